"""The exchange legs alone: torchtitan 0.2.2's dispatch and combine against our dispatcher's,
all arms round-robin in one run, over NVLink or NCCL's slower transports; and the bare
``all_to_all_v`` exchange in bf16 and MXFP8.

    torchrun --nproc_per_node=2 -m benchmarks.legs --out OUT [--link nvlink|shm|socket]
    torchrun --nproc_per_node=2 -m benchmarks.legs --out OUT --a2a

Legs: ``--rows`` routed rows of ``--dim`` per rank (top-8 of 64 experts), even or Zipf routing.
torchtitan's whole leg (gather, count exchange, all-to-all, permute; back: unpermute,
all-to-all, unsort, weighted reduce) against ours (``dispatch`` / ``combine`` of
``mxfp8_ep.dispatcher.TokenDispatcher``); each arm's dispatch + combine is checked against
torchtitan's in the first round (``rel_err``). ``--link`` sets NCCL's environment before NCCL
starts (``harness.LINKS``); symm arms need peer memory and run on ``nvlink`` only.

``--a2a``: ``mxfp8_ep.exchange.all_to_all.all_to_all_v`` alone, per rank ``--a2a-shapes`` (batch x seq x
dim rows; even routing: the same rows to every rank; zipf: tokens to one of ``--experts``
experts with Zipf popularity, experts placed contiguously on ranks), dispatch (to the expert
ranks) and combine (back), forward and forward+backward, each leg bf16 or MXFP8 (both ways).
``GBps``: the bf16 bytes the busiest rank sends to other ranks over the time (comparable across
formats); ``wire_GBps``: the bytes actually sent. The MXFP8 dispatch also times the quantize
and dequantize of its remote rows alone (``op`` quantize / dequantize).
"""

from __future__ import annotations

import argparse
import torch
import torch.distributed as dist

from benchmarks.harness import (
    LINKS,
    TOP_K,
    EXPERTS,
    Results,
    TitanLeg,
    add_speedups,
    add_timing_arguments,
    build_dispatcher,
    init_process_group,
    leave_process_group,
    leg_inputs,
    max_over_ranks,
    nbytes,
    parse_arms,
    parsed,
    rel_err,
    reset_peak,
    round_robin,
    sample_ms,
    timed_passes,
    timing_fields,
    titan022_mesh,
    use_link,
    worst_median,
)
from mxfp8_ep.transport import Transport

ARMS = ("torchtitan", "bf16/symm", "mxfp8/symm", "mxfp8_all/symm", "bf16/nccl", "mxfp8/nccl", "mxfp8_all/nccl")
BASELINES = ("torchtitan", "bf16/nccl")
COLUMNS = ("link", "routing", "leg", "arm", "ms", "speedup_vs_torchtitan", "speedup_vs_bf16_nccl", "ms_synced",
           "peak_gib", "rel_err")
A2A_COLUMNS = ("shape", "routing", "op", "pass", "arm", "ms", "speedup_vs_bf16", "GBps", "wire_GBps")


def bench_legs(arms, args, device, mesh) -> list[dict]:
    rank, rows = dist.get_rank(), []
    for routing in args.routings.split(","):
        leg = leg_inputs(args.rows, args.dim, routing, device, rank)
        errs, ref = {}, {}

        def time_arm(arm, first_round, iters):
            disp = TitanLeg(mesh) if arm.baseline else build_dispatcher(arm, leg.tokens, mesh.get_group(), device)
            routed, _, meta = disp.dispatch(leg.x, leg.scores, leg.ids, leg.counts)
            if first_round:
                out = disp.combine(routed, meta)
                errs[arm.name] = max_over_ranks(rel_err(out, ref.setdefault("out", out)), device)
                del out  # the reference's is kept (held_bytes); this arm's is not
            fns = {"dispatch": lambda: disp.dispatch(leg.x, leg.scores, leg.ids, leg.counts),
                   "combine": lambda: disp.combine(routed, meta)}
            reset_peak(device)
            return timed_passes(fns, iters, args, device)

        results = round_robin(arms, time_arm, args, device, lambda: nbytes(ref.values()))
        for arm in arms:
            for name, (ms, ms_synced) in results[arm.name]["ms"].items():
                rows.append({
                    "shape": f"{args.rows}x{args.dim}", "rows": args.rows, "dim": args.dim, "top_k": TOP_K,
                    "experts": EXPERTS, "routing": routing, "ep": dist.get_world_size(), "link": args.link,
                    "arm": arm.name, "leg": name, "pass": "fwd", "ms": round(ms, 3), "ms_synced": round(ms_synced, 3),
                    "peak_gib": round(results[arm.name]["peak_gib"], 2),
                    "rel_err": {"dispatch+combine": float(f"{errs[arm.name]:.3g}")}, **timing_fields(args),
                })
    add_speedups(rows, BASELINES, same=("shape", "routing", "leg", "pass"))
    return rows


# ----------------------------------------------------------------------- all_to_all_v alone


