"""The two_hop tests' layer (tests/test_two_hop*.py): linear experts behind a dispatcher of
``LOCAL_EXPERTS`` experts per rank, its inputs, its run forward and backward, and a float64
oracle of it on one rank's tokens."""

from __future__ import annotations

import torch

import torch.distributed as dist

from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher
from tests.distributed import rank_device

DIM = 64
TOKENS = 12  # per rank
LOCAL_EXPERTS = 2


def layer_config(world, top_k, preset, transport, score_before=False, **a2a):
    return TokenDispatcher.Config(
        num_experts=LOCAL_EXPERTS * world, top_k=top_k, max_tokens_per_rank=TOKENS, score_before_experts=score_before,
        a2a=A2AConfig.preset(preset, transport=transport, **a2a),
    )


def layer_inputs(rank, world, top_k, seed, tokens=TOKENS, to_node=None, ranks_per_node=2):
    """This rank's ``tokens`` tokens, distinct expert picks (uniform, or all on node ``to_node``
    of ``ranks_per_node`` ranks), softmax scores, every expert's weights and the output's
    gradient, on the rank's device (``tests.distributed.rank_device``)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    E = LOCAL_EXPERTS * world
    on_node = LOCAL_EXPERTS * ranks_per_node
    x = torch.randn(tokens, DIM, generator=g)
    first, choices = (0, E) if to_node is None else (to_node * on_node, on_node)
    ids = torch.zeros((tokens, top_k), dtype=torch.int64)
    for t in range(tokens):
        ids[t] = first + torch.randperm(choices, generator=g)[:top_k]
    scores = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=1)
    weights = torch.randn(E, DIM, generator=torch.Generator().manual_seed(seed))
    grad_out = torch.randn(tokens, DIM, generator=g)
    device = rank_device()
    return tuple(t.to(device) for t in (x, scores, ids, weights, grad_out))


def linear_experts(routed, per_expert, weights):
    """Expert ``e`` of this rank multiplies each row of its segment of the expert-major rows
    by ``weights[e]``, element by element (a diagonal linear map); rows past the segments give
    zeros. The segment is copied out first: the gradient's sum over its rows then reads memory
    laid out alike whatever buffer the dispatcher handed out (a vectorized sum's order follows
    the data's alignment), so equal rows give equal bits."""
    outs, start = [], 0
    for e, n in enumerate(per_expert.tolist()):
        outs.append(routed[start : start + n].clone() * weights[e])
        start += n
    outs.append(torch.zeros_like(routed[start:]))
    return torch.cat(outs)


def run_layer(dispatcher, x, scores, ids, weights, rank, grad_out):
    """Forward and backward of the layer through ``dispatcher``: output, grads of x, scores and
    this rank's expert weights."""
    x = x.clone().requires_grad_(True)
    scores = scores.clone().requires_grad_(True)
    local = weights[rank * LOCAL_EXPERTS : (rank + 1) * LOCAL_EXPERTS].clone().requires_grad_(True)
    counts = torch.bincount(ids.reshape(-1), minlength=weights.shape[0])
    routed, per_expert, meta = dispatcher.dispatch(x, scores, ids, counts)
    out = dispatcher.combine(linear_experts(routed, per_expert, local), meta)
    out.backward(grad_out)
    return out.detach(), x.grad, scores.grad, local.grad


def layer_oracle(x, scores, ids, weights, grad_out):
    """The layer in float64 on this rank's tokens: output, grads of x and scores, and the grads
    of every expert's weights from this rank's tokens. (Linear experts: the router score scales a
    row before or after its expert alike.)"""
    x, scores, weights = (t.double().requires_grad_(True) for t in (x, scores, weights))
    rows = x.unsqueeze(1) * weights[ids]
    out = (rows * scores.unsqueeze(2)).sum(dim=1)
    out.backward(grad_out.double())
    return out.detach(), x.grad, scores.grad, weights.grad


def expert_grad_oracle(oracle, rank):
    """``layer_oracle``'s expert gradients from every rank's tokens, summed over the group: this
    rank's experts' share."""
    grads = oracle[3].float()
    dist.all_reduce(grads)
    return grads[rank * LOCAL_EXPERTS : (rank + 1) * LOCAL_EXPERTS]
