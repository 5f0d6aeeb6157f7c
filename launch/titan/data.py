"""The recipe's datasets, registered with torchtitan 0.2.2, and the validation batches.

torchtitan finds datasets by name in ``torchtitan.hf_datasets.text_datasets.DATASETS``; the
wheel only knows c4 (a download). :func:`register_datasets` adds ours, each read into an
in-memory HF ``Dataset`` (no HF cache directory, no network, nothing two ranks could race on;
being map-style, torchtitan checkpoints the position by sample index, so resumed runs
continue where they stopped):

* ``mxfp8ep_tiny`` (the default): ``launch/titan/assets/tiny_text.jsonl`` and the 512-id tokenizer
  next to it, written by ``scripts/build_tiny_assets.py``. No validation split.
* ``debian_docs``: a corpus folder written by ``scripts/build_corpus.py`` (default
  ``data/corpus/``): ``train.jsonl.gz``, ``validation.jsonl.gz``, ``tokenizer/`` and
  ``manifest.json``. ``training.dataset_path`` names the folder; the tokenizer defaults to the
  one inside it.

:func:`validation_batches` cuts the validation split into the same token windows on every
run that has the same batch shape, so every arm of a comparison is scored on the same tokens.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from launch.config.problems import choice_problem

__all__ = [
    "ASSETS_DIR",
    "CORPUS_DATASET",
    "CORPUS_DIR",
    "CORPUS_FILES",
    "DATASET_PATHS",
    "DataSource",
    "TINY_DATASET",
    "TINY_TEXT",
    "TOKENIZER_DIR",
    "TOKENIZER_FILES",
    "check_data",
    "corpus_provenance",
    "corpus_sha256",
    "data_source",
    "load_jsonl_dataset",
    "register_datasets",
    "tokenizer_vocab_size",
    "validation_batches",
]

REPO = Path(__file__).resolve().parents[2]
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TINY_TEXT = ASSETS_DIR / "tiny_text.jsonl"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
TINY_DATASET = "mxfp8ep_tiny"
CORPUS_DATASET = "debian_docs"
# The datasets read with load_jsonl_dataset (register_datasets).
JSONL_DATASETS = (TINY_DATASET, CORPUS_DATASET)
CORPUS_DIR = REPO / "data" / "corpus"


@dataclass(frozen=True)
class CorpusFiles:
    """What ``scripts/build_corpus.py`` writes into a corpus folder."""

    train: str = "train.jsonl.gz"
    validation: str = "validation.jsonl.gz"
    tokenizer: str = "tokenizer"
    manifest: str = "manifest.json"
    licenses: str = "licenses"


CORPUS_FILES = CorpusFiles()
# The datasets training.dataset may name and where each reads from without
# training.dataset_path: torchtitan 0.2.2's (a Hugging Face hub id or a path) plus ours.
# tests/test_titan_models.py checks this against torchtitan's DATASETS.
DATASET_PATHS = {
    "c4": "allenai/c4",
    "c4_test": "tests/assets/c4_test",
    "c4_validation": "allenai/c4",
    TINY_DATASET: str(TINY_TEXT),
    CORPUS_DATASET: str(CORPUS_DIR),
}
# torchtitan's c4 datasets from a local copy of allenai/c4: the split's files in it.
C4_FILES = {"c4": "en/c4-train.*.json.gz", "c4_validation": "en/c4-validation.*.json.gz"}
# Fetching the first 10 of c4's 1,024 training files and the README that defines "en".
C4_DOWNLOAD = ("hf download allenai/c4 --repo-type dataset --include 'en/c4-train.0000*-of-01024.json.gz' "
               "README.md --local-dir {path}")
# What torchtitan's HuggingFaceTokenizer loads from a tokenizer directory (one of them).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
BUILD_CORPUS = "python scripts/build_corpus.py"


# ------------------------------------------------------------------------------ identity
def corpus_sha256(files: dict[str, dict]) -> str:
    """A corpus folder's digest: SHA-256 of its files' names and SHA-256s (``files``: relative
    path -> {"sha256": ...}, the manifest's ``files``), in name order. Equal digests, equal files."""
    lines = "".join(f"{name} {files[name]['sha256']}\n" for name in sorted(files))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def corpus_provenance(corpus: str | Path) -> dict[str, Any]:
    """What a result trained on this corpus folder records of it, from its manifest: the corpus's
    ``sha256`` and the Debian package versions it was built from (``{"corpus_sha256": None}``
    when the folder has no manifest that says)."""
    path = Path(corpus) / CORPUS_FILES.manifest
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    packages = {p["package"]: p.get("version") for p in manifest.get("packages", [])}
    return {"corpus_sha256": manifest.get("sha256"), "corpus_packages": packages or None}


# ------------------------------------------------------------------------------ reading
def _open_text(path: str | Path) -> Any:
    path = str(path)
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def iter_texts(path: str | Path) -> Iterator[str]:
    """The ``text`` of every row of a ``.jsonl`` or ``.jsonl.gz`` file, in order. A row that is
    not a document raises ``ValueError`` naming the file and its line."""
    with _open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                text, problem = _read_record(number, line)
                if problem is not None:
                    raise ValueError(f"{path}: {problem}; a dataset file holds {RECORD_FORMAT}")
                yield text


def jsonl_file(path: str | Path) -> Path:
    """The file :func:`load_jsonl_dataset` reads for ``path``: the file itself, or a corpus
    folder's train split."""
    p = Path(path)
    return p / CORPUS_FILES.train if p.is_dir() else p


def load_jsonl_dataset(path: str) -> Any:
    """A ``.jsonl`` / ``.jsonl.gz`` file, or a corpus folder's train split, as an in-memory
    ``datasets.Dataset`` with one column, ``text``."""
    from datasets import Dataset

    return Dataset.from_dict({"text": list(iter_texts(jsonl_file(path)))})


# What the records of a .jsonl dataset must be (the loader's reading of them), for the messages.
RECORD_FORMAT = 'one JSON object per line, the document in its "text" field (a string)'
# Files up to this size are read whole by the check before launch (every line, and the record
# count against the data-parallel ranks); of larger ones it reads the first CHECKED_RECORDS.
WHOLE_FILE_CHECK_BYTES = 64 << 20
CHECKED_RECORDS = 3


def _json_type(value: Any) -> str:
    """JSON's name for the type of a decoded value."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _read_record(number: int, line: str) -> tuple[Optional[str], Optional[str]]:
    """Line ``number`` of a dataset: ``(its text, None)``, or ``(None, what is wrong with it)``."""
    try:
        record = json.loads(line)
    except ValueError as e:
        return None, f"line {number} is not JSON ({e})"
    if not isinstance(record, dict):
        return None, f"line {number} is a JSON {_json_type(record)}, not an object"
    if "text" not in record:
        keys = ", ".join(sorted(map(str, record))) or "none"
        return None, f'line {number} has no "text" field (its fields: {keys})'
    if not isinstance(record["text"], str):
        return None, f'line {number}\'s "text" is a JSON {_json_type(record["text"])}, not a string'
    return record["text"], None


def records_problem(path: Path, *, at_least: int = 1) -> Optional[str]:
    """What is wrong with a ``.jsonl`` / ``.jsonl.gz`` file for :func:`iter_texts` (None: it
    reads as documents): every record of a file up to :data:`WHOLE_FILE_CHECK_BYTES`, which must
    hold ``at_least`` records (torchtitan gives each data-parallel rank its own share of them),
    and the first :data:`CHECKED_RECORDS` of a larger one. So a malformed dataset is refused
    before launch instead of failing every worker after start-up."""
    whole = Path(path).stat().st_size <= WHOLE_FILE_CHECK_BYTES
    seen = 0
    try:
        with _open_text(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                problem = _read_record(number, line)[1]
                if problem is not None:
                    return problem
                seen += 1
                if not whole and seen == CHECKED_RECORDS:
                    return None
    except (OSError, EOFError, UnicodeDecodeError) as e:  # not gzip, a truncated gzip, binary data
        return f"cannot be read as {'gzip-compressed ' if str(path).endswith('.gz') else ''}text ({e})"
    if not seen:
        return "holds no records (an empty file)"
    if seen < at_least:
        return (f"holds {seen} record(s), fewer than the {at_least} data-parallel ranks that each read "
                f"their own share of them")
    return None


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Register ``mxfp8ep_tiny`` and ``debian_docs`` with torchtitan (overwrites: idempotent).
    ``training.dataset_path`` in the job config still overrides the path per run."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    for name in JSONL_DATASETS:
        DATASETS[name] = DatasetConfig(path=DATASET_PATHS[name], loader=load_jsonl_dataset,
                                       sample_processor=_text)


# ------------------------------------------------------------------------------ paths
@dataclass(frozen=True)
class DataSource:
    """Where one run's data comes from."""

    dataset: str
    path: str  # what torchtitan's loader gets: a file, a corpus folder or a hub id
    tokenizer: Path
    validation: Optional[Path]  # the held-out split, when the dataset has one
    manifest: Optional[Path]  # build_corpus.py's manifest, for corpus folders


def data_source(dataset: str, dataset_path: Optional[str], tokenizer_path: Optional[str]) -> DataSource:
    """Resolve ``training.dataset`` / ``dataset_path`` / ``tokenizer_path`` (None: the
    dataset's defaults). Unknown names raise ``KeyError``."""
    path = dataset_path or DATASET_PATHS[dataset]
    if dataset == CORPUS_DATASET:
        root = Path(path)
        return DataSource(dataset, str(root), Path(tokenizer_path) if tokenizer_path else root / CORPUS_FILES.tokenizer,
                          root / CORPUS_FILES.validation, root / CORPUS_FILES.manifest)
    return DataSource(dataset, path, Path(tokenizer_path) if tokenizer_path else TOKENIZER_DIR, None, None)


def tokenizer_vocab_size(tokenizer_dir: Path) -> Optional[int]:
    """Largest token id + 1 of a ``tokenizer.json`` (None when the folder has none)."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    tok = json.loads(path.read_text(encoding="utf-8"))
    ids = list(tok.get("model", {}).get("vocab", {}).values()) + [t["id"] for t in tok.get("added_tokens", [])]
    return max(ids) + 1 if ids else None


def check_data(t: Any, *, model_vocab: Optional[int], dp_degree: Optional[int]) -> tuple[list[str], list[str]]:
    """Errors and warnings about ``cfg.training``'s data before launch: the dataset name,
    its files, the tokenizer against the model's vocabulary, and whether the validation
    split holds ``val_batches`` batches (``dp_degree``: data-parallel ranks)."""
    errors: list[str] = []
    warnings: list[str] = []
    if t.dataset not in DATASET_PATHS:
        errors.append(f"{choice_problem('training.dataset', t.dataset, sorted(DATASET_PATHS))} (with "
                      f"training.dataset_path=<local copy> for c4)")
        return errors, warnings
    src = data_source(t.dataset, t.dataset_path, t.tokenizer_path)
    if t.dataset in C4_FILES and not src.path.startswith("allenai/"):
        _check_c4(t.dataset, src.path, errors)
    elif src.path.startswith("allenai/"):
        warnings.append(f"training.dataset={t.dataset} without training.dataset_path downloads {src.path} "
                        f"from the Hugging Face hub at start; set training.dataset_path to a local copy")
    elif t.dataset == CORPUS_DATASET:
        if not (Path(src.path) / CORPUS_FILES.train).is_file():
            # One message: the tokenizer and validation split would be missing with it.
            errors.append(f"training.dataset_path={src.path}: no {CORPUS_FILES.train} there (training.dataset="
                          f"{t.dataset} reads a corpus folder); build it with `{BUILD_CORPUS} --out {src.path}`")
            return errors, warnings
    elif not Path(src.path).exists():
        errors.append(f"training.dataset_path={src.path}: no such file or directory (training.dataset="
                      f"{t.dataset})")
    if t.dataset in JSONL_DATASETS and Path(src.path).exists():
        data = jsonl_file(src.path)
        shown = f"training.dataset_path={src.path}" + (f" ({data.name})" if data != Path(src.path) else "")
        if not data.is_file():
            errors.append(f"{shown}: no such file (a folder given to training.dataset={t.dataset} is read as "
                          f"a corpus folder, its train split in {CORPUS_FILES.train})")
        else:
            _check_records(shown, t.dataset, data, errors, at_least=dp_degree or 1)

    tokenizer = src.tokenizer
    if not tokenizer.is_dir():
        errors.append(f"training.tokenizer_path={tokenizer}: no such directory (point it at the model's "
                      f"Hugging Face tokenizer files)")
    elif not any((tokenizer / name).is_file() for name in TOKENIZER_FILES):
        errors.append(f"training.tokenizer_path={tokenizer} has none of {list(TOKENIZER_FILES)}, which "
                      f"torchtitan's tokenizer loads")
    else:
        vocab = tokenizer_vocab_size(tokenizer)
        if vocab is not None and model_vocab is not None and vocab > model_vocab:
            errors.append(f"the tokenizer in {tokenizer} has {vocab} ids but the model's vocabulary has "
                          f"{model_vocab}: token ids would index past the embedding; use a model whose "
                          f"vocab_size is >= {vocab} (the parity_* models take the corpus tokenizer)")

    if t.val_every < 0 or t.val_batches < 1:
        errors.append(f"training.val_every={t.val_every}, training.val_batches={t.val_batches}: "
                      f"val_every is 0 (off) or a step interval, val_batches >= 1")
    elif t.val_every > 0 and src.validation is None:
        errors.append(f"training.val_every={t.val_every} but training.dataset={t.dataset} has no "
                      f"validation split; use training.dataset={CORPUS_DATASET} or training.val_every=0")
    elif t.val_every > 0 and not src.validation.is_file():
        errors.append(f"training.val_every={t.val_every}: no validation split {src.validation}; "
                      f"build the corpus with `{BUILD_CORPUS} --out {src.path}`")
    elif t.val_every > 0:
        _check_records(f"training.val_every={t.val_every}: the validation split {src.validation}", t.dataset,
                       src.validation, errors)
    # The manifest counts tokens with the corpus's own tokenizer.
    if dp_degree and src.manifest is not None and src.manifest.is_file() and t.tokenizer_path is None:
        _check_split_sizes(t, json.loads(src.manifest.read_text()).get("splits", {}), dp_degree,
                           errors, warnings)
    return errors, warnings


def _check_c4(dataset: str, path: str, errors: list[str]) -> None:
    """A local copy of the Hugging Face dataset allenai/c4, as torchtitan loads it
    (``load_dataset(path, name="en")``): the repository's README.md, whose ``configs`` define
    "en", and the split's ``en/*.json.gz`` files; their first records must carry ``text``."""
    root = Path(path)
    files = sorted(root.glob(C4_FILES[dataset])) if root.is_dir() else []
    readme = root / "README.md"
    has_en = readme.is_file() and "config_name: en" in readme.read_text(errors="replace")
    if not files or not has_en:
        missing = " and no ".join(what for what, ok in (("README.md defining the config en", has_en),
                                                         (f"{C4_FILES[dataset]} files", files)) if not ok)
        errors.append(f"training.dataset_path={path} has no {missing}: training.dataset={dataset} reads a local copy "
                      f"of the Hugging Face dataset allenai/c4 (e.g. `{C4_DOWNLOAD.format(path=path)}`)")
        return
    _check_records(f"training.dataset_path={path} ({files[0].relative_to(root)})", dataset, files[0], errors)


def _check_records(shown: str, dataset: str, path: Path, errors: list[str], at_least: int = 1) -> None:
    problem = records_problem(path, at_least=at_least)
    if problem is not None:
        errors.append(f"{shown}: {problem}; training.dataset={dataset} reads {RECORD_FORMAT}")


def _check_split_sizes(t: Any, splits: dict, dp_degree: int, errors: list[str], warnings: list[str]) -> None:
    """The validation tokens the batches need against the split's count; passes over train."""
    window = t.seq_len + 1
    per_batch = dp_degree * t.local_batch_size * window
    have = splits.get("validation", {}).get("tokens")
    if t.val_every > 0 and have is not None and t.val_batches * per_batch > have:
        errors.append(f"training.val_batches={t.val_batches} × {dp_degree} data-parallel ranks × "
                      f"local_batch_size {t.local_batch_size} × (seq_len+1) {window} = "
                      f"{t.val_batches * per_batch:,} tokens, but the validation split has {have:,}; "
                      f"use training.val_batches={max(1, have // per_batch)} or fewer")
    train_tokens = splits.get("train", {}).get("tokens")
    if train_tokens and t.steps > 0:
        passes = t.steps * per_batch / train_tokens
        if passes > 1:
            warnings.append(f"training.steps={t.steps} reads the train split {passes:.2f} times "
                            f"({train_tokens:,} tokens): later passes repeat what the model has seen")


# ------------------------------------------------------------------------------ validation
def validation_batches(path: Path, tokenizer: Any, *, batches: int, batch_size: int, seq_len: int,
                       dp_rank: int = 0, dp_degree: int = 1) -> list[tuple[Any, Any]]:
    """This rank's ``batches`` validation batches, ``(input, labels)`` of shape
    ``(batch_size, seq_len)``.

    The split's documents are tokenized in file order as torchtitan tokenizes training text
    (BOS and EOS around each), concatenated and cut into windows of ``seq_len + 1`` tokens;
    global batch ``i`` is windows ``i*G .. (i+1)*G`` (``G = dp_degree × batch_size``) and rank
    ``r`` takes its ``r``-th ``batch_size`` of them. Every run with the same global batch shape
    sees the same tokens, however the ranks are laid out.
    """
    import torch

    window = seq_len + 1
    need = batches * dp_degree * batch_size * window
    tokens: list[int] = []
    for text in iter_texts(path):
        tokens.extend(tokenizer.encode(text, add_bos=True, add_eos=True))
        if len(tokens) >= need:
            break
    if len(tokens) < need:
        raise ValueError(f"the validation split {path} has {len(tokens):,} tokens; {batches} batches of "
                         f"{dp_degree} × {batch_size} × {window} need {need:,}: lower training.val_batches")
    windows = torch.tensor(tokens[:need], dtype=torch.long).view(batches, dp_degree, batch_size, window)
    mine = windows[:, dp_rank]
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in mine]
