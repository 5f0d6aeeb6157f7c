"""What the checks before launch need to know about each model, without torch or torchtitan.

Importing torchtitan takes ~10 s; validation must take well under 2 s. So the numbers the
checks use (widths, expert counts, parameter counts, attention kind) are kept here, one row per
torchtitan 0.2.2 flavor of Llama4 and DeepSeek-V3 plus the recipe's tiny ones (:data:`MODELS`),
and per torchtitan 0.3.0 MoE flavor of DeepSeek-V3 and Qwen3 plus ours (:data:`MODELS_030`,
``launch.titan.titan030.models``); :func:`models` is the table of the installed stack.
``tests/test_titan_models.py`` (0.2.2) and ``tests/titan030/test_recipe_models.py`` (0.3.0)
rebuild every row from torchtitan (the model on the meta device) and fail when one differs, so a
torchtitan upgrade cannot leave a table stale.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from launch.config.stack import FAMILIES_BY_STACK, installed_torchtitan

__all__ = ["FAMILIES", "MODELS", "MODELS_030", "ModelFacts", "UnknownModelError", "facts", "models", "resolve"]

# torchtitan 0.2.2's families (:data:`MODELS`); ``launch.config.stack.FAMILIES_BY_STACK`` has each stack's.
FAMILIES = FAMILIES_BY_STACK["0.2.2"]


class UnknownModelError(KeyError, ValueError):
    """Unknown family or flavor (a KeyError for table-style callers, a ValueError for others)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ModelFacts:
    dim: int
    n_layers: int
    n_moe_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    num_experts: int
    num_shared_experts: int
    top_k: int
    # Hidden width of one routed expert, and of a dense layer's FFN (0: no dense layer).
    moe_hidden_dim: int
    dense_hidden_dim: int
    params: int
    # Of ``params``: the routed experts' weights (sharded over EP).
    expert_params: int
    # torchtitan's attention: "sdpa" or "flex" (torch has no flex-attention backward on CPU).
    attention: str


def _flex(facts: ModelFacts) -> ModelFacts:
    """The same model with flex attention (torchtitan's *_irope / *_flex_attn flavors)."""
    return dataclasses.replace(facts, attention="flex")


_L4_DEBUG = ModelFacts(256, 6, 3, 16, 16, 2048, 8, 1, 1, 512, 768, 15_017_216, 9_437_184, "sdpa")
_L4_16E = ModelFacts(5120, 48, 48, 40, 8, 202048, 16, 1, 1, 8192, 0, 107_769_861_120, 96_636_764_160, "sdpa")
_L4_128E = ModelFacts(5120, 48, 24, 40, 8, 202048, 128, 1, 1, 8192, 16384, 400_711_848_960, 386_547_056_640, "sdpa")
_DS_DEBUG = ModelFacts(256, 6, 5, 16, 16, 2048, 8, 2, 3, 256, 1024, 33_014_016, 7_864_320, "sdpa")

MODELS: dict[tuple[str, str], ModelFacts] = {
    ("llama4", "tiny"): ModelFacts(128, 2, 2, 4, 2, 512, 4, 1, 1, 192, 0, 968_320, 589_824, "sdpa"),
    ("llama4", "parity"): ModelFacts(512, 6, 6, 8, 2, 16384, 16, 1, 1, 768, 0, 141_089_280, 113_246_208, "sdpa"),
    ("llama4", "debugmodel"): _L4_DEBUG,
    ("llama4", "debugmodel_irope"): _flex(_L4_DEBUG),
    ("llama4", "17bx16e"): _L4_16E,
    ("llama4", "17bx16e_irope"): _flex(_L4_16E),
    ("llama4", "17bx128e"): _L4_128E,
    ("llama4", "17bx128e_irope"): _flex(_L4_128E),
    ("deepseek_v3", "tiny"): ModelFacts(128, 2, 2, 4, 4, 512, 8, 1, 2, 64, 0, 731_904, 393_216, "sdpa"),
    ("deepseek_v3", "parity"): ModelFacts(512, 8, 7, 8, 8, 16384, 32, 1, 4, 256, 1536, 117_040_640, 88_080_384, "sdpa"),
    ("deepseek_v3", "parity_tiny"): ModelFacts(128, 3, 2, 4, 4, 16384, 16, 1, 4, 64, 384, 5_416_000, 786_432, "sdpa"),
    ("deepseek_v3", "routing_study"): ModelFacts(128, 5, 4, 4, 4, 16384, 64, 2, 6, 64, 384, 11_253_440, 6_291_456,
                                                 "sdpa"),
    ("deepseek_v3", "routing_study_full"): ModelFacts(128, 27, 26, 4, 4, 16384, 64, 2, 6, 64, 384, 48_837_184,
                                                      40_894_464, "sdpa"),
    ("deepseek_v3", "ep_bench"): ModelFacts(7168, 2, 2, 16, 16, 512, 64, 1, 8, 2048, 0,
                                            5_819_371_520, 5_637_144_576, "sdpa"),
    ("deepseek_v3", "debugmodel"): _DS_DEBUG,
    ("deepseek_v3", "debugmodel_flex_attn"): _flex(_DS_DEBUG),
    ("deepseek_v3", "16B"): ModelFacts(2048, 27, 26, 16, 16, 102400, 64, 2, 6, 1408, 10944,
                                       15_706_484_224, 14_394_851_328, "flex"),
    ("deepseek_v3", "236B"): ModelFacts(5120, 60, 59, 128, 128, 102400, 160, 2, 6, 1536, 12288,
                                        235_741_434_880, 222_717_542_400, "flex"),
    ("deepseek_v3", "671B"): ModelFacts(7168, 61, 58, 128, 128, 129280, 256, 1, 8, 2048, 18432,
                                        671_026_404_352, 653_908_770_816, "flex"),
}


