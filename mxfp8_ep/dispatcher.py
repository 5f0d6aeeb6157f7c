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
  their owner's staging buffer through peer memory (``peer_memory.PeerBuffer``); MXFP8 legs
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
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from mxfp8_ep import routing, wire_stats
from mxfp8_ep.all_to_all import all_to_all_v
from mxfp8_ep.capacity import expert_major_capacity, staging_rows
from mxfp8_ep.config import A2AConfig
from mxfp8_ep.format import BLOCK_SIZE
from mxfp8_ep.peer_memory import LocalBuffer, PeerBuffer
from mxfp8_ep.quantize import resolve_kernel
from mxfp8_ep.symm_reference import (
    partial_slots,
    partial_stage_rows,
    row_weights,
    staged_row_nbytes,
    staging_buffer_nbytes,
    staging_nbytes,
    token_map,
    token_map_offset,
)

# torch 2.13 renamed funcol.all_gather_tensor to all_gather_single (the old name warns); the GPU
# machine's torch 2.11 may have only the old one.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def resolve_transport(transport: str, device: torch.device, group: dist.ProcessGroup) -> str:
    """``auto`` -> ``symm`` on one node with CUDA and >= 2 ranks, ``nccl`` otherwise. An
    explicit ``symm`` across nodes is an error (peer memory does not span nodes)."""
    if transport == "nccl":
        return "nccl"
    world = dist.get_world_size(group)
    if transport == "auto" and (torch.device(device).type != "cuda" or world < 2):
        return "nccl"
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        if transport == "symm":
            raise ValueError(
                f"a2a.transport=symm needs every EP rank on one node, but the EP group spans "
                f"{len(set(hosts))} hosts; use transport=nccl (or auto) for multi-node EP"
            )
        return "nccl"
    return "symm"


class TokenDispatcher:
    """Base of the EP dispatchers: config, checks and the routing both transports share."""

    @dataclass(kw_only=True)
    class Config:
        num_experts: int
        top_k: int
        a2a: A2AConfig = field(default_factory=A2AConfig)
        # Router scores multiply the expert inputs (Llama4) instead of the outputs (DeepSeek-V3).
        score_before_experts: bool = False
        # Each local expert's segment is padded to a multiple of this (grouped GEMM alignment).
        pad_multiple: int = 8
        # symm: receive buffers are sized for this many tokens per rank (None: the largest
        # token count of the first dispatch, over the EP group).
        max_tokens_per_rank: int | None = None

        @property
        def symm_partial_sums(self) -> bool:
            """Whether the symm transport sends dispatch's backward as one partial sum per
            token and rank (``SymmTokenDispatcher._push_to_tokens``): with top-k > 1 and the
            scores after the experts, the plain sum of a token's rows on each rank. The x
            gradient then adds a token's rows in another grouping than the fused nccl
            transport, and rounds (bf16) or quantizes (MXFP8) each partial sum once instead of
            each row: equal to that rounding, not bits."""
            return self.top_k > 1 and not self.score_before_experts

        @property
        def symm_combine_partial_sums(self) -> bool:
            """Whether combine's forward goes the same way (``symm_partial_sums`` and
            ``A2AConfig.symm_combine_partial_sums``): the weighted sum of a token's rows on each
            rank (the scores ride along with dispatch's forward). The output then differs from
            the fused nccl transport's as the x gradient does, and the score gradients are taken
            where the expert outputs stayed, against the output gradient as it arrived there
            (MXFP8: dequantized), and go back to the tokens' ranks
            (``SymmTokenDispatcher.to_experts``)."""
            return self.symm_partial_sums and self.a2a.symm_combine_partial_sums

        @property
        def symm_scores_after_dequantize(self) -> bool:
            """Whether the symm transport quantizes a token before its router score multiplies
            it: with top-k > 1 the weighted expert-bound leg (combine's backward when the
            scores come after the experts, dispatch's forward when they come first) sends each
            token once per rank and the experts' rank multiplies each row by its score as it
            receives it (``SymmTokenDispatcher._push_to_experts``). On a bf16 leg that is the
            same product, the same bits; on an MXFP8 leg the row is ``score * dequant(quant(token))``
            where the fused nccl transport sends ``quant(score * token)``: equal to the format's
            rounding, not bits (every gradient downstream of combine's backward, or every value
            downstream of dispatch's forward)."""
            weighted = self.a2a.dispatch_fwd if self.score_before_experts else self.a2a.combine_bwd
            return self.top_k > 1 and weighted == "mxfp8"

        def build(self, group: dist.ProcessGroup, device: torch.device | str) -> "TokenDispatcher":
            transport = resolve_transport(self.a2a.transport, torch.device(device), group)
            if transport == "symm":
                cls = SymmTokenDispatcher
            elif self.a2a.any_quantized:
                cls = FusedNcclTokenDispatcher
            else:  # all-bf16 legs: torchtitan's math, bit for bit
                cls = NcclTokenDispatcher
            return cls(self, group)

    def __init__(self, config: Config, group: dist.ProcessGroup):
        self.config = config
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if config.num_experts % self.ep != 0:
            raise ValueError(
                f"expert parallelism {self.ep} must divide the number of experts {config.num_experts}"
            )
        self.num_local_experts = config.num_experts // self.ep

    def _check_inputs(self, x_TD, topk_scores_TK, topk_expert_ids_TK) -> None:  # noqa: N803
        """Fail on every rank, before any exchange, so no rank waits for a peer that raised."""
        a2a = self.config.a2a
        if x_TD.dim() != 2 or topk_expert_ids_TK.shape != (x_TD.shape[0], self.config.top_k):
            raise ValueError(
                f"dispatch takes x (T, D) and expert ids (T, top_k={self.config.top_k}), got "
                f"{tuple(x_TD.shape)} and {tuple(topk_expert_ids_TK.shape)}"
            )
        if topk_scores_TK.shape != topk_expert_ids_TK.shape:
            raise ValueError(f"scores {tuple(topk_scores_TK.shape)} != expert ids {tuple(topk_expert_ids_TK.shape)}")
        quantized = [leg for leg in A2AConfig.legs() if getattr(a2a, leg) == "mxfp8"]
        if quantized and x_TD.shape[1] % BLOCK_SIZE != 0:
            raise ValueError(
                f"MXFP8 legs {quantized} need the model dim to be a multiple of {BLOCK_SIZE}, "
                f"got dim {x_TD.shape[1]}; use a2a=bf16 for this model"
            )
        if x_TD.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"dispatch takes bfloat16 or float32 tokens, got {x_TD.dtype}")


