"""Run a function on N local processes joined in a gloo process group (the CPU stand-in for
NCCL: the code under test is the same)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A bounded timeout turns a collective that would hang into an error.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; any rank's
    exception fails the caller with that rank's traceback."""
    mp.start_processes(
        _entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True,
        start_method="spawn",
    )
