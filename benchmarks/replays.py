"""The symm transport's capacity replays over training runs, as rows (bench ``capacity_replays``).

    python -m benchmarks.replays RUN_DIR... --out OUT
    python -m benchmarks.replays EXPORT_DIR --out OUT --like ROWS.jsonl --command "..."   # runs made elsewhere

Each run: a run dir (``summary.json``, ``console.log``), or in an export folder a pair
``<run>.summary.json`` / ``<run>.console.log``, or a ``<run>.console.log`` alone (a run cut off
with its machine before it wrote a summary: its row says ``cut_off``, takes its steps and last
validation loss from the console lines, its preset and seed from a name like
``scripts/parity_study.py``'s arms, ``<preset>[_seed<k>]``, and the rest from ``--set``).
Per run: the steps it trained, the steps run again after a capacity overflow
(``capacity_replay_steps``, the last one), those past the ceiling (``capacity_spills``), the
capacity it started at, ended at and may grow to (expert rows: from the console's replay lines
and the summary), the routing telemetry's loads (``moe_imbalance``), its last validation loss,
its peak memory per rank (``max_memory_gib``) and a digest of its losses (``losses_sha256``:
equal digests, the same losses bit for bit).
``--like``: rows of the machine and session the runs were made in, whose machine and versions
these rows take (with ``--command``, the command that ran them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

from benchmarks.rows import Machine, ResultsFile, read_rows
from launch.run.run_dir import CONSOLE_LOG, SUMMARY

STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s+loss ")
VAL_LINE = re.compile(r"^step\s+(\d+)/\d+\s+val loss ([\d.]+)")
ARM_NAME = re.compile(r"^(?P<a2a>.+?)(?:_seed(?P<seed>\d+))?$")
REPLAY_LINE = re.compile(r"^step (\d+): a symm dispatch needed more expert rows than its capacity; "
                         r"capacity grown \(([\d,]+) -> ([\d,]+)")  # the first dispatch's, where several grew


EXPORTED = (".summary.json", ".console.log")  # an export folder's files of a run, by its name


def runs_in(path: Path) -> dict[str, tuple[Path, Path]]:
    """Run name -> (summary, console log) of a run dir or of an export folder's runs, each with
    either file or both (a path that does not exist: the run has no such file)."""
    if (path / SUMMARY).is_file():
        return {path.name: (path / SUMMARY, path / CONSOLE_LOG)}
    names = {p.name.removesuffix(suffix) for suffix in EXPORTED for p in path.glob(f"*{suffix}")}
    return {name: tuple(path / f"{name}{suffix}" for suffix in EXPORTED) for name in sorted(names)}


def run_row(name: str, summary_path: Path, console_path: Path, fill: dict | None = None) -> dict:
    """A run's row; ``fill``: the summary fields of a run without one that its console lines do
    not give (``--set``)."""
    lines = console_path.read_text().splitlines() if console_path.is_file() else []
    grown = [m for m in map(REPLAY_LINE.match, lines) if m]
    s = (json.loads(summary_path.read_text()) if summary_path.is_file()
         else {**(fill or {}), **_from_console(name, lines, grown)})
    steps = s.get("capacity_replay_steps", [])
    return {
        "run": name, "model": s.get("model"), "a2a": s["a2a"], "seed": s.get("seed"), "ep": s.get("ep"),
        "steps": s["steps"], "capacity_replays": s.get("capacity_replays", 0), "capacity_replay_steps": steps,
        "last_replay_step": steps[-1] if steps else None,
        "start_capacity_rows": int(grown[0].group(2).replace(",", "")) if grown else s.get("capacity_rows"),
        "capacity_rows": s.get("capacity_rows"), "capacity_ceiling_rows": s.get("capacity_ceiling_rows"),
        "capacity_spills": s.get("capacity_spills", 0), "capacity_spill_steps": s.get("capacity_spill_steps", []),
        "moe_imbalance": s.get("moe_imbalance") or None,
        "val_step": s["val_logged_steps"][-1] if s.get("val_logged_steps") else None,
        "val_loss": s.get("final_val_loss"), "gpu_shared": s.get("gpu_shared", False),
        "max_memory_gib": s.get("max_memory_gib"), "losses_sha256": losses_digest(s.get("losses")),
        **({"cut_off": True} if s.get("cut_off") else {}),
    }


def losses_digest(losses: list[float] | None) -> str | None:
    """A run's logged losses as one hash: two runs with the same digest trained to the same
    losses, bit for bit (floats as JSON writes them: Python's shortest round-trip repr)."""
    if not losses:
        return None
    return hashlib.sha256(json.dumps(losses).encode()).hexdigest()


def _from_console(name: str, lines: list[str], grown: list[re.Match]) -> dict:
    """A summary's fields that a run's console lines give (module docstring)."""
    steps = [int(m.group(1)) for m in map(STEP_LINE.match, lines) if m]
    vals = [(int(m.group(1)), float(m.group(2))) for m in map(VAL_LINE.match, lines) if m]
    arm = ARM_NAME.match(name)
    return {"a2a": arm.group("a2a"), "seed": int(arm.group("seed") or 0), "steps": max(steps, default=0),
            "capacity_replays": len(grown), "capacity_replay_steps": [int(m.group(1)) for m in grown],
            "capacity_rows": int(grown[-1].group(3).replace(",", "")) if grown else None,
            "val_logged_steps": [v[0] for v in vals], "final_val_loss": vals[-1][1] if vals else None,
            "cut_off": True}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run dirs or export folders")
    parser.add_argument("--out", required=True)
    parser.add_argument("--like", type=Path, help="a rows file of the machine and session the runs were made in")
    parser.add_argument("--command", help="the command that ran them (with --like)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="a field that runs without a summary do not give (e.g. ep=2, gpu_shared=true)")
    args = parser.parse_args(argv)
    provenance = {}
    if args.like:
        like = read_rows(args.like)[0]
        provenance = {"machine": Machine(**like["machine"]), "versions": like["versions"],
                      "command": args.command or like["command"]}
    fixed = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    rows = [run_row(name, *paths, fill=fixed) for path in args.runs for name, paths in runs_in(path).items()]
    results = ResultsFile("capacity_replays", args.out, **provenance)
    for row in rows:
        results.write(**row)
        print(f"{row['run']}: {row['steps']} steps, {row['capacity_replays']} replays at "
              f"{row['capacity_replay_steps']}, {row['capacity_spills']} spills, capacity "
              f"{row['start_capacity_rows']} -> {row['capacity_rows']} rows (ceiling {row['capacity_ceiling_rows']})")
    print(f"wrote {len(rows)} rows to {results.path}")


if __name__ == "__main__":
    main()
