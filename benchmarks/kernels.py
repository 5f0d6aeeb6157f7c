"""The symm transport's Triton kernels alone, on one GPU, at launch shapes side by side.

    torchrun --nproc_per_node=1 -m benchmarks.kernels --out OUT [--world 8] \\
        [--launch push_tokens=1x4x1024,2x4x1024 --launch reduce_slots.mxfp8=1x4x512]

Rank 0 of an EP group of ``--world`` ranks with a MoE shape's routing (top-k of random experts,
rows sorted by expert as the dispatcher sorts them), and peer 1's receive and way back with as
many rows from every rank as from rank 0. The peers are buffers on the same GPU
(``OneProcessPeers``), so the rows that would cross NVLink are HBM stores here: this measures
each kernel's HBM pass, not the link. ``--world 8`` runs the kernels at the EP degree of an
8-GPU node, where 7 of 8 rows leave.

Kernels and their variants: the expert-bound push row by row (``push_rows``) and each token
once per rank (``push_tokens``), plain (dispatch's forward) and weighted (combine's backward:
each row times its score, with the score gradients' dot products against saved rows, or
against the token's own rows after combine's partial sums); the receive by row and through the
token map (``receive_rows``); the way back row by row (``push_rows``, token-bound) and as one
partial sum per token and rank (``push_partials``, plain and weighted); the top-k reduce of rows
and of partial sums (``reduce_slots``); the dispatcher's device checks of the routing
(``check_routing``: its Triton kernels, and their torch twin).

Each kernel runs at its format's default launch shape (``mxfp8_ep.kernels.launch_shapes``) and at every
shape ``--launch`` names for it (``KERNEL=BxW[xD[xSxP]],...``; ``KERNEL.FMT=`` for one format);
``speedup_vs_default``: the default's time over the row's. Each row's ``ms`` is the median over
``--rounds`` rounds (the whole sweep once per round) of each round's median sample.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict

import torch
import torch.distributed as dist

from benchmarks.harness import (
    SHAPES,
    Results,
    add_timing_arguments,
    init_process_group,
    leave_process_group,
    launches,
    parse_launch_options,
    parsed,
    sample_ms,
    timing_fields,
)
from mxfp8_ep.format.wire_format import WIRE_FORMATS

RANK = 0
FORMATS = WIRE_FORMATS
COLUMNS = ("world", "kernel", "variant", "fmt", "launch", "ms", "speedup_vs_default")


def sorted_routing(tokens: int, experts: int, top_k: int, world: int, device, seed: int = 0):
    """Rank 0 of ``world``: top-k of random experts per token, sorted by expert (stable, as the
    dispatcher's argsort): each sorted row's owner rank and row there (rows in sorted order per
    owner), the slot of each sorted row, and ``sorted_row`` (the sorted row of each slot)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(tokens, experts, device=device, generator=g).topk(top_k, dim=1).indices
    slot = torch.argsort(ids.reshape(-1), stable=True)
    dst_rank = ids.reshape(-1)[slot] // (experts // world)
    dst_row = torch.zeros_like(dst_rank)
    for r in range(world):
        mine = dst_rank == r
        dst_row[mine] = torch.arange(int(mine.sum()), device=device)
    sorted_row = torch.empty_like(slot)
    sorted_row[slot] = torch.arange(slot.numel(), device=device)
    return dst_rank, dst_row, slot, sorted_row


def peer_one_rows(peers, offset: int, capacity: int, dst_rank, world: int, tokens: int):
    """Peer 1's expert-major rows at EP=``world`` once rank 0's ``push_tokens`` ran: rank 0's
    rows where that push put them, then as many from each other rank (rank 0's routing again,
    its tokens staged at that rank's rows), then its own. Returns each row's source rank (-2:
    unused), its staged row and its routing weight (as rank 0's token map and row weights)."""
    from mxfp8_ep.exchange.staging import row_weights, token_map

    count = int((dst_rank == 1).sum())
    senders = [0, *range(2, world)]
    source = torch.full((capacity,), -2, dtype=torch.int64, device=dst_rank.device)
    source[:count * (world - 1)] = torch.tensor(senders, device=dst_rank.device).repeat_interleave(count)
    source[count * (world - 1):count * world] = 1
    tmap, weights = torch.zeros_like(source), torch.zeros(capacity, device=dst_rank.device)
    staged = token_map(peers.peer(1), offset, capacity)[:count] % tokens
    tmap[:count * (world - 1)] = torch.cat([staged + r * tokens for r in senders])
    weights[:count * (world - 1)] = row_weights(peers.peer(1), offset, capacity)[:count].repeat(world - 1)
    return source, tmap, weights


def sweep(shape, args, device, options) -> list[dict]:
    """One round: every kernel, variant, format and launch shape once."""
    from mxfp8_ep.exchange import symm_kernels as sk
    from mxfp8_ep.dispatcher import checks
    from mxfp8_ep.exchange.peer_memory import OneProcessPeers
    from mxfp8_ep.exchange.staging import StagedLeg, staging_buffer_nbytes, token_map_offset
    from mxfp8_ep.exchange.symm_reference import partial_slots, partial_stage_rows

    tokens, top_k, dim, world = args.tokens or shape.tokens, shape.top_k, shape.dim, args.world
    dst_rank, dst_row, slot, sorted_row = sorted_routing(tokens, shape.experts, top_k, world, device)
    n = tokens * top_k
    # Peer 1 holds as many rows from each rank as from rank 0 (peer_one_rows).
    rows, capacity = max(n, world * tokens), max(n, world * int((dst_rank == 1).sum()))
    offset = token_map_offset(rows, dim, torch.bfloat16)
    nbytes = staging_buffer_nbytes(rows, dim, torch.bfloat16, capacity)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x, out = torch.randn((tokens, dim), **bf16), torch.empty((capacity, dim), **bf16)
    sent = torch.zeros(1, dtype=torch.int64, device=device)
    common = {**shape.row_fields(), "tokens": tokens, "world": world, "rows_to_peer": int((dst_rank != RANK).sum())}
    # Combine's backward: a score per slot, and the routed outputs saved for the score gradient.
    weight, dots = torch.rand(n, device=device), torch.empty(n, device=device)
    saved = torch.randn((n, dim), **bf16)
    found: list[dict] = []

    def run(kernel: str, fmt: str, variants: dict) -> None:
        for launch in launches(options, kernel, fmt):
            for variant, call in variants.items():
                ms = statistics.median(sample_ms(lambda: call(launch), args.iters, args.warmup, device,
                                                 group=args.group))
                found.append({**common, "kernel": kernel, "variant": variant, "fmt": fmt, "launch": asdict(launch),
                              "default_launch": launch == launches({}, kernel, fmt)[0], "ms": ms})

    for fmt in FORMATS:
        peers = OneProcessPeers(nbytes, world, RANK, device)
        leg = StagedLeg(staging=peers, rows=rows, rank=RANK, fmt=fmt, tokens_per_rank=tokens, map_offset=offset,
                        map_rows=capacity)
        push = dict(dst_rank=dst_rank, dst_row=dst_row, local_out=out, slot=slot, top_k=top_k)
        run("push_rows", fmt, {
            "plain": lambda s: sk.push_rows(leg.launched_at("push_rows", s), x, **push),
            "weighted": lambda s: sk.push_rows(leg.launched_at("push_rows", s), x, **push, weight=weight,
                                               dot_with=saved, dot_out=dots)})
        tok = dict(sorted_row=sorted_row, dst_rank=dst_rank, dst_row=dst_row, local_out=out, top_k=top_k, sent=sent)
        run("push_tokens", fmt, {
            "plain": lambda s: sk.push_tokens(leg.launched_at("push_tokens", s), x, **tok),
            "weighted": lambda s: sk.push_tokens(leg.launched_at("push_tokens", s), x, **tok, weight=weight,
                                                 dot_with=saved, dot_out=dots),
            "weighted, local dots": lambda s: sk.push_tokens(leg.launched_at("push_tokens", s), x, **tok, weight=weight,
                                                             dot_with=saved, dot_out=dots, dot_with_expert_rows=True)})
        # The peer's receive: each row from the staged row of its index, or through the map.
        source, tmap, weights = peer_one_rows(peers, offset, capacity, dst_rank, world, tokens)
        peer = StagedLeg(staging=peers.seen_from(1), rows=rows, rank=1, fmt=fmt)
        received = torch.empty((capacity, dim), **bf16)
        row_dots = torch.empty(capacity, device=device)
        run("receive_rows", fmt, {
            "by row": lambda s: sk.receive_rows(peer.launched_at("receive_rows", s), received, source=source),
            "token map": lambda s: sk.receive_rows(peer.launched_at("receive_rows", s), received, source=source,
                                                   stage_row=tmap),
            "token map, weighted": lambda s: sk.receive_rows(peer.launched_at("receive_rows", s), received,
                                                             source=source, stage_row=tmap, weight=weights),
            "token map, weighted, dots": lambda s: sk.receive_rows(peer.launched_at("receive_rows", s), received,
                                                                   source=source, stage_row=tmap, weight=weights,
                                                                   dot_with=saved, dot_out=row_dots)})
    # The way back (dispatch's backward; combine's forward weighted by the scores): the peer
    # pushes its rows of the other ranks' tokens row by row, or one partial sum per token and
    # rank (through the token map); rank 0 reduces each token's K slots, reading rows, or
    # partials once per token and peer.
    grads = torch.randn((capacity, dim), **bf16)
    remote = (source >= 0) & (source != 1)
    return_row = torch.zeros(capacity, dtype=torch.int64, device=device)
    return_row[remote] = torch.nonzero(dst_rank == 1).squeeze(1).repeat(world - 1)  # each sender's sorted row
    return_rank = torch.where(remote, source, -1)
    back = OneProcessPeers(nbytes, world, 1, device)
    order, start = partial_slots(torch.where(remote, tmap, world * tokens), world * tokens)
    max_rows = top_k  # as the dispatcher passes it: a token may list one expert up to top_k times
    reduced, kept = torch.empty((tokens, dim), **bf16), torch.empty((n, dim), **bf16)
    stage_row = partial_stage_rows(sorted_row, dst_rank, RANK, top_k, tokens)
    row_score = torch.rand(capacity, device=device)
    for fmt in FORMATS:
        leg = StagedLeg(staging=back, rows=rows, rank=1, fmt=fmt, tokens_per_rank=tokens)
        run("push_rows", fmt, {"token-bound": lambda s: sk.push_rows(leg.launched_at("push_rows", s), grads,
                                                                       dst_rank=return_rank, dst_row=return_row)})
        partials = dict(order=order, start=start, max_rows=max_rows, sent=sent)
        run("push_partials", fmt, {
            "plain": lambda s: sk.push_partials(leg.launched_at("push_partials", s), grads, **partials),
            "weighted": lambda s: sk.push_partials(leg.launched_at("push_partials", s), grads, **partials,
                                                   weight=row_score)})
        home = StagedLeg(staging=back.seen_from(RANK), rows=rows, rank=RANK, fmt=fmt)
        red = dict(sorted_row=sorted_row, row_rank=dst_rank, local_row=dst_row, local_src=out, top_k=top_k)
        run("reduce_slots", fmt, {
            "rows": lambda s: sk.reduce_slots(home.launched_at("reduce_slots", s), reduced, **red),
            "partials": lambda s: sk.reduce_slots(home.launched_at("reduce_slots", s), reduced, **red,
                                                  stage_row=stage_row),
            "weighted, keeps rows": lambda s: sk.reduce_slots(home.launched_at("reduce_slots", s), reduced, **red,
                                                              weight=weight, save=kept),
            "weighted partials": lambda s: sk.reduce_slots(home.launched_at("reduce_slots", s), reduced, **red,
                                                           weight=weight, stage_row=stage_row, weigh_staged=False)})
    # The dispatcher's device checks of rank 0's routing (dispatch's forward, every transport):
    # its Triton kernels and their torch twin.
    ids = torch.empty(n, dtype=torch.int64, device=device)
    ids[slot] = dst_rank * (shape.experts // world)  # the first expert of each slot's owner: a valid routing
    counts = torch.zeros(shape.experts, dtype=torch.int64, device=device).scatter_add_(0, ids, torch.ones_like(ids))
    for variant in ("triton", "torch"):
        ms = statistics.median(sample_ms(lambda: checks.check_routing(ids, counts, shape.experts, variant),
                                         args.iters, args.warmup, device, group=args.group))
        found.append({**common, "kernel": "check_routing", "variant": variant, "fmt": None, "launch": None,
                      "default_launch": True, "ms": ms})
    return found


def merge_rounds(runs: list[list[dict]]) -> list[dict]:
    """The first round's rows, each with every round's time (``rounds_ms``), their median
    (``ms``) and ``speedup_vs_default`` (the same kernel, variant and format at its default
    launch shape)."""
    rows = [dict(r) for r in runs[0]]
    for i, row in enumerate(rows):
        row["rounds_ms"] = [round(run[i]["ms"], 4) for run in runs]
        row["ms"] = round(statistics.median(run[i]["ms"] for run in runs), 4)
    default = {(r["world"], r["kernel"], r["variant"], r["fmt"]): r["ms"] for r in rows if r["default_launch"]}
    for r in rows:
        base = default.get((r["world"], r["kernel"], r["variant"], r["fmt"]))
        r["speedup_vs_default"] = round(base / r["ms"], 3) if base and r["ms"] else None
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="dsv3")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the shape's)")
    parser.add_argument("--world", type=int, default=2, help="the EP degree rank 0 and peer 1 run at")
    parser.add_argument("--launch", action="append", default=[], help="KERNEL[.FMT]=BxW[xD],... (repeatable)")
    add_timing_arguments(parser)
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.world < 2 or shape.experts % args.world:
        parser.error(f"--world {args.world}: expected >= 2 and a divisor of {args.shape}'s {shape.experts} experts")
    options = parsed(parser, parse_launch_options, args.launch)
    device = init_process_group()
    if dist.get_world_size() != 1:
        raise SystemExit("benchmarks.kernels runs on one process (one GPU); its peers are buffers there")
    rows = merge_rounds([sweep(shape, args, device, options) for _ in range(args.rounds)])
    for r in rows:
        r.update(timing_fields(args))
    Results("kernels", args.out, count=1).write(rows, COLUMNS)
    leave_process_group()


if __name__ == "__main__":
    main()
