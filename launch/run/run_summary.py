"""One run's result: what the runner writes, the console prints and ``compare_runs`` reads.

Rank 0 of every run writes ``<run dir>/summary.json`` at the end (also when stopped by a
signal), locally and inside SLURM jobs alike. The headline numbers are totals over the steady
log windows (every window after the first: lazy init, compile and warm-up left out) divided by
their total time or total steps (:func:`steady_numbers`): tokens/s is the steady windows' tokens
over their seconds, the step time their seconds over their steps, so tokens/s x step time is the
tokens of one step. The runner writes the same numbers into the wandb run's summary under the
metric names below, so the console, ``summary.json`` and wandb agree; the logged series stay
one value per window. A run without ``summary.json`` (a job killed before it could write one)
is read back from its offline wandb run(s) with :meth:`RunSummary.from_wandb`, through the
same names and the same sums.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from launch.run.provenance import recipe_commit, utc_now
from launch.run.run_dir import SUMMARY
from launch.run.shared_gpu import gpu_shared
from mxfp8_ep.config import LEGS, NUMERICS_STATS  # noqa: F401  (NUMERICS_STATS: read by compare_runs)

# wandb metric names (torchtitan's where it has one, so dashboards match stock runs).
LOSS = "loss_metrics/global_avg_loss"
TOKENS_PER_S = "throughput(tps)"
TOKENS_PER_S_GLOBAL = "throughput/global_tps"
STEP_TIME = "time_metrics/end_to_end(s)"
A2A_BYTES = "a2a/bytes_per_step"
TFLOPS = "tflops"
MFU = "mfu(%)"
MAX_MEMORY = "memory/max_reserved(GiB)"
VAL_LOSS = "val/loss"  # mean loss per token on the validation batches (launch.titan.validation)
# The symm transport's elastic capacity (mxfp8_ep.elastic): the largest expert-major capacity
# (rows) after the window, the steps run again after an overflow since the run started, and of
# those the ones that needed more than the ceiling (spills: rerun at exactly their rows).
A2A_CAPACITY_ROWS = "a2a/capacity_rows"
A2A_REPLAYS = "a2a/replays"
A2A_SPILLS = "a2a/spills"
# The routing telemetry (launch.titan.routing_telemetry): rows the busiest rank would receive at
# EP degree e over the balanced count, the largest of a log window's steps and MoE layers.
IMBALANCE_PREFIX = "moe/imbalance_ep"
# The a2a preset every other one is compared with (compare_runs, the wandb dashboard):
# torchtitan's own all-to-all.
BASELINE = "bf16"
# The wandb config key the runner logs the composed recipe config under (so its a2a preset is
# config "recipe.a2a.name").
RECIPE_CONFIG = "recipe"

# MXFP8 numerics telemetry (logging.numerics_every, launch.run.numerics_log): per MoE layer, all-to-all
# leg (mxfp8_ep.config.LEGS) and statistic (NUMERICS_STATS, defined in mxfp8_ep.telemetry.numerics),
# "numerics/layer<i>/<leg>/<stat>" (i: torchtitan's block index), and model-wide
# "numerics/<leg>/<stat>". RunSummary keeps summary statistics of each (numerics); compare_runs
# sums them up per run.
NUMERICS_PREFIX = "numerics/"

# RunSummary field <- the wandb metric logged once per log window that it sums up. A rate (per
# second) is the steady windows' total over their total seconds, so each window's value counts
# with its seconds; a per-step figure is their total over their total steps, so each window's
# value counts with its steps.
PER_SECOND = {
    "tokens_per_s": TOKENS_PER_S,
    "tokens_per_s_global": TOKENS_PER_S_GLOBAL,
    "tflops": TFLOPS,
    "mfu_pct": MFU,
}
PER_STEP = {
    "step_time_s": STEP_TIME,
    "a2a_bytes_per_step": A2A_BYTES,
}
WINDOW_STEPS = "steps"  # a log window's number of steps, beside its metrics (steady_numbers)


def a2a_leg_metric(leg: str) -> str:
    """wandb metric of one all-to-all leg's bytes per step (``leg``: a ``WIRE_PARTS`` name)."""
    return f"a2a/{leg}_bytes_per_step"


