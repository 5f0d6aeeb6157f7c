"""Token dispatcher vs torchtitan 0.2.2's ExpertParallel: a whole MoE layer and the dispatch /
combine legs alone, all arms side by side in one run.

    torchrun --nproc_per_node=2 benchmarks/dispatcher.py --json dispatcher.json

``moe_layer``: torchtitan 0.2.2's ``MoE`` (router, grouped-GEMM experts, one shared expert)
under EP over all ranks, forward and forward+backward, same weights and inputs in every arm.
Arms: ``torchtitan`` (its ``ExpertParallel``, bf16: the reference), then our dispatcher as
``<preset>/<transport>`` (modifiers: ``_modifiers``). An arm ending in ``@local`` (``bf16/symm@local``) is the layer's floor
with no exchange: every rank runs the same layer alone (a one-rank group) with its share of
the experts (``experts / ranks``) and the same tokens, so the expert GEMMs see the rows an even
routing gives them under EP but no byte crosses a link; its outputs differ from the others'
(other experts), so it is not checked. ``leg``: ``--leg-rows`` routed rows of ``--leg-dim`` per rank (top-8
of 64 experts), even or Zipf routing; torchtitan's whole leg (gather, count exchange,
all-to-all, permute; and back: unpermute, all-to-all, unsort, reduce) against ours.

Arms run round-robin (``--rounds`` rounds, each with its share of the samples), so slow drifts
of the GPU fall on all arms alike. Times: median over ``--iters`` iterations (after warm-up) of
each rank, then the max over ranks (CUDA events). ``peak_gib``: the allocator's peak during the
arm's timed passes (its layer or dispatcher, their activations and gradients, the inputs), less
what the correctness check keeps of the reference arm, plus the arm's peer buffers; max over
ranks. Each arm's outputs (and, for the MoE layer, the input and expert gradients) are
compared with the torchtitan arm's (``rel_err``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module


@dataclass(frozen=True)
class MoEShape:
    name: str
    dim: int
    hidden: int
    experts: int
    top_k: int
    tokens: int
    score_before_experts: bool
    route_norm: bool
    route_scale: float

    def label(self) -> str:
        return (f"{self.name}: dim {self.dim}, hidden {self.hidden}, {self.experts} experts, "
                f"top-{self.top_k}, {self.tokens} tokens/rank")


SHAPES = {
    "dsv3": MoEShape("dsv3", 7168, 2048, 256, 8, 8192, False, True, 2.5),
    "llama4": MoEShape("llama4", 5120, 8192, 16, 1, 16384, True, False, 1.0),
    # One rank's share of dsv3 at EP=2 (128 of its 256 experts, the same 8192 tokens and top-8:
    # ~512 rows per expert, as an even routing gives each rank), for one GPU: the layer with no
    # wire at all (an EP=2 layer runs this work plus its exchange).
    "dsv3_rank": MoEShape("dsv3_rank", 7168, 2048, 128, 8, 8192, False, True, 2.5),
    # Small enough for a CPU smoke run (gloo).
    "tiny": MoEShape("tiny", 256, 128, 8, 2, 256, False, True, 1.0),
}
# The last: the no-wire floor of the same layer (each rank alone, its share of the experts).
ARMS = ["bf16/symm", "mxfp8/symm", "mxfp8_all/symm", "mxfp8/nccl", "bf16/symm@local"]
LEG_ARMS = ["bf16/symm", "mxfp8/symm", "mxfp8_all/symm", "bf16/nccl", "mxfp8/nccl", "mxfp8_all/nccl"]
# The link NCCL's exchanges cross (``--link``), as NCCL environment: NVLink (its default on one
# node), NCCL's shared-memory transport through host memory (~24 GB/s on 2xH200), or its socket
# transport over loopback -- the slow links that multi-node EP crosses, on one machine. Peer
# memory (symm) always uses NVLink: its arms run on the nvlink link only.
LINKS: dict[str, dict[str, str]] = {
    "nvlink": {},
    "shm": {"NCCL_P2P_DISABLE": "1"},
    "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"},
}


def link_env(link: str) -> str:
    """``KEY=VALUE ...`` of a link, for shells (benchmarks/gpu_evidence.sh)."""
    return " ".join(f"{k}={v}" for k, v in LINKS[link].items())


def _sample_ms(fn, iters: int, warmup: int, device: torch.device, before=None, group: int = 1) -> list[float]:
    """This rank's ``iters`` samples (after ``warmup``), each the mean time of ``group``
    back-to-back calls. ``before`` runs ahead of every call, untimed when ``group == 1``.
    ``group > 1`` is the steady state of training, where the host enqueues the next layer
    while the device still runs this one (a design that syncs the host pays its sync there
    too); ``group == 1`` also counts the host's launch latency at every call."""
    import time

    times = []
    for i in range(warmup + iters):
        if before is not None and group == 1:
            before()
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(group):
            if before is not None and group > 1:
                before()
            fn()
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / group
        else:
            ms = (time.perf_counter() - t0) * 1e3 / group
        if i >= warmup:
            times.append(ms)
    return times


