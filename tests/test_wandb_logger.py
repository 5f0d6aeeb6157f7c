"""launch/titan/wandb_run.py: the run's wandb logger keeps the run whole when wandb's service
process dies under it (SLURM signals every process of a job: ``scancel``'s SIGTERM reaches
``wandb-core``, which exits at once, losing what it had not written). Real offline wandb runs,
the service killed by the test."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from launch.run.wandb_offline import find_runs, read_run, read_runs
from launch.titan.wandb_run import RecipeWandBLogger, WandbSettings


def _logger(tmp_path) -> RecipeWandBLogger:
    return RecipeWandBLogger(WandbSettings(mode="offline", project="p", run_id="run1", name="a2a=bf16",
                                           group="g", entity=None, tags=(), dir=str(tmp_path)),
                             {"recipe": {"a2a": {"name": "bf16"}}})


def _children_named(name: str) -> list[int]:
    """This process's child processes called ``name``, from /proc (no procps needed: the test
    image has none)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone since the listing
            continue
        comm, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if comm == name and int(rest[1]) == os.getpid():  # rest: state, ppid, ...
            pids.append(int(stat.parent.name))
    return pids


def _kill_wandb_service() -> None:
    """SIGTERM to this process's wandb-core, as SLURM sends it to every process of a job step."""
    pids = _children_named("wandb-core")
    assert pids, "no wandb-core child process"
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    time.sleep(1.0)


def test_a_run_whose_wandb_service_died_keeps_every_step_once(tmp_path):
    log = _logger(tmp_path)
    for step in range(1, 6):
        log.log({"loss": 1.0 / step}, step)
    _kill_wandb_service()
    for step in range(6, 9):  # the steps up to the next step boundary: no error reaches training
        log.log({"loss": 1.0 / step}, step)
    log.log({"val/loss": 0.5}, 8)
    log.set_summary({"loss": 0.125})
    log.close()
    log.wandb.teardown()  # the service writes its files out (a worker's exit does this)

    (run,) = read_runs(str(tmp_path))
    assert [row["_step"] for row in run.history] == list(range(1, 9))
    assert [row["loss"] for row in run.history] == pytest.approx([1.0 / s for s in range(1, 9)])
    assert run.history[-1]["val/loss"] == 0.5
    assert run.summary["loss"] == 0.125 and run.exit_code == 0
    assert run.run_id == "run1" and run.config["recipe"]["a2a"]["name"] == "bf16"
    # what wandb sync uploads, folder after folder: every step once
    assert sorted(row["_step"] for d in find_runs(str(tmp_path)) for row in read_run(d).history) == list(range(1, 9))


def test_a_run_whose_service_lives_is_one_folder(tmp_path):
    log = _logger(tmp_path)
    for step in range(1, 4):
        log.log({"loss": 1.0 / step}, step)
    log.close()
    log.close()  # the trainer closes again on its way out: nothing happens
    log.wandb.teardown()  # the service writes its files out (a worker's exit does this)
    (run,) = read_runs(str(tmp_path))
    assert len(run.paths) == 1 and [row["_step"] for row in run.history] == [1, 2, 3] and run.exit_code == 0
