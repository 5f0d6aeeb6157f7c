"""One launch per run folder (launch/run/run_lock.py): a run folder a live process or a queued or
running SLURM job trains refuses a second launch into it (a resume, a new run, a sweep finishing
its points) before anything starts, naming the holder; a stale hold (a process that is gone, a
job that ended) is taken over with a line that says so. The SLURM jobs here are a fake
``squeue`` on PATH; tests/slurm/test_train_slurm.py has the real cluster's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.hydra_compose import no_slurm_cluster  # noqa: F401 (autouse)
from tests.launch_recorder import LAUNCHED
from tests.test_resume import RECORDER, RUN, make_run
from tests.train_cli import run_train

from launch.config.problems import ConfigError
from launch.run import run_lock
from launch.run.run_lock import HOLD, Hold, this_host


@pytest.fixture
def live_pid():
    """A process that lives for the test (a launch training elsewhere)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has ended (a launch killed outright)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def hold(run_dir: Path, **fields) -> None:
    (run_dir / HOLD).write_text(json.dumps({"host": this_host(), **fields}))


@pytest.fixture
def squeue(tmp_path, monkeypatch):
    """A fake ``squeue`` on PATH that lists job 33 in the state ``set(state)`` gives ("" for a job
    SLURM no longer knows)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "squeue_state"

    def set_state(value: str) -> None:
        state.write_text(value)
        script = (f'#!/bin/sh\nstate=$(cat {state})\nif [ -z "$state" ]; then echo "slurm_load_jobs error: '
                  f'Invalid job id specified" >&2; exit 1; fi\necho "$state"\n')
        (bin_dir / "squeue").write_text(script)
        (bin_dir / "squeue").chmod(0o755)

    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return set_state


def test_a_resume_of_a_run_a_live_process_trains_is_refused_before_anything_starts(tmp_path, live_pid):
    run = tmp_path / "run"
    make_run(run, *RUN)
    hold(run, pid=live_pid)
    before = sorted(p.name for p in run.iterdir())
    proc = run_train(tmp_path, RECORDER, f"training.resume={run}", "training.steps=12", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"  - {run} is being trained by pid {live_pid} on {this_host()}; nothing was started. Wait for it "
            f"to end, or stop it (Ctrl-C in its terminal, or `kill {live_pid}`") in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == before  # no resumes/1, no launch
    assert not (run / LAUNCHED).exists()
    # a new run into the folder: the holder is named too, not only "already holds a run"
    proc = run_train(tmp_path, RECORDER, *RUN, f"hydra.run.dir={run}", timeout=120)
    assert proc.returncode == 2 and f"is being trained by pid {live_pid}" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in run.iterdir()) == before


def test_the_hold_of_a_process_that_is_gone_is_taken_over(tmp_path, dead_pid):
    run = tmp_path / "run"
    make_run(run, *RUN)
    hold(run, pid=dead_pid)
    proc = run_train(tmp_path, RECORDER, f"training.resume={run}", "training.steps=12", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[mxfp8ep] {run}: took over the hold of pid {dead_pid} on {this_host()} (it is gone)" in proc.stdout
    assert (run / LAUNCHED).exists()
    assert not (run / HOLD).exists()  # the launch released its hold when it ended


def test_a_launch_holds_its_folder_while_it_lasts(tmp_path):
    """The recorder's launch sees this process's hold; the folder is free afterwards."""
    run = tmp_path / "run"
    run.mkdir()
    assert run_lock.take(run) is None
    assert run_lock.read(run) == Hold(this_host(), os.getpid())
    assert run_lock.take(run) is None  # its own hold: taken again without a word
    run_lock.check_free(run)  # this process's own hold does not refuse it
    run_lock.release(run)
    assert not (run / HOLD).exists()


def test_a_slurm_jobs_hold_lasts_while_squeue_lists_it(tmp_path, squeue):
    run = tmp_path / "run"
    run.mkdir()
    run_lock.take(run)
    run_lock.hand_to_job(run, "33")
    run_lock.release(run)  # the submitting process ends: the job's hold stays
    assert run_lock.read(run) == Hold(this_host(), None, "33")
    for state, how in (("RUNNING", "running"), ("PENDING", "queued"), ("COMPLETING", "running")):
        squeue(state)
        with pytest.raises(ConfigError) as e:
            run_lock.take(run)
        assert e.value.problems == [
            f"{run} is being trained by SLURM job 33 ({how}); nothing was started. Wait for the job to end "
            f"(`squeue -j 33`), or stop it (`scancel 33`; a running job saves a checkpoint first)"]
    squeue("COMPLETED")
    assert run_lock.take(run) == f"[mxfp8ep] {run}: took over the hold of SLURM job 33 (it has ended)"
    run_lock.hand_to_job(run, "34")
    squeue("")  # SLURM no longer knows the job
    run_lock.check_free(run)
    run_lock.release_job(run, "35")  # another job's end leaves the hold alone
    assert run_lock.read(run).job_id == "34"
    run_lock.release_job(run, "34")
    assert not (run / HOLD).exists()


def test_a_hold_that_cannot_be_checked_counts_as_live(tmp_path, monkeypatch):
    """A process on another host, or a job where SLURM does not answer: refused, with the file
    to remove when nothing trains the run."""
    run = tmp_path / "run"
    run.mkdir()
    (run / HOLD).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(ConfigError, match=rf"pid 1 on elsewhere, which cannot be checked from .*remove {run / HOLD}"):
        run_lock.check_free(run)
    (run / HOLD).write_text(json.dumps({"host": "elsewhere", "job_id": "7"}))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no squeue
    with pytest.raises(ConfigError, match=r"SLURM job 7 \(state unknown: SLURM cannot be asked from here\)"):
        run_lock.check_free(run)


def test_finishing_a_sweep_leaves_points_being_trained_alone(tmp_path, live_pid, squeue):
    """A sweep finished while point #0's process trains it and point #1's SLURM job is queued:
    both are left alone (not moved to <sweep>.cut/, not launched again) and the line says so."""
    sweep = tmp_path / "sweep"
    args = ["--multirun", "a2a=bf16,mxfp8", RECORDER, "training.steps=4", f"hydra.sweep.dir={sweep}"]
    first = run_train(tmp_path, *args, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    points = sorted(sweep.glob("[0-9]_*"))
    hold(points[0], pid=live_pid)
    hold(points[1], job_id="33")
    squeue("PENDING")
    before = {p: sorted(f.name for f in p.iterdir()) for p in points}
    logs = {p: (p / "console.log").read_text() for p in points}

    again = run_train(tmp_path, *args, timeout=120, PATH=os.environ["PATH"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines()[0] == (
        f"[mxfp8ep] finishing the sweep in {sweep}: #0 (a2a=bf16) being trained by pid {live_pid} on "
        f"{this_host()} (running): left alone; #1 (a2a=mxfp8) being trained by SLURM job 33 (queued): left alone")
    assert not Path(f"{sweep}.cut").exists()
    assert {p: sorted(f.name for f in p.iterdir()) for p in points} == before
    assert {p: (p / "console.log").read_text() for p in points} == logs  # nothing launched again
