"""What every benchmark script shares: shapes, arms, the process group, CUDA-event timing of arms
run round-robin in one run, peak memory, speed-up ratios, and rows written through
``benchmarks.rows.ResultsFile``.

Times are CUDA events on a GPU (``time.perf_counter`` on CPU processes, for smoke runs only):
each rank's median over its samples, then the slowest rank's (``worst_median``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

from benchmarks.rows import ResultsFile, this_machine

# ------------------------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer and the tokens each rank feeds it."""

    name: str
    dim: int
    hidden: int
    experts: int
    top_k: int
    tokens: int  # per rank
    score_before_experts: bool
    route_norm: bool
    route_scale: float

    def row_fields(self) -> dict:
        """The row fields that name this shape."""
        return {"shape": self.name, "dims": {"dim": self.dim, "hidden": self.hidden, "experts": self.experts,
                                             "top_k": self.top_k, "tokens_per_rank": self.tokens}}


SHAPES = {
    "dsv3": MoEShape("dsv3", 7168, 2048, 256, 8, 8192, False, True, 2.5),  # DeepSeek-V3-like
    "llama4": MoEShape("llama4", 5120, 8192, 16, 1, 16384, True, False, 1.0),  # Llama4-like
    # One rank's share of dsv3 at EP=2 (128 of its 256 experts, the same tokens, top-8: the rows
    # an even routing gives one rank), for one GPU: the layer with no exchange at all.
    "dsv3_rank": MoEShape("dsv3_rank", 7168, 2048, 128, 8, 8192, False, True, 2.5),
    "tiny": MoEShape("tiny", 256, 128, 8, 2, 256, False, True, 1.0),  # CPU smoke runs
}


def parse_shape_names(text: str) -> list[MoEShape]:
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(SHAPES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown shapes {unknown or text!r}; known: {sorted(SHAPES)}")
    return [SHAPES[n] for n in names]


# ------------------------------------------------------------------------------------- links

# The link NCCL's exchanges cross, as NCCL environment (set before NCCL starts): NVLink (its
# default on one node), its shared-memory transport through host memory, or its socket transport
# over loopback (the slow links multi-node EP crosses, on one machine). Peer memory (symm) always
# uses NVLink, so symm arms run on the nvlink link only.
LINKS: dict[str, dict[str, str]] = {
    "nvlink": {},
    "shm": {"NCCL_P2P_DISABLE": "1"},
    "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"},
}
# rows.Machine.link of each link name (``shared``: the ranks share one GPU, no link between them)
MACHINE_LINK = {"nvlink": None, "shm": "nccl-shm", "socket": "nccl-socket", "shared": "shared-gpu"}


def use_link(link: str) -> None:
    """Set ``link``'s NCCL environment in this process (before the process group starts)."""
    os.environ.update(LINKS[link])


# -------------------------------------------------------------------------------------- arms

def parse_launch(text: str):
    """``BxW[xD[xSxP]]`` -> ``LaunchShape(block, warps, block_d, stripes, stages)``."""
    from mxfp8_ep.kernels.launch_shapes import LaunchShape

    try:
        return LaunchShape(*(int(v) for v in text.split("x")))
    except (TypeError, ValueError) as e:
        raise ValueError(f"launch shape {text!r}: expected BLOCKxWARPS[xBLOCK_D[xSTRIPESxSTAGES]] ({e})") from None


def parse_kernel_launch(text: str) -> tuple[str, str | None, list]:
    """``KERNEL[.FMT]=BxW[xD],...`` -> (kernel, leg format or None for both, [LaunchShape, ...])."""
    from mxfp8_ep.kernels.launch_shapes import KernelShapes
    from mxfp8_ep.format.wire_format import WIRE_FORMATS

    kernels = [f.name for f in fields(KernelShapes)]
    key, eq, values = text.partition("=")
    kernel, _, fmt = key.partition(".")
    if not eq or kernel not in kernels or (fmt and fmt not in WIRE_FORMATS) or not values:
        raise ValueError(f"{text!r}: expected KERNEL[.FMT]=BxW[xD],... with KERNEL in {kernels}, "
                         f"FMT {' or '.join(WIRE_FORMATS)}")
    return kernel, fmt or None, [parse_launch(v) for v in values.split(",")]


def parse_launch_options(options: list[str]) -> dict[tuple[str, str | None], list]:
    """``--launch`` values -> {(kernel, fmt or None): [LaunchShape, ...]}."""
    out: dict[tuple[str, str | None], list] = {}
    for option in options:
        kernel, fmt, shapes = parse_kernel_launch(option)
        out.setdefault((kernel, fmt), []).extend(shapes)
    return out


