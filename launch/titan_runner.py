"""Run one torchtitan 0.2.2 training job from the recipe config, in every worker process.

The launchers (local processes, SLURM) start one process per GPU (or CPU worker), export the
torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and call :func:`run_training` with the composed config. It:

1. on a machine without CUDA, patches torchtitan's CPU gaps (``launch.titan_cpu_compat``);
   the process group is then gloo (torchtitan maps device type "cpu" to gloo);
2. registers our tiny model flavors and the tiny dataset (``launch.titan_models`` /
   ``launch.titan_data``);
3. installs the EP all-to-all from ``cfg.a2a`` (``mxfp8_ep.install_expert_parallel``);
4. translates the config into torchtitan's ``JobConfig`` (:func:`build_job_config`);
5. runs torchtitan's ``Trainer`` (resuming from the newest checkpoint in the run's checkpoint
   folder when checkpointing is on), with :class:`~launch.titan_metrics.RecipeMetricsProcessor`
   for metrics (console on rank 0, wandb on rank 0);
6. returns a summary dict on rank 0 (``None`` on other ranks).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchtitan.train import Trainer

__all__ = ["RecipeTrainer", "build_job_config", "run_training", "wandb_env"]

_AC_MODES = ("none", "full", "selective")


# --------------------------------------------------------------------------------------------
# config translation
# --------------------------------------------------------------------------------------------


def _as_dictconfig(cfg: Any) -> DictConfig:
    if isinstance(cfg, DictConfig):
        return cfg
    return OmegaConf.structured(cfg) if dataclasses.is_dataclass(cfg) else OmegaConf.create(cfg)


def build_job_config(cfg: Any, run_dir: str) -> Any:
    """torchtitan ``JobConfig`` for the recipe config ``cfg`` (``launch.schema.TrainConfig``).

    Everything torchtitan writes (checkpoints, traces) goes under ``run_dir``. Defaults that
    matter and differ from torchtitan's:

    * ``checkpoint.last_save_model_only = False``: torchtitan's default saves a model-only
      checkpoint at the last step, which a later run with more steps cannot resume from
      (no optimizer, no step count). We always save full state.
    * metrics loggers are off in torchtitan's config: ``RecipeMetricsProcessor`` attaches our
      wandb logger (it writes under ``run_dir`` and logs the full recipe config).
    """
    from torchtitan.config import JobConfig

    from launch.titan_data import TOKENIZER_DIR
    from launch.titan_models import resolve

    cfg = _as_dictconfig(cfg)
    t, p = cfg.training, cfg.parallelism
    cpu = not torch.cuda.is_available()

    jc = JobConfig()
    jc.job.dump_folder = run_dir
    jc.job.description = f"mxfp8-ep {cfg.experiment}: {cfg.model.family}/{cfg.model.flavor}, a2a={cfg.a2a.name}"

    jc.model.name, jc.model.flavor = resolve(cfg.model.family, cfg.model.flavor)
    jc.model.hf_assets_path = str(t.tokenizer_path or TOKENIZER_DIR)

    jc.training.dataset = t.dataset
    jc.training.dataset_path = t.dataset_path
    jc.training.local_batch_size = int(t.local_batch_size)
    jc.training.seq_len = int(t.seq_len)
    jc.training.steps = int(t.steps)
    jc.training.max_norm = float(t.max_norm)
    jc.debug.seed = int(t.seed)

    jc.optimizer.lr = float(t.lr)
    jc.lr_scheduler.warmup_steps = int(t.warmup_steps)

    jc.parallelism.expert_parallel_degree = int(p.ep)
    jc.parallelism.data_parallel_shard_degree = int(p.fsdp)
    jc.parallelism.tensor_parallel_degree = int(p.tp)

    jc.checkpoint.enable = bool(t.checkpoint_enable)
    jc.checkpoint.interval = int(t.checkpoint_interval)
    jc.checkpoint.folder = str(t.checkpoint_folder)
    jc.checkpoint.last_save_model_only = False

    jc.compile.enable = bool(t.compile)
    if t.activation_checkpoint not in _AC_MODES:
        raise ValueError(
            f"training.activation_checkpoint={t.activation_checkpoint!r}: expected one of {_AC_MODES}"
        )
    jc.activation_checkpoint.mode = t.activation_checkpoint

    jc.metrics.log_freq = int(cfg.logging.log_freq)
    jc.metrics.enable_wandb = False
    jc.metrics.enable_tensorboard = False
    jc.metrics.disable_color_printing = not sys.stdout.isatty()

    if cpu:
        # No NCCL flight recorder on gloo: don't create <run_dir>/comm_traces.
        jc.comm.trace_buf_size = 0
    return jc


# --------------------------------------------------------------------------------------------
# wandb
# --------------------------------------------------------------------------------------------


def _default_run_name(cfg: DictConfig) -> str:
    return f"{cfg.model.name}-a2a_{cfg.a2a.name}-ep{cfg.parallelism.ep}"


def wandb_env(cfg: Any, run_dir: str) -> dict[str, str]:
    """``WANDB_*`` variables for this run, from ``cfg.logging`` (the config wins over the env).

    ``WANDB_MODE=offline`` (the default) keeps wandb off the network; the run lands in
    ``<run_dir>/wandb/offline-run-*``.
    """
    cfg = _as_dictconfig(cfg)
    log = cfg.logging
    env = {
        "WANDB_MODE": str(log.wandb_mode),
        "WANDB_PROJECT": str(log.project),
        "WANDB_RUN_GROUP": str(log.group or cfg.experiment),
        "WANDB_RUN_NAME": str(log.run_name or _default_run_name(cfg)),
        "WANDB_RUN_TAGS": ",".join(str(tag) for tag in (log.tags or [])),
        "WANDB_DIR": run_dir,
    }
    if log.entity:
        env["WANDB_TEAM"] = env["WANDB_ENTITY"] = str(log.entity)
    if log.wandb_mode == "offline":
        # Belt and braces: nothing in an offline run may try the network.
        env["WANDB_DISABLE_CODE"] = "true"
    return env


# --------------------------------------------------------------------------------------------
# trainer
# --------------------------------------------------------------------------------------------


class RecipeTrainer(Trainer):
    """torchtitan's ``Trainer`` with the recipe's metrics processor.

    ``Trainer.__init__`` picks its metrics processor builder from the model's ``TrainSpec``.
    Rather than registering a modified TrainSpec globally, ``train_spec`` is a property here:
    the spec ``__init__`` assigns gets our builder swapped in for this trainer only.
    """

    def __init__(self, job_config: Any, *, a2a_name: str, wandb_run_dir: str | None,
                 recipe_config: dict[str, Any]) -> None:
        self._a2a_name = a2a_name
        self._wandb_run_dir = wandb_run_dir
        self._recipe_config = recipe_config
        self.start_step = 0
        super().__init__(job_config)

    @property
    def train_spec(self) -> Any:
        return self._train_spec

    @train_spec.setter
    def train_spec(self, spec: Any) -> None:
        self._train_spec = dataclasses.replace(
            spec, build_metrics_processor_fn=self._build_metrics_processor
        )

    def _build_metrics_processor(self, job_config: Any, parallel_dims: Any,
                                 model_args: Any = None, tag: str | None = None) -> Any:
        from launch.titan_metrics import RecipeMetricsProcessor

        return RecipeMetricsProcessor(
            job_config,
            parallel_dims,
            tag,
            a2a_name=self._a2a_name,
            wandb_run_dir=self._wandb_run_dir,
            wandb_config={"recipe": self._recipe_config, "torchtitan": job_config.to_dict()},
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # Resumed from a checkpoint: step windows and the ETA restart from here.
        self.start_step = self.step
        self.metrics_processor.start_at(self.step)

    def summary(self) -> dict[str, Any]:
        """What ``run_training`` returns on rank 0."""
        h = self.metrics_processor.history
        # Leave the first logged window out of the rates (lazy init, warm-up) when we can.
        skip = 1 if len(h.steps) > 1 else 0

        def mean(values: list[float]) -> float | None:
            values = values[skip:]
            return sum(values) / len(values) if values else None

        jc = self.job_config
        return {
            "final_loss": h.losses[-1] if h.losses else None,
            "losses": list(h.losses),
            "logged_steps": list(h.steps),
            "steps": self.step,
            "start_step": self.start_step,
            "grad_norms": list(h.grad_norms),
            "tokens_per_sec": mean(h.tps),
            "tokens_per_s": mean(h.tps),  # the name launch/summary.py looks for
            "tokens_per_sec_global": mean(h.global_tps),
            "step_time_s": mean(h.step_times),
            "tflops": mean(h.tflops),
            "mfu_pct": mean(h.mfu),
            "max_reserved_gib": max(h.max_reserved_gib) if h.max_reserved_gib else None,
            "a2a": self._a2a_name,
            "a2a_bytes_per_step": mean(h.a2a_bytes_per_step),
            "a2a_bytes_per_step_by_leg": {
                leg: mean([row[leg] for row in h.a2a_leg_bytes_per_step])
                for leg in (h.a2a_leg_bytes_per_step[0] if h.a2a_leg_bytes_per_step else {})
            },
            "model": f"{jc.model.name}/{jc.model.flavor}",
            "world_size": self.parallel_dims.world_size,
            "ep": self.parallel_dims.ep,
            "device": self.device.type,
            "backend": str(dist.get_backend()),
            "ntokens_seen": self.ntokens_seen,
            "checkpoint_folder": (
                os.path.join(jc.job.dump_folder, jc.checkpoint.folder)
                if jc.checkpoint.enable else None
            ),
            "wandb_dir": self._wandb_run_dir,
        }


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


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


def _finish_wandb(exit_code: int) -> None:
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=exit_code)


def run_training(cfg: Any, run_dir: str) -> dict[str, Any] | None:
    """Train with torchtitan per ``cfg`` in this worker process; rank 0 returns a summary.

    Args:
        cfg: composed config following ``launch.schema.TrainConfig`` (DictConfig or dataclass).
        run_dir: the run's output folder (checkpoints, wandb). Shared by all ranks.

    Returns:
        On rank 0: ``{"final_loss", "losses", "logged_steps", "steps", "start_step",
        "tokens_per_sec", "tokens_per_sec_global", "step_time_s", "a2a_bytes_per_step", ...}``
        (``losses`` has one entry per logged step, every ``logging.log_freq`` steps).
        ``None`` on other ranks.
    """
    import mxfp8_ep
    from mxfp8_ep.config import A2AConfig
    from launch.titan_cpu_compat import apply_cpu_compat

    from launch.titan_data import register_tiny_dataset
    from launch.titan_models import register_tiny_flavors

    cfg = _as_dictconfig(cfg)
    cpu = not torch.cuda.is_available()
    if cpu:
        apply_cpu_compat()
    _setup_process(cpu)
    os.makedirs(run_dir, exist_ok=True)

    register_tiny_flavors()
    register_tiny_dataset()
    mxfp8_ep.install_expert_parallel(
        A2AConfig.from_dict(OmegaConf.to_container(cfg.a2a, resolve=True))  # type: ignore[arg-type]
    )

    job_config = build_job_config(cfg, run_dir)
    use_wandb = cfg.logging.wandb_mode != "disabled"
    if use_wandb:
        for key, value in wandb_env(cfg, run_dir).items():
            if value:
                os.environ[key] = value
            else:  # wandb rejects empty values (e.g. WANDB_RUN_TAGS="")
                os.environ.pop(key, None)

    owns_process_group = not dist.is_initialized()
    trainer: RecipeTrainer | None = None
    try:
        trainer = RecipeTrainer(
            job_config,
            a2a_name=str(cfg.a2a.name),
            wandb_run_dir=run_dir if use_wandb else None,
            recipe_config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
        )
        trainer.train()
        summary = trainer.summary() if dist.get_rank() == 0 else None
    except BaseException:
        _finish_wandb(exit_code=1)  # mark the wandb run failed (before close() finishes it)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        _finish_wandb(exit_code=0)  # no-op unless __init__ failed after wandb.init
        if owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        # torchtitan's GarbageCollection disabled automatic gc for the training loop.
        gc.enable()
    return summary
