"""Transport ``symm`` (one node): Triton kernels push each leg's rows straight into their
owner's staging buffer through peer memory (``peer_memory.PeerBuffer``), quantizing in that
push and dequantizing in the receiving pass; token counts travel the same way, so forward and
backward never wait for the host. The peer buffers are allocated once per (group, device, dim,
dtype, layout) and shared by every layer of that shape (``release_peer_buffers`` drops them).

The expert-major tensors hold an elastic capacity (``A2AConfig.capacity_factor`` times the
balanced case, ``capacity.expert_major_capacity``): a dispatch whose routing needs more rows
still stays in bounds (``routing.routing_tables``' ``row_limit``), and raises, on the device,
the rows its buffer set needed (``_SymmBuffers.needed``). At a step boundary
``grow_overflowed`` reads those counters once and grows each capacity that overflowed; the
caller runs the step again (``mxfp8_ep.elastic``). Without a caller that replays
(``expect_replays``), an overflow is an error (a device assert on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxfp8_ep import wire_stats
from mxfp8_ep.capacity import expert_major_capacity, grown_capacity, staging_rows, worst_case_capacity
from mxfp8_ep.dispatcher import checks
from mxfp8_ep.dispatcher.base import TokenDispatcher, register_transport
from mxfp8_ep.dispatcher.push import ExpertRowRouting, PushTokenDispatcher
from mxfp8_ep.peer_memory import PeerBuffer, int64_tensor
from mxfp8_ep.staging import staging_buffer_nbytes, staging_nbytes, token_map_offset
from mxfp8_ep.symm_reference import partial_slots, partial_stage_rows, partial_sums
from mxfp8_ep.transport import Transport


@dataclass
class _SymmBuffers:
    """Peer buffers of one (group, device, dim, dtype): a count buffer and two staging buffers
    that consecutive legs alternate between. Each staging buffer holds ``staging_rows`` rows,
    then (at ``map_offset``) a token map and row weights of ``capacity`` entries each
    (``staging.token_map``, ``row_weights``)."""

    counts: PeerBuffer
    staging: tuple[PeerBuffer, PeerBuffer]
    staging_rows: int
    max_tokens: int
    capacity: int  # rows of the expert-major tensor dispatch returns
    worst_case: int  # the drop-free worst case of those rows (``capacity.worst_case_capacity``)
    align: int  # each local expert's rows are padded to a multiple of this
    map_offset: int
    # (1,) int64 on the device: the most rows a dispatch through these buffers needed since
    # the counter was last read (``grow_overflowed``); above ``capacity``: an overflow.
    needed: torch.Tensor
    next_staging: int = 0

    def take_staging(self) -> PeerBuffer:
        # Leg j writes into staging j % 2. A peer writes into a buffer again only after the
        # barrier of leg j + 1, which this rank enters after it has read leg j's rows: every
        # rank runs the same sequence of legs on one stream, so no live data is overwritten.
        buf = self.staging[self.next_staging]
        self.next_staging ^= 1
        return buf


_BUFFERS: dict[tuple, _SymmBuffers] = {}
_GROWN: dict[tuple, int] = {}  # buffer key -> the capacity an overflow grew it to
_REPLAYS_EXPECTED = False


def expect_replays(on: bool) -> None:
    """Whether a caller reads the overflow counters at every step boundary and runs an
    overflowed step again (``mxfp8_ep.elastic``; every rank alike). Off (the default), a
    dispatch that needs more rows than its capacity is an error: at once on CPU or in debug
    mode, else a device assert (the process stops at its next sync)."""
    global _REPLAYS_EXPECTED
    _REPLAYS_EXPECTED = bool(on)


def overflow_counters() -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every buffer set's overflow counter and capacity, as two int64 device tensors (one entry
    per set, in ``grow_overflowed``'s order; no host sync), or None when this process holds
    no symm buffers."""
    if not _BUFFERS:
        return None
    sets = list(_BUFFERS.values())
    device = sets[0].needed.device
    return torch.cat([b.needed.to(device) for b in sets]), int64_tensor([b.capacity for b in sets], device)