# The part of the bytes that crossed between nodes (the two_hop transport's node hop;
# ``mxfp8_ep.telemetry.wire_stats.inter_node_key``): of each leg, ``inter_node_part(leg)``, and
# of all of them, ``INTER_NODE``. Each is inside its leg's count and the total already.
INTER_NODE = "inter_node"


def inter_node_part(leg: str) -> str:
    """The ``WIRE_PARTS`` name of ``leg``'s bytes that crossed between nodes."""
    return f"{leg}_{INTER_NODE}"


# The parts of the all-to-all bytes the metrics log (``a2a_leg_metric``) and RunSummary keeps
# (``a2a_bytes_per_step_by_leg``): the legs, ``other`` (a leg the library may add), each leg's
# inter-node part and their sum.
WIRE_PARTS = LEGS + ("other",) + tuple(inter_node_part(leg) for leg in LEGS) + (INTER_NODE,)


def imbalance_metric(ep: int) -> str:
    """wandb metric of the routing's load at EP degree ``ep`` (its run maximum: ``..._max``)."""
    return f"{IMBALANCE_PREFIX}{ep}"


def numerics_metric(leg: str, stat: str, layer: Optional[int] = None) -> str:
    """wandb name of a numerics statistic of one leg: of MoE block ``layer``, or model-wide."""
    return f"{NUMERICS_PREFIX}{'' if layer is None else f'layer{layer}/'}{leg}/{stat}"


def parse_numerics_metric(name: str) -> Optional[tuple[Optional[int], str, str]]:
    """(layer or None for model-wide, leg, stat) of a :func:`numerics_metric` name; None for
    other names."""
    if not name.startswith(NUMERICS_PREFIX):
        return None
    parts = name[len(NUMERICS_PREFIX):].split("/")
    if len(parts) == 2:
        return None, parts[0], parts[1]
    if len(parts) == 3 and parts[0].startswith("layer") and parts[0][len("layer"):].isdigit():
        return int(parts[0][len("layer"):]), parts[1], parts[2]
    return None


# The metrics whose wandb run summary is RunSummary's number (set at the end of the run)
# rather than wandb's default, the last logged value.
LEG_METRICS = {part: a2a_leg_metric(part) for part in WIRE_PARTS}
SUMMARY_METRICS = tuple(PER_SECOND.values()) + tuple(PER_STEP.values()) + tuple(LEG_METRICS.values())


def _finite(x: Any) -> Optional[float]:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def series_stats(values: list[Any]) -> dict[str, float]:
    """``n``, ``mean``, ``min``, ``max`` and ``last`` of the finite values (empty when none)."""
    vals = [v for v in (_finite(x) for x in values) if v is not None]
    if not vals:
        return {}
    return {"n": len(vals), "mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals),
            "last": vals[-1]}


def numerics_from_wandb(run: Any) -> dict[str, dict[str, float]]:
    """``series_stats`` of every numerics metric in an offline wandb run's history."""
    keys = sorted({k for row in run.history for k in row if k.startswith(NUMERICS_PREFIX)})
    return {k: series_stats(run.series(k)) for k in keys}


def ratio_of_sums(pairs: list[tuple[Any, Any]]) -> Optional[float]:
    """sum(value x weight) / sum(weight) over the pairs with a finite value and a positive
    weight; None when there is none."""
    kept = [(v, w) for v, w in ((_finite(v), _finite(w)) for v, w in pairs)
            if v is not None and w is not None and w > 0]
    total = sum(w for _, w in kept)
    return sum(v * w for v, w in kept) / total if kept else None


