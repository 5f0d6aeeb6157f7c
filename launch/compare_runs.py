"""Compare finished runs: bf16 vs MXFP8 all-to-all, side by side, in a table, a JSON file and
plots.

    python launch/compare_runs.py multirun/default/2026-11-30_10-00-00     # a sweep
    python launch/compare_runs.py outputs/a/run1 outputs/b/run2 --out cmp.json
    python launch/compare_runs.py path/to/wandb/offline-run-*              # wandb runs only

Each argument may be a run directory (with ``summary.json`` and/or ``wandb/``), a sweep
directory holding run directories, an ``offline-run-*`` directory or a ``.wandb`` file.
Runs are read as ``launch.run_summary.RunSummary``: from their ``summary.json`` when they
have one, otherwise from their offline wandb run(s), so SLURM runs that never wrote one are
compared too. Every run is compared with the bf16 run of the same sweep point (else of the
same model, world size and EP degree). Next to the JSON (``<dir>/comparison.json`` for one
directory) go ``comparison_loss.png`` (loss per step, one line per run) and
``comparison_throughput.png`` (tokens/s and all-to-all bytes per step, one bar per run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from launch.run_dir import RUN_CONFIG, SUMMARY
from launch.run_summary import RunSummary
from launch.wandb_offline import OfflineRun, read_run, read_runs

BASELINE = "bf16"


@dataclass
class Compared:
    """A run, where it was read from, and its ratios to its bf16 baseline."""

    run: RunSummary
    path: str
    source: str  # "summary" | "wandb"
    vs_baseline: dict[str, Any] = field(default_factory=dict)

    @property
    def group_key(self) -> tuple:
        return (self.run.model, self.run.world_size, self.run.ep)

    @property
    def pair_key(self) -> tuple:
        """group_key + the run name without its a2a part: the runs of one sweep point."""
        rest = ",".join(t for t in self.run.run_name.split(",") if not t.startswith(("a2a=", "a2a.")))
        return self.group_key + (rest,)


def _recipe_config(run: OfflineRun) -> dict:
    """The composed recipe config: logged to wandb under "recipe" by the runner, else the
    train_config.yaml the launcher wrote into the run dir above the wandb folder."""
    if isinstance(run.config.get("recipe"), dict):
        return run.config["recipe"]
    for parent in Path(run.path).parents:
        candidate = parent / RUN_CONFIG
        if candidate.is_file():
            from omegaconf import OmegaConf

            return OmegaConf.to_container(OmegaConf.load(candidate), resolve=True)  # type: ignore[return-value]
    return {}


def collect(paths: list[str]) -> list[Compared]:
    """Every run found under ``paths`` (see module doc), each once."""
    found: list[Compared] = []
    seen: set[str] = set()  # wandb folders already covered by a summary

    def add_wandb(run: OfflineRun) -> None:
        if not seen.intersection(os.path.realpath(p) for p in run.paths):
            seen.update(os.path.realpath(p) for p in run.paths)
            where = str(Path(run.paths[0]))
            found.append(Compared(RunSummary.from_wandb(run, _recipe_config(run), where), where, "wandb"))

    for arg in paths:
        p = Path(arg)
        if p.is_file() and p.suffix == ".wandb":
            add_wandb(read_run(str(p.parent)))
            continue
        if not p.is_dir():
            raise FileNotFoundError(f"{arg}: no such run, sweep or wandb directory")
        for summary_file in sorted(p.rglob(SUMMARY)):
            s = RunSummary.read(summary_file)
            if s is None:  # unreadable: its wandb run, if any, stands in below
                continue
            seen.update(os.path.realpath(d) for d in s.wandb_dirs)
            found.append(Compared(s, str(summary_file.parent), "summary"))
        for run in read_runs(str(p)):
            add_wandb(run)
    return found


def _ratio(x: Any, base: Any) -> Optional[float]:
    if x is None or base in (None, 0):
        return None
    return float(x) / float(base)


def compare(runs: list[Compared]) -> list[Compared]:
    """Fill ``vs_baseline`` of each run from its bf16 run: the one whose name differs only in
    the a2a part, else the first bf16 run of the same model, world size and EP."""
    pairs: dict[tuple, Compared] = {}
    groups: dict[tuple, Compared] = {}
    for c in runs:
        if c.run.a2a == BASELINE:
            pairs.setdefault(c.pair_key, c)
            groups.setdefault(c.group_key, c)
    for c in runs:
        base = pairs.get(c.pair_key) or groups.get(c.group_key)
        if base is None:
            continue
        m, b = c.run, base.run
        c.vs_baseline = {
            "baseline": b.run_name,
            "loss_delta": None if m.final_loss is None or b.final_loss is None
            else m.final_loss - b.final_loss,
            "tokens_per_s_ratio": _ratio(m.tokens_per_s_global, b.tokens_per_s_global),
            "step_time_ratio": _ratio(m.step_time_s, b.step_time_s),
            "bytes_ratio": _ratio(m.a2a_bytes_per_step, b.a2a_bytes_per_step),
        }
    return runs


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def ordered(runs: list[Compared]) -> list[Compared]:
    """Sweep point by sweep point, bf16 first."""
    return sorted(runs, key=lambda c: (repr(c.pair_key), c.run.a2a != BASELINE, c.run.a2a, c.run.run_name))


def format_table(runs: list[Compared]) -> str:
    header = ("run", "a2a", "model", "world/ep", "final loss", "Δloss", "tokens/s", "×bf16",
              "step s", "a2a MiB/step", "×bf16")
    rows = [header]
    for c in ordered(runs):
        s, v, base = c.run, c.vs_baseline, c.run.a2a == BASELINE
        rows.append((
            s.run_name,
            s.a2a,
            s.model,
            f"{s.world_size or '?'}/{s.ep or '?'}",
            _f(s.final_loss, ".4f"),
            "" if base else _f(v.get("loss_delta"), "+.4f"),
            _f(s.tokens_per_s_global, ",.0f"),
            "" if base else _f(v.get("tokens_per_s_ratio"), ".3f"),
            _f(s.step_time_s, ".4f"),
            _f(None if s.a2a_bytes_per_step is None else s.a2a_bytes_per_step / 2**20, ".3f"),
            "" if base else _f(v.get("bytes_ratio"), ".3f"),
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i < 4 else str(c).rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def to_json(runs: list[Compared]) -> dict[str, Any]:
    return {"baseline": BASELINE, "runs": [
        {"path": c.path, "source": c.source, "vs_baseline": c.vs_baseline, **dataclasses.asdict(c.run)}
        for c in ordered(runs)
    ]}


def write_plots(runs: list[Compared], out_dir: Path) -> list[Path]:
    """``comparison_loss.png`` and ``comparison_throughput.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = ordered(runs)
    labels = [c.run.run_name for c in runs]

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for c, label in zip(runs, labels):
        ax.plot(c.run.logged_steps, c.run.losses, marker="." if len(c.run.losses) < 50 else None,
                linestyle="-" if c.run.a2a == BASELINE else "--", label=label)
    ax.set(xlabel="step", ylabel="loss (global average)", title="Loss per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    loss = out_dir / "comparison_loss.png"
    fig.tight_layout()
    fig.savefig(loss, dpi=120)
    plt.close(fig)

    fig, (tps, wire) = plt.subplots(1, 2, figsize=(10, 0.5 * len(runs) + 2.5))
    ys = range(len(runs))
    colors = ["tab:blue" if c.run.a2a == BASELINE else "tab:orange" for c in runs]
    tps.barh(ys, [c.run.tokens_per_s_global or 0 for c in runs], color=colors)
    tps.set(yticks=list(ys), yticklabels=labels, xlabel="tokens/s (all ranks)", title="Throughput")
    wire.barh(ys, [(c.run.a2a_bytes_per_step or 0) / 2**20 for c in runs], color=colors)
    wire.set(yticks=list(ys), yticklabels=[], xlabel="MiB per step", title="All-to-all bytes")
    for ax in (tps, wire):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    throughput = out_dir / "comparison_throughput.png"
    fig.tight_layout()
    fig.savefig(throughput, dpi=120)
    plt.close(fig)
    return [loss, throughput]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run / sweep / offline wandb run directories")
    ap.add_argument("--out", default=None,
                    help="JSON output (default: <dir>/comparison.json for one directory, "
                         "else ./comparison.json); the plots go next to it")
    args = ap.parse_args(argv)
    try:
        runs = compare(collect(args.paths))
    except FileNotFoundError as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    if not runs:
        print("compare_runs: no runs found (no summary.json or .wandb file) under "
              + ", ".join(args.paths), file=sys.stderr)
        return 1
    print(format_table(runs))
    if args.out is None:
        only = Path(args.paths[0])
        args.out = str(only / "comparison.json") if len(args.paths) == 1 and only.is_dir() else "comparison.json"
    out = Path(args.out)
    out.write_text(json.dumps(to_json(runs), indent=2))
    plots = write_plots(runs, out.parent)
    print(f"\nwrote {out}, " + ", ".join(str(p) for p in plots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
