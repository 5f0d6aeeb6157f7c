"""Flavor mapping, the model facts table against torchtitan, tiny flavors, tiny
tokenizer/dataset assets (single process, seconds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from launch.config.model_facts import MODELS
from launch.titan import models as titan_models
from launch.titan.data import (
    DATASET_PATHS,
    TINY_DATASET,
    TINY_TEXT,
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    register_datasets,
)
from launch.titan.models import (
    CORPUS_VOCAB_SIZE,
    TINY_VOCAB_SIZE,
    UnknownModelError,
    facts_from_torchtitan,
    flavors_in_torchtitan,
    model_args,
    resolve,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "family, flavor, expected",
    [
        ("llama4", "tiny", ("llama4", "tiny")),
        ("llama4", "debugmodel", ("llama4", "debugmodel")),
        ("llama4", "17bx16e", ("llama4", "17bx16e")),
        ("llama4", "17bx128e", ("llama4", "17bx128e")),
        ("deepseek_v3", "tiny", ("deepseek_v3", "tiny")),
        ("deepseek_v3", "16B", ("deepseek_v3", "16B")),
        ("deepseek_v3", "16b", ("deepseek_v3", "16B")),
        ("deepseek_v3", "671B", ("deepseek_v3", "671B")),
        ("deepseek_v3", "debugmodel_flex_attn", ("deepseek_v3", "debugmodel_flex_attn")),
    ],
)
def test_resolve(family: str, flavor: str, expected: tuple[str, str]) -> None:
    assert resolve(family, flavor) == expected


@pytest.mark.parametrize("family, flavor", [("llama3", "8B"), ("llama4", "huge"), ("deepseek_v3", "7B"),
                                            ("dsv3", "debugmodel")])
def test_unknown_names_raise_key_and_value_error(family: str, flavor: str) -> None:
    with pytest.raises(KeyError):
        resolve(family, flavor)
    with pytest.raises(ValueError, match="unknown"):
        model_args(family, flavor)
    with pytest.raises(UnknownModelError):
        resolve(family, flavor)


def test_model_facts_table_is_what_torchtitan_builds() -> None:
    """launch/config/model_facts.py (what validation reads without torchtitan) has one row per
    flavor torchtitan ships plus ours, each equal to the model torchtitan builds."""
    assert sorted(flavors_in_torchtitan()) == sorted(MODELS)
    for family, flavor in MODELS:
        assert facts_from_torchtitan(family, flavor) == MODELS[family, flavor], (family, flavor)


def test_dataset_names_and_paths_are_torchtitans() -> None:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    register_datasets()
    assert {name: config.path for name, config in DATASETS.items()} == DATASET_PATHS
    assert any((TOKENIZER_DIR / name).is_file() for name in TOKENIZER_FILES)


@pytest.mark.parametrize("family", ["llama4", "deepseek_v3"])
def test_tiny_flavor_shapes(family: str) -> None:
    args = model_args(family, "tiny")
    assert 64 <= args.dim <= 128 and args.dim % 32 == 0
    assert args.n_layers == 2
    assert 4 <= args.moe_args.num_experts <= 8 and args.moe_args.num_experts % 2 == 0  # EP=2
    assert 1 <= args.moe_args.top_k <= 2
    assert args.vocab_size == TINY_VOCAB_SIZE
    if family == "llama4":
        assert args.interleave_moe_layer_step == 1  # MoE on every layer
    else:
        assert args.n_dense_layers == 0 and args.moe_inter_dim % 32 == 0


@pytest.mark.parametrize("family", ["llama4", "deepseek_v3"])
def test_parity_flavors_are_the_studys_models(family: str) -> None:
    """The parity study's models: >= 100M parameters, most of them routed experts, >= 16
    experts, a shared expert, top-k >= 4 for DeepSeek-V3 (Llama4 routes top-1), widths whole
    MXFP8 blocks, the corpus tokenizer's vocabulary."""
    facts = MODELS[family, "parity"]
    assert facts.params >= 100_000_000 and facts.expert_params > facts.params / 2
    assert facts.num_experts >= 16 and facts.num_shared_experts == 1
    assert facts.top_k >= (4 if family == "deepseek_v3" else 1)
    assert facts.dim % 32 == 0 and facts.moe_hidden_dim % 32 == 0
    assert facts.vocab_size == CORPUS_VOCAB_SIZE and facts.attention == "sdpa"
    tiny = MODELS["deepseek_v3", "parity_tiny"]
    assert tiny.vocab_size == CORPUS_VOCAB_SIZE and tiny.num_experts % 2 == 0 and tiny.top_k >= 4