# torchtitan 0.3.0: DeepSeek-V3 and Qwen3 MoE. DeepSeek-V3's rows are 0.2.2's but for the
# attention of torchtitan's flavors (flex on 0.3.0); the recipe's own attend with sdpa.
_DEEPSEEK_V3_OURS = ("tiny", "parity_tiny", "parity", "ep_bench")
_DEEPSEEK_V3_TITAN = ("debugmodel", "16B", "236B", "671B")

MODELS_030: dict[tuple[str, str], ModelFacts] = {
    **{("deepseek_v3", f): MODELS["deepseek_v3", f] for f in _DEEPSEEK_V3_OURS},
    **{("deepseek_v3", f): dataclasses.replace(MODELS["deepseek_v3", f], attention="flex")
       for f in _DEEPSEEK_V3_TITAN},
    ("qwen3", "tiny"): ModelFacts(128, 2, 2, 4, 2, 512, 8, 0, 2, 64, 0, 625_408, 393_216, "sdpa"),
    ("qwen3", "debugmodel_moe"): ModelFacts(256, 8, 8, 16, 8, 2048, 64, 0, 8, 768, 0, 315_758_848, 301_989_888,
                                            "flex"),
    ("qwen3", "30B-A3B"): ModelFacts(2048, 48, 48, 32, 4, 151936, 128, 0, 8, 768, 0, 30_532_122_624,
                                     28_991_029_248, "flex"),
    ("qwen3", "235B-A22B"): ModelFacts(4096, 94, 94, 64, 4, 151936, 128, 0, 8, 1536, 0, 235_093_634_560,
                                       227_096_395_776, "flex"),
}


def models(torchtitan: Optional[str] = None) -> dict[tuple[str, str], ModelFacts]:
    """The facts table of a torchtitan release (default: the installed one)."""
    return MODELS_030 if (torchtitan or installed_torchtitan()) == "0.3.0" else MODELS


def resolve(family: str, flavor: str, torchtitan: Optional[str] = None) -> tuple[str, str]:
    """``(family, flavor)`` as torchtitan spells them; flavors match regardless of case
    ("16b" -> "16B": Hydra option names are lowercase). ``torchtitan``: the release whose
    flavors count (default: the installed one). Raises :class:`UnknownModelError`."""
    torchtitan = torchtitan or installed_torchtitan()
    families = FAMILIES_BY_STACK[torchtitan]
    if family not in families:
        raise UnknownModelError(f"unknown model family {family!r} on torchtitan {torchtitan}; known: {list(families)}")
    known = [f for fam, f in models(torchtitan) if fam == family]
    by_lower = {f.lower(): f for f in known}
    if flavor.lower() not in by_lower:
        raise UnknownModelError(f"unknown flavor {flavor!r} for {family}; known: {known}")
    return family, by_lower[flavor.lower()]


def facts(family: str, flavor: str, torchtitan: Optional[str] = None) -> ModelFacts:
    return models(torchtitan)[resolve(family, flavor, torchtitan)]
