"""The recipe config as torchtitan 0.3.0's ``Trainer.Config`` (its Python dataclasses: the recipe
fills the fields a torchtitan config file or ``--module/--config`` would).

What it sets beside the recipe's numbers, where it differs from torchtitan's defaults:

* the model: ``launch.titan.titan030.models.model_spec`` (torchtitan's flavor, or ours), its
  parallelize function switching FSDP to SUM on gloo (``cpu_compat.with_sum_reduction``), its
  routers with the config's node-limited routing (``launch.titan.node_limited``);
* the EP exchange: the library's override, ``("mxfp8_ep.titan030.token_dispatcher", {preset
  and legs of cfg.a2a, max_tokens_per_rank})`` in ``override.imports``, the same entry
  ``--override.imports`` makes of a plain torchtitan run's command line; with EP = 1 none (the
  dispatcher needs an EP group: torchtitan's own local path runs);
* the loss: plain cross-entropy over the full logits, as on 0.2.2 (torchtitan's configs chunk it);
* ``lr_scheduler.total_steps``: ``training.lr_schedule_steps``, the run's length, which a resume
  keeps (torchtitan's default: this launch's ``training.steps``);
* ``checkpoint.last_save_model_only = False``: a later launch with more steps resumes from the
  last step's checkpoint (torchtitan's default saves the model alone there);
* ``training.disable_cuda_graphs``: our dispatcher syncs with the host, as 0.3.0's own AllToAll;
* ``parallelism.spmd_backend``: ``torch_compat.SPMD_BACKEND`` (torchtitan's default on torch 2.15);
* torchtitan's own validator and loggers off: the recipe's held-out loss and wandb run are
  built by its trainer and metrics processor (``launch.titan.titan030.trainer`` / ``metrics``);
* profiler traces in ``<run dir>/profile_traces`` (as on 0.2.2).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch
from omegaconf import DictConfig

from launch.config.schema import PROFILER_WARMUP_STEPS
from launch.run.run_dir import CONSOLE_LOG
from launch.titan.a2a import a2a_config
from launch.titan.recipe_trainer import wandb_config, wandb_settings

__all__ = ["DISPATCHER_OVERRIDE", "build_job_config", "dispatcher_override"]

DISPATCHER_OVERRIDE = "mxfp8_ep.titan030.token_dispatcher"
PROFILE_TRACES = "profile_traces"


def dispatcher_override(cfg: DictConfig, a2a: Any) -> tuple[str, dict[str, Any]]:
    """The ``override.imports`` entry that puts the library's dispatcher, as ``a2a`` (the run's
    ``A2AConfig``) says, on every MoE layer: its kwargs are the ``--override.imports`` JSON."""
    from mxfp8_ep.config import PRESETS

    preset = str(cfg.a2a.name) if cfg.a2a.name in PRESETS else "bf16"  # every field is given anyway
    # Every rank sees at most this many tokens per MoE layer: symm's buffers are sized for it alike.
    tokens = int(cfg.training.local_batch_size) * int(cfg.training.seq_len)
    return DISPATCHER_OVERRIDE, {"preset": preset, **dataclasses.asdict(a2a), "max_tokens_per_rank": tokens}


def _activation_checkpoint(mode: str) -> Any:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[mode]


def build_job_config(cfg: DictConfig, run_dir: str) -> Any:
    """torchtitan 0.3.0's ``Trainer.Config`` for the recipe config ``cfg``; everything torchtitan
    writes (checkpoints, traces) goes under ``run_dir``."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.tools.profiler import Profiler
    from torchtitan.trainer import Trainer

    from launch.titan.data import data_source
    from launch.titan.node_limited import model_config_with_groups
    from launch.titan.titan030.cpu_compat import with_sum_reduction
    from launch.titan.titan030.metrics import RecipeMetricsProcessor
    from launch.titan.titan030.models import model_spec
    from launch.titan.titan030.torch_compat import SPMD_BACKEND

    t, p = cfg.training, cfg.parallelism
    data = data_source(t.dataset, t.dataset_path, t.tokenizer_path)
    spec = model_spec(cfg.model.family, cfg.model.flavor)
    spec = dataclasses.replace(spec, model=model_config_with_groups(spec.model, cfg.model.num_expert_groups,
                                                                    cfg.model.num_limited_groups))
    spec = dataclasses.replace(spec, parallelize_fn=with_sum_reduction(spec.parallelize_fn))
    profile = int(t.profile_freq) > 0

    config = Trainer.Config(
        model_spec=spec,
        hf_assets_path=str(data.tokenizer),
        dump_folder=run_dir,
        loss=CrossEntropyLoss.Config(),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=t.dataset, dataset_path=data.path),
        optimizer=default_adamw(lr=float(t.lr)),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=int(t.warmup_steps),
                                                  total_steps=int(t.lr_schedule_steps or t.steps)),
        training=TrainingConfig(local_batch_size=int(t.local_batch_size), seq_len=int(t.seq_len),
                                steps=int(t.steps), max_norm=float(t.max_norm), disable_cuda_graphs=True,
                                mixed_precision_param=str(t.mixed_precision_param)),
        parallelism=ParallelismConfig(
            expert_parallel_degree=int(p.ep), data_parallel_shard_degree=int(p.fsdp),
            tensor_parallel_degree=int(p.tp), fsdp_reshard_after_forward=str(p.fsdp_reshard_after_forward),
            spmd_backend=SPMD_BACKEND),
        checkpoint=CheckpointManager.Config(
            enable=bool(t.checkpoint_enable), interval=int(t.checkpoint_interval), folder=str(t.checkpoint_folder),
            last_save_model_only=False, keep_latest_k=int(t.checkpoint_keep)),
        activation_checkpoint=_activation_checkpoint(str(t.activation_checkpoint)),
        compile=CompileConfig(enable=bool(t.compile)),
        profiler=Profiler.Config(enable_profiling=profile, save_traces_folder=PROFILE_TRACES,
                                 profile_freq=int(t.profile_freq) if profile else 10,
                                 profiler_warmup=PROFILER_WARMUP_STEPS, profiler_active=1),
        metrics=RecipeMetricsProcessor.Config(
            log_freq=int(cfg.logging.log_freq), disable_color_printing=not sys.stdout.isatty(),
            total_steps=int(t.steps), a2a_name=str(cfg.a2a.name), console_path=os.path.join(run_dir, CONSOLE_LOG),
            wandb=wandb_settings(cfg, run_dir), _wandb_config=wandb_config(cfg, {})),
    )
    config.debug.seed = int(t.seed)
    if int(p.ep) > 1:
        config.override.imports.append(dispatcher_override(cfg, a2a_config(cfg)))
    if not torch.cuda.is_available():
        # No NCCL flight recorder on gloo: don't create <run_dir>/comm_traces.
        config.comm.trace_buf_size = 0
    return config