def grow_overflowed(needed: list[int]) -> list[tuple[int, int]]:
    """After the counters were read (``needed``, in ``overflow_counters``' order): reset them,
    and grow each buffer set whose dispatches needed more rows than its capacity to that plus
    headroom (``capacity.grown_capacity``): its peer buffers are dropped and the next dispatch
    allocates them at the new capacity (a collective of its EP group, whose ranks all saw the
    same counts and grow alike). Returns ``(old, new)`` capacity per grown set. Every rank
    calls it at the same point, when no rank is in a leg."""
    grown = []
    for key, rows in zip(list(_BUFFERS), needed, strict=True):
        bufs = _BUFFERS[key]
        bufs.needed.zero_()
        if rows > bufs.capacity:
            new = grown_capacity(rows, bufs.worst_case, bufs.align)
            grown.append((bufs.capacity, new))
            _GROWN[key] = new
            del _BUFFERS[key]
    return grown


def capacities() -> list[int]:
    """The expert-major capacity of each buffer set this process holds (rows)."""
    return [b.capacity for b in _BUFFERS.values()]


def peer_buffer_nbytes() -> int:
    """Bytes of peer memory this process's symm dispatchers hold (its own count and staging
    buffers; symmetric memory is not the caching allocator's, so its statistics miss them)."""
    return sum(b.counts.nbytes + sum(s.nbytes for s in b.staging) for b in _BUFFERS.values())


def release_peer_buffers() -> None:
    """Drop the cached peer buffers and the capacities overflows grew; the next symm dispatch
    allocates them again (a collective). Every rank of the group calls it at the same point,
    when no rank is in a leg."""
    _BUFFERS.clear()
    _GROWN.clear()


class CapacityOverflowError(RuntimeError):
    """A symm dispatch needed more expert-major rows than its capacity, and no caller replays
    overflowed steps (``expect_replays``)."""


CAPACITY_ASSERT_MESSAGE = (
    "symm dispatch: more rows for a rank than A2AConfig.capacity_factor allows; run each step through "
    "mxfp8_ep.elastic.ReplayGuard, or set capacity_factor=None")