# --------------------------------------------------------------------------------------------
# nccl


@dataclass(frozen=True)
class NcclDispatchMetadata:
    slot: torch.Tensor  # (N,) token * K + k of each expert-sorted row
    permuted: torch.Tensor  # (R,) row of the all-to-all output (or the zero row) per expert-major row
    input_splits: list[int]
    output_splits: list[int]
    topk_scores_TK: torch.Tensor  # noqa: N815


class NcclTokenDispatcher(TokenDispatcher):
    """All-to-all-v transport (multi-node NCCL, and gloo) for all-bf16 legs: torchtitan 0.2.2's
    ExpertParallel and MoE math around ``all_to_all_v``, bit for bit. ``Config.build`` takes
    ``FusedNcclTokenDispatcher`` instead when any leg is MXFP8 (this class still carries MXFP8
    legs, through ``all_to_all_v``'s separate quantize pass and two exchanges, when built
    directly)."""

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E):  # noqa: N803
        self._check_inputs(x_TD, topk_scores_TK, topk_expert_ids_TK)
        a2a, cfg, W, L = self.config.a2a, self.config, self.ep, self.num_local_experts
        counts = num_tokens_per_expert_E.to(torch.int64)
        with torch.no_grad():
            counts_recv = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group))
            # The one host wait of this transport (torchtitan makes the same one, as two syncs):
            # NCCL takes the splits on the host. One copy of both, waited for here.
            splits = torch.stack([counts.view(W, L).sum(dim=1), counts_recv.view(W, L).sum(dim=1)])
            input_splits, output_splits = _HostCopy(splits).tolist()
            slot = torch.argsort(topk_expert_ids_TK.reshape(-1), stable=True)
        routed_input = x_TD[slot // cfg.top_k]
        if cfg.score_before_experts:
            scores = topk_scores_TK.reshape(-1)[slot]
            routed_input = (routed_input.to(torch.float32) * scores.reshape(-1, 1)).to(x_TD.dtype)
        received = all_to_all_v(
            routed_input, output_splits, input_splits, self.group,
            forward_format=a2a.dispatch_fwd, backward_format=a2a.dispatch_bwd,
            rounding=a2a.scale_rounding, kernel=a2a.kernel, legs=("dispatch_fwd", "dispatch_bwd"),
        )
        with torch.no_grad():
            counts_SL = counts_recv.view(W, L)  # noqa: N806
            align = cfg.pad_multiple
            num_rows = (received.shape[0] + L * align + align - 1) // align * align
            rows = routing.expert_major_rows(counts_SL, align, num_rows)
            permuted = routing.rank_major_index(rows, counts_SL)
            permuted = torch.where(permuted < 0, received.shape[0], permuted)
        # Padding rows read an appended zero row (torchtitan's _permute).
        routed_input = torch.vstack((received, received.new_zeros((1, received.shape[1]))))[permuted]
        meta = NcclDispatchMetadata(
            slot=slot, permuted=permuted, input_splits=input_splits,
            output_splits=output_splits, topk_scores_TK=topk_scores_TK,
        )
        return routed_input, rows.tokens_per_local_expert, meta

    def combine(self, routed_output, metadata: NcclDispatchMetadata):
        a2a, cfg = self.config.a2a, self.config
        num_received = sum(metadata.output_splits)
        unpermuted = routed_output.new_empty((num_received + 1, routed_output.shape[1]))
        unpermuted[metadata.permuted] = routed_output
        returned = all_to_all_v(
            unpermuted[:-1], metadata.input_splits, metadata.output_splits, self.group,
            forward_format=a2a.combine_fwd, backward_format=a2a.combine_bwd,
            rounding=a2a.scale_rounding, kernel=a2a.kernel, legs=("combine_fwd", "combine_bwd"),
        )
        scores = metadata.topk_scores_TK
        num_tokens, dim = scores.shape[0], routed_output.shape[1]
        by_slot = returned.new_zeros((num_tokens * cfg.top_k, dim))
        by_slot[metadata.slot] = returned
        by_slot = by_slot.reshape(num_tokens, cfg.top_k, dim)
        if cfg.score_before_experts:
            return by_slot.sum(dim=1)
        return torch.bmm(scores.reshape(-1, 1, cfg.top_k), by_slot.float()).to(routed_output.dtype).squeeze(1)


# --------------------------------------------------------------------------------------------
# push transports: symm, and nccl with MXFP8 legs


@dataclass(frozen=True)
class ExchangeSplits:
    """Rows this rank sends each rank and receives from each in the all-to-all of the
    expert-bound direction, its own entries 0 (those rows never leave it); the token-bound
    direction swaps them."""

    send: list[int]
    recv: list[int]


@dataclass(frozen=True)
class ExpertRowRouting:
    """Routing of the rows of this rank's expert-major tensor, known once the token counts of
    every rank are (symm: at once, on the device; nccl: after the host has the splits)."""

    capacity: int  # R: rows of the expert-major tensor
    row_source: torch.Tensor  # (R,) per expert-major row: source rank, PAD_ROW or UNUSED_ROW
    return_rank: torch.Tensor  # (R,) rank a row goes back to in combine (-1: stays, pad, unused)
    # (R,) symm: its sorted row there; nccl: its row in the receive buffer of dispatch = the
    # send buffer of combine
    return_row: torch.Tensor
    splits: ExchangeSplits | None = None  # nccl: the all-to-all's rows per rank


@dataclass
class PushDispatchMetadata:
    """Routing of one dispatch, for its combine and both backwards. A row that crosses ranks is
    addressed where its receiver reads it: symm, in the receiver's staging buffer (which peers
    write into); nccl, in the rank-major all-to-all buffers (``routing.exchange_tables``).

    The expert-side routing (``expert_rows``) may be pending: a function that returns it when
    first needed (nccl: it waits for the splits on the host, so the device work queued before
    that wait keeps the GPU busy through it)."""

    slot: torch.Tensor  # (N,) token * K + k of each expert-sorted row
    inv: torch.Tensor  # (N,) expert-sorted row of each slot
    dst_rank: torch.Tensor  # (N,) rank that owns each sorted row's expert
    # (N,) its row in the owner's expert-major tensor (symm; nccl when the owner is this rank),
    # else (nccl) in the send buffer of dispatch = the receive buffer of combine
    dst_row: torch.Tensor
    topk_scores_TK: torch.Tensor  # noqa: N815
    num_tokens: int
    pending_expert_rows: ExpertRowRouting | Callable[[], ExpertRowRouting]
    # symm, after a token-once push (``push_tokens``): per expert-major row, the slot of its
    # token (``source * slot_tokens + token``) when a peer sent it, else ``ep * slot_tokens``.
    row_slot: torch.Tensor | None = None
    slot_tokens: int = 0
    # symm with combine's partial sums (``Config.symm_combine_partial_sums``): per expert-major
    # row, the router score of its slot (fp32; 0 for rows that hold no slot), carried by dispatch.
    row_score: torch.Tensor | None = None
    partial_order: tuple[torch.Tensor, torch.Tensor] | None = None  # ``partial_slots`` of ``row_slot``

    @property
    def expert_rows_known(self) -> bool:
        """Whether ``expert_rows`` is at hand (no wait for the host)."""
        return not callable(self.pending_expert_rows)

    @property
    def expert_rows(self) -> ExpertRowRouting:
        if callable(self.pending_expert_rows):
            self.pending_expert_rows = self.pending_expert_rows()
        return self.pending_expert_rows

    @property
    def capacity(self) -> int:
        return self.expert_rows.capacity

    @property
    def row_source(self) -> torch.Tensor:
        return self.expert_rows.row_source

    @property
    def return_rank(self) -> torch.Tensor:
        return self.expert_rows.return_rank

    @property
    def return_row(self) -> torch.Tensor:
        return self.expert_rows.return_row

    @property
    def splits(self) -> ExchangeSplits | None:
        return self.expert_rows.splits


class PushTokenDispatcher(TokenDispatcher):
    """What the symm and the fused nccl transports share: routing metadata from the
    expert-major layout (``routing``), and each leg as ``push_rows`` (one pass that gathers,
    weights and, for an MXFP8 leg, quantizes each row; rows that stay are stored unquantized
    straight into their destination) -> the transport's exchange -> ``receive_rows`` (into the
    expert-major tensor) or ``reduce_slots`` (the fp32 top-k reduction), each dequantizing as
    it reads. Kernels: ``symm_kernels`` (Triton) or their twins ``symm_reference``.

    A transport supplies the token counts, routing tables and expert-row routing
    (``_routing``), the expert-bound push and exchange (``_push_to_experts``), and the buffer
    a token-bound leg pushes into (``_send_buffer``) with the exchange that makes it readable
    (``_exchange``); symm also replaces the token-bound push of a plain sum
    (``_push_to_tokens``: partial sums)."""

    def kernels(self, device: torch.device):
        if resolve_kernel(self.config.a2a.kernel, device) == "triton":
            from mxfp8_ep import symm_kernels as kernels
        else:
            from mxfp8_ep import symm_reference as kernels
        return kernels

    def _routing(self, x_TD, counts_E):  # noqa: N803
        """Exchange the token counts: this rank's routing tables and the expert-row routing
        (or a function that returns it when first needed)."""
        raise NotImplementedError

    def _push_to_experts(self, push, src, meta, leg, fmt, factor, dot_rows, dot_out):
        """Run ``push(out, send, rows, only)`` (``push_rows`` of this leg's sorted rows) and the
        exchange: the fresh expert-major tensor ``out``, the buffer this rank reads the leg's
        rows from, its rows, the staged row of each row read (``stage_row``, None: the same
        row) and the weight the receiving pass applies to each (None: none). ``factor``,
        ``dot_rows``, ``dot_out``: what ``push`` does to the rows (``push_rows``), for a
        transport that pushes another way (symm: each token once per rank)."""
        raise NotImplementedError

    def _send_buffer(self, src, meta, leg, fmt):
        """The buffer a token-bound ``leg`` pushes into and its rows; records the wire bytes."""
        raise NotImplementedError

    def _exchange(self, sent, rows, src, meta, fmt):
        """After a token-bound push: the buffer this rank reads the leg's rows from, its rows,
        and the staged row of each row read (``stage_row``, None: the same row)."""
        raise NotImplementedError

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E):  # noqa: N803
        self._check_inputs(x_TD, topk_scores_TK, topk_expert_ids_TK)
        cfg = self.config
        kernels = self.kernels(x_TD.device)
        with torch.no_grad():
            slot = torch.argsort(topk_expert_ids_TK.reshape(-1), stable=True)
            tables, expert_rows = self._routing(x_TD, num_tokens_per_expert_E.to(torch.int64).contiguous())
            dst_rank, dst_row, inv = kernels.sorted_row_routing(
                tables, slot, topk_expert_ids_TK.reshape(-1), self.num_local_experts
            )
        meta = PushDispatchMetadata(
            slot=slot, inv=inv, dst_rank=dst_rank, dst_row=dst_row, topk_scores_TK=topk_scores_TK,
            num_tokens=x_TD.shape[0], pending_expert_rows=expert_rows,
        )
        factor = topk_scores_TK.reshape(-1) if cfg.score_before_experts else None
        routed_input = _ToExperts.apply(x_TD, factor, meta, self)
        return routed_input, tables.tokens_per_local_expert, meta

    def combine(self, routed_output, metadata: PushDispatchMetadata):
        weight = None if self.config.score_before_experts else metadata.topk_scores_TK.reshape(-1)
        return _ToTokens.apply(routed_output, weight, metadata, self)

    # The two directions. Expert-bound: dispatch forward, combine backward. Token-bound:
    # combine forward, dispatch backward.

    def to_experts(self, src, meta, leg, factor=None, dot_rows=None, dot_out=None, dot_local=None):
        """Sorted rows (read from ``src`` by token) -> a fresh ``(capacity, D)`` expert-major
        tensor on their owners. ``leg``: dispatch_fwd or combine_bwd. ``dot_rows`` (per sorted
        row) or ``dot_local`` (this rank's expert-major rows; symm after combine's partial
        sums): the rows the score gradients ``dot_out`` take their dot products with."""
        if dot_local is not None:
            raise NotImplementedError(f"{type(self).__name__} takes its score gradients on the token's rank")
        kernels, a2a = self.kernels(src.device), self.config.a2a
        fmt = getattr(a2a, leg)

        def push(out, send, rows, only):
            kernels.push_rows(
                src, meta.dst_rank, meta.dst_row, out, send, rows, self.rank, fmt, a2a.scale_rounding,
                slot=meta.slot, top_k=self.config.top_k, factor=factor, dot_rows=dot_rows, dot_out=dot_out,
                only=only,
            )

        out, recv, rows, stage_row, row_weight = self._push_to_experts(push, src, meta, leg, fmt, factor, dot_rows, dot_out)
        kernels.receive_rows(out, meta.row_source, self.rank, recv, rows, fmt, stage_row=stage_row, weight=row_weight)
        return out

    def to_tokens(self, src, meta, leg, weight=None, save=None, dot_with=None, dot_out=None):
        """Expert-major rows (``src``) -> ``(T, D)``: each token's K rows reduced in fp32.
        ``leg``: combine_fwd or dispatch_bwd."""
        kernels = self.kernels(src.device)
        fmt = getattr(self.config.a2a, leg)
        recv, rows, stage_row, staged_weighted = self._push_to_tokens(src, meta, leg, fmt)
        out = src.new_empty((meta.num_tokens, src.shape[1]))
        kernels.reduce_slots(
            out, meta.inv, meta.dst_rank, meta.dst_row, src, recv, rows, self.rank, fmt,
            self.config.top_k, weight=weight, save=save, dot_with=dot_with, dot_out=dot_out,
            stage_row=stage_row, weigh_staged=not staged_weighted,
        )
        return out

    def _push_to_tokens(self, src, meta, leg, fmt):
        """Push a token-bound leg's rows (``push_rows``) and exchange them: the buffer this
        rank reads them from, its rows, the staged row of each sorted row (``stage_row``,
        None: the same row), and whether the staged rows come weighted already."""
        a2a = self.config.a2a
        send, rows = self._send_buffer(src, meta, leg, fmt)
        self.kernels(src.device).push_rows(
            src, meta.return_rank, meta.return_row, None, send, rows, self.rank, fmt, a2a.scale_rounding,
        )
        return (*self._exchange(send, rows, src, meta, fmt), False)


