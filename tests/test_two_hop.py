"""The two_hop transport (``mxfp8_ep.dispatcher.two_hop``) on CPU worlds of 2 nodes x 2 ranks
and 3 nodes x 2 ranks (gloo for the node hop, the symm transport's torch twins over shared
memory inside a node; ``A2AConfig.ranks_per_node`` makes the nodes on one host).

A layer of linear experts (expert ``e`` multiplies its rows by its own matrix) runs through the
two_hop dispatcher and through the flat nccl transport on the same inputs, and a float64 oracle
computes it on each rank from that rank's tokens alone (every expert's matrix is known
everywhere). With fp32 tokens and bf16 legs every output and gradient (x, the router scores,
the experts' matrices) equals the flat path's within fp32 reduction order (``ORDER_TOL``) and
the oracle's; with MXFP8 legs it is within MXFP8's rounding of the oracle (``MXFP8_TOL``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher
from mxfp8_ep.telemetry import wire_stats
from tests.distributed import run_on_ranks

DIM = 64
TOKENS = 12  # per rank
LOCAL_EXPERTS = 2
ORDER_TOL = 1e-5  # relative: fp32 sums in another order
# relative Frobenius error of MXFP8 legs against the oracle: e4m3 rounds each element to 2^-4 of
# its binade; a value crosses up to three quantizations (dispatch, the fan-out's partial sum and
# the node hop's, on the way back)
MXFP8_TOL = 3 * 2.0**-4


def _config(world, top_k, preset, transport, score_before, **a2a):
    return TokenDispatcher.Config(
        num_experts=LOCAL_EXPERTS * world, top_k=top_k, max_tokens_per_rank=TOKENS, score_before_experts=score_before,
        a2a=A2AConfig.preset(preset, transport=transport, **a2a),
    )


def _inputs(rank, world, top_k, seed):
    """This rank's tokens, distinct expert picks, softmax scores, and every expert's matrix."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    E = LOCAL_EXPERTS * world
    x = torch.randn(TOKENS, DIM, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(TOKENS)])
    scores = torch.softmax(torch.randn(TOKENS, top_k, generator=g), dim=1)
    weights = torch.randn(E, DIM, DIM, generator=torch.Generator().manual_seed(seed)) / DIM**0.5
    return x, scores, ids, weights


def _experts(routed, per_expert, weights):
    """Expert ``e`` of this rank multiplies its segment of the expert-major rows by
    ``weights[e]``; rows past the segments give zeros."""
    outs, start = [], 0
    for e, n in enumerate(per_expert.tolist()):
        outs.append(routed[start : start + n] @ weights[e])
        start += n
    outs.append(torch.zeros_like(routed[start:]))
    return torch.cat(outs)


def _layer(dispatcher, x, scores, ids, weights, rank, grad_out):
    """Forward and backward of the layer through ``dispatcher``: output, grads of x, scores and
    this rank's expert matrices."""
    x = x.clone().requires_grad_(True)
    scores = scores.clone().requires_grad_(True)
    local = weights[rank * LOCAL_EXPERTS : (rank + 1) * LOCAL_EXPERTS].clone().requires_grad_(True)
    counts = torch.bincount(ids.reshape(-1), minlength=weights.shape[0])
    routed, per_expert, meta = dispatcher.dispatch(x, scores, ids, counts)
    out = dispatcher.combine(_experts(routed, per_expert, local), meta)
    out.backward(grad_out)
    return out.detach(), x.grad, scores.grad, local.grad


def _oracle(x, scores, ids, weights, score_before, grad_out):
    """The layer in float64 on this rank's tokens: output, grads of x and scores, and the grads
    of every expert matrix from this rank's tokens."""
    x, scores, weights = (t.double().requires_grad_(True) for t in (x, scores, weights))
    rows = torch.einsum("td,tkde->tke", x, weights[ids]) if not score_before else None
    if score_before:
        rows = torch.einsum("td,tkde->tke", x, weights[ids]) * scores.unsqueeze(2)
        out = rows.sum(dim=1)
    else:
        out = (rows * scores.unsqueeze(2)).sum(dim=1)
    out.backward(grad_out.double())
    return out.detach(), x.grad, scores.grad, weights.grad


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _compare(rank, world, ranks_per_node, top_k, preset, score_before, seed):
    x, scores, ids, weights = _inputs(rank, world, top_k, seed)
    grad_out = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(seed + 7 * rank))
    group = dist.group.WORLD
    two_hop = _config(world, top_k, preset, "two_hop", score_before, ranks_per_node=ranks_per_node).build(group, "cpu")
    flat = _config(world, top_k, preset, "nccl", score_before).build(group, "cpu")
    wire_stats.reset()
    got = _layer(two_hop, x, scores, ids, weights, rank, grad_out)
    bytes_two_hop = wire_stats.snapshot(reset=True)
    want = _layer(flat, x, scores, ids, weights, rank, grad_out)
    oracle = _oracle(x, scores, ids, weights, score_before, grad_out)
    # the expert matrices' oracle gradient: every rank's tokens' share, summed
    expert_grad = oracle[3].float()
    dist.all_reduce(expert_grad)
    oracle = (*oracle[:3], expert_grad[rank * LOCAL_EXPERTS : (rank + 1) * LOCAL_EXPERTS])
    names = ("output", "x grad", "score grad", "expert grad")
    for name, g, w, o in zip(names, got, want, oracle, strict=True):
        if preset == "bf16":
            assert _rel(g, w) <= ORDER_TOL, (name, _rel(g, w))
            assert _rel(g, o) <= ORDER_TOL, (name, _rel(g, o))
        else:
            assert _rel(g, o) <= MXFP8_TOL, (name, _rel(g, o))
            assert _rel(w, o) > 0  # the legs did quantize
    assert bytes_two_hop.get(wire_stats.inter_node_key("dispatch_fwd"), 0) > 0


CASES = (  # top-k, preset, scores before the experts, seed
    (3, "bf16", False, 1), (1, "bf16", True, 2), (4, "mxfp8_all", False, 3), (1, "mxfp8", True, 4),
    (2, "mxfp8", False, 5),
)


def _cases(rank, world):
    for top_k, preset, score_before, seed in CASES:
        _compare(rank, world, 2, top_k, preset, score_before, seed)


@pytest.mark.parametrize("nodes", [2, 3])
def test_two_hop_equals_flat_nccl_and_the_fp64_oracle(nodes):
    run_on_ranks(2 * nodes, _cases, timeout_s=60)
