"""A ``--multirun`` sweep that stopped can be finished in its own folder.

A stopped sweep (Ctrl-C, a failed point) names the points that did not run and the one
command that finishes it: the same command line with ``hydra.sweep.dir=<its folder>``. Run in
a folder that holds the sweep's runs, each point is one of (:func:`point_state`):

* ``done``: its run completed; it is not run again;
* ``resume``: its run was cut with a checkpoint; it resumes from it (``training.resume``);
* ``again``: its run was cut before a checkpoint (or failed); that run moves to
  ``<sweep dir>.cut/`` (kept, not overwritten) and the point starts anew;
* ``new``: it has no run yet; it starts;
* ``held``: another launch is training its run (a SLURM job queued or running, a live process:
  ``launch.run.run_lock``); it is left alone: not moved, not resumed, not submitted again.

Hydra's basic launcher runs the points one after another in this process: the callback
``launch.preflight.callbacks.CheckEverySweepPoint`` records the sweep (:func:`begin`) and each job
asks for its point's state.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from launch.run.run_dir import RUN_CONFIG, checkpoint_steps, free_folder
from launch.run.run_lock import live_hold
from launch.run.run_summary import RunSummary

DONE, RESUME, AGAIN, NEW, HELD = "done", "resume", "again", "new", "held"


@dataclass
class Point:
    num: int
    shown: str  # its overrides, as the console names it
    folder: str  # its run's folder name under the sweep dir


@dataclass
class Sweep:
    dir: Path
    points: list[Point]
    checkpoint_folder: str

    def finish_command(self) -> str:
        """The command line that made this sweep, with its folder named (``hydra.sweep.dir``)."""
        args = [a for a in sys.argv[1:] if not a.lstrip("+").startswith("hydra.sweep.dir=")]
        return " ".join(["python", shlex.quote(sys.argv[0]), *map(shlex.quote, args),
                         shlex.quote(f"hydra.sweep.dir={self.dir}")])


_current: Optional[Sweep] = None


def begin(sweep: Sweep) -> None:
    global _current
    _current = sweep


def point_state(folder: Path, checkpoint_folder: str) -> tuple[str, Optional[int | str]]:
    """What the folder of a sweep point holds: (state, the step it reached or resumes from; for
    ``held``, who trains it and how: "SLURM job 33 (queued)")."""
    live = live_hold(folder) if folder.is_dir() else None
    if live is not None:
        hold, how = live
        return HELD, f"{hold.who} ({how})"
    if not (folder / RUN_CONFIG).is_file():
        return NEW, None
    s = RunSummary.read(folder)
    if s is not None and s.steps >= s.target_steps and not s.stopped_by:
        return DONE, s.steps
    steps = checkpoint_steps(folder, checkpoint_folder)
    if steps:
        return RESUME, steps[-1]
    return AGAIN, s.steps if s is not None else None


def _described(state: str, step: Optional[int | str]) -> str:
    return {DONE: f"done (step {step})", RESUME: f"resumes from its checkpoint of step {step}",
            AGAIN: "cut before a checkpoint: starts anew (the cut run moves to <sweep dir>.cut/)",
            NEW: "starts", HELD: f"being trained by {step}: left alone"}[state]


def prepare_folder(sweep: Sweep) -> list[str]:
    """Before the first job of a sweep into a folder that holds runs: move the runs that cannot be
    resumed aside; the problems that refuse the folder (runs of points this sweep does not have)."""
    names = {p.folder for p in sweep.points}
    strangers = sorted(f.parent.name for f in sweep.dir.glob(f"*/{RUN_CONFIG}") if f.parent.name not in names)
    if strangers:
        return [f"hydra.sweep.dir={sweep.dir} holds runs that are no point of this sweep ({', '.join(strangers)}): "
                f"finish a sweep with the command line that started it, or choose another folder"]
    lines = []
    for p in sweep.points:
        folder = sweep.dir / p.folder
        state, step = point_state(folder, sweep.checkpoint_folder)
        if state == AGAIN:
            cut = Path(free_folder(f"{sweep.dir}.cut", p.folder))
            cut.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(folder), str(cut))
        lines.append(f"#{p.num} ({p.shown}) {_described(state, step)}")
    print(f"[mxfp8ep] finishing the sweep in {sweep.dir}: {'; '.join(lines)}", flush=True)
    return []


def unfinished(num: int) -> Optional[str]:
    """After job ``num`` of the current sweep ended it: the points that did not run, and the
    command that finishes the sweep (None outside a sweep)."""
    if _current is None:
        return None
    s = _current
    left = []
    for p in s.points[num:]:
        state, step = point_state(s.dir / p.folder, s.checkpoint_folder)
        if state == DONE:
            continue
        how = {RESUME: f"cut at a checkpoint of step {step}", AGAIN: "cut before a checkpoint",
               NEW: "not started", HELD: f"being trained by {step}"}[state]
        left.append(f"#{p.num} ({p.shown}, {how})")
    return (f"[mxfp8ep] the sweep stopped: {len(left)} of its {len(s.points)} points did not run: "
            f"{', '.join(left)}\n[mxfp8ep] finish it (done points are kept, cut ones resumed where "
            f"they have a checkpoint, the rest started) with: {s.finish_command()}")
