"""Compare finished runs: bf16 vs MXFP8 all-to-all, side by side, in a table, a JSON file and
plots.

    python launch/compare_runs.py multirun/default/2026-11-30_10-00-00     # a sweep
    python launch/compare_runs.py outputs/a/run1 outputs/b/run2 --out cmp/   # into cmp/
    python launch/compare_runs.py path/to/wandb/offline-run-*              # wandb runs only
    python launch/compare_runs.py --wandb-dashboard my-team/mxfp8-ep --group parity  # wandb workspace

Each argument may be a run directory (with ``summary.json`` and/or ``wandb/``), a sweep
directory holding run directories, an ``offline-run-*`` directory or a ``.wandb`` file. The
offline wandb runs of one run id (the launches of a resumed run) are one run, whether found
under one folder or named one by one.
Runs are read as ``launch.run.run_summary.RunSummary``: from their ``summary.json`` when they
have one, otherwise from their offline wandb run(s), so SLURM runs that never wrote one are
compared too.

Every run is compared with its baseline: the bf16 run of the same sweep point (its name
without the ``a2a`` and ``training.seed`` parts), the one with the lowest seed when there are
several, else the first bf16 run of the same model, world size and EP degree. Further bf16
runs of the point with other seeds measure the seed-to-seed spread, against which each arm's
end loss is judged (``PARITY_SHARE`` and ``bf16_reference``: with three or more bf16 seeds,
its distance from their mean against max(2 × their sample std, 0.5% of the loss); with one or
two, its distance from the baseline against max(their distance, 0.5% of the loss)): one verdict
line per run, e.g.

    mxfp8: final val loss +0.0030 (+0.08%) vs bf16; bf16 seed spread 0.0040 -> within ...
    mxfp8 seed 1: final val loss -0.0250 (-0.57%) vs bf16 mean of 3 seeds; bf16 std 0.0100 over 3 seeds -> outside ...

and one throughput verdict per arm: its runs' tokens/s together over the bf16 runs', with the
ratios of every (arm run, bf16 run) pair; a difference is called a speed-up only when every pair
shows it, with one run on each side (no spread to judge by) not at all, and for runs whose ranks
shared one GPU (``RunSummary.gpu_shared``) never:

    mxfp8: tokens/s ×1.031 vs bf16, 2 vs 2 runs (pairs ×0.992-×1.070) -> inside the run-to-run spread ...

``comparison.json`` goes where ``--out`` says, else into the one sweep directory given, else
into the folder of the runs (one run's when the paths are its wandb launches) or the folder
that holds them all, never the current directory by default; the command prints where. Next
to it go ``comparison_loss.png`` (training loss, its difference to the baseline smoothed, with
the seed spread as a band;
validation loss and its difference when the runs have one) and ``comparison_throughput.png``
(tokens/s and all-to-all bytes per step, values on the bars). The JSON holds the series
behind every panel (``plots``), the verdicts and, when runs logged MXFP8 numerics telemetry
(``numerics/...``), its worst layer per leg and statistic.

A run still queued or running (its SLURM job as ``squeue`` lists it, or a live process:
``launch.run.run_lock``), one that failed (its ``console.log`` ends "failed", its wandb run exited
non-zero, or ``sacct`` says its job failed) or one that trained no step (a run folder with nothing
logged) is a marked row of the table, left out of the verdicts and the plots; the command says
where every run stands (queued, running, done, stopped, failed) and which it left out, and
``comparison.json`` lists them (``left_out``). With no finished run there is nothing to compare:
it writes nothing and exits 1.

Each run's row in ``comparison.json`` carries its provenance (``RunSummary``: the recipe's commit
and dirty flag, start and end times, hosts, GPU model and count, the stack).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from launch.config.stack import Stack
from launch.run import run_lock, slurm_jobs
from launch.run.run_dir import CONSOLE_LOG, RESUMES, RUN_CONFIG, SUMMARY
from launch.run.run_summary import (BASELINE, NUMERICS_STATS, RECIPE_CONFIG, RunSummary, numerics_from_wandb,
                                    parse_numerics_metric, ratio_of_sums)
from launch.run.shared_gpu import SHARED_GPU_NOTE
from launch.run.wandb_offline import OfflineRun, read_runs
from mxfp8_ep.format.wire_format import quantized_formats

# An arm is at parity when its end loss lies within the bound of the bf16 reference
# (``bf16_reference``): with n bf16 seeds of its sweep point,
#   n >= SEED_STATS_MIN: |loss - bf16 mean| <= max(SPREAD_STDS x bf16 sample std, PARITY_SHARE x mean);
#   n = 2: |loss - lowest seed's| <= max(their distance, PARITY_SHARE x that loss);
#   n = 1: |loss - bf16's| <= PARITY_SHARE x bf16's loss.
# Two seeds give one degree of freedom, no usable standard deviation: their distance stands in
# for the spread, as it did before there were more.
PARITY_SHARE = 0.005
SPREAD_STDS = 2
SEED_STATS_MIN = 3
PARITY_RULE = (f"|end loss - bf16 reference| <= bound; with n >= {SEED_STATS_MIN} bf16 seeds the reference is "
               f"their mean, the bound max({SPREAD_STDS} × their sample std, {PARITY_SHARE:g} × mean); with 2 the "
               f"lowest seed's loss, max(their distance, {PARITY_SHARE:g} × that loss); with 1 its loss, "
               f"{PARITY_SHARE:g} × that loss")
CPU_NOTE = "CPU run: throughput is not a speed claim"
# When a throughput difference is called a speed-up (or a slow-down).
THROUGHPUT_RULE = ("faster (slower) only when every run of the arm is faster (slower) than every "
                   "baseline run; otherwise the ratio is inside the run-to-run spread")
# The table's note on its marked rows.
NOT_COMPARED = ("the run is queued or still running, failed (its console.log's last line) or trained no "
                "step: not compared, no verdict and no plot")
# Smoothing of the loss-difference panels: a trailing mean over this share of the points.
SMOOTH_SHARE = 1 / 30
# How the worst layer is picked for each numerics statistic: (stat of a layer's samples, worst).
NUMERICS_WORST = {
    "rel_l2_err": ("mean", max),
    "saturated_block_frac": ("max", max),
    "flushed_frac": ("max", max),
    "scale_exp_min": ("min", min),
    "scale_exp_max": ("max", max),
}
assert set(NUMERICS_WORST) == set(NUMERICS_STATS)


# The a2a fields of a run name that make a sweep point rather than an arm of it: the transport
# and its node size move the same rows another way (recipes/dsv3_16b_2nodes_sweep.yaml sweeps
# a2a.transport beside the a2a presets).
POINT_A2A_FIELDS = ("a2a.transport=", "a2a.ranks_per_node=")


@dataclass
class Compared:
    """A run, where it was read from, and its differences to its bf16 baseline."""

    run: RunSummary
    path: str
    source: str  # "summary" | "wandb"
    vs_baseline: dict[str, Any] = field(default_factory=dict)
    baseline: Optional["Compared"] = field(default=None, repr=False)
    # bf16 runs of this run's sweep point with other seeds than the baseline's
    seed_replicas: list["Compared"] = field(default_factory=list, repr=False)
    show_seed: bool = False  # the sweep point has runs of this a2a with several seeds
    # "queued" / "running" / "failed" / "no step" for a run that is not compared (``ending``);
    # None for one that is
    mark: Optional[str] = None
    holder: Optional[str] = None  # who trains a queued or running run ("SLURM job 33")

    @property
    def group_key(self) -> tuple:
        return (self.run.model, self.run.world_size, self.run.ep)

    @property
    def point(self) -> str:
        """The run name without its a2a and seed parts: what the sweep point varies. The a2a
        fields that say how the rows travel (``POINT_A2A_FIELDS``) stay: each transport is a
        point with its own bf16 baseline."""
        return ",".join(t for t in self.run.run_name.split(",")
                        if t.startswith(POINT_A2A_FIELDS) or not t.startswith(("a2a=", "a2a.", "training.seed=")))

    @property
    def pair_key(self) -> tuple:
        return self.group_key + (self.point,)

    @property
    def is_baseline(self) -> bool:
        return self.baseline is None and self.run.a2a == BASELINE

    @property
    def label(self) -> str:
        """Short name: the a2a preset, plus the seed where the point has runs of the preset
        with several."""
        return f"{self.run.a2a} seed {self.run.seed}" if self.show_seed else self.run.a2a


def _recipe_config(run: OfflineRun) -> dict:
    """The composed recipe config: logged to wandb under ``RECIPE_CONFIG`` by the runner, else
    the train_config.yaml the launcher wrote into the run dir above the wandb folder."""
    if isinstance(run.config.get(RECIPE_CONFIG), dict):
        return run.config[RECIPE_CONFIG]
    for parent in Path(run.path).parents:
        candidate = parent / RUN_CONFIG
        if candidate.is_file():
            from omegaconf import OmegaConf

            return OmegaConf.to_container(OmegaConf.load(candidate), resolve=True)  # type: ignore[return-value]
    return {}


def _numerics_logged_to_wandb(s: RunSummary, run_dir: Path) -> dict[str, dict[str, float]]:
    """The numerics telemetry of a run whose summary has none, from its offline wandb run."""
    for run in read_runs(str(run_dir)):
        if run.run_id == s.wandb_run_id:
            return numerics_from_wandb(run)
    return {}


def _last_ending(run_folder: Path) -> str:
    """How the last launch of the run in ``run_folder`` ended: the end of its ``console.log``'s
    last "==== ended <time>: <how> ====" line ("" when it has none)."""
    try:
        lines = (run_folder / CONSOLE_LOG).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    ends = [ln for ln in lines if ln.startswith("==== ended ")]
    return ends[-1].split(": ", 1)[-1].removesuffix(" ====") if ends else ""


def ending(c: Compared, exit_code: Optional[int] = None) -> Optional[str]:
    """"queued" / "running" while a launch trains the run (its SLURM job is queued or running, as
    ``squeue`` lists it, or its process is alive: ``launch.run.run_lock``); "failed" when its last
    launch failed (its summary or ``console.log`` says so, its wandb run exited with ``exit_code``
    != 0, or ``sacct`` says its job failed); "no step" when it logged no training step; else None."""
    folder = run_folder(c)
    live = run_lock.live_hold(folder) if folder.is_dir() else None
    if live is not None:
        hold, how = live
        c.holder = hold.who
        return "queued" if how == "queued" else "running"
    how = getattr(c.run, "ended", None) or _last_ending(folder)
    if how.startswith("failed") or exit_code not in (None, 0) or _job_failed(folder):
        return "failed"
    return None if c.run.logged_steps else "no step"


def _job_failed(folder: Path) -> bool:
    """Whether the run's SLURM job ended without a word in the run dir (killed outright: its
    hold is still there) in a state ``sacct`` calls a failure."""
    hold = run_lock.read(folder)
    return bool(hold and hold.job_id and (slurm_jobs.final_state(hold.job_id) or "") in JOB_FAILED)


# sacct's states of a job that failed.
JOB_FAILED = ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "TIMEOUT", "DEADLINE")


def status(c: Compared) -> str:
    """Where the run stands: queued, running, done, stopped, failed (also a run that ended
    having trained no step)."""
    if c.mark in ("queued", "running", "failed"):
        return c.mark
    if c.mark == "no step":
        return "failed"
    return "stopped" if c.run.stopped_by else "done"


STATUSES = ("queued", "running", "done", "stopped", "failed")


def status_lines(runs: list[Compared]) -> list[str]:
    """Where every run stands, and which are left out of the comparison (none when all are in)."""
    left_out = [c for c in ordered(runs) if c.mark]
    if not left_out:
        return []
    counts = {s: sum(status(c) == s for c in runs) for s in STATUSES}
    lines = [f"{len(runs)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items())]
    for c in left_out:
        who = f" ({c.holder})" if c.holder else ""
        why = {"queued": "not started yet", "running": "still training", "failed": "failed",
               "no step": "trained no step"}[c.mark]
        lines.append(f"left out: {c.run.run_name}: {status(c)}{who}, {why} ({run_folder(c)})")
    return lines


def _unrecorded(folder: Path) -> Compared:
    """A run folder with a config but neither ``summary.json`` nor a wandb run (it ended before
    its first record): a row with what its ``train_config.yaml`` says."""
    from omegaconf import OmegaConf

    recipe = OmegaConf.to_container(OmegaConf.load(folder / RUN_CONFIG), resolve=True)
    name = (recipe.get("logging") or {}).get("run_name") or folder.name  # type: ignore[union-attr]
    nothing = OfflineRun(path=str(folder), name=name)
    c = Compared(RunSummary.from_wandb(nothing, recipe, str(folder)), str(folder), "summary")  # type: ignore[arg-type]
    c.mark = ending(c)
    return c


def collect(paths: list[str]) -> list[Compared]:
    """Every run found under ``paths`` (see module doc), each once; ``Compared.mark`` says
    which of them failed or trained no step."""
    found: list[Compared] = []
    seen: set[str] = set()  # wandb folders already covered by a summary

    def add_wandb(run: OfflineRun) -> None:
        if not seen.intersection(os.path.realpath(p) for p in run.paths):
            seen.update(os.path.realpath(p) for p in run.paths)
            where = str(Path(run.paths[0]))
            c = Compared(RunSummary.from_wandb(run, _recipe_config(run), where), where, "wandb")
            c.mark = ending(c, run.exit_code)
            found.append(c)

    wandb_roots: list[str] = []  # searched together: one run's launches may be named one by one
    for arg in paths:
        p = Path(arg)
        if p.is_file() and p.suffix == ".wandb":
            wandb_roots.append(str(p.parent))
            continue
        if not p.is_dir():
            raise FileNotFoundError(f"{arg}: no such run, sweep or wandb directory")
        for summary_file in sorted(p.rglob(SUMMARY)):
            s = RunSummary.read(summary_file)
            if s is None:  # unreadable: its wandb run, if any, stands in below
                continue
            seen.update(os.path.realpath(d) for d in s.wandb_dirs)
            if not s.numerics and quantized_formats(s.a2a_legs.values()):
                s.numerics = _numerics_logged_to_wandb(s, summary_file.parent)
            c = Compared(s, str(summary_file.parent), "summary")
            c.mark = ending(c)
            found.append(c)
        wandb_roots.append(str(p))
    for run in read_runs(*wandb_roots):
        add_wandb(run)
    recorded = {run_folder(c).resolve() for c in found}
    for arg in paths:
        if Path(arg).is_dir():
            found += [_unrecorded(f.parent) for f in sorted(Path(arg).rglob(RUN_CONFIG))
                      if f.parent.resolve() not in recorded and f.parent.parent.name != RESUMES]
    return found


# ------------------------------------------------------------------------------ numbers
def _ratio(x: Any, base: Any) -> Optional[float]:
    if x is None or base in (None, 0):
        return None
    return float(x) / float(base)


def _delta(x: Optional[float], base: Optional[float]) -> Optional[float]:
    return None if x is None or base is None else x - base


def smooth_window(n: int) -> int:
    return max(1, round(n * SMOOTH_SHARE))


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def aligned_delta(steps: list[int], values: list[float], base_steps: list[int],
                  base_values: list[float]) -> tuple[list[int], list[float]]:
    """``values - base_values`` at the steps both logged."""
    base = dict(zip(base_steps, base_values))
    pairs = [(s, v - base[s]) for s, v in zip(steps, values) if s in base]
    return [s for s, _ in pairs], [d for _, d in pairs]


def end_loss(run: RunSummary) -> tuple[Optional[float], str]:
    """The number a verdict compares: the final validation loss, else the mean training loss
    over the last logged window of the smoothing length."""
    if run.final_val_loss is not None:
        return run.final_val_loss, "final val loss"
    if not run.losses:
        return None, "final loss"
    w = smooth_window(len(run.losses))
    return sum(run.losses[-w:]) / w, f"train loss (mean of last {w} logged steps)"


def _seed_order(c: Compared) -> tuple:
    return (c.run.seed is None, c.run.seed if c.run.seed is not None else 0, c.run.run_name)


def compare(runs: list[Compared]) -> list[Compared]:
    """Give each run its baseline (module doc), seed replicas and ``vs_baseline``; failed and
    empty runs (``Compared.mark``) are returned as they are."""
    everything, runs = runs, compared(runs)
    pairs: dict[tuple, list[Compared]] = {}
    groups: dict[tuple, list[Compared]] = {}
    seeds: dict[tuple, set] = {}
    for c in runs:
        seeds.setdefault(c.pair_key + (c.run.a2a,), set()).add(c.run.seed)
    for c in runs:
        c.show_seed = len(seeds[c.pair_key + (c.run.a2a,)]) > 1
    for c in sorted(runs, key=_seed_order):
        if c.run.a2a == BASELINE:
            pairs.setdefault(c.pair_key, []).append(c)
            groups.setdefault(c.group_key, []).append(c)
    for bf16 in pairs.values():
        first = bf16[0]
        first.seed_replicas = [c for c in bf16[1:] if c.run.seed != first.run.seed]
    for c in runs:
        candidates = pairs.get(c.pair_key) or groups.get(c.group_key) or []
        base = candidates[0] if candidates else None
        if base is None or base is c:
            continue
        c.baseline = base
        m, b = c.run, base.run
        mine, what = end_loss(m)
        theirs, _ = end_loss(b)
        c.vs_baseline = {
            "baseline": b.run_name,
            "loss_delta": _delta(m.final_loss, b.final_loss),
            "val_loss_delta": _delta(m.final_val_loss, b.final_val_loss),
            "end_loss": mine,
            "end_loss_delta": _delta(mine, theirs),
            "end_loss_is": what,
            "tokens_per_s_ratio": _ratio(m.tokens_per_s_global, b.tokens_per_s_global),
            "step_time_ratio": _ratio(m.step_time_s, b.step_time_s),
            "bytes_ratio": _ratio(m.a2a_bytes_per_step, b.a2a_bytes_per_step),
        }
    return everything


def compared(runs: list[Compared]) -> list[Compared]:
    """The runs that are compared: all but the failed and empty ones."""
    return [c for c in runs if c.mark is None]


def seed_spread(base: Compared) -> Optional[float]:
    """Largest |end loss of another-seed bf16 run - the baseline's| (None without one)."""
    ref, _ = end_loss(base.run)
    spreads = [abs(x - ref) for x in (end_loss(r.run)[0] for r in base.seed_replicas)
               if x is not None and ref is not None]
    return max(spreads) if spreads else None


