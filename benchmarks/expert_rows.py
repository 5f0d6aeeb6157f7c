"""Do the routed experts pay for the expert-major buffer's static capacity? One GPU.

    torchrun --nproc_per_node=1 benchmarks/expert_rows.py --json expert_rows.json

The symm dispatcher returns an expert-major buffer sized for the drop-free worst case
(``expert_major_capacity``: twice the even-routing rows at EP=2), because it cannot
size it to the rows received without a host sync. The grouped GEMMs read only the rows inside
their offsets; everything else that touches all rows pays for the tail. This times one MoE
layer's routed experts (forward, forward+backward), the rows of one EP rank under even routing
at ``--ep``, side by side and round-robin:

* ``torchtitan``: torchtitan 0.2.2's grouped-GEMM experts (``_run_experts_grouped_mm``) on a
  buffer of exactly the received rows plus padding (what its ``_permute`` returns);
* ``torchtitan+capacity``: the same on a capacity-sized buffer (its elementwise ops over all rows);
* ``ours``: ``mxfp8_ep.grouped_experts.grouped_swiglu`` on exactly the received rows;
* ``ours+capacity``: on the capacity-sized buffer, as the symm dispatcher hands it over.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script (python benchmarks/x.py, torchrun): the repo root holds `benchmarks`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dispatcher import (  # noqa: E402
    SHAPES,
    _rel_err,
    _sample_ms,
    add_timing_arguments,
    finish,
    init_process_group,
    parse_shapes,
)
from mxfp8_ep import routing  # noqa: E402
from mxfp8_ep.capacity import expert_major_capacity  # noqa: E402

ARMS = ("torchtitan", "torchtitan+capacity", "ours", "ours+capacity")
# (persistent programs per SM, rows per block) of the SwiGLU kernel sweep
SWEEP_LAUNCH = [(per_sm, block_m) for per_sm in (4, 8, 16, 32) for block_m in (2, 4, 8)]


def even_counts(rows: int, num_local_experts: int, align: int) -> torch.Tensor:
    """Rows per local expert under even routing, each padded to ``align`` (torchtitan's layout)."""
    base, extra = divmod(rows, num_local_experts)
    counts = torch.tensor([base + (e < extra) for e in range(num_local_experts)])
    return routing.padded_expert_sizes(counts.view(1, -1), align)


def bench_shape(name: str, args, device, rows_out: list[dict]) -> None:
    from torchtitan.models.moe.moe import _run_experts_grouped_mm

    from mxfp8_ep.grouped_experts import grouped_swiglu

    shape = SHAPES[name]
    L = shape.experts // args.ep
    received = shape.tokens * shape.top_k  # rows an EP rank receives under even routing
    counts = even_counts(received, L, args.align).to(device)
    exact = int(counts.sum())
    capacity = expert_major_capacity(shape.tokens, shape.top_k, args.ep, L, args.align)
    g = torch.Generator(device=device).manual_seed(0)
    w1, w3 = (torch.randn((L, shape.hidden, shape.dim), generator=g, device=device, dtype=torch.bfloat16) * 0.02
              for _ in range(2))
    w2 = torch.randn((L, shape.dim, shape.hidden), generator=g, device=device, dtype=torch.bfloat16) * 0.02
    x_cap = torch.randn((capacity, shape.dim), generator=g, device=device, dtype=torch.bfloat16)
    grad_cap = torch.randn((capacity, shape.dim), generator=g, device=device, dtype=torch.bfloat16)
    weights = [w.requires_grad_() for w in (w1, w2, w3)]

    def run(arm: str):
        rows = capacity if arm.endswith("+capacity") else exact
        x = x_cap[:rows].detach().requires_grad_()
        if arm.startswith("torchtitan"):
            return x, lambda: _run_experts_grouped_mm(w1, w2, w3, x, counts)
        return x, lambda: grouped_swiglu(x, w1, w2, w3, counts)

    def drop_grads(x):
        # Each timed backward writes fresh gradients: no accumulation kernels in the timing
        # (x.grad would otherwise add up over a capacity-sized buffer).
        for t in (x, *weights):
            t.grad = None

    # Correctness on the rows that matter: every arm against torchtitan on exact rows.
    ref = None
    errs = {}
    for arm in ARMS:
        x, fn = run(arm)
        drop_grads(x)
        out = fn()
        out.backward(grad_cap[: out.shape[0]])
        got = [out[:exact], x.grad[:exact], *(w.grad for w in weights)]
        ref = ref or [t.detach().clone() for t in got]
        errs[arm] = max(_rel_err(a, b) for a, b in zip(got, ref))
    samples = {arm: {"fwd": [], "fwd+bwd": []} for arm in ARMS}
    per_round = max(1, args.iters // args.rounds)
    for _ in range(args.rounds):
        for arm in ARMS:
            x, fn = run(arm)
            grad = grad_cap[: x.shape[0]]
            samples[arm]["fwd"] += _sample_ms(fn, per_round, args.warmup, device, group=args.group)
            samples[arm]["fwd+bwd"] += _sample_ms(lambda: fn().backward(grad), per_round, args.warmup, device,
                                                  before=lambda: drop_grads(x), group=args.group)
    if args.profile:
        for arm in ARMS:
            x, fn = run(arm)
            grad = grad_cap[: x.shape[0]]
            profile_kernels(f"{name} EP={args.ep} {arm}", lambda: fn().backward(grad), lambda: drop_grads(x))
    rows = [{"bench": "expert_rows", "shape": f"{name} EP={args.ep}: {exact} rows, capacity {capacity}",
             "arm": arm, "pass": name_, "ms": round(statistics.median(s), 3), "rel_err": float(f"{errs[arm]:.3g}")}
            for arm in ARMS for name_, s in samples[arm].items()]
    ref_ms = {r["pass"]: r["ms"] for r in rows if r["arm"] == "torchtitan"}
    for r in rows:
        r["vs_torchtitan"] = round(ref_ms[r["pass"]] / r["ms"], 3)
    rows_out += rows


def profile_kernels(label: str, fn, before, top: int = 12) -> None:
    """One call of ``fn`` under torch.profiler: its ``top`` kernels by GPU time (rank 0 prints)."""
    before()
    fn()  # warm
    before()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print(f"--- {label}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70))


def sweep_rows_kernel(name: str, args, device, rows_out: list[dict]) -> None:
    """The SwiGLU / input-gradient kernel alone over a capacity-sized buffer, per launch shape
    (persistent programs per SM x rows per block): forward (silu * mul), backward, and the add of
    the two input gradients, each timed on the rows of one rank under even routing."""
    from mxfp8_ep import grouped_experts as ge

    shape = SHAPES[name]
    L = shape.experts // args.ep
    counts = even_counts(shape.tokens * shape.top_k, L, args.align).to(device)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    capacity = expert_major_capacity(shape.tokens, shape.top_k, args.ep, L, args.align)
    g = torch.Generator(device=device).manual_seed(0)
    h1, h3, dh = (torch.randn((capacity, shape.hidden), generator=g, device=device, dtype=torch.bfloat16)
                  for _ in range(3))
    dx1, dx3 = (torch.randn((capacity, shape.dim), generator=g, device=device, dtype=torch.bfloat16)
                for _ in range(2))
    ops = {"silu_mul": lambda: ge._silu_mul(h1, h3, offsets),
           "silu_mul_backward": lambda: ge._silu_mul_backward(dh, h1, h3, offsets),
           "add_rows": lambda: ge._add_rows(dx1, dx3, offsets)}
    defaults = (ge._PROGRAMS_PER_SM, ge._BLOCK_M)
    try:
        for per_sm, block_m in args.sweep_launch:
            ge._PROGRAMS_PER_SM, ge._BLOCK_M = per_sm, block_m
            for op, fn in ops.items():
                ms = statistics.median(_sample_ms(fn, args.iters, args.warmup, device, group=args.group))
                rows_out.append({"bench": "rows_kernel", "shape": f"{name} EP={args.ep}, capacity {capacity}",
                                 "arm": f"{per_sm} programs/SM, {block_m} rows", "pass": op, "ms": round(ms, 4)})
    finally:
        ge._PROGRAMS_PER_SM, ge._BLOCK_M = defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv3,llama4")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--align", type=int, default=8)
    parser.add_argument("--profile", action="store_true", help="print each arm's top kernels of one fwd+bwd (CUDA)")
    parser.add_argument("--sweep-launch", type=parse_shapes, default=SWEEP_LAUNCH,
                        help='launch shapes of the sweep, "programs per SM,rows per block;..."')
    parser.add_argument("--sweep-rows-kernel", action="store_true",
                        help="time the SwiGLU kernel alone per launch shape instead of the experts")
    add_timing_arguments(parser)
    args = parser.parse_args()
    device = init_process_group()
    rows: list[dict] = []
    for name in args.shapes.split(","):
        (sweep_rows_kernel if args.sweep_rows_kernel else bench_shape)(name, args, device, rows)
    if args.sweep_rows_kernel:
        finish(rows, args.json, lambda r: f"{r['pass']:<18} {r['arm']:<24} {r['ms']:>8.4f} ms  {r['shape']}")
    else:
        finish(rows, args.json, header=f"{'pass':<8} {'arm':<20} {'ms':>9} {'vs titan':>9} {'rel_err':>9}  shape",
               line=lambda r: (f"{r['pass']:<8} {r['arm']:<20} {r['ms']:>9.3f} {r['vs_torchtitan']:>8.3f}x "
                               f"{r['rel_err']:>9.2g}  {r['shape']}"))


if __name__ == "__main__":
    main()
