"""The expert-bound push on one GPU: row by row (``push_rows``) against each token once per
rank (``push_tokens``, at several launch shapes), and the receive by row against the receive
through the token map ``push_tokens`` writes; the same for a weighted leg (combine's backward:
each row times its score, and the score gradient's dot product with a saved row), whose
receive multiplies by the row weights ``push_tokens`` leaves; after combine's partial sums the
score gradients' dot products are taken against the expert rows instead (rows that stay in the
push, received rows in the receive). The way back (dispatch's backward, and combine's forward
weighted by the scores; bf16 and MXFP8): the token-bound push row by row against one partial
sum per token and rank (``push_partials``), and the top-k reduce of rows (combine's forward:
weighted, keeping each row for the score gradients) against the reduce of partial sums.

    torchrun --nproc_per_node=1 benchmarks/push_sweep.py --json push_sweep.json

Rank 0 of an EP group (``--world``, default 2) with a MoE shape's routing (top-k of random
experts, expert-sorted rows as the dispatcher sorts them), and peer 1's receive and way back
with as many rows from every rank as from rank 0. The peers are buffers on the same GPU, so the
rows that would cross NVLink are HBM stores here: this measures a push's HBM pass, not the link
(on 2xH200 the link is slower: ``benchmarks/dispatcher.py``). ``--world 8`` shows the kernels
at the EP degree of an 8-GPU node, where 7 of 8 rows leave. Each row's time is a median of
CUDA-event samples, the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

# Run as a script (python benchmarks/x.py, torchrun): the repo root holds `benchmarks`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dispatcher import (  # noqa: E402
    SHAPES,
    _sample_ms,
    add_timing_arguments,
    finish,
    init_process_group,
    parse_shapes,
)
from benchmarks.receive_sweep import run_rounds  # noqa: E402
from mxfp8_ep import symm_kernels as sk  # noqa: E402
from mxfp8_ep.launch_shapes import KernelShapes, LaunchShape  # noqa: E402
from mxfp8_ep.peer_memory import OneProcessPeers  # noqa: E402
from mxfp8_ep.staging import row_weights, staging_buffer_nbytes, staging_nbytes, token_map, token_map_offset  # noqa: E402
from mxfp8_ep.symm_reference import partial_slots, partial_stage_rows  # noqa: E402

SWEPT_PUSH_TOKENS_SHAPES = [(1, 2, 1024), (1, 4, 1024), (2, 2, 1024), (2, 4, 1024), (2, 8, 1024)]
RANK = 0


def _triple(shape: LaunchShape) -> tuple[int, int, int]:
    return shape.block, shape.warps, shape.block_d


def sorted_routing(tokens: int, experts: int, top_k: int, world: int, device, seed: int = 0):
    """Rank 0 of ``world``: top-k of random experts per token, sorted by expert (stable, as the
    dispatcher's argsort): each sorted row's owner rank and row there (rows in sorted order per
    owner), the slot of each sorted row, and ``inv`` (the sorted row of each slot)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(tokens, experts, device=device, generator=g).topk(top_k, dim=1).indices
    slot = torch.argsort(ids.reshape(-1), stable=True)
    dst_rank = ids.reshape(-1)[slot] // (experts // world)
    dst_row = torch.zeros_like(dst_rank)
    for r in range(world):
        mine = dst_rank == r
        dst_row[mine] = torch.arange(int(mine.sum()), device=device)
    inv = torch.empty_like(slot)
    inv[slot] = torch.arange(slot.numel(), device=device)
    return dst_rank, dst_row, slot, inv


def peer_one_rows(peers, offset: int, capacity: int, dst_rank, world: int, tokens: int):
    """Peer 1's expert-major rows at EP=``world`` once rank 0's ``push_tokens`` ran: rank 0's
    rows where that push put them, then as many from each other rank (rank 0's routing again,
    its tokens staged at that rank's rows), then its own. Returns each row's source rank (-2:
    unused), its staged row and its routing weight (as rank 0's token map and row weights)."""
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


def sweep(shape_name: str, args, device, rows_out: list[dict]) -> None:
    shape = SHAPES[shape_name]
    tokens, top_k, dim, world = args.tokens or shape.tokens, shape.top_k, shape.dim, args.world
    if shape.experts % world:
        raise SystemExit(f"--world {world} does not divide {shape_name}'s {shape.experts} experts")
    dst_rank, dst_row, slot, inv = sorted_routing(tokens, shape.experts, top_k, world, device)
    n = tokens * top_k
    # Peer 1 holds as many rows from each rank as from rank 0 (peer_one_rows).
    rows, capacity = max(n, world * tokens), max(n, world * int((dst_rank == 1).sum()))
    offset = token_map_offset(rows, dim, torch.bfloat16)
    x = torch.randn((tokens, dim), device=device, dtype=torch.bfloat16)
    out = torch.empty((capacity, dim), device=device, dtype=torch.bfloat16)
    sent = torch.zeros(1, dtype=torch.int64, device=device)
    to_peer = int((dst_rank != RANK).sum())

    def timed(fn) -> float:
        return statistics.median(_sample_ms(fn, args.iters, args.warmup, device, group=args.group))

    def row(kernel, fmt, launch, ms):
        rows_out.append({"bench": "push_sweep", "shape": shape.label(), "world": world, "kernel": kernel,
                         "fmt": fmt, "launch": launch, "ms": round(ms, 4), "rows_to_peer": to_peer})

    # Combine's backward: a score per slot, and the routed outputs saved for the score gradient.
    factor = torch.rand(n, device=device)
    saved = torch.randn((n, dim), device=device, dtype=torch.bfloat16)
    dots = torch.empty(n, device=device)
    for fmt in ("bf16", "mxfp8"):
        peers = OneProcessPeers(staging_buffer_nbytes(rows, dim, torch.bfloat16, capacity), world, RANK, device)
        push_launch = {"rows": KernelShapes.default(fmt).push_rows.block, "warps": KernelShapes.default(fmt).push_rows.warps}
        row("push_rows", fmt, push_launch, timed(
            lambda: sk.push_rows(x, dst_rank, dst_row, out, peers, rows, RANK, fmt, "rceil", slot=slot, top_k=top_k)))
        weighted = dict(slot=slot, top_k=top_k, weight=factor, dot_with=saved, dot_out=dots)
        row("push_rows (weighted)", fmt, push_launch, timed(
            lambda: sk.push_rows(x, dst_rank, dst_row, out, peers, rows, RANK, fmt, "rceil", **weighted)))
        for shape_of_push in args.push_tokens_shapes:
            launch = dict(zip(("tokens", "warps", "block_d"), shape_of_push))
            kernel_shape = LaunchShape(*shape_of_push)
            row("push_tokens", fmt, launch, timed(
                lambda: sk.push_tokens(x, inv, dst_rank, dst_row, out, peers, rows, offset, capacity, RANK, fmt,
                                       "rceil", top_k, tokens, sent, shape=kernel_shape)))
            row("push_tokens (weighted)", fmt, launch, timed(
                lambda: sk.push_tokens(x, inv, dst_rank, dst_row, out, peers, rows, offset, capacity, RANK, fmt,
                                       "rceil", top_k, tokens, sent, weight=factor, dot_with=saved, dot_out=dots,
                                       shape=kernel_shape)))
            row("push_tokens (weighted, local dots)", fmt, launch, timed(
                lambda: sk.push_tokens(x, inv, dst_rank, dst_row, out, peers, rows, offset, capacity, RANK, fmt,
                                       "rceil", top_k, tokens, sent, weight=factor, dot_with=saved, dot_out=dots,
                                       dot_with_expert_rows=True,
                                       shape=kernel_shape)))
        # The peer's receive: each row from the staged row of its index, or through the map.
        source, tmap, weights = peer_one_rows(peers, offset, capacity, dst_rank, world, tokens)
        peer_side = peers.seen_from(1)
        received = torch.empty((capacity, dim), device=device, dtype=torch.bfloat16)
        receive = KernelShapes.default(fmt).receive_rows
        launch = {"rows": receive.block, "warps": receive.warps}
        row("receive_rows", fmt, launch, timed(lambda: sk.receive_rows(received, source, 1, peer_side, rows, fmt)))
        row("receive_rows (token map)", fmt, launch, timed(
            lambda: sk.receive_rows(received, source, 1, peer_side, rows, fmt, stage_row=tmap)))
        row("receive_rows (token map, weighted)", fmt, launch, timed(
            lambda: sk.receive_rows(received, source, 1, peer_side, rows, fmt, stage_row=tmap, weight=weights)))
        row_dots = torch.empty(capacity, device=device)
        row("receive_rows (token map, weighted, dots)", fmt, launch, timed(
            lambda: sk.receive_rows(received, source, 1, peer_side, rows, fmt, stage_row=tmap, weight=weights,
                                    dot_with=saved, dot_out=row_dots)))
    # The way back (dispatch's backward, bf16 and MXFP8): the peer pushes its rows of the
    # other ranks' tokens row by row, or one partial sum per token and rank (through the token
    # map); rank 0 reduces each token's K slots, reading rows, or partials once per token and peer.
    grads = torch.randn((capacity, dim), device=device, dtype=torch.bfloat16)
    remote = (source >= 0) & (source != 1)
    to_one = torch.nonzero(dst_rank == 1).squeeze(1)
    return_row = torch.zeros(capacity, dtype=torch.int64, device=device)
    return_row[remote] = to_one.repeat(world - 1)  # each sender's sorted row (rank 0's routing)
    return_rank = torch.where(remote, source, -1)
    back = OneProcessPeers(staging_buffer_nbytes(rows, dim, torch.bfloat16, capacity), world, 1, device)
    row_slot = torch.where(remote, tmap, world * tokens)
    order, start = partial_slots(row_slot, world * tokens)
    max_rows = min(top_k, shape.experts // world)
    token_side = back.seen_from(RANK)
    reduced = torch.empty((tokens, dim), device=device, dtype=torch.bfloat16)
    stage_row = partial_stage_rows(inv, dst_rank, RANK, top_k, tokens)
    row_score = torch.rand(capacity, device=device)
    kept = torch.empty((n, dim), device=device, dtype=torch.bfloat16)
    for fmt in ("bf16", "mxfp8"):
        push = KernelShapes.default(fmt).push_rows
        row("push_rows (token-bound)", fmt, {"rows": push.block, "warps": push.warps}, timed(
            lambda: sk.push_rows(grads, return_rank, return_row, None, back, rows, 1, fmt, "rceil")))
        defaults = KernelShapes.default(fmt)
        for shape_of_partials in args.push_partials_shapes or [_triple(defaults.push_partials)]:
            launch = dict(zip(("slots", "warps", "block_d"), shape_of_partials))
            kernel_shape = LaunchShape(*shape_of_partials)
            row("push_partials", fmt, launch, timed(
                lambda: sk.push_partials(grads, order, start, back, rows, 1, fmt, "rceil", max_rows, tokens, sent,
                                         shape=kernel_shape)))
            # Combine's forward: weighted partial sums from the experts' rank.
            row("push_partials (weighted)", fmt, launch, timed(
                lambda: sk.push_partials(grads, order, start, back, rows, 1, fmt, "rceil", max_rows, tokens, sent,
                                         weight=row_score, shape=kernel_shape)))
        for shape_of_reduce in args.reduce_shapes or [_triple(defaults.reduce_slots)]:
            launch = dict(zip(("tokens", "warps", "block_d"), shape_of_reduce))
            kernel_shape = LaunchShape(*shape_of_reduce)
            row("reduce_slots", fmt, launch, timed(
                lambda: sk.reduce_slots(reduced, inv, dst_rank, dst_row, out, token_side, rows, RANK, fmt, top_k,
                                        shape=kernel_shape)))
            row("reduce_slots (partials)", fmt, launch, timed(
                lambda: sk.reduce_slots(reduced, inv, dst_rank, dst_row, out, token_side, rows, RANK, fmt, top_k,
                                        stage_row=stage_row, shape=kernel_shape)))
            # Combine's forward: rows weighted on the token's rank (each kept for the score
            # gradients), or the weighted partial sums.
            row("reduce_slots (weighted, keeps rows)", fmt, launch, timed(
                lambda: sk.reduce_slots(reduced, inv, dst_rank, dst_row, out, token_side, rows, RANK, fmt, top_k,
                                        weight=factor, save=kept, shape=kernel_shape)))
            row("reduce_slots (weighted partials)", fmt, launch, timed(
                lambda: sk.reduce_slots(reduced, inv, dst_rank, dst_row, out, token_side, rows, RANK, fmt, top_k,
                                        weight=factor, stage_row=stage_row, weigh_staged=False, shape=kernel_shape)))
    assert staging_nbytes(rows, dim, torch.bfloat16) <= offset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv3")
    parser.add_argument("--push-tokens-shapes", type=parse_shapes, default=SWEPT_PUSH_TOKENS_SHAPES,
                        help='push_tokens launch shapes "tokens,warps,block_d;..."')
    parser.add_argument("--reduce-shapes", type=parse_shapes, default=None,
                        help='reduce_slots launch shapes "tokens,warps,block_d;..." (default: each format\'s own)')
    parser.add_argument("--push-partials-shapes", type=parse_shapes, default=None,
                        help='push_partials launch shapes "slots,warps,block_d;..." (default: each format\'s own)')
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the shape's)")
    parser.add_argument("--world", type=int, default=2,
                        help="the EP degree rank 0 and peer 1 run at; the other peers are buffers too")
    add_timing_arguments(parser)
    args = parser.parse_args()
    rows = run_rounds(sweep, args, init_process_group())
    finish(rows, args.json, lambda r: (f"{r['kernel']:<36} {r['fmt']:<6} {json.dumps(r['launch']):<44} "
                                       f"{r['ms']:>8.4f} ms  {r['shape']}"))


if __name__ == "__main__":
    main()
