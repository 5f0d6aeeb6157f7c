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
    through our token dispatcher (``mxfp8_ep.titan022``)."""
    from mxfp8_ep.titan022 import install_expert_parallel as _install

    _install(a2a, max_tokens_per_rank, overlap_shared_experts)