@dataclass(frozen=True)
class Bf16Reference:
    """What the arms of one baseline are judged against (the rule at ``PARITY_SHARE``): the bf16
    runs of its sweep point, the baseline and its seed replicas."""

    value: float  # the end loss an arm's distance is taken from
    label: str  # what that is, e.g. "bf16 seed 0" or "bf16 mean of 3 seeds"
    seeds: int  # bf16 runs with an end loss
    mean: float
    std: Optional[float]  # their sample standard deviation (None with one)
    spread: Optional[float]  # the largest distance of another seed from the baseline (``seed_spread``)
    bound: float  # the largest |distance| at parity
    rule: str  # the bound's formula

    @property
    def by_mean(self) -> bool:
        return self.seeds >= SEED_STATS_MIN

    def describe(self) -> str:
        """The seeds' part of a verdict line."""
        if self.by_mean:
            return f"bf16 std {self.std:.4f} over {self.seeds} seeds"
        return (f"bf16 seed spread {self.spread:.4f}" if self.spread is not None
                else "one bf16 seed, no seed spread (sweep training.seed for one)")


def bf16_reference(base: Compared) -> Optional[Bf16Reference]:
    """The bf16 reference of ``base``'s arms (module constants above); None when the baseline has
    no end loss."""
    ref, _ = end_loss(base.run)
    if ref is None:
        return None
    values = [ref] + [x for x in (end_loss(r.run)[0] for r in base.seed_replicas) if x is not None]
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else None
    share = f"{100 * PARITY_SHARE:g}% of loss"
    if len(values) >= SEED_STATS_MIN:
        return Bf16Reference(mean, f"bf16 mean of {len(values)} seeds", len(values), mean, std, seed_spread(base),
                             max(SPREAD_STDS * std, PARITY_SHARE * abs(mean)),
                             f"max({SPREAD_STDS} × bf16 std, {share})")
    spread = seed_spread(base)
    if spread is None:  # one bf16 seed: no spread to take, the share alone
        return Bf16Reference(ref, base.label, len(values), mean, std, None, PARITY_SHARE * abs(ref), share)
    return Bf16Reference(ref, base.label, len(values), mean, std, spread,
                         max(spread, PARITY_SHARE * abs(ref)), f"max(seed spread, {share})")


