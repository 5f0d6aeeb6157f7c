"""Both transports report the bytes each leg put on the wire (``mxfp8_ep.wire_stats``, the
recipe's ``a2a/bytes_per_step``): the same routing gives the same counts on nccl (host split
lists) and symm (device row counts, read at the snapshot), and the count is the rows that
left the rank times the leg format's row size."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mxfp8_ep import wire_stats
from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher
from tests.moe_harness import preload, run_forked, setup_rank

TOKENS, EXPERTS, TOP_K, DIM = 12, 4, 2, 64


def _leg_bytes(rank, world, preset, transport):
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(TOKENS, DIM, generator=g).bfloat16().requires_grad_()
    scores, ids = torch.randn(TOKENS, EXPERTS, generator=g).sigmoid().topk(TOP_K, dim=-1)
    scores = scores.clone().requires_grad_()
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    disp = TokenDispatcher.Config(
        num_experts=EXPERTS, top_k=TOP_K, max_tokens_per_rank=TOKENS,
        a2a=A2AConfig.preset(preset, transport=transport),
    ).build(dist.group.WORLD, "cpu")
    wire_stats.reset()
    routed, _, meta = disp.dispatch(x, scores, ids, counts)
    disp.combine(routed * 2, meta).sum().backward()
    return wire_stats.snapshot(reset=True), int((ids // (EXPERTS // world) != rank).sum())


def _same_bytes_on_both_transports(rank, world):
    setup_rank()
    for preset in ("bf16", "mxfp8_all"):
        nccl, remote_rows = _leg_bytes(rank, world, preset, "nccl")
        symm, _ = _leg_bytes(rank, world, preset, "symm")
        assert symm == nccl, (preset, symm, nccl)
        row = wire_stats.row_bytes(DIM, 2, A2AConfig.preset(preset).dispatch_fwd)
        assert nccl["dispatch_fwd"] == remote_rows * row > 0, (preset, nccl, remote_rows)
        assert set(nccl) == {"dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd", "total"}


def test_symm_and_nccl_count_the_same_wire_bytes():
    preload(titan=False)
    run_forked(2, _same_bytes_on_both_transports)
