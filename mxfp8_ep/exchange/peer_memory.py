"""Buffers that every rank of a group can write into directly: one byte buffer per rank,
mapped in all ranks, plus a barrier after which all writes into this rank's buffer are visible.

* CUDA: ``torch.distributed._symmetric_memory`` (NVLink peer memory on one node).
* CUDA, every rank of the group in its own process on one shared GPU (``share_one_device``;
  torch's symmetric memory refuses ranks on one device): each rank allocates its buffer on the
  GPU and the ranks open each other's through CUDA IPC handles, exchanged over the group
  (``torch.multiprocessing``'s own tensor sharing, one share per peer: ``_open_peers``). The
  barrier is stream-ordered as symmetric memory's is: each rank records an interprocess CUDA
  event, the group meets on the host (gloo), and each rank's stream then waits for every
  peer's event; no host waits for a stream. Stores into a peer are HBM stores there: for
  numerics and logic on one GPU, not for NVLink ordering or speed.
* CPU: files in ``/dev/shm`` mapped by every process of the group (``torch.from_file`` with
  ``shared=True``); the barrier is the group's (gloo) barrier. This runs the very same push
  kernels (Triton interpreter or torch twins) that CUDA runs, so CI exercises the symm
  transport on CPU processes.

Kernels get the peers' buffers as an int64 tensor of addresses (``ptrs``); torch code gets them
as tensors (``peer(rank)``). ``LocalBuffer`` has the same face over one local tensor (every
peer is itself): the nccl transport's all-to-all buffers, for the same kernels.
"""

from __future__ import annotations

import copy
import os
import uuid

import torch
import torch.distributed as dist

DISABLE_MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
_SHARED_DEVICE = False
# The shared-device mapping's one host wait (a new buffer zeroed before any peer opens it) is
# the emulation's own, not a sync the transport makes: it goes through Stream.synchronize as it
# was at import, with the sync debug mode off, so checks that patch or trap host syncs
# (``torch.cuda.set_sync_debug_mode("error")``) see none.
_stream_synchronize = torch.cuda.Stream.synchronize


def share_one_device(on: bool = True) -> None:
    """Whether the CUDA peer buffers of this process's groups are those of ranks that share one
    GPU (module docstring): every rank a process of its own on the same device, the group a
    gloo one. Every rank of the group sets it alike, before its first ``PeerBuffer``."""
    global _SHARED_DEVICE
    _SHARED_DEVICE = bool(on)


def sharing_one_device() -> bool:
    """Whether this process's CUDA peer buffers are the shared-device ones (``share_one_device``):
    plain allocations of torch's caching allocator, which its statistics count (symmetric
    memory's are not)."""
    return _SHARED_DEVICE


