"""SM clock, power and energy of each MoE-layer arm under a sustained load, on the GPU machine:

    torchrun --nproc_per_node=2 benchmarks/layer_power.py --json layer_power.json

Each arm (``benchmarks/dispatcher.py``'s arms and ``MoE`` layer, same weights and inputs) runs
``--iters`` forward+backward passes back to back, as training does, after a ``--cooldown``
pause; arms alternate over ``--rounds`` rounds. One node: rank 0 samples every GPU with
``nvidia-smi`` (``--sample-ms``). Per arm and rank: ms per pass (CUDA events) and, for the
rank's GPU, mean SM clock and power over the samples inside the passes, the share of samples
with the software power cap active, and the energy per pass (mean power x ms; nvidia-smi's
power.draw is itself an average over up to a second).

Why: an H200 running these layers sits at its power cap, so a layer's time also follows its
energy: a schedule with fewer low-power phases (waits on the wire) runs its GEMMs at lower
clocks.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script (torchrun benchmarks/layer_power.py): the repo root holds `benchmarks`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dispatcher import (  # noqa: E402
    ARMS,
    SHAPES,
    _free_peer_buffers,
    _pass_fns,
    finish,
    init_process_group,
    layer_builder,
    layer_inputs,
)

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


def _back_to_back(fwd_bwd, drop_grads, passes: int) -> None:
    """``passes`` forward+backward passes, each writing fresh gradients (as dispatcher.py's
    timed passes do), queued without a wait."""
    for _ in range(passes):
        drop_grads()
        fwd_bwd()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="dsv3", choices=sorted(SHAPES))
    parser.add_argument("--arms", default=",".join(["torchtitan", *ARMS]))
    parser.add_argument("--iters", type=int, default=40, help="back-to-back forward+backward passes per arm and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cooldown", type=float, default=1.0, help="seconds idle before each arm's passes")
    parser.add_argument("--sample-ms", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("layer_power.py measures GPU clocks and power: it needs CUDA GPUs and nvidia-smi")
    device = init_process_group()
    from torch.distributed.device_mesh import init_device_mesh

    from mxfp8_ep.config import A2AConfig
    from mxfp8_ep.titan022 import install_expert_parallel

    install_expert_parallel(A2AConfig())
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    shape = SHAPES[args.shape]
    x, grad = layer_inputs(shape, device, torch.bfloat16)
    build = layer_builder(shape, device, torch.bfloat16, mesh)
    smi_index = smi_index_of_ranks(device)
    sampler = Sampler(args.sample_ms)
    if rank == 0:
        sampler.start()
    phases = []  # (arm, round, host start, host end, ms per pass of each rank)
    for round_ in range(args.rounds):
        for arm in args.arms.split(","):
            moe = build(arm)
            xi = x.clone().requires_grad_()
            passes, drop_grads = _pass_fns(moe, xi, grad)
            _back_to_back(passes["fwd+bwd"], drop_grads, 3)
            torch.cuda.synchronize()
            time.sleep(args.cooldown)
            dist.barrier()
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.time()
            start_event.record()
            _back_to_back(passes["fwd+bwd"], drop_grads, args.iters)
            end_event.record()
            torch.cuda.synchronize()
            t1 = time.time()
            ms = torch.tensor([start_event.elapsed_time(end_event) / args.iters], device=device)
            per_rank = [torch.empty_like(ms) for _ in range(world)]
            dist.all_gather(per_rank, ms)
            phases.append((arm, round_, t0, t1, [float(t.item()) for t in per_rank]))
            del moe, xi, passes, drop_grads  # the passes hold the layer
            _free_peer_buffers()
            torch.cuda.empty_cache()
    rows: list[dict] = []
    if rank == 0:
        time.sleep(2 * args.sample_ms / 1e3)
        sampler.stop()
        reference = {}
        for arm, round_, t0, t1, ms in phases:
            for r in range(world):
                gpu = smi_index[r]
                row = {"bench": "moe_layer_power", "shape": shape.label(), "arm": arm, "round": round_, "rank": r,
                       "gpu": gpu, "pass": "fwd+bwd", "ms": round(ms[r], 3),
                       **phase_stats(sampler.samples, gpu, t0, t1, skip_s=min(0.3, (t1 - t0) / 4))}
                row["energy_j"] = round(row["power_w"] * row["ms"] / 1e3, 2) if row["power_w"] else None
                if arm == "torchtitan":
                    reference[(round_, r)] = row["ms"]
                ref = reference.get((round_, r))
                row["speedup_vs_torchtitan"] = round(ref / row["ms"], 3) if ref else None
                rows.append(row)
    header = (f"{'arm':<16} {'round':>5} {'rank':>4} {'gpu':>3} {'ms':>8} {'x titan':>7} {'SM MHz':>7} {'W':>5} "
              f"{'capped':>6} {'J/pass':>7}")

    def line(r):
        return (f"{r['arm']:<16} {r['round']:>5} {r['rank']:>4} {r['gpu']:>3} {r['ms']:>8.2f} {r['speedup_vs_torchtitan'] or 0:>7.3f} "
                f"{r['sm_mhz'] or 0:>7} {r['power_w'] or 0:>5} {r['power_capped'] or 0:>6} {r['energy_j'] or 0:>7}")

    finish(rows, args.json, line, header)


if __name__ == "__main__":
    main()