# --------------------------------------------------------------------------------------------
# symm


@dataclass
class _SymmBuffers:
    """Peer buffers of one (group, device, dim, dtype): a count buffer and two staging buffers
    that consecutive legs alternate between. Each staging buffer holds ``staging_rows`` rows,
    then (at ``map_offset``) a token map and row weights of ``capacity`` entries each
    (``symm_reference.token_map``, ``row_weights``)."""

    counts: PeerBuffer
    staging: tuple[PeerBuffer, PeerBuffer]
    staging_rows: int
    max_tokens: int
    capacity: int  # rows of the expert-major tensor dispatch returns (drop-free worst case)
    map_offset: int
    next_staging: int = 0

    def take_staging(self) -> PeerBuffer:
        # Leg j writes into staging j % 2. A peer writes into a buffer again only after the
        # barrier of leg j + 1, which this rank enters after it has read leg j's rows: every
        # rank runs the same sequence of legs on one stream, so no live data is overwritten.
        buf = self.staging[self.next_staging]
        self.next_staging ^= 1
        return buf


_BUFFERS: dict[tuple, _SymmBuffers] = {}


class SymmTokenDispatcher(PushTokenDispatcher):
    """Peer-memory push transport (one node): sync-free, quantizes inside the push. Each
    leg's rows go straight into the owner's staging buffer at the row the owner reads them
    from; a barrier makes them visible."""

    def _buffer_key(self, x_TD: torch.Tensor) -> tuple:  # noqa: N803
        # The cached PeerBuffers hold the group, so its id cannot be reused while cached.
        cfg = self.config
        return (id(self.group), x_TD.device, x_TD.shape[1], x_TD.dtype, cfg.top_k, self.num_local_experts, cfg.pad_multiple,
                cfg.symm_combine_partial_sums)

    def _buffers(self, x_TD: torch.Tensor) -> _SymmBuffers:  # noqa: N803
        """The peer buffers for ``x_TD``'s (group, device, dim, dtype), allocated at the first
        dispatch (a collective: every rank builds the same dispatchers in the same order) and
        again, larger, when this dispatcher is configured for more tokens than they hold."""
        cfg = self.config
        key = self._buffer_key(x_TD)
        bufs = _BUFFERS.get(key)
        if bufs is None or (cfg.max_tokens_per_rank or 0) > bufs.max_tokens:
            max_tokens = cfg.max_tokens_per_rank
            if max_tokens is None:  # once, at the first dispatch: agree on the largest T
                t = torch.tensor([x_TD.shape[0]], dtype=torch.int64, device=x_TD.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
                max_tokens = int(t.item())
            capacity = expert_major_capacity(max_tokens, cfg.top_k, self.ep, self.num_local_experts, cfg.pad_multiple)
            rows = self._staging_rows(max_tokens, capacity, x_TD.shape[1], x_TD.dtype)
            map_offset = token_map_offset(rows, x_TD.shape[1], x_TD.dtype)
            # The rows' bytes also hold the score gradients combine's backward returns
            # (``_return_row_dots``): fp32, one per expert-major row of every rank.
            assert not cfg.symm_combine_partial_sums or map_offset >= self.ep * capacity * 4
            nbytes = staging_buffer_nbytes(rows, x_TD.shape[1], x_TD.dtype, capacity)
            bufs = _SymmBuffers(
                # Per rank: its counts per expert, then its token count (checked by every rank).
                counts=PeerBuffer(self.ep * (cfg.num_experts + 1) * 8, self.group, x_TD.device),
                staging=(PeerBuffer(nbytes, self.group, x_TD.device), PeerBuffer(nbytes, self.group, x_TD.device)),
                staging_rows=rows,
                max_tokens=max_tokens,
                capacity=capacity,
                map_offset=map_offset,
            )
            _BUFFERS[key] = bufs
        return bufs

    def _staging_rows(self, max_tokens: int, capacity: int, dim: int, dtype: torch.dtype) -> int:
        """Rows a staging buffer holds (``capacity.staging_rows``): ``EP x max_tokens`` with
        top-k > 1 (plus each token's K rows when combine's forward goes row by row), the
        drop-free ``capacity`` with top-1."""
        cfg = self.config
        return staging_rows(self.ep, max_tokens, cfg.top_k, capacity, cfg.symm_combine_partial_sums,
                            staging_nbytes(1, dim, dtype))

    def _routing(self, x_TD, counts_E):  # noqa: N803
        W, E = self.ep, self.config.num_experts
        bufs = self._buffers(x_TD)
        # Every rank's token count travels with its expert counts, so that a rank with more
        # tokens than the buffers hold fails on every rank instead of leaving its peers waiting
        # in the next barrier: it raises here, after the count exchange; they assert on the device.
        kernels = self.kernels(x_TD.device)
        kernels.push_counts(counts_E, x_TD.shape[0], bufs.counts, self.rank)
        bufs.counts.barrier()
        table = bufs.counts.local[: W * (E + 1) * 8].view(torch.int64).view(W, E + 1)
        message = (f"symm dispatch: a rank got more tokens than the buffers hold ({bufs.max_tokens} per rank); "
                   f"raise TokenDispatcher.Config.max_tokens_per_rank")
        if x_TD.shape[0] > bufs.max_tokens:
            raise ValueError(f"{message} (rank {self.rank} got {x_TD.shape[0]})")
        # Read before the next dispatch rewrites the count buffer: a peer pushes its next counts
        # only after this leg's staging barrier, which this rank reaches after these reads.
        tables, within = kernels.routing_tables(table, self.rank, self.config.pad_multiple, bufs.max_tokens)
        _assert_on_device(within, message)
        rows = ExpertRowRouting(bufs.capacity, *kernels.expert_row_routing(tables, self.rank, W, bufs.capacity))
        return tables, rows

    def _push_to_experts(self, push, src, meta, leg, fmt, factor, dot_rows, dot_out, dot_local=None):
        """With top-k > 1 each token goes once per rank that owns one of its experts
        (``push_tokens``), not once per expert: at top-8 on 2 ranks, a quarter of the rows.
        The owner copies it into each of its expert rows in the receiving pass, through the
        token map the push wrote; on a weighted leg it multiplies each row by the router score
        the push left beside the map (on an MXFP8 leg: after dequantizing,
        ``Config.symm_scores_after_dequantize``). The score gradients' dot products are taken
        in the same pass, on the token's rank (``dot_rows``), or, after combine's partial sums,
        for the rows that stay only (``dot_local``). Dispatch's forward carries the router
        scores along for combine's partial sums (``Config.symm_combine_partial_sums``): the owner
        keeps each row's score in ``meta.row_score``. Top-1 pushes row by row."""
        bufs = self._buffers_for(src)
        send = bufs.take_staging()
        out = src.new_empty((meta.capacity, src.shape[1]))
        row_bytes = wire_stats.row_bytes(src.shape[1], src.element_size(), fmt)
        stage_row = row_weight = None
        carry = None
        if leg == "dispatch_fwd" and self.config.symm_combine_partial_sums:
            carry = meta.topk_scores_TK.detach().reshape(-1)
        if self.config.top_k > 1:
            kernels, a2a = self.kernels(src.device), self.config.a2a
            sent = torch.zeros(1, dtype=torch.int64, device=src.device)
            kernels.push_tokens(
                src, meta.inv, meta.dst_rank, meta.dst_row, out, send, bufs.staging_rows, bufs.map_offset,
                bufs.capacity, self.rank, fmt, a2a.scale_rounding, self.config.top_k, bufs.max_tokens, sent,
                factor=factor, dot_rows=dot_rows, dot_out=dot_out, carry=carry, dot_local=dot_local,
            )
            wire_stats.record_rows(leg, sent[0], row_bytes)
            stage_row = token_map(send.local, bufs.map_offset, bufs.capacity)
            if factor is not None:
                row_weight = row_weights(send.local, bufs.map_offset, bufs.capacity)
        else:
            wire_stats.record_rows(leg, (meta.dst_rank != self.rank).sum(), row_bytes)
            push(out, send, bufs.staging_rows, "all")  # one pass: local HBM copies beside NVLink stores
        send.barrier()  # the peers' pushes (rows, token maps, row weights) into this rank's staging buffer are visible
        if stage_row is not None and leg == "dispatch_fwd" and self.config.symm_partial_sums:
            # Which token each row came from, for the partial sums of dispatch's backward: a
            # copy, since the staging buffer (and its map) serves the next legs.
            remote = (meta.row_source >= 0) & (meta.row_source != self.rank)
            meta.row_slot = torch.where(remote, stage_row, self.ep * bufs.max_tokens)
            meta.slot_tokens = bufs.max_tokens
            if carry is not None:
                meta.row_score = self._row_scores(carry, meta, remote, row_weights(send.local, bufs.map_offset, bufs.capacity))
        return out, send, bufs.staging_rows, stage_row, row_weight

    def _row_scores(self, scores, meta, remote, carried):
        """Per expert-major row, the router score of its slot (fp32): carried by the push for a
        row a peer sent, this rank's own score for a row that stayed, 0 elsewhere. Device ops."""
        capacity = meta.capacity
        stays = torch.where(meta.dst_rank == self.rank, meta.dst_row, capacity)  # capacity: no row here
        own = torch.zeros(capacity + 1, dtype=torch.float32, device=scores.device)
        own.scatter_(0, stays, scores[meta.slot].float())
        return torch.where(remote, carried, own[:capacity])

    def to_experts(self, src, meta, leg, factor=None, dot_rows=None, dot_out=None, dot_local=None):
        """Combine's backward after its partial sums (``dot_local``: the expert outputs, which
        stayed on their rank): the score gradient of a row that stays is taken in the push;
        of a row that a peer's token sent, by the receiving pass, against the output gradient
        as it arrived (MXFP8: dequantized, before its score multiplies it), and then returned
        to the token's rank (``_return_row_dots``)."""
        if dot_local is None:
            return super().to_experts(src, meta, leg, factor, dot_rows, dot_out)
        kernels, fmt = self.kernels(src.device), getattr(self.config.a2a, leg)
        out, recv, rows, stage_row, row_weight = self._push_to_experts(
            None, src, meta, leg, fmt, factor, None, dot_out, dot_local=dot_local,
        )
        row_dots = torch.zeros(meta.capacity, dtype=torch.float32, device=src.device)
        kernels.receive_rows(out, meta.row_source, self.rank, recv, rows, fmt, stage_row=stage_row,
                             weight=row_weight, dot_with=dot_local, dot_out=row_dots)
        self._return_row_dots(row_dots, meta, dot_out, src)
        return out

    def _return_row_dots(self, row_dots, meta, dot_out, src):
        """Each rank's score gradients of its expert-major rows into every peer's next staging
        buffer (rank ``r``'s at ``[r * capacity, (r + 1) * capacity)``, fp32); after the barrier
        each slot whose row a peer holds takes its entry there (the slot's ``dst_rank`` /
        ``dst_row``). A leg of its own (a staging buffer and a barrier): the token's rank needs
        its score gradients before combine's backward returns."""
        bufs = self._buffers_for(src)
        send = bufs.take_staging()
        W, capacity = self.ep, bufs.capacity
        for peer in range(W):
            if peer != self.rank:
                send.peer(peer)[: W * capacity * 4].view(torch.float32)[self.rank * capacity : (self.rank + 1) * capacity].copy_(row_dots)
        wire_stats.record("combine_bwd", (W - 1) * capacity * 4)
        send.barrier()  # the peers' score gradients are in this rank's staging buffer
        returned = send.local[: W * capacity * 4].view(torch.float32)
        n = meta.inv[: dot_out.numel()]
        owner = meta.dst_rank[n]
        theirs = returned[owner.clamp(min=0) * capacity + meta.dst_row[n]]
        dot_out.copy_(torch.where(owner != self.rank, theirs, dot_out))

    def _push_to_tokens(self, src, meta, leg, fmt):
        """A token-bound leg whose rows' tokens this rank knows (``meta.row_slot``: dispatch's
        forward sent tokens once) goes back as one partial sum per token and rank
        (``push_partials``), not row by row: at top-8 on 2 ranks a quarter of the rows. The
        token's rank adds it once, at the token's first slot on that rank. Those legs, when
        the scores follow the experts (DeepSeek-V3): dispatch's backward, a plain sum
        (``Config.symm_partial_sums``), and combine's forward, each row times its score
        (``meta.row_score``; the token's rank weights only the rows that stayed;
        ``Config.symm_combine_partial_sums``). On an MXFP8 leg the partial sum is quantized,
        not each row."""
        weighted = leg == "combine_fwd"
        if meta.row_slot is None or (weighted and meta.row_score is None):
            return super()._push_to_tokens(src, meta, leg, fmt)
        bufs = self._buffers_for(src)
        send = bufs.take_staging()
        kernels = self.kernels(src.device)
        if meta.partial_order is None:  # grouped once, for both token-bound legs
            meta.partial_order = partial_slots(meta.row_slot, self.ep * meta.slot_tokens)
        order, start = meta.partial_order
        sent = torch.zeros(1, dtype=torch.int64, device=src.device)
        kernels.push_partials(
            src, order, start, send, bufs.staging_rows, self.rank, fmt, self.config.a2a.scale_rounding,
            min(self.config.top_k, self.num_local_experts), meta.slot_tokens, sent,
            weight=meta.row_score if weighted else None,
        )
        wire_stats.record_rows(leg, sent[0], wire_stats.row_bytes(src.shape[1], src.element_size(), fmt))
        stage_row = partial_stage_rows(meta.inv, meta.dst_rank, self.rank, self.config.top_k, meta.slot_tokens)
        send.barrier()  # the peers' partial sums into this rank's staging buffer are visible
        return send, bufs.staging_rows, stage_row, weighted

    def _send_buffer(self, src, meta, leg, fmt):
        wire_stats.record_rows(leg, (meta.return_rank >= 0).sum(), wire_stats.row_bytes(src.shape[1], src.element_size(), fmt))
        bufs = self._buffers_for(src)
        return bufs.take_staging(), bufs.staging_rows

    def _exchange(self, sent, rows, src, meta, fmt):
        sent.barrier()  # the peers' pushes into this rank's staging buffer are visible
        return sent, rows, None

    def _buffers_for(self, src: torch.Tensor) -> _SymmBuffers:
        return _BUFFERS[self._buffer_key(src)]


def _assert_on_device(ok: torch.Tensor, message: str) -> None:
    """Fail when ``ok`` (a bool tensor) is False, without a host sync on CUDA: the device traps
    and the process fails at its next synchronization ("device-side assert triggered") instead
    of running on. Elsewhere (CPU processes) it raises ``ValueError`` at once."""
    if ok.is_cuda:
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


# --------------------------------------------------------------------------------------------
# nccl with MXFP8 legs


class FusedNcclTokenDispatcher(PushTokenDispatcher):
    """All-to-all transport (multi-node NCCL, and gloo) for configs with an MXFP8 leg, on the
    symm transport's kernels: each leg is one ``push_rows`` into a rank-major send buffer
    (rows gathered by token and quantized in the same pass; rows that stay on this rank go
    unquantized straight into the expert-major output), ONE ``all_to_all_single`` of packed
    rows (MXFP8: ``D`` e4m3 bytes then ``D/32`` scale bytes per row, so the scales need no
    second exchange), and one receiving pass that dequantizes into the expert-major layout the
    grouped GEMM takes (``receive_rows``) or into the fp32 top-k reduction (``reduce_slots``).
    bf16 legs of the same config take the same path unquantized. The counts travel in one
    all-gather and their splits reach the host once per layer (the one device-to-host sync,
    as torchtitan); dispatch returns exactly the received rows plus per-expert padding.

    An expert-bound leg pushes the rows that leave first, starts the exchange, then pushes the
    rows that stay while the exchange runs. In dispatch's forward the host waits for the splits
    only after the first push is queued (into a send buffer sized for every sorted row), so
    the GPU stays busy through that wait."""

    def _routing(self, x_TD, counts_E):  # noqa: N803
        W, E, L, align = self.ep, self.config.num_experts, self.num_local_experts, self.config.pad_multiple
        counts_WE = funcol.wait_tensor(_all_gather(counts_E, 0, self.group)).view(W, E)  # noqa: N806
        rows_WW = counts_WE.view(W, W, L).sum(dim=2)  # noqa: N806  [s, d]: rows rank s sends rank d
        # The one device-to-host sync of this transport (torchtitan makes the same one). The
        # copy is queued now; the host waits for it only when the expert rows are first needed,
        # after the push of the rows that leave: that push keeps the GPU busy meanwhile.
        splits = _HostCopy(torch.stack([rows_WW[self.rank], rows_WW[:, self.rank]]))
        tables = routing.exchange_tables(counts_WE, self.rank, align)
        kernels = self.kernels(x_TD.device)

        def expert_rows() -> ExpertRowRouting:
            send, recv = splits.tolist()
            capacity = (sum(recv) + L * align + align - 1) // align * align
            send[self.rank] = recv[self.rank] = 0
            return ExpertRowRouting(capacity, *kernels.expert_row_routing(tables, self.rank, W, capacity),
                                    splits=ExchangeSplits(send=send, recv=recv))

        return tables, expert_rows

    def _push_to_experts(self, push, src, meta, leg, fmt, factor, dot_rows, dot_out):  # noqa: ARG002 (rows on the wire)
        nbytes = staged_row_nbytes(src.shape[1], src.dtype, fmt)
        # Before the host has the splits (dispatch forward), the send buffer is sized for every
        # sorted row: the rows that leave this rank are at most all of them.
        rows = sum(meta.splits.send) if meta.expert_rows_known else meta.dst_rank.numel()
        send = LocalBuffer(torch.empty(rows * nbytes, dtype=torch.uint8, device=src.device), self.ep)
        push(None, send, rows, "remote")
        splits = meta.splits  # (waits for the host copy of the splits on the first dispatch leg)
        num_send, num_recv = sum(splits.send), sum(splits.recv)
        wire_stats.record(leg, num_send * nbytes)  # a staged row is its wire size
        received = funcol.all_to_all_single(
            send.local[: num_send * nbytes].view(num_send, nbytes), splits.recv, splits.send, self.group
        )
        # The rows that stay go straight into the expert-major tensor while the exchange runs.
        out = src.new_empty((meta.capacity, src.shape[1]))
        push(out, send, rows, "local")
        received = funcol.wait_tensor(received)
        return out, LocalBuffer(received.view(-1), self.ep), num_recv, meta.return_row, None

    def _send_buffer(self, src, meta, leg, fmt):
        rows = sum(meta.splits.recv)  # the token-bound direction sends what dispatch received
        nbytes = staged_row_nbytes(src.shape[1], src.dtype, fmt)
        wire_stats.record(leg, rows * nbytes)  # a staged row is its wire size
        return LocalBuffer(torch.empty(rows * nbytes, dtype=torch.uint8, device=src.device), self.ep), rows

    def _exchange(self, sent, rows, src, meta, fmt):
        send, recv = meta.splits.recv, meta.splits.send
        nbytes = staged_row_nbytes(src.shape[1], src.dtype, fmt)
        received = funcol.wait_tensor(
            funcol.all_to_all_single(sent.local.view(rows, nbytes), recv, send, self.group)
        )
        return LocalBuffer(received.view(-1), self.ep), sum(recv), meta.dst_row


class _HostCopy:
    """A small device tensor's values on the host: the copy is queued at construction (CUDA:
    into pinned memory, on the current stream, with an event behind it) and ``tolist`` waits
    for that copy alone, not for the work queued after it. The nccl transports' one host wait
    per layer; ``torch.cuda.set_sync_debug_mode`` does not flag an event wait, so the GPU tests
    count these waits (tests/test_dispatcher_gpu.py)."""

    def __init__(self, value: torch.Tensor):
        if value.is_cuda:
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = value, None

    def tolist(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


# --------------------------------------------------------------------------------------------
# autograd of the push transports


class _ToExperts(torch.autograd.Function):
    """Dispatch: tokens -> expert-major rows (scores applied here when they come first)."""

    @staticmethod
    def forward(ctx, x, factor, meta, disp):
        ctx.meta, ctx.disp = meta, disp
        ctx.save_for_backward(x, factor)
        return disp.to_experts(x.contiguous(), meta, "dispatch_fwd", factor=factor)

    @staticmethod
    def backward(ctx, grad):
        x, factor = ctx.saved_tensors
        meta, disp = ctx.meta, ctx.disp
        grad_factor = None
        if factor is not None and ctx.needs_input_grad[1]:
            grad_factor = torch.empty(factor.shape, dtype=torch.float32, device=grad.device)
        grad_x = disp.to_tokens(
            grad.contiguous(), meta, "dispatch_bwd", weight=factor,
            dot_with=x if grad_factor is not None else None, dot_out=grad_factor,
        )
        if grad_factor is not None:
            grad_factor = grad_factor.to(factor.dtype)
        return grad_x, grad_factor, None, None


class _ToTokens(torch.autograd.Function):
    """Combine: expert-major rows -> tokens (scores applied here when they come after)."""

    @staticmethod
    def forward(ctx, routed_output, weight, meta, disp):
        ctx.meta, ctx.disp = meta, disp
        routed_output = routed_output.contiguous()
        # The score gradient needs each row's output where the output gradient meets it. After
        # partial sums (symm, ``meta.row_score``) the rows stay on their experts' rank: keep
        # them there. Otherwise keep them on the token's rank (in the tokens' sorted order)
        # while reducing, instead of reading them back from peers.
        ctx.expert_rows = meta.row_score is not None
        save = None
        if weight is not None and weight.requires_grad:
            save = routed_output if ctx.expert_rows else routed_output.new_empty((meta.slot.numel(), routed_output.shape[1]))
        out = disp.to_tokens(routed_output, meta, "combine_fwd", weight=weight, save=None if ctx.expert_rows else save)
        ctx.save_for_backward(weight, save)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, save = ctx.saved_tensors
        meta, disp = ctx.meta, ctx.disp
        grad_weight = None
        if save is not None and ctx.needs_input_grad[1]:
            grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=grad.device)
        dots = dict(dot_local=save) if ctx.expert_rows else dict(dot_rows=save)
        grad_routed = disp.to_experts(
            grad.contiguous(), meta, "combine_bwd", factor=weight,
            **(dots if grad_weight is not None else {}), dot_out=grad_weight,
        )
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_routed, grad_weight, None, None