def _worst_median(samples: list[float], device) -> float:
    """Median of this rank's samples, max over ranks."""
    return _max_over_ranks(statistics.median(samples), device)


def _median_ms(fn, iters: int, warmup: int, device: torch.device, before=None, group: int = 1) -> float:
    """Median over ``iters`` samples of ``_sample_ms``, max over ranks."""
    return _worst_median(_sample_ms(fn, iters, warmup, device, before, group), device)


def _max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item())


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device, held_bytes: int = 0) -> float:
    """The allocator's peak since ``_reset_peak`` less ``held_bytes`` (tensors kept across arms),
    plus the peer buffers (symmetric memory is not the caching allocator's), max over ranks."""
    from mxfp8_ep.dispatcher import peer_buffer_nbytes

    peer = peer_buffer_nbytes()
    alloc = torch.cuda.max_memory_allocated() - held_bytes if device.type == "cuda" else 0
    return _max_over_ranks((alloc + peer) / 2**30, device)


def _nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _free_peer_buffers():
    from mxfp8_ep.dispatcher import release_peer_buffers

    release_peer_buffers()


def leave_process_group() -> None:
    """The last step of every benchmark: the cached peer buffers go (they hold the process
    group), then the group, every rank at once."""
    import gc

    _free_peer_buffers()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def finish(rows: list[dict], json_path: str | None, line, header: str | None = None) -> None:
    """The end of a benchmark that prints one line per row: rank 0 writes ``rows`` as JSON
    (when asked) and prints ``header`` and ``line(row)`` for each row; then
    ``leave_process_group``."""
    if dist.get_rank() == 0:
        if json_path:
            with open(json_path, "w") as f:
                json.dump(rows, f, indent=1)
        if header:
            print(header)
        for r in rows:
            print(line(r))
    leave_process_group()


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """Launch shapes from the command line: ``"1,4,1024;2,4,512"`` -> [(1, 4, 1024), (2, 4, 512)]."""
    return [tuple(int(v) for v in part.split(",")) for part in text.split(";") if part]


def add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every MoE benchmark shares: iterations, warm-up, grouping and JSON output."""
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--group", type=int, default=4, help="back-to-back calls per timed sample (ms)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="MoE arms are timed round-robin in this many rounds (iters split among them)")
    parser.add_argument("--json", default=None)


def init_process_group() -> torch.device:
    """NCCL with one GPU per process (torchrun), else gloo on CPU processes (smoke runs)."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def check_step(moe, x, grad, expert_w1, ref: dict | None, device):
    """One forward+backward of ``moe`` on a fresh copy of ``x``: the input that the timed calls
    reuse, this step's output / input gradient / expert w1 gradient, and their relative errors
    against ``ref`` (max over ranks; ``ref=None``: this arm is the reference)."""
    xi = x.clone().requires_grad_()
    out = moe(xi)
    out.backward(grad)
    w1 = expert_w1(moe).grad
    w1 = w1.to_local() if hasattr(w1, "to_local") else w1
    # Clones: the timed calls write the same .grad tensors again.
    result = {"out": out.detach(), "x_grad": xi.grad.detach().clone(), "w1_grad": w1.detach().clone()}
    ref = result if ref is None else ref
    errs = {k: _max_over_ranks(_rel_err(v, ref[k]), device) for k, v in result.items()}
    return xi, result, errs


def _pass_fns(moe, xi, grad):
    def fwd():
        moe(xi)

    def fwd_bwd():
        moe(xi).backward(grad)

    def drop_grads():
        # Each timed backward writes fresh gradients, as the first micro-batch of a training
        # step does (FSDP reduce-scatters them): no accumulation kernels in the timing.
        moe.zero_grad(set_to_none=True)
        xi.grad = None

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}, drop_grads


