"""How many rows the symm transport's buffers hold, as plain arithmetic (no torch): the
dispatcher allocates these and the recipe's memory estimate before launch
(``launch/config/memory.py``) reads the same numbers.

Symbols: ``W`` EP ranks, ``T`` the most tokens a rank dispatches (``max_tokens``), ``K`` top-k,
``L`` local experts per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def worst_case_capacity(max_tokens: int, top_k: int, ep: int, num_local_experts: int, align: int) -> int:
    """Rows the expert-major input of one rank can ever need: every rank sends it each of its
    tokens once per pick of one of its experts (``top_k`` times when a token lists one expert
    more than once: the dispatcher accepts any ids), plus per-expert padding."""
    return ep * max_tokens * top_k + num_local_experts * align


def expert_major_capacity(max_tokens: int, top_k: int, ep: int, num_local_experts: int, align: int,
                          factor: float | None = None) -> int:
    """Rows of the expert-major tensors the symm dispatcher returns (and of what scales with
    them): ``factor`` times the balanced case, the ``T x K`` rows a rank receives when every
    rank routes alike, rounded up to ``align``, plus each local expert's padding; never more
    than the worst case (``worst_case_capacity``), which ``factor=None`` asks for. A dispatch
    that needs more rows than this overflows: it is flagged on the device and its step runs
    again at a grown capacity (``mxfp8_ep.elastic``). Any finite factor works: one past the
    worst case is the worst case."""
    worst = worst_case_capacity(max_tokens, top_k, ep, num_local_experts, align)
    if factor is None:
        return worst
    rows = factor * max_tokens * top_k
    if rows >= worst:  # compared as a float: a huge factor never reaches math.ceil
        return worst
    balanced = _round_up(math.ceil(rows), align)
    return min(worst, balanced + num_local_experts * align)


# A capacity that overflowed grows to what the step needed plus this fraction, so that the
# routing's imbalance, still rising in the steps after the first overflow, does not overflow it
# again at once (docs/design.md, "A grown capacity").
GROWTH_HEADROOM = 0.25
# The activation pool (every MoE layer's kept rows) grows by this fraction past what a step
# needed: its need rises over the same steps as the capacity's (docs/design.md, "The defaults").
POOL_GROWTH_HEADROOM = GROWTH_HEADROOM


def grown_capacity(needed: int, worst: int, align: int, headroom: float = GROWTH_HEADROOM) -> int:
    """The capacity after a dispatch needed ``needed`` rows: that plus ``headroom``, a
    multiple of ``align``, at most the worst case."""
    return min(worst, _round_up(math.ceil(needed * (1 + headroom)), align))


@dataclass(frozen=True)
class CapacityStep:
    """What a step whose dispatches needed ``needed`` rows does to a buffer set
    (``next_capacity``): ``capacity``, the rows it holds from the next step on, and
    ``step_rows``, the rows the step itself runs again at (0: it fitted, no rerun).
    ``kind``: ``"fits"``, ``"grow"`` (rerun at the grown capacity) or ``"spill"`` (the step
    needs more than the ceiling: the capacity stops at the ceiling and the step alone reruns
    at exactly the rows it needs)."""

    kind: str
    capacity: int
    step_rows: int


def next_capacity(needed: int, capacity: int, ceiling: int, worst: int, align: int,
                  headroom: float = GROWTH_HEADROOM) -> CapacityStep:
    """The elastic capacity's rule: a step that fits changes nothing; one that needs more than
    ``capacity`` but no more than ``ceiling`` grows it (``grown_capacity``, at most the
    ceiling) and runs again at it; one that needs more than the ceiling spills: the capacity
    grows to the ceiling and never past it, and the step runs again at exactly ``needed``
    rows (rounded up to ``align``), a size that lasts that step only. Either rerun computes
    what the worst case computes."""
    if needed <= capacity:
        return CapacityStep("fits", capacity, 0)
    if needed <= ceiling:
        grown = min(ceiling, grown_capacity(needed, worst, align, headroom))
        return CapacityStep("grow", grown, grown)
    return CapacityStep("spill", max(capacity, ceiling), min(worst, _round_up(needed, align)))


def _round_up(rows: int, align: int) -> int:
    return -(-rows // align) * align


def token_map_byte_offset(rows: int, row_nbytes: int) -> int:
    """Byte offset of the token map in a staging buffer of ``rows`` rows of ``row_nbytes``
    bytes: after the rows, 16-byte aligned."""
    return -(-rows * row_nbytes // 16) * 16


def staging_buffer_bytes(rows: int, row_nbytes: int, map_rows: int) -> int:
    """Bytes of one staging buffer: its rows, then per expert-major row (``map_rows``) an int64
    token map entry and an fp32 row weight."""
    return token_map_byte_offset(rows, row_nbytes) + map_rows * 12


def staging_rows(ep: int, max_tokens: int, top_k: int, capacity: int, combine_partial_sums: bool,
                 row_nbytes: int) -> int:
    """Rows one symm staging buffer holds: the highest row any leg stores into.

    * A row pushed to its experts row by row (top-1) lands at its expert-major row:
      ``capacity``.
    * A token pushed once per rank (top-k > 1, both expert-bound legs), or a partial sum per
      token and rank (the token-bound legs, when the scores follow the experts), lands at row
      ``rank * max_tokens + token``: ``W x T``, not ``capacity`` (an eighth of it at top-8).
    * A row pushed back to its token's rank row by row (a token-bound leg without partial sums:
      ``combine_partial_sums`` false) lands at its sorted row there: ``T x K``.
    * After combine's partial sums, combine's backward returns the score gradients through the
      rows' bytes: ``W x capacity`` fp32 (``row_nbytes``: the bytes of one staged row)."""
    if top_k == 1:
        return max(capacity, max_tokens)
    rows = ep * max_tokens
    if not combine_partial_sums:
        return max(rows, max_tokens * top_k)
    return max(rows, -(-ep * capacity * 4 // row_nbytes))


def symm_staging_rows(ep: int, max_tokens: int, top_k: int, num_local_experts: int, align: int,
                      combine_partial_sums: bool, row_nbytes: int) -> int:
    """Rows of one symm staging buffer as the dispatcher allocates it: ``staging_rows`` at the
    worst case's capacity (``worst_case_capacity``), whatever the elastic capacity, so that a
    grown capacity or a spill's exact size fits the buffers already held. With top-k > 1 that
    costs only the capacity-sized areas (the returned score gradients, and the token map and
    row weights: ``symm_staging_bytes``); with top-1 the rows themselves hold the worst case."""
    worst = worst_case_capacity(max_tokens, top_k, ep, num_local_experts, align)
    return staging_rows(ep, max_tokens, top_k, worst, combine_partial_sums, row_nbytes)


def symm_staging_bytes(ep: int, max_tokens: int, top_k: int, num_local_experts: int, align: int,
                       combine_partial_sums: bool, row_nbytes: int) -> int:
    """Bytes of the two symm staging buffers of one buffer set (``symm_staging_rows``, then a
    token map and row weights of the worst case's rows): every symmetric allocation the
    transport makes for it besides its small count buffer."""
    worst = worst_case_capacity(max_tokens, top_k, ep, num_local_experts, align)
    rows = symm_staging_rows(ep, max_tokens, top_k, num_local_experts, align, combine_partial_sums, row_nbytes)
    return 2 * staging_buffer_bytes(rows, row_nbytes, worst)


# The two_hop transport's node hop (``mxfp8_ep.dispatcher.two_hop``): the rows a rank sends each
# other node, one per token that has an expert there. Symbols as above, ``N`` nodes of ``G``
# ranks each (``W = N x G``).


def remote_node_share(num_experts: int, top_k: int, nodes: int) -> float:
    """The share of a rank's tokens that go to one other node when every token picks ``top_k``
    distinct experts uniformly (the balanced case): the chance that at least one of them lies
    on that node, which holds ``num_experts / nodes`` of them."""
    per_node = num_experts // nodes
    miss = 1.0
    for i in range(top_k):
        miss *= max(0, num_experts - per_node - i) / (num_experts - i)
    return 1.0 - miss


def node_hop_capacity(max_tokens: int, share: float, factor: float | None = None) -> int:
    """Rows a rank sends each other node per dispatch: ``factor`` times the balanced case
    (``share x T``, ``remote_node_share``), rounded up, at least 1 and at most ``T`` (every
    token, the worst case, which ``factor=None`` asks for)."""
    if factor is None or factor * share * max_tokens >= max_tokens:
        return max_tokens
    return max(1, min(max_tokens, math.ceil(factor * share * max_tokens)))


# A node-hop row's stride: its wire bytes padded to this many, so the int32 side columns after
# a block's rows stay aligned.
NODE_HOP_ROW_ALIGN = 16
# The int32 side columns a node-hop row carries per top-k pick, by leg: dispatch forward the
# pick's expert id on the receiving node and its router score (fp32 bits), dispatch backward
# the score's gradient; the combine legs none.
NODE_HOP_SIDE_COLUMNS = {"dispatch_fwd": 2, "dispatch_bwd": 1, "combine_fwd": 0, "combine_bwd": 0}


def node_hop_row_bytes(row_nbytes: int, top_k: int, leg: str = "dispatch_fwd") -> int:
    """Bytes of one node-hop row of ``leg``: the token in its wire format (``row_nbytes``)
    padded to ``NODE_HOP_ROW_ALIGN``, then its side columns (``NODE_HOP_SIDE_COLUMNS``)."""
    stride = -(-row_nbytes // NODE_HOP_ROW_ALIGN) * NODE_HOP_ROW_ALIGN
    return stride + 4 * NODE_HOP_SIDE_COLUMNS[leg] * top_k


def node_hop_bytes(nodes: int, rows: int, row_nbytes: int, top_k: int, leg: str = "dispatch_fwd") -> int:
    """Bytes of the node hop's send and receive buffers of ``leg`` (dispatch forward, the
    largest, unless told) at ``rows`` rows per node pair (``node_hop_capacity``): a block per
    other node each (the buffers come from the caching allocator per dispatch)."""
    return 2 * (nodes - 1) * rows * node_hop_row_bytes(row_nbytes, top_k, leg)
