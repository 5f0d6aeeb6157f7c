"""launch/titan/data.py and launch/titan/validation.py without a training launch: corpus
folders as torchtitan datasets, the checks before launch, the validation batches and the
validator's bookkeeping (single process, seconds)."""

from __future__ import annotations

import contextlib
import functools
import gzip
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from launch.titan.data import (
    CORPUS_DATASET,
    TOKENIZER_DIR,
    check_data,
    data_source,
    load_jsonl_dataset,
    register_datasets,
    tokenizer_vocab_size,
    validation_batches,
)
from tests.corpus_files import sample_texts, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "c", sample_texts(30), sample_texts(20, offset=100))


@pytest.fixture(scope="module")
def tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(str(TOKENIZER_DIR))


def training(**kw):
    base = dict(dataset=CORPUS_DATASET, dataset_path=None, tokenizer_path=None, val_every=10,
                val_batches=2, seq_len=32, local_batch_size=2, steps=10)
    return SimpleNamespace(**{**base, **kw})


def test_corpus_folder_is_a_torchtitan_dataset(corpus):
    from torchtitan.hf_datasets.text_datasets import DATASETS

    register_datasets()
    config = DATASETS[CORPUS_DATASET]
    ds = config.loader(str(corpus))  # training.dataset_path names the folder: its train split
    assert [config.sample_processor(row) for row in ds] == sample_texts(30)
    assert load_jsonl_dataset(str(corpus / "validation.jsonl.gz"))["text"] == sample_texts(20, offset=100)
    src = data_source(CORPUS_DATASET, str(corpus), None)
    assert src.tokenizer == corpus / "tokenizer" and src.validation == corpus / "validation.jsonl.gz"
    assert data_source("mxfp8ep_tiny", None, None).validation is None


def test_check_data_accepts_a_corpus(corpus):
    errors, warnings = check_data(training(dataset_path=str(corpus)), model_vocab=512, dp_degree=2)
    assert errors == [] and warnings == []


@pytest.mark.parametrize("change, message", [
    (dict(dataset="debain_docs"), "training.dataset='debain_docs': did you mean training.dataset=debian_docs?"),
    (dict(dataset_path="/no/such/corpus"), "build it with `python scripts/build_corpus.py --out /no/such/corpus`"),
    (dict(dataset="mxfp8ep_tiny"), "has no validation split; use training.dataset=debian_docs or training.val_every=0"),
    (dict(val_batches=0), "val_batches >= 1"),
    (dict(val_batches=10_000), "use training.val_batches="),
    (dict(tokenizer_path="/no/such/tok"), "training.tokenizer_path=/no/such/tok: no such directory"),
])
def test_check_data_errors(corpus, change, message):
    errors, _ = check_data(training(**{"dataset_path": str(corpus), **change}), model_vocab=512, dp_degree=2)
    assert len(errors) == 1 and message in errors[0], errors


def test_check_data_vocab_and_passes(corpus):
    errors, _ = check_data(training(dataset_path=str(corpus)), model_vocab=256, dp_degree=1)
    assert errors == [f"the tokenizer in {corpus / 'tokenizer'} has {tokenizer_vocab_size(TOKENIZER_DIR)} ids "
                      "but the model's vocabulary has 256: token ids would index past the embedding; "
                      f"use a model whose vocab_size is >= {tokenizer_vocab_size(TOKENIZER_DIR)} (the "
                      "parity_* models take the corpus tokenizer)"]
    _, warnings = check_data(training(dataset_path=str(corpus), steps=1000), model_vocab=512, dp_degree=1)
    assert len(warnings) == 1 and "reads the train split" in warnings[0]


