"""The ``mxfp8_ep.titan030.token_dispatcher`` override on torchtitan 0.3.0's own configs, parsed
from the command line the way ``torchtitan.train`` parses it, and applied the way its trainer
applies overrides (after ``update_from_config``, before any build)."""

from __future__ import annotations

import pytest

titan030 = pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

from torchtitan.components.quantization.utils import swap_token_dispatcher  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.config.override import apply_overrides  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: E402
from torchtitan.models.common.token_dispatcher import (  # noqa: E402
    AllToAllTokenDispatcher,
    LocalTokenDispatcher,
    MinimalAsyncEPTokenDispatcher,
    TorchAOTokenDispatcher,
)

from mxfp8_ep.config import A2AConfig  # noqa: E402

OVERRIDE = "mxfp8_ep.titan030.token_dispatcher"


def trainer_config(module: str, config: str, *extra: str, kwargs: str = '{"preset": "mxfp8", "transport": "auto"}'):
    """``torchtitan.train``'s parse, then what its Trainer does before building the model."""
    cfg = ConfigManager().parse_args([
        "--module", module, "--config", config,
        "--parallelism.expert_parallel_degree", "2", "--training.disable_cuda_graphs",
        "--override.imports", f"{OVERRIDE}={kwargs}", *extra,
    ])
    cfg.model_spec.model.update_from_config(config=cfg)
    return cfg


def dispatcher_configs(cfg):
    return [(fqn, c) for fqn, c, _, _ in cfg.model_spec.model.traverse(LocalTokenDispatcher.Config)]


@pytest.mark.parametrize("config", ["deepseek_v3_debugmodel", "deepseek_v3_debugmodel_mtp"])
def test_override_replaces_the_dispatcher_of_every_moe_layer(config):
    cfg = trainer_config("deepseek_v3", config)
    before = dispatcher_configs(cfg)
    assert before and all(type(c) is AllToAllTokenDispatcher.Config for _, c in before)
    apply_overrides(cfg.override, cfg)
    cfg._validate_cuda_graphs()  # the trainer's check right after the overrides

    after = dispatcher_configs(cfg)
    assert [fqn for fqn, _ in after] == [fqn for fqn, _ in before]
    moe_layers = [layer for layer in (*cfg.model_spec.model.layers, *cfg.model_spec.model.mtp_layers) if layer.moe]
    assert len(after) == len(moe_layers) > 0
    for (fqn, new), (_, old) in zip(after, before):
        assert type(new) is titan030.A2ATokenDispatcher.Config, fqn
        assert (new.num_experts, new.top_k) == (old.num_experts, old.top_k), fqn
        assert new.a2a == A2AConfig.preset("mxfp8", transport="auto"), fqn
    built = after[0][1].build()
    assert isinstance(built, titan030.A2ATokenDispatcher) and isinstance(built, AllToAllTokenDispatcher)
    experts = [c for _, c, _, _ in cfg.model_spec.model.traverse(GroupedExperts.Config)]
    assert len(experts) == len(moe_layers), "one routed-experts config per MoE layer"
    assert all(type(c) is titan030.ValidRowGroupedExperts.Config for c in experts)
    assert isinstance(experts[0].build(), titan030.ValidRowGroupedExperts)


def test_override_keeps_the_padding_of_the_grouped_gemm_converters():
    """0.3.0's MXFP8 / FP8 grouped-GEMM converters swap in TorchAOTokenDispatcher with their pad
    multiple (``swap_token_dispatcher``; the converters themselves refuse to build without an
    SM100 / SM89 GPU). The override keeps that padding."""
    cfg = trainer_config("deepseek_v3", "deepseek_v3_debugmodel", kwargs='{"preset": "mxfp8_all", "transport": "symm"}')
    for _, routed, _, _ in cfg.model_spec.model.traverse(RoutedExperts.Config):
        swap_token_dispatcher(routed, 128)
    apply_overrides(cfg.override, cfg)

    after = dispatcher_configs(cfg)
    assert after
    for fqn, new in after:
        assert type(new) is titan030.PaddedA2ATokenDispatcher.Config, fqn
        assert isinstance(new, TorchAOTokenDispatcher.Config) and new.pad_multiple == 128, fqn
        assert new.a2a == A2AConfig.preset("mxfp8_all", transport="symm"), fqn
    built = after[0][1].build()
    assert isinstance(built, TorchAOTokenDispatcher) and built.pad_multiple == built.segment_pad_multiple == 128


