"""Triton kernels of the symm transport. Each has a torch twin of the same name and arguments
in ``symm_reference.py`` (read its docstring for the arithmetic, ``staging.py``'s for the staging
layout); the two give the same bits. A leg's kernels take what they share as one
``staging.StagedLeg`` (its staging buffer and layout, this rank, its wire format, scale rounding
and launch shapes), then their rows and routing as named arguments. Peers' buffers arrive as an
int64 tensor of addresses. A leg's wire format reaches the kernels as its constants
(``WireFormat.kernel_constants``), its launch shape from the leg (``launch_shapes``).

* ``push_rows``: one pass per leg on the sending side. Each row is read once (gathered by
  token for the expert-bound legs), optionally weighted, and stored either into this rank's
  own expert-major tensor (rows that stay: not quantized, unless ``quantize_local``) or into
  the owning rank's staging buffer, quantized to MXFP8 in registers when the leg is MXFP8.
* ``push_tokens``: the sending side of an expert-bound leg with top-k > 1 (symm): each token
  is read once and goes, quantized once, to every other rank that owns one of its experts
  (once per rank, not once per expert); its rows that stay are copied (weighted) into the
  expert-major tensor, and each row bound for a peer writes the token's staged row into that
  peer's token map and its routing weight into the peer's row weights.
* ``receive_rows``: the receiving side of the expert-bound legs: dequantizes peers' rows into
  the fresh expert-major tensor the grouped GEMM reads (each row from the staged row its index,
  or the token map, names; times its row weight after a weighted token-once push), and zeroes
  the padding rows.
* ``reduce_slots``: the receiving side of the token-bound legs: for each token, dequantizes its
  K rows (or reads them from this rank's expert output) and reduces them in fp32.

``quantize_local`` (``A2AConfig.quantize_local_rows``; ``push_rows``, ``push_tokens``,
``reduce_slots``): the rows that stay on this rank are encoded and decoded in registers as a
peer would have received them; off, the kernels compile to what they were without it.

The nccl transport runs the same kernels around an all-to-all (``dispatcher``): ``push_rows``
into a local send buffer (every peer offset 0), the receiving passes from the receive buffer,
each row read at the staged row its ``stage_row`` index names.

No kernel reads a device value on the host: grids are sized from static capacities and rows a
kernel must skip are marked in the index tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfp8_ep.kernels.launch_shapes import LaunchShape
from mxfp8_ep.exchange.routing import RoutingTables
from mxfp8_ep.exchange.staging import StagedLeg
from mxfp8_ep.exchange.symm_reference import pushed_rows_index
from mxfp8_ep.kernels.triton_kernels import (
    _decode_groups,
    _encode_groups,
    _load_decoded,
    _load_fp32,
    _packed_offsets,
    _round_to_activation,
    _store_encoded,
    _store_fp32,
    rounding_code,
)
from mxfp8_ep.format.wire_format import ELEMENT_ACTIVATION, WireFormat

# A leg whose rows travel as they are (``WireFormat.kernel_constants``' ELEMENT).
_ACTIVATION = tl.constexpr(ELEMENT_ACTIVATION)
ROUTING_BLOCK = 1024
# A row limit that never binds (``RoutingTables.row_limit`` None: the nccl transport).
NO_ROW_LIMIT = 2**62


@triton.jit
def _push_counts_kernel(counts_ptr, fault_ptr, peer_ptrs, rank, tokens, NUM: tl.constexpr, BLOCK: tl.constexpr):
    peer = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = tl.load(peer_ptrs + peer).to(tl.pointer_type(tl.int64))
    row = tl.load(counts_ptr + offs, mask=offs < NUM, other=0)
    row = tl.where(offs == NUM, tokens, row)
    row = tl.where(offs == NUM + 1, tl.load(fault_ptr), row)
    tl.store(base + rank * (NUM + 2) + offs, row, mask=offs <= NUM + 1)


@triton.jit
def _routing_tables_kernel(table_ptr, out_ptr, needed_ptr, rank, align, max_tokens, row_limit,
                           W: tl.constexpr, L: tl.constexpr, WP: tl.constexpr, LP: tl.constexpr,
                           HAS_NEEDED: tl.constexpr):
    """One program: ``routing.routing_tables`` of the ``(W, E + 2)`` count table (every rank's
    counts per expert, its token count, its fault word), packed into ``out`` in
    ``RoutingTables`` field order (the padded sizes cut at ``row_limit``, the capacity rounded
    down to ``align``), then the flag ``every rank's tokens <= max_tokens and fault word 0``.
    ``HAS_NEEDED``: ``needed`` rises to the rows the largest expert-major tensor needs."""
    E: tl.constexpr = W * L
    S: tl.constexpr = (W + 1) * L
    s3 = tl.arange(0, WP)[:, None, None]
    d3 = tl.arange(0, WP)[None, :, None]
    l3 = tl.arange(0, LP)[None, None, :]
    c = tl.load(table_ptr + s3 * (E + 2) + d3 * L + l3, mask=(s3 < W) & (d3 < W) & (l3 < L), other=0)  # [s, d, l]
    d2 = tl.arange(0, WP)[:, None]  # rows of [d, l] and of [s, l]
    l2 = tl.arange(0, LP)[None, :]
    ok2 = (d2 < W) & (l2 < L)
    total = tl.sum(c, axis=0)  # [d, l]: rows every source sends expert d*L + l
    m_size = tl.where(ok2, (tl.maximum(total, align) + align - 1) // align * align, 0)
    if HAS_NEEDED:
        tl.atomic_max(needed_ptr, tl.max(tl.sum(m_size, axis=1), axis=0))
    dst_base = tl.cumsum(m_size, axis=1) - m_size + tl.sum(tl.where(s3 < rank, c, 0), axis=0)
    tl.store(out_ptr + d2 * L + l2, dst_base, mask=ok2)
    mine_row = tl.sum(tl.where(s3 == rank, c, 0), axis=0)  # [d, l]: this rank's counts
    before_d = tl.cumsum(tl.sum(mine_row, axis=1), axis=0) - tl.sum(mine_row, axis=1)
    first_row = before_d[:, None] + tl.cumsum(mine_row, axis=1) - mine_row
    tl.store(out_ptr + E + d2 * L + l2, first_row, mask=ok2)
    # This rank's segments: per local expert l, the W sources' rows, then its padding.
    mine = tl.sum(tl.where(d3 == rank, c, 0), axis=1)  # [s, l]: rows source s sends local expert l
    m_rank = tl.sum(tl.where(d2 == rank, m_size, 0), axis=0)  # [l]
    pad = m_rank - tl.sum(mine, axis=0)
    start = tl.cumsum(m_rank, axis=0) - m_rank
    s2 = d2
    seg = l2 * (W + 1) + s2
    lp = tl.arange(0, LP)
    pad_seg = lp * (W + 1) + W
    l_ok = lp < L
    tl.store(out_ptr + 2 * E + seg, mine, mask=ok2)
    tl.store(out_ptr + 2 * E + pad_seg, pad, mask=l_ok)
    tl.store(out_ptr + 2 * E + S + seg, start[None, :] + tl.cumsum(mine, axis=0), mask=ok2)
    tl.store(out_ptr + 2 * E + S + pad_seg, start + m_rank, mask=l_ok)
    # Each source's first sorted row bound for (this rank, l): its rows for the experts before.
    before = tl.sum(tl.sum(tl.where(d3 < rank, c, 0), axis=2), axis=1)  # [s]
    origin = before[:, None] + tl.cumsum(mine, axis=1) - mine
    tl.store(out_ptr + 2 * E + 2 * S + seg, origin, mask=ok2)
    tl.store(out_ptr + 2 * E + 2 * S + pad_seg, tl.zeros_like(pad), mask=l_ok)
    end = tl.cumsum(m_rank, axis=0)
    tl.store(out_ptr + 2 * E + 3 * S + lp, tl.minimum(end, row_limit) - tl.minimum(end - m_rank, row_limit), mask=l_ok)
    s1 = tl.arange(0, WP)
    tokens = tl.load(table_ptr + s1 * (E + 2) + E, mask=s1 < W, other=0)
    fault = tl.load(table_ptr + s1 * (E + 2) + E + 1, mask=s1 < W, other=0)
    ok = tl.sum(((tokens <= max_tokens) & (fault == 0) & (s1 < W)).to(tl.int64), axis=0) == W
    tl.store(out_ptr + 2 * E + 3 * S + L, ok.to(tl.int64))


# Tiles are [rows, BLOCK_D // GROUP, GROUP] (GROUP: the wire format's, ``WireFormat.kernel_constants``):
# one scale block per innermost row, so encoding and decoding need no layout change, and the
# innermost GROUP elements are contiguous in memory.


@triton.jit
def _cols(start, GROUP: tl.constexpr, BLOCK_D: tl.constexpr):
    """[1, BLOCK_D // GROUP, GROUP] column indices of the tile that starts at column ``start``."""
    groups = tl.arange(0, BLOCK_D // GROUP)
    return start + groups[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]


@triton.jit
def _mask(row_ok, cols, D: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile mask. When BLOCK_D divides D the columns need no mask: the mask is then constant
    along each row, which lets loads and stores use 16-byte vectors."""
    if D % BLOCK_D == 0:
        mask = row_ok[:, None, None] & tl.full((1, BLOCK_D // GROUP, GROUP), 1, tl.int1)
    else:
        mask = row_ok[:, None, None] & (cols < D)
    return mask


@triton.jit
def _load_tile(ptr, rows, cols, mask, D: tl.constexpr, IN_BF16: tl.constexpr):
    return _load_fp32(ptr, rows[:, None, None].to(tl.int64) * D + cols, mask, IN_BF16)


@triton.jit
def _store_tile(ptr, rows, cols, value, mask, D: tl.constexpr, IN_BF16: tl.constexpr):
    _store_fp32(ptr, rows[:, None, None].to(tl.int64) * D + cols, value, mask, IN_BF16)


@triton.jit
def _store_staged_tile(stage_ptr, peer, rows, row_ok, cols, start, value, D: tl.constexpr, IN_BF16: tl.constexpr,
                       ELEMENT: tl.constexpr, SCALE: tl.constexpr, ROUNDING: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """A tile of ``rows`` (where ``row_ok``) into the staging buffers of each row's peer
    (``stage_ptr + peer``, element offsets): in the activation dtype, or encoded in the wire
    format (element bytes, then the row's scale bytes)."""
    mask = _mask(row_ok, cols, D, GROUP, BLOCK_D)
    if ELEMENT != _ACTIVATION:
        elements, scales = _encode_groups(value, ELEMENT, SCALE, ROUNDING)
        doffs, soffs, sok = _packed_offsets(rows, cols, start, D, GROUP, BLOCK_D, ELEMENT, SCALE)
        _store_encoded(stage_ptr, peer[:, None, None], peer[:, None], doffs, soffs, elements, scales, mask,
                       row_ok[:, None] & sok, ELEMENT, SCALE)
    else:
        _store_tile(stage_ptr + peer[:, None, None], rows, cols, value, mask, D, IN_BF16)


@triton.jit
def _round_trip_tile(value, IN_BF16: tl.constexpr, ELEMENT: tl.constexpr, SCALE: tl.constexpr,
                     ROUNDING: tl.constexpr):
    """A tile's values encoded in the wire format and decoded again, as a receiving pass writes
    them (the rows that stay, under ``A2AConfig.quantize_local_rows``); unencoded formats: as
    they are."""
    if ELEMENT != _ACTIVATION:
        elements, scales = _encode_groups(value, ELEMENT, SCALE, ROUNDING)
        value = _round_to_activation(_decode_groups(elements, scales, ELEMENT, SCALE), IN_BF16)
    return value


@triton.jit
def _push_rows_kernel(
    src_ptr, slot_ptr, weight_ptr, dot_with_ptr, dot_out_ptr,
    dst_rank_ptr, dst_row_ptr, local_out_ptr, stage_ptr, peer_delta_ptr,
    M, rank,
    D: tl.constexpr, TOP_K: tl.constexpr, HAS_SLOT: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_DOT: tl.constexpr, IN_BF16: tl.constexpr, ELEMENT: tl.constexpr, SCALE: tl.constexpr, GROUP: tl.constexpr,
    ROUNDING: tl.constexpr,
    QUANTIZE_LOCAL: tl.constexpr, PUSHED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    STRIPES: tl.constexpr, STAGES: tl.constexpr,
):
    # Program p takes block (p % STRIPES) * per_stripe + p // STRIPES (the grid is a multiple
    # of STRIPES; blocks past the rows find no active row).
    pid = tl.program_id(0)
    block = (pid % STRIPES) * (tl.num_programs(0) // STRIPES) + pid // STRIPES
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dst_rank = tl.load(dst_rank_ptr + rows, mask=rows < M, other=-1)
    if PUSHED == 1:  # the rows that stay
        dst_rank = tl.where(dst_rank == rank, dst_rank, -1)
    elif PUSHED == 2:  # the rows that leave
        dst_rank = tl.where(dst_rank != rank, dst_rank, -1)
    active = dst_rank >= 0
    if tl.max(active.to(tl.int32), axis=0) == 0:
        return
    dst_row = tl.load(dst_row_ptr + rows, mask=active, other=0).to(tl.int64)
    if HAS_SLOT:
        slot = tl.load(slot_ptr + rows, mask=active, other=0)
        src_row = slot // TOP_K
    else:
        slot = rows
        src_row = rows
    is_local = active & (dst_rank == rank)
    remote = active & (dst_rank != rank)
    # A peer's staging buffer = this rank's staging pointer + an element offset. Allocations are
    # 16-byte aligned; saying so lets the stores to peers use 16-byte vectors.
    peer = tl.multiple_of(tl.load(peer_delta_ptr + dst_rank, mask=remote, other=0), 16)
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + slot, mask=active, other=0.0)
    # The expert-sorted rows come grouped by owner, so most blocks hold only rows that stay or
    # only rows that leave: each path (the local store; the quantize and the peer store) runs
    # only in blocks that have rows for it.
    any_local = tl.max(is_local.to(tl.int32), axis=0) > 0
    any_remote = tl.max(remote.to(tl.int32), axis=0) > 0
    dot = tl.zeros((BLOCK_M,), tl.float32)
    for start in tl.range(0, D, BLOCK_D, num_stages=STAGES):
        cols = _cols(start, GROUP, BLOCK_D)
        x = _load_tile(src_ptr, src_row, cols, _mask(active, cols, D, GROUP, BLOCK_D), D, IN_BF16)
        if HAS_DOT:
            other = _load_tile(dot_with_ptr, rows, cols, _mask(active, cols, D, GROUP, BLOCK_D), D, IN_BF16)
            dot += tl.sum(tl.sum(other * x, axis=2), axis=1)
        if HAS_WEIGHT:
            x = _round_to_activation(x * weight[:, None, None], IN_BF16)
        if any_local:
            x_local = x
            if QUANTIZE_LOCAL:
                x_local = _round_trip_tile(x, IN_BF16, ELEMENT, SCALE, ROUNDING)
            _store_tile(local_out_ptr, dst_row, cols, x_local, _mask(is_local, cols, D, GROUP, BLOCK_D), D, IN_BF16)
        if any_remote:
            _store_staged_tile(stage_ptr, peer, dst_row, remote, cols, start, x,
                               D, IN_BF16, ELEMENT, SCALE, ROUNDING, GROUP, BLOCK_D)
    if HAS_DOT:
        tl.store(dot_out_ptr + slot, dot, mask=active)


@triton.jit
def _push_tokens_kernel(
    src_ptr, sorted_row_ptr, dst_rank_ptr, dst_row_ptr, local_out_ptr, stage_ptr, stage_delta_ptr,
    map_ptr, map_delta_ptr, weight_map_ptr, weight_delta_ptr, weight_ptr, dot_with_ptr, dot_out_ptr,
    sent_ptr, T, rank, max_tokens,
    D: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr, IN_BF16: tl.constexpr,
    ELEMENT: tl.constexpr, SCALE: tl.constexpr, GROUP: tl.constexpr, ROUNDING: tl.constexpr,
    QUANTIZE_LOCAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, WEIGH_LOCAL: tl.constexpr,
    HAS_DOT: tl.constexpr, DOT_EXPERT_ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # HAS_WEIGHT: per-slot weights go to the owners' row weights; WEIGH_LOCAL: they also
    # multiply the rows that stay (else they are only carried). HAS_DOT: dot products per slot,
    # against a sorted row (DOT_EXPERT_ROWS False) or, for the rows that stay, their expert row.
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    kk = tl.arange(0, KP)
    slot_ok = tok_ok[:, None] & (kk < TOP_K)[None, :]
    n = tl.load(sorted_row_ptr + toks[:, None] * TOP_K + kk[None, :], mask=slot_ok, other=0)
    owner = tl.load(dst_rank_ptr + n, mask=slot_ok, other=-1)  # [tokens, K]
    row = tl.load(dst_row_ptr + n, mask=slot_ok, other=0)
    staged = rank * max_tokens + toks.to(tl.int64)  # the token's row in every peer's staging
    # Each row bound for a peer names the token's staged row in that peer's token map (and
    # leaves its routing weight in the peer's row weights).
    bound = slot_ok & (owner != rank) & (owner >= 0)
    # A slot's owner where that is a peer, else -1: `peer_owner == d` is already false for d ==
    # rank, so no scalar condition (rank != d) joins a block (a scalar comparison splat over a
    # block is not a bool mask in Triton 3.9's interpreter).
    peer_owner = tl.where(bound, owner, -1)
    map_delta = tl.load(map_delta_ptr + owner, mask=bound, other=0)
    tl.store(map_ptr + map_delta + row, staged[:, None] + tl.zeros((BLOCK_T, KP), tl.int64), mask=bound)
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + toks[:, None] * TOP_K + kk[None, :], mask=bound, other=0.0)
        weight_delta = tl.load(weight_delta_ptr + owner, mask=bound, other=0)
        tl.store(weight_map_ptr + weight_delta + row, weight, mask=bound)
    sent = 0
    for d in tl.static_range(W):
        sent += tl.sum((tl.max((peer_owner == d).to(tl.int32), axis=1) > 0).to(tl.int32), axis=0)
    if sent > 0:
        tl.atomic_add(sent_ptr, sent.to(tl.int64))
    any_local = tl.max(tl.max((slot_ok & (owner == rank)).to(tl.int32), axis=1), axis=0) > 0
    # Dot products: per slot, one partial sum per column group (a reduction within each
    # thread's group), summed over the groups once at the end.
    dots = tl.zeros((BLOCK_T, KP, BLOCK_D // GROUP), tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = _cols(start, GROUP, BLOCK_D)
        x = _load_tile(src_ptr, toks, cols, _mask(tok_ok, cols, D, GROUP, BLOCK_D), D, IN_BF16)
        # The rows that stay take the token as it is, or (QUANTIZE_LOCAL) as a peer decodes it.
        x_local = x
        if QUANTIZE_LOCAL:
            x_local = _round_trip_tile(x, IN_BF16, ELEMENT, SCALE, ROUNDING)
        if any_local or (HAS_DOT and not DOT_EXPERT_ROWS):
            for k in tl.static_range(TOP_K):
                slot = toks * TOP_K + k
                n_k = tl.load(sorted_row_ptr + slot, mask=tok_ok, other=0)
                if HAS_DOT and not DOT_EXPERT_ROWS:
                    other = _load_tile(dot_with_ptr, n_k, cols, _mask(tok_ok, cols, D, GROUP, BLOCK_D), D, IN_BF16)
                    part = tl.sum(other * x, axis=2)
                    dots += tl.where(kk[None, :, None] == k, part[:, None, :], 0.0)
                if any_local:
                    is_local = tok_ok & (tl.load(dst_rank_ptr + n_k, mask=tok_ok, other=-1) == rank)
                    row_k = tl.load(dst_row_ptr + n_k, mask=is_local, other=0)
                    if HAS_DOT and DOT_EXPERT_ROWS:
                        other = _load_tile(dot_with_ptr, row_k, cols,
                                           _mask(is_local, cols, D, GROUP, BLOCK_D), D, IN_BF16)
                        part = tl.sum(other * x_local, axis=2)
                        dots += tl.where(kk[None, :, None] == k, part[:, None, :], 0.0)
                    x_k = x_local
                    if HAS_WEIGHT and WEIGH_LOCAL:
                        f_k = tl.load(weight_ptr + slot, mask=is_local, other=0.0)
                        x_k = _round_to_activation(x_local * f_k[:, None, None], IN_BF16)
                    _store_tile(local_out_ptr, row_k, cols, x_k, _mask(is_local, cols, D, GROUP, BLOCK_D), D, IN_BF16)
        if sent > 0:
            if ELEMENT != _ACTIVATION:
                elements, scales = _encode_groups(x, ELEMENT, SCALE, ROUNDING)
                doffs, soffs, sok = _packed_offsets(staged, cols, start, D, GROUP, BLOCK_D, ELEMENT, SCALE)
            for d in tl.static_range(W):
                need = tl.max((peer_owner == d).to(tl.int32), axis=1) > 0
                if tl.max(need.to(tl.int32), axis=0) > 0:
                    # 16-byte aligned allocations: the stores to the peer use 16-byte vectors.
                    delta = tl.multiple_of(tl.load(stage_delta_ptr + d), 16)
                    if ELEMENT != _ACTIVATION:
                        _store_encoded(stage_ptr, delta, delta, doffs, soffs, elements, scales,
                                       _mask(need, cols, D, GROUP, BLOCK_D), need[:, None] & sok, ELEMENT, SCALE)
                    else:
                        _store_tile(stage_ptr + delta, staged, cols, x,
                                    _mask(need, cols, D, GROUP, BLOCK_D), D, IN_BF16)
    if HAS_DOT:
        dot_ok = slot_ok & (owner == rank) if DOT_EXPERT_ROWS else slot_ok
        tl.store(dot_out_ptr + toks[:, None] * TOP_K + kk[None, :], tl.sum(dots, axis=2), mask=dot_ok)


@triton.jit
def _push_partials_kernel(
    src_ptr, order_ptr, start_ptr, weight_ptr, stage_ptr, peer_delta_ptr, sent_ptr, S, rank, max_tokens,
    D: tl.constexpr, MAX_ROWS: tl.constexpr, IN_BF16: tl.constexpr, ELEMENT: tl.constexpr, SCALE: tl.constexpr,
    GROUP: tl.constexpr, ROUNDING: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    ok = slots < S
    first = tl.load(start_ptr + slots, mask=ok, other=0)
    count = tl.load(start_ptr + slots + 1, mask=ok, other=0) - first
    dest = slots // max_tokens
    active = ok & (count > 0) & (dest != rank)
    sent = tl.sum(active.to(tl.int32), axis=0)
    if sent == 0:
        return
    tl.atomic_add(sent_ptr, sent.to(tl.int64))
    staged = rank * max_tokens + (slots % max_tokens).to(tl.int64)
    # 16-byte aligned allocations: the stores to the peer use 16-byte vectors.
    peer = tl.multiple_of(tl.load(peer_delta_ptr + dest, mask=active, other=0), 16)
    for start in range(0, D, BLOCK_D):
        cols = _cols(start, GROUP, BLOCK_D)
        acc = tl.zeros((BLOCK_S, BLOCK_D // GROUP, GROUP), tl.float32)
        for j in tl.static_range(MAX_ROWS):
            has = active & (j < count)
            row = tl.load(order_ptr + first + j, mask=has, other=0)
            value = _load_tile(src_ptr, row, cols, _mask(has, cols, D, GROUP, BLOCK_D), D, IN_BF16)
            if HAS_WEIGHT:
                value = value * tl.load(weight_ptr + row, mask=has, other=0.0)[:, None, None]
            acc = acc + value
        value = _round_to_activation(acc, IN_BF16)
        _store_staged_tile(stage_ptr, peer, staged, active, cols, start, value,
                           D, IN_BF16, ELEMENT, SCALE, ROUNDING, GROUP, BLOCK_D)


@triton.jit
def _staged_rows(stage_row_ptr, rows, row_ok, HAS_STAGE_ROW: tl.constexpr):
    """The staged row each of ``rows`` reads: ``stage_row[rows]``, or the same row."""
    if HAS_STAGE_ROW:
        staged = tl.load(stage_row_ptr + rows, mask=row_ok, other=0)
    else:
        staged = rows
    return staged


@triton.jit
def _load_staged_tile(stage_ptr, rows, row_ok, cols, start, D: tl.constexpr, IN_BF16: tl.constexpr,
                      ELEMENT: tl.constexpr, SCALE: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows of this rank's staging buffer, decoded to fp32 values of the activation dtype."""
    mask = _mask(row_ok, cols, D, GROUP, BLOCK_D)
    if ELEMENT != _ACTIVATION:
        doffs, soffs, sok = _packed_offsets(rows, cols, start, D, GROUP, BLOCK_D, ELEMENT, SCALE)
        decoded = _load_decoded(stage_ptr, doffs, soffs, mask, row_ok[:, None] & sok, ELEMENT, SCALE)
        value = _round_to_activation(decoded, IN_BF16)
    else:
        value = _load_tile(stage_ptr, rows, cols, mask, D, IN_BF16)
    return value


@triton.jit
def _receive_rows_kernel(
    out_ptr, source_ptr, stage_ptr, stage_row_ptr, weight_ptr, dot_with_ptr, dot_out_ptr, R, rank,
    D: tl.constexpr, IN_BF16: tl.constexpr, ELEMENT: tl.constexpr, SCALE: tl.constexpr, GROUP: tl.constexpr,
    HAS_STAGE_ROW: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    source = tl.load(source_ptr + rows, mask=rows < R, other=-2)
    remote = (source >= 0) & (source != rank)
    pad = source == -1
    if tl.max((remote | pad).to(tl.int32), axis=0) == 0:
        return
    staged = _staged_rows(stage_row_ptr, rows, remote, HAS_STAGE_ROW)
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + rows, mask=remote, other=0.0)
    # Dot products: one partial sum per row and column group, summed once at the end.
    dots = tl.zeros((BLOCK_M, BLOCK_D // GROUP), tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = _cols(start, GROUP, BLOCK_D)
        value = _load_staged_tile(stage_ptr, staged, remote, cols, start, D, IN_BF16, ELEMENT, SCALE, GROUP, BLOCK_D)
        if HAS_DOT:
            other = _load_tile(dot_with_ptr, rows, cols, _mask(remote, cols, D, GROUP, BLOCK_D), D, IN_BF16)
            dots += tl.sum(other * value, axis=2)
        if HAS_WEIGHT:
            value = _round_to_activation(value * weight[:, None, None], IN_BF16)
        value = tl.where(pad[:, None, None], 0.0, value)
        _store_tile(out_ptr, rows, cols, value, _mask(remote | pad, cols, D, GROUP, BLOCK_D), D, IN_BF16)
    if HAS_DOT:
        tl.store(dot_out_ptr + rows, tl.sum(dots, axis=1), mask=remote)


@triton.jit
def _reduce_slots_kernel(
    out_ptr, sorted_row_ptr, row_rank_ptr, local_row_ptr, local_src_ptr, stage_ptr, stage_row_ptr,
    weight_ptr, save_ptr, dot_with_ptr, dot_out_ptr, T, rank,
    D: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, IN_BF16: tl.constexpr,
    ELEMENT: tl.constexpr, SCALE: tl.constexpr, GROUP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, WEIGH_STAGED: tl.constexpr, HAS_SAVE: tl.constexpr, HAS_DOT: tl.constexpr,
    HAS_STAGE_ROW: tl.constexpr, QUANTIZE_LOCAL: tl.constexpr, ROUNDING: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    kk = tl.arange(0, KP)
    dots = tl.zeros((BLOCK_T, KP), tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = _cols(start, GROUP, BLOCK_D)
        mask = _mask(tok_ok, cols, D, GROUP, BLOCK_D)
        acc = tl.zeros((BLOCK_T, BLOCK_D // GROUP, GROUP), tl.float32)
        if HAS_DOT:
            xrow = _load_tile(dot_with_ptr, toks, cols, mask, D, IN_BF16)
        for k in tl.static_range(TOP_K):
            slot = toks * TOP_K + k
            n = tl.load(sorted_row_ptr + slot, mask=tok_ok, other=0)
            owner = tl.load(row_rank_ptr + n, mask=tok_ok, other=-1)
            is_local = tok_ok & (owner == rank)
            is_remote = tok_ok & (owner != rank) & (owner >= 0)  # -1: a masked slot adds nothing
            local_row = tl.load(local_row_ptr + n, mask=is_local, other=0)
            value = _load_tile(local_src_ptr, local_row, cols, _mask(is_local, cols, D, GROUP, BLOCK_D), D, IN_BF16)
            if QUANTIZE_LOCAL:  # a row that stayed, as a peer would have decoded it
                value = _round_trip_tile(value, IN_BF16, ELEMENT, SCALE, ROUNDING)
            staged = _staged_rows(stage_row_ptr, n, is_remote, HAS_STAGE_ROW)
            if HAS_STAGE_ROW:  # -1: nothing to add (push_partials sent the token's sum once)
                is_remote = is_remote & (staged >= 0)
            # Most slots read no staged row (partial sums arrive once per token and peer; rows
            # that stayed are the rest): where no token of the block reads one, skip the masked
            # staged load, whose decode would still run for every slot.
            if tl.max(is_remote.to(tl.int32), axis=0) > 0:
                remote_val = _load_staged_tile(stage_ptr, staged, is_remote, cols, start,
                                               D, IN_BF16, ELEMENT, SCALE, GROUP, BLOCK_D)
                value = tl.where(is_local[:, None, None], value, remote_val)
            if HAS_SAVE:
                _store_tile(save_ptr, n, cols, value, mask, D, IN_BF16)
            if HAS_DOT:
                part = tl.sum(tl.sum(value * xrow, axis=2), axis=1)
                dots += tl.where(kk[None, :] == k, part[:, None], 0.0)
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + slot, mask=tok_ok, other=0.0)
                if not WEIGH_STAGED:  # a staged partial sum comes weighted
                    w = tl.where(is_local, w, 1.0)
                value = value * w[:, None, None]
            acc = acc + value
        _store_tile(out_ptr, toks, cols, acc, mask, D, IN_BF16)
    if HAS_DOT:
        tl.store(dot_out_ptr + toks[:, None] * TOP_K + kk[None, :], dots,
                 mask=tok_ok[:, None] & (kk < TOP_K)[None, :])


@triton.jit
def _sorted_rows_kernel(slot_ptr, ids_ptr, dst_base_ptr, first_row_ptr, dst_rank_ptr, dst_row_ptr, sorted_row_ptr,
                        N, last_row, E, L: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = j < N
    slot = tl.load(slot_ptr + j, mask=ok, other=0)
    expert = tl.load(ids_ptr + slot, mask=ok, other=0)
    routed = expert < E  # E: a masked slot (no expert), sorted after every routed one
    tl.store(dst_rank_ptr + j, tl.where(routed, expert // L, -1), mask=ok)
    row = (tl.load(dst_base_ptr + expert, mask=ok & routed, other=0) + j
           - tl.load(first_row_ptr + expert, mask=ok & routed, other=0))
    tl.store(dst_row_ptr + j, tl.where(routed, tl.minimum(row, last_row), 0), mask=ok)
    tl.store(sorted_row_ptr + slot, j.to(tl.int64), mask=ok)


@triton.jit
def _expert_rows_kernel(seg_end_ptr, seg_len_ptr, seg_origin_ptr, source_ptr, return_rank_ptr, return_row_ptr,
                        R, rank, W: tl.constexpr, NUM_SEG: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < R
    # seg = number of segment ends <= i: an upper-bound binary search over the sorted seg_end.
    lo = tl.zeros((BLOCK,), tl.int32)
    hi = tl.full((BLOCK,), NUM_SEG, tl.int32)
    for _ in tl.static_range(STEPS):
        searching = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(seg_end_ptr + mid, mask=searching, other=0) <= i
        lo = tl.where(searching & right, mid + 1, lo)
        hi = tl.where(searching & ~right, mid, hi)
    seg = lo
    seg_c = tl.minimum(seg, NUM_SEG - 1)
    kind = seg_c % (W + 1)
    end = tl.load(seg_end_ptr + seg_c, mask=ok, other=0)
    offset = i - (end - tl.load(seg_len_ptr + seg_c, mask=ok, other=0))
    source = tl.where(kind == W, -1, kind)
    source = tl.where(seg < NUM_SEG, source, -2).to(tl.int64)
    tl.store(source_ptr + i, source, mask=ok)
    tl.store(return_rank_ptr + i, tl.where((source >= 0) & (source != rank), source, -1), mask=ok)
    row = tl.load(seg_origin_ptr + seg_c, mask=ok, other=0) + offset
    tl.store(return_row_ptr + i, tl.where(source >= 0, row, 0), mask=ok)


def _kernel_arg(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensors travel through the kernels as their int16 bits (exact on every backend)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _no_fp32(device: torch.device) -> torch.Tensor:
    """Placeholder for an fp32 pointer argument the kernel's flags leave unused."""
    return torch.empty(1, dtype=torch.float32, device=device)


def _format_constants(fmt: WireFormat, dim: int, shape: LaunchShape) -> dict[str, int]:
    """A tile kernel's constants for a leg in format ``fmt``: the format's own
    (``WireFormat.kernel_constants``) and the column tile ``BLOCK_D`` for rows of ``dim``."""
    constants = fmt.kernel_constants()
    return {**constants, "BLOCK_D": shape.tile(dim, constants["GROUP"])}


def _quantizes(leg: StagedLeg) -> bool:
    """The kernels' ``QUANTIZE_LOCAL``: rows that stay go through the leg's wire format too
    (``A2AConfig.quantize_local_rows``), where that format encodes them."""
    return leg.quantize_local and leg.fmt.quantized


def _staging_arg(leg: StagedLeg, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A leg's staging byte buffer as the kernels take it: its bytes (quantized: packed rows) or
    its values (bf16 as int16 bits)."""
    return _kernel_arg(leg.views(leg.staging.local, dim, dtype)[0])


def push_counts(counts: torch.Tensor, tokens: int, buf, rank: int, fault: torch.Tensor) -> None:
    num = counts.numel()
    _push_counts_kernel[(buf.world_size,)](counts, fault, buf.ptrs, rank, tokens, NUM=num,
                                           BLOCK=triton.next_power_of_2(num + 2))


def routing_tables(table: torch.Tensor, rank: int, align: int, max_tokens: int, capacity: int | None = None,
                   needed: torch.Tensor | None = None):
    W, E = table.shape[0], table.shape[1] - 2
    L = E // W
    packed = torch.empty(2 * E + 3 * (W + 1) * L + L + 1, dtype=torch.int64, device=table.device)
    row_limit = NO_ROW_LIMIT if capacity is None else capacity // align * align
    _routing_tables_kernel[(1,)](
        table, packed, needed if needed is not None else packed, rank, align, max_tokens, row_limit,
        W=W, L=L, WP=triton.next_power_of_2(W), LP=triton.next_power_of_2(L), HAS_NEEDED=needed is not None,
    )
    # One int64 output: the RoutingTables fields in order (views), then the flag (nonzero:
    # every rank within max_tokens, no rank's fault word set).
    *fields, ok = torch.split(packed, (E, E, (W + 1) * L, (W + 1) * L, (W + 1) * L, L, 1))
    return RoutingTables(*fields, row_limit=capacity), ok.view(())


def push_rows(leg: StagedLeg, src, *, dst_rank, dst_row, local_out=None, slot=None, top_k=1, weight=None,
              dot_with=None, dot_out=None, pushed="all") -> None:
    num = dst_rank.numel()
    if num == 0:
        return
    dim = src.shape[1]
    pushed_index = pushed_rows_index(pushed)
    shape = leg.launch("push_rows")
    block_m, stripes = shape.block, shape.stripes
    no_fp32 = _no_fp32(src.device)
    stage = _staging_arg(leg, dim, src.dtype)
    _push_rows_kernel[(stripes * triton.cdiv(triton.cdiv(num, block_m), stripes),)](
        _kernel_arg(src), slot if slot is not None else dst_rank, weight if weight is not None else no_fp32,
        _kernel_arg(dot_with if dot_with is not None else src), dot_out if dot_out is not None else no_fp32,
        dst_rank, dst_row, _kernel_arg(local_out if local_out is not None else src), stage,
        leg.staging.element_offsets(stage.element_size()),
        num, leg.rank,
        D=dim, TOP_K=top_k, HAS_SLOT=slot is not None, HAS_WEIGHT=weight is not None,
        HAS_DOT=dot_with is not None, IN_BF16=src.dtype == torch.bfloat16,
        ROUNDING=rounding_code(leg.rounding), QUANTIZE_LOCAL=_quantizes(leg), BLOCK_M=block_m,
        **_format_constants(leg.fmt, dim, shape), PUSHED=pushed_index, STRIPES=stripes, STAGES=shape.stages,
        num_warps=shape.warps,
    )


def push_tokens(leg: StagedLeg, src, *, sorted_row, dst_rank, dst_row, local_out, top_k, sent, weight=None,
                weigh_local=True, dot_with=None, dot_out=None, dot_with_expert_rows=False) -> None:
    num_tokens, dim = src.shape
    if num_tokens == 0:
        return
    shape = leg.launch("push_tokens")
    stage = _staging_arg(leg, dim, src.dtype)
    staging = leg.staging
    no_fp32 = _no_fp32(src.device)
    _push_tokens_kernel[(triton.cdiv(num_tokens, shape.block),)](
        _kernel_arg(src), sorted_row, dst_rank, dst_row, _kernel_arg(local_out),
        stage, staging.element_offsets(stage.element_size()),
        leg.token_map(staging.local), staging.element_offsets(8),
        leg.row_weights(staging.local), staging.element_offsets(4),
        weight if weight is not None else no_fp32, _kernel_arg(dot_with if dot_with is not None else src),
        dot_out if dot_out is not None else no_fp32, sent,
        num_tokens, leg.rank, leg.tokens_per_rank,
        D=dim, TOP_K=top_k, KP=triton.next_power_of_2(top_k), W=staging.world_size,
        IN_BF16=src.dtype == torch.bfloat16, ROUNDING=rounding_code(leg.rounding),
        QUANTIZE_LOCAL=_quantizes(leg),
        HAS_WEIGHT=weight is not None, WEIGH_LOCAL=weight is not None and weigh_local, HAS_DOT=dot_with is not None,
        DOT_EXPERT_ROWS=dot_with_expert_rows, BLOCK_T=shape.block, **_format_constants(leg.fmt, dim, shape),
        num_warps=shape.warps,
    )


def push_partials(leg: StagedLeg, src, *, order, start, max_rows, sent, weight=None) -> None:
    num_slots, dim = start.numel() - 1, src.shape[1]
    if num_slots == 0 or src.shape[0] == 0:
        return
    shape = leg.launch("push_partials")
    stage = _staging_arg(leg, dim, src.dtype)
    _push_partials_kernel[(triton.cdiv(num_slots, shape.block),)](
        _kernel_arg(src), order, start, weight if weight is not None else _no_fp32(src.device), stage,
        leg.staging.element_offsets(stage.element_size()), sent, num_slots, leg.rank, leg.tokens_per_rank,
        D=dim, MAX_ROWS=max_rows, IN_BF16=src.dtype == torch.bfloat16,
        ROUNDING=rounding_code(leg.rounding), HAS_WEIGHT=weight is not None, BLOCK_S=shape.block,
        **_format_constants(leg.fmt, dim, shape), num_warps=shape.warps,
        # fp32 multiply then add, as the torch twin does: no fused multiply-add.
        enable_fp_fusion=False,
    )


def receive_rows(leg: StagedLeg, out, *, source, stage_row=None, weight=None, dot_with=None, dot_out=None) -> None:
    rows, dim = out.shape
    if rows == 0:
        return
    shape = leg.launch("receive_rows")
    _receive_rows_kernel[(triton.cdiv(rows, shape.block),)](
        _kernel_arg(out), source, _staging_arg(leg, dim, out.dtype),
        stage_row if stage_row is not None else source, weight if weight is not None else _no_fp32(out.device),
        _kernel_arg(dot_with if dot_with is not None else out),
        dot_out if dot_out is not None else _no_fp32(out.device),
        rows, leg.rank,
        D=dim, IN_BF16=out.dtype == torch.bfloat16, HAS_STAGE_ROW=stage_row is not None,
        HAS_WEIGHT=weight is not None, HAS_DOT=dot_with is not None, BLOCK_M=shape.block,
        **_format_constants(leg.fmt, dim, shape), num_warps=shape.warps,
    )


def reduce_slots(leg: StagedLeg, out, *, sorted_row, row_rank, local_row, local_src, top_k, weight=None, save=None,
                 dot_with=None, dot_out=None, stage_row=None, weigh_staged=True) -> None:
    num_tokens, dim = out.shape
    if num_tokens == 0:
        return
    shape = leg.launch("reduce_slots")
    no_fp32 = _no_fp32(out.device)
    _reduce_slots_kernel[(triton.cdiv(num_tokens, shape.block),)](
        _kernel_arg(out), sorted_row, row_rank, local_row, _kernel_arg(local_src),
        _staging_arg(leg, dim, out.dtype), stage_row if stage_row is not None else sorted_row,
        weight if weight is not None else no_fp32, _kernel_arg(save if save is not None else out),
        _kernel_arg(dot_with if dot_with is not None else out), dot_out if dot_out is not None else no_fp32,
        num_tokens, leg.rank,
        D=dim, TOP_K=top_k, KP=triton.next_power_of_2(top_k), IN_BF16=out.dtype == torch.bfloat16,
        HAS_WEIGHT=weight is not None, WEIGH_STAGED=weigh_staged, HAS_SAVE=save is not None,
        HAS_DOT=dot_out is not None, HAS_STAGE_ROW=stage_row is not None,
        QUANTIZE_LOCAL=_quantizes(leg), ROUNDING=rounding_code(leg.rounding), BLOCK_T=shape.block,
        **_format_constants(leg.fmt, dim, shape), num_warps=shape.warps,
        # fp32 multiply then add, as the torch twin does: no fused multiply-add.
        enable_fp_fusion=False,
    )


def sorted_row_routing(tables, slot, expert_ids, num_local_experts):
    num = slot.numel()
    dst_rank, dst_row, sorted_row = torch.empty_like(slot), torch.empty_like(slot), torch.empty_like(slot)
    if num:
        _sorted_rows_kernel[(triton.cdiv(num, ROUTING_BLOCK),)](
            slot, expert_ids, tables.dst_base, tables.first_row, dst_rank, dst_row, sorted_row, num,
            NO_ROW_LIMIT if tables.row_limit is None else tables.row_limit - 1, tables.dst_base.numel(),
            L=num_local_experts, BLOCK=ROUTING_BLOCK,
        )
    return dst_rank, dst_row, sorted_row


def expert_row_routing(tables, rank, world, capacity):
    source = torch.empty(capacity, dtype=torch.int64, device=tables.seg_end.device)
    return_rank, return_row = torch.empty_like(source), torch.empty_like(source)
    num_seg = tables.seg_end.numel()
    _expert_rows_kernel[(triton.cdiv(capacity, ROUTING_BLOCK),)](
        tables.seg_end, tables.seg_len, tables.seg_origin_row, source, return_rank, return_row, capacity, rank,
        W=world, NUM_SEG=num_seg, STEPS=max(1, num_seg.bit_length()), BLOCK=ROUTING_BLOCK,
    )
    return source, return_rank, return_row