def launches(options: dict, kernel: str, fmt: str) -> list:
    """The default launch shape of ``kernel`` for ``fmt``, then the ``--launch`` ones (each once)."""
    from mxfp8_ep.kernels.launch_shapes import KernelShapes

    shapes = [getattr(KernelShapes.default(fmt), kernel), *options.get((kernel, None), []),
              *options.get((kernel, fmt), [])]
    return list(dict.fromkeys(shapes))


@dataclass(frozen=True)
class Arm:
    """One side of a comparison. A baseline by name (``torchtitan``, ...), or our dispatcher:
    ``<preset>/<transport>`` with modifiers ``:overlap`` (shared experts on a side stream),
    ``:rows`` (combine's forward row by row: ``A2AConfig.symm_combine_partial_sums=False``),
    ``:worst`` (symm's expert capacity at the worst case: ``A2AConfig.capacity_factor=None``),
    ``:ceiling`` (symm's expert capacity at the default ceiling, the most it grows to:
    ``capacity_factor=DEFAULT_CAPACITY_CEILING``),
    ``:<kernel>=BxW[xD]`` or ``:<kernel>.<fmt>=BxW[xD]`` (that kernel's launch shape, for both
    leg formats or one), and the suffix ``@local``: every rank runs the layer alone with its
    share of the experts (no exchange; the layer's floor, not comparable to the others)."""

    name: str
    preset: str | None = None
    transport: str | None = None
    overlap: bool = False
    rows: bool = False
    worst: bool = False
    ceiling: bool = False
    local: bool = False
    launch: tuple = ()  # ((kernel, fmt or None, LaunchShape), ...)

    @property
    def baseline(self) -> bool:
        return self.preset is None

    def a2a(self):
        from mxfp8_ep.config import DEFAULT_CAPACITY_CEILING, A2AConfig

        factor = ({"capacity_factor": None} if self.worst
                  else {"capacity_factor": DEFAULT_CAPACITY_CEILING} if self.ceiling else {})
        return A2AConfig.preset(self.preset, transport=self.transport, symm_combine_partial_sums=not self.rows,
                                **factor)

    def launch_shapes(self):
        """``TokenDispatcher.Config.launch_shapes`` of this arm (None: the defaults)."""
        if not self.launch:
            return None
        from mxfp8_ep.kernels.launch_shapes import KernelShapes
        from mxfp8_ep.format.wire_format import WIRE_FORMATS

        out = {}
        for fmt in WIRE_FORMATS:
            shapes = KernelShapes.default(fmt)
            for kernel, only, shape in self.launch:
                if only in (None, fmt):
                    shapes = replace(shapes, **{kernel: shape})
            out[fmt] = shapes
        return out


MODIFIERS = ("overlap", "rows", "worst", "ceiling")  # an arm's flags (``Arm``)


def parse_arm(text: str, baselines=("torchtitan",)) -> Arm:
    if text in baselines:
        return Arm(text)
    from mxfp8_ep.config import PRESETS
    from mxfp8_ep.transport import Transport

    body, local = (text[: -len("@local")], True) if text.endswith("@local") else (text, False)
    head, *mods = body.split(":")
    preset, _, transport = head.partition("/")
    if preset not in PRESETS or transport not in Transport.named():
        raise ValueError(f"arm {text!r}: expected one of {list(baselines)} or <preset>/<transport> with preset in "
                         f"{sorted(PRESETS)} and transport {' or '.join(Transport.named())}")
    flags, launch = set(), []
    for mod in mods:
        if mod in MODIFIERS:
            flags.add(mod)
        elif "=" in mod:
            kernel, fmt, (shape,) = parse_kernel_launch(mod)  # one shape per modifier (commas split arms)
            launch.append((kernel, fmt, shape))
        else:
            raise ValueError(f"arm {text!r}: unknown modifier {mod!r}; known: {', '.join(MODIFIERS)}, "
                             f"KERNEL[.FMT]=BxW[xD]")
    return Arm(text, preset, transport, "overlap" in flags, "rows" in flags, "worst" in flags, "ceiling" in flags,
               local, tuple(launch))