def test_override_keeps_a_per_rank_token_capacity():
    """Sync-free 0.3.0 dispatchers carry the per-rank token capacity (filled in by
    ``update_from_config``); ours keeps it (symm buffers are sized by it); an explicit
    max_tokens_per_rank wins."""
    capped = MinimalAsyncEPTokenDispatcher.Config(num_experts=8, top_k=2, num_max_tokens_per_rank=16384)
    assert titan030.replacement_config(capped, A2AConfig()).max_tokens_per_rank == 16384
    assert titan030.replacement_config(capped, A2AConfig(), 4096).max_tokens_per_rank == 4096
    plain = AllToAllTokenDispatcher.Config(num_experts=8, top_k=2)
    assert titan030.replacement_config(plain, A2AConfig()).max_tokens_per_rank is None


def test_override_says_when_the_model_has_no_moe():
    cfg = trainer_config("llama3", "llama3_debugmodel")
    with pytest.raises(ValueError, match="found no MoE layer"):
        apply_overrides(cfg.override, cfg)


@pytest.mark.parametrize("kwargs, message", [
    ('{"preset": "fp4"}', "unknown a2a preset"),
    ('{"preset": "mxfp8", "dispatch": "bf16"}', r"unknown keys \['dispatch'\]"),
    ('{"preset": "mxfp8", "transport": "nvshmem"}', "A2AConfig.transport"),
])
def test_override_rejects_bad_kwargs(kwargs, message):
    cfg = trainer_config("deepseek_v3", "deepseek_v3_debugmodel", kwargs=kwargs)
    with pytest.raises(ValueError, match=message):
        apply_overrides(cfg.override, cfg)


@pytest.mark.parametrize("cls", ["A2ATokenDispatcher", "PaddedA2ATokenDispatcher"])
def test_dispatcher_says_it_needs_expert_parallelism(cls):
    """EP=1: 0.3.0 wires no EP mesh (wire_meshes(None) with TP, no call at all without)."""
    config_cls = getattr(titan030, cls).Config
    kwargs = {"pad_multiple": 32} if cls.startswith("Padded") else {}
    with pytest.raises(ValueError, match="expert_parallel_degree > 1"):
        config_cls(num_experts=8, top_k=2, **kwargs).build().wire_meshes(ep_mesh=None)
    import torch

    unwired = config_cls(num_experts=8, top_k=2, **kwargs).build()
    x, ids = torch.zeros(4, 64), torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="expert_parallel_degree > 1"):
        unwired.dispatch(x, torch.ones(4, 2), ids, torch.bincount(ids.view(-1), minlength=8))


def test_override_makes_the_trainer_replay_an_overflowed_step():
    """With the symm transport possible at an elastic capacity, torchtitan's Trainer (built by
    0.3.0's entry point from its config) runs an overflowed step again: the override wraps its
    train_step and forward_backward_step (mxfp8_ep.elastic.install_replays)."""
    from torchtitan.trainer import Trainer

    cfg = trainer_config("deepseek_v3", "deepseek_v3_debugmodel")
    apply_overrides(cfg.override, cfg)
    assert Trainer.replays_overflowed_steps
    assert Trainer.train_step.__wrapped__.__qualname__ == "Trainer.train_step"
    assert Trainer.forward_backward_step.__wrapped__.__qualname__ == "Trainer.forward_backward_step"
