"""torchtitan 0.2.2's MoE layer under EP over all ranks: torchtitan's ``ExpertParallel`` against
our dispatcher's arms, side by side in one run.

    torchrun --nproc_per_node=2 -m benchmarks.layer --out OUT [--shapes dsv3,llama4] [--arms ...]
    torchrun --nproc_per_node=1 -m benchmarks.layer --out OUT --shapes dsv3_rank   # one GPU
    torchrun --nproc_per_node=2 -m benchmarks.layer --out OUT --power               # clocks, power

The layer: torchtitan's ``MoE`` (sigmoid router, grouped-GEMM experts, one shared expert), the
same weights and inputs in every arm, forward and forward+backward. Arms (``harness.Arm``):
``torchtitan`` (the reference, always first), ``<preset>/<transport>[:mods][@local]``. Arms
run round-robin (``--rounds``). Each arm's output, input gradient and expert w1 gradient after
one step are compared with torchtitan's (``rel_err``). ``peak_gib``: the allocator's peak over
the arm's timed passes plus its peer buffers, less the reference results kept for the check.

``--power``: each arm runs ``--iters`` forward+backward passes back to back, as training does,
after a ``--cooldown`` pause, arms alternating over ``--rounds``; rank 0 samples every GPU
with ``nvidia-smi`` meanwhile. Per arm, round and rank: ms per pass and, for the rank's GPU, the
mean SM clock and power over the samples inside the passes, the share of samples with the
software power cap active, and the energy per pass (mean power x ms). An H200 running these
layers can sit at its power cap, so a layer's time also follows its energy.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from benchmarks.harness import (
    Results,
    add_speedups,
    add_timing_arguments,
    free_peer_buffers,
    init_process_group,
    layer_builder,
    layer_inputs,
    layer_passes,
    layer_rows,
    leave_process_group,
    parse_arms,
    parse_shape_names,
    parsed,
    time_layer_arms,
    titan022_mesh,
)

ARMS = ("torchtitan", "bf16/symm", "mxfp8/symm", "mxfp8_all/symm", "bf16/nccl", "mxfp8/nccl", "mxfp8_all/nccl",
        "bf16/symm@local")
BASELINES = ("torchtitan", "bf16/nccl")
COLUMNS = ("shape", "pass", "arm", "ms", "speedup_vs_torchtitan", "ms_synced", "peak_gib", "rel_err")


def bench_layer(shape, arms, args, device, mesh) -> list[dict]:
    x, grad = layer_inputs(shape, device)
    results = time_layer_arms(arms, layer_builder(shape, device, torch.bfloat16, mesh), x, grad,
                              lambda m: m.experts.w1, args, device)
    rows = layer_rows(shape, arms, results, args)
    add_speedups(rows, BASELINES)
    return rows


# --------------------------------------------------------------------------------- power

POWER_CAP_BIT = 0x4  # nvmlClocksThrottleReasonSwPowerCap in clocks_throttle_reasons.active
QUERY = "index,clocks.sm,power.draw,clocks_throttle_reasons.active"


@dataclass
class Sampler:
    """``nvidia-smi`` sampling every GPU in the background: (host time, gpu, MHz, W, cap bit)."""

    period_ms: int
    samples: list[tuple[float, int, float, float, bool]] = field(default_factory=list)

    def start(self) -> None:
        self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                       "-lms", str(self.period_ms)], stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append((time.time(), *sample))

    def stop(self) -> None:
        self._proc.terminate()
        self._thread.join(timeout=5)


def parse_sample(line: str) -> tuple[int, float, float, bool] | None:
    """One ``nvidia-smi`` line of ``QUERY`` -> (gpu, SM MHz, W, power cap active); None when a
    field is not a number (e.g. ``[N/A]``)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        return int(parts[0]), float(parts[1]), float(parts[2]), bool(int(parts[3], 16) & POWER_CAP_BIT)
    except ValueError:
        return None


def smi_index_by_uuid(text: str) -> dict[str, int]:
    """``nvidia-smi --query-gpu=index,uuid --format=csv,noheader`` -> {uuid without ``GPU-``: index}."""
    out = {}
    for line in text.strip().splitlines():
        index, uuid = (p.strip() for p in line.split(",", 1))
        out[uuid.removeprefix("GPU-")] = int(index)
    return out


def smi_index_of_ranks(device: torch.device) -> list[int]:
    """nvidia-smi's index of every rank's GPU (matched by UUID: CUDA_VISIBLE_DEVICES, as SLURM
    sets it, renumbers CUDA devices but not nvidia-smi's); the rank itself where no UUID matches."""
    uuids = [None] * dist.get_world_size()
    dist.all_gather_object(uuids, str(getattr(torch.cuda.get_device_properties(device), "uuid", "")))
    text = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout
    by_uuid = smi_index_by_uuid(text) if text.strip() else {}
    return [by_uuid.get(u, rank) for rank, u in enumerate(uuids)]


