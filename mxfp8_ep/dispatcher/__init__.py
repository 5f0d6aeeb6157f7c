"""The token dispatcher: the whole expert-parallel path of a MoE layer, shaped like
torchtitan 0.3.0's token dispatchers (``models/common/token_dispatcher.py``):

* ``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E)`` returns the
  expert-major routed input (padded per expert for the grouped GEMM), the padded tokens per
  local expert, and the metadata ``combine`` needs;
* ``combine(routed_output, metadata)`` returns ``(T, D)``: each token's K expert outputs,
  weighted by the router scores (unless they were applied before the experts), reduced in fp32.

Autograd runs through both. Each of the four legs (dispatch / combine, forward / backward)
travels in the format ``A2AConfig`` gives it. Two transports, one API:

* ``transport="nccl"``: all-to-all through the process group, one device-to-host sync per
  layer for the splits (as torchtitan). Works on NCCL across nodes and on gloo.

  - all legs bf16: ``NcclTokenDispatcher``, torchtitan 0.2.2's ExpertParallel + MoE math
    around ``all_to_all_v``, bit for bit;
  - any leg MXFP8: ``FusedNcclTokenDispatcher``, the symm transport's kernels around one
    ``all_to_all_single`` per leg: quantizing fused into the gather of the routed rows,
    payload and scales in one exchange, dequantizing fused into the expert-major permute
    (dispatch) and into the fp32 top-k reduction (combine). Same kernels, same rows, same
    reduction order as symm: the same bits.
* ``SymmTokenDispatcher`` (``transport="symm"``): Triton kernels push rows straight into
  their owner's staging buffer through peer memory (``exchange.peer_memory.PeerBuffer``); MXFP8 legs
  quantize inside that push and dequantize inside the receiving pass, which writes the
  expert-major rows. With top-k > 1 an expert-bound leg (dispatch's forward, combine's
  backward) sends each token once per rank that owns one of its experts, not once per expert;
  the receiving pass applies each row's router score where the leg carries one. When the
  scores come after the experts (top-k > 1) both token-bound legs go back as one partial sum
  per token and rank: combine's forward weighted by the scores dispatch's forward carried
  along (unless ``A2AConfig.symm_combine_partial_sums`` is off: it keeps the expert outputs
  for the score gradients), dispatch's backward a plain sum. Token counts travel through peer
  memory too: no host sync in forward or backward. One node (CUDA symmetric memory); on CPU
  processes the same code runs over shared-memory files (tests).

One file per job: ``base`` (the config, the input checks, the transport registry), ``nccl``
(all-bf16 legs over all-to-all-v), ``push`` (what the push transports share: their metadata and
autograd), ``symm`` (peer memory) and ``fused_nccl`` (quantized legs over all-to-all). A
transport is one file that registers its class (``register_transport``), imported below so
that it is registered whenever the package is; its name is a member of
``mxfp8_ep.transport.Transport``.

May import ``exchange``, ``telemetry``, ``kernels``, ``config``, ``format`` and ``transport``;
``pool``, ``elastic`` and the torchtitan integrations above import it (``mxfp8_ep.LAYERS``).
"""

from mxfp8_ep.dispatcher.base import (
    TokenDispatcher,
    dispatcher_for,
    register_transport,
    registered_transports,
    resolve_transport,
)
from mxfp8_ep.dispatcher.fused_nccl import FusedNcclTokenDispatcher
from mxfp8_ep.dispatcher.nccl import NcclTokenDispatcher
from mxfp8_ep.dispatcher.push import PushDispatchMetadata, PushTokenDispatcher
from mxfp8_ep.dispatcher.symm import SymmTokenDispatcher, peer_buffer_nbytes, release_peer_buffers
from mxfp8_ep.dispatcher.two_hop import TwoHopTokenDispatcher

__all__ = [
    "FusedNcclTokenDispatcher",
    "NcclTokenDispatcher",
    "PushDispatchMetadata",
    "PushTokenDispatcher",
    "SymmTokenDispatcher",
    "TokenDispatcher",
    "TwoHopTokenDispatcher",
    "dispatcher_for",
    "peer_buffer_nbytes",
    "register_transport",
    "registered_transports",
    "release_peer_buffers",
    "resolve_transport",
]
