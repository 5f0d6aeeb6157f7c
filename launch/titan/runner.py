"""Run one training job from the recipe config, in every worker process, on the torchtitan
stack this environment has (0.2.2 or 0.3.0: ``launch.config.stack``).

The launchers (local processes, SLURM) start one process per GPU (or CPU worker), export the
torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and call :func:`run_training` with the composed config. It:

1. notes stop signals from here on (``launch.run.stop``: Ctrl-C, SIGTERM, SLURM's SIGUSR2);
2. sets the process up for its stack (``prepare_process``): on a machine without CUDA, patches
   torchtitan's CPU gaps (the process group is then gloo: torchtitan maps device type "cpu" to
   gloo), registers our model flavors and datasets; with ``parallelism.share_gpu`` on CUDA, puts
   every rank on GPU 0 in a gloo group (``launch.run.shared_gpu``);
3. installs the EP all-to-all from ``cfg.a2a`` (``install_dispatcher``: on 0.2.2 into its
   ``ExpertParallel``; on 0.3.0 the job config carries the library's token-dispatcher override);
4. records the stack (torchtitan, torch, triton) in ``<run dir>/stack.json`` (rank 0);
5. translates the config into the stack's torchtitan job config (``build_job_config``);
6. runs the stack's ``RecipeTrainer`` (resuming from the newest checkpoint in the run's
   checkpoint folder when checkpointing is on), with the recipe's metrics processor (console
   lines, wandb and the history on rank 0) and, with ``training.val_every``, the held-out loss
   (``launch.titan.validation``). After a stop signal all ranks stop at the same step boundary
   and save a checkpoint;
7. on rank 0 writes the run's ``RunSummary`` (``summary.json``, and the wandb run summary),
   finishes wandb and returns the summary (``None`` on other ranks).

The stack's pieces: ``launch.titan.titan022`` and ``launch.titan.titan030.trainer``, each with
``prepare_process``, ``install_dispatcher``, ``build_job_config`` and ``RecipeTrainer``
(:func:`stack_adapter`; ``runner.RecipeTrainer`` and the others name the installed stack's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from launch.config.stack import installed, installed_torchtitan
from launch.run.heartbeat import append_line
from launch.run.run_dir import CONSOLE_LOG, STACK
from launch.run.rank_meeting import meet
from launch.run.run_summary import RunSummary
from launch.run.shared_gpu import join_one_gpu
from launch.run.stop import Stopped, StopSignals
from launch.titan.a2a import a2a_config, capacity_ceiling_here, capacity_line
from launch.titan.recipe_trainer import CHECKED_STEPS, wandb_settings

__all__ = ["CHECKED_STEPS", "a2a_config", "capacity_ceiling_here", "capacity_line", "run_training", "stack_adapter",
           "wandb_settings"]

# How long the ranks wait for each other at the end of a run: rank 0 finishes wandb (an upload,
# when online) while the others wait.
END_TIMEOUT_S = 600
# The module of each torchtitan release's trainer and job config.
ADAPTERS = {"0.2.2": "launch.titan.titan022", "0.3.0": "launch.titan.titan030.trainer"}
# What this module names from the installed stack's adapter (``runner.RecipeTrainer``, ...).
FROM_ADAPTER = ("RecipeTrainer", "build_job_config", "install_dispatcher")


def stack_adapter() -> ModuleType:
    """The installed torchtitan release's adapter module."""
    return importlib.import_module(ADAPTERS[installed_torchtitan()])


def __getattr__(name: str) -> Any:
    if name in FROM_ADAPTER:
        return getattr(stack_adapter(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _as_dictconfig(cfg: Any) -> DictConfig:
    if isinstance(cfg, DictConfig):
        return cfg
    return OmegaConf.structured(cfg) if dataclasses.is_dataclass(cfg) else OmegaConf.create(cfg)


def _setup_process(cpu: bool) -> None:
    """Logging like torchtitan (rank 0 INFO; others WARNING unless listed in LOG_RANK) and, on
    CPU, one share of the cores per process instead of every process using all of them."""
    from torchtitan.tools.logging import init_logger

    init_logger()
    rank = os.environ.get("RANK", "0")
    log_ranks = [r for r in os.environ.get("LOG_RANK", "0").split(",") if r]
    if rank not in log_ranks:
        logging.getLogger().setLevel(logging.WARNING)
    if cpu and "OMP_NUM_THREADS" not in os.environ:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, per_node)))


def run_training(cfg: Any, run_dir: str) -> Optional[RunSummary]:
    """Train with torchtitan per ``cfg`` in this worker process.

    Args:
        cfg: composed config following ``launch.config.schema.TrainConfig`` (DictConfig or dataclass),
            with ``logging.run_id`` / ``run_name`` filled (``launch/train.py`` does).
        run_dir: the run's output folder (checkpoints, wandb, summary). Shared by all ranks.

    Returns:
        The run's :class:`~launch.run.run_summary.RunSummary` on rank 0 (also written to
        ``<run_dir>/summary.json``), ``None`` on other ranks.

    Raises:
        launch.run.stop.Stopped: on every rank, after a clean stop by a signal.
    """
    cfg = _as_dictconfig(cfg)
    adapter = stack_adapter()
    with StopSignals() as stop:
        cpu = not torch.cuda.is_available()
        adapter.prepare_process(cpu)
        _setup_process(cpu)
        os.makedirs(run_dir, exist_ok=True)

        a2a = adapter.install_dispatcher(cfg)
        if os.environ.get("RANK", "0") == "0":
            installed().write(Path(run_dir) / STACK)
            line = capacity_line(cfg, a2a)
            if line is not None:
                append_line(os.path.join(run_dir, CONSOLE_LOG))(line)

        owns_process_group = not dist.is_initialized()
        job_config = adapter.build_job_config(cfg, run_dir)
        if cfg.parallelism.share_gpu and not cpu and owns_process_group:
            join_one_gpu(job_config.comm.init_timeout_seconds)
        trainer = None
        try:
            trainer = adapter.RecipeTrainer(job_config, cfg, run_dir, stop)
            trainer.train()
            summary = trainer.finish()
            if owns_process_group:
                # The ranks leave together (torchtitan's rank 0 alone sleeps 2 s at the end of
                # train()), so no rank tears its groups down while a peer is still connected; a
                # rank that never comes is named instead of waited for.
                meet("the end of the run", END_TIMEOUT_S)
                dist.barrier()
        except BaseException:
            _finish_wandb(trainer, exit_code=1)  # mark the wandb run failed (flushes what was logged)
            raise
        finally:
            if trainer is not None:
                trainer.close()
            if owns_process_group and dist.is_initialized():
                dist.destroy_process_group()
            # torchtitan's GarbageCollection disabled automatic gc for the training loop.
            gc.enable()
    if trainer.stopped_by is not None:
        raise Stopped(trainer.stopped_by, summary)
    return summary


def _finish_wandb(trainer: Any, exit_code: int) -> None:
    """Finish the wandb run of a failed launch: through the trainer's logger, which writes what
    a lost wandb service had not; without a trainer, the run ``wandb.init`` left open."""
    wandb_logger = getattr(getattr(trainer, "metrics_processor", None), "wandb", None)
    if wandb_logger is not None:
        wandb_logger.close(exit_code=exit_code)
        return
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        with contextlib.suppress(ConnectionError):  # its service is gone: nothing to finish
            wandb.finish(exit_code=exit_code)
