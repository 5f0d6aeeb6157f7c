"""One launch per run folder: who is training a run, and the refusal of a second launch into it.

A launch holds its run folder in ``<run dir>/.training`` (JSON): the host and pid of the
launching process, and, once a SLURM job was submitted for it, the job id. The file lies in
the run folder, so launches on different nodes of a shared filesystem see it. A hold is live
while:

* its SLURM job is queued or running (``squeue`` lists it: ``launch.run.slurm_jobs``);
* without a job, its process is alive on this host;
* without a job, on another host: that cannot be checked from here, so it counts as live (the
  message says which file to remove when no process trains the run).

A second launch into a live hold (a resume, a sweep finishing its points, a new run) is refused
before anything starts, naming the holder (:func:`check_free`, :func:`take`); a stale hold (its
process gone, its job ended) is taken over with a line that says so. The launching process
releases its hold when its launch ends (:func:`release`); a SLURM launch hands the hold to its
job (:func:`hand_to_job`), which releases it when it ends (:func:`release_job`); a requeued job
keeps it.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from launch.config.problems import ConfigError
from launch.run import slurm_jobs

HOLD = ".training"


def this_host() -> str:
    return socket.gethostname()


@dataclass(frozen=True)
class Hold:
    """Who trains a run: a process (``host``, ``pid``) and/or a SLURM job (``job_id``)."""

    host: str
    pid: Optional[int] = None
    job_id: Optional[str] = None

    @property
    def who(self) -> str:
        """``SLURM job 33`` / ``pid 123 on node7``."""
        return f"SLURM job {self.job_id}" if self.job_id else f"pid {self.pid} on {self.host}"

    def is_mine(self) -> bool:
        return self.job_id is None and self.host == this_host() and self.pid == os.getpid()


def read(run_dir: str | Path) -> Optional[Hold]:
    """The hold recorded in ``run_dir``; None when there is none (or it cannot be read)."""
    try:
        data = json.loads((Path(run_dir) / HOLD).read_text())
        return Hold(str(data["host"]), data.get("pid"), data.get("job_id"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pid_alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:  # a zombie has ended: it only waits for its parent to read its exit code
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


def state(hold: Hold) -> Optional[str]:
    """How the holder stands: ``queued`` / ``running`` (its SLURM job), ``running`` (its process
    alive here), ``unknown`` (it cannot be checked from here: counts as live), None when it is
    gone (a stale hold)."""
    if hold.job_id:
        queued = slurm_jobs.queue_state(hold.job_id)
        if queued is None:  # SLURM cannot be asked from here
            return "running" if hold.host == this_host() and _pid_alive(hold.pid) else "unknown"
        if not slurm_jobs.is_active(queued):
            return None
        return "queued" if queued in slurm_jobs.QUEUED else "running"
    if hold.host == this_host():
        return "running" if _pid_alive(hold.pid) else None
    return "unknown"


def held_message(run_dir: str | Path, hold: Hold, how: str) -> str:
    """The refusal of a launch into ``run_dir`` while ``hold`` is live (``how``: its state)."""
    run = Path(run_dir)
    if hold.job_id:
        status = "queued" if how == "queued" else "running"
        fix = (f"Wait for the job to end (`squeue -j {hold.job_id}`), or stop it (`scancel {hold.job_id}`; a "
               f"running job saves a checkpoint first)")
        if how == "unknown":
            status, fix = "state unknown: SLURM cannot be asked from here", (
                f"check it where SLURM answers (`squeue -j {hold.job_id}`); if it has ended, remove {run / HOLD}")
        return f"{run} is being trained by {hold.who} ({status}); nothing was started. {fix}"
    if how == "unknown":
        return (f"{run} is being trained by {hold.who}, which cannot be checked from {this_host()}; nothing "
                f"was started. If no process trains it any more, remove {run / HOLD}")
    return (f"{run} is being trained by {hold.who}; nothing was started. Wait for it to end, or stop it "
            f"(Ctrl-C in its terminal, or `kill {hold.pid}`: it saves a checkpoint first)")


def live_hold(run_dir: str | Path) -> Optional[tuple[Hold, str]]:
    """The live hold on ``run_dir`` and its state; None when it is free (no hold, a stale one,
    or this process's own)."""
    hold = read(run_dir)
    if hold is None or hold.is_mine():
        return None
    how = state(hold)
    return None if how is None else (hold, how)


def check_free(run_dir: str | Path) -> None:
    """Raise :class:`ConfigError` naming the holder when ``run_dir`` is being trained."""
    live = live_hold(run_dir)
    if live is not None:
        raise ConfigError([held_message(run_dir, *live)])


def take(run_dir: str | Path) -> Optional[str]:
    """Hold ``run_dir`` for this process (the folder exists). Raises :class:`ConfigError`
    naming the holder when it is held; returns the line that says a stale hold was taken over,
    else None."""
    path = Path(run_dir) / HOLD
    mine = Hold(this_host(), os.getpid())
    try:
        with path.open("x") as f:
            f.write(json.dumps(asdict(mine)))
        return None
    except FileExistsError:
        pass
    stale = read(run_dir)
    if stale is not None and stale.is_mine():
        return None
    if stale is not None:
        how = state(stale)
        if how is not None:
            raise ConfigError([held_message(run_dir, stale, how)])
    _write(path, mine)
    if read(run_dir) != mine:  # another launch took it over in the same moment
        check_free(run_dir)
    gone = "has ended" if stale is not None and stale.job_id else "is gone"
    return (f"[mxfp8ep] {run_dir}: took over the hold of {stale.who if stale else 'an unreadable record'} "
            f"({'it ' + gone if stale else 'no one holds it'})")


def _write(path: Path, hold: Hold) -> None:
    tmp = path.with_name(f"{HOLD}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(hold)))
    os.replace(tmp, path)  # readers never see half a file


def hand_to_job(run_dir: str | Path, job_id: str) -> None:
    """This process's hold on ``run_dir`` passes to the SLURM job it submitted, which may run
    after this process has ended."""
    hold = read(run_dir)
    if hold is None or hold.is_mine():
        _write(Path(run_dir) / HOLD, Hold(this_host(), None, str(job_id)))


def release(run_dir: str | Path) -> None:
    """This process's launch into ``run_dir`` ended: its hold goes (a job's stays the job's)."""
    hold = read(run_dir)
    if hold is not None and hold.is_mine():
        (Path(run_dir) / HOLD).unlink(missing_ok=True)


def release_job(run_dir: str | Path, job_id: str) -> None:
    """SLURM job ``job_id`` ended its training of ``run_dir``: its hold goes."""
    hold = read(run_dir)
    if hold is not None and hold.job_id == str(job_id):
        (Path(run_dir) / HOLD).unlink(missing_ok=True)
