"""What the recipe adds to torchtitan's ``Trainer``, the same on torchtitan 0.2.2 and 0.3.0: clean
stops at a step boundary (with a checkpoint), the heartbeat, the numerics telemetry's sampled
steps, the dispatcher's synced input checks for the first steps, the elastic capacity's replays
counted and logged (``on_capacity_replay``; the replays themselves are
``mxfp8_ep.elastic``'s), the routing telemetry's counts of each step that counts
(``launch.titan.routing_telemetry``), resumed runs' counts and series, and the run's ``RunSummary``.

Each stack's trainer (``launch.titan.titan022.RecipeTrainer``,
``launch.titan.titan030.trainer.RecipeTrainer``) is ``RecipeTrainerMixin`` over torchtitan's
``Trainer`` of that release, plus how that release builds its metrics processor, validator and
parallelize function, its checkpoint config (``checkpoint_config``) and the loss of a
held-out batch (``held_out_loss``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchtitan.tools.logging import logger

from launch.config.memory import ep_transport
from launch.config.stack import installed
from launch.run.heartbeat import StepHeartbeat, append_line, stage
from launch.run.numerics_log import arm_for_step
from launch.run.run_dir import CONSOLE_LOG, checkpoint_steps, earlier_logging, remove_incomplete_checkpoints
from launch.run.provenance import host_name, utc_now
from launch.run.run_summary import (RECIPE_CONFIG, RunSummary, earlier_record, recipe_provenance, series_stats,
                                    steady_numbers)
from launch.run.shared_gpu import gpu_shared
from launch.run.stop import StopSignals, signal_name
from launch.run.wandb_offline import find_runs
from launch.titan.routing_telemetry import RoutingTelemetry
from launch.titan.wandb_run import WandbSettings
from mxfp8_ep import elastic
from mxfp8_ep.transport import Transport

__all__ = ["CHECKED_STEPS", "RecipeTrainerMixin", "wandb_config", "wandb_settings"]

# Steps at the start of a run whose dispatches run every input check, those that need a host
# sync too (``RecipeTrainerMixin._set_input_checks``): a bad routing fails at once, naming its rank.
CHECKED_STEPS = 3


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


def wandb_config(cfg: DictConfig, torchtitan: dict[str, Any]) -> dict[str, Any]:
    """The wandb run's config: the composed recipe config, torchtitan's job config
    (``torchtitan``, as a dict), the device and the stack (torchtitan, torch, triton)."""
    return {RECIPE_CONFIG: OmegaConf.to_container(cfg, resolve=True), "torchtitan": torchtitan,
            "device": "cuda" if torch.cuda.is_available() else "cpu", "stack": installed().to_dict()}


class RecipeTrainerMixin:
    """Put before torchtitan's ``Trainer`` (and, on 0.2.2, ``ReplayOverflowedSteps``) in the bases;
    constructed as ``Trainer(job_config, cfg, run_dir, stop)``: torchtitan's job config, the
    recipe's config, the run's folder and the stop signals."""

    _heartbeat: Optional[StepHeartbeat] = None
    routing: Optional[RoutingTelemetry] = None

    def __init__(self, job_config: Any, cfg: DictConfig, run_dir: str, stop: StopSignals) -> None:
        self.started_at = utc_now()
        self.cfg = cfg
        self.run_dir = run_dir
        self.stop = stop
        self.stopped_by: Optional[int] = None
        self.start_step = 0
        # The elastic capacity's per-step check, where a sync-free dispatch (symm, two_hop: the
        # replay guard's) may run at one (every rank has the same config): none for nccl, nor at
        # the worst case.
        self.checks_capacity = (Transport(cfg.a2a.transport) is not Transport.NCCL
                                and cfg.a2a.capacity_factor is not None)
        self.capacity_replay_steps: list[int] = []  # this launch's
        self.capacity_spill_steps: list[int] = []
        self.earlier_replay_steps: list[int] = []  # a resumed run's, up to its checkpoint
        self.earlier_spill_steps: list[int] = []
        stage(run_dir, f"start-up: process group, data and model ({cfg.model.name}, EP {cfg.parallelism.ep})")
        super().__init__(job_config)  # type: ignore[call-arg]
        self.routing = self.metrics_processor.routing = RoutingTelemetry.of(self.model_parts, self.parallel_dims.ep,
                                                                            run_dir)
        self._checkpoints_whole()
        # The stop flag is agreed on the host: a gloo group even when training uses NCCL.
        self._stop_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.hosts = _every_rank_host(self._stop_group)
        self._comm = job_config.comm
        every_s = float(cfg.logging.heartbeat_s)
        self._heartbeat = (StepHeartbeat(append_line(os.path.join(run_dir, CONSOLE_LOG)),
                                         int(cfg.training.steps), every_s)
                           if every_s > 0 and dist.get_rank() == 0 else None)

    def _checkpoints_whole(self) -> None:
        """Checkpoints are written whole or not at all (``launch.titan.checkpoints``); what a
        write cut short by an earlier launch left is removed (rank 0) before any is loaded."""
        from launch.titan.checkpoints import keep_latest_after_the_last_save, write_whole

        write_whole(self.checkpointer)
        if self.checkpoint_config.enable:
            keep_latest_after_the_last_save(self.checkpointer)
        ckpt = self.checkpoint_config
        if ckpt.enable and dist.get_rank() == 0:
            removed = remove_incomplete_checkpoints(self.run_dir, ckpt.folder)
            if removed:
                logger.warning(f"removed what cut-short checkpoint writes left: {', '.join(removed)}")

    # -- what each stack's trainer provides ---------------------------------------------------
    @property
    def checkpoint_config(self) -> Any:
        """torchtitan's checkpoint config of this run (``enable``, ``interval``)."""
        raise NotImplementedError

    def held_out_loss(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy (fp64) of one held-out batch, its tensors on the trainer's
        device (``launch.titan.validation.HeldOutLoss``); nothing the training counts changes."""
        raise NotImplementedError

    # -- the training loop ------------------------------------------------------------------
    def train_step(self, data_iterator: Any) -> None:
        """torchtitan's step, with the numerics telemetry armed on the steps it samples, and
        the heartbeat watching it (rank 0)."""
        arm_for_step(self.step, int(self.cfg.logging.numerics_every))
        if self.routing is not None:
            self.routing.begin_step()
        watched = self._heartbeat.step(self.step) if self._heartbeat else contextlib.nullcontext()
        try:
            with watched:
                super().train_step(data_iterator)  # type: ignore[misc]
        finally:
            arm_for_step(self.step, 0)

    def forward_backward_step(self, *args: Any, **kwargs: Any) -> Any:
        """torchtitan's (checked for capacity overflows); the routing telemetry keeps the
        counts of a step that counts."""
        loss = super().forward_backward_step(*args, **kwargs)  # type: ignore[misc]
        if self.routing is not None:
            self.routing.microbatch_done(self.step, self.gradient_accumulation_steps)
        return loss

    def on_capacity_replay(self, overflow: Any, what: str = "step") -> None:
        """Before an overflowed step (or validation batch: ``what``) runs again: what it
        observed is dropped (the numerics telemetry's samples of the attempt go with
        ``mxfp8_ep.elastic.StepState``; the routing telemetry's here), the replay (and a spill)
        is logged; the counts are ``mxfp8_ep.elastic``'s and ``validation.HeldOutLoss``'s."""
        if self.routing is not None:
            self.routing.restart_step()
        self.capacity_replay_steps.append(self.step)
        if overflow.spill:
            self.capacity_spill_steps.append(self.step)
        self.metrics_processor.capacity_replay(self.step, overflow, self.capacity_replays, self.capacity_spills,
                                               what, transport=self._transport() or Transport.SYMM.value)

    def train(self) -> None:
        """torchtitan's loop, its start and end said on the console."""
        t = self.cfg.training
        resumes = t.checkpoint_enable and checkpoint_steps(self.run_dir, str(t.checkpoint_folder))
        load = "the newest checkpoint, then " if resumes else ""
        compiled = " and torch.compile" if t.compile else ""
        stage(self.run_dir, f"start-up: {load}the first step (the slowest: warm-up{compiled})")
        super().train()  # type: ignore[misc]
        stage(self.run_dir, "finishing: summary.json and wandb")

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()
        super().close()  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        # Resumed from a checkpoint: step windows and the ETA restart from here.
        self.start_step = self.step
        self.metrics_processor.start_at(self.step)
        # The capacity starts over (and grows again, by replays, where the routing needs it);
        # the replays of the earlier launches up to the checkpoint still count (from the wandb
        # history where the launch that saved it was killed before its summary).
        earlier = earlier_record(self.run_dir, self.step)
        self.earlier_replay_steps = [s for s in (earlier.capacity_replay_steps if earlier else []) if s <= self.step]
        self.earlier_spill_steps = [s for s in (earlier.capacity_spill_steps if earlier else []) if s <= self.step]
        self.capacity_replays = self.metrics_processor.capacity_replays = len(self.earlier_replay_steps)
        self.capacity_spills = self.metrics_processor.capacity_spills = len(self.earlier_spill_steps)

    def _transport(self) -> Optional[str]:
        """The transport the EP layers run (``launch.config.memory.ep_transport``: ``a2a.transport``
        resolved as the dispatcher resolves it on this device and layout); None at EP 1."""
        if self.parallel_dims.ep < 2:
            return None
        transport = ep_transport(self.cfg, self.device.type)
        return None if transport is None else transport.value

    def should_continue_training(self) -> bool:
        """Also asked at every step boundary, on every rank: did any rank get a stop signal?
        Then all stop here, with a checkpoint of this step when checkpointing is on."""
        self._set_input_checks()
        if not super().should_continue_training():  # type: ignore[misc]
            return False
        if self.step > self.start_step:
            self.stop.trained()  # a stop now saves what was trained
        self.stopped_by = self.stop.agreed(self._stop_group, self._agreement_timeout_s())
        if self.stopped_by is None:
            return True
        ckpt = self.checkpoint_config
        if ckpt.enable and self.step > self.start_step and self.step % ckpt.interval:
            self.checkpointer.save(self.step, last_step=True)
        return False

    def _agreement_timeout_s(self) -> float:
        """How long a rank waits for the others at a step boundary before it names the missing
        ones: torchtitan's collective timeout at this point (its start-up one, and its training
        one once step 1 is trained: torchtitan shortens it there, not in a resumed launch), so the
        agreement's message comes first."""
        shortened = self.start_step == 0 and self.step >= 1
        return float(self._comm.train_timeout_seconds if shortened else self._comm.init_timeout_seconds)

    def _set_input_checks(self) -> None:
        """The dispatcher's input checks that need a host sync per dispatch
        (``mxfp8_ep.dispatcher.checks``: a bad routing on any rank named, with its rank, on
        every rank) for the first ``CHECKED_STEPS`` steps of this run (also after a resume);
        then the sync-free checks only, unless ``MXFP8_EP_DEBUG=1``."""
        from mxfp8_ep.dispatcher import checks

        checks.set_debug(True if self.step < self.start_step + CHECKED_STEPS else None)

    # -- the run's summary --------------------------------------------------------------------
    def summary(self) -> RunSummary:
        """This run's summary (rank 0); a resumed run's earlier losses come from the summary
        its earlier launch wrote."""
        from launch.config.model_facts import resolve

        h = self.metrics_processor.history
        cfg, t = self.cfg, self.cfg.training
        steps, losses = list(h.steps), list(h.losses)
        val_steps, val_losses = list(h.val_steps), list(h.val_losses)
        earlier = earlier_record(self.run_dir, self.start_step) if self.start_step else None
        if earlier is not None:
            steps, losses = _continue(earlier.logged_steps, earlier.losses, self.start_step, steps, losses)
            val_steps, val_losses = _continue(earlier.val_logged_steps, earlier.val_losses,
                                              self.start_step, val_steps, val_losses)
        replay_steps = self.earlier_replay_steps + self.capacity_replay_steps
        spill_steps = self.earlier_spill_steps + self.capacity_spill_steps
        folder = str(t.checkpoint_folder)
        saved = checkpoint_steps(self.run_dir, folder) if t.checkpoint_enable else []
        family, flavor = resolve(cfg.model.family, cfg.model.flavor)
        return RunSummary(
            run_name=str(cfg.logging.run_name or cfg.experiment),
            experiment=str(cfg.experiment),
            a2a=str(cfg.a2a.name),
            a2a_legs={k: str(v) for k, v in cfg.a2a.items() if k != "name"},
            model=str(cfg.model.name),
            model_flavor=f"{family}/{flavor}",
            parallelism=str(cfg.parallelism.name),
            world_size=self.parallel_dims.world_size,
            ep=self.parallel_dims.ep,
            launcher=str(cfg.launcher.name),
            device=self.device.type,
            gpu_shared=gpu_shared(cfg.parallelism.share_gpu, self.device.type, self.parallel_dims.world_size),
            transport=self._transport(),
            run_dir=os.path.abspath(self.run_dir),
            steps=self.step,
            target_steps=int(t.steps),
            start_step=self.start_step,
            stopped_by=signal_name(self.stopped_by),
            checkpoint=(os.path.join(os.path.abspath(self.run_dir), folder, f"step-{saved[-1]}")
                        if saved else None),
            seed=int(t.seed),
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
            # offline when an online run's wandb could not start (launch.titan.wandb_run.start_wandb)
            wandb_mode=self.metrics_processor.wandb.settings.mode if self.metrics_processor.wandb
            else str(cfg.logging.wandb_mode),
            wandb_run_id=self.metrics_processor.wandb.run.id if self.metrics_processor.wandb else None,
            stack=installed().to_dict(),
            **recipe_provenance(),
            started_at=self.started_at,
            ended_at=utc_now(),
            hosts=self.hosts,
            gpu=torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            gpu_count=(1 if gpu_shared(cfg.parallelism.share_gpu, self.device.type, self.parallel_dims.world_size)
                       else self.parallel_dims.world_size),
        )

    def finish(self) -> Optional[RunSummary]:
        """After training: on rank 0 the summary goes into ``summary.json`` at once (a job
        killed while wandb finishes keeps it) and into wandb's run summary (so wandb and the
        console show the same numbers); once wandb has finished, ``summary.json`` names its
        folders."""
        summary = self.summary() if dist.get_rank() == 0 else None
        if summary is not None:
            summary.write(self.run_dir)
        wandb_logger = self.metrics_processor.wandb
        if summary is not None and wandb_logger is not None:
            wandb_logger.set_summary(summary.wandb_summary())
        self.close()  # checkpointer and metrics processor: wandb finishes, console.log closes
        if summary is not None:
            summary.wandb_dirs = find_runs(os.path.join(self.run_dir, "wandb"))
            summary.write(self.run_dir)
        return summary


def _every_rank_host(group: Any) -> list[str]:
    """The hosts the ranks run on, each once, in rank order (collective)."""
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_name(), group=group)
    return list(dict.fromkeys(hosts))


def _continue(earlier_steps: list[int], earlier_values: list[float], start: int,
              steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """A resumed run's series: the earlier launch's points up to the resumed step, then this
    launch's."""
    kept = [(s, x) for s, x in zip(earlier_steps, earlier_values) if s <= start]
    return [s for s, _ in kept] + steps, [x for _, x in kept] + values
