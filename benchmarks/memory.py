"""Memory of the symm transport's elastic capacity against the all-to-all's and the worst case.

    python -m benchmarks.memory --out OUT                                   # the recipe's estimate
    torchrun --nproc_per_node=W -m benchmarks.memory --layer --out OUT      # the layer, measured

Estimate (bench ``memory_estimate``): ``launch/config/memory.py``'s bytes per GPU, the check the
recipe makes before launch, for DeepSeek-V3 16B at EP=8 on 8 GPUs (seq 4096, local batch 2) and
every activation checkpointing, per arm: ``nccl`` (all-to-all: the rows received), ``symm`` with
its activation pool and capacity where they start (the default ``pool_factor`` and
``a2a.capacity_factor``), ``symm:ceiling`` at the default ceilings, ``symm:worst``
(``capacity_factor=None``: every layer at EP x tokens x top_k rows, no pool). ``vs_nccl``: the arm's bytes over nccl's.

Layer (bench ``layer_memory``): the DeepSeek-V3-like MoE layer (``harness.SHAPES``; ``--tokens``
per rank), one forward+backward, each rank's peak (``harness.peak_bytes``: the allocator's,
plus the peer buffers where it does not count them), max over ranks (``peak_gib``), and that
less the layer's parameters and their gradients (``above_weights_gib``: what the arms differ
in), and what of it the activation pool's planes and the peer buffers hold
(``activation_pool_gib``, ``peer_buffers_gib``). With CUDA the W ranks share GPU 0 (a gloo
group, peer buffers allocated by each rank and opened by the others over CUDA IPC:
``peer_memory.share_one_device``), so one GPU measures EP=W;
the rows say ``gpu_shared``, and each arm starts once every rank has let go of the last arm's
buffers. Arms: ``<preset>/symm`` at the default capacity factor, ``:ceiling`` (the default ceiling
the capacity grows to) and ``:worst``;
``torchtitan``: torchtitan 0.2.2's ``ExpertParallel`` on rank 0 alone (a one-rank NCCL group)
with that rank's share of the experts, the rows and buffers one rank of EP=W holds under an even
routing. Every rank builds only its own experts. ``capacity_rows``: the symm arm's expert rows.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
import torch.distributed as dist

from benchmarks.harness import (
    MoEShape,
    Results,
    free_peer_buffers,
    layer_inputs,
    leave_process_group,
    max_over_ranks,
    nbytes,
    parse_arms,
    parse_shape_names,
    parsed,
    peak_bytes,
    reset_peak,
    titan_moe,
)
from launch.config.memory import estimate
from launch.config.model_facts import MODELS
from mxfp8_ep.exchange import peer_memory
from mxfp8_ep.config import (DEFAULT_CAPACITY_CEILING, DEFAULT_CAPACITY_FACTOR, DEFAULT_POOL_CEILING,
                             DEFAULT_POOL_FACTOR, A2AConfig)
from mxfp8_ep.titan022 import install_expert_parallel
from mxfp8_ep.transport import Transport

# (model family, flavor, GPUs, EP, seq_len, local batch): what the EP=8 recipes train.
ESTIMATED = (("deepseek_v3", "16B", 8, 8, 4096, 2),)
CHECKPOINTING = ("none", "selective", "full")
# arm -> (symm, capacity_factor, pool_factor): symm where the capacity and the activation pool
# start, at their default ceilings, and every layer at the worst case (no pool).
ESTIMATE_ARMS = {Transport.NCCL: (False, None, None),
                 Transport.SYMM: (True, DEFAULT_CAPACITY_FACTOR, DEFAULT_POOL_FACTOR),
                 f"{Transport.SYMM}:ceiling": (True, DEFAULT_CAPACITY_CEILING, DEFAULT_POOL_CEILING),
                 f"{Transport.SYMM}:worst": (True, None, None)}
GIB = 2**30


def estimate_rows() -> list[dict]:
    rows = []
    for family, flavor, world, ep, seq_len, batch in ESTIMATED:
        facts = MODELS[family, flavor]
        for checkpointing in CHECKPOINTING:
            gib = {}
            for arm, (symm, factor, pool) in ESTIMATE_ARMS.items():
                est = estimate(facts, world=world, ep=ep, tp=1, local_batch_size=batch, seq_len=seq_len,
                               activation_checkpoint=checkpointing, device="cuda", symm=symm, capacity_factor=factor,
                               pool_factor=pool)
                gib[arm] = est.total / GIB
                rows.append({"model": f"{family}/{flavor}", "gpus": world, "ep": ep, "seq_len": seq_len,
                             "local_batch_size": batch, "activation_checkpoint": checkpointing, "arm": arm,
                             "capacity_factor": factor if symm else None, "pool_factor": pool,
                             "gib": round(gib[arm], 2), "activations_gib": round(est.activations / GIB, 2),
                             "activation_pool_gib": round(est.activation_pool / GIB, 2),
                             "layer_transient_gib": round(est.layer_transient / GIB, 2),
                             "peer_buffers_gib": round(est.peer_buffers / GIB, 2)})
            for row in rows[-len(ESTIMATE_ARMS):]:
                row["vs_nccl"] = round(gib[row["arm"]] / gib[Transport.NCCL], 4)
    return rows


# --------------------------------------------------------------------------------- the layer

LAYER_ARMS = ("torchtitan", "bf16/symm", "bf16/symm:ceiling", "bf16/symm:worst", "mxfp8/symm", "mxfp8/symm:ceiling",
              "mxfp8/symm:worst")


def init_ranks() -> torch.device:
    """A gloo group; with CUDA every rank on GPU 0 with peer buffers over CUDA IPC."""
    dist.init_process_group("gloo")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(0)
    peer_memory.share_one_device(True)
    return torch.device("cuda", 0)


def ep_moe(shape: MoEShape, arm, device, dtype):
    """Our dispatcher's layer over every rank: this rank's experts and the plan
    ``DispatcherExpertParallel`` would record (built by hand: every rank allocates only its
    experts)."""
    from mxfp8_ep.titan022 import CapacityGroupedExperts, ExpertParallelPlan

    world = dist.get_world_size()
    moe = titan_moe(shape, device, dtype, local_experts=shape.experts // world)
    if device.type == "cuda":
        moe.experts.__class__ = CapacityGroupedExperts
    moe.experts.expert_parallel_plan = ExpertParallelPlan(dist.group.WORLD, arm.a2a(), shape.tokens)
    return moe


def titan_moe_alone(shape: MoEShape, group, device, dtype):
    """torchtitan's ``ExpertParallel`` over the one-rank ``group``, with one rank's share of the
    experts: the router routes every row to them, as an even routing sends one rank its share."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    share = replace(shape, experts=shape.experts // dist.get_world_size())
    moe = titan_moe(share, device, dtype, local_experts=share.experts)
    mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("ep",))
    parallelize_module(moe.experts, mesh, ExpertParallel())
    return moe


