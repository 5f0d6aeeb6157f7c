"""A trainer stand-in for tests of the local launcher, plugged in through the worker's debug
hook ``MXFP8EP_RUNNER=tests.console_runner:run_training``: rank 0 adds one line per step to
``console.log`` and writes a ``summary.json``, as the real runner does; nothing is trained."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from launch.run.run_dir import CONSOLE_LOG
from launch.run.run_summary import RunSummary


def run_training(cfg: Any, run_dir: str) -> Optional[RunSummary]:
    if os.environ.get("RANK") != "0":
        return None
    steps = int(cfg.training.steps)
    with Path(run_dir, CONSOLE_LOG).open("a") as f:
        for step in range(1, steps + 1):
            f.write(f"stand-in step {step}/{steps}\n")
    summary = RunSummary(run_name=str(cfg.logging.run_name), experiment=str(cfg.experiment),
                         a2a=str(cfg.a2a.name), a2a_legs={}, model=str(cfg.model.name), model_flavor="",
                         parallelism=str(cfg.parallelism.name), world_size=int(os.environ["WORLD_SIZE"]),
                         ep=int(cfg.parallelism.ep), launcher=str(cfg.launcher.name), device="cpu",
                         run_dir=os.path.abspath(run_dir), steps=steps, target_steps=steps)
    summary.write(run_dir)
    return summary