def steady_numbers(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """RunSummary's headline fields from a run's log windows, in step order: each window a dict of
    its ``WINDOW_STEPS`` and the metrics logged for it (``PER_SECOND``, ``PER_STEP``,
    ``LEG_METRICS``; absent ones are left out, e.g. TFLOPS on CPU).

    Only the steady windows count: all but the first (compile, allocator and wandb warm-up),
    or the one window a run has. A window's seconds are its step time x its steps; a rate is
    sum(rate x seconds) / sum(seconds) (tokens over time), a per-step figure sum(value x steps)
    / sum(steps) (so the step time is seconds over steps). Also ``steady_steps``, the steps
    they cover."""
    steady = windows[1:] if len(windows) > 1 else windows
    steps = [w.get(WINDOW_STEPS) for w in steady]
    seconds = [None if w.get(STEP_TIME) is None or n is None else w[STEP_TIME] * n
               for w, n in zip(steady, steps)]
    out: dict[str, Any] = {
        name: ratio_of_sums([(w.get(metric), s) for w, s in zip(steady, seconds)])
        for name, metric in PER_SECOND.items()}
    out.update({name: ratio_of_sums([(w.get(metric), n) for w, n in zip(steady, steps)])
                for name, metric in PER_STEP.items()})
    by_leg = {leg: ratio_of_sums([(w.get(metric), n) for w, n in zip(steady, steps)])
              for leg, metric in LEG_METRICS.items()}
    out["a2a_bytes_per_step_by_leg"] = {leg: v for leg, v in by_leg.items() if v is not None}
    out["steady_steps"] = int(sum(n for n, s in zip(steps, seconds) if s is not None)) or None
    return out


def counted_steps(rows: list[dict[str, Any]], counter: str) -> list[int]:
    """The steps a run's count (``a2a/replays``, ``a2a/spills``: a total each log row carries)
    grew at, a step once per count, from the training rows of a wandb history (``_step`` order).
    A row's growth is put at its own step: exact with ``logging.log_freq=1`` (the default) for
    training steps; a replay of a validation batch shows in the next step's row."""
    steps: list[int] = []
    last = 0
    for row in rows:
        if counter in row:
            value = int(row[counter])
            steps += [int(row["_step"])] * max(0, value - last)
            last = value
    return steps


def windows_from_history(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``steady_numbers``' windows from the training rows of a wandb history (``_step`` order):
    a window's steps are its ``_step`` less the row before's (the first row's: its ``_step``)."""
    windows, last = [], 0
    for row in rows:
        step = int(row["_step"])
        windows.append({WINDOW_STEPS: step - last, **row})
        last = step
    return windows


def recipe_provenance() -> dict[str, Any]:
    """RunSummary's ``commit``, ``dirty`` and ``dirty_reason`` of the recipe this process runs."""
    commit, dirty, why = recipe_commit()
    return {"commit": commit, "dirty": dirty, "dirty_reason": why}


@dataclass
class RunSummary:
    # what ran
    run_name: str
    experiment: str
    a2a: str
    a2a_legs: dict[str, str]
    model: str  # config option, e.g. tiny_llama4
    model_flavor: str  # torchtitan family/flavor
    parallelism: str
    world_size: int
    ep: int
    launcher: str
    device: str  # "cpu" | "cuda"
    run_dir: str
    # how far it got
    steps: int  # last step trained
    target_steps: int
    # the ranks shared one GPU (parallelism.share_gpu, launch.run.shared_gpu): no speed figure
    gpu_shared: bool = False
    # the transport the EP layers ran (``a2a.transport`` as the dispatcher resolves it on the run's
    # device and layout: ``auto`` named as what it picked); None: no EP exchange (EP 1), or not known
    transport: Optional[str] = None
    start_step: int = 0  # the checkpoint step this launch resumed from
    stopped_by: Optional[str] = None  # "SIGINT" / "SIGTERM" / "SIGUSR2" when stopped early
    checkpoint: Optional[str] = None  # newest checkpoint folder, when checkpointing is on
    seed: Optional[int] = None  # training.seed
    # every logged step of the run (earlier launches of a resumed run included)
    logged_steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    # every validation of the run (training.val_every), same convention
    val_logged_steps: list[int] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    # headline numbers of this launch (steady_numbers: totals over the steady windows' seconds
    # or steps); None where they mean nothing (TFLOPS and MFU on CPU) or were not measured
    final_loss: Optional[float] = None
    final_val_loss: Optional[float] = None
    tokens_per_s: Optional[float] = None  # per rank
    tokens_per_s_global: Optional[float] = None
    step_time_s: Optional[float] = None
    a2a_bytes_per_step: Optional[float] = None
    # per WIRE_PARTS name: each leg, other, each leg's inter-node part and their sum (parts of the
    # legs' counts, never added to them)
    a2a_bytes_per_step_by_leg: dict[str, float] = field(default_factory=dict)
    tflops: Optional[float] = None
    mfu_pct: Optional[float] = None
    max_memory_gib: Optional[float] = None
    steady_steps: Optional[int] = None  # the steps the headline numbers cover
    # numerics telemetry of this launch: metric name -> series_stats of its samples
    numerics: dict[str, dict[str, float]] = field(default_factory=dict)
    # the symm transport's elastic capacity (earlier launches of a resumed run included): steps
    # run again after an overflow and at which steps, those of them that needed more than the
    # ceiling (spills) and at which steps, the largest capacity at the end (rows) and the ceiling
    # it grows to (rows; the worst case when it has none below it)
    capacity_replays: int = 0
    capacity_replay_steps: list[int] = field(default_factory=list)
    capacity_spills: int = 0
    capacity_spill_steps: list[int] = field(default_factory=list)
    capacity_rows: Optional[int] = None
    capacity_ceiling_rows: Optional[int] = None
    # routing telemetry of this launch, per EP degree "ep<e>": the largest load (busiest rank's
    # rows over the balanced count, any step and MoE layer), its step, the last log window's
    moe_imbalance: dict[str, dict[str, float]] = field(default_factory=dict)
    # the versions it trained with: torchtitan, torch, triton (launch.config.stack)
    stack: dict[str, Optional[str]] = field(default_factory=dict)
    # wandb
    wandb_mode: str = "disabled"
    wandb_run_id: Optional[str] = None
    wandb_dirs: list[str] = field(default_factory=list)
    # how the run's latest launch ended, in the launching process's or the SLURM job's words
    # ("completed step 20/20", "stopped by SIGINT at step 7/20 (checkpoint step-7)", "failed: rank
    # 1 failed: ..."); None when nobody could say (a job killed outright)
    ended: Optional[str] = None
    # where the numbers come from (launch.run.provenance), this launch's: the recipe's commit and
    # whether its tracked files differed from it (None: it could not be told, dirty_reason says
    # why), when it started and ended (UTC), the hosts its ranks ran on, the GPU model ("cpu"
    # without one) and the GPUs (or CPU processes) it used
    commit: Optional[str] = None
    dirty: Optional[bool] = None
    dirty_reason: Optional[str] = None
    started_at: Optional[str] = None
    ended_at: Optional[str] = None
    hosts: list[str] = field(default_factory=list)
    gpu: Optional[str] = None
    gpu_count: Optional[int] = None

    def record_end(self, how: str) -> None:
        """How the launch ended (``ended``) and when (``ended_at``)."""
        self.ended = how
        self.ended_at = utc_now()

    # ------------------------------------------------------------------------------ files
    def write(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / SUMMARY
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        os.replace(tmp, path)  # readers never see half a file
        return path

    @classmethod
    def read(cls, path: str | Path) -> Optional["RunSummary"]:
        """From a run dir or a summary.json; None when there is none (or one this class
        cannot read, e.g. written by an older version)."""
        path = Path(path)
        if path.is_dir():
            path = path / SUMMARY
        if not path.is_file():
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in json.loads(path.read_text()).items() if k in known})
        except (TypeError, ValueError):
            return None

    @classmethod
    def before_training(cls, cfg: Any, run_dir: str | Path, start_step: int = 0) -> "RunSummary":
        """The summary of a launch that trained nothing it could record (it failed before rank 0
        wrote one): what ran, from its config, at the step it started from."""
        p = cfg.parallelism
        return cls(run_name=str(cfg.logging.run_name or cfg.experiment), experiment=str(cfg.experiment),
                   a2a=str(cfg.a2a.name), a2a_legs={k: str(v) for k, v in cfg.a2a.items() if k != "name"},
                   model=str(cfg.model.name), model_flavor=f"{cfg.model.family}/{cfg.model.flavor}",
                   parallelism=str(p.name), world_size=int(p.procs_per_node) * max(1, int(p.nodes)),
                   ep=int(p.ep), launcher=str(cfg.launcher.name), device="unknown",
                   run_dir=os.path.abspath(run_dir), steps=start_step, target_steps=int(cfg.training.steps),
                   start_step=start_step, seed=int(cfg.training.seed),
                   wandb_mode=str(cfg.logging.wandb_mode), wandb_run_id=cfg.logging.run_id,
                   **recipe_provenance())

    def wandb_summary(self) -> dict[str, float]:
        """The headline numbers under their wandb metric names (for the wandb run summary)."""
        out = {metric: getattr(self, name) for name, metric in {**PER_SECOND, **PER_STEP}.items()}
        out[LOSS] = self.final_loss
        out[VAL_LOSS] = self.final_val_loss
        out[A2A_REPLAYS] = self.capacity_replays if self.capacity_rows is not None else None
        out[A2A_SPILLS] = self.capacity_spills if self.capacity_rows is not None else None
        out[A2A_CAPACITY_ROWS] = self.capacity_rows
        out.update({a2a_leg_metric(leg): v for leg, v in self.a2a_bytes_per_step_by_leg.items()})
        for degree, load in self.moe_imbalance.items():
            metric = imbalance_metric(int(degree.removeprefix("ep")))
            out.update({metric: load["last"], f"{metric}_max": load["max"]})
        return {k: v for k, v in out.items() if v is not None}

    # ------------------------------------------------------------------------------ wandb
    @classmethod
    def from_wandb(cls, run: Any, recipe: dict[str, Any], path: str) -> "RunSummary":
        """From an offline wandb run (``launch.run.wandb_offline.OfflineRun``, attempts merged)
        and the recipe config it logged."""
        par = recipe.get("parallelism", {})
        model = recipe.get("model", {})
        a2a = recipe.get("a2a", {})
        rows = [row for row in run.history if LOSS in row]
        losses = [float(row[LOSS]) for row in rows]
        val_rows = [row for row in run.history if VAL_LOSS in row]
        val_losses = [float(row[VAL_LOSS]) for row in val_rows]
        world_size = par.get("nodes", 0) * par.get("procs_per_node", 0)
        device = str(run.config.get("device", "?"))
        replay_steps, spill_steps = counted_steps(rows, A2A_REPLAYS), counted_steps(rows, A2A_SPILLS)
        capacity = [row[A2A_CAPACITY_ROWS] for row in rows if A2A_CAPACITY_ROWS in row]
        return cls(
            run_name=run.name or os.path.basename(path),
            experiment=recipe.get("experiment", run.group),
            a2a=a2a.get("name", "?"),
            a2a_legs={k: v for k, v in a2a.items() if k != "name"},
            model=model.get("name", "?"),
            model_flavor=f"{model.get('family', '?')}/{model.get('flavor', '?')}",
            parallelism=par.get("name", "?"),
            world_size=world_size,
            ep=par.get("ep", 0),
            launcher=recipe.get("launcher", {}).get("name", "?"),
            device=device,
            gpu_shared=gpu_shared(par.get("share_gpu", False), device, world_size),
            run_dir=path,
            steps=int(rows[-1]["_step"]) if rows else 0,
            target_steps=recipe.get("training", {}).get("steps", 0),
            seed=recipe.get("training", {}).get("seed"),
            logged_steps=[int(row["_step"]) for row in rows],
            losses=losses,
            val_logged_steps=[int(row["_step"]) for row in val_rows],
            val_losses=val_losses,
            final_loss=losses[-1] if losses else None,
            final_val_loss=val_losses[-1] if val_losses else None,
            numerics=numerics_from_wandb(run),
            capacity_replays=len(replay_steps),
            capacity_replay_steps=replay_steps,
            capacity_spills=len(spill_steps),
            capacity_spill_steps=spill_steps,
            capacity_rows=int(capacity[-1]) if capacity else None,
            stack=dict(run.config.get("stack") or {}),
            wandb_mode="offline",
            wandb_run_id=run.run_id,
            wandb_dirs=list(run.paths),
            **steady_numbers(windows_from_history(rows)),
        )


def earlier_record(run_dir: str | Path, step: int) -> Optional[RunSummary]:
    """What the earlier launches of a run resumed from ``step`` logged: its ``summary.json``,
    unless the offline wandb runs under the run dir reach further (a launch killed before it
    wrote its summary: SIGKILL, a node lost), then those read back (:meth:`RunSummary.from_wandb`)."""
    from launch.run.wandb_offline import read_runs

    summary = RunSummary.read(run_dir)
    if summary is not None and summary.steps >= step:
        return summary
    runs = [r for r in read_runs(str(Path(run_dir) / "wandb")) if r.history] if Path(run_dir, "wandb").is_dir() else []
    logged = RunSummary.from_wandb(runs[-1], runs[-1].config.get(RECIPE_CONFIG, {}), str(run_dir)) if runs else None
    if logged is not None and (summary is None or logged.steps > summary.steps):
        return logged
    return summary
