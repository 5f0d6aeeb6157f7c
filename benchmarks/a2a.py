"""bf16 vs MXFP8 expert-parallel all-to-all: dispatch and combine, forward and forward+backward.

Run one process per GPU (NCCL) – or per CPU process (gloo, for a smoke run):

    torchrun --nproc_per_node=2 benchmarks/a2a.py --json benchmarks/a2a_h200x2.json

Each rank holds ``input_shape`` = (batch, seq, dim) tokens, i.e. batch*seq rows of ``dim``.
Routing decides the row splits: ``even`` sends the same number of rows to every rank; ``zipf``
routes every token to one of ``--experts`` experts with Zipf(s) popularity, experts placed
contiguously on ranks (so the ranks owning the popular experts receive most tokens).
"dispatch" sends tokens to the expert ranks; "combine" sends the same rows back (transposed
splits). ``bf16`` = both legs in bf16; ``mxfp8`` = both legs MXFP8 (``mxfp8_all`` preset).
Times are the median over iterations of the slowest rank (CUDA events on GPU). GB/s is the
bf16-equivalent payload the busiest rank sends to other ranks divided by the time (algorithm
bandwidth, comparable across formats); ``wire_GBps`` counts the bytes actually sent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script (python benchmarks/x.py, torchrun): the repo root holds `benchmarks`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dispatcher import leave_process_group  # noqa: E402
from mxfp8_ep.all_to_all import all_to_all_v  # noqa: E402
from mxfp8_ep.quantize import dequantize, quantize  # noqa: E402


def routing_splits(num_rows: int, world: int, routing: str, experts: int, zipf_s: float) -> list[list[int]]:
    """Split matrix S[src][dst]: rows rank src sends rank dst (same token mix on every rank)."""
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


def _time(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median ms of ``fn`` on the slowest rank."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(elapsed)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def bench_case(shape, routing, args, device) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch, seq, dim = shape
    rows = batch * seq
    matrix = routing_splits(rows, world, routing, args.experts, args.zipf_s)
    send = matrix[rank]
    recv = [matrix[src][rank] for src in range(world)]
    group = dist.group.WORLD
    gen = torch.Generator(device=device).manual_seed(rank)
    results = []
    for op, (in_splits, out_splits) in (("dispatch", (send, recv)), ("combine", (recv, send))):
        x = torch.randn(sum(in_splits), dim, device=device, dtype=torch.bfloat16, generator=gen)
        grad = torch.randn(sum(out_splits), dim, device=device, dtype=torch.bfloat16, generator=gen)
        # The busiest sender sets the pace: its rows to other ranks are the bandwidth numerator.
        busiest = torch.tensor([sum(in_splits) - in_splits[rank]], dtype=torch.int64, device=device)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        remote_rows = int(busiest.item())
        for passes in ("fwd", "fwd+bwd"):
            row = {"input_shape": list(shape), "num_splits": world, "routing": routing, "op": op, "pass": passes}
            for fmt in ("bf16", "mxfp8"):
                if passes == "fwd":
                    def fn():
                        all_to_all_v(x, out_splits, in_splits, group, forward_format=fmt, backward_format=fmt)
                else:
                    xg = x.detach().requires_grad_(True)

                    def fn():
                        all_to_all_v(xg, out_splits, in_splits, group, forward_format=fmt,
                                     backward_format=fmt).backward(grad)
                row[f"{fmt}_ms"] = _time(fn, args.iters, args.warmup, device)
            # bf16-equivalent bytes this rank moves across the wire (x2 with the backward leg)
            legs = 1 if passes == "fwd" else 2
            payload = remote_rows * dim * 2 * legs
            wire_mx = remote_rows * (dim + dim // 32) * legs
            row["speedup"] = row["bf16_ms"] / row["mxfp8_ms"]
            row["bf16_GBps"] = payload / row["bf16_ms"] / 1e6
            row["mxfp8_GBps"] = payload / row["mxfp8_ms"] / 1e6
            row["mxfp8_wire_GBps"] = wire_mx / row["mxfp8_ms"] / 1e6
            results.append(row)
        if op == "dispatch":
            # Where the MXFP8 time goes: quantize + dequantize of this rank's remote rows alone.
            xr = x[: max(sum(in_splits) - in_splits[rank], 1)]
            q = quantize(xr)
            results[-1]["quantize_ms"] = _time(lambda: quantize(xr), args.iters, args.warmup, device)
            results[-1]["dequantize_ms"] = _time(lambda: dequantize(q), args.iters, args.warmup, device)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["16,8192,5120", "16,8192,7168", "16,8192,2048"],
                   help="per-rank input shapes batch,seq,dim")
    p.add_argument("--routing", nargs="+", default=["even", "zipf"], choices=["even", "zipf"])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--zipf-s", type=float, default=1.2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None, help="write all rows here (rank 0)")
    args = p.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    rows = []
    for spec in args.shapes:
        shape = tuple(int(v) for v in spec.split(","))
        for routing in args.routing:
            rows.extend(bench_case(shape, routing, args, device))
    if dist.get_rank() == 0:
        env = {
            "device": torch.cuda.get_device_name() if use_cuda else "cpu",
            "world_size": dist.get_world_size(),
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
            "backend": dist.get_backend(),
        }
        header = f"{'input_shape':>18} {'routing':>7} {'op':>8} {'pass':>7} {'splits':>6} " \
                 f"{'bf16_ms':>8} {'mxfp8_ms':>8} {'speedup':>7} {'bf16_GB/s':>9} {'mxfp8_GB/s':>10}"
        print(f"# {env}")
        print(header)
        for r in rows:
            print(f"{str(tuple(r['input_shape'])):>18} {r['routing']:>7} {r['op']:>8} {r['pass']:>7} "
                  f"{r['num_splits']:>6} {r['bf16_ms']:8.3f} {r['mxfp8_ms']:8.3f} {r['speedup']:7.2f} "
                  f"{r['bf16_GBps']:9.1f} {r['mxfp8_GBps']:10.1f}")
        for r in rows:
            if "quantize_ms" in r:
                print(f"# {tuple(r['input_shape'])} {r['routing']}: quantize {r['quantize_ms']:.3f} ms, "
                      f"dequantize {r['dequantize_ms']:.3f} ms (remote rows of dispatch)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": env, "rows": rows}, f, indent=1)
    leave_process_group()


if __name__ == "__main__":
    main()