def round_robin(arms, time_arm, args, device, held_bytes=lambda: 0) -> dict[str, dict]:
    """Time every arm round-robin: each of ``args.rounds`` rounds runs the arms in turn, each
    taking its share of the ``args.iters`` samples, so slow drifts of the GPU (clocks under a
    long GEMM load, temperature) fall on all arms alike instead of on the later ones.
    ``time_arm(arm, first_round, iters)`` builds the arm and returns ``{pass: (steady samples, synced samples)}``; whatever it built
    is gone when it returns, before the next arm's peak.
    It calls ``_reset_peak`` before its timed samples (after any check); ``held_bytes()``: what
    is kept across arms then (the reference's check results), left out of the peak.

    Returns per arm: ``peak_gib`` and ``ms[pass] = (steady-state ms, synced ms)``, each a median
    over all rounds' samples, max over ranks."""
    import math

    per_round = max(1, math.ceil(args.iters / args.rounds))
    samples: dict[str, dict] = {arm: {} for arm in arms}
    peaks: dict[str, float] = {}
    for round_ in range(args.rounds):
        for arm in arms:
            _free_peer_buffers()
            timed = time_arm(arm, round_ == 0, per_round)
            for name, (steady, synced) in timed.items():
                kept = samples[arm].setdefault(name, ([], []))
                kept[0].extend(steady)
                kept[1].extend(synced)
            peaks[arm] = max(peaks.get(arm, 0.0), _peak_gib(device, held_bytes()))
    return {
        arm: {"peak_gib": peaks[arm],
              "ms": {p: (_worst_median(s[0], device), _worst_median(s[1], device)) for p, s in samples[arm].items()}}
        for arm in arms
    }


def time_arms(arms, build, x, grad, expert_w1, args, device) -> dict[str, dict]:
    """Every MoE arm, timed ``round_robin``. The first arm is the reference of the one-step
    correctness check (first round); ``@local`` arms compute another layer and are not checked.
    Returns ``round_robin``'s result plus ``errs`` per arm (relative errors vs the first arm)."""
    errs, ref = {arm: {} for arm in arms}, {}

    def time_arm(arm, first_round, iters):
        moe = build(arm)
        if first_round and not is_local(arm):
            xi, result, errs[arm] = check_step(moe, x, grad, expert_w1, ref.get("result"), device)
            ref.setdefault("result", result)
            del result  # the reference's is kept (held_bytes); this arm's is not
        else:
            xi = x.clone().requires_grad_()
        fns, drop_grads = _pass_fns(moe, xi, grad)
        drop_grads()
        _reset_peak(device)
        return {name: (_sample_ms(fn, iters, args.warmup, device, before=drop_grads, group=args.group),
                       _sample_ms(fn, iters, args.warmup, device, before=drop_grads))
                for name, fn in fns.items()}

    results = round_robin(arms, time_arm, args, device, lambda: _nbytes(ref.get("result", {}).values()))
    for arm in arms:
        results[arm]["errs"] = errs[arm]
    return results


# Arm modifiers that run the arm at another kernel launch shape (``TokenDispatcher.Config.launch_shapes``:
# kernel -> a shape per leg format), side by side with the defaults. ``push2``: ``push_tokens`` at
# two tokens per program. ``partials2``: ``push_partials`` at two token slots per program.
LAUNCH_MODIFIERS = {
    "push2": ("push_tokens", {"bf16": (2, 4, 1024), "mxfp8": (2, 4, 1024)}),
    "partials2": ("push_partials", {"bf16": (2, 4, 512), "mxfp8": (2, 4, 1024)}),
}


def _modifiers(arm: str) -> set[str]:
    """``<preset>/<transport>[:overlap][:rows][:push2][:partials2][@local]``: ``overlap`` runs the shared
    experts on a side stream (``DispatcherExpertParallel(overlap_shared_experts=True)``); ``rows``
    sends combine's forward row by row (``A2AConfig.symm_combine_partial_sums=False``); the
    ``LAUNCH_MODIFIERS`` run a kernel at another launch shape (``launch_shapes``)."""
    mods = set(arm.split("@")[0].split(":")[1:])
    known = {"overlap", "rows", *LAUNCH_MODIFIERS}
    if not mods <= known:
        raise ValueError(f"arm {arm!r}: unknown modifiers {sorted(mods - known)}")
    return mods


