"""mxfp8_ep: expert-parallel token dispatch in MXFP8 for torchtitan MoE training.

Imports neither hydra, submitit nor wandb (the recipe in ``launch/`` does).
"""

from mxfp8_ep.config import PRESETS, A2AConfig

__all__ = ["A2AConfig", "PRESETS", "install_expert_parallel"]


def install_expert_parallel(
    a2a: A2AConfig, max_tokens_per_rank: int | None = None, overlap_shared_experts: bool = False
) -> None:
    """Make torchtitan 0.2.2's Llama4 / DeepSeek-V3 parallelization run every EP MoE layer
    through our token dispatcher (``mxfp8_ep.titan022``)."""
    from mxfp8_ep.titan022 import install_expert_parallel as _install

    _install(a2a, max_tokens_per_rank, overlap_shared_experts)