def parity_bound(base: Compared) -> Optional[float]:
    """The largest |end loss - bf16 reference| at which an arm of this baseline is at parity
    (``bf16_reference``); None without one."""
    ref = bf16_reference(base)
    return None if ref is None else ref.bound


def verdicts(runs: list[Compared]) -> list[dict[str, Any]]:
    """One verdict per run that has a baseline, seed replicas included (their line is the
    spread itself): its end loss's distance from the bf16 reference against the bound. With
    ``SEED_STATS_MIN`` or more bf16 seeds every bf16 run, the baseline too, has a line: its
    distance from their mean."""
    runs = compared(runs)
    out = []
    for c in ordered(runs):
        base = c.baseline or (c if c.is_baseline else None)
        ref = bf16_reference(base) if base is not None else None
        if ref is None or (c is base and not ref.by_mean):
            continue
        mine, what = end_loss(c.run)
        if mine is None:
            continue
        d = mine - ref.value
        replica = c is base or c in base.seed_replicas
        within = abs(d) <= ref.bound
        text = (f"{c.label}: {what} {d:+.4f} ({100 * d / ref.value:+.2f}%) vs {ref.label}; {ref.describe()}"
                + ("" if replica else f" -> {'within' if within else 'outside'} {ref.rule} = {ref.bound:.4f}"))
        point = f"[{c.point}] " if c.point else ""
        out.append({"run": c.run.run_name, "baseline": base.run.run_name, "reference": ref.label,
                    "reference_loss": ref.value, "delta": d, "measure": what, "bf16_seeds": ref.seeds,
                    "bf16_mean": ref.mean, "bf16_std": ref.std, "seed_spread": ref.spread,
                    "tolerance": ref.bound, "rule": ref.rule, "within": None if replica else within,
                    "text": point + text})
    return out


