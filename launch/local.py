"""``launcher=local``: start the training processes on this machine with torch's elastic
launcher (the API behind ``torchrun --standalone``)."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Optional

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from launch.worker import config_to_yaml, run_worker

log = logging.getLogger(__name__)


def launch_config(cfg: Any, run_dir: str) -> LaunchConfig:
    """One node, ``parallelism.procs_per_node`` processes, rendezvous on a free local port.

    On a GPU machine each process takes one GPU (validation checked there are enough); on a
    CPU-only machine they are CPU workers talking over gloo.
    """
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
        # Each rank's stdout/stderr go to the console (prefixed by rank) and to
        # <run_dir>/worker_logs/<run_id>/attempt_0/<rank>/.
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "worker_logs"), tee=Std.ALL),
        log_line_prefix_template="[rank${rank}]:",
    )


def run_local(cfg: Any, run_dir: str) -> Optional[dict]:
    """Train to the end; return rank 0's result (``run_training``'s dict) or None."""
    config = launch_config(cfg, run_dir)
    device = (
        f"{config.nproc_per_node} GPU process(es)"
        if torch.cuda.is_available()
        else f"{config.nproc_per_node} CPU process(es) (gloo)"
    )
    log.info("launcher=local: starting %s; logs in %s", device, config.logs_specs.root_log_dir)
    results = elastic_launch(config, run_worker)(config_to_yaml(cfg), run_dir)
    return results.get(0)
