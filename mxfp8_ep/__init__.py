"""mxfp8_ep: expert-parallel token dispatch in MXFP8 for torchtitan MoE training.

Imports neither hydra, submitit nor wandb (the recipe in ``launch/`` does).

The code lies in subpackages by concern, and a few public modules at the top, listed lowest
first in :data:`LAYERS`: a module imports from its own part and the ones below it, never from
one above (tests/test_import_cycles.py checks it). ``transport``: the transports' names;
``format``: the wire formats and MXFP8 in torch; ``config``: ``A2AConfig``, each leg's format;
``kernels``: the Triton kernels beside their launch shapes and the quantize ops; ``telemetry``:
what the library counts (numerics, bytes on the wire, expert loads); ``exchange``: the buffers
rows travel through and the kernels that push them; ``dispatcher``: the token dispatchers, one
module per transport; ``pool``: symm's activation pool. Above them all sit the entry points a
training loop uses: ``elastic`` (the replays of an overflowed step), ``titan022`` and
``titan030`` (torchtitan 0.2.2 and 0.3.0). A subpackage's ``__init__`` imports nothing (but
``dispatcher``'s, which registers the transports), so the torch-free modules (``transport``,
``format.wire_format``, ``config``, ``exchange.capacity``, ``pool.activation_pool_size``) load
without torch.
"""

from mxfp8_ep.config import PRESETS, A2AConfig

__all__ = ["A2AConfig", "PRESETS", "install_expert_parallel"]

LAYERS = ("transport", "format", "config", "kernels", "telemetry", "exchange", "dispatcher", "pool")


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
