"""How many rows the symm transport's buffers hold, as plain arithmetic (no torch): the
dispatcher allocates these and the recipe's memory estimate before launch
(``launch/memory.py``) reads the same numbers.

Symbols: ``W`` EP ranks, ``T`` the most tokens a rank dispatches (``max_tokens``), ``K`` top-k,
``L`` local experts per rank.
"""

from __future__ import annotations


def expert_major_capacity(max_tokens: int, top_k: int, ep: int, num_local_experts: int, align: int) -> int:
    """Rows the expert-major input of one rank can ever need: every rank sends it each of its
    tokens once per pick of one of its experts (``top_k`` times when a token lists one expert
    more than once: the dispatcher accepts any ids), plus per-expert padding. The symm
    dispatcher returns tensors of this many rows (the drop-free worst case)."""
    return ep * max_tokens * top_k + num_local_experts * align


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
