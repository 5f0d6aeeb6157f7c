"""What every training process runs: rebuild the config and call ``run_training``.

Started by the local launcher (``launch/local.py``, one process per GPU or CPU worker) and by
the SLURM job (``launch/slurm.py``, one per task). torch.distributed's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is already set;
``run_training`` itself sets up wandb (``WANDB_*`` from ``cfg.logging``) and CPU threads.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

# Debug hook: "module:function" with run_training's signature replaces the real trainer
# (to exercise the launchers without torchtitan). Unset in normal use.
RUNNER_ENV = "MXFP8EP_RUNNER"
DEFAULT_RUNNER = "launch.titan_runner:run_training"


def config_to_yaml(cfg: DictConfig) -> str:
    """Serialize the composed config (Hydra's own node is not part of it) for another process."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def config_from_yaml(text: str) -> DictConfig:
    """Inverse of :func:`config_to_yaml`: a typed (``TrainConfig``) DictConfig again."""
    from launch.config_store import SlurmLauncherConfig
    from launch.schema import LauncherConfig, TrainConfig

    values = OmegaConf.create(text)
    schema = OmegaConf.structured(TrainConfig)
    base_fields = {f.name for f in dataclasses.fields(LauncherConfig)}
    if set(values.get("launcher", {})) - base_fields:  # SLURM-only fields present
        schema.launcher = OmegaConf.structured(SlurmLauncherConfig)
    return OmegaConf.merge(schema, values)


def _runner():
    spec = os.environ.get(RUNNER_ENV) or DEFAULT_RUNNER
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@record  # a failing rank's traceback reaches the launcher's error report
def run_worker(cfg_yaml: str, run_dir: str) -> Optional[dict]:
    """Entry point of one training process; returns ``run_training``'s result (rank 0's
    result is what the launcher reports)."""
    return _runner()(config_from_yaml(cfg_yaml), run_dir)
