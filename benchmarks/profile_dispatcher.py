"""Where the symm dispatcher's time goes, on the GPU machine:

    torchrun --nproc_per_node=2 benchmarks/profile_dispatcher.py --json profile.json

1. Each kernel of the dispatch and combine legs alone (CUDA events, median, max over ranks),
   for several launch shapes, with the bandwidth it reaches: bytes it must read and write in
   HBM, and bytes it sends over NVLink.
2. A torch.profiler table of one forward+backward of the DeepSeek-V3-like MoE layer (``--layer-shape``; top
   kernels by device time), for each of ``--arms``, and its timeline: the time the GPU is idle
   between kernels, how much of it the host caused (the next kernel was launched after the
   previous one had ended), the largest gaps with the kernels and host op around them, and
   every GEMM call in order (kernel, stream, grid, time, work beside it on other streams), to
   compare the same GEMM across arms.
3. ``--leg-arms``: the same timeline over back-to-back dispatch legs alone (``--rows`` x
   ``--dim``, even routing), per call: every kernel of the leg, routing included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script (torchrun benchmarks/profile_dispatcher.py): the repo root holds `benchmarks`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time(fn, iters=20, warmup=5) -> float:
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    t = torch.tensor([statistics.median(times)], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sweep_shape(stage: str, block: int, warps: int, *rest: int):
    """The launch shape (``symm_kernels`` wrappers' ``shape=``) of one of ``kernel_sweep``'s
    shapes: pushes (rows per program, warps, stripes, pipelining stages), receive (rows, warps),
    reduce (tokens, warps, widest column tile); other stages: None."""
    from mxfp8_ep.launch_shapes import LaunchShape

    if stage in ("push", "push_back"):
        return LaunchShape(block=block, warps=warps, stripes=rest[0], stages=rest[1])
    if stage == "receive":
        return LaunchShape(block=block, warps=warps)
    if stage == "reduce":
        return LaunchShape(block=block, warps=warps, block_d=rest[0])
    return None


def kernel_sweep(args, rows_out):
    from benchmarks.dispatcher import LEG_EXPERTS, LEG_TOP_K, leg_inputs
    from mxfp8_ep import symm_kernels as sk
    from mxfp8_ep.config import A2AConfig
    from mxfp8_ep.dispatcher import TokenDispatcher
    from mxfp8_ep.peer_memory import PeerBuffer
    from mxfp8_ep.staging import staging_buffer_nbytes, token_map, token_map_offset

    rank, device = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    top_k, experts, dim = LEG_TOP_K, LEG_EXPERTS, args.dim
    leg = leg_inputs(args.rows, dim, "even", device, rank)
    tokens, x, scores, ids, counts = leg.tokens, leg.x, leg.scores, leg.ids, leg.counts
    for fmt in ("bf16", "mxfp8"):
        preset = "mxfp8_all" if fmt == "mxfp8" else "bf16"
        cfg = TokenDispatcher.Config(num_experts=experts, top_k=top_k, max_tokens_per_rank=tokens,
                                     a2a=A2AConfig.preset(preset, kernel="triton", transport="symm"))
        disp = cfg.build(dist.group.WORLD, device)
        routed, per_expert, meta = disp.dispatch(x, scores, ids, counts)
        bufs = disp._buffers_for(x)
        # The row-by-row kernels store at expert-major rows, up to the capacity: more than the
        # dispatcher's staging buffers hold at top-k > 1. A buffer of their own, for every kernel.
        staging_rows = max(bufs.capacity, tokens * top_k)
        map_offset = token_map_offset(staging_rows, dim, x.dtype)
        staging = PeerBuffer(staging_buffer_nbytes(staging_rows, dim, x.dtype, bufs.capacity), dist.group.WORLD, device)
        out = torch.empty_like(routed)
        n = meta.slot.numel()
        remote = int((meta.dst_rank != rank).sum())
        wire_row = dim + dim // 32 if fmt == "mxfp8" else 2 * dim
        stage = {
            "push": lambda shape: sk.push_rows(x, meta.dst_rank, meta.dst_row, out, staging, staging_rows, rank,
                                               fmt, "rceil", slot=meta.slot, top_k=top_k, shape=shape),
            # Each token once per rank (what the dispatcher runs for this unweighted leg), and its
            # receive through the token map.
            "push_tokens": lambda _shape: sk.push_tokens(x, meta.sorted_row, meta.dst_rank, meta.dst_row, out, staging,
                                                  staging_rows, map_offset, bufs.capacity, rank, fmt,
                                                  "rceil", top_k, bufs.max_tokens, sent),
            "receive_token_map": lambda _shape: sk.receive_rows(out, meta.row_source, rank, staging, staging_rows, fmt,
                                                         stage_row=token_map(staging.local, map_offset, bufs.capacity)),
            "receive": lambda shape: sk.receive_rows(out, meta.row_source, rank, staging, staging_rows, fmt,
                                                     shape=shape),
            "push_back": lambda shape: sk.push_rows(routed, meta.return_rank, meta.return_row, None, staging,
                                                    staging_rows, rank, fmt, "rceil", shape=shape),
            "reduce": lambda shape: sk.reduce_slots(x, meta.sorted_row, meta.dst_rank, meta.dst_row, routed, staging,
                                                    staging_rows, rank, fmt, top_k,
                                                    weight=scores.reshape(-1), shape=shape),
            "barrier": lambda _shape: staging.barrier(),
            # Ceilings: the same bytes as push's remote rows, one contiguous SM copy into the peer's
            # buffer; and a local HBM copy of everything push reads.
            "p2p_copy": lambda _shape: staging.peer(1 - rank)[: remote * wire_row].copy_(p2p_src),
            "hbm_copy": lambda _shape: out[:n].copy_(x_rep),
            "dispatch": lambda _shape: disp.dispatch(x, scores, ids, counts),
            "combine": lambda _shape: disp.combine(routed, meta),
        }
        # HBM bytes each kernel must move at least, and NVLink bytes it sends.
        sent = torch.zeros(1, dtype=torch.int64, device=device)
        owners = meta.dst_rank[meta.sorted_row].view(tokens, top_k)
        remote_tokens = sum(int((owners == peer).any(dim=1).sum()) for peer in range(dist.get_world_size()) if peer != rank)
        p2p_src = torch.empty(remote * wire_row, dtype=torch.uint8, device=device)
        x_rep = torch.empty((n, dim), dtype=torch.bfloat16, device=device)
        hbm = {"hbm_copy": 2 * n * dim * 2, "push": n * dim * 2 + (n - remote) * dim * 2, "receive": remote * (wire_row + dim * 2),
               "push_tokens": tokens * dim * 2 + (n - remote) * dim * 2,
               "receive_token_map": remote_tokens * wire_row + remote * dim * 2,
               "push_back": remote * dim * 2, "reduce": n * dim * 2 + tokens * dim * 2}
        nvlink = {"push": remote * wire_row, "push_back": remote * wire_row, "p2p_copy": remote * wire_row,
                  "push_tokens": remote_tokens * wire_row}
        # (rows per program, warps[, push stripes, push pipelining stages]): stripes 1 = the
        # blocks in row order; reduce: (tokens per program, warps, widest column tile).
        shapes = {"push": [(4, 4, 1, 1), (4, 4, 8, 1), (4, 4, 8, 2), (4, 4, 8, 3), (8, 8, 8, 2)],
                  "receive": [(4, 4), (8, 8), (8, 4), (16, 8)],
                  "push_back": [(4, 4, 8, 1), (4, 4, 8, 2)], "reduce": [(1, 4, 1024), (2, 4, 1024), (4, 8, 1024), (1, 4, 512),
                             (1, 8, 1024), (1, 2, 512), (2, 4, 512), (2, 8, 1024)]}
        for name, fn in stage.items():
            for block, warps, *stripes in shapes.get(name, [(0, 0)]):
                shape = sweep_shape(name, block, warps, *stripes)
                ms = _time(lambda: fn(shape))
                pushes = name in ("push", "push_back")
                row = {"fmt": fmt, "stage": name, "block": block, "warps": warps, "stripes": stripes[0] if pushes else None,
                       "stages": stripes[1] if pushes else None, "block_d": stripes[0] if name == "reduce" else None,
                       "ms": round(ms, 4),
                       "hbm_GBps": round(hbm.get(name, 0) / ms / 1e6, 1),
                       "nvlink_GBps": round(nvlink.get(name, 0) / ms / 1e6, 1)}
                rows_out.append(row)
        from mxfp8_ep.dispatcher import release_peer_buffers

        release_peer_buffers()


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
    # Every matrix-multiply kernel in launch order (name index, stream, grid, us): compares the
    # same GEMM call across arms.
    gemm_names: list[str] = []
    gemm_calls = []
    for e in gpu:
        if any(k in e["name"] for k in ("cutlass", "nvjet", "xmma", "gemv", "gemm")):
            if e["name"] not in gemm_names:
                gemm_names.append(e["name"])
            args = e.get("args", {})
            # Work on other streams (or peer copies) that overlaps this GEMM.
            beside = sorted({o["name"][:40] for o in gpu if o is not e and o["ts"] < e["ts"] + e["dur"]
                             and o["ts"] + o["dur"] > e["ts"]})
            gemm_calls.append([gemm_names.index(e["name"]), args.get("stream"), args.get("grid"), round(e["dur"], 1), beside])
    return {
        "gemm_names": gemm_names, "gemm_calls": gemm_calls,
        "top_kernels_ms": {k: round(v / 1e3, 3) for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:kernels]},
        "span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "idle_host_late_ms": round(sum(g["us"] for g in gaps if g["host_late"]) / 1e3, 3),
        "gaps_over_20us": sum(g["us"] > 20 for g in gaps),
        "largest": sorted(gaps, key=lambda g: -g["us"])[:top],
    }


def leg_profile(args, arm: str, calls: int = 10):
    """torch.profiler over ``calls`` back-to-back dispatch legs of ``arm`` (the leg shape of
    ``--rows`` x ``--dim``, even routing): every kernel's device time per call, and the
    timeline's idle time, per rank."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.dispatcher import LEG_EXPERTS, LEG_TOP_K, _a2a, _free_peer_buffers, launch_shapes, leg_inputs
    from mxfp8_ep.dispatcher import TokenDispatcher

    rank, device = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    leg = leg_inputs(args.rows, args.dim, "even", device, rank)
    x, scores, ids, counts = leg.x, leg.scores, leg.ids, leg.counts
    cfg = TokenDispatcher.Config(num_experts=LEG_EXPERTS, top_k=LEG_TOP_K, a2a=_a2a(arm), max_tokens_per_rank=leg.tokens,
                                 launch_shapes=launch_shapes(arm))
    disp = cfg.build(dist.group.WORLD, device)
    for _ in range(5):
        disp.dispatch(x, scores, ids, counts)
    torch.cuda.synchronize()
    dist.barrier()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.cpu_ops else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            disp.dispatch(x, scores, ids, counts)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        gaps = timeline_gaps(trace, kernels=40)
    gaps = {k: ({n: round(ms / calls, 4) for n, ms in v.items()} if k == "top_kernels_ms"
                else round(v / calls, 4) if k.endswith("_ms") else v) for k, v in gaps.items()}
    gaps.update(_host_ms(lambda: disp.dispatch(x, scores, ids, counts)))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, gaps)
    del disp
    _free_peer_buffers()
    return {"arm": arm, "leg": "dispatch fwd", "per_call_per_rank": per_rank}