def unjudged(runs: list[Compared]) -> list[str]:
    """A line for each run that gets no verdict because there is no bf16 run to compare it
    with, neither at its sweep point nor in its group (the baseline, module doc)."""
    runs = compared(runs)
    return [f"{f'[{c.point}] ' if c.point else ''}{c.label}: no verdict: no {BASELINE} run of the same "
            f"settings to compare it with (add a2a={BASELINE} to the sweep, or name a {BASELINE} run's folder)"
            for c in ordered(runs) if c.baseline is None and not c.is_baseline and c.run.a2a != BASELINE]


def pooled_tokens_per_s(runs: list[RunSummary]) -> Optional[float]:
    """tokens/s of all ranks of several runs taken together: their steady tokens over their steady
    seconds (a run's: step time x steady steps; a summary without ``steady_steps`` counts as
    long as the others)."""
    seconds = [None if r.step_time_s is None else r.step_time_s * (r.steady_steps or 1) for r in runs]
    return ratio_of_sums([(r.tokens_per_s_global, s) for r, s in zip(runs, seconds)])


def throughput_verdicts(runs: list[Compared]) -> list[dict[str, Any]]:
    """One verdict per arm and sweep point with a baseline: the arm's runs' tokens/s together
    over the baseline point's bf16 runs' (``pooled_tokens_per_s``), the range of the ratios of
    every (arm run, bf16 run) pair, and what they show by ``THROUGHPUT_RULE``. With one run on
    each side there is no spread to judge the ratio by, and none is called faster."""
    runs = compared(runs)
    arms: dict[tuple, list[Compared]] = {}
    for c in ordered(runs):
        if c.baseline is not None and c.run.a2a != BASELINE:
            arms.setdefault((c.pair_key, c.run.a2a), []).append(c)
    cpu = on_cpu(runs)
    out = []
    for (_, a2a), arm in arms.items():
        base = [c for c in ordered(runs) if c.run.a2a == BASELINE and c.pair_key == arm[0].baseline.pair_key]
        mine = [c.run.tokens_per_s_global for c in arm]
        theirs = [c.run.tokens_per_s_global for c in base]
        if None in mine or None in theirs or 0 in theirs:
            continue
        ratio = _ratio(pooled_tokens_per_s([c.run for c in arm]), pooled_tokens_per_s([c.run for c in base]))
        pairs = [m / b for m in mine for b in theirs]
        low, high = min(pairs), max(pairs)
        if any(c.run.gpu_shared for c in arm + base):
            verdict = "not judged"
            said = f"not judged: {SHARED_GPU_NOTE}"
        elif len(pairs) == 1:
            verdict = "not judged"
            said = "one run each -> not judged: no run-to-run spread to judge it by (sweep training.seed for one)"
        else:
            verdict = "faster" if low > 1 else "slower" if high < 1 else "within spread"
            said = f"{len(arm)} vs {len(base)} runs (pairs ×{low:.3f}-×{high:.3f}) -> " + {
                "faster": "faster in every run pair" + ("" if cpu else ": a speed-up"),
                "slower": "slower in every run pair" + ("" if cpu else ": a slow-down"),
                "within spread": "inside the run-to-run spread: no speed difference shown"}[verdict]
        point = f"[{arm[0].point}] " if arm[0].point else ""
        text = f"{point}{a2a}: tokens/s ×{ratio:.3f} vs {BASELINE}, {said}" + (f" ({CPU_NOTE})" if cpu else "")
        out.append({"arm": a2a, "point": arm[0].point, "baseline": BASELINE,
                    "runs": [c.run.run_name for c in arm], "baseline_runs": [c.run.run_name for c in base],
                    "ratio": ratio, "pair_ratios": [low, high], "verdict": verdict, "text": text})
    return out


