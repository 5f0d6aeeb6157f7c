"""A launcher for tests of what happens before a launch: it records the config it was given in
``<run dir>/launched.yaml``, adds a line to ``console.log`` as rank 0 would, and starts nothing.
Picked on the command line with ``launcher._target_=tests.launch_recorder.Recorder``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from launch.launchers.launcher import LauncherConfig, Target
from launch.run.run_dir import CONSOLE_LOG

LAUNCHED = "launched.yaml"


@dataclass
class RecorderConfig(LauncherConfig):
    _target_: str = "tests.launch_recorder.Recorder"
    name: str = "local"


class Recorder:
    Config = RecorderConfig

    def target(self, cfg: Any, machine: Any) -> Target:
        return Target("cpu", 1 << 40, "the recorder's RAM", "the recorder starts no process")

    def check(self, cfg: Any, machine: Any, report: Any) -> None:
        pass

    def launch(self, cfg: Any, run_dir: str) -> None:
        Path(run_dir, LAUNCHED).write_text(OmegaConf.to_yaml(cfg, resolve=True))
        with Path(run_dir, CONSOLE_LOG).open("a") as f:
            f.write(f"launched to step {cfg.training.steps}\n")