def test_validation_batches_are_fixed_and_split_over_ranks(corpus, tokenizer):
    path = corpus / "validation.jsonl.gz"
    shape = dict(batches=3, batch_size=2, seq_len=16)
    one = validation_batches(path, tokenizer, **shape, dp_rank=0, dp_degree=1)
    again = validation_batches(path, tokenizer, **shape)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one, again))
    assert len(one) == 3 and one[0][0].shape == (2, 16)
    # labels are the inputs shifted by one token, windows follow each other in the text
    tokens = []
    for text in sample_texts(20, offset=100):
        tokens += tokenizer.encode(text, add_bos=True, add_eos=True)
    x, y = one[0]
    assert x[0].tolist() == tokens[:16] and y[0].tolist() == tokens[1:17]
    assert x[1].tolist() == tokens[17:33]
    # two ranks with batch 1 each score the same windows as one rank with batch 2
    halves = [validation_batches(path, tokenizer, batches=3, batch_size=1, seq_len=16, dp_rank=r, dp_degree=2)
              for r in range(2)]
    for i in range(3):
        assert torch.equal(torch.cat([halves[0][i][0], halves[1][i][0]]), one[i][0])
    with pytest.raises(ValueError, match="lower training.val_batches"):
        validation_batches(path, tokenizer, batches=10_000, batch_size=2, seq_len=16)


class _Recorder:
    def __init__(self):
        self.calls = []

    def log_validation(self, loss, step, seconds=0.0):
        self.calls.append((loss, step, seconds))


class _TinyLM(torch.nn.Module):
    """Embedding + linear head with an MoE-style token counter buffer."""

    def __init__(self, vocab: int):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, 16)
        self.head = torch.nn.Linear(16, vocab)
        self.register_buffer("tokens_per_expert", torch.zeros(4))

    def forward(self, x):
        self.tokens_per_expert.add_(1.0)  # what the router does in every forward
        return self.head(self.emb(x))


def test_held_out_loss_scores_the_same_tokens_and_leaves_training_alone(corpus, tokenizer):
    from torchtitan.components.loss import cross_entropy_loss

    from launch.titan.titan022 import RecipeTrainer
    from launch.titan.validation import HeldOutLoss

    model = _TinyLM(tokenizer_vocab_size(TOKENIZER_DIR))
    model.tokens_per_expert.fill_(7.0)
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(training=SimpleNamespace(steps=25, local_batch_size=2, seq_len=16)),
        parallel_dims=SimpleNamespace(dp_enabled=False), tokenizer=tokenizer, device=torch.device("cpu"),
        post_dataloading_process=lambda d, labels: (d["input"], labels, {}, {}),
        train_context=contextlib.nullcontext, maybe_enable_amp=contextlib.nullcontext(),
        loss_fn=cross_entropy_loss, metrics_processor=_Recorder())
    # the 0.2.2 trainer's loss of a held-out batch, over this trainer's pieces
    trainer.held_out_loss = functools.partial(RecipeTrainer.held_out_loss, trainer)
    v = HeldOutLoss(trainer, corpus / "validation.jsonl.gz", every=10, batches=3)
    assert [s for s in range(1, 26) if v.should_validate(s)] == [10, 20, 25]  # and the last step
    v.validate([model], 10)
    v.validate([model], 20)
    (l1, s1, t1), (l2, s2, _) = trainer.metrics_processor.calls
    assert (s1, s2) == (10, 20) and l1 == l2 and t1 > 0
    with torch.no_grad():
        logits = torch.cat([model.head(model.emb(x)) for x, _ in v.batches])
        labels = torch.cat([y for _, y in v.batches])
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert l1 == pytest.approx(expected.item(), rel=1e-6)
    assert model.training and model.tokens_per_expert.tolist() == [7.0] * 4


@pytest.mark.parametrize("lines, problem", [
    (['{"foo": 1}'], 'line 1 has no "text" field (its fields: foo)'),
    (["not json"], "line 1 is not JSON (Expecting value: line 1 column 1 (char 0))"),
    (['{"text": "a"}', "", '[1, 2]'], "line 3 is a JSON array, not an object"),
    (['{"text": 3}'], 'line 1\'s "text" is a JSON number, not a string'),
    ([], "holds no records (an empty file)"),
], ids=["no_text_field", "not_json", "not_an_object", "text_not_a_string", "empty"])
def test_a_dataset_whose_first_records_the_loader_cannot_read_is_refused(tmp_path, lines, problem):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    errors, _ = check_data(training(dataset="mxfp8ep_tiny", dataset_path=str(data), val_every=0),
                           model_vocab=512, dp_degree=2)
    assert errors == [f"training.dataset_path={data}: {problem}; training.dataset=mxfp8ep_tiny reads one JSON "
                      f'object per line, the document in its "text" field (a string)'], errors


