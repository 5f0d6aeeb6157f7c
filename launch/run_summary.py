"""One run's result: what the runner writes, the console prints and ``compare_runs`` reads.

Rank 0 of every run writes ``<run dir>/summary.json`` at the end (also when stopped by a
signal), locally and inside SLURM jobs alike. The headline numbers are means over the logged
windows after the first (lazy init and warm-up left out: :func:`steady_mean`), and the runner
writes the same numbers into the wandb run's summary under the metric names below, so the
console, ``summary.json`` and wandb agree. A run without ``summary.json`` (a job killed
before it could write one) is read back from its offline wandb run(s) with
:meth:`RunSummary.from_wandb`, through the same names and statistic.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from launch.run_dir import SUMMARY
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
VAL_LOSS = "val/loss"  # mean loss per token on the validation batches (launch.titan_validation)
# The a2a preset every other one is compared with (compare_runs, the wandb dashboard):
# torchtitan's own all-to-all.
BASELINE = "bf16"
# The wandb config key the runner logs the composed recipe config under (so its a2a preset is
# config "recipe.a2a.name").
RECIPE_CONFIG = "recipe"

# MXFP8 numerics telemetry (logging.numerics_every, launch.numerics_log): per MoE layer, all-to-all
# leg (mxfp8_ep.config.LEGS) and statistic (NUMERICS_STATS, defined in mxfp8_ep.numerics),
# "numerics/layer<i>/<leg>/<stat>" (i: torchtitan's block index), and model-wide
# "numerics/<leg>/<stat>". RunSummary keeps summary statistics of each (numerics); compare_runs
# sums them up per run.
NUMERICS_PREFIX = "numerics/"

# RunSummary field <- wandb metric whose steady mean it is.
MEAN_OF = {
    "tokens_per_s": TOKENS_PER_S,
    "tokens_per_s_global": TOKENS_PER_S_GLOBAL,
    "step_time_s": STEP_TIME,
    "a2a_bytes_per_step": A2A_BYTES,
    "tflops": TFLOPS,
    "mfu_pct": MFU,
}


def a2a_leg_metric(leg: str) -> str:
    """wandb metric of one all-to-all leg's bytes per step (``leg``: a LEGS name or "other")."""
    return f"a2a/{leg}_bytes_per_step"


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
SUMMARY_METRICS = tuple(MEAN_OF.values()) + tuple(a2a_leg_metric(leg) for leg in LEGS + ("other",))


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


def steady_mean(values: list[Any]) -> Optional[float]:
    """Mean of the finite values without the first (compile, allocator and wandb warm-up);
    None when there is none."""
    vals = [v for v in (_finite(x) for x in values) if v is not None]
    if len(vals) > 1:
        vals = vals[1:]
    return sum(vals) / len(vals) if vals else None


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
    # headline numbers of this launch (steady means); None where they mean nothing (TFLOPS
    # and MFU on CPU) or were not measured
    final_loss: Optional[float] = None
    final_val_loss: Optional[float] = None
    tokens_per_s: Optional[float] = None  # per rank
    tokens_per_s_global: Optional[float] = None
    step_time_s: Optional[float] = None
    a2a_bytes_per_step: Optional[float] = None
    a2a_bytes_per_step_by_leg: dict[str, float] = field(default_factory=dict)
    tflops: Optional[float] = None
    mfu_pct: Optional[float] = None
    max_memory_gib: Optional[float] = None
    # numerics telemetry of this launch: metric name -> series_stats of its samples
    numerics: dict[str, dict[str, float]] = field(default_factory=dict)
    # wandb
    wandb_mode: str = "disabled"
    wandb_run_id: Optional[str] = None
    wandb_dirs: list[str] = field(default_factory=list)

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

    def wandb_summary(self) -> dict[str, float]:
        """The headline numbers under their wandb metric names (for the wandb run summary)."""
        out = {metric: getattr(self, name) for name, metric in MEAN_OF.items()}
        out[LOSS] = self.final_loss
        out[VAL_LOSS] = self.final_val_loss
        out.update({a2a_leg_metric(leg): v for leg, v in self.a2a_bytes_per_step_by_leg.items()})
        return {k: v for k, v in out.items() if v is not None}

    # ------------------------------------------------------------------------------ wandb
    @classmethod
    def from_wandb(cls, run: Any, recipe: dict[str, Any], path: str) -> "RunSummary":
        """From an offline wandb run (``launch.wandb_offline.OfflineRun``, attempts merged)
        and the recipe config it logged."""
        par = recipe.get("parallelism", {})
        model = recipe.get("model", {})
        a2a = recipe.get("a2a", {})
        rows = [row for row in run.history if LOSS in row]
        losses = [float(row[LOSS]) for row in rows]
        val_rows = [row for row in run.history if VAL_LOSS in row]
        val_losses = [float(row[VAL_LOSS]) for row in val_rows]
        summary = cls(
            run_name=run.name or os.path.basename(path),
            experiment=recipe.get("experiment", run.group),
            a2a=a2a.get("name", "?"),
            a2a_legs={k: v for k, v in a2a.items() if k != "name"},
            model=model.get("name", "?"),
            model_flavor=f"{model.get('family', '?')}/{model.get('flavor', '?')}",
            parallelism=par.get("name", "?"),
            world_size=par.get("nodes", 0) * par.get("procs_per_node", 0),
            ep=par.get("ep", 0),
            launcher=recipe.get("launcher", {}).get("name", "?"),
            device=str(run.config.get("device", "?")),
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
            wandb_mode="offline",
            wandb_run_id=run.run_id,
            wandb_dirs=list(run.paths),
        )
        for name, metric in MEAN_OF.items():
            setattr(summary, name, steady_mean(run.series(metric)))
        return summary
