"""How the symm transport's elastic capacity would grow over a measured routing, at EP 2, 4, 8, as
rows (bench ``capacity_study``).

    python -m benchmarks.capacity_study ROUTING.jsonl[.gz] --out benchmarks/results \\
        [--save-telemetry benchmarks/results/telemetry/NAME.routing.jsonl.gz]

The input is a run's routing telemetry (``<run dir>/routing.jsonl``, written by
``launch.titan.routing_telemetry``; ``recipes/routing_study_cpu.yaml`` makes one): per training
step and MoE layer, the rows the busiest rank would receive at EP ``e`` over the balanced count
(its load). Each step of it is applied to the target shape, the recipe ``TARGET_RECIPE``
(DeepSeek-V3 16B on one 8-GPU node: its tokens per rank, top-k, experts), at EP ``e`` on the
same 8 GPUs: the step needs the rows of ``capacity.expert_major_capacity`` at a factor of its
largest load over the layers (the MoE layers share one buffer set), and the capacity follows
``capacity.next_capacity`` from a start factor with a growth headroom up to a ceiling. Per EP
degree and setting (``GRID``) a row: the steps run again to grow the capacity (``replays``,
the last one's step), the steps above the ceiling (``spills``), the capacity at the end and its
peak (rows, and as a factor of the balanced case), and ``launch/config/memory.py``'s estimate
per GPU (selective checkpointing, as the target recipe) at the start factor, at the ceiling and
at the end, beside the nccl transport's. ``max_load``: the largest load of the run at that
degree (``max_load_second_half``: over the second half of its steps); ``sampling_floor``: the
largest load a router that picks its experts uniformly at random shows at the run's tokens per
step and layer count (the part of a load that is the count's noise: the target's steps count
many more tokens, so it sees less of it).

Assumes that every rank of the target routes like the measured steps (their shares of the
experts carry over, not their token counts). ``--save-telemetry`` writes the input, gzipped,
beside the rows: the data they were computed from, so ``python -m benchmarks.capacity_study``
on that file makes them again.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.rows import REPO, ResultsFile, this_machine
from launch.config.memory import EXPERT_ALIGN, estimate
from launch.config.model_facts import MODELS, ModelFacts
from mxfp8_ep.capacity import GROWTH_HEADROOM, expert_major_capacity, next_capacity, worst_case_capacity
from mxfp8_ep.config import DEFAULT_CAPACITY_CEILING, DEFAULT_CAPACITY_FACTOR

TARGET_RECIPE = "recipes/dsv3_16b_ep8_bf16_vs_mxfp8.yaml"
EP_DEGREES = (2, 4, 8)
# (start factor, headroom, ceiling factor; None: the worst case) the policy is simulated at.
GRID = tuple((f, h, c) for f in (1.0, 1.25, 1.5) for h in (0.1, 0.25, 0.5) for c in (1.5, 2.0, 2.5, 3.0, None)
             if c is None or c >= f)
DEFAULTS = (DEFAULT_CAPACITY_FACTOR, GROWTH_HEADROOM, DEFAULT_CAPACITY_CEILING)
GIB = 2**30


@dataclass(frozen=True)
class Target:
    """The shape the measured loads are applied to."""

    model: str  # family/flavor
    facts: ModelFacts
    gpus: int
    seq_len: int
    local_batch_size: int
    activation_checkpoint: str

    @property
    def tokens(self) -> int:
        """Per rank and dispatch."""
        return self.seq_len * self.local_batch_size

    def rows(self, ep: int, factor: float | None) -> int:
        """Expert-major rows at ``factor`` times the balanced case (None: the worst case)."""
        return expert_major_capacity(self.tokens, self.facts.top_k, ep, self.facts.num_experts // ep,
                                     EXPERT_ALIGN, factor)

    def worst(self, ep: int) -> int:
        return worst_case_capacity(self.tokens, self.facts.top_k, ep, self.facts.num_experts // ep, EXPERT_ALIGN)

    def factor_of(self, ep: int, rows: int) -> float:
        """The factor whose capacity is ``rows`` (the balanced rows' multiple, padding left out)."""
        return (rows - (self.facts.num_experts // ep) * EXPERT_ALIGN) / (self.tokens * self.facts.top_k)

    def gib(self, ep: int, factor: float | None, symm: bool = True) -> float:
        est = estimate(self.facts, world=self.gpus, ep=ep, tp=1, local_batch_size=self.local_batch_size,
                       seq_len=self.seq_len,
                       activation_checkpoint=self.activation_checkpoint, device="cuda", symm=symm,
                       capacity_factor=factor)
        return round(est.total / GIB, 2)


def _config(group: str, name: str) -> dict:
    return yaml.safe_load((REPO / "conf" / group / f"{name}.yaml").read_text())


def target(recipe: str = TARGET_RECIPE) -> Target:
    """The recipe's model, GPUs, tokens per rank and checkpointing."""
    spec = yaml.safe_load((REPO / recipe).read_text())
    groups = {k.removeprefix("override /"): v for d in spec["defaults"] if isinstance(d, dict)
              for k, v in d.items()}
    model, par, training = _config("model", groups["model"]), _config("parallelism", groups["parallelism"]), \
        spec["training"]
    return Target(model=f"{model['family']}/{model['flavor']}", facts=MODELS[model["family"], model["flavor"]],
                  gpus=par["nodes"] * par["procs_per_node"], seq_len=training["seq_len"],
                  local_batch_size=training["local_batch_size"],
                  activation_checkpoint=training.get("activation_checkpoint", "none"))


def read_telemetry(path: Path) -> list[dict]:
    """The steps of a ``routing.jsonl`` (gzipped or not), in step order, one per step (a
    resumed run's repeated steps: the last)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        steps = {line["step"]: line for line in map(json.loads, filter(str.strip, f))}
    return [steps[s] for s in sorted(steps)]


def step_loads(steps: list[dict], ep: int) -> list[float]:
    """Each step's largest load over its MoE layers at EP ``ep``."""
    return [max(step["load"][str(ep)]) for step in steps]


def simulate(loads: list[float], steps: list[int], t: Target, ep: int, factor: float, headroom: float,
             ceiling: float | None) -> dict:
    """``capacity.next_capacity`` over the steps' loads at the target shape."""
    worst, align = t.worst(ep), EXPERT_ALIGN
    capacity = start = t.rows(ep, factor)
    ceiling_rows = t.rows(ep, ceiling)
    replay_steps, spill_steps, peak = [], [], capacity
    for step, load in zip(steps, loads):
        taken = next_capacity(t.rows(ep, load), capacity, ceiling_rows, worst, align, headroom)
        if taken.kind == "grow":
            replay_steps.append(step)
        elif taken.kind == "spill":
            spill_steps.append(step)
        capacity = taken.capacity
        peak = max(peak, capacity)
    return {"replays": len(replay_steps), "last_replay_step": replay_steps[-1] if replay_steps else None,
            "spills": len(spill_steps), "last_spill_step": spill_steps[-1] if spill_steps else None,
            "start_rows": start, "end_rows": capacity, "peak_rows": peak, "worst_rows": worst,
            "end_factor": round(t.factor_of(ep, capacity), 4)}


def sampling_floor(picks: int, top_k: int, experts: int, layers: int, ep: int, steps: int = 200,
                   seed: int = 0) -> float:
    """The mean over ``steps`` simulated steps of the largest load over ``layers`` layers of a
    router that sends each of ``picks / top_k`` tokens to ``top_k`` distinct experts drawn
    uniformly at random."""
    import torch

    from mxfp8_ep.routing_stats import busiest_rank_load

    gen = torch.Generator().manual_seed(seed)
    tokens = picks // top_k
    total = 0.0
    for _ in range(steps):
        ids = torch.rand(layers, tokens, experts, generator=gen).topk(top_k, dim=2).indices
        counts = torch.zeros(layers, experts).scatter_add_(1, ids.view(layers, -1), torch.ones(layers, tokens * top_k))
        total += float(busiest_rank_load(counts, (ep,)).max())
    return round(total / steps, 4)


def study_rows(steps: list[dict], t: Target, grid=GRID, degrees=EP_DEGREES) -> list[dict]:
    numbers = [s["step"] for s in steps]
    picks, layers = steps[0]["picks"][0], len(steps[0]["layers"])
    experts = t.facts.num_experts
    rows = []
    for ep in degrees:
        loads = step_loads(steps, ep)
        floor = sampling_floor(picks, t.facts.top_k, experts, layers, ep)
        nccl = t.gib(ep, None, symm=False)
        for factor, headroom, ceiling in grid:
            sim = simulate(loads, numbers, t, ep, factor, headroom, ceiling)
            rows.append({
                "target": t.model, "gpus": t.gpus, "ep": ep, "tokens_per_rank": t.tokens,
                "capacity_factor": factor, "headroom": headroom, "capacity_ceiling": ceiling,
                "defaults": (factor, headroom, ceiling) == DEFAULTS,
                "steps": len(numbers), "max_load": round(max(loads), 4),
                "max_load_step": numbers[loads.index(max(loads))],
                "max_load_second_half": round(max(loads[len(loads) // 2:]), 4), "sampling_floor": floor, **sim,
                "gib_start": t.gib(ep, factor), "gib_ceiling": t.gib(ep, ceiling),
                "gib_end": t.gib(ep, sim["end_factor"]), "gib_nccl": nccl,
            })
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("telemetry", type=Path, help="a run's routing.jsonl (or .jsonl.gz)")
    parser.add_argument("--out", required=True, help="folder for the rows")
    parser.add_argument("--save-telemetry", type=Path, default=None,
                        help="write the telemetry read, gzipped, here (commit it beside the rows)")
    parser.add_argument("--source", default=None,
                        help="how the telemetry was made (the training command), kept in every row")
    args = parser.parse_args(argv)
    steps = read_telemetry(args.telemetry)
    if not steps:
        parser.error(f"{args.telemetry}: no steps")
    data = "".join(json.dumps(s) + "\n" for s in steps).encode()
    if args.save_telemetry is not None:
        args.save_telemetry.parent.mkdir(parents=True, exist_ok=True)
        args.save_telemetry.write_bytes(gzip.compress(data, mtime=0))
    t = target()
    telemetry = {"telemetry": str(args.save_telemetry or args.telemetry),
                 "telemetry_sha256": hashlib.sha256(data).hexdigest(),
                 "telemetry_source": args.source, "study_picks_per_layer": steps[0]["picks"][0],
                 "study_moe_layers": len(steps[0]["layers"])}
    results = ResultsFile("capacity_study", args.out, machine=this_machine(count=1, link="none"))
    for row in study_rows(steps, t):
        results.write(**row, **telemetry)
    print(f"wrote {results.path}")


if __name__ == "__main__":
    main()
