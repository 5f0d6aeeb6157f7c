"""Run one torchtitan 0.2.2 training job from the recipe config, in every worker process.

The launchers (local processes, SLURM) start one process per GPU (or CPU worker), export the
torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and call :func:`run_training` with the composed config. It:

1. notes stop signals from here on (``launch.run.stop``: Ctrl-C, SIGTERM, SLURM's SIGUSR2);
2. on a machine without CUDA, patches torchtitan's CPU gaps (``launch.titan.cpu_compat``);
   the process group is then gloo (torchtitan maps device type "cpu" to gloo); with
   ``parallelism.share_gpu`` on CUDA, puts every rank on GPU 0 in a gloo group
   (``launch.run.shared_gpu``);
3. registers our model flavors and datasets (``launch.titan.models`` / ``launch.titan.data``);
4. installs the EP all-to-all from ``cfg.a2a`` (``mxfp8_ep.install_expert_parallel``);
5. translates the config into torchtitan's ``JobConfig`` (:func:`build_job_config`);
6. runs torchtitan's ``Trainer`` (resuming from the newest checkpoint in the run's checkpoint
   folder when checkpointing is on), with :class:`~launch.titan.metrics.RecipeMetricsProcessor`
   for metrics (console lines, wandb and the history on rank 0) and, with
   ``training.val_every``, :class:`~launch.titan.validation.HeldOutLoss` for the validation
   loss. After a stop signal all ranks stop at the same step boundary and save a checkpoint;
7. on rank 0 writes the run's ``RunSummary`` (``summary.json``, and the wandb run summary),
   finishes wandb and returns the summary (``None`` on other ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchtitan.train import Trainer

from mxfp8_ep import elastic
from mxfp8_ep.elastic import ReplayOverflowedSteps
from mxfp8_ep.transport import Transport

from launch.config.memory import AUTO_CEILING, fitting_ceiling, run_estimate, runs_symm, symm_capacity
from launch.config.model_facts import facts
from launch.config.schema import PROFILER_WARMUP_STEPS
from launch.run.heartbeat import StepHeartbeat, append_line
from launch.run.numerics_log import arm_for_step
from launch.run.run_dir import CONSOLE_LOG, checkpoint_steps, earlier_logging
from launch.run.run_summary import RECIPE_CONFIG, RunSummary, series_stats, steady_numbers
from launch.run.shared_gpu import gpu_shared, join_one_gpu
from launch.run.stop import Stopped, StopSignals, signal_name
from launch.run.wandb_offline import find_runs
from launch.titan.metrics import WandbSettings
from launch.titan.routing_telemetry import RoutingTelemetry

__all__ = ["RecipeTrainer", "build_job_config", "run_training", "wandb_settings"]

# Steps at the start of a run whose dispatches run every input check, those that need a host
# sync too (``RecipeTrainer._set_input_checks``): a bad routing fails at once, naming its rank.
CHECKED_STEPS = 3


# --------------------------------------------------------------------------------------------
# config translation
# --------------------------------------------------------------------------------------------


def _as_dictconfig(cfg: Any) -> DictConfig:
    if isinstance(cfg, DictConfig):
        return cfg
    return OmegaConf.structured(cfg) if dataclasses.is_dataclass(cfg) else OmegaConf.create(cfg)


def build_job_config(cfg: Any, run_dir: str) -> Any:
    """torchtitan ``JobConfig`` for the recipe config ``cfg`` (``launch.config.schema.TrainConfig``).

    Everything torchtitan writes (checkpoints, traces) goes under ``run_dir``. Defaults that
    matter and differ from torchtitan's:

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

    cfg = _as_dictconfig(cfg)
    t, p = cfg.training, cfg.parallelism
    cpu = not torch.cuda.is_available()
    data = data_source(t.dataset, t.dataset_path, t.tokenizer_path)

    jc = JobConfig()
    jc.job.dump_folder = run_dir
    jc.job.description = f"mxfp8-ep {cfg.experiment}: {cfg.model.family}/{cfg.model.flavor}, a2a={cfg.a2a.name}"

    jc.model.name, jc.model.flavor = resolve(cfg.model.family, cfg.model.flavor)
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


