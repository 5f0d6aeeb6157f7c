"""How the symm transport's activation pool and elastic capacity would behave over a measured
routing, at EP 2, 4, 8, as rows (bench ``capacity_study``).

    python -m benchmarks.capacity_study ROUTING.jsonl[.gz] --out benchmarks/results [--model MODEL] \\
        [--save-telemetry benchmarks/results/telemetry/NAME.routing.jsonl.gz] [--source "COMMAND"] [--extrapolate]

The study first prints what its input is: the steps, the MoE layers, the experts and top-k, and
the model they came from (the conf/model option of the run, from the ``train_config.yaml``
beside a run's ``routing.jsonl``, or ``--model`` for a copy elsewhere). Its verdict is on the
target (DeepSeek-V3 16B at EP=8), so it refuses, before writing anything, an input of fewer than
``MIN_VERDICT_STEPS`` steps (the capacity grows and the routing drifts over the first hundreds),
of an unknown model, of another model family than the target's, or whose layers and experts are
not its model's; ``--extrapolate`` writes the rows and the verdict anyway, saying why they are an
extrapolation.

The input is a run's routing telemetry (``<run dir>/routing.jsonl``, written by
``launch.titan.routing_telemetry``; ``recipes/routing_study_full_cpu.yaml`` makes one): per
training step and MoE layer, the tokens routed to each expert (``counts``) and the busiest
rank's load at EP ``e`` (``load``: its rows over the balanced count). From the counts, per step
and EP degree: each layer's busiest rank's load (``layer_load``: the most rows one layer's
transient needs) and each rank's rows summed over every MoE layer, the busiest rank's sum over
the balanced sum (``rank_sum``: what the activation pool needs). A telemetry without counts
gives no rank sums; its mean over the layers of each layer's busiest load stands in, an upper
bound (rows say ``rank_sum_bound``).

Each step is applied to the target shape, the recipe ``TARGET_RECIPE`` (DeepSeek-V3 16B on one
8-GPU node: its tokens per rank, top-k, experts, MoE layers), at EP ``e`` on the same 8 GPUs,
through the policy (``simulate``): the capacity (one layer's expert-side tensors) starts at a
factor of the balanced case and grows by ``capacity.next_capacity`` (its growth headroom) up to
a ceiling; the activation pool (every MoE layer's kept rows, ``launch.config.memory.pool_rows``)
starts at a pool factor and grows the same way, by ``POOL_GROWTH_HEADROOM``, up to a pool ceiling. A step
that overflows either runs again once (its overflows are read together after the forward):
``replays`` where both grow to fit, ``spills`` where it needs more than a ceiling (it runs
again at exactly its rows). ``reruns_per_1000``: both, per 1,000 steps, the first steps
included. Memory: ``launch/config/memory.py``'s estimate per GPU (selective checkpointing, as
the target recipe) with both at their ceilings (``gib_ceiling``, what the check before launch
holds), where they ended (``gib_end``), and the nccl transport's at an even routing
(``gib_nccl``) and at the run's largest rank sum (``gib_nccl_routed``: the all-to-all keeps the
routed rows too); ``vs_nccl_routed``: ``gib_ceiling`` over it. One ``routing`` row per EP degree
summarises the loads (``max_layer_load``, ``max_rank_sum``, their 99th percentiles, and over the
second half of the steps); ``sampling_floor``: the largest layer load a router that picks its
experts uniformly at random shows at the study's tokens per step (the count's noise: the
target's steps count many more tokens, so it sees less of it).

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
from launch.config.memory import EXPERT_ALIGN, estimate, pool_rows
from launch.config.model_facts import MODELS, ModelFacts
from mxfp8_ep.exchange.capacity import (GROWTH_HEADROOM, POOL_GROWTH_HEADROOM, expert_major_capacity, next_capacity,
                               worst_case_capacity)
from mxfp8_ep.config import (DEFAULT_CAPACITY_CEILING, DEFAULT_CAPACITY_FACTOR, DEFAULT_POOL_CEILING,
                             DEFAULT_POOL_FACTOR)

TARGET_RECIPE = "recipes/dsv3_16b_ep8_bf16_vs_mxfp8.yaml"
# The fewest steps of an input whose verdict on the target is given without --extrapolate.
MIN_VERDICT_STEPS = 1000
EP_DEGREES = (2, 4, 8)


@dataclass(frozen=True)
class Policy:
    """Where the capacity and the pool start and the most they grow to, as multiples of their
    balanced cases (``capacity_ceiling=None``: the worst case)."""

    capacity_factor: float
    capacity_ceiling: float | None
    pool_factor: float
    pool_ceiling: float


# The policies simulated: capacity start x ceiling x pool start x pool ceiling.
GRID = tuple(Policy(c, cc, p, pc) for c in (1.25, 2.0) for cc in (2.0, 3.0, 4.0, 5.0, 6.0, None)
             for p in (1.1, 1.25, 1.4) for pc in (1.3, 1.4, 1.5, 1.6, 1.8, 2.0)
             if (cc is None or cc >= c) and pc >= p)
DEFAULTS = Policy(DEFAULT_CAPACITY_FACTOR, DEFAULT_CAPACITY_CEILING, DEFAULT_POOL_FACTOR, DEFAULT_POOL_CEILING)
GIB = 2**30
# What the defaults must meet at EP=8 (the target recipe's degree): reruns per 1,000 steps, the
# first steps included, and the estimate per GPU at both ceilings over nccl's on the same routing.
TARGET_EP = 8
TARGET_RERUNS_PER_1000 = 10
TARGET_VS_NCCL_ROUTED = 1.10


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

    def pool(self, ep: int, factor: float) -> int:
        """The pool's rows at ``factor`` times the balanced rows of every MoE layer."""
        return pool_rows(self.facts, self.tokens, ep, factor)

    def factor_of(self, ep: int, rows: int) -> float:
        """The factor whose capacity is ``rows`` (the balanced rows' multiple, padding left out)."""
        return (rows - (self.facts.num_experts // ep) * EXPERT_ALIGN) / (self.tokens * self.facts.top_k)

    def pool_factor_of(self, ep: int, rows: int) -> float:
        """The factor whose pool is ``rows`` (as ``factor_of``, per MoE layer)."""
        return self.factor_of(ep, rows // self.facts.n_moe_layers)

    def gib(self, ep: int, capacity: float | None, pool: float | None = None, symm: bool = True,
            routed_load: float = 1.0) -> float:
        est = estimate(self.facts, world=self.gpus, ep=ep, tp=1, local_batch_size=self.local_batch_size,
                       seq_len=self.seq_len, activation_checkpoint=self.activation_checkpoint, device="cuda",
                       symm=symm, capacity_factor=capacity, pool_factor=pool, routed_load=routed_load)
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


def rank_loads(counts: list[list[int]], ep: int) -> list[list[float]]:
    """Per MoE layer, each of ``ep`` ranks' rows (its block of consecutive experts) over the
    layer's balanced count."""
    out = []
    for layer in counts:
        block, total = len(layer) // ep, sum(layer)
        out.append([ep * sum(layer[r * block:(r + 1) * block]) / total if total else 0.0 for r in range(ep)])
    return out


@dataclass(frozen=True)
class StepLoads:
    """One step at one EP degree: each layer's busiest rank's load and the busiest rank's sum
    over the layers over the balanced sum (``bound``: the mean of the layers' busiest loads,
    from a telemetry without counts, an upper bound of it)."""

    step: int
    layer_loads: tuple[float, ...]
    rank_sum: float
    bound: bool

    @property
    def layer_load(self) -> float:
        return max(self.layer_loads)


def step_loads(steps: list[dict], ep: int) -> list[StepLoads]:
    """Each step's loads at EP ``ep``."""
    out = []
    for s in steps:
        if "counts" in s:
            per_rank = rank_loads(s["counts"], ep)
            layers = tuple(max(r) for r in per_rank)
            ranks = [sum(col) for col in zip(*per_rank)]
            out.append(StepLoads(s["step"], layers, max(ranks) / len(per_rank), False))
        else:
            layers = tuple(s["load"][str(ep)])
            out.append(StepLoads(s["step"], layers, sum(layers) / len(layers), True))
    return out


def simulate(loads: list[StepLoads], t: Target, ep: int, policy: Policy, headroom: float = GROWTH_HEADROOM,
             pool_headroom: float = POOL_GROWTH_HEADROOM) -> dict:
    """The policy over the steps' loads at the target shape: the capacity and the pool, each by
    ``capacity.next_capacity``; a step reruns once when either overflows. The run's first step
    reruns in any case: the pool learns there how many layers it holds
    (``mxfp8_ep.pool.activation_pool``)."""
    worst, align = t.worst(ep), EXPERT_ALIGN
    capacity = start = t.rows(ep, policy.capacity_factor)
    ceiling = t.rows(ep, policy.capacity_ceiling)
    pool = pool_start = t.pool(ep, policy.pool_factor)
    pool_ceiling, pool_worst = t.pool(ep, policy.pool_ceiling), t.pool(ep, ep)
    replays, spills, pool_spills, peak, pool_peak = [], [], [], capacity, pool
    for s in loads:
        took = next_capacity(t.rows(ep, s.layer_load), capacity, ceiling, worst, align, headroom)
        pool_took = next_capacity(t.pool(ep, s.rank_sum), pool, pool_ceiling, pool_worst, 1, pool_headroom)
        if "spill" in (took.kind, pool_took.kind):
            spills.append(s.step)
            if pool_took.kind == "spill":
                pool_spills.append(s.step)
        elif "grow" in (took.kind, pool_took.kind) or s is loads[0]:
            replays.append(s.step)
        capacity, pool = took.capacity, pool_took.capacity
        peak, pool_peak = max(peak, capacity), max(pool_peak, pool)
    reruns = sorted(replays + spills)
    return {"replays": len(replays), "spills": len(spills), "pool_spills": len(pool_spills),
            "reruns": len(reruns), "reruns_per_1000": round(1000 * len(reruns) / len(loads), 2),
            "reruns_first_100": sum(step <= loads[0].step + 99 for step in reruns),
            "last_rerun_step": reruns[-1] if reruns else None,
            "start_rows": start, "end_rows": capacity, "peak_rows": peak, "worst_rows": worst,
            "end_factor": round(t.factor_of(ep, capacity), 4),
            "pool_start_rows": pool_start, "pool_end_rows": pool, "pool_peak_rows": pool_peak,
            "pool_end_factor": round(t.pool_factor_of(ep, pool), 3)}


def sampling_floor(picks: int, top_k: int, experts: int, layers: int, ep: int, steps: int = 200,
                   seed: int = 0) -> float:
    """The mean over ``steps`` simulated steps of the largest load over ``layers`` layers of a
    router that sends each of ``picks / top_k`` tokens to ``top_k`` distinct experts drawn
    uniformly at random."""
    import torch

    from mxfp8_ep.telemetry.routing_stats import busiest_rank_load

    gen = torch.Generator().manual_seed(seed)
    tokens = picks // top_k
    total = 0.0
    for _ in range(steps):
        ids = torch.rand(layers, tokens, experts, generator=gen).topk(top_k, dim=2).indices
        counts = torch.zeros(layers, experts).scatter_add_(1, ids.view(layers, -1), torch.ones(layers, tokens * top_k))
        total += float(busiest_rank_load(counts, (ep,)).max())
    return round(total / steps, 4)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def routing_row(loads: list[StepLoads], t: Target, ep: int, picks: int, layers: int) -> dict:
    """The loads at EP ``ep`` in one row."""
    layer, ranks = [s.layer_load for s in loads], [s.rank_sum for s in loads]
    half = len(loads) // 2
    worst = max(loads, key=lambda s: s.rank_sum)
    return {"kind": "routing", "target": t.model, "gpus": t.gpus, "ep": ep, "steps": len(loads),
            "max_layer_load": round(max(layer), 4), "max_layer_load_step": loads[layer.index(max(layer))].step,
            "p99_layer_load": _percentile(layer, 0.99), "max_layer_load_second_half": round(max(layer[half:]), 4),
            "max_rank_sum": round(worst.rank_sum, 4), "max_rank_sum_step": worst.step,
            "p99_rank_sum": _percentile(ranks, 0.99), "max_rank_sum_second_half": round(max(ranks[half:]), 4),
            "mean_layer_load_at_max_rank_sum": round(sum(worst.layer_loads) / len(worst.layer_loads), 4),
            "rank_sum_bound": any(s.bound for s in loads),
            "sampling_floor": sampling_floor(picks, t.facts.top_k, t.facts.num_experts, layers, ep)}


def study_rows(steps: list[dict], t: Target, grid=GRID, degrees=EP_DEGREES) -> list[dict]:
    picks, layers = steps[0]["picks"][0], len(steps[0]["layers"])
    rows = []
    for ep in degrees:
        loads = step_loads(steps, ep)
        routing = routing_row(loads, t, ep, picks, layers)
        rows.append(routing)
        nccl = t.gib(ep, None, symm=False)
        nccl_routed = t.gib(ep, None, symm=False, routed_load=max(1.0, routing["max_rank_sum"]))
        policies = grid if DEFAULTS in grid else (*grid, DEFAULTS)
        for policy in policies:
            sim = simulate(loads, t, ep, policy)
            ceiling = t.gib(ep, policy.capacity_ceiling, policy.pool_ceiling)
            rows.append({
                "kind": "policy", "target": t.model, "gpus": t.gpus, "ep": ep, "tokens_per_rank": t.tokens,
                "moe_layers": t.facts.n_moe_layers, "activation_checkpoint": t.activation_checkpoint,
                "capacity_factor": policy.capacity_factor, "headroom": GROWTH_HEADROOM,
                "capacity_ceiling": policy.capacity_ceiling, "pool_factor": policy.pool_factor,
                "pool_headroom": POOL_GROWTH_HEADROOM, "pool_ceiling": policy.pool_ceiling,
                "defaults": policy == DEFAULTS, "steps": len(loads), **sim,
                "gib_start": t.gib(ep, policy.capacity_factor, policy.pool_factor), "gib_ceiling": ceiling,
                "gib_end": t.gib(ep, sim["end_factor"], sim["pool_end_factor"]),
                "gib_nccl": nccl, "gib_nccl_routed": nccl_routed, "vs_nccl": round(ceiling / nccl, 4),
                "vs_nccl_routed": round(ceiling / nccl_routed, 4),
            })
    return rows


def meets_target(row: dict) -> bool:
    return row["reruns_per_1000"] <= TARGET_RERUNS_PER_1000 and row["vs_nccl_routed"] <= TARGET_VS_NCCL_ROUTED


def verdict(rows: list[dict]) -> list[str]:
    """Lines saying how the defaults do at each EP degree, whether they meet the target at
    ``TARGET_EP``, and the simulated policy of least memory there that does."""
    policies = [r for r in rows if r.get("kind") == "policy"]
    lines = [f"EP={r['ep']} defaults: {r['reruns_per_1000']:g} reruns per 1,000 steps ({r['replays']} replays, "
             f"{r['spills']} spills), {r['gib_ceiling']:.1f} GiB per GPU at the ceilings = "
             f"{r['vs_nccl_routed']:.3f}x nccl on the same routing ({r['gib_nccl_routed']:.1f}; balanced "
             f"{r['gib_nccl']:.1f})" for r in policies if r["defaults"]]
    at = [r for r in policies if r["ep"] == TARGET_EP]
    default = next((r for r in at if r["defaults"]), None)
    if default is not None:
        lines.append(f"EP={TARGET_EP} target (<= {TARGET_RERUNS_PER_1000} reruns per 1,000 steps, <= "
                     f"{TARGET_VS_NCCL_ROUTED}x nccl on the same routing): "
                     f"{'met' if meets_target(default) else 'NOT met'} at the defaults")
    fitting = sorted((r for r in at if meets_target(r)), key=lambda r: (r["gib_ceiling"], r["reruns"]))
    if fitting:
        b = fitting[0]
        lines.append(f"least memory meeting it: capacity_factor={b['capacity_factor']} capacity_ceiling="
                     f"{b['capacity_ceiling']} pool_factor={b['pool_factor']} pool_ceiling={b['pool_ceiling']} "
                     f"({b['reruns_per_1000']:g} reruns per 1,000 steps, {b['gib_ceiling']:.1f} GiB)")
    return lines


@dataclass(frozen=True)
class Source:
    """What a telemetry's steps came from: its steps and their range, its MoE layers and experts
    (the lines'), the model (a conf/model option; None where not known) and where that was read."""

    steps: int
    first_step: int
    last_step: int
    moe_layers: int
    experts: int
    model: str | None = None
    family: str | None = None
    flavor: str | None = None
    facts: ModelFacts | None = None
    where: str = ""

    @property
    def top_k(self) -> int | None:
        return self.facts.top_k if self.facts is not None else None

    def line(self) -> str:
        """``input: 1,500 steps (1-1500) of model=... (deepseek_v3/..., 26 MoE layers, 64 experts, top-6; ...)``."""
        model = (f"model={self.model} ({self.family}/{self.flavor}, {self.moe_layers} MoE layers, "
                 f"{self.experts} experts, top-{self.top_k}; {self.where})" if self.model else
                 f"an unknown model ({self.moe_layers} MoE layers, {self.experts} experts, top-k unknown: no "
                 f"train_config.yaml beside the telemetry and no --model)")
        return f"input: {self.steps:,} steps ({self.first_step}-{self.last_step}) of {model}"


def source_of(telemetry: Path, steps: list[dict], model: str | None = None) -> Source:
    """The ``Source`` of ``steps`` read from ``telemetry``: the model ``--model`` names, else the
    one in the ``train_config.yaml`` of the run folder the telemetry is in."""
    where = "--model"
    if model is None:
        config = telemetry.parent / "train_config.yaml"
        if config.is_file():
            model, where = (yaml.safe_load(config.read_text()) or {}).get("model", {}).get("name"), str(config)
    base = dict(steps=len(steps), first_step=steps[0]["step"], last_step=steps[-1]["step"],
                moe_layers=len(steps[0]["layers"]), experts=len(steps[0]["counts"][0]) if "counts" in steps[0] else 0)
    if model is None:
        return Source(**base)
    spec = _config("model", model)
    return Source(**base, model=model, family=spec["family"], flavor=spec["flavor"],
                  facts=MODELS.get((spec["family"], spec["flavor"])), where=where)


def extrapolation(src: Source, t: Target) -> list[str]:
    """Why a verdict on the target from ``src`` would be an extrapolation (empty: it is not)."""
    family = t.model.split("/")[0]
    found = []
    if src.steps < MIN_VERDICT_STEPS:
        found.append(f"{src.steps:,} steps, fewer than the {MIN_VERDICT_STEPS:,} a verdict takes (the capacity "
                     f"grows and the routing drifts over the first hundreds)")
    if src.model is None:
        found.append("the model is unknown (pass --model <the conf/model option the run trained>)")
    elif src.family != family:
        found.append(f"model={src.model} is {src.family}, not the target's family ({family}: {t.model})")
    elif src.facts is not None and (src.facts.n_moe_layers, src.facts.num_experts) != (
            src.moe_layers, src.experts or src.facts.num_experts):
        found.append(f"its {src.moe_layers} MoE layers and {src.experts} experts are not model={src.model}'s "
                     f"({src.facts.n_moe_layers}, {src.facts.num_experts})")
    return found


def telemetry_arguments(parser: argparse.ArgumentParser, extrapolate_help: str) -> None:
    """The options every study of a routing telemetry takes: its file, the rows' folder, how it
    was made, its model, and leave to extrapolate."""
    parser.add_argument("telemetry", type=Path, help="a run's routing.jsonl (or .jsonl.gz) with per-expert counts")
    parser.add_argument("--out", required=True, help="folder for the rows")
    parser.add_argument("--source", default=None,
                        help="how the telemetry was made (the training command), kept in every row")
    models = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    parser.add_argument("--model", default=None, choices=models, metavar="MODEL",
                        help="the conf/model option the telemetry's run trained (default: the one in the "
                             "train_config.yaml beside it)")
    parser.add_argument("--extrapolate", action="store_true", help=extrapolate_help)


def refuse_extrapolation(parser: argparse.ArgumentParser, why: list[str], subject: str, model: str) -> None:
    """A parser error where a verdict on ``subject`` would be an extrapolation (``why``)."""
    if why:
        parser.error(f"a verdict on {subject} from this input would be an extrapolation: "
                     f"{'; '.join(why)}. Use a longer run of a {model.split('/')[0]} model "
                     f"(recipes/routing_study_full_cpu.yaml), or --extrapolate to write it anyway")


def telemetry_bytes(steps: list[dict]) -> bytes:
    """The telemetry as the rows' ``telemetry_sha256`` hashes it (one JSON line per step)."""
    return "".join(json.dumps(s) + "\n" for s in steps).encode()


def write_study(results: ResultsFile, rows: list[dict], telemetry: dict, why: list[str], lines: list[str]) -> None:
    """Every row with the telemetry's fields, then where they went, the extrapolation if any and
    the verdict ``lines``."""
    for row in rows:
        results.write(**row, **telemetry)
    print(f"wrote {results.path}")
    if why:
        print(f"extrapolated (--extrapolate): {'; '.join(why)}")
    print("\n".join(lines))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    telemetry_arguments(parser, f"write rows and a verdict on the target from fewer than {MIN_VERDICT_STEPS:,} "
                                f"steps, an unknown model or another family's")
    parser.add_argument("--save-telemetry", type=Path, default=None,
                        help="write the telemetry read, gzipped, here (commit it beside the rows)")
    args = parser.parse_args(argv)
    steps = read_telemetry(args.telemetry)
    if not steps:
        parser.error(f"{args.telemetry}: no steps")
    t = target()
    src = source_of(args.telemetry, steps, args.model)
    print(src.line())
    why = extrapolation(src, t)
    if not args.extrapolate:
        refuse_extrapolation(parser, why, f"{t.model} at EP={TARGET_EP}", t.model)
    data = telemetry_bytes(steps)
    if args.save_telemetry is not None:
        args.save_telemetry.parent.mkdir(parents=True, exist_ok=True)
        args.save_telemetry.write_bytes(gzip.compress(data, mtime=0))
    telemetry = {"telemetry": str(args.save_telemetry or args.telemetry),
                 "telemetry_sha256": hashlib.sha256(data).hexdigest(),
                 "telemetry_source": args.source, "study_picks_per_layer": steps[0]["picks"][0],
                 "study_moe_layers": len(steps[0]["layers"]), "study_model": src.model, "study_top_k": src.top_k}
    results = ResultsFile("capacity_study", args.out, machine=this_machine(count=1, link="none"))
    rows = study_rows(steps, t)
    write_study(results, rows, telemetry, why, verdict(rows))


if __name__ == "__main__":
    main()
