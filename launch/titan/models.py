"""Model flavors for the recipe: torchtitan 0.2.2's own MoE flavors plus ours.

Our config names a model by ``family`` + ``flavor`` (``launch/config/schema.py::ModelConfig``).
``family`` is a torchtitan model name (``llama4`` / ``deepseek_v3``); ``flavor`` is either one of
torchtitan's flavors in that family (``debugmodel``, ``17bx16e``, ``16B``, ...) or one of ours,
which :func:`register_tiny_flavors` adds to torchtitan's flavor dicts so torchtitan's ``Trainer``
finds them by name:

* ``tiny`` (both families): CI trains real Llama4 / DeepSeek-V3 MoE blocks with EP=2 on two CPU
  processes in seconds: dim 128, 2 layers, MoE on every layer, vocab 512 (our tokenizer in
  ``launch/titan/assets/tokenizer``).
* ``parity`` (both families): the bf16-vs-MXFP8 parity study's models, ~120-140M parameters
  (mostly routed experts), small enough per step that several runs share one GPU; vocab
  ``CORPUS_VOCAB_SIZE``, the tokenizer ``scripts/build_corpus.py`` trains.
* ``parity_tiny`` (deepseek_v3): the same study's DeepSeek-V3 shape shrunk for CPU/gloo.
* ``routing_study`` (deepseek_v3): DeepSeek-V3 16B's routing (64 experts, top-6) shrunk for a
  CPU, for the routing telemetry's capacity study.
* ``ep_bench`` (deepseek_v3): full-width DeepSeek-V3 MoE layers for exchange benchmarks.

Every width the EP all-to-all sends (the model dim) and every expert hidden dim is a multiple
of 32, the MXFP8 block size, so the MXFP8 path sees whole blocks.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from launch.config.model_facts import FAMILIES, ModelFacts, UnknownModelError, resolve

__all__ = [
    "CORPUS_VOCAB_SIZE",
    "TINY_VOCAB_SIZE",
    "UnknownModelError",
    "facts_from_torchtitan",
    "flavors_in_torchtitan",
    "model_args",
    "register_tiny_flavors",
    "resolve",
]

# In a flavor name: a variant of a flavor with other node-limited routing, which
# launch.titan.node_limited adds to torchtitan's flavor dict for a job config.
NODE_LIMITED_VARIANT = ":groups="
# The tokenizer in launch/titan/assets/tokenizer has at most this many ids (build_tiny_assets.py).
TINY_VOCAB_SIZE = 512
# The tokenizer scripts/build_corpus.py trains by default has this many ids.
CORPUS_VOCAB_SIZE = 16384


def _deepseek_v3_routing(num_experts: int, top_k: int) -> Any:
    """DeepSeek-V3's MoE routing: sigmoid scores, normalised over the top-k and scaled by 2.5,
    applied to the expert outputs; one shared expert."""
    from torchtitan.models.moe import MoEArgs

    return MoEArgs(num_experts=num_experts, num_shared_experts=1, top_k=top_k, score_func="sigmoid",
                   route_norm=True, route_scale=2.5, score_before_experts=False)


def _tiny_llama4() -> Any:
    from torchtitan.models.llama4 import TransformerModelArgs
    from torchtitan.models.moe import MoEArgs

    # Expert hidden dim: 4*128 -> *2/3 = 341 -> /(top_k + shared = 2) = 170 -> round up to
    # multiple_of 32 = 192. Dense-FFN fallback is unused (MoE on every layer).
    return TransformerModelArgs(
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=TINY_VOCAB_SIZE,
        multiple_of=32,
        rope_theta=10000,
        max_seq_len=2048,
        interleave_moe_layer_step=1,
        moe_args=MoEArgs(num_experts=4, num_shared_experts=1, top_k=1),
    )


def _tiny_deepseek_v3() -> Any:
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    return DeepSeekV3ModelArgs(
        vocab_size=TINY_VOCAB_SIZE,
        dim=128,
        inter_dim=256,
        moe_inter_dim=64,
        n_layers=2,
        n_dense_layers=0,  # MoE on every layer
        n_heads=4,
        max_seq_len=2048,
        moe_args=MoEArgs(
            num_experts=8,
            num_shared_experts=1,
            top_k=2,
            score_func="softmax",
            route_norm=False,
            score_before_experts=False,
        ),
        q_lora_rank=0,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        mscale=0.70,
    )


def _ep_bench_deepseek_v3() -> Any:
    """DeepSeek-V3 MoE layers at full width (dim 7168, expert hidden 2048, 64 experts, top-8,
    one shared expert), two of them, with the tiny vocabulary: a model whose step time the
    expert-parallel token exchange dominates, that fits 2xH200 (EP=2, FSDP=2) at 8192 tokens
    per GPU. For bf16-vs-MXFP8 and nccl-vs-symm training comparisons; not for CPUs."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs

    return DeepSeekV3ModelArgs(
        vocab_size=TINY_VOCAB_SIZE,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=2,
        n_dense_layers=0,  # MoE on every layer
        n_heads=16,
        max_seq_len=8192,
        moe_args=_deepseek_v3_routing(num_experts=64, top_k=8),
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    )


