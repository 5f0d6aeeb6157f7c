"""Both transports report the bytes each leg put on the wire (``mxfp8_ep.telemetry.wire_stats``, the
recipe's ``a2a/bytes_per_step``): nccl from its host split lists, symm from device row counts
read at the snapshot. A leg's count is the rows that left the rank times the leg format's row
size; the same routing gives the same counts on both transports, except on symm with top-k > 1
and the scores after the experts: the expert-bound legs (dispatch's forward, combine's
backward) send each token once per rank that owns one of its experts, not once per expert,
and the token-bound legs (combine's forward, dispatch's backward) one partial sum per token and
rank back; combine's backward then also returns the score gradients its experts' rank took (one
fp32 per expert-major row of the drop-free capacity, to every peer). With
``A2AConfig.symm_combine_partial_sums`` off, combine's forward goes row by row (as on nccl) and
combine's backward returns no score gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mxfp8_ep.telemetry import wire_stats
from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher
from tests.moe_harness import preload, run_forked, setup_rank

TOKENS, EXPERTS, TOP_K, DIM = 12, 4, 2, 64


def _routing(rank):
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(TOKENS, DIM, generator=g).bfloat16().requires_grad_()
    scores, ids = torch.randn(TOKENS, EXPERTS, generator=g).sigmoid().topk(TOP_K, dim=-1)
    return x, scores.clone().requires_grad_(), ids


def _leg_bytes(rank, world, preset, transport, combine_partial_sums=True):
    x, scores, ids = _routing(rank)
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    disp = TokenDispatcher.Config(
        num_experts=EXPERTS, top_k=TOP_K, max_tokens_per_rank=TOKENS,
        a2a=A2AConfig.preset(preset, transport=transport, symm_combine_partial_sums=combine_partial_sums),
    ).build(dist.group.WORLD, "cpu")
    wire_stats.reset()
    routed, _, meta = disp.dispatch(x, scores, ids, counts)
    disp.combine(routed * 2, meta).sum().backward()
    owner = ids // (EXPERTS // world)
    remote_tokens = sum(int((owner == peer).any(dim=1).sum()) for peer in range(world) if peer != rank)
    return wire_stats.snapshot(reset=True), int((owner != rank).sum()), remote_tokens, getattr(meta, "capacity", 0)


def _tokens_received(rank, world):
    """Tokens of the other ranks with at least one expert on this rank."""
    owners = [_routing(peer)[2] // (EXPERTS // world) for peer in range(world) if peer != rank]
    return sum(int((owner == rank).any(dim=1).sum()) for owner in owners)


def _same_bytes_on_both_transports(rank, world):
    setup_rank()
    for preset in ("bf16", "mxfp8_all"):
        nccl, remote_rows, remote_tokens, _ = _leg_bytes(rank, world, preset, "nccl")
        symm, _, _, capacity = _leg_bytes(rank, world, preset, "symm")
        a2a = A2AConfig.preset(preset)
        score_grads = (world - 1) * capacity * 4
        for leg, extra in (("dispatch_fwd", 0), ("combine_bwd", score_grads)):  # expert-bound: tokens once per rank
            row = wire_stats.row_bytes(DIM, 2, getattr(a2a, leg))
            assert nccl[leg] == remote_rows * row > 0, (preset, leg, nccl, remote_rows)
            assert symm[leg] == remote_tokens * row + extra, (preset, leg, symm, remote_tokens)
            assert remote_tokens * row < nccl[leg], (preset, leg, remote_tokens)
        for leg in ("combine_fwd", "dispatch_bwd"):  # partial sums back (bf16, or quantized for mxfp8_all)
            partial = _tokens_received(rank, world) * wire_stats.row_bytes(DIM, 2, getattr(a2a, leg))
            assert symm[leg] == partial < nccl[leg], (preset, leg, symm, nccl, partial)
        assert set(nccl) == set(symm) == {"dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd", "total"}
        rows, *_ = _leg_bytes(rank, world, preset, "symm", combine_partial_sums=False)
        assert rows["combine_fwd"] == nccl["combine_fwd"], (preset, rows, nccl)
        assert rows["combine_bwd"] == symm["combine_bwd"] - score_grads, (preset, rows, symm)
        assert rows["dispatch_fwd"] == symm["dispatch_fwd"], (preset, rows)
        assert rows["dispatch_bwd"] == symm["dispatch_bwd"], (preset, rows)


def test_symm_and_nccl_count_the_same_wire_bytes():
    preload(titan=False)
    run_forked(2, _same_bytes_on_both_transports)
