"""What the push transports (``symm``, and ``nccl`` with an MXFP8 leg) share: the routing
metadata of a dispatch, each leg as one push -> the transport's exchange -> one receiving pass,
and the autograd functions that run the four legs (``_ToExperts``, ``_ToTokens``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mxfp8_ep.dispatcher.base import TokenDispatcher
from mxfp8_ep.kernels.quantize import resolve_kernel
from mxfp8_ep.exchange.routing import to_peer
from mxfp8_ep.exchange.staging import StagedLeg


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
    buffers: object | None = None  # symm: the buffer set every leg of the dispatch uses
    # symm: the replay scopes the dispatch counted in (innermost last), and the rows its routing
    # gives this rank's expert-major tensor before any cut ((1,) int64 on the device)
    scopes: tuple = ()
    own_rows: torch.Tensor | None = None


@dataclass
class PushDispatchMetadata:
    """Routing of one dispatch, for its combine and both backwards. A row that crosses ranks is
    addressed where its receiver reads it: symm, in the receiver's staging buffer (which peers
    write into); nccl, in the rank-major all-to-all buffers (``routing.exchange_tables``).

    The expert-side routing (``expert_rows``) may be pending: a function that returns it when
    first needed (nccl: it waits for the splits on the host, so the device work queued before
    that wait keeps the GPU busy through it)."""

    slot: torch.Tensor  # (N,) token * K + k of each expert-sorted row
    sorted_row: torch.Tensor  # (N,) expert-sorted row of each slot
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
    # symm with combine's partial sums (``SymmTokenDispatcher.Config.combine_fwd_partial_sums``):
    # per expert-major row, the router score of its slot (fp32; 0 for rows that hold no slot),
    # carried by dispatch.
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
    (``_push_to_tokens``: partial sums). A buffer a leg's kernels push into or read from
    travels as a ``staging.StagedLeg`` (``_staged``)."""

    def kernels(self, device: torch.device):
        if resolve_kernel(self.config.a2a.kernel, device) == "triton":
            from mxfp8_ep.exchange import symm_kernels as kernels
        else:
            from mxfp8_ep.exchange import symm_reference as kernels
        return kernels

    def _routing(self, x_TD, checked, fault):  # noqa: N803
        """Exchange the token counts (``checked.counts``) with every rank's fault word
        (``checked.fault``): this rank's routing tables and the expert-row routing (or a
        function that returns it when first needed). Raises, on every rank, when a rank's
        fault word is set; this rank's host ``fault`` (its routing then empty) right after
        the exchange."""
        raise NotImplementedError

    def _staged(self, staging, rows: int, fmt: str, **token_layout) -> StagedLeg:
        """A leg in ``fmt`` whose rows wait in ``staging`` (``rows`` of them), as this
        dispatcher's kernels take it (``token_layout``: symm's token-major rows)."""
        a2a = self.config.a2a
        return StagedLeg(staging=staging, rows=rows, rank=self.rank, fmt=fmt, rounding=a2a.scale_rounding,
                         quantize_local=a2a.quantize_local_rows, shapes=self.config.kernel_shapes(fmt),
                         **token_layout)

    def _push_to_experts(self, push, src, meta, leg, fmt, weight, dot_with, dot_out, dot_with_expert_rows=False):
        """Run ``push(out, staged, pushed)`` (``push_rows`` of this leg's sorted rows into
        ``staged``, a ``StagedLeg``) and the exchange: the fresh expert-major tensor ``out``, the
        leg this rank reads the rows from, the staged row of each row read (``stage_row``, None:
        the same row) and the weight the receiving pass applies to each (None: none). ``weight``,
        ``dot_with``, ``dot_out``, ``dot_with_expert_rows``: what ``push`` does to the rows
        (``push_rows``), for a transport that pushes another way (symm: each token once per
        rank)."""
        raise NotImplementedError

    def _send_buffer(self, src, meta, leg, fmt) -> StagedLeg:
        """Where a token-bound ``leg`` pushes its rows; records the wire bytes."""
        raise NotImplementedError

    def _exchange(self, sent: StagedLeg, src, meta) -> tuple[StagedLeg, torch.Tensor | None]:
        """After a token-bound push into ``sent``: the leg this rank reads the rows from, and the
        staged row of each row read (``stage_row``, None: the same row)."""
        raise NotImplementedError

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E):  # noqa: N803
        checked, fault = self._checked_routing(x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E)
        cfg = self.config
        kernels = self.kernels(x_TD.device)
        with torch.no_grad():
            slot = torch.argsort(checked.expert_ids, stable=True)
            tables, expert_rows = self._routing(x_TD, checked, fault)
            dst_rank, dst_row, sorted_row = kernels.sorted_row_routing(
                tables, slot, checked.expert_ids, self.num_local_experts
            )
        meta = PushDispatchMetadata(
            slot=slot, sorted_row=sorted_row, dst_rank=dst_rank, dst_row=dst_row, topk_scores_TK=topk_scores_TK,
            num_tokens=x_TD.shape[0], pending_expert_rows=expert_rows,
        )
        weight = topk_scores_TK.reshape(-1) if cfg.score_before_experts else None
        routed_input = _ToExperts.apply(x_TD, weight, meta, self)
        return routed_input, tables.tokens_per_local_expert, meta

    def combine(self, routed_output, metadata: PushDispatchMetadata):
        weight = None if self.config.score_before_experts else metadata.topk_scores_TK.reshape(-1)
        return _ToTokens.apply(routed_output, weight, metadata, self)

    # The two directions. Expert-bound: dispatch forward, combine backward. Token-bound:
    # combine forward, dispatch backward.

    def to_experts(self, src, meta, leg, weight=None, dot_with=None, dot_out=None, dot_with_expert_rows=False):
        """Sorted rows (read from ``src`` by token) -> a fresh ``(capacity, D)`` expert-major
        tensor on their owners, each times its ``weight`` (per slot) when given. ``leg``:
        dispatch_fwd or combine_bwd. ``dot_with``: the rows the score gradients ``dot_out`` take
        their dot products with, one per sorted row, or with ``dot_with_expert_rows`` this
        rank's expert-major rows (symm after combine's partial sums)."""
        if dot_with_expert_rows:
            raise NotImplementedError(f"{type(self).__name__} takes its score gradients on the token's rank")
        kernels, fmt = self.kernels(src.device), getattr(self.config.a2a, leg)
        if self._observing(leg):
            self._observe(leg, *self._wire_rows_to_experts(src, meta, weight))

        def push(out, staged, pushed):
            kernels.push_rows(staged, src, dst_rank=meta.dst_rank, dst_row=meta.dst_row, local_out=out, slot=meta.slot,
                              top_k=self.config.top_k, weight=weight, dot_with=dot_with, dot_out=dot_out, pushed=pushed)

        out, received, stage_row, row_weight = self._push_to_experts(push, src, meta, leg, fmt, weight, dot_with,
                                                                     dot_out)
        kernels.receive_rows(received, out, source=meta.row_source, stage_row=stage_row, weight=row_weight)
        return out

    def to_tokens(self, src, meta, leg, weight=None, save=None, dot_with=None, dot_out=None):
        """Expert-major rows (``src``) -> ``(T, D)``: each token's K rows reduced in fp32.
        ``leg``: combine_fwd or dispatch_bwd."""
        kernels, fmt = self.kernels(src.device), getattr(self.config.a2a, leg)
        if self._observing(leg):
            for rows, valid in self._wire_rows_to_tokens(src, meta, leg):
                self._observe(leg, rows, valid)
        received, stage_row, staged_weighted = self._push_to_tokens(src, meta, leg, fmt)
        out = src.new_empty((meta.num_tokens, src.shape[1]))
        kernels.reduce_slots(
            received, out, sorted_row=meta.sorted_row, row_rank=meta.dst_rank, local_row=meta.dst_row, local_src=src,
            top_k=self.config.top_k, weight=weight, save=save, dot_with=dot_with, dot_out=dot_out,
            stage_row=stage_row, weigh_staged=not staged_weighted,
        )
        return out

    # What each leg quantizes, for the numerics telemetry: the rows the push encodes, and which
    # of them (``valid``) it encodes (the rows that leave this rank; every row with data under
    # ``A2AConfig.quantize_local_rows``, whose rows that stay take the same round trip).

    def _crossing(self, leaves: torch.Tensor) -> torch.Tensor | None:
        return None if self.config.a2a.quantize_local_rows else leaves

    def _wire_rows_to_experts(self, src, meta, weight):
        """An expert-bound leg (``push_rows``): each sorted row's token, times the row's
        ``weight`` when the leg weighs (rounded to the activation dtype, as pushed)."""
        rows = src[meta.slot // self.config.top_k]
        if weight is not None:
            rows = (rows.float() * weight[meta.slot].unsqueeze(1)).to(src.dtype)
        return rows, self._crossing(to_peer(meta.dst_rank, self.rank))

    def _wire_rows_to_tokens(self, src, meta, leg):  # noqa: ARG002 (symm's partial sums depend on it)
        """A token-bound leg (``push_rows``): ``(rows, valid)`` pairs, here one, the expert-major
        rows as they are (the token's rank weighs them as it adds them up)."""
        crossing = self._crossing(meta.return_rank >= 0)
        return [(src, meta.row_source >= 0 if crossing is None else crossing)]

    def _push_to_tokens(self, src, meta, leg, fmt):
        """Push a token-bound leg's rows (``push_rows``) and exchange them: the leg this rank
        reads them from, the staged row of each sorted row (``stage_row``, None: the same row),
        and whether the staged rows come weighted already."""
        sent = self._send_buffer(src, meta, leg, fmt)
        self.kernels(src.device).push_rows(sent, src, dst_rank=meta.return_rank, dst_row=meta.return_row)
        return (*self._exchange(sent, src, meta), False)



class _ToExperts(torch.autograd.Function):
    """Dispatch: tokens -> expert-major rows (scores applied here when they come first)."""

    @staticmethod
    def forward(ctx, x, weight, meta, disp):
        ctx.meta, ctx.disp = meta, disp
        ctx.save_for_backward(x, weight)
        return disp.to_experts(x.contiguous(), meta, "dispatch_fwd", weight=weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        meta, disp = ctx.meta, ctx.disp
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=grad.device)
        grad_x = disp.to_tokens(
            grad.contiguous(), meta, "dispatch_bwd", weight=weight,
            dot_with=x if grad_weight is not None else None, dot_out=grad_weight,
        )
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_x, grad_weight, None, None


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
            save = (routed_output if ctx.expert_rows
                    else routed_output.new_empty((meta.slot.numel(), routed_output.shape[1])))
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
        grad_routed = disp.to_experts(
            grad.contiguous(), meta, "combine_bwd", weight=weight,
            dot_with=save if grad_weight is not None else None, dot_out=grad_weight,
            dot_with_expert_rows=ctx.expert_rows and grad_weight is not None,
        )
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_routed, grad_weight, None, None
