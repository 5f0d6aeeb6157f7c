"""``A2AConfig.quantize_local_rows``: on every MXFP8 leg, a row that stays on its rank is what
the receiving pass would have decoded had it crossed, on gloo at EP=1 (transport nccl over a
one-rank group, what the recipe runs on one GPU) and EP=2 (both transports); with the option
off, rows that stay are exact as before.

Each leg is checked against the all-bf16 dispatcher of the same routing (same expert-major
layout, no row quantized): with every leg MXFP8 and the option on,

* dispatch's forward: each expert row is the reference's quantize -> dequantize of the bf16 row;
* combine's backward: likewise, or, where symm sends each token once and applies the router
  score after decoding (``SymmTokenDispatcher.Config.scores_after_dequantize``), the bf16 leg of the decoded
  output gradient;
* the token-bound legs (combine's forward, dispatch's backward): the bf16 legs of the decoded
  expert rows, bit for bit, where each row travels by itself (symm sends a token's rows on a
  rank as one partial sum at top-k > 1: quantized once per sum, checked by the dispatcher fuzz).

The same dispatch and combine without autograd (a validation pass) give the same rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher
from tests.moe_harness import mxfp8_round_trip, preload, run_forked, setup_rank
from tests.round_trips import MAX_TOKENS, rank_transports

TOKENS, DIM = 12, 64


def build(transport, preset, top_k, score_before, rounding, quantize_local_rows=False):
    config = TokenDispatcher.Config(
        num_experts=2 * dist.get_world_size(), top_k=top_k, max_tokens_per_rank=MAX_TOKENS,
        score_before_experts=score_before,
        a2a=A2AConfig.preset(preset, transport=transport, scale_rounding=rounding,
                             quantize_local_rows=quantize_local_rows),
    )
    return config.build(dist.group.WORLD, "cpu")


def legs(disp, x, scores, ids, grad_routed, expert_out, grad_out):
    """Each leg on its own: dispatch (forward, then its backward of ``grad_routed``) and
    combine of ``expert_out`` (forward, then its backward of ``grad_out``)."""
    xg, sg = x.clone().requires_grad_(), scores.clone().requires_grad_()
    counts = torch.bincount(ids.reshape(-1), minlength=disp.config.num_experts)
    routed, _, meta = disp.dispatch(xg, sg, ids, counts)
    routed.backward(grad_routed)
    eg = expert_out.clone().requires_grad_()
    out = disp.combine(eg, meta)
    out.backward(grad_out)
    return dict(routed=routed.detach(), x_grad=xg.grad, out=out.detach(), expert_grad=eg.grad, meta=meta)


def _check(rank, world):
    setup_rank()
    g = torch.Generator().manual_seed(10 + rank)
    transports = rank_transports() if world > 1 else ("nccl",)
    cases = [(1, True, "rceil"), (1, False, "floor"), (2, False, "rceil")]
    for transport in transports:
        for top_k, score_before, rounding in cases:
            x = (4 * torch.randn(TOKENS, DIM, generator=g)).bfloat16()
            x[0, :32] = 0  # an all-zero block
            scores, ids = torch.randn(TOKENS, 2 * world, generator=g).softmax(-1).topk(top_k, dim=-1)
            bf16 = build(transport, "bf16", top_k, score_before, rounding)
            shape = bf16.dispatch(x, scores, ids, torch.bincount(ids.reshape(-1), minlength=2 * world))[0].shape
            grad_routed, expert_out = (torch.randn(shape, generator=g).bfloat16() for _ in range(2))
            grad_out = torch.randn(TOKENS, DIM, generator=g).bfloat16()
            exact = legs(bf16, x, scores, ids, grad_routed, expert_out, grad_out)
            decoded = legs(bf16, x, scores, ids, mxfp8_round_trip(grad_routed, rounding),
                           mxfp8_round_trip(expert_out, rounding), mxfp8_round_trip(grad_out, rounding))
            on_dispatcher = build(transport, "mxfp8_all", top_k, score_before, rounding, quantize_local_rows=True)
            on = legs(on_dispatcher, x, scores, ids, grad_routed, expert_out, grad_out)
            off = legs(build(transport, "mxfp8_all", top_k, score_before, rounding),
                       x, scores, ids, grad_routed, expert_out, grad_out)
            case = (transport, top_k, score_before, rounding)
            source = on["meta"].row_source
            valid, local = source >= 0, source == rank
            assert local.any(), case  # the check is about rows that stay
            quantized = mxfp8_round_trip(exact["routed"], rounding)
            assert torch.equal(on["routed"][valid].view(torch.int16), quantized[valid].view(torch.int16)), case
            config = build(transport, "mxfp8_all", top_k, score_before, rounding).config
            after_decode = transport == "symm" and config.scores_after_dequantize
            if after_decode and not score_before:
                want = decoded["expert_grad"]  # score * dequant(quant(output gradient))
            else:
                want = mxfp8_round_trip(exact["expert_grad"], rounding)
            assert torch.equal(on["expert_grad"][valid].view(torch.int16), want[valid].view(torch.int16)), case
            if not (transport == "symm" and config.dispatch_bwd_partial_sums):
                assert torch.equal(on["out"].view(torch.int16), decoded["out"].view(torch.int16)), case
                assert torch.equal(on["x_grad"].view(torch.int16), decoded["x_grad"].view(torch.int16)), case
            # Off: the rows that stay are exact, those that cross quantized.
            kept, crossed = valid & local, valid & ~local
            assert torch.equal(off["routed"][kept].view(torch.int16), exact["routed"][kept].view(torch.int16)), case
            assert torch.equal(off["routed"][crossed].view(torch.int16), quantized[crossed].view(torch.int16)), case
            if world == 1:
                assert not torch.equal(on["routed"], off["routed"]), case  # the option changed something
            with torch.no_grad():  # as a validation pass runs the model
                counts = torch.bincount(ids.reshape(-1), minlength=2 * world)
                routed, _, meta = on_dispatcher.dispatch(x, scores, ids, counts)
                out = on_dispatcher.combine(expert_out, meta)
            assert torch.equal(routed[valid].view(torch.int16), on["routed"][valid].view(torch.int16)), case
            assert torch.equal(out.view(torch.int16), on["out"].view(torch.int16)), case


@pytest.mark.parametrize("world", [1, 2])
def test_rows_that_stay_are_quantized_like_rows_that_cross(world):
    preload(titan=False)
    run_forked(world, _check)


def _own_group(rank, world):
    from mxfp8_ep.titan022 import one_rank_group

    group = one_rank_group()
    assert dist.get_world_size(group) == 1 and dist.get_rank(group) == 0
    assert one_rank_group() is group  # made once
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=group)  # this rank alone
    assert t.item() == rank + 1.0
    assert (world == 1) == (group is dist.group.WORLD)
    # Rank 0 serves the store that the subgroups' rendezvous reads: it stays until every rank
    # has its group (a rank still connecting when it leaves is reset).
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2])
def test_each_rank_gets_a_group_of_its_own_without_ep(world):
    preload(titan=False)
    run_forked(world, _own_group)