def _host_ms(call, samples: int = 20) -> dict:
    """Host time of one call while the GPU is busy with other work (so the host never waits
    for it), median ms: until the push kernel's launch, in all, and inside each routing
    kernel's wrapper (launch included). The GPU starts a leg's bulk work only after the host has queued everything before the
    push."""
    import time

    from mxfp8_ep import symm_kernels

    marks: dict[str, float] = {}

    def marked(name, fn):
        def wrapper(*args, **kwargs):
            marks.setdefault(f"{name}_start", time.perf_counter())
            out = fn(*args, **kwargs)
            marks.setdefault(f"{name}_end", time.perf_counter())
            return out
        return wrapper

    patched = [(symm_kernels, name) for name in ("push_rows", "routing_tables", "expert_row_routing", "sorted_row_routing")]
    originals = [getattr(m, n) for m, n in patched]
    times: dict[str, list[float]] = {}
    for (module, name), fn in zip(patched, originals):
        setattr(module, name, marked(name, fn))
    try:
        for _ in range(samples):
            dist.barrier()
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work ahead of the call
            marks.clear()
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            seen = {"host_to_push_ms": marks.get("push_rows_start", t1) - t0, "host_total_ms": t1 - t0}
            for _, name in patched[1:]:
                if f"{name}_start" in marks:
                    seen[f"host_{name}_ms"] = marks[f"{name}_end"] - marks[f"{name}_start"]
            for key, value in seen.items():
                times.setdefault(key, []).append(value * 1e3)
            torch.cuda.synchronize()
    finally:
        for (module, name), fn in zip(patched, originals):
            setattr(module, name, fn)
    return {key: round(statistics.median(v), 4) for key, v in times.items()}