def parse_arms(text: str, baselines=("torchtitan",), first: str | None = None) -> list[Arm]:
    """Comma-separated arms, each once; ``first`` (the reference) leads, whether named or not."""
    names = [a for a in text.split(",") if a]
    if first is not None:
        names = [first, *(a for a in names if a != first)]
    if len(set(names)) != len(names):
        raise ValueError(f"arms {text!r}: an arm is named twice")
    return [parse_arm(a, baselines) for a in names]


def parsed(parser: argparse.ArgumentParser, parse, *args, **kwargs):
    """``parse(*args, **kwargs)``; its ``ValueError`` is a usage error of ``parser`` (the
    message, exit status 2), raised before anything starts."""
    try:
        return parse(*args, **kwargs)
    except ValueError as e:
        parser.error(str(e))


def key_of(arm: str) -> str:
    """An arm's name as part of a field name: ``bf16/nccl`` -> ``bf16_nccl``."""
    return arm.replace("/", "_").replace(":", "_").replace("@", "_")


# ----------------------------------------------------------------------------- process group


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


def ep_mesh(device: torch.device):
    """The one-dimensional ``ep`` device mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ep",))


def titan022_mesh(device: torch.device, dispatcher_forward: bool = False):
    """``ep_mesh`` for torchtitan 0.2.2's layers: CPU processes (smoke runs) get torchtitan's CPU
    patches first. ``dispatcher_forward``: ``MoE.forward`` runs through our dispatcher
    (``install_expert_parallel``); each arm then shards its experts with its own style."""
    if device.type == "cpu":
        from launch.titan.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    if dispatcher_forward:
        from mxfp8_ep.config import A2AConfig
        from mxfp8_ep.titan022 import install_expert_parallel

        install_expert_parallel(A2AConfig())
    return ep_mesh(device)


def free_peer_buffers() -> None:
    """Drop the symm transport's peer buffers and activation pools (an arm's held memory)."""
    from mxfp8_ep.pool.activation_pool import release_pools
    from mxfp8_ep.dispatcher import release_peer_buffers

    release_peer_buffers()
    release_pools()


def leave_process_group() -> None:
    """The last step of every benchmark: the cached peer buffers go (they hold the process
    group), then the group, every rank at once."""
    import gc

    free_peer_buffers()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ timing


def add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=int, default=20, help="timed samples per arm and pass (split over rounds)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed samples before each arm's timed ones")
    parser.add_argument("--group", type=int, default=4, help="back-to-back calls per timed sample (ms)")
    parser.add_argument("--rounds", type=int, default=3, help="arms run round-robin in this many rounds")
    parser.add_argument("--out", required=True, help="folder of the results file (JSON Lines)")


def timing_fields(args) -> dict:
    return {"timing": {"iters": args.iters, "warmup": args.warmup, "group": args.group, "rounds": args.rounds}}


def sample_ms(fn, iters: int, warmup: int, device: torch.device, before=None, group: int = 1) -> list[float]:
    """This rank's ``iters`` samples (after ``warmup``), each the mean time of ``group``
    back-to-back calls. ``before`` runs ahead of every call, untimed when ``group == 1``.
    ``group > 1`` is the steady state of training, where the host enqueues the next layer
    while the device still runs this one; ``group == 1`` also counts the host's launch latency
    at every call. Every sample starts with all ranks at a barrier."""
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


def max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def worst_median(samples: list[float], device) -> float:
    """Median of this rank's samples, max over ranks."""
    return max_over_ranks(statistics.median(samples), device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item())


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device, held_bytes: int = 0) -> int:
    """This rank's allocator peak since ``reset_peak`` less ``held_bytes`` (tensors kept across
    arms), plus the peer buffers where the allocator does not count them (symmetric memory is
    not the caching allocator's; ranks sharing one GPU allocate theirs there)."""
    from mxfp8_ep.dispatcher import peer_buffer_nbytes
    from mxfp8_ep.exchange.peer_memory import sharing_one_device

    alloc = torch.cuda.max_memory_allocated() - held_bytes if device.type == "cuda" else 0
    return alloc + (0 if sharing_one_device() else peer_buffer_nbytes())


def peak_gib(device, held_bytes: int = 0) -> float:
    """``peak_bytes`` in GiB, max over ranks."""
    return max_over_ranks(peak_bytes(device, held_bytes) / 2**30, device)


def nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def round_robin(arms: list[Arm], time_arm, args, device, held_bytes=lambda: 0) -> dict[str, dict]:
    """Time every arm round-robin: each of ``args.rounds`` rounds runs the arms in turn, each
    taking its share of the ``args.iters`` samples, so slow drifts of the GPU (clocks under a
    long GEMM load, temperature) fall on all arms alike instead of on the later ones.
    ``time_arm(arm, first_round, iters)`` builds the arm, calls ``reset_peak`` before its timed
    samples and returns ``{pass: (steady samples, synced samples)}``; whatever it built is gone
    when it returns. ``held_bytes()``: what is kept across arms (the reference's check results),
    left out of the peak.

    Returns per arm name: ``peak_gib`` and ``ms[pass] = (steady ms, synced ms)``, each a median
    over all rounds' samples, max over ranks."""
    per_round = max(1, math.ceil(args.iters / args.rounds))
    samples: dict[str, dict] = {arm.name: {} for arm in arms}
    peaks: dict[str, float] = {}
    for round_ in range(args.rounds):
        for arm in arms:
            free_peer_buffers()
            timed = time_arm(arm, round_ == 0, per_round)
            for name, (steady, synced) in timed.items():
                kept = samples[arm.name].setdefault(name, ([], []))
                kept[0].extend(steady)
                kept[1].extend(synced)
            peaks[arm.name] = max(peaks.get(arm.name, 0.0), peak_gib(device, held_bytes()))
    return {arm.name: {"peak_gib": peaks[arm.name],
                       "ms": {p: (worst_median(s[0], device), worst_median(s[1], device))
                              for p, s in samples[arm.name].items()}}
            for arm in arms}


def timed_passes(fns: dict, iters: int, args, device, before=None) -> dict[str, tuple[list[float], list[float]]]:
    """Each pass's ``iters`` (steady samples, synced samples), for ``round_robin``."""
    return {name: (sample_ms(fn, iters, args.warmup, device, before=before, group=args.group),
                   sample_ms(fn, iters, args.warmup, device, before=before))
            for name, fn in fns.items()}


# ------------------------------------------------------------------------------- a MoE layer


def layer_inputs(shape: MoEShape, device, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's MoE-layer input and output gradient (the same in every arm and script)."""
    g = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    x = torch.randn((1, shape.tokens, shape.dim), generator=g, device=device, dtype=dtype)
    grad = torch.randn((1, shape.tokens, shape.dim), generator=g, device=device, dtype=dtype)
    return x, grad


def layer_passes(moe, xi, grad):
    """``{"fwd", "fwd+bwd"}`` calls of ``moe`` on ``xi``, and ``drop_grads``: each timed
    backward writes fresh gradients, as the first micro-batch of a training step does."""
    def fwd():
        moe(xi)

    def fwd_bwd():
        moe(xi).backward(grad)

    def drop_grads():
        moe.zero_grad(set_to_none=True)
        xi.grad = None

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}, drop_grads


def check_step(moe, x, grad, expert_w1, ref: dict | None, device):
    """One forward+backward of ``moe`` on a fresh copy of ``x``: the input the timed calls
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
    errs = {k: max_over_ranks(rel_err(v, ref[k]), device) for k, v in result.items()}
    return xi, result, errs


def time_layer_arms(arms: list[Arm], build, x, grad, expert_w1, args, device) -> dict[str, dict]:
    """Every MoE-layer arm (``build(arm)`` makes its layer), timed ``round_robin`` over the
    passes of ``layer_passes``. The first arm is the reference of the one-step correctness
    check (first round); ``@local`` arms compute another layer and are not checked. Returns
    ``round_robin``'s result plus ``errs`` per arm (relative errors vs the first arm)."""
    errs, ref = {arm.name: {} for arm in arms}, {}

    def time_arm(arm, first_round, iters):
        moe = build(arm)
        if first_round and not arm.local:
            xi, result, errs[arm.name] = check_step(moe, x, grad, expert_w1, ref.get("result"), device)
            ref.setdefault("result", result)
            del result  # the reference's is kept (held_bytes); this arm's is not
        else:
            xi = x.clone().requires_grad_()
        fns, drop_grads = layer_passes(moe, xi, grad)
        drop_grads()
        reset_peak(device)
        return timed_passes(fns, iters, args, device, before=drop_grads)

    results = round_robin(arms, time_arm, args, device, lambda: nbytes(ref.get("result", {}).values()))
    for arm in arms:
        results[arm.name]["errs"] = errs[arm.name]
    return results