def weights_bytes(moe) -> int:
    """The layer's parameters and their gradients (a DTensor's local shard)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in moe.parameters()]
    return 2 * nbytes(local)


def pass_peak(moe, x, grad, device, group=None) -> tuple[float, float, int]:
    """One forward+backward after a warm-up one, each again after a capacity overflow
    (``elastic.ReplayGuard`` over ``group``; None: the layer runs on this rank alone and never
    overflows): (peak GiB, peak less weights and grads GiB, replays), this rank's."""
    from mxfp8_ep.elastic import ReplayGuard

    guard = ReplayGuard(moe.modules(), group) if group is not None else None
    for measured in (False, True):
        for _ in guard.attempts() if guard is not None else (0,):
            moe.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            if measured:
                reset_peak(device)
            moe(xi).backward(grad)
    peak = peak_bytes(device)
    return peak / GIB, (peak - weights_bytes(moe)) / GIB, guard.replays if guard is not None else 0


def release_arm(device) -> None:
    """Drop the last arm's peer buffers everywhere before the next arm's peak: ranks sharing a
    GPU hold each other's through CUDA IPC, whose blocks their owner frees only once no rank
    holds them (``torch.cuda.ipc_collect``)."""
    free_peer_buffers()
    if device.type == "cuda":
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.ipc_collect()
        dist.barrier()