def layer_profile(args, arm: str):
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.dispatcher import SHAPES, _build_moe

    device = torch.device("cuda", torch.cuda.current_device())
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("ep",))
    shape = SHAPES[args.layer_shape]
    moe = _build_moe(shape, device, torch.bfloat16, arm, mesh)
    x = torch.randn((1, shape.tokens, shape.dim), device=device, dtype=torch.bfloat16, requires_grad=True)
    def step():
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).backward(torch.ones_like(x))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.cpu_ops else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        gaps = timeline_gaps(trace)
    # Every rank's timeline: a rank waits in the exchange's barriers for the slowest one.
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, gaps)
    del moe
    from benchmarks.dispatcher import _free_peer_buffers

    _free_peer_buffers()
    torch.cuda.empty_cache()
    return {"arm": arm, "table": table, "timeline_2_iterations_per_rank": per_rank}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--dim", type=int, default=5120)
    parser.add_argument("--arms", default="torchtitan,mxfp8/symm")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument("--layer-shape", default="dsv3", help="benchmarks/dispatcher.py SHAPES entry of the layer profile")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--cpu-ops", action="store_true", help="also record host ops (names the op behind each gap)")
    parser.add_argument("--leg-arms", default="", help="also profile the dispatch leg alone of these arms")
    args = parser.parse_args()
    from benchmarks.dispatcher import init_process_group, leave_process_group

    init_process_group()
    from mxfp8_ep.config import A2AConfig
    from mxfp8_ep.titan022 import install_expert_parallel

    install_expert_parallel(A2AConfig())
    rows: list[dict] = []
    if not args.skip_kernels:
        kernel_sweep(args, rows)
    profiles = [] if args.skip_layer else [layer_profile(args, arm) for arm in args.arms.split(",")]
    legs = [leg_profile(args, arm) for arm in args.leg_arms.split(",") if arm]
    if dist.get_rank() == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"kernels": rows, "layer_profiles": profiles, "leg_profiles": legs}, f, indent=1)
        for p in legs:
            print(f"== {p['arm']} {p['leg']}, per call")
            for rank, t in enumerate(p["per_call_per_rank"]):
                print(f"rank {rank}:", {k: v for k, v in t.items() if k not in ("largest", "top_kernels_ms", "gemm_names", "gemm_calls")})
                for name, ms in t.get("top_kernels_ms", {}).items():
                    print(f"  {ms:>9.4f} ms  {name}")
        for p in profiles:
            print(f"== {p['arm']}")
            print(p["table"])
            for rank, t in enumerate(p["timeline_2_iterations_per_rank"]):
                print(f"rank {rank}:", {k: v for k, v in t.items() if k not in ("largest", "top_kernels_ms", "gemm_names", "gemm_calls")})
                for name, ms in t.get("top_kernels_ms", {}).items():
                    print(f"  {ms:>9.3f} ms  {name}")
                print("  gemm calls (name, stream, grid, us):", t.get("gemm_calls"))
                for g in t.get("largest", [])[:6]:
                    print(f"  gap {g['us']:>8.1f} us host_late={g['host_late']!s:<5} {g['before']} -> {g['after']}  [{g['host_op']}]")
        print(f"{'fmt':<6} {'stage':<10} {'block':>5} {'warps':>5} {'stripes':>7} {'stages':>6} {'cols':>5} {'ms':>8} {'HBM GB/s':>9} {'NVLink GB/s':>11}")
        for r in rows:
            print(f"{r['fmt']:<6} {r['stage']:<10} {r['block']:>5} {r['warps']:>5} {r.get('stripes') or '':>7} {r.get('stages') or '':>6} {r.get('block_d') or '':>5} {r['ms']:>8.3f} "
                  f"{r['hbm_GBps']:>9.1f} {r['nvlink_GBps']:>11.1f}")
    leave_process_group()


if __name__ == "__main__":
    main()
