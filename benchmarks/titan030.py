"""torchtitan 0.3.0's MoE layer under EP: 0.3.0's own token dispatchers against ours
(``mxfp8_ep.titan030``), all arms side by side in one run.

    torchrun --nproc_per_node=2 -m benchmarks.titan030 --out OUT [--shapes dsv3,llama4] [--arms ...]

Needs torchtitan 0.3.0 importable: ``.venv-titan030`` (scripts/setup_titan030.sh) on CPU; on a
GPU machine whose environment has torchtitan 0.2.2, the wheels of torchtitan==0.3.0 and
spmd_types==0.2.3 installed with ``pip install --no-deps --target DIR`` and ``DIR`` first on
``PYTHONPATH`` (``benchmarks/run.sh titan030`` takes it as ``$TITAN030_SITE``). 0.3.0's trainer
needs torch >= 2.12; its MoE layer and dispatchers import on torch 2.11 once
``torch.compiler._is_non_strict_tracing`` exists, which this script adds (returning False) where
torch lacks it.

The layer: 0.3.0's ``MoE`` (sigmoid router, grouped-GEMM experts, one shared expert; it always
scores after the experts), forward and forward+backward, the same weights and inputs in every
arm. Arms:

* ``alltoall``: 0.3.0's ``AllToAllTokenDispatcher`` (bf16), the reference;
* ``minimal_async_ep``: 0.3.0's ``MinimalAsyncEPTokenDispatcher`` (bf16, CUDA only) with its
  dispatch output cloned: dispatch returns its double-buffered symmetric receive buffer itself,
  which a later combine backward overwrites while the experts still hold it for their weight
  gradients (``minimal_async_ep_uncloned`` shows the wrong w1 gradient);
* ``<preset>/<transport>``: ours, e.g. ``bf16/symm``, ``mxfp8/symm``, ``mxfp8_all/symm``.

Times as ``benchmarks.layer``'s. ``correct``: every ``rel_err`` against the alltoall arm within
2**-6 (bf16 legs) or 2**-4 (an MXFP8 leg).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # torch 2.11: 0.3.0's dispatchers call it
    torch.compiler._is_non_strict_tracing = lambda: False

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

from benchmarks.harness import (  # noqa: E402
    Arm,
    MoEShape,
    Results,
    add_speedups,
    add_timing_arguments,
    ep_mesh,
    init_process_group,
    layer_inputs,
    layer_rows,
    leave_process_group,
    parse_arms,
    parse_shape_names,
    parsed,
    time_layer_arms,
)
from mxfp8_ep.titan030 import A2ATokenDispatcher, valid_row_experts_config  # noqa: E402

ARMS = ("alltoall", "minimal_async_ep", "bf16/symm", "mxfp8/symm", "mxfp8_all/symm")
BASELINES = ("alltoall", "minimal_async_ep")  # the speed-ups' references
BASELINE_ARMS = ("alltoall", "minimal_async_ep", "minimal_async_ep_uncloned")
EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")
COLUMNS = ("shape", "pass", "arm", "ms", "speedup_vs_alltoall", "speedup_vs_minimal_async_ep", "ms_synced", "correct")


class ClonedMinimalAsyncEP(MinimalAsyncEPTokenDispatcher):
    """MinimalAsyncEP whose dispatch hands the experts a copy of its receive buffer."""

    @dataclass(kw_only=True, slots=True)
    class Config(MinimalAsyncEPTokenDispatcher.Config):
        pass

    def dispatch(self, *args):
        routed, tokens_per_expert, metadata = super().dispatch(*args)
        return routed.clone(), tokens_per_expert, metadata


def dispatcher_config(arm: Arm, shape: MoEShape, device: torch.device):
    common = dict(num_experts=shape.experts, top_k=shape.top_k)
    if arm.name == "alltoall":
        return AllToAllTokenDispatcher.Config(**common)
    if arm.name.startswith("minimal_async_ep"):
        if device.type != "cuda":
            raise ValueError(f"arm {arm.name}: MinimalAsyncEP needs CUDA symmetric memory")
        # One process-global buffer whose layout is fixed at its first init: start afresh per shape.
        minimal_async_ep_api._buffer_state = minimal_async_ep_api._buffer_key = None
        cls = MinimalAsyncEPTokenDispatcher if arm.name == "minimal_async_ep_uncloned" else ClonedMinimalAsyncEP
        return cls.Config(**common, hidden_dim=shape.dim, num_max_tokens_per_rank=shape.tokens,
                          dtype=torch.bfloat16, device=device)
    return A2ATokenDispatcher.Config(**common, a2a=arm.a2a(), max_tokens_per_rank=shape.tokens)


def build_moe(shape: MoEShape, arm: Arm, mesh, device: torch.device):
    """0.3.0's MoE holding this rank's experts only; weights drawn per global expert (and per
    other parameter) from fixed seeds: the same model in every arm, on any number of ranks."""
    local = shape.experts // mesh.size()
    routed = make_routed_experts_config(
        dim=shape.dim, hidden_dim=shape.hidden, num_experts=local, top_k=shape.top_k,
        param_init={}, comm_backend="standard",
    )
    routed.token_dispatcher = dispatcher_config(arm, shape, device)
    if not arm.baseline:  # ours: with the experts the override installs
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


def tolerance(arm: Arm) -> float:
    return 2.0**-4 if not arm.baseline and arm.a2a().any_quantized else 2.0**-6


def bench_layer(shape: MoEShape, arms: list[Arm], args, device, mesh) -> list[dict]:
    x, grad = layer_inputs(shape, device)
    results = time_layer_arms(arms, lambda arm: build_moe(shape, arm, mesh, device), x, grad,
                              lambda m: m.routed_experts.inner_experts.w1_EFD, args, device)
    rows = []
    for arm in arms:
        correct = all(e <= tolerance(arm) for e in results[arm.name]["errs"].values())  # NaN compares False
        rows += layer_rows(shape, [arm], results, args, correct=correct)
    add_speedups(rows, BASELINES)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shape_names, default="dsv3,llama4")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated; alltoall leads")
    add_timing_arguments(parser)
    args = parser.parse_args(argv)
    arms = parsed(parser, parse_arms, args.arms, baselines=BASELINE_ARMS, first="alltoall")
    if any(arm.local or arm.launch or arm.overlap or arm.rows for arm in arms):
        parser.error("torchtitan 0.3.0 arms take no modifiers (overlap, rows, launch shapes, @local)")

    device = init_process_group()
    # On CUDA 0.3.0's trainer default; on CPU smoke runs gloo rejects spmd_types' uneven
    # all_to_all, so the functional one.
    set_spmd_backend("spmd_types" if device.type == "cuda" else "partial_dtensor")
    mesh = ep_mesh(device)
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
    results = Results("titan030", args.out)
    results.write([r for shape in args.shapes for r in bench_layer(shape, arms, args, device, mesh)], COLUMNS)
    leave_process_group()


if __name__ == "__main__":
    main()
