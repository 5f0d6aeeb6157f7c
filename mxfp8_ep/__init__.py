"""mxfp8_ep: expert-parallel token dispatch in MXFP8 for torchtitan MoE training.

Imports neither hydra, submitit nor wandb (the recipe in ``launch/`` does).
"""

from mxfp8_ep.config import PRESETS, A2AConfig

__all__ = ["A2AConfig", "PRESETS", "install_expert_parallel"]


def install_expert_parallel(
    a2a: A2AConfig, max_tokens_per_rank: int | None = None, overlap_shared_experts: bool = False
) -> None:
    """Make torchtitan 0.2.2's Llama4 / DeepSeek-V3 parallelization run every EP MoE layer
    through our token dispatcher (``mxfp8_ep.titan022``). Where another torchtitan is installed
    (0.3.0 has no ``ExpertParallel``) an ``ImportError`` names the form that works there."""
    try:
        from mxfp8_ep.titan022 import install_expert_parallel as _install
    except ImportError as e:
        from importlib.metadata import PackageNotFoundError, version

        try:
            torchtitan = version("torchtitan")
        except PackageNotFoundError:
            torchtitan = None
        if torchtitan in (None, "0.2.2"):
            raise
        raise ImportError(
            f"install_expert_parallel rebinds torchtitan 0.2.2's ExpertParallel, which torchtitan {torchtitan} "
            f"does not have; on torchtitan 0.3.0 put the dispatcher on the job config before the trainer builds "
            f"the model: `from mxfp8_ep.titan030 import token_dispatcher; token_dispatcher("
            f"job_config.model_spec.model, preset=\"mxfp8\", transport=\"auto\")`, or pass `--override.imports "
            f"'mxfp8_ep.titan030.token_dispatcher={{\"preset\": \"mxfp8\"}}'` (docs/torchtitan_030.md)") from e

    _install(a2a, max_tokens_per_rank, overlap_shared_experts)
