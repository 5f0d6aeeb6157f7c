"""``parallelism.share_gpu``: every training process of a run on one GPU, for EP numerics on a
one-GPU machine.

NCCL refuses two ranks on one GPU and torch's symmetric memory refuses ranks on one device. The
ranks of such a run therefore (``join_one_gpu``, before torchtitan's ``Trainer`` starts):

* all sit on the machine's first visible GPU (torchtitan puts a rank on ``cuda:LOCAL_RANK``, so
  ``LOCAL_RANK`` is 0 in every one of them);
* talk over a gloo process group, started here so that torchtitan does not start NCCL (gloo
  stages CUDA tensors through host memory);
* reduce FSDP's gradients with SUM and scale them apart (gloo has no AVG or PREMUL_SUM:
  ``launch.titan.cpu_compat.force_sum_reduction``, applied by the runner to any gloo run);
* exchange the EP rows through the symm transport's peer buffers, opened over CUDA IPC, with
  a barrier over interprocess CUDA events (``mxfp8_ep.exchange.peer_memory.share_one_device``).

torch's functional all-gather crashes on CUDA tensors over gloo (torch 2.11), and the nccl
transport's MXFP8 path exchanges its counts with one, so ``launch/preflight/validate.py`` requires the
symm transport. The ranks take turns on the GPU, their FSDP traffic goes through host memory: the run's throughput
is no speed figure. Its summary says the GPU was shared (``RunSummary.gpu_shared``), and
``compare_runs`` and the benchmark rows mark it.
"""

from __future__ import annotations

import os
from datetime import timedelta

# What marks a run whose ranks shared one GPU, wherever its throughput is shown.
SHARED_GPU_NOTE = "ranks shared one GPU (parallelism.share_gpu): throughput is not a speed claim"


def gpu_shared(share_gpu: bool, device: str, world_size: int) -> bool:
    """Whether a run's ranks shared one GPU: asked for, on CUDA, with more than one rank (on a
    machine without a GPU the option changes nothing)."""
    return bool(share_gpu) and device == "cuda" and world_size > 1


def join_one_gpu(timeout_s: float) -> None:
    """In each training process of a ``parallelism.share_gpu`` run on CUDA (torch elastic's
    environment set), before torchtitan's ``Trainer``: this rank on GPU 0, the gloo group,
    peer buffers over CUDA IPC (module docstring)."""
    import torch
    import torch.distributed as dist

    from mxfp8_ep.exchange import peer_memory

    os.environ["LOCAL_RANK"] = "0"
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    peer_memory.share_one_device()
