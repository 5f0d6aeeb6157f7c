"""Step metrics for the recipe: torchtitan's MetricsProcessor plus what an EP/MXFP8 study needs.

torchtitan 0.2.2 already measures loss, grad norm, tokens/s per device, TFLOPS, MFU, peak memory
and step time. :class:`RecipeMetricsProcessor` keeps those (same metric keys, so dashboards
match stock torchtitan runs) and adds:

* ``throughput/global_tps``: tokens/s over all ranks (torchtitan's ``throughput(tps)`` is per
  device),
* ``a2a/bytes_per_step`` (and per leg): bytes the EP all-to-alls sent, summed over ranks, read
  from ``mxfp8_ep.wire_stats`` (the MXFP8 core records every exchange there),
* ``a2a/mode``: the a2a preset name, in the console line and the wandb config,
* ``time_metrics/eta(s)``: estimated time left, from the mean step time so far,
* a run history (``history``) that ``launch.titan_runner`` returns as the run summary.

:class:`RecipeWandBLogger` replaces torchtitan's ``WandBLogger`` because that one puts the run
under ``<dump>/tb/<timestamp>`` and logs only torchtitan's config; ours writes
``<run_dir>/wandb/...`` and logs the full composed recipe config. Like torchtitan's, it takes
project/entity/name/group/tags from the ``WANDB_*`` environment (set by the runner from
``cfg.logging``), and only rank 0 creates it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from mxfp8_ep import wire_stats

__all__ = ["RecipeMetricsProcessor", "RecipeWandBLogger", "RunHistory", "format_eta"]

_LEGS = ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd")


@dataclass
class RunHistory:
    """What the runner reports at the end (rank 0): one entry per logged step."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tps: list[float] = field(default_factory=list)
    global_tps: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    a2a_bytes_per_step: list[float] = field(default_factory=list)
    a2a_leg_bytes_per_step: list[dict[str, float]] = field(default_factory=list)
    tflops: list[float] = field(default_factory=list)
    mfu: list[float] = field(default_factory=list)
    max_reserved_gib: list[float] = field(default_factory=list)


