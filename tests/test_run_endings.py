"""How a local run that goes wrong ends: a worker that raises, a dataset the loader cannot read.
Each ends with one short message naming what failed and where its log is, the exit code the
docs name, and no traceback from the recipe."""

from __future__ import annotations

import os
import re

import pytest

from tests.hydra_compose import REPO
from tests.train_cli import run_train

FAULTS = {"PYTHONPATH": os.pathsep.join((str(REPO / "tests" / "slurm"), str(REPO))),
          "MXFP8EP_RUNNER": "slurm_fault_runner:raise_on_rank"}


def test_a_worker_that_raises_is_one_line_naming_its_rank_and_log(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(tmp_path, "logging=none", f"hydra.run.dir={run_dir}", timeout=180,
                     MXFP8EP_TEST_CRASH_RANK="1", **FAULTS)
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    m = re.fullmatch(r"\[mxfp8ep\] rank 1 failed: ValueError: injected failure; its full output: "
                     r"(\S+)/stderr\.log and stdout\.log", line)
    assert m, line
    log_dir = m.group(1)
    assert log_dir.startswith(str(run_dir / "worker_logs")) and log_dir.endswith("/attempt_0/1")
    # the rank's log has the traceback, each line after the time it was written
    stderr = open(os.path.join(log_dir, "stderr.log")).read().splitlines()
    assert stderr[-1].endswith("] ValueError: injected failure") and "Traceback" in stderr[0]
    assert all(re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ", line) for line in stderr), stderr
    assert "Traceback" not in proc.stdout
    # the run's record says how it ended: summary.json (no rank wrote one) and console.log
    from launch.run.run_summary import RunSummary

    summary = RunSummary.read(run_dir)
    assert summary.ended == f"failed: {line.removeprefix('[mxfp8ep] ')}" and summary.steps == 0
    assert (summary.model, summary.a2a, summary.world_size, summary.target_steps) == ("tiny_llama4", "bf16", 2, 20)
    console = (run_dir / "console.log").read_text().splitlines()
    assert console[-2] == line and console[-1].endswith(f": failed: {line.removeprefix('[mxfp8ep] ')} ====")


def test_a_dataset_the_loader_cannot_read_is_refused_before_launch(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"foo": 1}\n')
    proc = run_train(tmp_path, "training.dataset_path=bad.jsonl", "training.steps=3", timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "[mxfp8ep] 1 problem(s) in the training config:",
        '  - training.dataset_path=bad.jsonl: line 1 has no "text" field (its fields: foo); training.dataset='
        'mxfp8ep_tiny reads one JSON object per line, the document in its "text" field (a string)']
    assert not (tmp_path / "outputs").exists()  # refused by the checks: no run folder, no worker


@pytest.mark.parametrize("script,needs", [("train.py", "hydra or launch"), ("compare_runs.py", "omegaconf or launch")])
def test_a_python_without_the_recipe_is_one_line(tmp_path, script, needs):
    """A venv that is not active: the interpreter has none of the recipe's packages (``-S``: no
    site-packages, ``-I``: no PYTHONPATH), so each command says so in one line."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-S", "-I", str(REPO / "launch" / script), str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    venv = REPO / ".venv"
    fix = (f"activate its venv (`. {venv}/bin/activate`)" if (venv / "bin" / "python").exists()
           else "activate the venv you installed into, or install with `bash scripts/install.sh`")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"[mxfp8ep] {sys.executable} cannot import {needs}, which the recipe needs: {fix}, then run the "
        f"command again"]


def _start_in_own_group(cwd, *args: str):
    """train.py in its own process group, as a shell starts a foreground job."""
    import subprocess

    from tests.train_cli import train_cmd, train_env

    return subprocess.Popen(train_cmd(*args), cwd=cwd, env=train_env(), text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _workers_of(pid: int) -> list[int]:
    """The spawned training processes under the launcher ``pid`` (from /proc)."""
    from pathlib import Path

    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text, cmdline = stat.read_text(), (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == pid and b"spawn_main" in cmdline:
            out.append(int(stat.parent.name))
    return out


def _importing_torch(pid: int) -> bool:
    try:
        return "libtorch" in open(f"/proc/{pid}/maps").read()
    except OSError:
        return False


def _ctrl_c_during_start_up(tmp_path, ready) -> tuple[float, str, str, int]:
    """Start a run, wait until ``ready(proc, run_dir)``, SIGINT the whole group (a terminal's
    Ctrl-C); seconds until the launcher returned, its stdout, stderr and exit code."""
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = _start_in_own_group(tmp_path, "training.steps=50", "logging=wandb_offline", f"hydra.run.dir={run_dir}")
    deadline = time.monotonic() + 240
    while not ready(proc, run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=120)
    return time.monotonic() - sent, out, err, proc.returncode


STOPPED_BEFORE_A_STEP = "[mxfp8ep] stopped by SIGINT before a step was trained; its run dir was removed ({})"


def test_ctrl_c_while_the_workers_import_torch_is_one_line_at_once(tmp_path):
    """SIGINT reaches every worker while it still imports torch (before its stop handlers)."""
    def ready(proc, run_dir):
        workers = _workers_of(proc.pid)
        return len(workers) == 2 and all(_importing_torch(w) for w in workers)

    took, out, err, code = _ctrl_c_during_start_up(tmp_path, ready)
    assert code == 130 and err.splitlines() == [STOPPED_BEFORE_A_STEP.format(tmp_path / "run")], err
    assert "Traceback" not in out and took < 5
    assert not (tmp_path / "run").exists()


def test_ctrl_c_during_the_rest_of_start_up_is_one_line_at_once(tmp_path):
    """SIGINT once the workers build the model (their stop handlers in place, wandb started):
    no waiting for the rest of the start-up and a first step."""
    def ready(proc, run_dir):
        console = run_dir / "console.log"
        return console.is_file() and "start-up: process group, data and model" in console.read_text()

    took, out, err, code = _ctrl_c_during_start_up(tmp_path, ready)
    assert code == 130 and err.splitlines() == [STOPPED_BEFORE_A_STEP.format(tmp_path / "run")], err
    assert "Traceback" not in out and took < 5
    assert not (tmp_path / "run").exists()