def test_a_corpus_whose_splits_are_not_gzipped_records_is_refused(tmp_path):
    corpus = write_corpus(tmp_path / "c", sample_texts(4), sample_texts(4, offset=10), manifest=False)
    (corpus / "train.jsonl.gz").write_bytes(b"plain text, not gzip")
    (errors, _) = check_data(training(dataset_path=str(corpus)), model_vocab=512, dp_degree=2)
    assert len(errors) == 1 and errors[0].startswith(
        f"training.dataset_path={corpus} (train.jsonl.gz): cannot be read as gzip-compressed text (Not a gzipped file")
    (corpus / "train.jsonl.gz").unlink()
    write_corpus(corpus, sample_texts(4), ["x"], manifest=False)
    with gzip.open(corpus / "validation.jsonl.gz", "wt") as f:
        f.write('{"body": "no text field"}\n')
    (errors, _) = check_data(training(dataset_path=str(corpus)), model_vocab=512, dp_degree=2)
    assert errors == [f"training.val_every=10: the validation split {corpus / 'validation.jsonl.gz'}: line 1 has "
                      f'no "text" field (its fields: body); training.dataset=debian_docs reads one JSON object '
                      f'per line, the document in its "text" field (a string)']


def test_a_local_c4_is_checked_as_torchtitan_loads_it(tmp_path):
    """training.dataset=c4 with a folder: torchtitan runs load_dataset(folder, name="en"), which
    needs allenai/c4's README.md (its configs define "en") and the split's en/*.json.gz files."""
    errors, _ = check_data(training(dataset="c4", dataset_path=str(tmp_path), val_every=0), model_vocab=512,
                           dp_degree=2)
    assert errors == [
        f"training.dataset_path={tmp_path} has no README.md defining the config en and no en/c4-train.*.json.gz "
        f"files: training.dataset=c4 reads a local copy of the Hugging Face dataset allenai/c4 (e.g. `hf download "
        f"allenai/c4 --repo-type dataset --include 'en/c4-train.0000*-of-01024.json.gz' README.md --local-dir "
        f"{tmp_path}`)"]
    (tmp_path / "README.md").write_text("---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n"
                                        "    path: en/c4-train.*.json.gz\n---\n")
    (tmp_path / "en").mkdir()
    with gzip.open(tmp_path / "en" / "c4-train.00000-of-01024.json.gz", "wt") as f:
        f.write('{"text": "a document", "url": "u", "timestamp": "t"}\n')
    assert check_data(training(dataset="c4", dataset_path=str(tmp_path), val_every=0), model_vocab=512,
                      dp_degree=2) == ([], [])
    from datasets import load_dataset  # what torchtitan's c4 loader does with it

    assert next(iter(load_dataset(str(tmp_path), name="en", split="train", streaming=True)))["text"] == "a document"


def test_every_line_of_a_dataset_is_checked_and_each_rank_needs_a_record(tmp_path):
    """A bad line past the first few, and fewer records than data-parallel ranks (torchtitan's
    split of them raised IndexError at start-up), are refused before launch with file and line."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n' * 300 + "not json\n")
    tail = '; training.dataset=mxfp8ep_tiny reads one JSON object per line, the document in its "text" field (a string)'
    errors, _ = check_data(training(dataset="mxfp8ep_tiny", dataset_path=str(data), val_every=0),
                           model_vocab=512, dp_degree=2)
    assert errors == [f"training.dataset_path={data}: line 301 is not JSON (Expecting value: line 1 column 1 "
                      f"(char 0)){tail}"]
    with pytest.raises(ValueError, match=f"^{data}: line 301 is not JSON"):  # what a worker says at run time
        load_jsonl_dataset(str(data))
    data.write_text('{"text": "a"}\n')
    errors, _ = check_data(training(dataset="mxfp8ep_tiny", dataset_path=str(data), val_every=0),
                           model_vocab=512, dp_degree=2)
    assert errors == [f"training.dataset_path={data}: holds 1 record(s), fewer than the 2 data-parallel ranks "
                      f"that each read their own share of them{tail}"]