def routing_splits(num_rows: int, world: int, routing: str, experts: int, zipf_s: float) -> list[list[int]]:
    """Split matrix S[src][dst]: rows rank src sends rank dst (the same token mix on every rank)."""
    if routing == "even":
        base = [num_rows // world] * world
        base[-1] += num_rows - sum(base)
        return [list(base) for _ in range(world)]
    if routing != "zipf":
        raise ValueError(f"routing must be 'even' or 'zipf', got {routing!r}")
    if experts % world:
        raise ValueError(f"--experts {experts} must be a multiple of the world size {world}")
    weights = [1.0 / (i + 1) ** zipf_s for i in range(experts)]
    total = sum(weights)
    per_expert = [int(num_rows * w / total) for w in weights]
    per_expert[0] += num_rows - sum(per_expert)
    local = experts // world
    row = [sum(per_expert[r * local:(r + 1) * local]) for r in range(world)]
    return [list(row) for _ in range(world)]


def bench_a2a(args, device) -> list[dict]:
    from mxfp8_ep.exchange.all_to_all import all_to_all_v
    from mxfp8_ep.kernels.quantize import dequantize, quantize
    from mxfp8_ep.format.wire_format import WIRE_FORMATS, WireFormat

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    rows = []

    def timed(fn) -> float:
        return worst_median(sample_ms(fn, args.iters, args.warmup, device), device)

    for spec in args.a2a_shapes.split(","):
        batch, seq, dim = (int(v) for v in spec.split("x"))
        for routing in args.routings.split(","):
            matrix = routing_splits(batch * seq, world, routing, args.experts, 1.2)
            send, recv = matrix[rank], [matrix[src][rank] for src in range(world)]
            gen = torch.Generator(device=device).manual_seed(rank)
            common = {"shape": spec, "batch": batch, "seq": seq, "dim": dim, "routing": routing, "ep": world,
                      **timing_fields(args)}
            for op, (in_splits, out_splits) in (("dispatch", (send, recv)), ("combine", (recv, send))):
                x = torch.randn(sum(in_splits), dim, device=device, dtype=torch.bfloat16, generator=gen)
                grad = torch.randn(sum(out_splits), dim, device=device, dtype=torch.bfloat16, generator=gen)
                # The busiest sender sets the pace: its rows to other ranks are the bandwidth numerator.
                remote = int(max_over_ranks(sum(in_splits) - in_splits[rank], device))
                xg = x.detach().requires_grad_(True)
                for passes, legs in (("fwd", 1), ("fwd+bwd", 2)):
                    for fmt in WIRE_FORMATS:
                        def fn():
                            out = all_to_all_v(xg if legs == 2 else x, out_splits, in_splits, group,
                                               forward_format=fmt, backward_format=fmt)
                            if legs == 2:
                                out.backward(grad)
                        ms = timed(fn)
                        wire = remote * WireFormat(fmt).row_bytes(dim, 2) * legs
                        rows.append({**common, "op": op, "pass": passes, "arm": fmt, "ms": round(ms, 4),
                                     "GBps": round(remote * dim * 2 * legs / ms / 1e6, 1),
                                     "wire_GBps": round(wire / ms / 1e6, 1)})
                if op == "dispatch":
                    xr = x[: max(sum(in_splits) - in_splits[rank], 1)]
                    q = quantize(xr)
                    for name, fn in (("quantize", lambda: quantize(xr)), ("dequantize", lambda: dequantize(q))):
                        rows.append({**common, "op": name, "pass": "fwd", "arm": "mxfp8", "ms": round(timed(fn), 4)})
    add_speedups(rows, ("bf16",), same=("shape", "routing", "op", "pass"))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default=None,
                        help="comma-separated (harness.Arm); default: every arm the link allows")
    parser.add_argument("--rows", type=int, default=131072, help="routed rows per rank")
    parser.add_argument("--dim", type=int, default=5120)
    parser.add_argument("--routings", default="even,zipf")
    parser.add_argument("--link", choices=sorted(LINKS), default="nvlink",
                        help="the link NCCL crosses (its environment, set before NCCL starts)")
    parser.add_argument("--a2a", action="store_true", help="time all_to_all_v alone instead of the legs")
    parser.add_argument("--a2a-shapes", default="16x8192x5120,16x8192x7168,16x8192x2048",
                        help="batch x seq x dim, per rank")
    parser.add_argument("--experts", type=int, default=64, help="--a2a zipf routing: experts over the ranks")
    add_timing_arguments(parser)
    args = parser.parse_args(argv)
    if args.arms is None:
        args.arms = ",".join(a for a in ARMS if args.link == "nvlink" or not a.endswith("/symm"))
    arms = parsed(parser, parse_arms, args.arms, first="torchtitan")
    if args.link != "nvlink" and any(arm.transport == Transport.SYMM for arm in arms):
        parser.error(f"--link {args.link}: symm arms cross NVLink peer memory whatever NCCL's link; leave them out")
    for routing in args.routings.split(","):
        if routing not in ("even", "zipf"):
            parser.error(f"--routings: expected even and/or zipf, got {routing!r}")

    use_link(args.link)  # before NCCL creates its communicators
    device = init_process_group()
    if args.a2a:
        results = Results("a2a", args.out, link=args.link)
        results.write(bench_a2a(args, device), A2A_COLUMNS)
    else:
        mesh = titan022_mesh(device)
        results = Results("legs" if args.link == "nvlink" else f"legs_{args.link}", args.out, link=args.link)
        results.write(bench_legs(arms, args, device, mesh), COLUMNS)
    leave_process_group()


if __name__ == "__main__":
    main()
