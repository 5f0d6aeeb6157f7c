"""Torch twins of the symm transport's kernels (``symm_kernels.py``): same arguments (the leg's
launch shapes are taken and ignored), same arithmetic, same bytes. They run wherever
torch runs (CPU emulation of peers in CI, or on CUDA peer memory to check the Triton kernels on
the GPU machine).

The staging buffers they read and write, and how rows are encoded there: ``staging``.

Arithmetic (shared with the kernels, so both give the same bits):
* a routing weight multiplies in fp32 and the product is rounded to the activation dtype
  (torchtitan's ``(x.float() * score).to(x.dtype)``): before the row is sent or quantized
  (``push_rows``), or, after a token-once push (``push_tokens``), by the receiving pass, on the
  token as it arrived (MXFP8: dequantized);
* the top-k reduction adds the K slots of a token in fp32, in slot order ``k = 0..K-1``, each
  slot's (dequantized) value times its weight as separate multiply and add, then one rounding;
* a partial sum (``push_partials``) adds a token's rows on one rank in fp32, in expert-major
  row order, and is rounded to the activation dtype before it is sent or quantized.
"""

from __future__ import annotations

import torch

from mxfp8_ep.exchange import routing
from mxfp8_ep.exchange.staging import StagedLeg, decode_rows, encode_rows, round_trip_rows, store_rows


# Which rows a push stores (``push_rows(pushed=...)``): all, those that stay on this rank, or
# those that leave it. The nccl transport pushes the rows that leave before its host sync and
# those that stay after it, while the exchange runs.
PUSHED_ROWS = ("all", "local", "remote")


def pushed_rows_index(pushed: str) -> int:
    """``pushed``'s index in ``PUSHED_ROWS`` (the Triton kernel's ``PUSHED``); a clear error for
    anything else."""
    if pushed not in PUSHED_ROWS:
        raise ValueError(f"push_rows(pushed={pushed!r}): one of {PUSHED_ROWS}")
    return PUSHED_ROWS.index(pushed)


def _pushed_ranks(dst_rank: torch.Tensor, rank: int, pushed: str) -> torch.Tensor:
    """``dst_rank`` with the rows that ``pushed`` leaves out set to -1."""
    pushed_rows_index(pushed)
    if pushed == "all":
        return dst_rank
    keep = (dst_rank == rank) if pushed == "local" else (dst_rank != rank)
    return torch.where(keep, dst_rank, -1)


def push_counts(counts: torch.Tensor, tokens: int, buf, rank: int, fault: torch.Tensor) -> None:
    """Row ``rank`` of every rank's ``(W, E + 2)`` int64 count table = this rank's ``E``
    counts, its token count, then its fault word (``dispatcher.checks.Fault`` bits, a
    0-dim int64 tensor)."""
    num = counts.numel() + 2
    row = torch.cat([counts, counts.new_full((1,), tokens), fault.view(1).to(counts.dtype)])
    for peer in range(buf.world_size):
        buf.peer(peer)[: buf.world_size * num * 8].view(torch.int64).view(buf.world_size, num)[rank] = row


def routing_tables(table: torch.Tensor, rank: int, align: int, max_tokens: int, capacity: int | None = None,
                   needed: torch.Tensor | None = None):
    """From the ``(W, E + 2)`` count table (every rank's counts per expert, its token count,
    its fault word): ``routing.routing_tables`` of the counts (computed before the table is
    rewritten; ``capacity``: the expert-major tensors' rows) and a bool tensor, every rank's
    token count ``<= max_tokens`` and fault word 0. ``needed`` (int64, one element): raised to
    the rows the largest expert-major tensor of the group needs (``routing.rows_needed``)."""
    E = table.shape[1] - 2
    counts = table[:, :E].clone()
    tables = routing.routing_tables(counts, rank, align, capacity)
    if needed is not None:
        needed.copy_(torch.maximum(needed.view(()), routing.rows_needed(counts, align)).view_as(needed))
    return tables, (table[:, E] <= max_tokens).all() & (table[:, E + 1] == 0).all()