def numerics_summary(run: RunSummary) -> dict[str, dict[str, dict[str, Any]]]:
    """leg -> stat -> {"value", "layer", "layers"}: the worst MoE layer of each numerics
    statistic (``NUMERICS_WORST``) from the run's per-layer series statistics; the model-wide
    series (``layer`` None) where a leg has no per-layer ones."""
    per: dict[tuple[str, str], list[tuple[float, Optional[int]]]] = {}
    for name, stats in run.numerics.items():
        parsed = parse_numerics_metric(name)
        if parsed is None or not stats or parsed[2] not in NUMERICS_WORST:
            continue
        layer, leg, stat = parsed
        per.setdefault((leg, stat), []).append((stats[NUMERICS_WORST[stat][0]], layer))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (leg, stat), values in sorted(per.items()):
        layered = [v for v in values if v[1] is not None] or values
        value, layer = NUMERICS_WORST[stat][1](layered, key=lambda v: v[0])
        out.setdefault(leg, {})[stat] = {"value": value, "layer": layer,
                                         "layers": len(layered) if layer is not None else 0}
    return out


# ------------------------------------------------------------------------------ table
def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def ordered(runs: list[Compared]) -> list[Compared]:
    """Sweep point by sweep point, bf16 first (lowest seed first)."""
    return sorted(runs, key=lambda c: (repr(c.pair_key), c.run.a2a != BASELINE, c.run.a2a,
                                       *_seed_order(c)))


def on_cpu(runs: list[Compared]) -> bool:
    return any(c.run.device == "cpu" for c in runs)


def on_shared_gpu(runs: list[Compared]) -> bool:
    return any(c.run.gpu_shared for c in runs)


def throughput_notes(runs: list[Compared]) -> list[str]:
    """Why the runs' tokens/s are no speed figures, if they are not: CPU runs, ranks that shared
    one GPU."""
    return [note for note, applies in ((CPU_NOTE, on_cpu(runs)), (SHARED_GPU_NOTE, on_shared_gpu(runs)))
            if applies]


def stack_warning(runs: list[Compared]) -> Optional[str]:
    """A warning when the runs trained on different stacks (torchtitan, torch, triton:
    ``RunSummary.stack``), naming each stack's runs; None when they share one."""
    by_stack: dict[str, list[str]] = {}
    for c in ordered(runs):
        label = Stack.from_dict(c.run.stack).label if c.run.stack else "stack not recorded"
        by_stack.setdefault(label, []).append(c.run.run_name)
    if len(by_stack) < 2:
        return None
    stacks = "; ".join(f"{label} ({', '.join(names)})" for label, names in by_stack.items())
    return f"the runs trained on different stacks: {stacks}; their differences are not the all-to-all's alone"


