"""Model flavors for the recipe: torchtitan 0.2.2's own MoE flavors plus tiny CPU ones.

Our config names a model by ``family`` + ``flavor`` (``launch/schema.py::ModelConfig``).
``family`` is a torchtitan model name (``llama4`` / ``deepseek_v3``); ``flavor`` is either one of
torchtitan's flavors in that family (``debugmodel``, ``17bx16e``, ``16B``, ...) or one of ours
(``tiny``), which :func:`register_tiny_flavors` adds to torchtitan's flavor dicts so torchtitan's
``Trainer`` finds them by name.

The tiny flavors exist so CI can train real Llama4 / DeepSeek-V3 MoE blocks with EP=2 on two CPU
processes in seconds: dim 128, 2 layers, MoE on every layer, vocab 512 (our tokenizer in
``assets/tokenizer``). Every width the EP all-to-all sends (the model dim) and every expert
hidden dim is a multiple of 32, the MXFP8 block size, so the MXFP8 path sees whole blocks.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = [
    "FAMILIES",
    "UnknownModelError",
    "TITAN_FLAVORS",
    "TINY_FLAVORS",
    "TINY_VOCAB_SIZE",
    "model_args",
    "register_tiny_flavors",
    "resolve",
]

class UnknownModelError(KeyError, ValueError):
    """Unknown family or flavor (a KeyError for table-style callers, a ValueError for others)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


# Our family name (and accepted aliases) -> torchtitan model name.
FAMILIES: dict[str, str] = {
    "llama4": "llama4",
    "deepseek_v3": "deepseek_v3",
    "dsv3": "deepseek_v3",
    "deepseekv3": "deepseek_v3",
}

# torchtitan's own MoE flavors the configs may name (exact torchtitan spelling).
TITAN_FLAVORS: dict[str, tuple[str, ...]] = {
    "llama4": ("debugmodel", "17bx16e", "17bx128e"),
    "deepseek_v3": ("debugmodel", "16B", "236B", "671B"),
}

# The tokenizer in assets/tokenizer has at most this many ids (build_tiny_assets.py).
TINY_VOCAB_SIZE = 512

# Our flavors, per torchtitan family.
TINY_FLAVORS: dict[str, tuple[str, ...]] = {
    "llama4": ("tiny",),
    "deepseek_v3": ("tiny",),
}


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


_TINY_BUILDERS = {
    ("llama4", "tiny"): _tiny_llama4,
    ("deepseek_v3", "tiny"): _tiny_deepseek_v3,
}


def _flavor_dict(titan_name: str) -> dict[str, Any]:
    """torchtitan's own flavor dict for a family (mutable: ``get_train_spec`` reads it)."""
    if titan_name == "llama4":
        from torchtitan.models.llama4 import llama4_args

        return llama4_args
    if titan_name == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import deepseekv3_args

        return deepseekv3_args
    raise UnknownModelError(f"unknown torchtitan model family {titan_name!r}")


def register_tiny_flavors() -> None:
    """Add our tiny flavors to torchtitan's llama4 / deepseek_v3 flavor dicts. Idempotent."""
    for (titan_name, flavor), build in _TINY_BUILDERS.items():
        flavors = _flavor_dict(titan_name)
        if flavor not in flavors:
            flavors[flavor] = build()


def resolve(family: str, flavor: str) -> tuple[str, str]:
    """Map our (family, flavor) to torchtitan's (model name, flavor); raise on unknown names.

    Flavor matching tolerates case ("16b" -> "16B") since Hydra option names are lowercase.
    """
    try:
        titan_name = FAMILIES[family.lower()]
    except KeyError:
        raise UnknownModelError(
            f"unknown model family {family!r}; known: {sorted(set(FAMILIES.values()))}"
        ) from None
    known = TITAN_FLAVORS[titan_name] + TINY_FLAVORS[titan_name]
    if flavor in known:
        return titan_name, flavor
    by_lower = {name.lower(): name for name in known}
    if flavor.lower() in by_lower:
        return titan_name, by_lower[flavor.lower()]
    # Any other flavor torchtitan itself ships (e.g. "debugmodel_flex_attn") is allowed too.
    if flavor in _flavor_dict(titan_name):
        return titan_name, flavor
    raise UnknownModelError(f"unknown flavor {flavor!r} for {titan_name}; known: {list(known)}")


def model_args(family: str, flavor: str) -> Any:
    """A private copy of torchtitan's model args for (family, flavor).

    For validation (``num_experts`` vs EP degree, ``dim`` % 32, ...): the copy can be read or
    changed without touching the args torchtitan's ``Trainer`` will use.
    """
    register_tiny_flavors()
    titan_name, titan_flavor = resolve(family, flavor)
    return copy.deepcopy(_flavor_dict(titan_name)[titan_flavor])
