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

from dataclasses import dataclass

import torch

# Row kinds in ``ExpertMajorRows.source`` besides a source rank (0 <= s < W).
PAD_ROW = -1  # zero padding inside an expert's segment
UNUSED_ROW = -2  # past the last segment: never read by the grouped GEMM


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim=dim) - x


def padded_expert_sizes(counts_SL: torch.Tensor, align: int) -> torch.Tensor:  # noqa: N803
    """``(W, L)`` rows per (source, local expert) -> ``(L,)`` padded segment sizes."""
    total = counts_SL.sum(dim=0)
    return (torch.clamp_min(total, align) + align - 1) // align * align


def expert_major_capacity(max_tokens: int, top_k: int, ep: int, num_local_experts: int, align: int) -> int:
    """Rows the expert-major input of one rank can ever need: every peer sends it each of its
    tokens once per local expert it picks (at most ``min(top_k, L)``), plus per-expert padding."""
    return ep * max_tokens * min(top_k, num_local_experts) + num_local_experts * align


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


def segment_starts(counts_SL: torch.Tensor, align: int) -> torch.Tensor:  # noqa: N803
    """``(W, L)`` first row of each (source, local expert) segment in the expert-major buffer."""
    m_size = padded_expert_sizes(counts_SL, align)
    return _exclusive_cumsum(m_size, 0).unsqueeze(0) + _exclusive_cumsum(counts_SL, 0)


@dataclass(frozen=True)
class RoutedRows:
    """This rank's ``N`` routed rows in expert-sorted order."""

    slot: torch.Tensor  # (N,) int64: token * K + k of each sorted row
    expert: torch.Tensor  # (N,) int64: global expert id
    first_row_of_expert: torch.Tensor  # (E,) int64: first sorted row of each expert


def sort_routed_rows(topk_expert_ids_TK: torch.Tensor, counts_E: torch.Tensor) -> RoutedRows:  # noqa: N803
    ids = topk_expert_ids_TK.reshape(-1)
    slot = torch.argsort(ids, stable=True)
    return RoutedRows(slot=slot, expert=ids[slot], first_row_of_expert=_exclusive_cumsum(counts_E, 0))


def dispatch_destinations(
    routed: RoutedRows, counts_WE: torch.Tensor, rank: int, align: int  # noqa: N803
) -> tuple[torch.Tensor, torch.Tensor]:
    """Owner rank and expert-major row on that rank of each of this rank's sorted rows, from
    the full ``(W, E)`` count matrix (row ``s`` = counts of rank ``s``)."""
    W, E = counts_WE.shape
    L = E // W
    counts_SDL = counts_WE.view(W, W, L)  # source, destination rank, local expert
    m_size = (torch.clamp_min(counts_SDL.sum(dim=0), align) + align - 1) // align * align  # (D, L)
    start_DL = _exclusive_cumsum(m_size, 1) + _exclusive_cumsum(counts_SDL, 0)[rank]
    base = start_DL.reshape(E)  # first row of (this source, expert e) on e's owner
    dst_rank = routed.expert // L
    n = torch.arange(routed.expert.numel(), device=routed.expert.device)
    dst_row = base[routed.expert] + (n - routed.first_row_of_expert[routed.expert])
    return dst_rank, dst_row


def combine_destinations(rows: ExpertMajorRows, counts_WE: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
    """For each row of this rank's expert-major buffer: the source rank that routed it (-1 for
    padding / unused) and its sorted-row index there."""
    W, E = counts_WE.shape
    L = E // W
    first_row_WE = _exclusive_cumsum(counts_WE, 1)
    is_data = rows.source >= 0
    src = rows.source.clamp(min=0)
    origin_row = first_row_WE[src, rank * L + rows.local_expert] + rows.offset
    return torch.where(is_data, rows.source, torch.full_like(src, -1)), torch.where(is_data, origin_row, 0)


def rank_major_index(rows: ExpertMajorRows, counts_SL: torch.Tensor) -> torch.Tensor:  # noqa: N803
    """For each expert-major row, its row in the rank-major all-to-all output (sources in rank
    order, each source's rows by local expert); padding and unused rows get ``-1``."""
    W, L = counts_SL.shape
    start_SL = _exclusive_cumsum(counts_SL.reshape(-1), 0).view(W, L)
    is_data = rows.source >= 0
    idx = start_SL[rows.source.clamp(min=0), rows.local_expert] + rows.offset
    return torch.where(is_data, idx, torch.full_like(idx, -1))
