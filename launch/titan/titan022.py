"""The recipe on torchtitan 0.2.2's trainer (``launch.titan.runner`` picks it where 0.2.2 is
installed): the job as 0.2.2's ``JobConfig`` (:func:`build_job_config`), the EP exchange installed
into its ``ExpertParallel`` (:func:`install_dispatcher`), the process set up (:func:`prepare_process`:
the CPU patches of ``launch.titan.cpu_compat``, the recipe's flavors and datasets) and
:class:`RecipeTrainer`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torchtitan.train import Trainer

from launch.config.schema import PROFILER_WARMUP_STEPS
from launch.run.run_dir import CONSOLE_LOG
from launch.titan.a2a import a2a_config
from launch.titan.recipe_trainer import RecipeTrainerMixin, wandb_config, wandb_settings
from mxfp8_ep.elastic import ReplayOverflowedSteps

__all__ = ["RecipeTrainer", "build_job_config", "install_dispatcher", "prepare_process"]


def prepare_process(cpu: bool) -> None:
    """torchtitan 0.2.2's CPU gaps patched (``cpu``), the recipe's flavors and datasets registered."""
    from launch.titan.cpu_compat import apply_cpu_compat
    from launch.titan.data import register_datasets
    from launch.titan.models import register_tiny_flavors

    if cpu:
        apply_cpu_compat()
    register_tiny_flavors()
    register_datasets()


def install_dispatcher(cfg: DictConfig) -> Any:
    """Route every EP MoE layer of the models built from now on through our dispatcher, as
    ``cfg.a2a`` and ``cfg.parallelism`` say; returns the ``A2AConfig`` it installed."""
    import mxfp8_ep

    a2a = a2a_config(cfg)
    mxfp8_ep.install_expert_parallel(
        a2a,
        # Every rank sees at most this many tokens per MoE layer: the symm transport's
        # buffers are sized for it on every rank alike.
        max_tokens_per_rank=int(cfg.training.local_batch_size) * int(cfg.training.seq_len),
        overlap_shared_experts=bool(cfg.parallelism.overlap_shared_experts),
    )
    return a2a


def build_job_config(cfg: DictConfig, run_dir: str) -> Any:
    """torchtitan ``JobConfig`` for the recipe config ``cfg`` (``launch.config.schema.TrainConfig``).

    Everything torchtitan writes (checkpoints, traces) goes under ``run_dir``. Defaults that
    matter and differ from torchtitan's:

    * ``lr_scheduler.total_steps``: ``training.lr_schedule_steps``, the run's length, which a
      resume keeps (torchtitan's default: this launch's ``training.steps``).
    * ``checkpoint.last_save_model_only = False``: torchtitan's default saves a model-only
      checkpoint at the last step, which a later run with more steps cannot resume from
      (no optimizer, no step count). We always save full state.
    * metrics loggers are off in torchtitan's config: ``RecipeMetricsProcessor`` attaches our
      wandb logger (it writes under ``run_dir`` and logs the full recipe config).
    * ``validation`` mirrors ``training.val_every`` / ``val_batches``; the validator itself is
      ours (``RecipeTrainer``).
    """
    from torchtitan.config import JobConfig

    from launch.titan.data import data_source
    from launch.titan.models import resolve
    from launch.titan.node_limited import flavor_with_groups

    t, p = cfg.training, cfg.parallelism
    cpu = not torch.cuda.is_available()
    data = data_source(t.dataset, t.dataset_path, t.tokenizer_path)

    jc = JobConfig()
    jc.job.dump_folder = run_dir
    jc.job.description = f"mxfp8-ep {cfg.experiment}: {cfg.model.family}/{cfg.model.flavor}, a2a={cfg.a2a.name}"

    jc.model.name, jc.model.flavor = resolve(cfg.model.family, cfg.model.flavor)
    # The flavor with the config's node-limited routing (torchtitan's own, or a variant of it).
    jc.model.flavor = flavor_with_groups(jc.model.name, jc.model.flavor, cfg.model.num_expert_groups,
                                         cfg.model.num_limited_groups)
    jc.model.hf_assets_path = str(data.tokenizer)

    jc.training.dataset = t.dataset
    jc.training.dataset_path = data.path
    jc.training.local_batch_size = int(t.local_batch_size)
    jc.training.seq_len = int(t.seq_len)
    jc.training.steps = int(t.steps)
    jc.training.max_norm = float(t.max_norm)
    jc.training.mixed_precision_param = str(t.mixed_precision_param)
    jc.debug.seed = int(t.seed)

    jc.optimizer.lr = float(t.lr)
    jc.lr_scheduler.warmup_steps = int(t.warmup_steps)
    # The schedule's length is the run's, not this launch's training.steps (a resume may stop
    # the run earlier or later without stretching its schedule).
    jc.lr_scheduler.total_steps = int(t.lr_schedule_steps or t.steps)

    jc.parallelism.expert_parallel_degree = int(p.ep)
    jc.parallelism.data_parallel_shard_degree = int(p.fsdp)
    jc.parallelism.fsdp_reshard_after_forward = str(p.fsdp_reshard_after_forward)
    jc.parallelism.tensor_parallel_degree = int(p.tp)

    jc.checkpoint.enable = bool(t.checkpoint_enable)
    jc.checkpoint.interval = int(t.checkpoint_interval)
    jc.checkpoint.folder = str(t.checkpoint_folder)
    jc.checkpoint.last_save_model_only = False
    jc.checkpoint.keep_latest_k = int(t.checkpoint_keep)

    jc.validation.enable = int(t.val_every) > 0
    if jc.validation.enable:
        jc.validation.freq = int(t.val_every)
        jc.validation.steps = int(t.val_batches)
        jc.validation.local_batch_size = int(t.local_batch_size)
        jc.validation.seq_len = int(t.seq_len)
        jc.validation.dataset_path = str(data.validation)

    jc.compile.enable = bool(t.compile)
    jc.activation_checkpoint.mode = t.activation_checkpoint
    jc.profiling.enable_profiling = int(t.profile_freq) > 0
    if jc.profiling.enable_profiling:
        jc.profiling.profile_freq = int(t.profile_freq)
        jc.profiling.profiler_warmup, jc.profiling.profiler_active = PROFILER_WARMUP_STEPS, 1

    jc.metrics.log_freq = int(cfg.logging.log_freq)
    jc.metrics.enable_wandb = False
    jc.metrics.enable_tensorboard = False
    jc.metrics.disable_color_printing = not sys.stdout.isatty()

    if cpu:
        # No NCCL flight recorder on gloo: don't create <run_dir>/comm_traces.
        jc.comm.trace_buf_size = 0
    return jc


class RecipeTrainer(RecipeTrainerMixin, ReplayOverflowedSteps, Trainer):
    """torchtitan 0.2.2's ``Trainer`` with the recipe's metrics processor, validator and
    parallelize step (``RecipeTrainerMixin``: clean stops, counts, the summary), and steps run
    again after a capacity overflow of symm or two_hop (``mxfp8_ep.elastic.ReplayOverflowedSteps``).

    ``Trainer.__init__`` picks its metrics processor builder from the model's ``TrainSpec``.
    Rather than registering a modified TrainSpec globally, ``train_spec`` is a property here:
    the spec ``__init__`` assigns gets our builders swapped in for this trainer only.
    """

    @property
    def train_spec(self) -> Any:
        return self._train_spec

    @train_spec.setter
    def train_spec(self, spec: Any) -> None:
        self._titan_parallelize = spec.parallelize_fn
        self._train_spec = dataclasses.replace(
            spec,
            build_metrics_processor_fn=self._build_metrics_processor,
            build_validator_fn=self._build_validator,
            parallelize_fn=self._parallelize,
        )

    @property
    def checkpoint_config(self) -> Any:
        return self.job_config.checkpoint

    def held_out_loss(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process({"input": inputs}, labels)
        with self.train_context(), self.maybe_enable_amp:
            pred = model(inputs, **extra_inputs, **extra_kwargs)
            return self.loss_fn(pred, labels).double()  # 0.2.2's loss: the sum over the batch's tokens

    def _build_validator(self, job_config: Any, **_: Any) -> Any:
        """Called by ``Trainer.__init__`` when ``job_config.validation.enable`` (after the
        model, tokenizer, loss and metrics processor exist)."""
        from launch.titan.validation import HeldOutLoss

        return HeldOutLoss(self, Path(job_config.validation.dataset_path),
                           every=job_config.validation.freq, batches=job_config.validation.steps)

    def _parallelize(self, model: Any, parallel_dims: Any, job_config: Any) -> Any:
        """torchtitan's parallelize; then, without EP and with ``a2a.quantize_local_rows``, every
        MoE layer through our dispatcher over a one-rank group (torchtitan's own MoE path
        quantizes nothing). Over gloo (CPU, or ranks sharing a GPU) FSDP reduces with SUM:
        gloo has neither AVG nor PREMUL_SUM."""
        model = self._titan_parallelize(model, parallel_dims, job_config)
        if dist.get_backend() == "gloo":
            from launch.titan.cpu_compat import force_sum_reduction

            force_sum_reduction(model)
        if self.cfg.a2a.quantize_local_rows and not parallel_dims.ep_enabled:
            from mxfp8_ep.titan022 import dispatch_without_expert_parallel

            dispatch_without_expert_parallel(model, a2a_config(self.cfg),
                                             bool(self.cfg.parallelism.overlap_shared_experts))
        return model

    def _build_metrics_processor(self, job_config: Any, parallel_dims: Any,
                                 model_args: Any = None,  # noqa: ARG002 (torchtitan's signature)
                                 tag: str | None = None) -> Any:
        from launch.titan.metrics import RecipeMetricsProcessor

        return RecipeMetricsProcessor(
            job_config,
            parallel_dims,
            tag,
            a2a_name=str(self.cfg.a2a.name),
            wandb_settings=wandb_settings(self.cfg, self.run_dir),
            wandb_config=wandb_config(self.cfg, job_config.to_dict()),
            console_path=os.path.join(self.run_dir, CONSOLE_LOG),
        )
