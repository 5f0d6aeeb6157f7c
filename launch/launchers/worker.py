"""What every training process runs: rebuild the config and call ``run_training``.

Started by the local launcher (``launch/launchers/local.py``, one process per GPU or CPU worker) and by
the SLURM job (``launch/launchers/slurm.py``, one per task). torch.distributed's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is already set;
``run_training`` itself sets up wandb (from ``cfg.logging``) and CPU threads.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional

from launch.config.schema import config_from_yaml

# Debug hook: "module:function" with run_training's signature replaces the real trainer
# (to exercise the launchers without torchtitan). Unset in normal use.
RUNNER_ENV = "MXFP8EP_RUNNER"
DEFAULT_RUNNER = "launch.titan.runner:run_training"


def _runner():
    spec = os.environ.get(RUNNER_ENV) or DEFAULT_RUNNER
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def run_worker(cfg_yaml: str, run_dir: str) -> Optional[Any]:
    """Entry point of one training process; returns ``run_training``'s result (rank 0's
    ``RunSummary``, None elsewhere) or raises ``launch.run.stop.Stopped``."""
    return _runner()(config_from_yaml(cfg_yaml), run_dir)
