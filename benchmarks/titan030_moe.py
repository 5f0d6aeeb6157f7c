"""torchtitan 0.3.0's MoE layer under EP: 0.3.0's own token dispatchers against ours
(``mxfp8_ep.titan030``), all arms side by side in one run.

    torchrun --nproc_per_node=2 benchmarks/titan030_moe.py --json benchmarks/results/titan030_h200x2.json

Needs torchtitan 0.3.0 importable: ``.venv-titan030`` (scripts/setup_titan030.sh) on CPU; on a
GPU machine whose environment has torchtitan 0.2.2, install the wheels of torchtitan==0.3.0 and
spmd_types==0.2.3 with ``pip install --no-deps --target DIR`` and run with ``PYTHONPATH=DIR``.
0.3.0's trainer needs torch >= 2.12; its MoE layer and dispatchers import on torch 2.11 once
``torch.compiler._is_non_strict_tracing`` exists, which this script adds (returning False) where
torch lacks it.

``moe_layer``: 0.3.0's ``MoE`` (sigmoid router, grouped-GEMM experts, one shared expert) with EP
over all ranks, forward and forward+backward, the same weights and inputs in every arm, for the
shapes of benchmarks/dispatcher.py (0.3.0's MoE always scores after the experts). Arms:

* ``alltoall``: 0.3.0's ``AllToAllTokenDispatcher`` (bf16), the reference;
* ``minimal_async_ep``: 0.3.0's ``MinimalAsyncEPTokenDispatcher`` (bf16, CUDA only) with its
  dispatch output cloned: dispatch returns its double-buffered symmetric receive buffer itself,
  which a later combine backward overwrites while the experts still hold it for their weight
  gradients (``minimal_async_ep_uncloned`` shows the wrong w1 gradient);
* ``<preset>/<transport>``: ours, e.g. ``bf16/symm``, ``mxfp8/symm``, ``mxfp8_all/symm``.

Times: median over ``--iters`` iterations (after warm-up) of each rank, max over ranks (CUDA
events): ``ms`` over ``--group`` back-to-back calls, ``ms_synced`` one call at a time. Each arm's
output, input gradient and expert w1 gradient are compared with the alltoall arm's
(``rel_err``, max over ranks); ``correct``: all within 2**-6 (bf16 legs) or 2**-4 (an MXFP8 leg).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # torch 2.11: 0.3.0's dispatchers call it
    torch.compiler._is_non_strict_tracing = lambda: False

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torchtitan.distributed.minimal_async_ep import api as minimal_async_ep_api  # noqa: E402
from torchtitan.distributed.spmd_types import set_spmd_meshes  # noqa: E402
from torchtitan.distributed.utils import set_spmd_backend  # noqa: E402
from torchtitan.models.common.config_utils import (  # noqa: E402
    make_ffn_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.token_dispatcher import (  # noqa: E402
    AllToAllTokenDispatcher,
    MinimalAsyncEPTokenDispatcher,
)

from benchmarks.dispatcher import (  # noqa: E402
    SHAPES,
    MoEShape,
    add_timing_arguments,
    finish,
    init_process_group,
    time_arms,
)
from mxfp8_ep.config import A2AConfig  # noqa: E402
from mxfp8_ep.titan030 import A2ATokenDispatcher, valid_row_experts_config  # noqa: E402

ARMS = ["alltoall", "minimal_async_ep", "bf16/symm", "mxfp8/symm", "mxfp8_all/symm"]
BASELINES = {"alltoall": "speedup_vs_alltoall", "minimal_async_ep": "speedup_vs_minimal_async_ep"}
EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


class ClonedMinimalAsyncEP(MinimalAsyncEPTokenDispatcher):
    """MinimalAsyncEP whose dispatch hands the experts a copy of its receive buffer."""

    @dataclass(kw_only=True, slots=True)
    class Config(MinimalAsyncEPTokenDispatcher.Config):
        pass

    def dispatch(self, *args):
        routed, tokens_per_expert, metadata = super().dispatch(*args)
        return routed.clone(), tokens_per_expert, metadata


def dispatcher_config(arm: str, shape: MoEShape, device: torch.device):
    common = dict(num_experts=shape.experts, top_k=shape.top_k)
    if arm == "alltoall":
        return AllToAllTokenDispatcher.Config(**common)
    if arm.startswith("minimal_async_ep"):
        if device.type != "cuda":
            raise ValueError(f"arm {arm}: MinimalAsyncEP needs CUDA symmetric memory")
        # One process-global buffer whose layout is fixed at its first init: start afresh per shape.
        minimal_async_ep_api._buffer_state = minimal_async_ep_api._buffer_key = None
        cls = MinimalAsyncEPTokenDispatcher if arm == "minimal_async_ep_uncloned" else ClonedMinimalAsyncEP
        return cls.Config(**common, hidden_dim=shape.dim, num_max_tokens_per_rank=shape.tokens,
                          dtype=torch.bfloat16, device=device)
    preset, transport = arm.split("/")
    return A2ATokenDispatcher.Config(**common, a2a=A2AConfig.preset(preset, transport=transport),
                                     max_tokens_per_rank=shape.tokens)


def build_moe(shape: MoEShape, arm: str, mesh, device: torch.device):
    """0.3.0's MoE holding this rank's experts only; weights drawn per global expert (and per
    other parameter) from fixed seeds: the same model in every arm, on any number of ranks."""
    local = shape.experts // mesh.size()
    routed = make_routed_experts_config(
        dim=shape.dim, hidden_dim=shape.hidden, num_experts=local, top_k=shape.top_k,
        param_init={}, comm_backend="standard",
    )
    routed.token_dispatcher = dispatcher_config(arm, shape, device)
    if "/" in arm:  # ours: with the experts the override installs
        routed.inner_experts = valid_row_experts_config(routed.inner_experts)
    config = make_moe_config(
        num_experts=shape.experts, load_balance_coeff=None,
        router=make_router_config(dim=shape.dim, num_experts=shape.experts, gate_param_init={}, top_k=shape.top_k,
                                  score_func="sigmoid", route_norm=shape.route_norm, route_scale=shape.route_scale),
        routed_experts=routed,
        shared_experts=make_ffn_config(dim=shape.dim, hidden_dim=shape.hidden, w1_param_init={}, w2w3_param_init={}),
    )
    with torch.device("meta"):
        moe = config.build()
    moe.to_empty(device=device)
    moe.to(torch.bfloat16)
    first = mesh.get_local_rank() * local
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(moe.named_parameters())):
            per_expert = name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS
            for j, chunk in enumerate(p if per_expert else [p]):
                g = torch.Generator(device=device).manual_seed(1000 * i + (first + j if per_expert else 0))
                chunk.copy_(torch.randn(chunk.shape, generator=g, device=device) * 0.02)
        moe.tokens_per_expert_E.zero_()
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return moe


def tolerance(arm: str) -> float:
    quantized = "/" in arm and A2AConfig.preset(arm.split("/")[0]).any_quantized
    return 2.0**-4 if quantized else 2.0**-6


def bench_moe_layer(shape: MoEShape, args, device, mesh, rows: list[dict]) -> None:
    g = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    x = torch.randn((1, shape.tokens, shape.dim), generator=g, device=device).bfloat16()
    grad = torch.randn((1, shape.tokens, shape.dim), generator=g, device=device).bfloat16()
    arms = ["alltoall", *[a for a in args.arms if a != "alltoall"]]
    results = time_arms(arms, lambda arm: build_moe(shape, arm, mesh, device), x, grad,
                        lambda m: m.routed_experts.inner_experts.w1_EFD, args, device)
    for arm in arms:
        errs = results[arm]["errs"]
        correct = all(e <= tolerance(arm) for e in errs.values())  # NaN compares False
        for name, (ms, ms_synced) in results[arm]["ms"].items():
            rows.append({
                "bench": "moe_layer", "shape": shape.label(), "arm": arm, "pass": name, "ms": round(ms, 3),
                "ms_synced": round(ms_synced, 3), "correct": correct,
                "rel_err": {k: float(f"{v:.3g}") for k, v in errs.items()},
            })
    for r in rows:
        if r["shape"] == shape.label():
            for base, key in BASELINES.items():
                b = next((s for s in rows if s["shape"] == r["shape"] and s["arm"] == base and s["pass"] == r["pass"]), None)
                r[key] = round(b["ms"] / r["ms"], 3) if b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv3,llama4")
    parser.add_argument("--arms", default=",".join(ARMS))
    add_timing_arguments(parser)
    args = parser.parse_args()
    args.arms = args.arms.split(",")

    device = init_process_group()
    # On CUDA 0.3.0's trainer default; on CPU smoke runs gloo rejects spmd_types' uneven
    # all_to_all, so the functional one.
    set_spmd_backend("spmd_types" if device.type == "cuda" else "partial_dtensor")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ep",))
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)

    rows: list[dict] = []
    for name in args.shapes.split(","):
        bench_moe_layer(SHAPES[name], args, device, mesh, rows)

    def line(r: dict) -> str:
        vs_maep = r["speedup_vs_minimal_async_ep"]
        return (f"{r['pass']:<8} {r['arm']:<26} {r['ms']:>8.3f} {r['ms_synced']:>8.3f} {r['speedup_vs_alltoall']:>6.3f}x "
                f"{(f'{vs_maep:.3f}x' if vs_maep else '-'):>7}  {r['correct']} {r['rel_err']} {r['shape']}")

    finish(rows, args.json, line,
           header=f"{'pass':<8} {'arm':<26} {'ms':>8} {'synced':>8} {'vs a2a':>7} {'vs MAEP':>7}  correct rel_err / shape")


if __name__ == "__main__":
    main()