def format_table(runs: list[Compared]) -> str:
    header = ("run", "a2a", "model", "world/ep", "device", "final loss", "Δloss", "val loss", "Δval",
              "tokens/s", "×bf16", "step s", "a2a MiB/step", "×bf16")
    rows = [header]
    for c in ordered(runs):
        s, v, base = c.run, c.vs_baseline, c.baseline is None
        rows.append((
            s.run_name + (f" [{c.mark}]" if c.mark else ""),
            s.a2a,
            s.model,
            f"{s.world_size or '?'}/{s.ep or '?'}",
            f"{s.device} (shared)" if s.gpu_shared else s.device,
            _f(s.final_loss, ".4f"),
            "" if base else _f(v.get("loss_delta"), "+.4f"),
            _f(s.final_val_loss, ".4f"),
            "" if base else _f(v.get("val_loss_delta"), "+.4f"),
            _f(s.tokens_per_s_global, ",.0f"),
            "" if base else _f(v.get("tokens_per_s_ratio"), ".3f"),
            _f(s.step_time_s, ".4f"),
            _f(None if s.a2a_bytes_per_step is None else s.a2a_bytes_per_step / 2**20, ".3f"),
            "" if base else _f(v.get("bytes_ratio"), ".3f"),
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i < 5 else str(c).rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    not_compared = sorted({c.mark for c in runs if c.mark})
    if not_compared:
        lines.append(f"* {' / '.join(f'[{e}]' for e in not_compared)}: {NOT_COMPARED}")
    disagreeing = sign_disagreements(runs)
    if disagreeing:
        measures = sorted({measure for _, measure in disagreeing})
        lines.append(f"* Δloss is the last logged step's training loss minus its bf16 run's; the verdicts below "
                     f"compare the {' / '.join(measures)} with the bf16 reference, and for "
                     f"{', '.join(label for label, _ in disagreeing)} the two differ in sign: one step's loss "
                     f"moves more than the difference between the runs")
    if on_cpu(runs):
        lines.append(f"* {CPU_NOTE}: tokens/s and step times of CPU (gloo) runs say nothing about GPUs.")
    if on_shared_gpu(runs):
        lines.append(f"* cuda (shared): {SHARED_GPU_NOTE}; the ranks took turns on the GPU.")
    warning = stack_warning(runs)
    if warning:
        lines.append(f"! {warning}")
    return "\n".join(lines)


def sign_disagreements(runs: list[Compared]) -> list[tuple[str, str]]:
    """(label, the verdict's measure) of each run whose table Δloss (its last step's) and verdict
    (``end_loss``: the final validation loss, else the mean of the last steps) differ in sign."""
    by_name = {c.run.run_name: c for c in runs}
    out = []
    for v in verdicts(runs):
        c = by_name.get(v["run"])
        table = c.vs_baseline.get("loss_delta") if c is not None and c.baseline is not None else None
        if table is not None and table * v["delta"] < 0:
            out.append((c.label, v["measure"]))
    return out


def _where(layer: Optional[int]) -> str:
    return "all layers" if layer is None else f"layer {layer}"


def format_numerics(runs: list[Compared]) -> str:
    """The numerics telemetry's worst layer per leg, one line per run and leg ('' if none)."""
    runs = compared(runs)
    lines = []
    for c in ordered(runs):
        for leg, stats in numerics_summary(c.run).items():
            parts = [f"{stat} {v['value']:.4g} ({_where(v['layer'])})" for stat, v in stats.items()]
            lines.append(f"  {c.run.run_name}  {leg}: " + ", ".join(parts))
    return ("MXFP8 numerics, worst layer per leg:\n" + "\n".join(lines)) if lines else ""


# ------------------------------------------------------------------------------ plots
def plot_labels(runs: list[Compared], width: int = 48) -> dict[str, str]:
    """Legend / axis name per run: the short label, with the sweep point when the runs come
    from several points, cut to ``width`` characters."""
    several = len({c.pair_key for c in runs}) > 1
    out = {}
    for c in runs:
        text = f"{c.label} [{c.point}]" if several and c.point else c.label
        out[c.run.run_name] = text if len(text) <= width else text[: width - 1] + "…"
    return out


_COLORS = ("tab:orange", "tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
           "tab:olive", "tab:cyan")
_DASHES = ("--", "-.", ":", (0, (5, 1, 1, 1)), (0, (3, 1, 1, 1, 1, 1)))
# Baselines (one per sweep point, e.g. per model): dark colours none of the arms has.
_BASELINE_COLORS = ("black", "navy", "darkgreen", "maroon", "indigo", "darkgoldenrod")
_BOUND_COLOR = "tab:green"


def line_styles(runs: list[Compared]) -> dict[str, dict[str, Any]]:
    """Per run: baselines solid, thick, dark and drawn on top (half transparent, so a line
    right under one still shows), each its own colour; seed replicas solid grey; every other
    arm its own colour and dash pattern."""
    styles, k, b = {}, 0, 0
    for c in ordered(runs):
        if c.is_baseline:
            styles[c.run.run_name] = {"color": _BASELINE_COLORS[b % len(_BASELINE_COLORS)], "linestyle": "-",
                                      "linewidth": 2.4, "alpha": 0.55, "zorder": 4}
            b += 1
        elif c.baseline is not None and c in c.baseline.seed_replicas:
            styles[c.run.run_name] = {"color": "0.45", "linestyle": "-", "linewidth": 1.6,
                                      "alpha": 0.9, "zorder": 3}
        else:
            styles[c.run.run_name] = {"color": _COLORS[k % len(_COLORS)],
                                      "linestyle": _DASHES[k % len(_DASHES)], "linewidth": 1.8,
                                      "alpha": 0.95, "zorder": 3}
            k += 1
    return styles


def _shown_ticks(ax: Any) -> list[float]:
    """The x ticks inside the axis range (after the figure is drawn)."""
    lo, hi = ax.get_xlim()
    return [float(t) for t in ax.get_xticks() if lo <= t <= hi]


def _panel_series(runs: list[Compared], which: str) -> dict[str, Any]:
    """The data one loss panel draws: ``which`` is train | train_delta | val | val_delta."""
    val = which.startswith("val")
    names = plot_labels(runs)
    series, band = [], None
    for c in ordered(runs):
        steps = c.run.val_logged_steps if val else c.run.logged_steps
        values = c.run.val_losses if val else c.run.losses
        if not steps:
            continue
        if which.endswith("delta"):
            if c.baseline is None:
                continue
            b = c.baseline.run
            steps, values = aligned_delta(steps, values, b.val_logged_steps if val else b.logged_steps,
                                          b.val_losses if val else b.losses)
        window = 1 if val else smooth_window(len(values))
        series.append({"run": c.run.run_name, "label": names[c.run.run_name], "steps": list(steps),
                       "raw": list(values), "values": trailing_mean(list(values), window),
                       "window": window})
    bounds = []
    if which.endswith("delta"):
        replicas = {c.run.run_name for c in runs if c.baseline is not None and c in c.baseline.seed_replicas}
        spread = [s for s in series if s["run"] in replicas]
        if spread:
            steps = spread[0]["steps"]
            width = [max(abs(s["values"][i]) for s in spread if i < len(s["values"])) for i in range(len(steps))]
            band = {"steps": steps, "low": [-w for w in width], "high": width,
                    "label": "bf16 seed-to-seed spread"}
        bounds = parity_bands(runs, {s["run"] for s in series})
    return {"series": series, "band": band, "bounds": bounds}


def parity_bands(runs: list[Compared], shown: set[str]) -> list[dict[str, Any]]:
    """The verdicts' parity bound (±``parity_bound``) of each baseline whose arms are among
    the ``shown`` runs: a band on the Δ panels, so a difference reads against the size that
    decides the verdict rather than the axis' auto-zoom."""
    bases = {id(c.baseline): c.baseline for c in ordered(runs) if c.baseline is not None and c.run.run_name in shown}
    names = plot_labels(runs)
    out = []
    for base in bases.values():
        ref = bf16_reference(base)
        if ref is not None and ref.bound:
            of = f" vs {names[base.run.run_name]}" if len(bases) > 1 else ""
            # Around the reference, drawn on axes of the difference to the baseline run.
            center = ref.value - end_loss(base.run)[0]
            around = f" around the {ref.label}" if ref.by_mean else ""
            out.append({"baseline": base.run.run_name, "tolerance": ref.bound, "center": center,
                        "label": f"parity bound ±{ref.bound:.4f}{around}{of}"})
    return out


_PANELS = {
    "train": ("Training loss", "loss (global average)"),
    "train_delta": ("Training loss minus the bf16 baseline's", "Δ loss"),
    "val": ("Validation loss (fixed held-out batches)", "val loss"),
    "val_delta": ("Validation loss minus the bf16 baseline's", "Δ val loss"),
}


# Characters of a verdict line that fit under one 7-inch panel of the loss figure (small monospace);
# longer lines are wrapped there, their continuation indented.
VERDICT_CHARS_PER_PANEL = 95


def wrapped(lines: list[str], width: int) -> list[str]:
    """``lines`` wrapped at ``width`` characters, each continuation indented."""
    return [piece for line in lines for piece in textwrap.wrap(line, width, subsequent_indent="    ")]


def plot_loss(runs: list[Compared], path: Path, verdict_lines: list[str]) -> dict[str, Any]:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    styles = line_styles(runs)
    has_val = any(c.run.val_logged_steps for c in runs)
    has_base = any(c.baseline is not None for c in runs)
    names = ["train"] + (["train_delta"] if has_base else []) + (["val"] if has_val else []) \
        + (["val_delta"] if has_val and has_base else [])
    ncols = 2 if len(names) > 1 else 1
    nrows = math.ceil(len(names) / ncols)
    lines = len(wrapped(verdict_lines, VERDICT_CHARS_PER_PANEL * ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, 4 * nrows + 0.3 * lines + 0.4), squeeze=False)
    panels = {}
    for ax, name in zip(axes.flat, names):
        data = _panel_series(runs, name)
        title, ylabel = _PANELS[name]
        delta = name.endswith("delta")
        if delta:
            ax.axhline(0.0, color="black", linewidth=0.8, alpha=0.6)
        for bound in data["bounds"]:
            ax.axhspan(bound["center"] - bound["tolerance"], bound["center"] + bound["tolerance"], color=_BOUND_COLOR,
                       alpha=0.12, linewidth=0, label=bound["label"], zorder=0)
        if data["band"]:
            b = data["band"]
            ax.fill_between(b["steps"], b["low"], b["high"], color="0.6", alpha=0.3, linewidth=0,
                            label=b["label"], zorder=1)
        for s in data["series"]:
            st = styles[s["run"]]
            if name == "train" and s["window"] > 1:
                ax.plot(s["steps"], s["raw"], color=st["color"], linewidth=0.6, alpha=0.2, zorder=1)
            few = len(s["steps"]) <= 40
            ax.plot(s["steps"], s["values"], label=s["label"], marker="o" if few else None,
                    markersize=3.5, **st)
        windows = {s["window"] for s in data["series"]}
        if name.startswith("train") and windows and windows != {1}:
            ylabel += f" (trailing mean of {max(windows)} logged steps)"
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        if data["series"]:
            ax.legend(fontsize="small")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        panels[name] = data
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    texts = list(verdict_lines)
    drawn = wrapped(texts, VERDICT_CHARS_PER_PANEL * ncols)
    if drawn:
        fig.text(0.01, 0.01, "\n".join(drawn), fontsize="small", family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.3 * len(drawn) / (4 * nrows + 0.3 * len(drawn) + 0.4) + 0.01, 1, 1))
    fig.savefig(path, dpi=110, metadata={"Comment": "\n".join(texts)})
    for ax, name in zip(axes.flat, names):
        panels[name]["xticks"] = _shown_ticks(ax)
    plt.close(fig)
    return {"file": path.name, "panels": panels, "texts": texts, "drawn": drawn,
            "styles": {k: {kk: (list(vv) if isinstance(vv, tuple) else vv) for kk, vv in v.items()}
                       for k, v in styles.items()}}


def plot_throughput(runs: list[Compared], path: Path) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    runs = ordered(runs)
    names = plot_labels(runs)
    labels = [names[c.run.run_name] for c in runs]
    cpu, shared = on_cpu(runs), on_shared_gpu(runs)
    fig, (tps, wire) = plt.subplots(1, 2, figsize=(11, 0.5 * len(runs) + 2.8))
    ys = list(range(len(runs)))
    colors = ["0.3" if c.baseline is None else "tab:orange" for c in runs]
    tokens = [c.run.tokens_per_s_global or 0.0 for c in runs]
    mib = [(c.run.a2a_bytes_per_step or 0.0) / 2**20 for c in runs]
    value_labels = {"tokens_per_s": [f"{v:,.0f}" for v in tokens], "a2a_mib_per_step": [f"{v:,.2f}" for v in mib]}
    bars = tps.barh(ys, tokens, color=colors)
    tps.bar_label(bars, labels=value_labels["tokens_per_s"], padding=3, fontsize="small")
    tps.set(yticks=ys, yticklabels=labels, xlabel="tokens/s (all ranks)",
            title="Throughput" + (" (CPU: not a speed claim)" if cpu else " (GPU shared: not a speed claim)"
                                  if shared else ""))
    bars = wire.barh(ys, mib, color=colors)
    wire.bar_label(bars, labels=value_labels["a2a_mib_per_step"], padding=3, fontsize="small")
    wire.set(yticks=ys, yticklabels=[], xlabel="MiB per step", title="All-to-all bytes")
    for ax, values in ((tps, tokens), (wire, mib)):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(0, max(values + [1e-9]) * 1.25)  # room for the value labels
    texts = []
    if cpu:
        texts.append(f"{CPU_NOTE}: tokens/s of CPU processes over gloo say nothing about GPUs")
    elif shared:
        texts.append(f"{SHARED_GPU_NOTE}: the ranks took turns on one GPU")
    if texts:
        fig.text(0.5, 0.01, texts[0], ha="center", va="bottom", color="tab:red", fontsize="medium",
                 weight="bold")
    fig.tight_layout(rect=(0, 0.07 if texts else 0, 1, 1))
    fig.savefig(path, dpi=110, metadata={"Comment": "\n".join(texts)})
    plt.close(fig)
    return {"file": path.name, "labels": labels, "tokens_per_s": tokens, "a2a_mib_per_step": mib,
            "value_labels": value_labels, "texts": texts, "titles": [tps.get_title(), wire.get_title()]}


def write_plots(runs: list[Compared], out_dir: Path,
                verdict_list: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """``comparison_loss.png`` and ``comparison_throughput.png`` in ``out_dir``; returns what
    each shows (series, ticks, texts) for ``comparison.json``."""
    runs = compared(runs)
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    lines = [v["text"] for v in (verdict_list if verdict_list is not None else verdicts(runs))]
    return {"loss": plot_loss(runs, out_dir / "comparison_loss.png", lines),
            "throughput": plot_throughput(runs, out_dir / "comparison_throughput.png")}


# ------------------------------------------------------------------------------ output
def to_json(runs: list[Compared], verdict_list: Optional[list[dict[str, Any]]] = None,
            plots: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    return {
        "baseline": BASELINE,
        "parity_rule": PARITY_RULE,
        "notes": throughput_notes(runs),
        "stack_warning": stack_warning(runs),
        "verdicts": verdict_list if verdict_list is not None else verdicts(runs),
        "unjudged": unjudged(runs),
        "throughput_rule": THROUGHPUT_RULE,
        "throughput_verdicts": throughput_verdicts(runs),
        "left_out": [{"run_name": c.run.run_name, "path": c.path, "status": status(c), "holder": c.holder}
                     for c in ordered(runs) if c.mark],
        "runs": [{"path": c.path, "source": c.source, "mark": c.mark, "status": status(c), "vs_baseline": c.vs_baseline,
                  "numerics_worst": numerics_summary(c.run), **dataclasses.asdict(c.run)}
                 for c in ordered(runs)],
        "plots": plots or {},
    }


# ------------------------------------------------------------------------------ where to write
JSON_NAME = "comparison.json"


def requested_json(out: str) -> Path:
    """``--out``: a ``.json`` file (the plots go next to it) or a folder (``comparison.json``
    and the plots go in it)."""
    p = Path(out)
    return p if p.suffix == ".json" else p / JSON_NAME


def unwritable(json_path: Path) -> Optional[str]:
    """Why ``json_path`` cannot be written (its folder may not exist yet), or None."""
    if json_path.is_dir():
        return f"{json_path} is a folder"
    folder = json_path.parent
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def run_folder(c: Compared) -> Path:
    """The folder of one run: its run dir, or the folder above the ``wandb/`` one its offline
    wandb run lies in."""
    if c.source == "summary":
        return Path(c.path)
    parent = Path(c.path).parent
    return parent.parent if parent.name == "wandb" else parent


def beside_the_runs(paths: list[str], runs: list[Compared]) -> Optional[Path]:
    """Where ``comparison.*`` go without ``--out``: the one folder given that holds runs (a
    sweep), else the folder of the runs (one run's, when the paths are its wandb launches) or
    the folder that holds them all; None when that is only the current directory or the
    filesystem root (runs from unrelated places: ``--out`` says where)."""
    folders = sorted({run_folder(c).resolve() for c in runs})
    sweeps = [g for g in (Path(p).resolve() for p in paths) if any(g in f.parents for f in folders)]
    if len(set(sweeps)) == 1:
        return sweeps[0]
    common = Path(os.path.commonpath(folders))
    if len(folders) > 1 and common in (Path.cwd().resolve(), Path(common.anchor)):
        return None
    return common


def _refuse(message: str) -> int:
    print(f"compare_runs: {message}", file=sys.stderr)
    return 2


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help="run / sweep / offline wandb run directories")
    ap.add_argument("--out", default=None,
                    help=f"where to write: a .json file (the plots go next to it) or a folder ({JSON_NAME} "
                         "and the plots go in it); default: the sweep folder given, else the folder "
                         "holding the runs")
    board = ap.add_argument_group("wandb dashboard (instead of comparing local runs)")
    board.add_argument("--wandb-dashboard", metavar="ENTITY/PROJECT", default=None,
                       help="save a wandb workspace comparing the project's runs by a2a mode (needs wandb login)")
    board.add_argument("--group", default=None, help="only the runs of this experiment (their wandb group)")
    board.add_argument("--preview", metavar="PNG", default=None,
                       help="draw the workspace's panels into PNG instead of saving it (no server)")
    args = ap.parse_args(argv)
    if args.wandb_dashboard is not None:
        if args.paths or args.out:
            return _refuse("--wandb-dashboard reads the runs on the wandb server: give no run paths or --out")
        from launch.tools.wandb_dashboard import command

        return command(args.wandb_dashboard, args.group, args.preview)
    if args.group is not None or args.preview is not None:
        return _refuse("--group and --preview go with --wandb-dashboard ENTITY/PROJECT")
    if not args.paths:
        return _refuse("give the run, sweep or offline wandb run directories to compare")
    out = requested_json(args.out) if args.out is not None else None
    problem = out and unwritable(out)
    if problem:
        return _refuse(f"--out {args.out}: {problem}")
    try:
        runs = compare(collect(args.paths))
    except FileNotFoundError as e:
        return _refuse(str(e))
    if not runs:
        print("compare_runs: no runs found (no summary.json or .wandb file) under "
              + ", ".join(args.paths), file=sys.stderr)
        return 1
    if out is None:
        folder = beside_the_runs(args.paths, runs)
        if folder is None:
            return _refuse("the runs lie in unrelated folders (the one holding them all is the current "
                           "directory or /): say where the comparison goes with --out <folder>")
        out = folder / JSON_NAME
        problem = unwritable(out)
        if problem:
            return _refuse(f"cannot write beside the runs ({problem}): give --out")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _refuse(f"cannot create {out.parent}: {e.strerror}")
    standing = status_lines(runs)
    if not compared(runs):
        print(format_table(runs))
        print("\n" + "\n".join(standing), file=sys.stderr)
        print("compare_runs: no finished run to compare yet: nothing was written; run it again once "
              "the runs have finished", file=sys.stderr)
        return 1
    verdict_list = verdicts(runs)
    print(format_table(runs))
    if standing:
        print("\n" + "\n".join(standing))
    lines = [v["text"] for v in verdict_list] + unjudged(runs)
    if lines:
        print("\n" + "\n".join(lines))
    speed = throughput_verdicts(runs)
    if speed:
        print("\n" + "\n".join(v["text"] for v in speed))
    numerics = format_numerics(runs)
    if numerics:
        print("\n" + numerics)
    plots = write_plots(runs, out.parent, verdict_list)
    out.write_text(json.dumps(to_json(runs, verdict_list, plots), indent=2))
    print(f"\nwrote {out}, " + ", ".join(str(out.parent / p["file"]) for p in plots.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