@register_transport(Transport.SYMM)
class SymmTokenDispatcher(PushTokenDispatcher):
    """Peer-memory push transport (one node): sync-free, quantizes inside the push. Each
    leg's rows go straight into the owner's staging buffer at the row the owner reads them
    from; a barrier makes them visible."""

    @dataclass(kw_only=True)
    class Config(TokenDispatcher.Config):
        """``TokenDispatcher.Config`` as this transport reads it (``Config.of``): the same
        fields, and which of its ways of sending a leg they select."""

        @property
        def dispatch_bwd_partial_sums(self) -> bool:
            """Whether dispatch's backward goes back as one partial sum per token and rank
            (``SymmTokenDispatcher._push_to_tokens``): with top-k > 1 and the scores after the
            experts, the plain sum of a token's rows on each rank. The x gradient then adds a
            token's rows in another grouping than the fused nccl transport, and rounds (bf16)
            or quantizes (MXFP8) each partial sum once instead of each row: equal to that
            rounding, not bits."""
            return self.top_k > 1 and not self.score_before_experts

        @property
        def combine_fwd_partial_sums(self) -> bool:
            """Whether combine's forward goes the same way (``dispatch_bwd_partial_sums`` and the
            flag ``A2AConfig.symm_combine_partial_sums``): the weighted sum of a token's rows on
            each rank (the scores ride along with dispatch's forward). The output then differs
            from the fused nccl transport's as the x gradient does, and the score gradients are
            taken where the expert outputs stayed, against the output gradient as it arrived
            there (MXFP8: dequantized), and go back to the tokens' ranks
            (``SymmTokenDispatcher.to_experts``)."""
            return self.dispatch_bwd_partial_sums and self.a2a.symm_combine_partial_sums

        @property
        def scores_after_dequantize(self) -> bool:
            """Whether a token is quantized before its router score multiplies it: with top-k >
            1 the weighted expert-bound leg (combine's backward when the scores come after the
            experts, dispatch's forward when they come first) sends each token once per rank and
            the experts' rank multiplies each row by its score as it receives it
            (``SymmTokenDispatcher._push_to_experts``). On a bf16 leg that is the same product,
            the same bits; on an MXFP8 leg the row is ``score * dequant(quant(token))`` where the
            fused nccl transport sends ``quant(score * token)``: equal to the format's rounding,
            not bits (every gradient downstream of combine's backward, or every value downstream
            of dispatch's forward)."""
            weighted = "dispatch_fwd" if self.score_before_experts else "combine_bwd"
            return self.top_k > 1 and self.a2a.wire_format(weighted).quantized

    def _buffer_key(self, device: torch.device, dim: int, dtype: torch.dtype) -> tuple:
        # The cached PeerBuffers hold the group, so its id cannot be reused while cached.
        cfg = self.config
        return (id(self.group), device, dim, dtype, cfg.top_k, self.num_local_experts, cfg.pad_multiple,
                cfg.combine_fwd_partial_sums, cfg.a2a.capacity_factor)

    def _buffers(self, device: torch.device, dim: int, dtype: torch.dtype, tokens: int) -> _SymmBuffers:
        """The peer buffers for (group, device, ``dim``, ``dtype``), allocated at the first
        dispatch (a collective: every rank builds the same dispatchers in the same order) and
        again, larger, when this dispatcher is configured for more tokens than they hold. Each
        allocation first checks that every rank allocates the same (``checks.agree``), which
        also gives the group's largest token count (``tokens``: this rank's)."""
        cfg = self.config
        key = self._buffer_key(device, dim, dtype)
        bufs = _BUFFERS.get(key)
        if bufs is None or (cfg.max_tokens_per_rank or 0) > bufs.max_tokens:
            facts = {"dim": dim, "dtype": str(dtype), "max_tokens_per_rank": cfg.max_tokens_per_rank,
                     "held_tokens": None if bufs is None else bufs.max_tokens, "grown": _GROWN.get(key)}
            gathered = checks.agree(self.group, "symm buffers", facts, local={"tokens": tokens})
            max_tokens = cfg.max_tokens_per_rank or max(g["tokens"] for g in gathered)
            shape = (max_tokens, cfg.top_k, self.ep, self.num_local_experts, cfg.pad_multiple)
            worst = worst_case_capacity(*shape)
            capacity = min(worst, max(expert_major_capacity(*shape, cfg.a2a.capacity_factor), _GROWN.get(key, 0)))
            rows = self._staging_rows(max_tokens, capacity, dim, dtype)
            map_offset = token_map_offset(rows, dim, dtype)
            # The rows' bytes also hold the score gradients combine's backward returns
            # (``_return_row_dots``): fp32, one per expert-major row of every rank.
            assert not cfg.combine_fwd_partial_sums or map_offset >= self.ep * capacity * 4
            nbytes = staging_buffer_nbytes(rows, dim, dtype, capacity)
            bufs = _SymmBuffers(
                # Per rank: its counts per expert, its token count and its fault word
                # (``checks.Fault``), checked by every rank.
                counts=PeerBuffer(self.ep * (cfg.num_experts + 2) * 8, self.group, device),
                staging=(PeerBuffer(nbytes, self.group, device), PeerBuffer(nbytes, self.group, device)),
                staging_rows=rows,
                max_tokens=max_tokens,
                capacity=capacity,
                worst_case=worst,
                align=cfg.pad_multiple,
                map_offset=map_offset,
                needed=torch.zeros(1, dtype=torch.int64, device=device),
            )
            _BUFFERS[key] = bufs
        return bufs

    def _staging_rows(self, max_tokens: int, capacity: int, dim: int, dtype: torch.dtype) -> int:
        """Rows a staging buffer holds (``capacity.staging_rows``): ``EP x max_tokens`` with
        top-k > 1 (plus each token's K rows when combine's forward goes row by row), the
        drop-free ``capacity`` with top-1."""
        cfg = self.config
        return staging_rows(self.ep, max_tokens, cfg.top_k, capacity, cfg.combine_fwd_partial_sums,
                            staging_nbytes(1, dim, dtype))

    def _routing(self, x_TD, checked, fault):  # noqa: ARG002, N803
        W, E, device = self.ep, self.config.num_experts, checked.counts.device
        dim, dtype = self._shape  # the tokens' shape the group agreed on (a faulty rank's x may have none)
        tokens = checked.expert_ids.numel() // self.config.top_k
        bufs = self._buffers(device, dim, dtype, tokens)
        if fault is None and tokens > bufs.max_tokens:
            error = ValueError(f"symm dispatch: a rank got more tokens than the buffers hold ({bufs.max_tokens} per "
                               f"rank); raise TokenDispatcher.Config.max_tokens_per_rank (rank {self.rank} got "
                               f"{tokens})")
            fault = checks.HostFault(checks.Fault.TOKENS, error)
            checked = checks.host_fault_routing(E, fault.fault, device)
        # Every rank's counts, token count and fault word into every rank's count table: a
        # rank whose input failed a check fails every rank after this exchange instead of
        # leaving its peers waiting in the next barrier. It raises its own error here; they
        # fail the check of the exchanged table (on CUDA a device-side assert, no host sync,
        # unless debug mode reads the table to name the rank and the check).
        kernels = self.kernels(device)
        kernels.push_counts(checked.counts, 0 if fault else tokens, bufs.counts, self.rank, checked.fault)
        bufs.counts.barrier()
        if fault is not None:
            raise fault.error
        table = bufs.counts.local[: W * (E + 2) * 8].view(torch.int64).view(W, E + 2)
        # Read before the next dispatch rewrites the count buffer: a peer pushes its next counts
        # only after this leg's staging barrier, which this rank reaches after these reads.
        tables, ok = kernels.routing_tables(table, self.rank, self.config.pad_multiple, bufs.max_tokens,
                                            bufs.capacity, bufs.needed)
        checks.assert_no_faults(table[:, E + 1], self.debug, E, ok=ok, where="symm dispatch")
        if not _REPLAYS_EXPECTED:
            self._assert_within_capacity(bufs)
        rows = ExpertRowRouting(bufs.capacity, *kernels.expert_row_routing(tables, self.rank, W, bufs.capacity))
        return tables, rows

    def _assert_within_capacity(self, bufs: _SymmBuffers) -> None:
        """No caller replays overflowed steps: a dispatch that needed more rows than the
        capacity fails (on CPU and in debug mode at once, naming the rows; else a device
        assert, no host sync)."""
        if bufs.needed.is_cuda and not self.debug:
            torch._assert_async(bufs.needed[0] <= bufs.capacity, CAPACITY_ASSERT_MESSAGE)
            return
        needed = int(bufs.needed[0])
        if needed > bufs.capacity:
            raise CapacityOverflowError(
                f"symm dispatch: a rank's expert-major tensor needs {needed} rows, its capacity is "
                f"{bufs.capacity} (A2AConfig.capacity_factor={self.config.a2a.capacity_factor}); run each step "
                f"through mxfp8_ep.elastic.ReplayGuard, which grows the capacity and runs the step again, or "
                f"set capacity_factor=None for the worst case ({bufs.worst_case} rows)")

    def _push_to_experts(self, push, src, meta, leg, fmt, weight, dot_with, dot_out, dot_with_expert_rows=False):
        """With top-k > 1 each token goes once per rank that owns one of its experts
        (``push_tokens``), not once per expert: at top-8 on 2 ranks, a quarter of the rows.
        The owner copies it into each of its expert rows in the receiving pass, through the
        token map the push wrote; on a weighted leg it multiplies each row by the router score
        the push left beside the map (on an MXFP8 leg: after dequantizing,
        ``Config.scores_after_dequantize``). The score gradients' dot products are taken
        in the same pass, on the token's rank (``dot_with``), or, after combine's partial sums,
        for the rows that stay only (``dot_with_expert_rows``). Dispatch's forward carries the router
        scores along for combine's partial sums (``Config.combine_fwd_partial_sums``): the owner
        keeps each row's score in ``meta.row_score``. Top-1 pushes row by row."""
        bufs = self._buffers_for(src)
        send = bufs.take_staging()
        staged = self._staged(send, bufs.staging_rows, fmt, tokens_per_rank=bufs.max_tokens,
                              map_offset=bufs.map_offset, map_rows=bufs.capacity)
        out = src.new_empty((meta.capacity, src.shape[1]))
        row_bytes = wire_stats.row_bytes(src.shape[1], src.element_size(), fmt)
        stage_row = row_weight = None
        carried = None  # the router scores dispatch's forward takes along, unapplied
        if leg == "dispatch_fwd" and self.config.combine_fwd_partial_sums:
            carried = meta.topk_scores_TK.detach().reshape(-1)
        if self.config.top_k > 1:
            sent = torch.zeros(1, dtype=torch.int64, device=src.device)
            self.kernels(src.device).push_tokens(
                staged, src, sorted_row=meta.sorted_row, dst_rank=meta.dst_rank, dst_row=meta.dst_row, local_out=out,
                top_k=self.config.top_k, sent=sent, weight=weight if weight is not None else carried,
                weigh_local=weight is not None, dot_with=dot_with, dot_out=dot_out,
                dot_with_expert_rows=dot_with_expert_rows,
            )
            wire_stats.record_rows(leg, sent[0], row_bytes)
            stage_row = staged.token_map(send.local)
            if weight is not None:
                row_weight = staged.row_weights(send.local)
        else:
            wire_stats.record_rows(leg, (meta.dst_rank != self.rank).sum(), row_bytes)
            push(out, staged, "all")  # one pass: local HBM copies beside NVLink stores
        send.barrier()  # the peers' pushes (rows, token maps, row weights) into this rank's staging buffer are visible
        if stage_row is not None and leg == "dispatch_fwd" and self.config.dispatch_bwd_partial_sums:
            # Which token each row came from, for the partial sums of dispatch's backward: a
            # copy, since the staging buffer (and its map) serves the next legs.
            remote = (meta.row_source >= 0) & (meta.row_source != self.rank)
            meta.row_slot = torch.where(remote, stage_row, self.ep * bufs.max_tokens)
            meta.slot_tokens = bufs.max_tokens
            if carried is not None:
                meta.row_score = self._row_scores(carried, meta, remote, staged.row_weights(send.local))
        return out, staged, stage_row, row_weight

    def _row_scores(self, scores, meta, remote, carried):
        """Per expert-major row, the router score of its slot (fp32): carried by the push for a
        row a peer sent, this rank's own score for a row that stayed, 0 elsewhere. Device ops."""
        capacity = meta.capacity
        stays = torch.where(meta.dst_rank == self.rank, meta.dst_row, capacity)  # capacity: no row here
        own = torch.zeros(capacity + 1, dtype=torch.float32, device=scores.device)
        own.scatter_(0, stays, scores[meta.slot].float())
        return torch.where(remote, carried, own[:capacity])

    def to_experts(self, src, meta, leg, weight=None, dot_with=None, dot_out=None, dot_with_expert_rows=False):
        """Combine's backward after its partial sums (``dot_with_expert_rows``: ``dot_with`` holds
        the expert outputs, which stayed on their rank): the score gradient of a row that stays is taken in the push;
        of a row that a peer's token sent, by the receiving pass, against the output gradient
        as it arrived (MXFP8: dequantized, before its score multiplies it), and then returned
        to the token's rank (``_return_row_dots``)."""
        if not dot_with_expert_rows:
            return super().to_experts(src, meta, leg, weight, dot_with, dot_out)
        kernels, fmt = self.kernels(src.device), getattr(self.config.a2a, leg)
        if self._observing(leg):
            self._observe(leg, *self._wire_rows_to_experts(src, meta, weight))
        out, received, stage_row, row_weight = self._push_to_experts(
            None, src, meta, leg, fmt, weight, dot_with, dot_out, dot_with_expert_rows=True,
        )
        row_dots = torch.zeros(meta.capacity, dtype=torch.float32, device=src.device)
        kernels.receive_rows(received, out, source=meta.row_source, stage_row=stage_row, weight=row_weight,
                             dot_with=dot_with, dot_out=row_dots)
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
                send.peer(peer)[: W * capacity * 4].view(torch.float32)[
                    self.rank * capacity : (self.rank + 1) * capacity].copy_(row_dots)
        wire_stats.record("combine_bwd", (W - 1) * capacity * 4)
        send.barrier()  # the peers' score gradients are in this rank's staging buffer
        returned = send.local[: W * capacity * 4].view(torch.float32)
        n = meta.sorted_row[: dot_out.numel()]
        owner = meta.dst_rank[n]
        theirs = returned[owner.clamp(min=0) * capacity + meta.dst_row[n]]
        dot_out.copy_(torch.where(owner != self.rank, theirs, dot_out))

    def _push_to_tokens(self, src, meta, leg, fmt):
        """A token-bound leg whose rows' tokens this rank knows (``meta.row_slot``: dispatch's
        forward sent tokens once) goes back as one partial sum per token and rank
        (``push_partials``), not row by row: at top-8 on 2 ranks a quarter of the rows. The
        token's rank adds it once, at the token's first slot on that rank. Those legs, when
        the scores follow the experts (DeepSeek-V3): dispatch's backward, a plain sum
        (``Config.dispatch_bwd_partial_sums``), and combine's forward, each row times its score
        (``meta.row_score``; the token's rank weights only the rows that stayed;
        ``Config.combine_fwd_partial_sums``). On an MXFP8 leg the partial sum is quantized,
        not each row."""
        if not self._sends_partials(meta, leg):
            return super()._push_to_tokens(src, meta, leg, fmt)
        weighted = leg == "combine_fwd"
        bufs = self._buffers_for(src)
        staged = self._staged(bufs.take_staging(), bufs.staging_rows, fmt, tokens_per_rank=meta.slot_tokens)
        order, start = self._partial_order(meta)
        sent = torch.zeros(1, dtype=torch.int64, device=src.device)
        self.kernels(src.device).push_partials(
            staged, src, order=order, start=start, sent=sent,
            max_rows=self.config.top_k,  # a token lists an expert up to top_k times
            weight=meta.row_score if weighted else None,
        )
        wire_stats.record_rows(leg, sent[0], wire_stats.row_bytes(src.shape[1], src.element_size(), fmt))
        stage_row = partial_stage_rows(meta.sorted_row, meta.dst_rank, self.rank, self.config.top_k, meta.slot_tokens)
        staged.staging.barrier()  # the peers' partial sums into this rank's staging buffer are visible
        return staged, stage_row, weighted

    @staticmethod
    def _sends_partials(meta, leg) -> bool:
        """Whether token-bound ``leg`` goes as partial sums (``_push_to_tokens``)."""
        return meta.row_slot is not None and (leg != "combine_fwd" or meta.row_score is not None)

    def _partial_order(self, meta):
        """``partial_slots`` of the dispatch's rows: grouped once, for both token-bound legs."""
        if meta.partial_order is None:
            meta.partial_order = partial_slots(meta.row_slot, self.ep * meta.slot_tokens)
        return meta.partial_order

    def _wire_rows_to_experts(self, src, meta, weight):
        """With top-k > 1 (``push_tokens``) each token a peer needs goes once, unweighted: the
        owner multiplies each row by its score after decoding it. Top-1: row by row."""
        if self.config.top_k == 1:
            return super()._wire_rows_to_experts(src, meta, weight)
        n = meta.sorted_row[: src.shape[0] * self.config.top_k].view(src.shape[0], self.config.top_k)
        return src, self._crossing((meta.dst_rank[n] != self.rank).any(dim=1))

    def _wire_rows_to_tokens(self, src, meta, leg):
        """After partial sums (``_sends_partials``) the leg sends one per token of another rank
        and this rank (``symm_reference.partial_sums``; combine's forward weighted by the router
        scores); taken over the other ranks' token slots (this rank's own never go). With
        ``quantize_local_rows`` also the rows that stay, which take the round trip unweighted."""
        if not self._sends_partials(meta, leg):
            return super()._wire_rows_to_tokens(src, meta, leg)
        order, start = self._partial_order(meta)
        values, sent = partial_sums(src, order, start, self.rank, self.config.top_k, meta.slot_tokens,
                                    weight=meta.row_score if leg == "combine_fwd" else None)
        own = slice(self.rank * meta.slot_tokens, (self.rank + 1) * meta.slot_tokens)
        others = [torch.cat([t[: own.start], t[own.stop :]]) for t in (values, sent)]
        out = [(others[0], others[1])]
        if self.config.a2a.quantize_local_rows:
            out.append((src, meta.row_source == self.rank))
        return out

    def _send_buffer(self, src, meta, leg, fmt):
        wire_stats.record_rows(leg, (meta.return_rank >= 0).sum(),
                               wire_stats.row_bytes(src.shape[1], src.element_size(), fmt))
        bufs = self._buffers_for(src)
        return self._staged(bufs.take_staging(), bufs.staging_rows, fmt)

    def _exchange(self, sent, src, meta):  # noqa: ARG002 (the peers pushed already)
        sent.staging.barrier()  # the peers' pushes into this rank's staging buffer are visible
        return sent, None

    def _buffers_for(self, src: torch.Tensor) -> _SymmBuffers:
        return _BUFFERS[self._buffer_key(src.device, src.shape[1], src.dtype)]

