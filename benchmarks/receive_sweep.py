"""Launch shapes of the receiving-side kernels, on one GPU.

    torchrun --nproc_per_node=1 benchmarks/receive_sweep.py --json receive_sweep.json

After a leg's barrier, ``reduce_slots`` (combine: each token's K rows, local or staged, reduced
in fp32) and ``receive_rows`` (dispatch: staged rows dequantized into the expert-major tensor)
read only this GPU's memory: the staging buffer the peers pushed into is local by then. So
their speed, and the launch shape that gives it, can be measured on one GPU with the routing of
an EP=2 rank made up: under even routing half of each token's rows come from the peer (read
from staging, MXFP8 or bf16), half from this rank's own expert output; rows land in random
order, as expert-sorted rows do. Each shape's time is a median of CUDA-event samples, with the
HBM bytes the kernel must move and the rate that makes.
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
from mxfp8_ep import symm_kernels as sk  # noqa: E402
from mxfp8_ep.launch_shapes import LaunchShape  # noqa: E402
from mxfp8_ep.peer_memory import LocalBuffer  # noqa: E402
from mxfp8_ep.staging import staged_row_nbytes, staging_nbytes  # noqa: E402

REDUCE_SHAPES = [(t, w, d) for t in (1, 2, 4) for w in (4, 8) for d in (512, 1024)]
RECEIVE_SHAPES = [(m, w) for m in (4, 8, 16) for w in (4, 8)]


def merge_rounds(runs: list[list[dict]]) -> list[dict]:
    """The first round's rows, each with every round's time (``rounds_ms``), their median
    (``ms``) and, for a row with ``hbm_bytes``, the HBM rate at the median (``hbm_GBps``)."""
    rows = [dict(r) for r in runs[0]]
    for i, row in enumerate(rows):
        row["rounds_ms"] = [run[i]["ms"] for run in runs]
        row["ms"] = round(statistics.median(row["rounds_ms"]), 4)
        if "hbm_bytes" in row:
            row["hbm_GBps"] = round(row.pop("hbm_bytes") / row["ms"] / 1e6, 1)
    return rows


def run_rounds(sweep, args, device) -> list[dict]:
    """``sweep(shape name, args, device, rows)`` for every shape of ``args.shapes``, once per
    round, the rounds one after another (a drift of the GPU falls on all launch shapes alike);
    each row's time is the median over the rounds (``merge_rounds``)."""
    runs: list[list[dict]] = []
    for _ in range(args.rounds):
        runs.append([])
        for name in args.shapes.split(","):
            sweep(name, args, device, runs[-1])
    return merge_rounds(runs)


def made_up_routing(tokens: int, top_k: int, device, seed: int = 0):
    """An EP=2 rank 0's view of a leg: sorted row ``n`` of slot ``slot`` comes from rank
    ``n % 2`` (1: staged at row ``n``), from its expert output row ``perm[n]`` when local."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = tokens * top_k
    inv = torch.randperm(n, generator=g, device=device)  # sorted row of each slot
    row_rank = torch.arange(n, device=device) % 2
    local_row = torch.randperm(n, generator=g, device=device)
    return inv, row_rank, local_row


def sweep(shape_name: str, args, device, rows_out: list[dict]) -> None:
    shape = SHAPES[shape_name]
    tokens, top_k, dim = shape.tokens, shape.top_k, shape.dim
    n = tokens * top_k
    inv, row_rank, local_row = made_up_routing(tokens, top_k, device)
    local_src = torch.randn((n, dim), device=device, dtype=torch.bfloat16)
    out = torch.empty((tokens, dim), device=device, dtype=torch.bfloat16)
    weight = torch.rand(n, device=device)
    # receive: the first half of the expert-major rows come from the peer, then this rank's own
    # rows (already in place: skipped), then unused capacity.
    received = torch.empty((2 * n, dim), device=device, dtype=torch.bfloat16)
    source = torch.full((2 * n,), -2, dtype=torch.int64, device=device)
    source[: n // 2] = 1
    source[n // 2 : n] = 0
    for fmt in ("bf16", "mxfp8"):
        staging = LocalBuffer(torch.randint(0, 127, (staging_nbytes(n, dim, torch.bfloat16),), dtype=torch.uint8,
                                            device=device), 1)
        staged = n // 2 * staged_row_nbytes(dim, torch.bfloat16, fmt)  # bytes read from staging
        reduce_hbm = staged + n // 2 * dim * 2 + tokens * dim * 2
        receive_hbm = staged + n // 2 * dim * 2
        for t, w, d in args.reduce_shapes:
            kernel_shape = LaunchShape(block=t, warps=w, block_d=d)
            ms = statistics.median(_sample_ms(
                lambda: sk.reduce_slots(out, inv, row_rank, local_row, local_src, staging, n, 0, fmt, top_k,
                                        weight=weight, shape=kernel_shape),
                args.iters, args.warmup, device, group=args.group))
            rows_out.append({"bench": "receive_sweep", "shape": shape.label(), "kernel": "reduce_slots",
                             "fmt": fmt, "launch": {"tokens": t, "warps": w, "block_d": d}, "ms": round(ms, 4),
                             "hbm_bytes": reduce_hbm})
        for m, w in args.receive_shapes:
            kernel_shape = LaunchShape(block=m, warps=w)
            ms = statistics.median(_sample_ms(
                lambda: sk.receive_rows(received, source, 0, staging, n, fmt, shape=kernel_shape),
                args.iters, args.warmup, device, group=args.group))
            rows_out.append({"bench": "receive_sweep", "shape": shape.label(), "kernel": "receive_rows",
                             "fmt": fmt, "launch": {"rows": m, "warps": w}, "ms": round(ms, 4),
                             "hbm_bytes": receive_hbm})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv3")
    parser.add_argument("--reduce-shapes", type=parse_shapes, default=REDUCE_SHAPES,
                        help='reduce_slots launch shapes "tokens,warps,block_d;..."')
    parser.add_argument("--receive-shapes", type=parse_shapes, default=RECEIVE_SHAPES,
                        help='receive_rows launch shapes "rows,warps;..."')
    add_timing_arguments(parser)
    args = parser.parse_args()
    rows = run_rounds(sweep, args, init_process_group())
    finish(rows, args.json, lambda r: (f"{r['kernel']:<13} {r['fmt']:<6} {json.dumps(r['launch']):<44} "
                                       f"{r['ms']:>8.4f} ms {r['hbm_GBps']:>8.1f} GB/s  {r['shape']}"))


if __name__ == "__main__":
    main()
