"""The recipe's models on torchtitan 0.3.0: torchtitan's DeepSeek-V3 and Qwen3 MoE flavors plus
the recipe's own, as 0.3.0 ``ModelSpec`` s (a model config built from its dataclasses, the
family's parallelize function, its load-balancing hook).

Ours (the same shapes as on torchtitan 0.2.2, ``launch.titan.models``):

* ``deepseek_v3``: ``tiny`` (CI's CPU model), ``parity_tiny`` and ``parity`` (the bf16-vs-MXFP8
  parity study's), ``ep_bench`` (full-width MoE layers for exchange benchmarks);
* ``qwen3``: ``tiny``: dim 128, 2 MoE layers of 8 experts (hidden 64), top-2, GQA 4/2 heads of
  32, vocab 512 (the tiny tokenizer).

torchtitan 0.3.0 builds every language model with flex attention over per-document masks, which
has no backward on CPU. Ours take ``F.scaled_dot_product_attention`` instead (causal over the
packed sequence, as the recipe's models attend on torchtitan 0.2.2; the trainer then leaves out
the per-document positions, ``launch.titan.titan030.trainer``), so they train on CPU processes;
torchtitan's flavors keep flex (GPUs only, checked before launch).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from launch.config.model_facts import ModelFacts, UnknownModelError, resolve
from launch.titan.models import CORPUS_VOCAB_SIZE, TINY_VOCAB_SIZE

__all__ = ["attention_of", "facts_from_torchtitan", "flavors_in_torchtitan", "model_spec"]

# torchtitan 0.3.0's MoE flavors the recipe trains (its dense Qwen3 flavors have no experts).
TITAN_FLAVORS = {
    "deepseek_v3": ("debugmodel", "16B", "236B", "671B"),
    "qwen3": ("debugmodel_moe", "30B-A3B", "235B-A22B"),
}


def _yarn_rope(max_seq_len: int) -> Any:
    """DeepSeek-V3's rotary embedding on the decoupled 32-wide (tiny) or 64-wide key part."""
    from torchtitan.models.common import ComplexRoPE

    return ComplexRoPE.Config(dim=32 if max_seq_len <= 2048 else 64, max_seq_len=max_seq_len, theta=10000.0,
                              scaling="yarn", rope_factor=40.0, beta_fast=32.0, beta_slow=1.0,
                              original_seq_len=4096)


def _deepseek_v3(*, vocab_size: int, dim: int, n_layers: int, n_dense_layers: int, n_heads: int,
                 dense_hidden_dim: int, moe_hidden_dim: int, num_experts: int, top_k: int, score_func: str,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 max_seq_len: int, mscale: float = 1.0, route_norm: bool = False, route_scale: float = 1.0) -> Any:
    """A DeepSeek-V3 model config (MLA without a query low-rank, one shared expert) the way
    torchtitan 0.3.0 builds its own flavors (``torchtitan.models.deepseek_v3``)."""
    from torchtitan.models import deepseek_v3 as ds
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    layers = ds._build_dsv3_layers(
        n_layers=n_layers, n_dense_layers=n_dense_layers, dim=dim, n_heads=n_heads, q_lora_rank=0,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim, mscale=mscale, dense_hidden_dim=dense_hidden_dim, moe_hidden_dim=moe_hidden_dim,
        num_experts=num_experts, num_shared_experts=1, router_top_k=top_k, router_score_func=score_func,
        router_route_norm=route_norm, router_route_scale=route_scale, attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=dataclasses.replace(_yarn_rope(max_seq_len), dim=qk_rope_head_dim))
    return ds.DeepSeekV3Model.Config(
        vocab_size=vocab_size, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init=ds._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=ds._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=ds._output_linear_init(dim)),
        layers=layers, mtp_layers=[])


def _tiny_deepseek_v3() -> Any:
    return _deepseek_v3(vocab_size=TINY_VOCAB_SIZE, dim=128, n_layers=2, n_dense_layers=0, n_heads=4,
                        dense_hidden_dim=256, moe_hidden_dim=64, num_experts=8, top_k=2, score_func="softmax",
                        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                        max_seq_len=2048, mscale=0.70)


def _parity_tiny_deepseek_v3() -> Any:
    return _deepseek_v3(vocab_size=CORPUS_VOCAB_SIZE, dim=128, n_layers=3, n_dense_layers=1, n_heads=4,
                        dense_hidden_dim=384, moe_hidden_dim=64, num_experts=16, top_k=4, score_func="sigmoid",
                        route_norm=True, route_scale=2.5, kv_lora_rank=64, qk_nope_head_dim=32,
                        qk_rope_head_dim=32, v_head_dim=32, max_seq_len=2048)


def _parity_deepseek_v3() -> Any:
    return _deepseek_v3(vocab_size=CORPUS_VOCAB_SIZE, dim=512, n_layers=8, n_dense_layers=1, n_heads=8,
                        dense_hidden_dim=1536, moe_hidden_dim=256, num_experts=32, top_k=4, score_func="sigmoid",
                        route_norm=True, route_scale=2.5, kv_lora_rank=128, qk_nope_head_dim=64,
                        qk_rope_head_dim=32, v_head_dim=64, max_seq_len=4096)