# --------------------------------------------------------------------------------------------
# wandb
# --------------------------------------------------------------------------------------------


def wandb_settings(cfg: Any, run_dir: str) -> Optional[WandbSettings]:
    """``wandb.init`` settings from ``cfg.logging`` (``launch/train.py`` fills the group, run
    name and run id; the id defaults to the one the run dir already has); None when wandb is
    off. Offline (the default) writes ``<run_dir>/wandb/offline-run-*``, no network."""
    lg = cfg.logging
    if lg.wandb_mode == "disabled":
        return None
    return WandbSettings(
        mode=str(lg.wandb_mode),
        project=str(lg.project),
        run_id=str(lg.run_id or earlier_logging(run_dir)[0]),
        name=lg.run_name,
        group=lg.group or cfg.experiment,
        entity=lg.entity,
        tags=tuple(str(tag) for tag in lg.tags),
        dir=run_dir,
    )


# --------------------------------------------------------------------------------------------
# trainer
# --------------------------------------------------------------------------------------------


class RecipeTrainer(ReplayOverflowedSteps, Trainer):
    """torchtitan's ``Trainer`` with the recipe's metrics processor, clean stops, and steps run
    again after a symm capacity overflow (``mxfp8_ep.elastic.ReplayOverflowedSteps``).

    ``Trainer.__init__`` picks its metrics processor builder from the model's ``TrainSpec``.
    Rather than registering a modified TrainSpec globally, ``train_spec`` is a property here:
    the spec ``__init__`` assigns gets our builder swapped in for this trainer only.
    """

    _heartbeat: Optional[StepHeartbeat] = None
    routing: Optional[RoutingTelemetry] = None

    def __init__(self, job_config: Any, cfg: DictConfig, run_dir: str, stop: StopSignals) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.stop = stop
        self.stopped_by: Optional[int] = None
        self.start_step = 0
        # The elastic capacity's per-step check, where a symm dispatch may run at one (every rank
        # has the same config): none for nccl, nor for symm at the worst case.
        self.checks_capacity = (Transport(cfg.a2a.transport) is not Transport.NCCL
                                and cfg.a2a.capacity_factor is not None)
        self.capacity_replay_steps: list[int] = []  # this launch's
        self.capacity_spill_steps: list[int] = []
        self.earlier_replay_steps: list[int] = []  # a resumed run's, up to its checkpoint
        self.earlier_spill_steps: list[int] = []
        super().__init__(job_config)
        self.routing = self.metrics_processor.routing = RoutingTelemetry.of(self.model_parts, self.parallel_dims.ep,
                                                                            run_dir)
        # The stop flag is agreed on the host: a gloo group even when training uses NCCL.
        self._stop_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        every_s = float(cfg.logging.heartbeat_s)
        self._heartbeat = (StepHeartbeat(append_line(os.path.join(run_dir, CONSOLE_LOG)),
                                         int(job_config.training.steps), every_s)
                           if every_s > 0 and dist.get_rank() == 0 else None)

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

    def train_step(self, data_iterator: Any) -> None:
        """torchtitan's step, with the numerics telemetry armed on the steps it samples, and
        the heartbeat watching it (rank 0)."""
        arm_for_step(self.step, int(self.cfg.logging.numerics_every))
        if self.routing is not None:
            self.routing.begin_step()
        watched = self._heartbeat.step(self.step) if self._heartbeat else contextlib.nullcontext()
        try:
            with watched:
                super().train_step(data_iterator)
        finally:
            arm_for_step(self.step, 0)

    def forward_backward_step(self, *args: Any, **kwargs: Any) -> Any:
        """torchtitan's (checked for capacity overflows); the routing telemetry keeps the
        counts of a step that counts."""
        loss = super().forward_backward_step(*args, **kwargs)
        if self.routing is not None:
            self.routing.microbatch_done(self.step, self.gradient_accumulation_steps)
        return loss

    def on_capacity_replay(self, overflow: Any, what: str = "step") -> None:
        """Before an overflowed step (or validation batch: ``what``) runs again: what it
        observed is dropped (the numerics telemetry samples the run that counts), the replay
        (and a spill) is logged; the counts are the mixin's (``ReplayOverflowedSteps``) and
        ``validation.HeldOutLoss``'s."""
        from mxfp8_ep.numerics import PROBE

        PROBE.collect()
        if self.routing is not None:
            self.routing.restart_step()
        self.capacity_replay_steps.append(self.step)
        if overflow.spill:
            self.capacity_spill_steps.append(self.step)
        self.metrics_processor.capacity_replay(self.step, overflow, self.capacity_replays, self.capacity_spills,
                                               what)

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()
        super().close()

    def _build_metrics_processor(self, job_config: Any, parallel_dims: Any,
                                 model_args: Any = None,  # noqa: ARG002 (torchtitan's signature)
                                 tag: str | None = None) -> Any:
        from launch.titan.metrics import RecipeMetricsProcessor

        recipe = OmegaConf.to_container(self.cfg, resolve=True)
        return RecipeMetricsProcessor(
            job_config,
            parallel_dims,
            tag,
            a2a_name=str(self.cfg.a2a.name),
            wandb_settings=wandb_settings(self.cfg, self.run_dir),
            wandb_config={RECIPE_CONFIG: recipe, "torchtitan": job_config.to_dict(),
                          "device": "cuda" if torch.cuda.is_available() else "cpu"},
            console_path=os.path.join(self.run_dir, CONSOLE_LOG),
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # Resumed from a checkpoint: step windows and the ETA restart from here.
        self.start_step = self.step
        self.metrics_processor.start_at(self.step)
        # The capacity starts over (and grows again, by replays, where the routing needs it);
        # the replays of the earlier launches up to the checkpoint still count.
        earlier = RunSummary.read(self.run_dir)
        self.earlier_replay_steps = [s for s in (earlier.capacity_replay_steps if earlier else []) if s <= self.step]
        self.earlier_spill_steps = [s for s in (earlier.capacity_spill_steps if earlier else []) if s <= self.step]
        self.capacity_replays = self.metrics_processor.capacity_replays = len(self.earlier_replay_steps)
        self.capacity_spills = self.metrics_processor.capacity_spills = len(self.earlier_spill_steps)

    def should_continue_training(self) -> bool:
        """Also asked at every step boundary, on every rank: did any rank get a stop signal?
        Then all stop here, with a checkpoint of this step when checkpointing is on."""
        self._set_input_checks()
        if not super().should_continue_training():
            return False
        self.stopped_by = self.stop.agreed(self._stop_group)
        if self.stopped_by is None:
            return True
        ckpt = self.job_config.checkpoint
        if ckpt.enable and self.step > self.start_step and self.step % ckpt.interval:
            self.checkpointer.save(self.step, last_step=True)
        return False

    def _set_input_checks(self) -> None:
        """The dispatcher's input checks that need a host sync per dispatch
        (``mxfp8_ep.dispatcher.checks``: a bad routing on any rank named, with its rank, on
        every rank) for the first ``CHECKED_STEPS`` steps of this run (also after a resume);
        then the sync-free checks only, unless ``MXFP8_EP_DEBUG=1``."""
        from mxfp8_ep.dispatcher import checks

        checks.set_debug(True if self.step < self.start_step + CHECKED_STEPS else None)

    def summary(self) -> RunSummary:
        """This run's summary (rank 0); a resumed run's earlier losses come from the summary
        its earlier launch wrote."""
        h = self.metrics_processor.history
        cfg, jc = self.cfg, self.job_config
        steps, losses = list(h.steps), list(h.losses)
        val_steps, val_losses = list(h.val_steps), list(h.val_losses)
        earlier = RunSummary.read(self.run_dir) if self.start_step else None
        if earlier is not None:
            steps, losses = _continue(earlier.logged_steps, earlier.losses, self.start_step, steps, losses)
            val_steps, val_losses = _continue(earlier.val_logged_steps, earlier.val_losses,
                                              self.start_step, val_steps, val_losses)
        replay_steps = self.earlier_replay_steps + self.capacity_replay_steps
        spill_steps = self.earlier_spill_steps + self.capacity_spill_steps
        saved = checkpoint_steps(self.run_dir, jc.checkpoint.folder) if jc.checkpoint.enable else []
        return RunSummary(
            run_name=str(cfg.logging.run_name or cfg.experiment),
            experiment=str(cfg.experiment),
            a2a=str(cfg.a2a.name),
            a2a_legs={k: str(v) for k, v in cfg.a2a.items() if k != "name"},
            model=str(cfg.model.name),
            model_flavor=f"{jc.model.name}/{jc.model.flavor}",
            parallelism=str(cfg.parallelism.name),
            world_size=self.parallel_dims.world_size,
            ep=self.parallel_dims.ep,
            launcher=str(cfg.launcher.name),
            device=self.device.type,
            gpu_shared=gpu_shared(cfg.parallelism.share_gpu, self.device.type, self.parallel_dims.world_size),
            run_dir=os.path.abspath(self.run_dir),
            steps=self.step,
            target_steps=jc.training.steps,
            start_step=self.start_step,
            stopped_by=signal_name(self.stopped_by),
            checkpoint=(os.path.join(os.path.abspath(self.run_dir), jc.checkpoint.folder,
                                     f"step-{saved[-1]}") if saved else None),
            seed=int(cfg.training.seed),
            logged_steps=steps,
            losses=losses,
            val_logged_steps=val_steps,
            val_losses=val_losses,
            final_loss=losses[-1] if losses else None,
            final_val_loss=val_losses[-1] if val_losses else None,
            **steady_numbers(h.windows),
            max_memory_gib=max(h.max_reserved_gib) if h.max_reserved_gib else None,
            numerics={k: series_stats(v) for k, v in h.numerics.items()},
            capacity_replays=len(replay_steps),
            capacity_replay_steps=replay_steps,
            capacity_spills=len(spill_steps),
            capacity_spill_steps=spill_steps,
            capacity_rows=elastic.capacity_rows(),
            capacity_ceiling_rows=elastic.capacity_ceiling_rows(),
            moe_imbalance=self.routing.summary() if self.routing is not None else {},
            wandb_mode=str(cfg.logging.wandb_mode),
            wandb_run_id=self.metrics_processor.wandb.run.id if self.metrics_processor.wandb else None,
        )

    def finish(self) -> Optional[RunSummary]:
        """After training: on rank 0 the summary goes into wandb's run summary (so wandb and
        the console show the same numbers) and ``summary.json``; wandb is finished first so
        the summary can name its folders."""
        summary = self.summary() if dist.get_rank() == 0 else None
        wandb_logger = self.metrics_processor.wandb
        if summary is not None and wandb_logger is not None:
            wandb_logger.set_summary(summary.wandb_summary())
        self.close()  # checkpointer and metrics processor: wandb finishes, console.log closes
        if summary is not None:
            summary.wandb_dirs = find_runs(os.path.join(self.run_dir, "wandb"))
            summary.write(self.run_dir)
        return summary


def _continue(earlier_steps: list[int], earlier_values: list[float], start: int,
              steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """A resumed run's series: the earlier launch's points up to the resumed step, then this
    launch's."""
    kept = [(s, x) for s, x in zip(earlier_steps, earlier_values) if s <= start]
    return [s for s, _ in kept] + steps, [x for _, x in kept] + values


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


def a2a_config(cfg: DictConfig) -> Any:
    """The library's ``A2AConfig`` of ``cfg.a2a``; a ``capacity_ceiling`` still ``auto`` (the
    memory was not known before launch: a SLURM job) resolved here, on the node
    (``capacity_ceiling_here``)."""
    from mxfp8_ep.config import A2AConfig

    values = OmegaConf.to_container(cfg.a2a, resolve=True)
    if values["capacity_ceiling"] == AUTO_CEILING:  # type: ignore[index]
        values["capacity_ceiling"] = capacity_ceiling_here(cfg)  # type: ignore[index]
    return A2AConfig.from_dict(values)  # type: ignore[arg-type]


def capacity_ceiling_here(cfg: DictConfig) -> float | None:
    """``a2a.capacity_ceiling=auto`` for this node: the largest ceiling whose estimate fits
    this GPU's memory (the node's RAM on CPU), shared by the processes that share it
    (``launch.config.memory.fitting_ceiling``); the library's default where no symm dispatch
    runs at an elastic capacity (nothing grows, so no ceiling applies)."""
    from mxfp8_ep.config import DEFAULT_CAPACITY_CEILING

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not runs_symm(cfg, device) or cfg.a2a.capacity_factor is None:
        return DEFAULT_CAPACITY_CEILING
    if device == "cuda":
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    p = cfg.parallelism
    procs = p.procs_per_node if p.share_gpu or device == "cpu" else 1
    return fitting_ceiling(cfg, facts(cfg.model.family, cfg.model.flavor), device, memory, procs)


def capacity_line(cfg: DictConfig, a2a: Any) -> str | None:
    """What the symm transport's elastic capacity holds, as the console's header states it:
    the rows it starts at and the most it grows to, each with the memory estimate of one
    process there (``launch.config.memory``); None where no symm dispatch runs at an elastic
    capacity."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not runs_symm(cfg, device) or a2a.capacity_factor is None:
        return None
    m = facts(cfg.model.family, cfg.model.flavor)
    tokens = int(cfg.training.local_batch_size) * int(cfg.training.seq_len)
    ep = int(cfg.parallelism.ep)

    def at(factor: float | None) -> str:
        rows = symm_capacity(m, tokens, ep, factor)
        gib = run_estimate(cfg, m, device, True, factor).total / 2**30
        times = "the worst case" if factor is None else f"{factor:g}x balanced"
        return f"{rows:,} expert rows ({times}; est. {gib:,.1f} GiB per process)"

    ceiling = a2a.capacity_ceiling
    return (f"a2a capacity  starts at {at(a2a.capacity_factor)}, grows up to {at(ceiling)}; a step that needs "
            f"more runs once at exactly its rows")


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
    from launch.titan.cpu_compat import apply_cpu_compat
    from launch.titan.data import register_datasets
    from launch.titan.models import register_tiny_flavors

    cfg = _as_dictconfig(cfg)
    with StopSignals() as stop:
        cpu = not torch.cuda.is_available()
        if cpu:
            apply_cpu_compat()
        _setup_process(cpu)
        os.makedirs(run_dir, exist_ok=True)

        register_tiny_flavors()
        register_datasets()
        a2a = install_dispatcher(cfg)
        line = capacity_line(cfg, a2a)
        if line is not None and os.environ.get("RANK", "0") == "0":
            append_line(os.path.join(run_dir, CONSOLE_LOG))(line)

        owns_process_group = not dist.is_initialized()
        job_config = build_job_config(cfg, run_dir)
        if cfg.parallelism.share_gpu and not cpu and owns_process_group:
            join_one_gpu(job_config.comm.init_timeout_seconds)
        trainer: RecipeTrainer | None = None
        try:
            trainer = RecipeTrainer(job_config, cfg, run_dir, stop)
            trainer.train()
            summary = trainer.finish()
        except BaseException:
            _finish_wandb(exit_code=1)  # mark the wandb run failed (flushes what was logged)
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


def _finish_wandb(exit_code: int) -> None:
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=exit_code)