def phase_stats(samples, gpu: int, start: float, end: float, skip_s: float) -> dict:
    """Mean clock and power, and the power-capped share, of ``gpu``'s samples in
    ``[start + skip_s, end]`` (the first ``skip_s`` seconds ramp up from the cool-down)."""
    inside = [s for s in samples if s[1] == gpu and start + skip_s <= s[0] <= end]
    if not inside:
        return {"samples": 0, "sm_mhz": None, "power_w": None, "power_capped": None}
    return {
        "samples": len(inside),
        "sm_mhz": round(statistics.mean(s[2] for s in inside)),
        "power_w": round(statistics.mean(s[3] for s in inside)),
        "power_capped": round(sum(s[4] for s in inside) / len(inside), 2),
    }


def bench_power(shape, arms, args, device, mesh) -> list[dict]:
    x, grad = layer_inputs(shape, device)
    build = layer_builder(shape, device, torch.bfloat16, mesh)
    smi_index = smi_index_of_ranks(device)
    sampler = Sampler(args.sample_ms)
    if dist.get_rank() == 0:
        sampler.start()

    def back_to_back(fns, drop_grads, passes: int) -> None:
        """``passes`` forward+backward passes queued without a wait, each with fresh gradients."""
        for _ in range(passes):
            drop_grads()
            fns["fwd+bwd"]()

    phases = []  # (arm, round, host start, host end, ms per pass of each rank)
    for round_ in range(args.rounds):
        for arm in arms:
            moe = build(arm)
            fns, drop_grads = layer_passes(moe, x.clone().requires_grad_(), grad)
            back_to_back(fns, drop_grads, 3)
            torch.cuda.synchronize()
            time.sleep(args.cooldown)
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.time()
            start.record()
            back_to_back(fns, drop_grads, args.iters)
            end.record()
            torch.cuda.synchronize()
            t1 = time.time()
            ms = torch.tensor([start.elapsed_time(end) / args.iters], device=device)
            per_rank = [torch.empty_like(ms) for _ in range(dist.get_world_size())]
            dist.all_gather(per_rank, ms)
            phases.append((arm.name, round_, t0, t1, [float(t.item()) for t in per_rank]))
            del moe, fns, drop_grads  # the passes hold the layer
            free_peer_buffers()
            torch.cuda.empty_cache()
    rows: list[dict] = []
    if dist.get_rank() == 0:
        time.sleep(2 * args.sample_ms / 1e3)
        sampler.stop()
        for arm, round_, t0, t1, ms in phases:
            for rank, rank_ms in enumerate(ms):
                gpu = smi_index[rank]
                row = {**shape.row_fields(), "ep": dist.get_world_size(), "arm": arm, "pass": "fwd+bwd",
                       "round": round_, "rank": rank, "gpu": gpu, "ms": round(rank_ms, 3),
                       **phase_stats(sampler.samples, gpu, t0, t1, skip_s=min(0.3, (t1 - t0) / 4)),
                       "passes": args.iters, "cooldown_s": args.cooldown, "sample_ms": args.sample_ms}
                row["energy_j"] = round(row["power_w"] * row["ms"] / 1e3, 2) if row["power_w"] else None
                rows.append(row)
        add_speedups(rows, ("torchtitan",), same=("shape", "pass", "round", "rank"))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shape_names, default="dsv3,llama4")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated (harness.Arm); torchtitan leads")
    parser.add_argument("--power", action="store_true", help="clocks, power and energy per pass (needs nvidia-smi)")
    parser.add_argument("--cooldown", type=float, default=1.0, help="--power: seconds idle before each arm's passes")
    parser.add_argument("--sample-ms", type=int, default=20, help="--power: nvidia-smi sampling period")
    add_timing_arguments(parser)
    args = parser.parse_args(argv)
    arms = parsed(parser, parse_arms, args.arms, first="torchtitan")
    if args.power and not torch.cuda.is_available():
        sys.exit("--power measures GPU clocks and power: it needs CUDA GPUs and nvidia-smi")

    device = init_process_group()
    mesh = titan022_mesh(device, dispatcher_forward=True)
    results = Results("power" if args.power else "layer", args.out)
    rows = [r for shape in args.shapes
            for r in (bench_power if args.power else bench_layer)(shape, arms, args, device, mesh)]
    power_columns = ("shape", "arm", "round", "rank", "ms", "speedup_vs_torchtitan", "sm_mhz", "power_w",
                     "power_capped", "energy_j")
    results.write(rows, power_columns if args.power else COLUMNS)
    leave_process_group()


if __name__ == "__main__":
    main()
