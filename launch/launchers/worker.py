"""What every training process runs: rebuild the config and call ``run_training``.

Started by the local launcher (``launch/launchers/local.py``, one process per GPU or CPU worker) and by
the SLURM job (``launch/launchers/slurm.py``, one per task). torch.distributed's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is already set;
``run_training`` itself sets up wandb (from ``cfg.logging``) and CPU threads. What the process
writes to stderr (warnings, wandb's lines, a traceback) gets the time at the start of each line,
as torchtitan's log lines have it.
"""

from __future__ import annotations

import datetime
import importlib
import os
import sys
from typing import Any, Optional, TextIO

from launch.config.schema import config_from_yaml

# Debug hook: "module:function" with run_training's signature replaces the real trainer
# (to exercise the launchers without torchtitan). Unset in normal use.
RUNNER_ENV = "MXFP8EP_RUNNER"
DEFAULT_RUNNER = "launch.titan.runner:run_training"


def _runner():
    spec = os.environ.get(RUNNER_ENV) or DEFAULT_RUNNER
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class TimestampedLines:
    """A text stream that writes every line to ``out`` after the time it began: ``[2026-12-05
    09:05:48] <line>``. Everything else (``fileno``, ``encoding``, ...) is ``out``'s."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._line_start = True

    def write(self, text: str) -> int:
        parts = []
        for line in text.splitlines(keepends=True):
            if self._line_start:
                parts.append(f"[{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] ")
            parts.append(line)
            self._line_start = line.endswith("\n")
        self.out.write("".join(parts))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)


def run_worker(cfg_yaml: str, run_dir: str) -> Optional[Any]:
    """Entry point of one training process; returns ``run_training``'s result (rank 0's
    ``RunSummary``, None elsewhere) or raises ``launch.run.stop.Stopped``."""
    from launch.run.heartbeat import stage

    if not isinstance(sys.stderr, TimestampedLines):
        sys.stderr = TimestampedLines(sys.stderr)
    stage(run_dir, f"start-up: {os.environ.get('WORLD_SIZE', '1')} processes started, importing torchtitan")
    return _runner()(config_from_yaml(cfg_yaml), run_dir)
