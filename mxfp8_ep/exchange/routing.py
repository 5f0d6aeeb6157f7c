"""Where every routed row goes: the expert-major layout of an EP rank's grouped-GEMM input,
computed on the device from token counts (torch ops with static shapes: no host sync).

Symbols: ``W`` EP ranks, ``E`` global experts, ``L = E / W`` local experts per rank, ``T``
tokens on a rank, ``K`` top-k, ``N = T * K`` routed rows of a rank (sorted by expert id, as
torchtitan's ``argsort(stable=True)`` orders them).

The layout is torchtitan 0.2.2's (``generate_permute_indices``): on the rank that owns them,
local expert ``l`` gets a segment of ``m_size[l] = roundup(max(total_l, align), align)`` rows;
inside it come the rows from source rank 0, then rank 1, ..., then zero padding. Each source's
rows keep their order on the source (expert-sorted, stable). Rows past the last segment are
unused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# Row kinds in ``ExpertMajorRows.source`` besides a source rank (0 <= s < W).
PAD_ROW = -1  # zero padding inside an expert's segment
UNUSED_ROW = -2  # past the last segment: never read by the grouped GEMM


def to_peer(dst_rank: torch.Tensor, rank: int) -> torch.Tensor:
    """Which routed rows go to another rank than ``rank``: those of a rank's experts, not a
    masked slot's (a pick of no expert in the group, ``dst_rank`` -1: the two_hop transport's
    picks on other nodes)."""
    return (dst_rank != rank) & (dst_rank >= 0)


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim=dim) - x


def padded_expert_sizes(counts_SL: torch.Tensor, align: int) -> torch.Tensor:  # noqa: N803
    """``(W, ..., L)`` rows per (source, ..., local expert) -> ``(..., L)`` padded segment sizes."""
    total = counts_SL.sum(dim=0)
    return (torch.clamp_min(total, align) + align - 1) // align * align


@dataclass(frozen=True)
class ExpertMajorRows:
    """Per row of a rank's expert-major buffer (``R`` rows): which rank it comes from
    (``source``, or PAD_ROW / UNUSED_ROW), its local expert and its offset inside the
    (source, expert) segment. Plus the padded sizes the grouped GEMM takes."""

    source: torch.Tensor  # (R,) int64
    local_expert: torch.Tensor  # (R,) int64
    offset: torch.Tensor  # (R,) int64
    tokens_per_local_expert: torch.Tensor  # (L,) int64, padded


def expert_major_rows(counts_SL: torch.Tensor, align: int, num_rows: int) -> ExpertMajorRows:  # noqa: N803
    """Describe every row of a ``num_rows``-row expert-major buffer built from ``(W, L)``
    counts ``counts_SL[s, l]`` (rows that source ``s`` sends to local expert ``l``)."""
    W, L = counts_SL.shape
    m_size = padded_expert_sizes(counts_SL, align)
    # Segments in row order: for each expert l, W data segments then its padding.
    seg_len = torch.cat([counts_SL.t(), (m_size - counts_SL.sum(dim=0)).unsqueeze(1)], dim=1).reshape(-1)
    seg_end = torch.cumsum(seg_len, dim=0)
    rows = torch.arange(num_rows, device=counts_SL.device, dtype=seg_end.dtype)
    seg = torch.searchsorted(seg_end, rows, right=True)
    used = seg < seg_len.numel()
    seg_c = seg.clamp(max=seg_len.numel() - 1)
    kind = seg_c % (W + 1)
    offset = rows - (seg_end - seg_len)[seg_c]
    source = torch.where(kind == W, torch.full_like(kind, PAD_ROW), kind)
    source = torch.where(used, source, torch.full_like(kind, UNUSED_ROW))
    return ExpertMajorRows(
        source=source, local_expert=seg_c // (W + 1), offset=offset, tokens_per_local_expert=m_size
    )


def rank_major_index(rows: ExpertMajorRows, counts_SL: torch.Tensor) -> torch.Tensor:  # noqa: N803
    """For each expert-major row, its row in the rank-major all-to-all output (sources in rank
    order, each source's rows by local expert); padding and unused rows get ``-1``."""
    W, L = counts_SL.shape
    start_SL = _exclusive_cumsum(counts_SL.reshape(-1), 0).view(W, L)
    is_data = rows.source >= 0
    idx = start_SL[rows.source.clamp(min=0), rows.local_expert] + rows.offset
    return torch.where(is_data, idx, torch.full_like(idx, -1))


@dataclass(frozen=True)
class RoutingTables:
    """Per-expert / per-segment tables (tiny, from the ``(W, E)`` count matrix) from which the
    per-row routing of the symm transport follows."""

    dst_base: torch.Tensor  # (E,) first row of (this rank, expert e) on e's owner
    first_row: torch.Tensor  # (E,) first expert-sorted row of expert e on this rank
    seg_len: torch.Tensor  # ((W+1)*L,) this rank's segments: per local expert, W sources then padding
    seg_end: torch.Tensor  # ((W+1)*L,) inclusive cumsum of seg_len
    seg_origin_row: torch.Tensor  # ((W+1)*L,) first sorted row on the source of each data segment
    tokens_per_local_expert: torch.Tensor  # (L,) padded
    # The rows of the expert-major tensors (symm: their capacity): a row routed past it is
    # kept at the last row (``sorted_row_routing``). None: no limit (the nccl transport's
    # tensors hold every row).
    row_limit: int | None = None


def rows_needed(counts_WE: torch.Tensor, align: int) -> torch.Tensor:  # noqa: N803
    """The most rows any rank's expert-major tensor needs for these ``(W, E)`` counts: its
    local experts' padded segments (a 0-dim tensor; device ops)."""
    W, E = counts_WE.shape
    return padded_expert_sizes(counts_WE.view(W, W, E // W), align).sum(dim=1).max()


def clipped_expert_sizes(m_size: torch.Tensor, capacity: int, align: int) -> torch.Tensor:
    """Padded segment sizes ``(..., L)`` cut where the rows pass ``capacity`` (rounded down to
    ``align``): what the grouped GEMM of a tensor of ``capacity`` rows may cover. Unchanged
    when the segments fit."""
    limit = capacity // align * align
    end = torch.cumsum(m_size, dim=-1).clamp(max=limit)
    return end - torch.cat([torch.zeros_like(end[..., :1]), end[..., :-1]], dim=-1)


def routing_tables(counts_WE: torch.Tensor, rank: int, align: int,  # noqa: N803
                   capacity: int | None = None) -> RoutingTables:
    """The tables of this ``rank``'s routing for ``(W, E)`` counts. ``capacity``: the rows of the
    expert-major tensors; where the segments need more (an overflow), the padded sizes the
    grouped GEMM takes are cut there (``clipped_expert_sizes``) and ``row_limit`` keeps
    every row inside them, so an overflowing dispatch stays in bounds (its step is then
    replayed, ``mxfp8_ep.elastic``)."""
    W, E = counts_WE.shape
    L = E // W
    counts_SDL = counts_WE.view(W, W, L)  # noqa: N806  source, destination rank, local expert
    m_size = padded_expert_sizes(counts_SDL, align)  # (destination rank, L)
    dst_base = (_exclusive_cumsum(m_size, 1) + _exclusive_cumsum(counts_SDL, 0)[rank]).reshape(E)
    mine_SL = counts_SDL[:, rank, :]  # noqa: N806
    seg_len = torch.cat([mine_SL.t(), (m_size[rank] - mine_SL.sum(dim=0)).unsqueeze(1)], dim=1).reshape(-1)
    origin_SL = _exclusive_cumsum(counts_WE, 1)[:, rank * L : (rank + 1) * L]  # noqa: N806
    seg_origin_row = torch.cat([origin_SL.t(), torch.zeros_like(origin_SL[:1].t())], dim=1).reshape(-1)
    tokens_per_local_expert = m_size[rank] if capacity is None else clipped_expert_sizes(m_size[rank], capacity, align)
    return RoutingTables(
        dst_base=dst_base, first_row=_exclusive_cumsum(counts_WE[rank], 0), seg_len=seg_len,
        seg_end=torch.cumsum(seg_len, dim=0), seg_origin_row=seg_origin_row,
        tokens_per_local_expert=tokens_per_local_expert, row_limit=capacity,
    )


def exchange_tables(counts_WE: torch.Tensor, rank: int, align: int) -> RoutingTables:  # noqa: N803
    """``routing_tables`` for an all-to-all instead of peer memory: the same expert-major
    layout, but a row that crosses ranks is addressed by its row in the rank-major exchange
    buffers (this rank's own rows never enter them):

    * ``dst_base`` of another rank's expert: rows bound for it are addressed by their row in
      the send buffer (this rank's sorted rows without its own block);
    * ``seg_origin_row`` of another source's segment: its rows by their row in the receive
      buffer (sources in rank order without this rank, each source's rows in its sorted order).

    The send buffer of the token-bound direction is laid out like this receive buffer, and its
    receive buffer like this send buffer: the same addresses serve both directions."""
    tables = routing_tables(counts_WE, rank, align)
    W, E = counts_WE.shape
    L = E // W
    owner = torch.arange(E, device=counts_WE.device) // L
    own_block = counts_WE[rank, rank * L : (rank + 1) * L].sum()
    send_row0 = tables.first_row - torch.where(owner > rank, own_block, 0)
    dst_base = torch.where(owner == rank, tables.dst_base, send_row0)
    from_source = counts_WE[:, rank * L : (rank + 1) * L].sum(dim=1)  # (W,) rows each source sends here
    is_peer = torch.arange(W, device=counts_WE.device) != rank
    recv_start = _exclusive_cumsum(torch.where(is_peer, from_source, 0), 0)
    first_to_here = counts_WE[:, : rank * L].sum(dim=1)  # first sorted row, on each source, bound here
    shift = torch.where(is_peer, recv_start - first_to_here, 0)
    shift = torch.cat([shift, shift.new_zeros(1)])  # the padding segment of each expert
    origin = (tables.seg_origin_row.view(L, W + 1) + shift).reshape(-1)
    return replace(tables, dst_base=dst_base, seg_origin_row=origin)
