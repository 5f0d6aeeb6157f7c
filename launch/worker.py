"""What every training process runs: rebuild the config, point wandb at the run dir, train.

Started by the local launcher (``launch/local.py``, one process per GPU or CPU worker) and by
the SLURM job (``launch/slurm.py``, one per task). torch.distributed's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is already set.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

# Debug hook: "module:function" with run_training's signature replaces the real trainer
# (to exercise the launchers without torchtitan). Unset in normal use.
RUNNER_ENV = "MXFP8EP_RUNNER"
DEFAULT_RUNNER = "launch.titan_runner:run_training"


def config_to_yaml(cfg: DictConfig) -> str:
    """Serialize the composed config (minus Hydra's own node) for another process."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def config_from_yaml(text: str) -> DictConfig:
    """Inverse of :func:`config_to_yaml`: a typed (``TrainConfig``) DictConfig again."""
    from launch.config_store import SlurmLauncherConfig
    from launch.schema import TrainConfig

    values = OmegaConf.create(text)
    schema = OmegaConf.structured(TrainConfig)
    if values.get("launcher", {}).get("name") == "slurm":
        schema.launcher = OmegaConf.structured(SlurmLauncherConfig)
    cfg = OmegaConf.merge(schema, values)
    OmegaConf.set_readonly(cfg, False)
    return cfg


def wandb_env(cfg: Any, run_dir: str) -> dict[str, str]:
    """The WANDB_* variables that put this run where ``cfg.logging`` says."""
    lg = cfg.logging
    env = {
        "WANDB_MODE": lg.wandb_mode,
        "WANDB_PROJECT": lg.project,
        "WANDB_DIR": run_dir,
        "WANDB_RUN_GROUP": lg.group or cfg.experiment,
        "WANDB_CONSOLE": "off",
        "WANDB_SILENT": "true",
    }
    # wandb's own names, and the ones torchtitan's WandBLogger reads (WANDB_RUN_NAME, WANDB_TEAM).
    if lg.run_name:
        env["WANDB_NAME"] = env["WANDB_RUN_NAME"] = lg.run_name
    if lg.entity:
        env["WANDB_ENTITY"] = env["WANDB_TEAM"] = lg.entity
    if lg.tags:
        env["WANDB_TAGS"] = ",".join(lg.tags)
    return env


def _runner():
    spec = os.environ.get(RUNNER_ENV) or DEFAULT_RUNNER
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@record  # a failing rank's traceback reaches the launcher's error report
def run_worker(cfg_yaml: str, run_dir: str) -> Optional[dict]:
    """Entry point of one training process; returns ``run_training``'s result (rank 0's
    result is what the launcher reports)."""
    cfg = config_from_yaml(cfg_yaml)
    os.environ.update(wandb_env(cfg, run_dir))
    _limit_cpu_threads()
    return _runner()(cfg, run_dir)


def _limit_cpu_threads() -> None:
    """CPU workers share the cores: give each its slice (what torchrun does with
    OMP_NUM_THREADS=1), unless the user chose a thread count."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    if torch.cuda.is_available():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