def layer_rows(shape: MoEShape, arms: list[Arm], results: dict, args, **extra) -> list[dict]:
    """The rows of ``time_layer_arms``' results: one per arm and pass."""
    rows = []
    for arm in arms:
        res = results[arm.name]
        for name, (ms, ms_synced) in res["ms"].items():
            rows.append({**shape.row_fields(), "ep": dist.get_world_size(), "arm": arm.name, "pass": name,
                         "ms": round(ms, 3), "ms_synced": round(ms_synced, 3), "peak_gib": round(res["peak_gib"], 2),
                         "rel_err": {k: float(f"{v:.3g}") for k, v in res["errs"].items()}, **extra,
                         **timing_fields(args)})
    return rows


def titan_moe(shape, device, dtype, local_experts: int | None = None):
    """torchtitan 0.2.2's MoE layer of ``shape`` (sigmoid router, grouped-GEMM experts, one
    shared expert), the same weights on every rank and in every arm. ``local_experts``: its
    experts module holds only that many (one rank's share, built without the others), the router
    still over ``shape.experts``."""
    from torchtitan.models.moe.moe import GroupedExperts, MoE, MoEArgs

    args = MoEArgs(
        num_experts=shape.experts, num_shared_experts=1, score_func="sigmoid", route_norm=shape.route_norm,
        route_scale=shape.route_scale, score_before_experts=shape.score_before_experts, top_k=shape.top_k,
        use_grouped_mm=device.type == "cuda", load_balance_coeff=None,
    )
    with torch.device("meta"):
        moe = MoE(args, dim=shape.dim, hidden_dim=shape.hidden)
        if local_experts is not None:
            moe.experts = GroupedExperts(shape.dim, shape.hidden, local_experts, use_grouped_mm=args.use_grouped_mm)
            moe.experts.num_experts = shape.experts  # what the router and the dispatcher count over
    moe.to_empty(device=device)
    torch.manual_seed(1234)  # the same full weights on every rank and in every arm
    with torch.no_grad():
        moe.init_weights(0.02, device)
    return moe.to(dtype)


def build_moe(shape, device, dtype, arm: Arm, mesh):
    """``titan_moe``, its experts sharded over ``mesh`` by the arm's style: torchtitan's
    ``ExpertParallel`` for the baseline, else our ``DispatcherExpertParallel``."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    from mxfp8_ep.titan022 import DispatcherExpertParallel

    moe = titan_moe(shape, device, dtype)
    if arm.baseline:
        style = ExpertParallel()
    else:
        style = DispatcherExpertParallel(arm.a2a(), shape.tokens, overlap_shared_experts=arm.overlap,
                                         launch_shapes=arm.launch_shapes())
    parallelize_module(moe.experts, mesh, style)
    return moe


def rank_alone(shape, device):
    """The ``@local`` arms' layer: ``shape`` with this rank's share of the experts, and a
    one-rank mesh of this rank (every rank takes part in creating every rank's group)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    if shape.experts % world:
        raise ValueError(f"{shape.name}: {shape.experts} experts do not split over {world} ranks")
    groups = [dist.new_group([r]) for r in range(world)]
    mesh = DeviceMesh.from_group(groups[dist.get_rank()], device.type, mesh_dim_names=("ep",))
    return replace(shape, experts=shape.experts // world), mesh


def layer_builder(shape, device, dtype, mesh):
    """``build(arm)``: the arm's layer on ``mesh``; an ``@local`` arm's on this rank alone (the
    one-rank groups are made at its first build, which every rank reaches at the same point)."""
    alone = []

    def build(arm: Arm):
        if not arm.local:
            return build_moe(shape, device, dtype, arm, mesh)
        if not alone:
            alone.append(rank_alone(shape, device))
        arm_shape, arm_mesh = alone[0]
        return build_moe(arm_shape, device, dtype, arm, arm_mesh)

    return build


# ------------------------------------------------------------------------------ legs alone

TOP_K, EXPERTS = 8, 64  # a leg alone: each routed row is one of top-8 of 64 experts


@dataclass
class LegInputs:
    """One rank's input to a leg alone: ``tokens`` x top-k routed rows."""

    tokens: int
    x: torch.Tensor
    scores: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor


def leg_routing(tokens: int, experts: int, top_k: int, routing: str, device, rank: int):
    """Router scores, expert ids and per-expert counts: ``even`` (every expert alike) or
    ``zipf`` (expert popularity ~ 1/i^1.2: the ranks holding the first experts get most rows)."""
    if routing == "even":
        ids = (torch.arange(tokens * top_k, device=device).view(tokens, top_k) + rank) % experts
    elif routing == "zipf":
        weights = 1.0 / torch.arange(1, experts + 1, device=device, dtype=torch.float32) ** 1.2
        g = torch.Generator(device=device).manual_seed(7 + rank)
        ids = torch.multinomial(weights.expand(tokens, experts), top_k, replacement=False, generator=g)
    else:
        raise ValueError(f"routing must be 'even' or 'zipf', got {routing!r}")
    scores = torch.rand((tokens, top_k), device=device)
    counts = torch.zeros(experts, dtype=torch.int64, device=device).scatter_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.int64, device=device)
    )
    return scores, ids, counts


