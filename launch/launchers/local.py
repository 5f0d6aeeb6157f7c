"""``launcher=local``: start the training processes on this machine with torch's elastic
launcher (the API behind ``torchrun --standalone``)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launch.launchers.launcher import LauncherConfig, RunFailed, RunStopped, Target
from launch.launchers.machine import Machine
from launch.run import console
from launch.run.heartbeat import stage
from launch.run.run_dir import WORKER_LOGS
from launch.run.run_summary import RunSummary
from launch.run.shared_gpu import SHARED_GPU_NOTE

log = logging.getLogger(__name__)


@dataclass
class LocalLauncherConfig(LauncherConfig):
    """``launcher=local`` has no fields of its own: the parallelism group says how many
    processes to start."""

    _target_: str = "launch.launchers.local.LocalLauncher"
    name: str = "local"


class LocalLauncher:
    """One node: ``parallelism.procs_per_node`` processes, one per GPU (or all on one with
    ``parallelism.share_gpu``), or CPU processes talking over gloo on a machine without GPUs.
    Waits for the run and returns its summary."""

    Config = LocalLauncherConfig

    def target(self, cfg: Any, machine: Machine) -> Target:  # noqa: ARG002 (the Launcher protocol)
        if machine.gpus:
            smallest = min(machine.gpu_memory_bytes)
            return Target("cuda", smallest, f"each GPU's memory (the smallest of {machine.gpus})",
                          f"this machine has {machine.gpus} GPU(s)")
        return Target("cpu", machine.ram_bytes, "this machine's RAM",
                      "this machine has no GPU (the processes would run on CPU with gloo)",
                      cores=machine.cpu_count)

    def check(self, cfg: Any, machine: Machine, report: Any) -> None:
        p = cfg.parallelism
        if p.nodes > 1:
            report.error(
                f"launcher=local starts processes on this machine only, but parallelism={p.name} "
                f"asks for {p.nodes} nodes; use launcher=slurm, or parallelism.nodes=1"
            )
        if p.share_gpu:
            if not machine.gpus:
                report.warn(f"parallelism.share_gpu=true, but this machine has no GPU to share: the "
                            f"{p.procs_per_node} processes run on CPU over gloo, as without it")
        elif machine.gpus and p.procs_per_node > machine.gpus:
            report.error(
                f"parallelism={p.name} starts {p.procs_per_node} processes, one per GPU, but this "
                f"machine has {machine.gpus} GPU(s); {_fits(machine.gpus)}, or launcher=slurm"
            )
        elif machine.gpus > p.procs_per_node * max(1, p.nodes):
            idle = machine.gpus - p.procs_per_node
            uses_all = _fits(machine.gpus).removeprefix("use ")
            report.warn(f"parallelism={p.name} starts {p.procs_per_node} process(es), one per GPU, but this machine "
                        f"has {machine.gpus} GPUs: {idle} stay idle; {uses_all} uses them all")
        elif not machine.gpus and p.procs_per_node > machine.cpu_count:
            report.warn(f"no GPU: {p.procs_per_node} CPU worker processes on {machine.cpu_count} "
                        f"cores will be slow")

    def launch(self, cfg: Any, run_dir: str) -> Optional[RunSummary]:
        machine = Machine.probe()
        procs = cfg.parallelism.procs_per_node
        if not machine.gpus:
            what = f"{procs} CPU processes (gloo)"
        elif cfg.parallelism.share_gpu:
            what = f"{procs} processes sharing GPU 0 (gloo; {SHARED_GPU_NOTE})"
        else:
            what = f"{procs} GPU processes (NCCL)"
        # before torch's import: the first line comes at once
        console.show(run_dir, console.header(cfg, run_dir, what, f"{WORKER_LOGS}/ (every process), train.log"))

        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

        from launch.config.schema import config_to_yaml

        console.route_logging(cfg.logging.verbose)  # again: importing torch reset its loggers
        config = launch_config(cfg, run_dir)
        log.info("starting %s; their output: %s/%s/", what, run_dir, WORKER_LOGS)
        try:
            with console.follow(run_dir):
                stage(run_dir, f"start-up: starting {what}")
                elastic_launch(config, worker_entrypoint)(config_to_yaml(cfg), run_dir)
        except SignalException as e:  # Ctrl-C / SIGTERM: the workers have stopped cleanly
            raise RunStopped(int(e.sigval), RunSummary.read(run_dir)) from None
        except KeyboardInterrupt:  # before the workers were started
            raise RunStopped(int(signal.SIGINT), RunSummary.read(run_dir)) from None
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            raise RunFailed(failure_line(rank, failure, run_dir)) from None
        log.info("every process exited cleanly")
        return RunSummary.read(run_dir)


def failure_line(rank: int, failure: Any, run_dir: str) -> str:
    """The one line that says which rank failed, why, and where its output is, from torch
    elastic's ``ProcessFailure``. A worker's Python exception comes through its ``@record``
    error file, whose ``message`` is ``{"message": "<type>: <text>", "extraInfo": {...}}``; a
    worker killed by a signal or exiting without one has a plain string, or only its exit code."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message")
    lines = str(message or "").strip().splitlines()
    if not lines or lines[-1].startswith("To enable traceback"):  # torch's text when it knows nothing
        reason = f"exit code {failure.exitcode}"
    else:
        reason = lines[-1]
    log_dir = Path(failure.error_file).parent if failure.error_file else Path(run_dir) / WORKER_LOGS
    return f"rank {rank} failed: {reason}; its full output: {log_dir}/stderr.log and stdout.log"


