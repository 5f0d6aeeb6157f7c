"""Where the dispatcher's GPU time goes, across GPUs:

    torchrun --nproc_per_node=2 -m benchmarks.timeline --out OUT [--parts kernels,layer,leg]

``kernels``: each kernel of the symm dispatch and combine legs alone, over the dispatcher's own
routing of a leg (``--rows`` x ``--dim``, top-8 of 64 experts, even routing), at each format's
default launch shape and the ``--launch`` ones, with the bandwidth it reaches: the bytes it must
read and write in HBM, and the bytes it sends to peers. Beside them, two ceilings: one contiguous
SM copy of the remote rows' bytes into the next rank's buffer (``p2p_copy``) and a local HBM
copy of everything the push reads (``hbm_copy``); and the whole legs. Median of CUDA-event
samples, max over ranks.

``layer``: torch.profiler over two forward+backward passes of the 0.2.2 MoE layer
(``--layer-shape``) per arm of ``--arms``: its top kernels by device time (printed), and per rank
the timeline: the time the GPU is idle between kernels, how much of it the host caused (the next
kernel was launched after the previous one had ended), the largest gaps with the kernels around
them, and every GEMM call in order (kernel, stream, grid, time, work beside it on other streams),
to compare the same GEMM across arms.

``leg``: the same timeline over back-to-back dispatch legs alone (``--leg-arms``), per call, and
the host time of one call while the GPU is busy with earlier work.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from benchmarks.harness import (
    SHAPES,
    TOP_K,
    Results,
    build_dispatcher,
    build_moe,
    free_peer_buffers,
    init_process_group,
    launches,
    leave_process_group,
    leg_inputs,
    parse_arm,
    parse_arms,
    parse_launch_options,
    parsed,
    sample_ms,
    titan022_mesh,
    worst_median,
)

PARTS = ("kernels", "layer", "leg")
KERNEL_COLUMNS = ("fmt", "stage", "launch", "ms", "hbm_GBps", "nvlink_GBps")
TIMELINE_COLUMNS = ("part", "arm", "rank", "span_ms", "busy_ms", "idle_ms", "idle_host_late_ms", "gaps_over_20us")


def kernel_rows(args, options) -> list[dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    leg = leg_inputs(args.rows, args.dim, "even", device, dist.get_rank())
    rows = []
    for fmt, preset in (("bf16", "bf16"), ("mxfp8", "mxfp8_all")):
        rows += format_kernel_rows(fmt, preset, leg, args, options, device)
        free_peer_buffers()
    return rows


def format_kernel_rows(fmt: str, preset: str, leg, args, options, device) -> list[dict]:
    """``kernel_rows`` of one leg format (its dispatcher: ``<preset>/symm``)."""
    from mxfp8_ep.exchange import symm_kernels as sk
    from mxfp8_ep.exchange.peer_memory import PeerBuffer
    from mxfp8_ep.exchange.staging import StagedLeg, staging_buffer_nbytes, token_map_offset
    from mxfp8_ep.format.wire_format import WireFormat

    rank, world, dim = dist.get_rank(), dist.get_world_size(), args.dim
    tokens, x, scores = leg.tokens, leg.x, leg.scores
    rows = []
    disp = build_dispatcher(parse_arm(f"{preset}/symm"), tokens, dist.group.WORLD, device)
    routed, _, meta = disp.dispatch(x, scores, leg.ids, leg.counts)
    capacity = meta.capacity
    # The row-by-row kernels store at expert-major rows, up to the capacity: more than the
    # dispatcher's staging buffers hold at top-k > 1. A buffer of their own, for every kernel.
    staging_rows = max(capacity, tokens * TOP_K)
    map_offset = token_map_offset(staging_rows, dim, x.dtype)
    staging = PeerBuffer(staging_buffer_nbytes(staging_rows, dim, x.dtype, capacity), dist.group.WORLD, device)
    out = torch.empty_like(routed)
    n = meta.slot.numel()
    remote = int((meta.dst_rank != rank).sum())
    wire_row = WireFormat(fmt).row_bytes(dim, x.element_size())
    owners = meta.dst_rank[meta.sorted_row].view(tokens, TOP_K)
    remote_tokens = sum(int((owners == peer).any(dim=1).sum()) for peer in range(world) if peer != rank)
    sent = torch.zeros(1, dtype=torch.int64, device=device)
    p2p_src = torch.empty(remote * wire_row, dtype=torch.uint8, device=device)
    x_rep = torch.empty((n, dim), dtype=torch.bfloat16, device=device)
    staged = StagedLeg(staging=staging, rows=staging_rows, rank=rank, fmt=fmt, tokens_per_rank=tokens,
                       map_offset=map_offset, map_rows=capacity)
    # (kernel whose launch shape applies or None, call, HBM bytes it must move, bytes it sends to the peer)
    stages = {
        "push": ("push_rows", lambda s: sk.push_rows(staged.launched_at("push_rows", s), x, dst_rank=meta.dst_rank,
                                                     dst_row=meta.dst_row, local_out=out, slot=meta.slot, top_k=TOP_K),
                 n * dim * 2 + (n - remote) * dim * 2, remote * wire_row),
        # Each token once per rank (what the dispatcher runs for this unweighted leg), and its
        # receive through the token map.
        "push_tokens": ("push_tokens", lambda s: sk.push_tokens(
            staged.launched_at("push_tokens", s), x, sorted_row=meta.sorted_row, dst_rank=meta.dst_rank,
            dst_row=meta.dst_row, local_out=out, top_k=TOP_K, sent=sent),
            tokens * dim * 2 + (n - remote) * dim * 2, remote_tokens * wire_row),
        "receive_token_map": ("receive_rows", lambda s: sk.receive_rows(
            staged.launched_at("receive_rows", s), out, source=meta.row_source,
            stage_row=staged.token_map(staging.local)),
            remote_tokens * wire_row + remote * dim * 2, 0),
        "receive": ("receive_rows", lambda s: sk.receive_rows(staged.launched_at("receive_rows", s), out,
                                                              source=meta.row_source),
                    remote * (wire_row + dim * 2), 0),
        "push_back": ("push_rows", lambda s: sk.push_rows(staged.launched_at("push_rows", s), routed,
                                                          dst_rank=meta.return_rank, dst_row=meta.return_row),
                      remote * dim * 2, remote * wire_row),
        "reduce": ("reduce_slots", lambda s: sk.reduce_slots(staged.launched_at("reduce_slots", s), x,
                                                             sorted_row=meta.sorted_row, row_rank=meta.dst_rank,
                                                             local_row=meta.dst_row, local_src=routed, top_k=TOP_K,
                                                             weight=scores.reshape(-1)),
                   n * dim * 2 + tokens * dim * 2, 0),
        "barrier": (None, lambda _s: staging.barrier(), 0, 0),
        "p2p_copy": (None, lambda _s: staging.peer((rank + 1) % world)[: remote * wire_row].copy_(p2p_src), 0,
                     remote * wire_row),
        "hbm_copy": (None, lambda _s: out[:n].copy_(x_rep), 2 * n * dim * 2, 0),
        "dispatch": (None, lambda _s: disp.dispatch(x, scores, leg.ids, leg.counts), 0, 0),
        "combine": (None, lambda _s: disp.combine(routed, meta), 0, 0),
    }
    for stage, (kernel, call, hbm, peer_bytes) in stages.items():
        for shape in launches(options, kernel, fmt) if kernel else [None]:
            ms = worst_median(sample_ms(lambda: call(shape), args.iters, args.warmup, device), device)
            rows.append({"part": "kernels", "rows": args.rows, "dim": dim, "fmt": fmt, "stage": stage,
                         "kernel": kernel, "launch": asdict(shape) if shape else None, "ms": round(ms, 4),
                         "hbm_GBps": round(hbm / ms / 1e6, 1), "nvlink_GBps": round(peer_bytes / ms / 1e6, 1)})
    return rows


def timeline_gaps(trace_file: str, top: int = 12, kernels: int = 14) -> dict:
    """GPU idle time in a chrome trace of torch.profiler: the union of kernel / memcpy / memset
    intervals over all streams against the span from the first to the last; a gap is
    *host-late* when the kernel after it was launched (its runtime call) after the GPU went idle."""
    with open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e for e in events
              if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    if not gpu:
        return {}

    def host_op(ts):
        inside = [e for e in cpu_ops if e["ts"] <= ts <= e["ts"] + e["dur"]]
        return min(inside, key=lambda e: e["dur"])["name"] if inside else ""

    end, prev, busy, gaps = gpu[0]["ts"], gpu[0], 0.0, []
    for e in gpu:
        if e["ts"] > end:
            runtime = launch.get(e.get("args", {}).get("correlation"))
            late = runtime is not None and runtime["ts"] > end
            gaps.append({"us": round(e["ts"] - end, 1), "host_late": late, "before": prev["name"][:60],
                         "after": e["name"][:60], "host_op": host_op(runtime["ts"]) if runtime else ""})
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    span = end - gpu[0]["ts"]
    per_kernel: dict[str, float] = {}
    for e in gpu:
        per_kernel[e["name"][:70]] = per_kernel.get(e["name"][:70], 0.0) + e["dur"]
    # Every matrix-multiply kernel in launch order (name index, stream, grid, us) and the work on
    # other streams (or peer copies) beside it: the same GEMM call compared across arms.
    gemm_names: list[str] = []
    gemm_calls = []
    for e in gpu:
        if any(k in e["name"] for k in ("cutlass", "nvjet", "xmma", "gemv", "gemm")):
            if e["name"] not in gemm_names:
                gemm_names.append(e["name"])
            args = e.get("args", {})
            beside = sorted({o["name"][:40] for o in gpu if o is not e and o["ts"] < e["ts"] + e["dur"]
                             and o["ts"] + o["dur"] > e["ts"]})
            gemm_calls.append([gemm_names.index(e["name"]), args.get("stream"), args.get("grid"), round(e["dur"], 1),
                               beside])
    return {
        "gemm_names": gemm_names, "gemm_calls": gemm_calls,
        "top_kernels_ms": {k: round(v / 1e3, 3)
                           for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:kernels]},
        "span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "idle_host_late_ms": round(sum(g["us"] for g in gaps if g["host_late"]) / 1e3, 3),
        "gaps_over_20us": sum(g["us"] > 20 for g in gaps),
        "largest": sorted(gaps, key=lambda g: -g["us"])[:top],
    }


def profiled(step, calls: int, cpu_ops: bool, kernels: int = 14):
    """torch.profiler over ``calls`` calls of ``step``: (its key-averages table, ``timeline_gaps``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu_ops else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        return table, timeline_gaps(trace, kernels=kernels)


def per_rank_rows(part: str, arm: str, timeline: dict, **extra) -> list[dict]:
    """Every rank's timeline as one row each (rank 0 keeps them): a rank waits in the exchange's
    barriers for the slowest one, so each rank's idle time tells a different story."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, timeline)
    return [{"part": part, "arm": arm, "rank": rank, **extra, **t} for rank, t in enumerate(gathered)]


def layer_timeline(args, arm, mesh) -> list[dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    shape = SHAPES[args.layer_shape]
    moe = build_moe(shape, device, torch.bfloat16, arm, mesh)
    x = torch.randn((1, shape.tokens, shape.dim), device=device, dtype=torch.bfloat16, requires_grad=True)

    def step():
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).backward(torch.ones_like(x))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    table, timeline = profiled(step, 2, args.cpu_ops)
    if dist.get_rank() == 0:
        print(f"== {arm.name}, {shape.name}: two forward+backward passes\n{table}")
    return per_rank_rows("layer", arm.name, timeline, **shape.row_fields(), calls=2)


def leg_timeline(args, arm, calls: int = 10) -> list[dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    leg = leg_inputs(args.rows, args.dim, "even", device, dist.get_rank())
    disp = build_dispatcher(arm, leg.tokens, dist.group.WORLD, device)

    def call():
        disp.dispatch(leg.x, leg.scores, leg.ids, leg.counts)

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    dist.barrier()
    _, timeline = profiled(call, calls, args.cpu_ops, kernels=40)
    timeline = {k: ({n: round(ms / calls, 4) for n, ms in v.items()} if k == "top_kernels_ms"
                    else round(v / calls, 4) if k.endswith("_ms") else v) for k, v in timeline.items()}
    host = []
    for _ in range(20):  # the host's time for one call while ~10 ms of GPU work runs ahead of it
        dist.barrier()
        torch.cuda._sleep(20_000_000)
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    timeline["host_ms"] = round(sorted(host)[len(host) // 2], 4)
    return per_rank_rows("leg", arm.name, timeline, leg="dispatch", rows=args.rows, dim=args.dim, per_call=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--rows", type=int, default=131072, help="routed rows per rank of the legs")
    parser.add_argument("--dim", type=int, default=5120)
    parser.add_argument("--arms", default="torchtitan,mxfp8/symm", help="the layer's arms (harness.Arm)")
    parser.add_argument("--layer-shape", choices=sorted(SHAPES), default="dsv3")
    parser.add_argument("--leg-arms", default="bf16/symm,mxfp8/symm", help="the dispatch leg's arms (ours)")
    parser.add_argument("--launch", action="append", default=[], help="kernels: KERNEL[.FMT]=BxW[xD],... (repeatable)")
    parser.add_argument("--cpu-ops", action="store_true", help="also record host ops (names the op behind each gap)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", required=True, help="folder of the results file (JSON Lines)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts: expected some of {PARTS}, got {args.parts!r}")
    arms, leg_arms = parsed(parser, parse_arms, args.arms), parsed(parser, parse_arms, args.leg_arms, baselines=())
    options = parsed(parser, parse_launch_options, args.launch)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.timeline profiles CUDA kernels: it needs GPUs")
    mesh = titan022_mesh(init_process_group(), dispatcher_forward=True)
    results = Results("profile", args.out)
    kernels = kernel_rows(args, options) if "kernels" in parts else []
    timelines = []
    for part, part_arms, profile in (("layer", arms, lambda arm: layer_timeline(args, arm, mesh)),
                                     ("leg", leg_arms, lambda arm: leg_timeline(args, arm))):
        for arm in part_arms if part in parts else []:
            timelines += profile(arm)  # what it built is gone when it returns
            free_peer_buffers()
            torch.cuda.empty_cache()
    results.write(kernels, KERNEL_COLUMNS)
    results.write(timelines, TIMELINE_COLUMNS)
    leave_process_group()


if __name__ == "__main__":
    main()
