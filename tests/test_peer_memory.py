"""Peer buffers of ranks that share one GPU (``peer_memory.share_one_device``), on gloo ranks:
how the ranks open each other's buffers. Each buffer goes to each peer as a CUDA IPC share of its
own. torch counts one reference per share (``reduce_tensor``) and gives one back for every
process that lets go of what it opened, so one share opened by several peers is given back more
often than taken, and torch then keeps the dropped buffer allocated for the rest of the run
(measured on one H200 at EP=4: every peer buffer an earlier arm of ``benchmarks/memory.py``
dropped, still held at the next arm's peak). The shares here are stand-ins that record who
opens them; CUDA IPC itself needs a GPU. And the order of the ranks' barrier: their streams wait
for each other's interprocess events, the host for no stream."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mxfp8_ep.exchange import peer_memory
from tests.distributed import run_on_ranks

_OPENED: list[tuple[int, int]] = []  # (rank that made the share, its number there), as opened here
_MADE: list[int] = []  # shares this process made


def _share(tensor: torch.Tensor):
    """A stand-in for ``reduce_tensor``: numbered per process, opened by ``_open``."""
    _MADE.append(len(_MADE))
    return _open, (dist.get_rank(), _MADE[-1], tensor.tolist())


def _open(owner: int, number: int, values: list) -> torch.Tensor:
    _OPENED.append((owner, number))
    return torch.tensor(values)


def _open_every_peer(rank: int, world: int) -> None:
    peers = peer_memory._open_peers(torch.full((3,), rank), dist.group.WORLD, share=_share)
    assert [int(p[0]) for p in peers] == list(range(world)), "each rank's buffer at its rank's index"
    opened: list = [None] * world
    dist.all_gather_object(opened, list(_OPENED))
    everyone = [s for shares in opened for s in shares]
    assert sorted(owner for owner, _ in _OPENED) == [r for r in range(world) if r != rank], \
        "each peer's buffer opened once"
    assert len(everyone) == len(set(everyone)) == world * (world - 1), \
        f"a share opened by more than one peer: {sorted(everyone)}"


def test_each_peer_opens_a_share_of_its_own_of_every_buffer():
    run_on_ranks(4, _open_every_peer)


def test_shared_gpu_barrier_orders_streams_not_the_host(monkeypatch):
    """``_StreamBarrier``: this rank's event is recorded on its stream before the ranks meet on
    the host, and the stream waits for every peer's event after it; the host never waits for a
    stream. (CUDA interprocess events need a GPU: here they are fakes that log what happens.)"""
    log: list = []  # what the fakes saw, in order

    class Event:
        def __init__(self, interprocess=False, name="mine"):
            assert interprocess or name != "mine"
            self.name = name

        def ipc_handle(self):
            return f"handle-{self.name}"

        @classmethod
        def from_ipc_handle(cls, device, handle):
            assert device == torch.device("cuda", 0)
            return cls(name=handle.removeprefix("handle-"))

        def record(self, stream):
            log.append(("record", self.name, stream))

        def synchronize(self):
            log.append(("host waits", self.name))

    class Stream:
        def wait_event(self, event):
            log.append(("stream waits", event.name, self))

        def synchronize(self):
            log.append(("host waits", "stream"))

    stream = Stream()
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "barrier", lambda group=None: log.append(("host barrier",)))

    def all_gather_object(out, obj, group=None):
        out[:] = ["handle-peer0", obj, "handle-peer2"]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    barrier = peer_memory._StreamBarrier(group=None, device=torch.device("cuda", 0))
    assert [e.name for e in barrier.peer_events] == ["peer0", "peer2"]
    for _ in range(2):
        log.clear()
        barrier.barrier()
        assert log == [("record", "mine", stream), ("host barrier",),
                       ("stream waits", "peer0", stream), ("stream waits", "peer2", stream)]
