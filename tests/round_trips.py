"""What the dispatcher tests share: the transports a rank can run and the token capacity every
test dispatcher is built for (the fuzz, tests/test_dispatcher.py, and the checks beside it), and,
for those checks, a hand-made routing sent there and back through a dispatcher with identity
experts."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher
from mxfp8_ep.elastic import ReplayGuard
from mxfp8_ep.transport import Transport
from tests import shared_gpu
from tests.distributed import rank_device

MAX_TOKENS = 16  # per rank; TokenDispatcher.Config.max_tokens_per_rank of every test dispatcher
# The gloo collective timeout of the bad-input checks (``run_forked(..., timeout_s=...)``): a rank
# left waiting for a peer fails within it. Every rank has raised by half of it.
TIMEOUT_S = 10
ERROR_WITHIN_S = TIMEOUT_S / 2
# The transports of one node's worth of ranks (two_hop takes a node layout: tests/test_two_hop*.py);
# symm first: the fused nccl path is checked against it.
TRANSPORTS = (Transport.SYMM, Transport.NCCL)


def rank_transports() -> tuple[str, ...]:
    """The transports this rank's group can run: both, but only symm where ranks share one GPU
    (``tests.shared_gpu``: a gloo group; the nccl transport's functional collectives over gloo
    with CUDA tensors crash in torch 2.11)."""
    return ("symm",) if shared_gpu.active() else TRANSPORTS


def build_dispatcher(transport, preset="bf16", num_experts=None, top_k=1, check_inputs=True, **a2a_overrides):
    """A dispatcher over the whole group on this rank's device: 2 experts per rank unless told,
    buffers for ``MAX_TOKENS`` per rank, every input check on (``Config.check_inputs``)."""
    num_experts = num_experts or 2 * dist.get_world_size()
    config = TokenDispatcher.Config(
        num_experts=num_experts, top_k=top_k, max_tokens_per_rank=MAX_TOKENS, check_inputs=check_inputs,
        a2a=A2AConfig.preset(preset, transport=transport, **a2a_overrides),
    )
    return config.build(dist.group.WORLD, rank_device())


def to_next_rank(rank, world, tokens, dim, dtype=torch.float32, seed=0):
    """Top-1 routing of every token to the first expert of the next rank (2 experts per rank;
    every row crosses), score 1: a layer with identity experts gives each token back."""
    x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed + rank)).to(dtype)
    ids = torch.full((tokens, 1), (rank + 1) % world * 2, dtype=torch.int64)
    scores = torch.ones(tokens, 1)
    return x, scores, ids, torch.bincount(ids.reshape(-1), minlength=2 * world)


def round_trip(dispatcher, x, scores, ids, counts):
    """dispatch -> identity experts -> combine -> backward of sum(out): routed input (valid
    rows), combine output, x grad, score grad."""
    x = x.clone().requires_grad_(True)
    scores = scores.clone().requires_grad_(True)
    routed, per_expert, meta = dispatcher.dispatch(x, scores, ids, counts)
    out = dispatcher.combine(routed.clone(), meta)
    out.backward(torch.ones_like(out))
    return routed.detach()[: int(per_expert.sum())], out.detach(), x.grad, scores.grad


def replayed(run):
    """``run()`` (forward and backward on fresh leaf tensors) through
    ``mxfp8_ep.elastic.ReplayGuard``: run again while a symm dispatch overflows its capacity.
    Returns ``run``'s result and the number of replays."""
    guard = ReplayGuard(())
    for _ in guard.attempts():
        result = run()
    return result, guard.replays


def timed_dispatch(dispatcher, x, scores, ids, counts):
    """``(the exception dispatch raised or None, seconds it took)``; on CUDA with the device
    synchronized inside, where a device-side assert surfaces."""
    start = time.monotonic()
    try:
        dispatcher.dispatch(x, scores, ids, counts)
        if x.is_cuda:
            torch.cuda.synchronize()
        raised = None
    except Exception as e:  # noqa: BLE001  (which error, and how fast, is what callers check)
        raised = e
    return raised, time.monotonic() - start


def fails_everywhere(dispatch, error, match: str, rank: int) -> None:
    """``dispatch()`` raises ``error`` matching ``match`` on this rank within ``ERROR_WITHIN_S``,
    and afterwards every rank meets in a barrier (none is still waiting for a peer)."""
    import pytest

    start = time.monotonic()
    with pytest.raises(error, match=match):
        dispatch()
    took = time.monotonic() - start
    assert took < ERROR_WITHIN_S, f"rank {rank} raised only after {took:.1f}s"
    dist.barrier()