def _parity_deepseek_v3() -> Any:
    """DeepSeek-V3's layout at dim 512: MLA attention, a dense first layer, then MoE layers
    with 32 fine-grained routed experts (hidden 256), top-4 sigmoid routing with normalised
    and scaled weights, one shared expert, auxiliary-loss-free load balancing (expert bias).
    8 layers, ~117M parameters of which ~88M routed experts; ~32M used per token."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs

    return DeepSeekV3ModelArgs(
        vocab_size=CORPUS_VOCAB_SIZE,
        dim=512,
        inter_dim=1536,
        moe_inter_dim=256,
        n_layers=8,
        n_dense_layers=1,
        n_heads=8,
        max_seq_len=4096,
        moe_args=_deepseek_v3_routing(num_experts=32, top_k=4),
        q_lora_rank=0,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
    )


def _parity_llama4() -> Any:
    """Llama 4 Scout's layout at dim 512: grouped-query attention, MoE on every layer with 16
    routed experts, top-1 sigmoid routing applied before the experts, one shared expert
    (expert hidden 768, torchtitan's auto-scaled SwiGLU width). 6 layers, ~141M parameters
    of which ~113M routed experts; ~27M used per token."""
    from torchtitan.models.llama4 import TransformerModelArgs
    from torchtitan.models.moe import MoEArgs

    return TransformerModelArgs(
        dim=512,
        n_layers=6,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=CORPUS_VOCAB_SIZE,
        multiple_of=256,
        rope_theta=500000,
        max_seq_len=4096,
        interleave_moe_layer_step=1,
        moe_args=MoEArgs(num_experts=16, num_shared_experts=1, top_k=1),
    )


def _parity_tiny_deepseek_v3() -> Any:
    """The parity DeepSeek-V3 shape for CPU/gloo: dim 128, a dense first layer and two MoE
    layers of 16 routed experts (hidden 64), top-4, one shared expert; the corpus vocab."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs

    return DeepSeekV3ModelArgs(
        vocab_size=CORPUS_VOCAB_SIZE,
        dim=128,
        inter_dim=384,
        moe_inter_dim=64,
        n_layers=3,
        n_dense_layers=1,
        n_heads=4,
        max_seq_len=2048,
        moe_args=_deepseek_v3_routing(num_experts=16, top_k=4),
        q_lora_rank=0,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
    )


def _routing_study_deepseek_v3() -> Any:
    """``parity_tiny`` with four MoE layers and DeepSeek-V3 16B's routing (torchtitan's "16B":
    64 routed experts, top-6 softmax scores applied after the experts, two shared experts,
    auxiliary-loss-free load balancing): for measuring on a CPU how unevenly that routing loads
    EP ranks as it trains (``launch.titan.routing_telemetry``)."""
    from torchtitan.models.moe import MoEArgs

    return dataclasses.replace(
        _parity_tiny_deepseek_v3(),
        n_layers=5,
        moe_args=MoEArgs(num_experts=64, num_shared_experts=2, top_k=6, score_func="softmax", route_norm=False,
                         score_before_experts=False),
    )


def _routing_study_full_deepseek_v3() -> Any:
    """``routing_study`` at DeepSeek-V3 16B's depth: a dense first layer and 26 MoE layers (the
    16B's 27), at the same reduced width: how a rank's rows summed over every MoE layer of a
    step compare with its busiest layer's (the activation pool's size, ``mxfp8_ep.pool.activation_pool``)."""
    return dataclasses.replace(_routing_study_deepseek_v3(), n_layers=27)


# The recipe's own flavors, added to torchtitan's flavor dicts by register_tiny_flavors.
_TINY_BUILDERS = {
    ("llama4", "tiny"): _tiny_llama4,
    ("llama4", "parity"): _parity_llama4,
    ("deepseek_v3", "tiny"): _tiny_deepseek_v3,
    ("deepseek_v3", "parity"): _parity_deepseek_v3,
    ("deepseek_v3", "parity_tiny"): _parity_tiny_deepseek_v3,
    ("deepseek_v3", "routing_study"): _routing_study_deepseek_v3,
    ("deepseek_v3", "routing_study_full"): _routing_study_full_deepseek_v3,
    ("deepseek_v3", "ep_bench"): _ep_bench_deepseek_v3,
}


def _flavor_dict(family: str) -> dict[str, Any]:
    """torchtitan's own flavor dict for a family (mutable: ``get_train_spec`` reads it)."""
    if family == "llama4":
        from torchtitan.models.llama4 import llama4_args

        return llama4_args
    if family == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import deepseekv3_args

        return deepseekv3_args
    raise UnknownModelError(f"unknown model family {family!r}; known: {list(FAMILIES)}")


def register_tiny_flavors() -> None:
    """Add our tiny flavors to torchtitan's llama4 / deepseek_v3 flavor dicts. Idempotent."""
    for (titan_name, flavor), build in _TINY_BUILDERS.items():
        flavors = _flavor_dict(titan_name)
        if flavor not in flavors:
            flavors[flavor] = build()


def model_args(family: str, flavor: str) -> Any:
    """A private copy of torchtitan's model args for (family, flavor).

    The copy can be read or changed without touching the args torchtitan's ``Trainer`` uses.
    """
    register_tiny_flavors()
    family, flavor = resolve(family, flavor)
    return copy.deepcopy(_flavor_dict(family)[flavor])


def flavors_in_torchtitan() -> list[tuple[str, str]]:
    """Every (family, flavor) torchtitan 0.2.2 ships for our families, plus our tiny ones (not
    the node-limited variants of them a job config adds, ``launch.titan.node_limited``)."""
    register_tiny_flavors()
    return [(family, flavor) for family in FAMILIES for flavor in _flavor_dict(family)
            if NODE_LIMITED_VARIANT not in flavor]


def facts_from_torchtitan(family: str, flavor: str) -> ModelFacts:
    """The row of ``launch.config.model_facts.MODELS`` for a flavor, computed from torchtitan: its
    model args, finished as the Trainer finishes them, and the model built on the meta device
    (no memory) to count parameters and read the expert and FFN widths."""
    import torch
    from torchtitan.config import JobConfig
    from torchtitan.protocols.train_spec import get_train_spec

    args = model_args(family, flavor)
    args.update_from_config(JobConfig())
    with torch.device("meta"):
        model = get_train_spec(family).model_cls(args)
    layers = list(model.layers.values())
    moe = [layer for layer in layers if layer.moe_enabled]
    dense = [layer for layer in layers if not layer.moe_enabled]
    return ModelFacts(
        dim=args.dim,
        n_layers=args.n_layers,
        n_moe_layers=len(moe),
        n_heads=args.n_heads,
        n_kv_heads=getattr(args, "n_kv_heads", None) or args.n_heads,
        vocab_size=args.vocab_size,
        num_experts=args.moe_args.num_experts,
        num_shared_experts=args.moe_args.num_shared_experts,
        top_k=args.moe_args.top_k,
        moe_hidden_dim=moe[0].moe.experts.w1.shape[1] if moe else 0,
        dense_hidden_dim=dense[0].feed_forward.w1.weight.shape[0] if dense else 0,
        params=sum(p.numel() for p in model.parameters()),
        expert_params=sum(p.numel() for n, p in model.named_parameters() if ".experts." in n),
        attention=args.attn_type,
    )