def _fits(gpus: int) -> str:
    """What to run on a machine with ``gpus`` GPUs."""
    if gpus == 1:
        return ("use parallelism=single (one process; EP 1 sends nothing over the wire, so "
                "bf16 and MXFP8 cost the same there), or parallelism=ep2_shared_gpu for EP numerics "
                "(two processes take turns on the GPU: no speed figure)")
    if gpus in PARALLELISM_OPTIONS:
        return f"use parallelism={PARALLELISM_OPTIONS[gpus]}"
    return (f"use parallelism.procs_per_node={gpus} with parallelism.ep={gpus} (or a divisor "
            f"of it)")


# conf/parallelism's one-node options by their number of processes (one per GPU).
PARALLELISM_OPTIONS = {2: "ep2", 4: "ep4", 8: "ep8"}


def worker_entrypoint(cfg_yaml: str, run_dir: str) -> None:
    """What each process torch elastic starts runs; a failing rank's traceback reaches the
    launcher's error report (``record``)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_train_until_stopped)(cfg_yaml, run_dir)


def _train_until_stopped(cfg_yaml: str, run_dir: str) -> None:
    """Train; after a clean stop exit at once: the agent is shutting its workers down and
    would wait for a result nobody reads. Results are read from ``summary.json``."""
    from launch.launchers.worker import run_worker
    from launch.run.stop import Stopped, StopSignals

    try:
        # from here on, Ctrl-C / SIGTERM stop the run: at once before a step is trained, else cleanly
        with StopSignals(exit_before_training=True):
            run_worker(cfg_yaml, run_dir)
    except Stopped:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except BaseException:
        # torch's spawn wrapper keeps the traceback only in the error file: the rank's
        # stderr.log, which the failure message names, gets it too.
        traceback.print_exc()
        raise


def launch_config(cfg: Any, run_dir: str) -> Any:
    """torch elastic's ``LaunchConfig``: one node, ``parallelism.procs_per_node`` processes,
    rendezvous on a free local port. Every rank's stdout/stderr go to
    ``<run_dir>/worker_logs/<run id>/attempt_0/<rank>/``; with ``logging.verbose=true`` also to
    the console, prefixed by rank."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.parallelism.procs_per_node,
        run_id=f"mxfp8ep-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(
            log_dir=os.path.join(run_dir, WORKER_LOGS),
            redirects=Std.ALL,
            tee=Std.ALL if cfg.logging.verbose else Std.NONE,
        ),
        log_line_prefix_template="[rank${rank}]:",
    )