def test_routing_study_flavor_routes_like_deepseek_v3_16b() -> None:
    """The capacity study's model: the 16B's experts, top-k, shared experts and router, the
    corpus vocabulary, a dense first layer and more than one MoE layer."""
    study, target = MODELS["deepseek_v3", "routing_study"], MODELS["deepseek_v3", "16B"]
    assert (study.num_experts, study.top_k, study.num_shared_experts) == (target.num_experts, target.top_k,
                                                                          target.num_shared_experts)
    routing = ("score_func", "route_norm", "route_scale", "score_before_experts", "load_balance_coeff",
               "num_expert_groups")
    study_moe = model_args("deepseek_v3", "routing_study").moe_args
    target_moe = model_args("deepseek_v3", "16B").moe_args
    assert {k: getattr(study_moe, k) for k in routing} == {k: getattr(target_moe, k) for k in routing}
    assert study.vocab_size == CORPUS_VOCAB_SIZE and study.n_layers - study.n_moe_layers == 1 < study.n_moe_layers


def test_model_args_is_a_private_copy() -> None:
    args = model_args("llama4", "tiny")
    args.dim = 7
    assert model_args("llama4", "tiny").dim == 128
    assert titan_models._flavor_dict("llama4")["tiny"].dim == 128


@pytest.mark.parametrize("family", ["llama4", "deepseek_v3"])
def test_tiny_model_forward_backward_on_cpu(family: str) -> None:
    """The tiny flavors build and train one step as plain modules (needs the CPU compat for
    the router's integer histc and DeepSeek-V3's moe_impl default)."""
    from torchtitan.protocols import train_spec

    from launch.titan.cpu_compat import apply_cpu_compat

    if not torch.cuda.is_available():
        apply_cpu_compat()
    args = model_args(family, "tiny")
    args.moe_args.use_grouped_mm = False  # what update_from_config does below SM90
    spec = train_spec.get_train_spec(family)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, args.vocab_size)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    assert torch.isfinite(loss)


def test_tokenizer_assets_load_in_torchtitan() -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(str(TOKENIZER_DIR))
    assert tok.get_vocab_size() <= TINY_VOCAB_SIZE
    assert tok.bos_id is not None and tok.eos_id is not None
    ids = tok.encode("Token 7 is routed to expert 3.", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert max(ids) < TINY_VOCAB_SIZE
    assert tok.decode(ids[1:-1]) == "Token 7 is routed to expert 3."


def test_tiny_dataset_registered_and_small() -> None:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    register_datasets()
    config = DATASETS[TINY_DATASET]
    assert Path(config.path) == TINY_TEXT
    assert TINY_TEXT.stat().st_size < 400 * 1024
    ds = config.loader(config.path)
    assert len(ds) > 100
    assert config.sample_processor(ds[0]).strip()


def test_asset_corpus_is_deterministic() -> None:
    spec = importlib.util.spec_from_file_location("build_tiny_assets", REPO / "scripts" / "build_tiny_assets.py")
    build_tiny_assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_tiny_assets)
    assert build_tiny_assets.ASSETS == TINY_TEXT.parent
    docs = build_tiny_assets.make_corpus(20)
    assert docs == build_tiny_assets.make_corpus(20)
    committed = TINY_TEXT.read_text().splitlines()[:20]
    import json

    assert [json.loads(line)["text"] for line in committed] == docs
