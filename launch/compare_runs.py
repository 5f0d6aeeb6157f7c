"""Compare finished runs: bf16 vs MXFP8 all-to-all, side by side.

    python launch/compare_runs.py multirun/default/2026-11-30_10-00-00     # a sweep (JSON
                                                                           # written inside it)
    python launch/compare_runs.py outputs/a/run1 outputs/b/run2 --out cmp.json
    python launch/compare_runs.py path/to/wandb/offline-run-*              # wandb runs only

Each argument may be a run directory (with ``summary.json`` and/or ``wandb/``), a sweep
directory holding run directories, an ``offline-run-*`` directory or a ``.wandb`` file.
Runs are read from their ``summary.json`` when they have one, otherwise from the offline wandb
run (``launch/wandb_offline.py``), so SLURM runs that were never waited for work too. Every
run is compared with the bf16 run of the same model, world size and EP degree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from launch.summary import SUMMARY_FILE, metrics_from_history
from launch.wandb_offline import find_runs, read_run

BASELINE = "bf16"
_RUN_CONFIG = "train_config.yaml"


@dataclass
class RunRecord:
    name: str
    a2a: str
    model: str
    world_size: Optional[int]
    ep: Optional[int]
    path: str
    source: str  # "summary" | "wandb"
    metrics: dict[str, Any] = field(default_factory=dict)
    # filled by compare():
    vs_baseline: dict[str, Any] = field(default_factory=dict)

    @property
    def group_key(self) -> tuple:
        return (self.model, self.world_size, self.ep)

    @property
    def pair_key(self) -> tuple:
        """group_key + the run name without its a2a part: the runs of one sweep point."""
        rest = ",".join(t for t in self.name.split(",") if not t.startswith(("a2a=", "a2a.")))
        return self.group_key + (rest,)


def _from_summary(path: Path) -> RunRecord:
    s = json.loads(path.read_text())
    metrics = dict(s.get("metrics", {}))
    wandb_dirs = [d for d in s.get("wandb_dirs", []) if os.path.isdir(d)]
    if wandb_dirs and any(metrics.get(k) is None for k in ("final_loss", "tokens_per_s")):
        from_wandb = metrics_from_history(read_run(wandb_dirs[-1]))
        metrics = {**from_wandb, **{k: v for k, v in metrics.items() if v is not None}}
    return RunRecord(
        name=s.get("run_name") or path.parent.name,
        a2a=s.get("a2a", "?"),
        model=s.get("model", "?"),
        world_size=s.get("world_size"),
        ep=s.get("ep"),
        path=str(path.parent),
        source="summary",
        metrics=metrics,
    )


def _recipe_config(run_wandb_dir: str, wandb_config: dict) -> dict:
    """The composed recipe config: logged to wandb under "recipe" by the runner, else the
    train_config.yaml the launcher wrote into the run dir above the wandb folder."""
    if isinstance(wandb_config.get("recipe"), dict):
        return wandb_config["recipe"]
    for parent in Path(run_wandb_dir).parents:
        candidate = parent / _RUN_CONFIG
        if candidate.is_file():
            from omegaconf import OmegaConf

            return OmegaConf.to_container(OmegaConf.load(candidate), resolve=True)  # type: ignore[return-value]
    return {}


def _from_wandb(run_dir: str) -> RunRecord:
    run = read_run(run_dir)
    cfg = _recipe_config(run_dir, run.config)
    par = cfg.get("parallelism", {})
    world = par["nodes"] * par["procs_per_node"] if "nodes" in par and "procs_per_node" in par else None
    return RunRecord(
        name=run.name or os.path.basename(run_dir),
        a2a=cfg.get("a2a", {}).get("name", "?"),
        model=cfg.get("model", {}).get("name", "?"),
        world_size=world,
        ep=par.get("ep"),
        path=run_dir,
        source="wandb",
        metrics=metrics_from_history(run),
    )


def collect(paths: list[str]) -> list[RunRecord]:
    """Every run found under ``paths`` (see module doc), each once."""
    records: list[RunRecord] = []
    seen: set[str] = set()

    def add_wandb(d: str) -> None:
        d = os.path.realpath(d)
        if d not in seen:
            seen.add(d)
            records.append(_from_wandb(d))

    for arg in paths:
        p = Path(arg)
        if p.is_file() and p.suffix == ".wandb":
            add_wandb(str(p.parent))
            continue
        if not p.is_dir():
            raise FileNotFoundError(f"{arg}: no such run, sweep or wandb directory")
        summaries = sorted(p.rglob(SUMMARY_FILE))
        for s in summaries:
            rec = _from_summary(s)
            seen.update(os.path.realpath(d) for d in json.loads(s.read_text()).get("wandb_dirs", []))
            records.append(rec)
        for d in find_runs(str(p)):
            add_wandb(d)
    return records


def _ratio(x: Any, base: Any) -> Optional[float]:
    if x is None or base in (None, 0):
        return None
    return float(x) / float(base)


def compare(records: list[RunRecord]) -> list[RunRecord]:
    """Fill ``vs_baseline`` of each run from its bf16 run: the one whose name differs only in
    the a2a part, else the first bf16 run of the same model, world size and EP."""
    pairs: dict[tuple, RunRecord] = {}
    groups: dict[tuple, RunRecord] = {}
    for r in records:
        if r.a2a == BASELINE:
            pairs.setdefault(r.pair_key, r)
            groups.setdefault(r.group_key, r)
    for r in records:
        base = pairs.get(r.pair_key) or groups.get(r.group_key)
        if base is None:
            continue
        m, b = r.metrics, base.metrics
        loss, base_loss = m.get("final_loss"), b.get("final_loss")
        r.vs_baseline = {
            "baseline": base.name,
            "loss_delta": None if loss is None or base_loss is None else loss - base_loss,
            "tokens_per_s_ratio": _ratio(
                m.get("tokens_per_s_global", m.get("tokens_per_s")),
                b.get("tokens_per_s_global", b.get("tokens_per_s")),
            ),
            "step_time_ratio": _ratio(m.get("step_time_s"), b.get("step_time_s")),
            "bytes_ratio": _ratio(m.get("a2a_bytes_per_step"), b.get("a2a_bytes_per_step")),
        }
    return records


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(records: list[RunRecord]) -> str:
    header = ("run", "a2a", "model", "world/ep", "final loss", "Δloss", "tokens/s", "×bf16",
              "step s", "a2a MiB/step", "×bf16")
    rows = [header]
    for r in sorted(records, key=lambda r: (repr(r.pair_key), r.a2a != BASELINE, r.a2a, r.name)):
        m, v = r.metrics, r.vs_baseline
        rows.append((
            r.name,
            r.a2a,
            r.model,
            f"{r.world_size or '?'}/{r.ep or '?'}",
            _f(m.get("final_loss"), ".4f"),
            _f(v.get("loss_delta"), "+.4f") if r.a2a != BASELINE else "",
            _f(m.get("tokens_per_s_global", m.get("tokens_per_s")), ",.0f"),
            _f(v.get("tokens_per_s_ratio"), ".3f") if r.a2a != BASELINE else "",
            _f(m.get("step_time_s"), ".4f"),
            _f(None if m.get("a2a_bytes_per_step") is None else m["a2a_bytes_per_step"] / 2**20, ".3f"),
            _f(v.get("bytes_ratio"), ".3f") if r.a2a != BASELINE else "",
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i < 4 else str(c).rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def to_json(records: list[RunRecord]) -> dict[str, Any]:
    out = []
    for r in records:
        d = asdict(r)
        d["metrics"] = {k: v for k, v in r.metrics.items() if k != "loss_series"}
        d["loss_series"] = r.metrics.get("loss_series")
        out.append(d)
    return {"baseline": BASELINE, "runs": out}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run / sweep / offline wandb run directories")
    ap.add_argument("--out", default=None,
                    help="JSON output (default: <dir>/comparison.json for one directory, "
                         "else ./comparison.json)")
    args = ap.parse_args(argv)
    try:
        records = compare(collect(args.paths))
    except FileNotFoundError as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    if not records:
        print("compare_runs: no runs found (no summary.json or .wandb file) under "
              + ", ".join(args.paths), file=sys.stderr)
        return 1
    print(format_table(records))
    if args.out is None:
        only = Path(args.paths[0])
        args.out = str(only / "comparison.json") if len(args.paths) == 1 and only.is_dir() else "comparison.json"
    with open(args.out, "w") as f:
        json.dump(to_json(records), f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
