"""``launch.config.model_facts`` for torchtitan 0.3.0: one row per MoE flavor of DeepSeek-V3 and
Qwen3 it ships plus the recipe's own (``launch.titan.titan030.models``), rebuilt from torchtitan
by ``tests/titan030/test_recipe_models.py``. torchtitan's flavors attend with flex, ours with sdpa.
DeepSeek-V3's rows are 0.2.2's but for that attention.
"""

from __future__ import annotations

import dataclasses

from launch.config.model_facts import MODELS as MODELS_022
from launch.config.model_facts import ModelFacts

_DEEPSEEK_V3_OURS = ("tiny", "parity_tiny", "parity", "ep_bench")
_DEEPSEEK_V3_TITAN = ("debugmodel", "16B", "236B", "671B")

MODELS: dict[tuple[str, str], ModelFacts] = {
    **{("deepseek_v3", f): MODELS_022["deepseek_v3", f] for f in _DEEPSEEK_V3_OURS},
    **{("deepseek_v3", f): dataclasses.replace(MODELS_022["deepseek_v3", f], attention="flex")
       for f in _DEEPSEEK_V3_TITAN},
    ("qwen3", "tiny"): ModelFacts(128, 2, 2, 4, 2, 512, 8, 0, 2, 64, 0, 625_408, 393_216, "sdpa"),
    ("qwen3", "debugmodel_moe"): ModelFacts(256, 8, 8, 16, 8, 2048, 64, 0, 8, 768, 0, 315_758_848, 301_989_888,
                                            "flex"),
    ("qwen3", "30B-A3B"): ModelFacts(2048, 48, 48, 32, 4, 151936, 128, 0, 8, 768, 0, 30_532_122_624,
                                     28_991_029_248, "flex"),
    ("qwen3", "235B-A22B"): ModelFacts(4096, 94, 94, 64, 4, 151936, 128, 0, 8, 1536, 0, 235_093_634_560,
                                       227_096_395_776, "flex"),
}
