"""Step metrics for the recipe: torchtitan's MetricsProcessor plus what an EP/MXFP8 study needs.

torchtitan (0.2.2 and 0.3.0 alike) already measures loss, grad norm, tokens/s per device, TFLOPS,
MFU, peak memory and step time. :class:`RecipeMetrics` keeps those (same metric keys, so
dashboards match stock torchtitan runs; the names are ``launch.run.run_summary``'s) and adds:

* ``throughput/global_tps``: tokens/s over all ranks (torchtitan's ``throughput(tps)`` is per
  device),
* ``a2a/bytes_per_step`` (and per leg): bytes the EP all-to-alls sent, summed over ranks, read
  from ``mxfp8_ep.telemetry.wire_stats`` (the MXFP8 core records every exchange there); the part
  of each leg that crossed between nodes (the two_hop transport's node hop) under its own name
  (``a2a/dispatch_fwd_inter_node_bytes_per_step``, and their sum ``a2a/inter_node_bytes_per_step``),
  not added to the total again,
* ``a2a/mode``: the a2a preset name, in the log line and the wandb config,
* ``a2a/capacity_rows``, ``a2a/replays`` and ``a2a/spills`` (symm transport): the largest
  expert-major capacity, the steps run again after a capacity overflow so far, and those of
  them that needed more than the ceiling (``mxfp8_ep.elastic``),
* ``moe/imbalance_ep<e>``: the rows the busiest rank would receive at EP 2, 4, 8 and the run's
  own over the balanced count, the window's largest (``launch.titan.routing_telemetry``),
* ``numerics/...``: the MXFP8 legs' quantization telemetry on the steps ``logging.numerics_every``
  samples (``launch.run.numerics_log``; names in ``launch.run.run_summary``), with a console line,
* ``time_metrics/eta(s)``: estimated time left, from the mean step time so far,
* ``val/loss``: the validation loss (``launch.titan.validation``), with its own console line,
* any further metrics a component hands to :meth:`RecipeMetricsProcessor.log_metrics` or
  through ``extra_metrics``, passed to wandb as they are (``numerics/...`` ones also kept for
  the run's summary),
* a console line per log window (``launch.run.console.progress_line``) in ``<run dir>/console.log``,
* a run history (``history``) the runner turns into the run's ``RunSummary``.

:class:`RecipeMetricsProcessor` is it over torchtitan 0.2.2's ``MetricsProcessor``;
``launch.titan.titan030.metrics`` puts it over 0.3.0's (whose constructor takes a config).

TFLOPS and MFU need the accelerator's peak FLOPS; a CPU has none torchtitan knows (it would
fall back to an A100's), so on CPU they are not logged and the summary shows n/a.

Only rank 0 logs to wandb, through ``launch.titan.wandb_run.RecipeWandBLogger``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torchtitan.components.metrics import LoggerContainer, MetricsProcessor
from torchtitan.tools.logging import logger

from launch.run import numerics_log
from launch.run import run_summary as names
from launch.run.console import format_eta, progress_line, validation_line
from launch.titan.routing_telemetry import RoutingTelemetry
from launch.titan.wandb_run import RecipeWandBLogger, WandbSettings, start_line, start_wandb
from mxfp8_ep import elastic
from mxfp8_ep.telemetry import wire_stats
from mxfp8_ep.config import LEGS
from mxfp8_ep.transport import Transport

__all__ = ["RecipeMetrics", "RecipeMetricsProcessor", "RunHistory"]

# wire_stats' keys of the legs' inter-node parts, in the order of their WIRE_PARTS names.
_INTER_NODE_KEYS = tuple(wire_stats.inter_node_key(leg) for leg in LEGS)


@dataclass
class RunHistory:
    """What the runner reports at the end (rank 0): one entry per logged step. ``windows``: each
    log window's steps and its throughput, step time and byte metrics as logged (TFLOPS and MFU
    absent on CPU), which ``run_summary.steady_numbers`` sums up."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    windows: list[dict[str, float]] = field(default_factory=list)
    max_reserved_gib: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    # numerics telemetry: metric name -> its values, in step order
    numerics: dict[str, list[float]] = field(default_factory=dict)

    def record_numerics(self, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if key.startswith(names.NUMERICS_PREFIX):
                self.numerics.setdefault(key, []).append(float(value))


class RecipeMetrics:
    """What the recipe adds to torchtitan's MetricsProcessor: global throughput, a2a bytes, a2a
    mode, ETA, console lines, history. Put before torchtitan's ``MetricsProcessor`` in the bases;
    its constructor calls :meth:`start_recipe_metrics` after torchtitan's.

    ``log`` runs on every rank (torchtitan calls it on each), so the all-reduce of the wire
    byte counters is a proper collective; only rank 0 has loggers and the console file.
    """

    def start_recipe_metrics(
        self,
        *,
        total_steps: int,
        a2a_name: str = "bf16",
        wandb_settings: Optional[WandbSettings] = None,
        wandb_config: dict[str, Any] | None = None,
        console_path: Optional[str] = None,
    ) -> None:
        self.a2a_name = a2a_name
        self.history = RunHistory()
        self.total_steps = total_steps
        self.wandb: Optional[RecipeWandBLogger] = None
        self.console = open(console_path, "a", buffering=1) if console_path and _rank() == 0 else None
        self._flops_known = self.device_memory_monitor.device.type != "cpu"
        self._last_logged_step = 0
        self._train_time = 0.0  # seconds over steps after the first logged window
        self._train_steps = 0
        self._first_window_done = False
        self.capacity_replays = 0  # the trainer counts them (earlier launches included)
        self.capacity_spills = 0
        self.routing: Optional[RoutingTelemetry] = None  # the trainer's, once its model exists
        if wandb_settings is not None and _rank() == 0:
            if self.console is not None:  # a start-up stage: wandb's own start takes seconds
                self.console.write(start_line(wandb_settings.mode) + "\n")
            container = LoggerContainer()
            container.add_logger(self.logger)
            self.wandb = start_wandb(wandb_settings, wandb_config or {}, self._say)
            if self.wandb is not None:
                container.add_logger(self.wandb)
            self.logger = container
        wire_stats.reset()

    def _say(self, line: str) -> None:
        """A line for the console (rank 0's ``console.log``) and the worker's log."""
        logger.warning(line)
        if self.console is not None:
            self.console.write(line + "\n")

    def start_at(self, step: int) -> None:
        """Tell the processor the step training resumes from (after a checkpoint load)."""
        self._last_logged_step = step
        self.time_last_log = time.perf_counter()

    def _wire_bytes(self) -> dict[str, float]:
        """Bytes sent since the last log by all ranks: per ``names.WIRE_PARTS`` name (each leg,
        ``other``, each leg's inter-node part and their sum) and ``total`` (the legs and
        ``other``: an inter-node part is inside its leg's count already).

        A fixed layout (the four legs, ``other`` for any key the core may add, the inter-node
        parts) keeps the all-reduce identical on every rank.
        """
        local = wire_stats.snapshot(reset=True)
        total_inter = wire_stats.inter_node_key("total")
        inter = {k: v for k, v in local.items() if k.endswith(f".{wire_stats.INTER_NODE}") and k != total_inter}
        values = [float(local.get(leg, 0)) for leg in LEGS]
        values.append(float(sum(v for k, v in local.items() if k not in LEGS and k not in inter
                                and k not in ("total", total_inter))))
        values += [float(local.get(key, 0)) for key in _INTER_NODE_KEYS]
        values.append(float(sum(inter.values())))
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
        totals = dict(zip(names.WIRE_PARTS, values))
        totals["total"] = sum(values[:len(LEGS) + 1])
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
        # None after the first window: its steps include start-up, which says nothing of the rest.
        eta = (self._train_time / self._train_steps * max(0, self.total_steps - step)
               if self._train_steps else None)

        metrics: dict[str, Any] = {
            names.LOSS: global_avg_loss,
            "loss_metrics/global_max_loss": global_max_loss,
            "grad_norm": grad_norm,
            names.TOKENS_PER_S: tps,
            names.TOKENS_PER_S_GLOBAL: global_tps,
            names.STEP_TIME: step_time,
            "time_metrics/data_loading(s)": data_time / max(1, len(self.data_loading_times)),
            "time_metrics/data_loading(%)": 100 * data_time / time_delta,
            "memory/max_active(GiB)": mem.max_active_gib,
            "memory/max_active(%)": mem.max_active_pct,
            names.MAX_MEMORY: mem.max_reserved_gib,
            "memory/max_reserved(%)": mem.max_reserved_pct,
            "memory/num_alloc_retries": mem.num_alloc_retries,
            "memory/num_ooms": mem.num_ooms,
            names.A2A_BYTES: a2a_bytes_per_step,
        }
        if eta is not None:
            metrics["time_metrics/eta(s)"] = eta
        tflops = mfu = None
        if self._flops_known:
            tflops = self.num_flops_per_token * tps / 1e12
            mfu = 100 * self.num_flops_per_token * tps / self.gpu_peak_flops
            metrics.update({names.TFLOPS: tflops, names.MFU: mfu})
        for part, value in wire.items():  # other and the inter-node parts where some were counted
            if part != "total" and (part in LEGS or value):
                metrics[names.a2a_leg_metric(part)] = value / steps_in_window
        capacity = elastic.capacity_rows()
        if capacity is not None:
            metrics.update({names.A2A_CAPACITY_ROWS: capacity, names.A2A_REPLAYS: self.capacity_replays,
                            names.A2A_SPILLS: self.capacity_spills})
        if self.routing is not None:  # a collective, like the wire bytes
            metrics.update(self.routing.collect())
        if extra_metrics:
            metrics.update(extra_metrics)
            self.history.record_numerics(extra_metrics)
        # The quantization telemetry of the steps sampled since the last log (a collective then).
        numerics = numerics_log.collect_metrics(self.model_parts or [])
        metrics.update(numerics)
        self.history.record_numerics(numerics)
        self.logger.log(metrics, step)

        h = self.history
        h.steps.append(step)
        h.losses.append(float(global_avg_loss))
        h.windows.append({names.WINDOW_STEPS: steps_in_window,
                          **{k: float(metrics[k]) for k in names.SUMMARY_METRICS if k in metrics}})
        h.max_reserved_gib.append(mem.max_reserved_gib)

        c = self.color
        flops = f"tflops: {tflops:,.2f}  mfu: {mfu:.2f}%  " if tflops is not None else ""
        logger.info(
            f"{c.red}step: {step:2}/{self.total_steps}  "
            f"{c.green}loss: {global_avg_loss:8.5f}  "
            f"{c.orange}grad_norm: {grad_norm:7.4f}  "
            f"{c.turquoise}memory: {mem.max_reserved_gib:5.2f}GiB({mem.max_reserved_pct:.2f}%)  "
            f"{c.blue}tps: {round(tps):,} (global {round(global_tps):,})  "
            f"{c.cyan}{flops}"
            f"{c.yellow}a2a[{self.a2a_name}]: {a2a_bytes_per_step / 2**20:,.2f}MiB/step  "
            f"{c.white}step: {step_time:.2f}s  eta: {format_eta(eta) if eta is not None else '-'}{c.reset}"
        )
        if self.console is not None:
            self.console.write(progress_line(step, self.total_steps, global_avg_loss, global_tps, eta) + "\n")
            line = numerics_log.console_line(step, numerics)
            if line:
                self.console.write(line + "\n")

        self._last_logged_step = step
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()

    def capacity_replay(self, step: int, overflow: elastic.Overflow, replays: int, spills: int,
                        what: str = "step", transport: str = "symm") -> None:
        """A step (or a validation batch: ``what``) runs again after a capacity overflow (every
        rank calls it; rank 0 writes the console line). ``transport``: the EP layers' (two_hop
        also grows its node hop's rows per node pair)."""
        self.capacity_replays, self.capacity_spills = replays, spills
        grown = ", ".join(f"{old:,} -> {new:,}" for old, new in overflow.grown)
        pool = ", ".join(f"{old:,} -> {new:,}" for old, new in overflow.pool_grown)
        elsewhere = "on another rank"  # this rank's own rows fitted: another rank's overflowed
        if overflow.spill:
            past = [f"{what_spilled} needed {needed:,} rows, ceiling {ceiling:,}"
                    for what_spilled, spilled in (("a dispatch", overflow.spilled),
                                                  ("the activation pool", overflow.pool_spilled))
                    for ceiling, needed in spilled]
            line = (f"step {step}: more rows were needed than a ceiling allows ({'; '.join(past) or elsewhere}); "
                    f"{what} run again with each dispatch at exactly its rows ({names.A2A_SPILLS} = {spills})")
        elif (pool or overflow.pool_only) and not grown:
            line = (f"step {step}: the MoE layers kept more routed rows than the activation pool holds; pool grown "
                    f"({f'{pool} rows' if pool else elsewhere}), {what} run again ({names.A2A_REPLAYS} = {replays})")
        else:
            also = f", activation pool grown ({pool} rows)" if pool else ""
            rows = ("rows (expert rows, or node-hop rows per node pair)" if Transport(transport) is Transport.TWO_HOP
                    else "expert rows")
            line = (f"step {step}: a {transport} dispatch needed more {rows} than its capacity; capacity grown "
                    f"({f'{grown} rows' if grown else elsewhere}){also}, {what} run again "
                    f"({names.A2A_REPLAYS} = {replays})")
        if _rank() == 0:
            self._say(line)

    def log_validation(self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None,
                       seconds: float = 0.0) -> None:
        """The validation loss at ``step`` (every rank calls it; rank 0 has the loggers).
        ``seconds``: how long validation took, left out of the next training window's step
        time and throughput."""
        self.time_last_log += seconds
        self.log_metrics(step, {names.VAL_LOSS: loss, **(extra_metrics or {})})
        self.history.val_steps.append(step)
        self.history.val_losses.append(float(loss))
        c = self.color
        logger.info(f"{c.red}step: {step:2}/{self.total_steps}  {c.yellow}validation loss: "
                    f"{loss:8.5f}  {c.white}({seconds:.2f}s){c.reset}")
        if self.console is not None:
            self.console.write(validation_line(step, self.total_steps, loss) + "\n")

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Log ``metrics`` at ``step`` to the loggers (wandb) as they are; ``numerics/...``
        values are also kept for the run's summary."""
        self.history.record_numerics(metrics)
        self.logger.log(metrics, step)

    def close(self) -> None:
        super().close()  # the loggers: wandb finishes here (exit code 0)
        if self.console is not None:
            self.console.close()
            self.console = None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RecipeMetricsProcessor(RecipeMetrics, MetricsProcessor):
    """:class:`RecipeMetrics` over torchtitan 0.2.2's ``MetricsProcessor``."""

    def __init__(
        self,
        job_config: Any,
        parallel_dims: Any,
        tag: str | None = None,
        *,
        a2a_name: str = "bf16",
        wandb_settings: Optional[WandbSettings] = None,
        wandb_config: dict[str, Any] | None = None,
        console_path: Optional[str] = None,
    ) -> None:
        super().__init__(job_config, parallel_dims, tag)
        self.start_recipe_metrics(total_steps=job_config.training.steps, a2a_name=a2a_name,
                                  wandb_settings=wandb_settings, wandb_config=wandb_config,
                                  console_path=console_path)
