"""Ranks that share one GPU: the symm transport's peer buffers over CUDA IPC.

torch's symmetric memory refuses ranks on one device ("detected allocations from overlapping
devices from different ranks") and NCCL refuses two ranks per GPU, so a one-GPU machine cannot
run the symm transport as it ships. It can run everything but the mapping: the library's
``peer_memory.share_one_device`` has each rank allocate its buffer on the shared GPU, open its
peers' through CUDA IPC handles exchanged over their gloo group, and order each barrier with
interprocess CUDA events (the ranks meet on the host; each stream waits for its peers'
events). The dispatcher, its compiled Triton kernels and its staging logic run unchanged in
separate processes: every row must land where its owner reads it. Peer stores are HBM stores
here, not NVLink ones: this checks the logic on real GPU processes, not NVLink ordering or
speed. The barrier makes no host wait for a stream, so ``tests.moe_harness.host_sync_check``
holds the shared-GPU dispatches to the same no-sync rule as the others (the one host wait when a
buffer is mapped is the emulation's: sync debug mode off, ``torch.cuda.Stream.synchronize`` as
it was at import).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

SHARED_GPU_ENV = "MXFP8_EP_TEST_SHARED_GPU"  # set in a rank: its tensors live on the one GPU


def active() -> bool:
    return os.environ.get(SHARED_GPU_ENV) == "1"


def enter_rank() -> None:
    """In a spawned rank of a gloo group: the GPU is device 0 for every rank, and the symm
    transport maps its peer buffers over CUDA IPC."""
    from mxfp8_ep.exchange import peer_memory

    os.environ[SHARED_GPU_ENV] = "1"
    torch.cuda.set_device(0)
    peer_memory.share_one_device()


def leave_rank() -> None:
    """Before the group goes: drop the cached peer buffers on every rank, then wait for all,
    so that no rank frees a buffer another still has open."""
    import gc

    from mxfp8_ep.dispatcher import release_peer_buffers

    release_peer_buffers()
    gc.collect()
    torch.cuda.synchronize()
    dist.barrier()