def held_gib() -> tuple[float, float]:
    """What this rank holds across steps, inside its peak: the activation pool's planes and the
    peer buffers (GiB)."""
    from mxfp8_ep.pool.activation_pool import pools
    from mxfp8_ep.dispatcher import peer_buffer_nbytes

    return sum(p.nbytes() for p in pools()) / GIB, peer_buffer_nbytes() / GIB


def layer_rows(shape: MoEShape, arms, device) -> list[dict]:
    from mxfp8_ep import elastic

    world, rank = dist.get_world_size(), dist.get_rank()
    titan_group = dist.new_group([0], backend="nccl" if device.type == "cuda" else "gloo")
    x, grad = layer_inputs(shape, device)
    rows = []
    for arm in arms:
        release_arm(device)
        if arm.baseline:
            *peaks, replays = pass_peak(titan_moe_alone(shape, titan_group, device, torch.bfloat16), x, grad,
                                        device) if rank == 0 else (0.0, 0.0, 0)
            capacity = None
        else:
            *peaks, replays = pass_peak(ep_moe(shape, arm, device, torch.bfloat16), x, grad, device, dist.group.WORLD)
            capacity = elastic.capacity_rows()
        peak, above, pool, peer = (max_over_ranks(p, torch.device("cpu")) for p in (*peaks, *held_gib()))
        rows.append({**shape.row_fields(), "ep": world, "arm": arm.name, "pass": "fwd+bwd",
                     "peak_gib": round(peak, 3), "above_weights_gib": round(above, 3),
                     "activation_pool_gib": round(pool, 3), "peer_buffers_gib": round(peer, 3),
                     "capacity_rows": capacity,
                     "replays": replays, "gpu_shared": device.type == "cuda" and world > 1})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        base = next((r for r in rows if r["arm"] == arms[0].name), None)
        row["vs_torchtitan"] = round(row["peak_gib"] / base["peak_gib"], 4) if base and base["peak_gib"] else None
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the rows")
    parser.add_argument("--layer", action="store_true", help="measure the layer (under torchrun), not the estimate")
    parser.add_argument("--shape", type=parse_shape_names, default="dsv3", help="a harness.SHAPES name")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the shape's)")
    parser.add_argument("--arms", default=",".join(LAYER_ARMS), help="comma-separated (harness.Arm)")
    args = parser.parse_args(argv)
    if not args.layer:
        Results("memory_estimate", args.out, count=1).write(
            estimate_rows(), ("model", "activation_checkpoint", "arm", "capacity_factor", "gib", "vs_nccl"))
        return
    arms = parsed(parser, parse_arms, args.arms, first="torchtitan")
    (shape,) = args.shape
    if args.tokens:
        shape = replace(shape, tokens=args.tokens)
    device = init_ranks()
    if device.type == "cpu":
        from launch.titan.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    install_expert_parallel(A2AConfig())  # MoE.forward through the dispatcher where a plan says so
    shared = device.type == "cuda" and dist.get_world_size() > 1
    results = Results("layer_memory", args.out, **({"link": "shared", "count": 1} if shared else {}))
    results.write(layer_rows(shape, arms, device),
                  ("shape", "ep", "arm", "peak_gib", "above_weights_gib", "capacity_rows", "vs_torchtitan"))
    leave_process_group()


if __name__ == "__main__":
    main()
