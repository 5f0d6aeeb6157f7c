"""Ranks that share one GPU: the symm transport's peer buffers over CUDA IPC.

torch's symmetric memory refuses ranks on one device ("detected allocations from overlapping
devices from different ranks") and NCCL refuses two ranks per GPU, so a one-GPU machine cannot
run the symm transport as it ships. It can run everything but the mapping: here each rank
allocates its buffer on the shared GPU, the ranks exchange CUDA IPC handles over their gloo
group (``torch.multiprocessing``'s own tensor sharing), and the barrier waits on the host (this
rank's stream, then the group). The dispatcher, its compiled Triton kernels and its staging
logic run unchanged in separate processes: every row must land where its owner reads it.
Peer stores are HBM stores here, not NVLink ones, and the barrier is stronger than symmetric
memory's stream-ordered one (it only stands in for it): this checks the logic on real GPU
processes, not NVLink ordering or speed.

The barrier's host wait is the emulation's, not the dispatcher's: it runs with the sync debug
mode off and through ``torch.cuda.Stream.synchronize`` as it was at import, so
``tests.moe_harness.host_sync_check`` neither raises on it nor counts it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

SHARED_GPU_ENV = "MXFP8_EP_TEST_SHARED_GPU"  # set in a rank: its tensors live on the one GPU
_stream_synchronize = torch.cuda.Stream.synchronize


def active() -> bool:
    return os.environ.get(SHARED_GPU_ENV) == "1"


class _HostBarrier:
    """Stands in for a symmetric-memory handle's ``barrier``: once every rank has finished
    what its stream did before (its stores into peers included), all ranks go on."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def barrier(self, channel: int = 0) -> None:  # noqa: ARG002 (symm_mem's signature)
        _wait_for_stream()
        dist.barrier(group=self.group)


def _wait_for_stream() -> None:
    """The emulation's host wait for this rank's stream, unseen by the sync checks (module
    docstring)."""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        _stream_synchronize(torch.cuda.current_stream())
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def map_over_cuda_ipc(nbytes: int, group: dist.ProcessGroup, device: torch.device):
    """``peer_memory._map_symmetric_memory``'s result for ranks on one GPU: every rank's buffer,
    opened in this process, and the barrier."""
    from torch.multiprocessing.reductions import reduce_tensor

    mine = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    _wait_for_stream()  # zeroed before any peer opens it
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shared: list = [None] * world
    dist.all_gather_object(shared, reduce_tensor(mine), group=group)
    peers = [mine if r == rank else rebuild(*args) for r, (rebuild, args) in enumerate(shared)]
    dist.barrier(group=group)
    return peers, _HostBarrier(group)


def enter_rank() -> None:
    """In a spawned rank of a gloo group: the GPU is device 0 for every rank, and the symm
    transport maps its peer buffers over CUDA IPC."""
    import mxfp8_ep.peer_memory as peer_memory

    os.environ[SHARED_GPU_ENV] = "1"
    torch.cuda.set_device(0)
    peer_memory._map_symmetric_memory = map_over_cuda_ipc


def leave_rank() -> None:
    """Before the group goes: drop the cached peer buffers on every rank, then wait for all,
    so that no rank frees a buffer another still has open."""
    import gc

    from mxfp8_ep.dispatcher import release_peer_buffers

    release_peer_buffers()
    gc.collect()
    torch.cuda.synchronize()
    dist.barrier()