def _ep_bench_deepseek_v3() -> Any:
    return _deepseek_v3(vocab_size=TINY_VOCAB_SIZE, dim=7168, n_layers=2, n_dense_layers=0, n_heads=16,
                        dense_hidden_dim=18432, moe_hidden_dim=2048, num_experts=64, top_k=8, score_func="sigmoid",
                        route_norm=True, route_scale=2.5, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, max_seq_len=8192)


def _tiny_qwen3() -> Any:
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    dim, head_dim = 128, 32
    layers = qwen3._build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=64,
        num_experts=8, top_k=2, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=2048, theta=1000000.0))
    return qwen3.Qwen3Model.Config(
        vocab_size=TINY_VOCAB_SIZE, dim=dim, norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=TINY_VOCAB_SIZE, embedding_dim=dim,
                                        param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=TINY_VOCAB_SIZE, param_init=qwen3._LINEAR_INIT),
        layers=layers)


# The recipe's own flavors: their model configs, all with sdpa attention.
OUR_FLAVORS: dict[tuple[str, str], Callable[[], Any]] = {
    ("deepseek_v3", "tiny"): _tiny_deepseek_v3,
    ("deepseek_v3", "parity_tiny"): _parity_tiny_deepseek_v3,
    ("deepseek_v3", "parity"): _parity_deepseek_v3,
    ("deepseek_v3", "ep_bench"): _ep_bench_deepseek_v3,
    ("qwen3", "tiny"): _tiny_qwen3,
}


def _family(family: str) -> tuple[Any, Callable[..., Any], Callable]:
    """torchtitan 0.3.0's package of a family: (its ``model_registry``, its parallelize function)."""
    if family == "deepseek_v3":
        from torchtitan.models import deepseek_v3 as package

        return package.model_registry, package.parallelize_deepseekv3
    if family == "qwen3":
        from torchtitan.models import qwen3 as package

        return package.model_registry, package.parallelize_qwen3
    raise UnknownModelError(f"unknown model family {family!r} on torchtitan 0.3.0; known: {list(TITAN_FLAVORS)}")


def _with_sdpa(model: Any) -> Any:
    """``model`` (a 0.3.0 model config) with every flex attention replaced by sdpa."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _fqn, _cfg, parent, attr in list(model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return model


def model_spec(family: str, flavor: str) -> Any:
    """A fresh 0.3.0 ``ModelSpec`` for (family, flavor): torchtitan's own flavor as its registry
    builds it, or ours with sdpa attention."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.protocols.model_spec import ModelSpec

    family, flavor = resolve(family, flavor, torchtitan="0.3.0")
    registry, parallelize = _family(family)
    if (family, flavor) not in OUR_FLAVORS:
        return registry(flavor)
    return ModelSpec(name=family, flavor=flavor, model=_with_sdpa(OUR_FLAVORS[family, flavor]()),
                     parallelize_fn=parallelize, pipelining_fn=None,
                     post_optimizer_build_fn=register_moe_load_balancing_hook, state_dict_adapter=None)


def attention_of(model: Any) -> str:
    """``sdpa`` or ``flex``: the attention of a 0.3.0 model config."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    return "sdpa" if any(model.traverse(ScaledDotProductAttention.Config)) else "flex"


def flavors_in_torchtitan() -> list[tuple[str, str]]:
    """Every (family, flavor) the recipe trains on torchtitan 0.3.0: its MoE flavors and ours."""
    return [(family, flavor) for family, flavors in TITAN_FLAVORS.items() for flavor in flavors] + list(OUR_FLAVORS)


def facts_from_torchtitan(family: str, flavor: str) -> ModelFacts:
    """The row of ``launch.config.model_facts.MODELS_030`` for a flavor, computed from
    torchtitan 0.3.0: the model built on the meta device (no memory)."""
    import torch
    from torchtitan.models.common.attention import GQAttention
    from torchtitan.models.common.moe import MoE

    model_cfg = model_spec(family, flavor).model
    with torch.device("meta"):
        model = model_cfg.build()
    layers = list(model.layers.values())
    moe = [layer.moe for layer in layers if getattr(layer, "moe", None) is not None]
    dense = [layer.feed_forward for layer in layers if getattr(layer, "feed_forward", None) is not None]
    first_moe = next(cfg for _fqn, cfg, _p, _a in model_cfg.traverse(MoE.Config))
    attention = layers[0].attention
    expert_hidden = moe[0].routed_experts.inner_experts.w1_EFD.shape[1]
    shared = moe[0].shared_experts
    n_heads = attention.n_heads
    n_kv_heads = attention.n_kv_heads if isinstance(attention, GQAttention) else n_heads
    return ModelFacts(
        dim=model_cfg.dim,
        n_layers=len(layers),
        n_moe_layers=len(moe),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=model_cfg.vocab_size,
        num_experts=first_moe.num_experts,
        num_shared_experts=shared.w1.weight.shape[0] // expert_hidden if shared is not None else 0,
        top_k=first_moe.router.top_k,
        moe_hidden_dim=expert_hidden,
        dense_hidden_dim=dense[0].w1.weight.shape[0] if dense else 0,
        params=sum(p.numel() for p in model.parameters()),
        expert_params=sum(p.numel() for n, p in model.named_parameters() if ".inner_experts." in n),
        attention=attention_of(model_cfg),
    )