def launch_shapes(arm: str):
    """The arm's ``TokenDispatcher.Config.launch_shapes``: each format's defaults with its
    ``LAUNCH_MODIFIERS`` applied, or None (the defaults) for an arm without any."""
    from dataclasses import replace

    from mxfp8_ep.config import LEG_FORMATS
    from mxfp8_ep.launch_shapes import KernelShapes, LaunchShape

    mods = sorted(_modifiers(arm) & LAUNCH_MODIFIERS.keys())
    if not mods:
        return None
    return {
        fmt: replace(KernelShapes.default(fmt), **{
            LAUNCH_MODIFIERS[mod][0]: LaunchShape(*LAUNCH_MODIFIERS[mod][1][fmt]) for mod in mods
        })
        for fmt in LEG_FORMATS
    }


def _a2a(arm: str):
    from mxfp8_ep.config import A2AConfig

    preset, transport = arm.split("@")[0].split(":")[0].split("/")
    return A2AConfig.preset(preset, transport=transport, symm_combine_partial_sums="rows" not in _modifiers(arm))


def is_local(arm: str) -> bool:
    return arm.endswith("@local")


def rank_alone(shape: MoEShape, device):
    """The ``@local`` arms' layer: ``shape`` with this rank's share of the experts, and a
    one-rank mesh of this rank (every rank takes part in creating every rank's group)."""
    from dataclasses import replace

    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    if shape.experts % world:
        raise ValueError(f"{shape.name}: {shape.experts} experts do not split over {world} ranks")
    groups = [dist.new_group([r]) for r in range(world)]
    mesh = DeviceMesh.from_group(groups[dist.get_rank()], device.type, mesh_dim_names=("ep",))
    return replace(shape, experts=shape.experts // world), mesh


def _build_moe(shape: MoEShape, device, dtype, arm: str, mesh):
    from torchtitan.distributed.expert_parallel import ExpertParallel
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from mxfp8_ep.titan022 import DispatcherExpertParallel

    args = MoEArgs(
        num_experts=shape.experts, num_shared_experts=1, score_func="sigmoid", route_norm=shape.route_norm,
        route_scale=shape.route_scale, score_before_experts=shape.score_before_experts, top_k=shape.top_k,
        use_grouped_mm=device.type == "cuda", load_balance_coeff=None,
    )
    with torch.device("meta"):
        moe = MoE(args, dim=shape.dim, hidden_dim=shape.hidden)
    moe.to_empty(device=device)
    torch.manual_seed(1234)  # same full weights on every rank and in every arm
    with torch.no_grad():
        moe.init_weights(0.02, device)
    moe.to(dtype)
    style = (ExpertParallel() if arm == "torchtitan" else
             DispatcherExpertParallel(_a2a(arm), shape.tokens, overlap_shared_experts="overlap" in _modifiers(arm),
                                      launch_shapes=launch_shapes(arm)))
    parallelize_module(moe.experts, mesh, style)
    return moe


def layer_builder(shape: MoEShape, device, dtype, mesh):
    """``build(arm)``: the arm's MoE layer of ``shape`` on ``mesh``; an ``@local`` arm's on
    this rank alone (``rank_alone``; the one-rank groups are made at its first build, which
    every rank reaches at the same point)."""
    alone = []

    def build(arm):
        if not is_local(arm):
            return _build_moe(shape, device, dtype, arm, mesh)
        if not alone:
            alone.append(rank_alone(shape, device))
        arm_shape, arm_mesh = alone[0]
        return _build_moe(arm_shape, device, dtype, arm, arm_mesh)

    return build


def layer_inputs(shape: MoEShape, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's MoE-layer input and output gradient (the same in every arm and benchmark)."""
    g = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    x = torch.randn((1, shape.tokens, shape.dim), generator=g, device=device, dtype=dtype)
    grad = torch.randn((1, shape.tokens, shape.dim), generator=g, device=device, dtype=dtype)
    return x, grad


def bench_moe_layer(shape: MoEShape, args, device, mesh, rows: list[dict]) -> None:
    x, grad = layer_inputs(shape, device, args.dtype)
    arms = ["torchtitan", *(a for a in args.arms if a != "torchtitan")]  # the reference, always first, once
    results = time_arms(arms, layer_builder(shape, device, args.dtype, mesh), x, grad, lambda m: m.experts.w1, args, device)
    for arm in arms:
        res = results[arm]
        for name, (ms, ms_synced) in res["ms"].items():
            rows.append({
                "bench": "moe_layer", "shape": shape.label(), "arm": arm, "pass": name, "ms": round(ms, 3),
                "ms_synced": round(ms_synced, 3), "peak_gib": round(res["peak_gib"], 2),
                "rel_err": {k: float(f"{v:.3g}") for k, v in res["errs"].items()},
            })
    _speedups(rows, "moe_layer", shape.label())


LEG_TOP_K, LEG_EXPERTS = 8, 64  # the legs alone: each routed row is one of top-8 of 64 experts


@dataclass
class LegInputs:
    """One rank's input to a leg alone: ``rows`` routed rows of ``dim`` (``tokens`` x top-k)."""

    tokens: int
    x: torch.Tensor
    scores: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor


def leg_inputs(rows: int, dim: int, routing: str, device, rank: int, dtype=torch.bfloat16) -> LegInputs:
    """The tokens, their router scores, expert ids and per-expert counts for a leg alone, with
    ``even`` (every expert alike) or ``zipf`` routing."""
    tokens = rows // LEG_TOP_K
    scores, ids, counts = _leg_routing(tokens, LEG_EXPERTS, LEG_TOP_K, routing, device, rank)
    return LegInputs(tokens, torch.randn((tokens, dim), device=device, dtype=dtype), scores, ids, counts)


def _leg_routing(tokens: int, experts: int, top_k: int, routing: str, device, rank: int):
    if routing == "even":
        ids = (torch.arange(tokens * top_k, device=device).view(tokens, top_k) + rank) % experts
    else:
        weights = 1.0 / torch.arange(1, experts + 1, device=device, dtype=torch.float32) ** 1.2
        g = torch.Generator(device=device).manual_seed(7 + rank)
        ids = torch.multinomial(weights.expand(tokens, experts), top_k, replacement=False, generator=g)
    scores = torch.rand((tokens, top_k), device=device)
    counts = torch.zeros(experts, dtype=torch.int64, device=device).scatter_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.int64, device=device)
    )
    return scores, ids, counts


