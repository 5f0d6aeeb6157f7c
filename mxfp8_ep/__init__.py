"""mxfp8_ep: expert-parallel all-to-all in MXFP8 for torchtitan MoE training.

Imports neither hydra, submitit nor wandb (the recipe in ``launch/`` does).
"""

from mxfp8_ep.config import PRESETS, A2AConfig

__all__ = ["A2AConfig", "PRESETS", "install_expert_parallel"]


def install_expert_parallel(a2a: A2AConfig) -> None:
    """Make torchtitan's Llama4 / DeepSeek-V3 parallelization use our ExpertParallel."""
    from mxfp8_ep.expert_parallel import install_expert_parallel as _install

    _install(a2a)