def push_rows(leg: StagedLeg, src, *, dst_rank, dst_row, local_out=None, slot=None, top_k=1, weight=None,
              dot_with=None, dot_out=None, pushed="all") -> None:
    """Row ``j``: read ``src[slot[j] // top_k]`` (or ``src[j]``), times ``weight[slot[j]]``
    when given; store it at row ``dst_row[j]`` of ``local_out`` when ``dst_rank[j]`` is this
    rank (``leg.quantize_local``: as a peer decodes it, ``round_trip_rows``), of rank
    ``dst_rank[j]``'s staging buffer (in ``leg.fmt``) otherwise, nowhere when -1.
    With ``dot_with``: ``dot_out[slot[j]] = <dot_with[j], src row>`` in fp32 (before the weight).
    ``pushed`` (``PUSHED_ROWS``): push just the rows that stay (``local``) or just those that
    leave (``remote``); the others are skipped as if their ``dst_rank`` were -1.
    (A reference: boolean indexing, so it syncs with the host; the Triton kernel does not.)"""
    num = dst_rank.numel()
    if num == 0:
        return
    rank, fmt, rounding = leg.rank, leg.fmt, leg.rounding
    idx = slot if slot is not None else torch.arange(num, device=src.device)
    values = src[idx // top_k] if slot is not None else src[:num]
    dst_rank = _pushed_ranks(dst_rank, rank, pushed)
    active = dst_rank >= 0
    if dot_with is not None:
        dots = (dot_with[:num].float() * values.float()).sum(dim=1)
        dot_out[idx[active]] = dots[active]
    if weight is not None:
        values = (values.float() * weight[idx].unsqueeze(1)).to(src.dtype)
    if local_out is not None:
        local = dst_rank == rank
        kept = round_trip_rows(values, rounding, fmt) if leg.quantize_local else values
        local_out[dst_row[local]] = kept[local]
    encoded = encode_rows(values, rounding, fmt)
    for peer in range(leg.staging.world_size):
        if peer != rank:
            store_rows(leg.staging.peer(peer), leg.rows, dst_row, values, encoded, dst_rank == peer, fmt)


def push_tokens(leg: StagedLeg, src, *, sorted_row, dst_rank, dst_row, local_out, top_k, sent, weight=None,
                weigh_local=True, dot_with=None, dot_out=None, dot_with_expert_rows=False) -> None:
    """The expert-bound push with each token sent once per rank: token ``t``'s K sorted rows
    (``sorted_row[t*K+k]``) that stay are stored at their ``dst_row`` of ``local_out``; for every
    other rank that owns one of its experts, the token itself (in ``leg.fmt``) goes once into that
    rank's staging buffer at row ``rank * leg.tokens_per_rank + t``, and each of its rows bound there
    writes that staged row into the owner's token map (``token_map``) at its ``dst_row``: the
    owner's ``receive_rows`` reads it through that map (``stage_row``). ``sent`` (int64, one
    element) grows by the rows put on the wire.
    With ``weight`` (per slot ``t*K+k``, fp32 or the activation dtype): a row bound for a peer
    leaves its weight (as fp32, exact) in the owner's row weights (``row_weights``), which its
    ``receive_rows`` applies (``weight``) to the token as it arrived; with ``weigh_local`` a row
    that stays is the token times its weight (``push_rows``' arithmetic), else nothing is
    multiplied (dispatch's forward carries the router scores that combine's partial sums apply
    on the experts' rank). With ``dot_with`` (per sorted row):
    ``dot_out[t*K+k] = <dot_with[sorted_row[t*K+k]], src[t]>`` in fp32, as ``push_rows``
    computes it; with ``dot_with_expert_rows`` ``dot_with`` holds this rank's expert-major rows
    instead: ``dot_out[t*K+k] = <dot_with[dst_row], src[t]>`` for the slots whose row stays,
    the other slots' entries are left as they are (their owners take theirs as they receive,
    ``receive_rows(dot_with=...)``). ``leg.quantize_local``: the rows that stay, and their
    ``dot_with_expert_rows`` products, take the token as a peer decodes it (``round_trip_rows``;
    before the weight, as ``receive_rows`` applies it)."""
    num_tokens, dim = src.shape
    if num_tokens == 0:
        return
    rank, fmt, rounding, staging = leg.rank, leg.fmt, leg.rounding, leg.staging
    n = sorted_row[: num_tokens * top_k].view(num_tokens, top_k)
    owner, row = dst_rank[n], dst_row[n]
    local = owner == rank
    if dot_with is not None and not dot_with_expert_rows:
        sent_rows = src.unsqueeze(1).expand(num_tokens, top_k, dim)
        dots = (dot_with[n.reshape(-1)].float() * sent_rows.reshape(-1, dim).float()).sum(dim=1)
        dot_out[: num_tokens * top_k] = dots
    kept = round_trip_rows(src, rounding, fmt) if leg.quantize_local else src
    rows_of = kept.unsqueeze(1).expand(num_tokens, top_k, dim)
    if dot_with is not None and dot_with_expert_rows:
        dots = (dot_with[torch.where(local, row, 0).reshape(-1)].float() * rows_of.reshape(-1, dim).float()).sum(dim=1)
        flat = dot_out[: num_tokens * top_k]
        flat.copy_(torch.where(local.reshape(-1), dots, flat))
    weights = None
    if weight is not None:
        weights = weight[: num_tokens * top_k].view(num_tokens, top_k)
        if weigh_local:
            rows_of = (rows_of.float() * weights.unsqueeze(2)).to(src.dtype)
    local_out[row[local]] = rows_of[local]
    encoded = encode_rows(src, rounding, fmt)
    staged = rank * leg.tokens_per_rank + torch.arange(num_tokens, device=src.device)
    for peer in range(staging.world_size):
        if peer == rank:
            continue
        bound = owner == peer
        need = bound.any(dim=1)
        store_rows(staging.peer(peer), leg.rows, staged, src, encoded, need, fmt)
        leg.token_map(staging.peer(peer))[row[bound]] = staged.unsqueeze(1).expand_as(row)[bound]
        if weights is not None:
            leg.row_weights(staging.peer(peer))[row[bound]] = weights[bound].float()
        sent += need.sum()


def partial_slots(row_slot: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group expert-major rows by the token they belong to: ``row_slot[i]`` is row ``i``'s
    token slot (``source * max_tokens + token``), or ``num_slots`` for a row that takes no part.
    Returns ``order`` (rows sorted by slot, stable: expert-major order within a slot) and
    ``start`` (``num_slots + 1``): slot ``s``'s rows are ``order[start[s]:start[s + 1]]``.
    Device ops only (no host sync)."""
    order = torch.argsort(row_slot, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=row_slot.device)
    counts.scatter_add_(0, row_slot, torch.ones_like(row_slot))
    start = torch.zeros(num_slots + 1, dtype=torch.int64, device=row_slot.device)
    torch.cumsum(counts[:num_slots], dim=0, out=start[1:])
    return order, start


def partial_sums(src, order, start, rank, max_rows, max_tokens, weight=None) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``push_partials`` sends: per slot ``s`` (``partial_slots``), the fp32 sum of its
    rows of ``src`` in ``order`` (at most ``max_rows``; with ``weight``, fp32 per row of
    ``src``, each row times its weight, separate multiply and add), rounded to the activation
    dtype; and whether it is sent: ``s`` has rows here and is another rank's token
    (``s // max_tokens``). Device ops only."""
    num_slots, dim = start.numel() - 1, src.shape[1]
    slots = torch.arange(num_slots, device=src.device)
    first, count = start[:-1], start[1:] - start[:-1]
    active = (count > 0) & (slots // max_tokens != rank)
    acc = torch.zeros((num_slots, dim), dtype=torch.float32, device=src.device)
    order = order if order.numel() else torch.zeros(1, dtype=torch.int64, device=src.device)
    for j in range(max_rows):
        has = active & (j < count)
        rows = order[(first + j).clamp(max=order.numel() - 1)]
        value = src[rows].float() if weight is None else src[rows].float() * weight[rows].unsqueeze(1)
        acc = acc + torch.where(has.unsqueeze(1), value, 0.0)
    return acc.to(src.dtype), active


def push_partials(leg: StagedLeg, src, *, order, start, max_rows, sent, weight=None) -> None:
    """The token-bound push with one row per token and rank: for every slot ``s`` of another
    rank's token (``max_tokens = leg.tokens_per_rank``) with rows here, its partial sum
    (``partial_sums``), quantized (``leg.fmt``), goes to that rank's staging buffer at row
    ``rank * max_tokens + s % max_tokens``. ``sent`` (int64, one element) grows by the rows put
    on the wire. The token's rank adds it once to the rows it kept (``reduce_slots`` with a
    ``stage_row`` from ``partial_stage_rows``). With ``weight``: the weighted sum of combine's
    forward."""
    rank, fmt, max_tokens = leg.rank, leg.fmt, leg.tokens_per_rank
    values, active = partial_sums(src, order, start, rank, max_rows, max_tokens, weight)
    slots = torch.arange(values.shape[0], device=src.device)
    dest = slots // max_tokens
    encoded = encode_rows(values, leg.rounding, fmt)
    staged = rank * max_tokens + slots % max_tokens
    for peer in range(leg.staging.world_size):
        if peer != rank:
            store_rows(leg.staging.peer(peer), leg.rows, staged, values, encoded, active & (dest == peer), fmt)
    sent += active.sum()


def partial_stage_rows(sorted_row: torch.Tensor, dst_rank: torch.Tensor, rank: int, top_k: int,
                       max_tokens: int) -> torch.Tensor:
    """For ``reduce_slots`` after ``push_partials``: per sorted row ``n``, the staged row of its
    token's partial sum from the row's owner (``owner * max_tokens + token``) when ``n`` is the
    token's first slot (lowest ``k``) on that owner, else -1 (added already, or a row that
    stays, or a masked slot). Device ops only."""
    n = sorted_row.view(-1, top_k)
    owner = dst_rank[n]
    earlier = torch.ones(top_k, top_k, dtype=torch.bool, device=sorted_row.device).tril(-1)
    repeat = ((owner.unsqueeze(2) == owner.unsqueeze(1)) & earlier).any(dim=2)
    token = torch.arange(n.shape[0], device=sorted_row.device).unsqueeze(1)
    value = torch.where(routing.to_peer(owner, rank) & ~repeat, owner * max_tokens + token, -1)
    stage_row = torch.empty_like(sorted_row)
    stage_row[n.reshape(-1)] = value.reshape(-1)
    return stage_row


def receive_rows(leg: StagedLeg, out, *, source, stage_row=None, weight=None, dot_with=None, dot_out=None) -> None:
    """Rows ``i`` of ``out`` whose ``source`` is another rank: decoded from this rank's staging
    buffer, row ``stage_row[i]`` (or ``i``), times ``weight[i]`` when given (fp32 multiply, one
    rounding). Padding rows (-1): zeros. This rank's own rows and unused rows: as is. With
    ``dot_with`` (rows like ``out``): ``dot_out[i] = <decoded row i, dot_with[i]>`` in fp32
    (before the weight) for those rows ``i``; other entries as they are."""
    dim = out.shape[1]
    views = leg.views(leg.staging.local, dim, out.dtype)
    remote = (source >= 0) & (source != leg.rank)
    rows = torch.nonzero(remote).squeeze(1)
    values = decode_rows(views, rows if stage_row is None else stage_row[rows], out.dtype, leg.fmt)
    if dot_with is not None:
        dot_out[rows] = (values.float() * dot_with[rows].float()).sum(dim=1)
    if weight is not None:
        values = (values.float() * weight[rows].unsqueeze(1)).to(out.dtype)
    out[rows] = values
    out[source == -1] = 0


def reduce_slots(leg: StagedLeg, out, *, sorted_row, row_rank, local_row, local_src, top_k, weight=None, save=None,
                 dot_with=None, dot_out=None, stage_row=None, weigh_staged=True) -> None:
    """``out[t] = sum_k weight[t*K+k] * v(sorted_row[t*K+k])`` in fp32 (k ascending), where ``v(n)``
    is sorted row ``n``: ``local_src[local_row[n]]`` when ``row_rank[n]`` is this rank (with
    ``leg.quantize_local``: as a peer decodes it, ``round_trip_rows`` with ``leg.rounding``), else
    row ``stage_row[n]`` (or ``n``) of this rank's staging buffer (decoded), or zero where
    ``stage_row[n]`` is -1 or ``row_rank[n]`` is -1 (a masked slot). ``save[n] = v(n)``;
    ``dot_out[t*K+k] = <v(sorted_row[t*K+k]), dot_with[t]>`` in fp32. ``weigh_staged=False``: a
    staged row is added as it is (a weighted partial sum, ``push_partials(weight=...)``); the
    weights multiply the rows that stay."""
    num_tokens, dim = out.shape
    rank, fmt = leg.rank, leg.fmt
    views = leg.views(leg.staging.local, dim, out.dtype)
    acc = torch.zeros((num_tokens, dim), dtype=torch.float32, device=out.device)
    slots = torch.arange(num_tokens, device=out.device) * top_k
    for k in range(top_k):
        n = sorted_row[slots + k]
        is_local = row_rank[n] == rank
        v = local_src[torch.where(is_local, local_row[n], 0)]
        if leg.quantize_local:
            v = round_trip_rows(v, leg.rounding, fmt)
        skipped = row_rank[n] < 0  # a masked slot
        if stage_row is not None:
            skipped = skipped | (~is_local & (stage_row[n] < 0))
        v[skipped] = 0
        remote = torch.nonzero(~is_local & ~skipped).squeeze(1)
        v[remote] = decode_rows(views, n[remote] if stage_row is None else stage_row[n[remote]], out.dtype, fmt)
        if save is not None:
            save[n] = v
        if dot_out is not None:
            dot_out[slots + k] = (v.float() * dot_with.float()).sum(dim=1)
        v = v.float()
        if weight is not None:
            w = weight[slots + k] if weigh_staged else torch.where(is_local, weight[slots + k], 1.0)
            v = v * w.unsqueeze(1)
        acc = acc + v
    out.copy_(acc.to(out.dtype))


def sorted_row_routing(tables, slot, expert_ids, num_local_experts):
    """Per expert-sorted row ``j`` (of ``N``), from ``routing.RoutingTables``: the rank owning
    its expert (``dst_rank``), its row there (``dst_row``; at most ``tables.row_limit - 1``),
    and ``sorted_row[slot[j]] = j``. A masked slot (expert id ``E``: the
    two_hop transport's slots whose expert is on another node) sorts last and gets
    ``dst_rank`` -1, ``dst_row`` 0: every push skips it and the top-k reduction adds nothing
    for it."""
    num, L = slot.numel(), num_local_experts
    expert = expert_ids[slot]
    routed = expert < tables.dst_base.numel()  # else a masked slot: no row anywhere
    expert = torch.where(routed, expert, 0)
    j = torch.arange(num, device=slot.device)
    dst_rank = torch.where(routed, expert // L, -1)
    dst_row = tables.dst_base[expert] + j - tables.first_row[expert]
    if tables.row_limit is not None:
        dst_row = dst_row.clamp(max=tables.row_limit - 1)
    dst_row = torch.where(routed, dst_row, 0)
    sorted_row = torch.empty_like(slot)
    sorted_row[slot] = j
    return dst_rank, dst_row, sorted_row


def expert_row_routing(tables, rank, world, capacity):
    """Per row ``i`` of this rank's ``capacity``-row expert-major buffer: its source rank, or -1
    (padding) / -2 (unused) (``row_source``); the rank and row it returns to in combine
    (``return_rank`` -1 when it stays here or is no data row; ``return_row``)."""
    W = world
    rows = torch.arange(capacity, device=tables.seg_end.device)
    num_segments = tables.seg_end.numel()
    seg = torch.searchsorted(tables.seg_end, rows, right=True)
    seg_c = seg.clamp(max=num_segments - 1)
    kind = seg_c % (W + 1)
    offset = rows - (tables.seg_end - tables.seg_len)[seg_c]
    source = torch.where(kind == W, -1, kind)
    source = torch.where(seg < num_segments, source, -2)
    return_rank = torch.where((source >= 0) & (source != rank), source, -1)
    return_row = torch.where(source >= 0, tables.seg_origin_row[seg_c] + offset, 0)
    return source, return_rank, return_row