class PeerBuffer:
    """``nbytes`` bytes on each rank of ``group``, reachable from every rank."""

    def __init__(self, nbytes: int, group: dist.ProcessGroup, device: torch.device):
        self.nbytes = int(nbytes)
        self.group = group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.device.type == "cuda":
            mapping = _map_over_cuda_ipc if _SHARED_DEVICE else _map_symmetric_memory
            self._peers, self._handle = mapping(self.nbytes, group, self.device)
        elif self.device.type == "cpu":
            self._peers, self._handle = _map_shared_files(self.nbytes, group), None
        else:
            raise RuntimeError(f"peer buffers exist for cuda and cpu devices, not {self.device}")
        self.ptrs = int64_tensor([p.data_ptr() for p in self._peers], self.device)
        self._element_offsets: dict[int, torch.Tensor] = {}

    @property
    def local(self) -> torch.Tensor:
        return self._peers[self.rank]

    def peer(self, rank: int) -> torch.Tensor:
        return self._peers[rank]

    def element_offsets(self, itemsize: int) -> torch.Tensor:
        """Each peer buffer's address minus this rank's, in ``itemsize`` elements (kernels add
        it to a pointer into the local buffer, keeping that pointer's alignment facts)."""
        if itemsize not in self._element_offsets:
            local = self.local.data_ptr()
            deltas = [p.data_ptr() - local for p in self._peers]
            if any(d % itemsize for d in deltas):
                raise RuntimeError(f"peer buffers are not {itemsize}-byte aligned relative to each other")
            with torch.inference_mode(False):  # cached: it serves the steps after an inference-mode pass
                self._element_offsets[itemsize] = int64_tensor([d // itemsize for d in deltas], self.device)
        return self._element_offsets[itemsize]

    def barrier(self) -> None:
        """Returns (on the current stream) once every rank reached it: all writes each rank made
        into any buffer before its barrier are visible to every rank after it."""
        if self._handle is not None:
            self._handle.barrier(channel=0)
        else:
            dist.barrier(group=self.group)


def int64_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without a host sync: CUDA gets them by an asynchronous copy from
    pinned memory (a copy from pageable memory would wait for the stream)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _map_symmetric_memory(nbytes: int, group: dist.ProcessGroup, device: torch.device):
    import torch.distributed._symmetric_memory as symm_mem

    # NVLink multicast is never needed here (and can wedge shared hosts): keep it off.
    os.environ.setdefault(DISABLE_MULTICAST_ENV, "1")
    backend = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else "CUDA"
    if backend not in (None, "CUDA"):
        raise RuntimeError(f"the symm transport needs the CUDA symmetric-memory backend, got {backend}")
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group)
    peers = [handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(dist.get_world_size(group))]
    peers[dist.get_rank(group)] = buf
    return peers, handle


class _StreamBarrier:
    """A symmetric-memory handle's ``barrier`` for ranks on one GPU. Each rank records its
    interprocess event on its stream, the ranks meet on the host, and each rank's stream waits
    for its peers' events: the work after the barrier starts once every rank's work before it
    (its stores into peers included) has finished, and the host never waits for a stream.

    A peer's wait takes the event's most recent record when it is issued. That is the record of
    this barrier, or, where this rank has already gone on to its next barrier, a later one: a
    stronger wait, never a wrong one, and never a cycle (a record only depends on waits issued
    before it, on records made before those waits)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.event = torch.cuda.Event(interprocess=True)
        handles: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(handles, self.event.ipc_handle(), group=group)
        rank = dist.get_rank(group)
        self.peer_events = [torch.cuda.Event.from_ipc_handle(device, h) for r, h in enumerate(handles) if r != rank]

    def barrier(self, channel: int = 0) -> None:  # noqa: ARG002 (symm_mem's signature)
        stream = torch.cuda.current_stream()
        self.event.record(stream)
        dist.barrier(group=self.group)
        for event in self.peer_events:
            stream.wait_event(event)


def _wait_for_stream() -> None:
    """The shared-device mapping's host wait for this rank's stream (see ``_stream_synchronize``)."""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        _stream_synchronize(torch.cuda.current_stream())
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _map_over_cuda_ipc(nbytes: int, group: dist.ProcessGroup, device: torch.device):
    """``_map_symmetric_memory``'s result for ranks on one GPU: every rank's buffer, opened in
    this process through its CUDA IPC handle, and a stream barrier over interprocess events."""
    mine = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    _wait_for_stream()  # zeroed before any peer opens it
    peers = _open_peers(mine, group)
    dist.barrier(group=group)
    return peers, _StreamBarrier(group, device)


def _open_peers(mine: torch.Tensor, group: dist.ProcessGroup, share=None) -> list[torch.Tensor]:
    """Every rank's buffer in this process: ``mine`` and each peer's, opened from the share of it
    that peer made for this rank (``share``, default ``torch.multiprocessing.reductions.reduce_tensor``:
    a rebuild function and its arguments). One share per peer, as torch's CUDA IPC counts them:
    one reference taken per share, one given back by each process that lets go of what it
    opened. A share opened by several peers is given back more often than taken, and torch then
    keeps the buffer's block allocated after every rank dropped it (with 3 or more ranks)."""
    if share is None:
        from torch.multiprocessing.reductions import reduce_tensor as share

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shared: list = [None] * world
    dist.all_gather_object(shared, [None if peer == rank else share(mine) for peer in range(world)], group=group)
    return [mine if r == rank else _open_share(shares[rank]) for r, shares in enumerate(shared)]


def _open_share(share) -> torch.Tensor:
    rebuild, args = share
    return rebuild(*args)


def _map_shared_files(nbytes: int, group: dist.ProcessGroup) -> list[torch.Tensor]:
    token = [uuid.uuid4().hex if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    paths = [f"/dev/shm/mxfp8ep-{token[0]}-{r}" for r in range(world)]
    mine = torch.from_file(paths[rank], shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    mine.zero_()
    dist.barrier(group=group)
    peers = [mine if r == rank else torch.from_file(p, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
             for r, p in enumerate(paths)]
    dist.barrier(group=group)
    # Every rank has mapped every file: the names can go, the mappings stay.
    os.unlink(paths[rank])
    return [p[:nbytes] for p in peers]


class LocalBuffer:
    """A byte buffer of this rank's, taken where the kernels take a ``PeerBuffer``: every
    peer is this buffer itself (peer offsets 0), so a row is stored at its row index whatever
    rank it is bound for. The nccl transport's send and receive buffers of an all-to-all."""

    _zero_offsets: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __init__(self, local: torch.Tensor, world_size: int):
        self.local = local
        self.world_size = world_size

    def peer(self, rank: int) -> torch.Tensor:  # noqa: ARG002 (every peer is this rank)
        return self.local

    def element_offsets(self, itemsize: int) -> torch.Tensor:  # noqa: ARG002 (offsets are all 0)
        key = (self.world_size, self.local.device)
        if key not in self._zero_offsets:
            with torch.inference_mode(False):  # cached: it serves the steps after an inference-mode pass
                self._zero_offsets[key] = torch.zeros(self.world_size, dtype=torch.int64, device=self.local.device)
        return self._zero_offsets[key]


class OneProcessPeers(PeerBuffer):
    """``world`` byte buffers of one process on one device, taken where the kernels take a
    ``PeerBuffer``: peers reached by address offsets from this rank's buffer, as over peer
    memory, with no group and no barrier. For kernel tests and one-GPU benchmarks."""

    def __init__(self, nbytes: int, world: int, rank: int, device: torch.device | str):
        self._peers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
        self.nbytes, self.world_size, self.rank, self.device = int(nbytes), world, rank, torch.device(device)
        self.group, self._handle = None, None
        self._element_offsets: dict[int, torch.Tensor] = {}

    def seen_from(self, rank: int) -> OneProcessPeers:
        """The same buffers as rank ``rank`` sees them (``local`` is its buffer): one process
        playing both sides of a push, the sender and the receiver."""
        view = copy.copy(self)
        view.rank, view._element_offsets = rank, {}
        return view

    def barrier(self) -> None:
        raise RuntimeError("OneProcessPeers has no peers to wait for")