class _TitanLeg:
    """torchtitan 0.2.2's dispatch and combine legs: MoE.forward's gather / unsort-reduce around
    ExpertParallel's token dispatch / combine hooks."""

    def __init__(self, experts: int, top_k: int, mesh):
        from torchtitan.distributed.expert_parallel import ExpertParallel

        self.ep, self.mesh, self.top_k = ExpertParallel(), mesh, top_k

    def dispatch(self, x, scores, ids, counts):
        slot = torch.argsort(ids.view(-1), stable=True)
        routed = x[slot // self.top_k]
        routed, per_expert = self.ep._token_dispatch(None, (routed, counts), self.mesh)
        return routed, per_expert, (slot, scores)

    def combine(self, routed_out, meta):
        slot, scores = meta
        back = self.ep._token_combine(None, routed_out, self.mesh)
        unsorted = back.new_zeros((slot.numel(), back.shape[1]))
        unsorted[slot] = back
        unsorted = unsorted.reshape(-1, self.top_k, back.shape[1])
        return torch.bmm(scores.reshape(-1, 1, self.top_k), unsorted.float()).to(back.dtype).squeeze(1)


def bench_legs(args, device, mesh, rows: list[dict]) -> None:
    """The legs alone, every arm timed ``round_robin``; each arm's dispatch + combine checked
    against torchtitan's in the first round."""
    from mxfp8_ep.dispatcher import TokenDispatcher

    rank, top_k, experts = dist.get_rank(), LEG_TOP_K, LEG_EXPERTS
    shape = f"{args.leg_rows} routed rows x {args.leg_dim} per rank (top-{top_k} of {experts})"
    arms = ["torchtitan", *(a for a in args.leg_arms
                            if a != "torchtitan" and (args.link == "nvlink" or not a.endswith("/symm")))]
    for routing in args.routings.split(","):
        leg = leg_inputs(args.leg_rows, args.leg_dim, routing, device, rank, args.dtype)
        tokens, x, scores, ids, counts = leg.tokens, leg.x, leg.scores, leg.ids, leg.counts
        errs, ref = {}, {}

        def time_arm(arm, first_round, iters):
            if arm == "torchtitan":
                disp = _TitanLeg(experts, top_k, mesh)
            else:
                cfg = TokenDispatcher.Config(num_experts=experts, top_k=top_k, a2a=_a2a(arm), max_tokens_per_rank=tokens,
                                             launch_shapes=launch_shapes(arm))
                disp = cfg.build(mesh.get_group(), device)
            routed, _, meta = disp.dispatch(x, scores, ids, counts)
            if first_round:
                out = disp.combine(routed, meta)
                errs[arm] = _max_over_ranks(_rel_err(out, ref.setdefault("out", out)), device)
                del out  # the reference's is kept (held_bytes); this arm's is not
            fns = {"dispatch": lambda: disp.dispatch(x, scores, ids, counts), "combine": lambda: disp.combine(routed, meta)}
            _reset_peak(device)
            return {leg: (_sample_ms(fn, iters, args.warmup, device, group=args.group),
                          _sample_ms(fn, iters, args.warmup, device)) for leg, fn in fns.items()}

        results = round_robin(arms, time_arm, args, device, lambda: _nbytes(ref.values()))
        ref.clear()
        for arm in arms:
            for leg, (ms, ms_synced) in results[arm]["ms"].items():
                rows.append({
                    "bench": "leg", "link": args.link, "shape": f"{shape}, {routing}", "arm": arm, "pass": f"{leg} fwd",
                    "ms": round(ms, 3), "ms_synced": round(ms_synced, 3), "peak_gib": round(results[arm]["peak_gib"], 2),
                    "rel_err": {"dispatch+combine": float(f"{errs[arm]:.3g}")},
                })
        _speedups(rows, "leg", f"{shape}, {routing}")


def _speedups(rows, bench, shape):
    rows = [r for r in rows if r["bench"] == bench and r["shape"] == shape]
    base = {r["pass"]: r for r in rows if r["arm"] == "torchtitan"}
    ours_bf16 = {r["pass"]: r for r in rows if r["arm"] == "bf16/nccl"}
    for r in rows:
        r["speedup_vs_torchtitan"] = round(base[r["pass"]]["ms"] / r["ms"], 3)
        r["speedup_synced"] = round(base[r["pass"]]["ms_synced"] / r["ms_synced"], 3)
        if r["pass"] in ours_bf16:
            r["speedup_vs_bf16_nccl"] = round(ours_bf16[r["pass"]]["ms"] / r["ms"], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", default="moe_layer,leg")
    parser.add_argument("--shapes", default="dsv3,llama4")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--leg-rows", type=int, default=131072)
    parser.add_argument("--leg-dim", type=int, default=5120)
    parser.add_argument("--leg-arms", default=",".join(LEG_ARMS))
    parser.add_argument("--routings", default="even,zipf", help="leg routings")
    parser.add_argument("--link", choices=sorted(LINKS), default="nvlink",
                        help="the link NCCL crosses (sets its environment before it starts; recorded in every row)")
    add_timing_arguments(parser)
    args = parser.parse_args()
    args.arms = args.arms.split(",")
    args.leg_arms = args.leg_arms.split(",")
    for key, value in LINKS[args.link].items():
        os.environ[key] = value  # before NCCL creates its communicators

    device = init_process_group()
    if device.type == "cpu":
        from launch.titan_cpu_compat import apply_cpu_compat

        apply_cpu_compat()  # torchtitan 0.2.2 on CPU processes (smoke runs)
    args.dtype = torch.bfloat16
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ep",))

    from mxfp8_ep.titan022 import install_expert_parallel
    from mxfp8_ep.config import A2AConfig

    install_expert_parallel(A2AConfig())  # patches MoE.forward; arms pick their own style
    rows: list[dict] = []
    benches = args.bench.split(",")
    if "leg" in benches:
        bench_legs(args, device, mesh, rows)
    if "moe_layer" in benches:
        for name in args.shapes.split(","):
            bench_moe_layer(SHAPES[name], args, device, mesh, rows)
    for r in rows:
        r.setdefault("link", args.link)

    finish(rows, args.json, header=(
        f"{'bench':<10} {'pass':<15} {'arm':<15} {'ms':>8} {'vs titan':>9} {'synced':>8} {'vs titan':>9} "
        f"{'peak GiB':>9}  shape / rel_err"), line=lambda r: (
        f"{r['bench']:<10} {r['pass']:<15} {r['arm']:<15} {r['ms']:>8.3f} {r['speedup_vs_torchtitan']:>8.3f}x "
        f"{r['ms_synced']:>8.3f} {r['speedup_synced']:>8.3f}x {r['peak_gib']:>9.2f}  {r['shape']} {r['rel_err']}"))


if __name__ == "__main__":
    main()