def format_eta(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``3s``."""
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


class RecipeWandBLogger(BaseLogger):
    """wandb run under ``run_dir`` with the full recipe config; settings from ``WANDB_*`` env."""

    def __init__(self, run_dir: str, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        os.makedirs(run_dir, exist_ok=True)
        tags = [t for t in os.getenv("WANDB_RUN_TAGS", "").split(",") if t]
        self.run = wandb.init(
            entity=os.getenv("WANDB_TEAM") or os.getenv("WANDB_ENTITY") or None,
            project=os.getenv("WANDB_PROJECT", "mxfp8-ep"),
            name=os.getenv("WANDB_RUN_NAME") or None,
            id=os.getenv("WANDB_RUN_ID") or None,
            group=os.getenv("WANDB_RUN_GROUP") or None,
            tags=tags or None,
            mode=os.getenv("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            dir=run_dir,
            config=config,
            # A preempted run that resumes appends to the same wandb run id when WANDB_RUN_ID
            # is set; otherwise it is a new run in the same group.
            resume="allow" if os.getenv("WANDB_RUN_ID") else None,
        )
        logger.info(f"wandb ({os.getenv('WANDB_MODE', 'offline')}) logging to {self.run.dir}")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.wandb.run is not None:
            self.wandb.finish()


class RecipeMetricsProcessor(MetricsProcessor):
    """torchtitan's MetricsProcessor + global throughput, a2a bytes, a2a mode, ETA, history.

    ``log`` runs on every rank (torchtitan calls it on each), so the all-reduce of the wire
    byte counters is a proper collective; only rank 0 has loggers attached.
    """

    def __init__(
        self,
        job_config: JobConfig,
        parallel_dims: ParallelDims,
        tag: str | None = None,
        *,
        a2a_name: str = "bf16",
        wandb_run_dir: str | None = None,
        wandb_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(job_config, parallel_dims, tag)
        self.a2a_name = a2a_name
        self.history = RunHistory()
        self.total_steps = job_config.training.steps
        self._last_logged_step = 0
        self._train_time = 0.0  # seconds over steps after the first logged window
        self._train_steps = 0
        self._first_window_done = False
        if wandb_run_dir is not None and _rank() == 0:
            container = LoggerContainer()
            container.add_logger(self.logger)
            try:
                container.add_logger(RecipeWandBLogger(wandb_run_dir, wandb_config or {}))
            except Exception as e:  # noqa: BLE001 - like torchtitan: wandb must not stop training
                logger.error(f"wandb logging disabled, wandb.init failed: {e}")
            self.logger = container
        wire_stats.reset()

    def start_at(self, step: int) -> None:
        """Tell the processor the step training resumes from (after a checkpoint load)."""
        self._last_logged_step = step
        self.time_last_log = time.perf_counter()

    def _wire_bytes(self) -> dict[str, float]:
        """Bytes sent since the last log by all ranks: per leg, ``other`` and ``total``.

        A fixed layout (the four legs + ``other`` for any key the core may add) keeps the
        all-reduce identical on every rank.
        """
        local = wire_stats.snapshot(reset=True)
        values = [float(local.get(leg, 0)) for leg in _LEGS]
        values.append(float(sum(v for k, v in local.items() if k not in _LEGS and k != "total")))
        if dist.is_available() and dist.is_initialized():
            # On the trainer's device: NCCL cannot reduce host tensors (gloo reduces CPU ones).
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
            t = torch.tensor(values, dtype=torch.float64, device=device)
            dist.all_reduce(t)
            values = t.tolist()
        totals = dict(zip(_LEGS + ("other",), values))
        totals["total"] = sum(values)
        return totals

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        assert self.num_flops_per_token > 0, "num_flops_per_token must be set"
        now = time.perf_counter()
        time_delta = now - self.time_last_log
        steps_in_window = max(1, step - self._last_logged_step)
        step_time = time_delta / steps_in_window

        world = self.parallel_dims.world_size
        non_dp = self.parallel_dims.non_data_parallel_size
        tps = self.ntokens_since_last_log / (time_delta * non_dp)
        global_tps = tps * world
        tflops = self.num_flops_per_token * tps / 1e12
        mfu = 100 * self.num_flops_per_token * tps / self.gpu_peak_flops
        data_time = sum(self.data_loading_times)
        mem = self.device_memory_monitor.get_peak_stats()

        wire = self._wire_bytes()
        a2a_bytes_per_step = wire["total"] / steps_in_window

        # ETA from the mean step time, leaving out the first window of this process
        # (lazy init, compile, checkpoint load).
        if self._first_window_done:
            self._train_time += time_delta
            self._train_steps += steps_in_window
        self._first_window_done = True
        mean_step = self._train_time / self._train_steps if self._train_steps else step_time
        eta = mean_step * max(0, self.total_steps - step)

        metrics: dict[str, Any] = {
            "loss_metrics/global_avg_loss": global_avg_loss,
            "loss_metrics/global_max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            "throughput/global_tps": global_tps,
            "tflops": tflops,
            "mfu(%)": mfu,
            "time_metrics/end_to_end(s)": step_time,
            "time_metrics/data_loading(s)": data_time / max(1, len(self.data_loading_times)),
            "time_metrics/data_loading(%)": 100 * data_time / time_delta,
            "time_metrics/eta(s)": eta,
            "memory/max_active(GiB)": mem.max_active_gib,
            "memory/max_active(%)": mem.max_active_pct,
            "memory/max_reserved(GiB)": mem.max_reserved_gib,
            "memory/max_reserved(%)": mem.max_reserved_pct,
            "memory/num_alloc_retries": mem.num_alloc_retries,
            "memory/num_ooms": mem.num_ooms,
            "a2a/bytes_per_step": a2a_bytes_per_step,
        }
        for leg, value in wire.items():
            if leg != "total" and (leg != "other" or value):
                metrics[f"a2a/{leg}_bytes_per_step"] = value / steps_in_window
        if extra_metrics:
            metrics.update(extra_metrics)
        self.logger.log(metrics, step)

        h = self.history
        h.steps.append(step)
        h.losses.append(float(global_avg_loss))
        h.grad_norms.append(float(grad_norm))
        h.tps.append(tps)
        h.global_tps.append(global_tps)
        h.step_times.append(step_time)
        h.a2a_bytes_per_step.append(a2a_bytes_per_step)
        h.a2a_leg_bytes_per_step.append(
            {leg: wire[leg] / steps_in_window for leg in _LEGS + ("other",)}
        )
        h.tflops.append(tflops)
        h.mfu.append(mfu)
        h.max_reserved_gib.append(mem.max_reserved_gib)

        c = self.color
        logger.info(
            f"{c.red}step: {step:2}/{self.total_steps}  "
            f"{c.green}loss: {global_avg_loss:8.5f}  "
            f"{c.orange}grad_norm: {grad_norm:7.4f}  "
            f"{c.turquoise}memory: {mem.max_reserved_gib:5.2f}GiB({mem.max_reserved_pct:.2f}%)  "
            f"{c.blue}tps: {round(tps):,} (global {round(global_tps):,})  "
            f"{c.cyan}tflops: {tflops:,.2f}  "
            f"{c.magenta}mfu: {mfu:.2f}%  "
            f"{c.yellow}a2a[{self.a2a_name}]: {a2a_bytes_per_step / 2**20:,.2f}MiB/step  "
            f"{c.white}step: {step_time:.2f}s  eta: {format_eta(eta)}{c.reset}"
        )

        self._last_logged_step = step
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