def leg_inputs(rows: int, dim: int, routing: str, device, rank: int, dtype=torch.bfloat16) -> LegInputs:
    tokens = rows // TOP_K
    scores, ids, counts = leg_routing(tokens, EXPERTS, TOP_K, routing, device, rank)
    return LegInputs(tokens, torch.randn((tokens, dim), device=device, dtype=dtype), scores, ids, counts)


def build_dispatcher(arm, tokens: int, group, device):
    """Our dispatcher for a leg alone (``TOP_K`` of ``EXPERTS``)."""
    from mxfp8_ep.dispatcher import TokenDispatcher

    cfg = TokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K, a2a=arm.a2a(), max_tokens_per_rank=tokens,
                                 launch_shapes=arm.launch_shapes())
    return cfg.build(group, device)


class TitanLeg:
    """torchtitan 0.2.2's dispatch and combine legs: ``MoE.forward``'s gather and unsort-reduce
    around ``ExpertParallel``'s token dispatch and combine."""

    def __init__(self, mesh):
        from torchtitan.distributed.expert_parallel import ExpertParallel

        self.ep, self.mesh = ExpertParallel(), mesh

    def dispatch(self, x, scores, ids, counts):
        slot = torch.argsort(ids.view(-1), stable=True)
        routed = x[slot // TOP_K]
        routed, per_expert = self.ep._token_dispatch(None, (routed, counts), self.mesh)
        return routed, per_expert, (slot, scores)

    def combine(self, routed_out, meta):
        slot, scores = meta
        back = self.ep._token_combine(None, routed_out, self.mesh)
        unsorted = back.new_zeros((slot.numel(), back.shape[1]))
        unsorted[slot] = back
        unsorted = unsorted.reshape(-1, TOP_K, back.shape[1])
        return torch.bmm(scores.reshape(-1, 1, TOP_K), unsorted.float()).to(back.dtype).squeeze(1)


# ------------------------------------------------------------------------------ ratios, rows


def add_speedups(rows: list[dict], baselines, same=("shape", "pass")) -> None:
    """``speedup_vs_<baseline>`` (and ``speedup_synced_vs_<baseline>`` where rows have
    ``ms_synced``) on every row: the baseline arm's time over the row's, the baseline being the
    row with the same ``same`` fields in this run; None where the run has no such row."""
    def key(r):
        return tuple(str(r.get(k)) for k in same)

    for base in baselines:
        ref = {key(r): r for r in rows if r["arm"] == base}
        for r in rows:
            b = ref.get(key(r))
            r[f"speedup_vs_{key_of(base)}"] = round(b["ms"] / r["ms"], 3) if b and r["ms"] else None
            if "ms_synced" in r:
                ok = b and r["ms_synced"]
                r[f"speedup_synced_vs_{key_of(base)}"] = round(b["ms_synced"] / r["ms_synced"], 3) if ok else None


class Results:
    """One run's results file (``rows.ResultsFile``), written by rank 0 only; every other rank
    holds ``None``. ``link``: a ``LINKS`` name the exchange crossed (recorded in the machine)."""

    def __init__(self, bench: str, out: str, link: str | None = None, count: int | None = None):
        self.file = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            count = count or (dist.get_world_size() if dist.is_initialized() else 1)
            machine_link = MACHINE_LINK.get(link) if link else None
            if machine_link is None and count == 1 and torch.cuda.is_available():
                machine_link = "none"
            self.file = ResultsFile(bench, out, machine=this_machine(count=count, link=machine_link))

    def write(self, rows: list[dict], columns: tuple[str, ...] = ()) -> list[dict]:
        """Write ``rows`` (rank 0) and print ``columns`` of each as a table; the rows as written
        (with their provenance; none on the other ranks)."""
        if self.file is None:
            return []
        written = [self.file.write(**r) for r in rows]
        if columns:
            print(format_table(rows, columns))
        print(f"wrote {len(rows)} rows to {self.file.path}")
        return written


def format_table(rows: list[dict], columns: tuple[str, ...]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    table = [list(columns)] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table)
