"""Is the host the bottleneck of a MoE layer? Host time (Python returns) vs GPU time (the work
done) of one forward+backward, per arm, one process.

    torchrun --nproc_per_node=1 benchmarks/host_time.py [--experts 64]

``moe(x)`` and ``.backward()`` return on the host while the GPU still runs what they queued; the
host time is when ``backward`` returns, the GPU time when a sync after it does. If the host took
longer than the GPU, the GPU would wait for launches (in a profile: gaps that the host causes)
and fewer or cheaper launches would pay. Median of ``--calls`` calls after 2 warm-up calls, EP=1 (one GPU:
the dispatcher's own launches all run, its pushes stay local).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# Run as a script (python benchmarks/x.py, torchrun): the repo root holds `benchmarks`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dispatcher import (  # noqa: E402
    SHAPES,
    MoEShape,
    _build_moe,
    _free_peer_buffers,
    _pass_fns,
    finish,
    init_process_group,
)

ARMS = ("torchtitan", "bf16/symm", "mxfp8/symm", "mxfp8/nccl")


def host_and_gpu_ms(moe, x, grad, calls: int = 12, warmup: int = 2) -> tuple[float, float, float]:
    _, drop_grads = _pass_fns(moe, x, grad)
    fwd, host, gpu = [], [], []
    for i in range(calls):
        drop_grads()
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = moe(x)
        t1 = time.perf_counter()
        y.backward(grad)
        t2 = time.perf_counter()
        if x.is_cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        if i >= warmup:
            fwd.append((t1 - t0) * 1e3)
            host.append((t2 - t0) * 1e3)
            gpu.append((t3 - t0) * 1e3)
    return statistics.median(fwd), statistics.median(host), statistics.median(gpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="dsv3")
    parser.add_argument("--experts", type=int, default=64, help="experts of the layer (all on this GPU)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--calls", type=int, default=12, help="calls per arm, the first 2 not counted")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = init_process_group()
    if device.type == "cpu":
        from launch.titan_cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    from mxfp8_ep.config import A2AConfig
    from mxfp8_ep.titan022 import install_expert_parallel

    install_expert_parallel(A2AConfig())
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ep",))
    base = SHAPES[args.shape]
    shape = MoEShape(f"{base.name}, {args.experts} experts", base.dim, base.hidden, args.experts, base.top_k,
                     base.tokens, base.score_before_experts, base.route_norm, base.route_scale)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for arm in args.arms.split(","):
        moe = _build_moe(shape, device, dtype, arm, mesh)
        x = torch.randn(1, shape.tokens, shape.dim, device=device, dtype=dtype, requires_grad=True)
        fwd, host, gpu = host_and_gpu_ms(moe, x, torch.randn_like(x), calls=args.calls)
        rows.append({"bench": "host_time", "shape": shape.label(), "arm": arm, "host_fwd_ms": round(fwd, 3),
                     "host_fwd_bwd_ms": round(host, 3), "gpu_fwd_bwd_ms": round(gpu, 3)})
        del moe
        _free_peer_buffers()
    finish(rows, args.json, lambda r: (f"{r['arm']:<12} host fwd {r['host_fwd_ms']:8.2f} ms  host fwd+bwd "
                                       f"{r['host_fwd_bwd_ms']:8.2f} ms  GPU done {r['gpu_fwd_bwd_ms']:8.2f} ms"))


if __name__ == "__main__":
    main()
