"""Run a function on N local processes joined in one process group: gloo on CPU (CI), NCCL
on GPUs (one per rank), or gloo with every rank on one GPU (``tests.shared_gpu``: the symm
transport on a one-GPU machine). The code under test is the same for all."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


SHARED_GPU = "shared_gpu"  # run_on_ranks backend: tests.shared_gpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backends(world_size: int) -> list[str]:
    """gloo always; NCCL too where this machine has a GPU per rank."""
    return ["gloo"] + (["nccl"] if torch.cuda.device_count() >= world_size else [])


def rank_device() -> torch.device:
    """Where this rank's tensors live: its GPU under NCCL, the one GPU when ranks share it,
    else the CPU."""
    from tests import shared_gpu

    if dist.get_backend() == "nccl" or shared_gpu.active():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _entry(rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn, args) -> None:
    import faulthandler

    from tests import shared_gpu

    faulthandler.enable()  # a rank that crashes in native code still says where
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    kwargs = {}
    if backend == SHARED_GPU:
        shared_gpu.enter_rank()
    elif backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    # A bounded timeout turns a collective that would hang into an error.
    dist.init_process_group("gloo" if backend == SHARED_GPU else backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    try:
        fn(rank, world_size, *args)
        if backend == SHARED_GPU:
            shared_gpu.leave_rank()
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args, backend: str = "gloo", timeout_s: float = 120) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; any rank's
    exception fails the caller with that rank's traceback. ``backend``: gloo, nccl, or
    ``SHARED_GPU`` (gloo, every rank on GPU 0, peer buffers over CUDA IPC). ``timeout_s``: the
    group's collective timeout."""
    mp.start_processes(
        _entry, args=(world_size, free_port(), backend, timeout_s, fn, args), nprocs=world_size, join=True,
        start_method="spawn",
    )
