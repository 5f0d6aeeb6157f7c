"""The quantization telemetry (``mxfp8_ep.telemetry.numerics``): its statistics against values worked out
by hand on crafted blocks, that an unarmed probe does no work at all and an armed one no host
sync, the sums over ranks, and that the dispatchers report what each MXFP8 leg quantizes (gloo,
both transports): the weighted rows where a leg sends weighted rows, the partial sums where symm
sends partial sums, worked out here from the ranks' tokens and routing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from mxfp8_ep.config import NUMERICS_STATS
from mxfp8_ep.telemetry.numerics import PROBE, SAMPLE_ROWS, LegStats, NumericsProbe, reduce_over_ranks, sample_rows
from tests.moe_harness import preload, run_forked, setup_rank
from tests.round_trips import MAX_TOKENS, build_dispatcher, rank_transports

TINY = 2.0**-11  # below half the smallest e4m3 subnormal (2**-9) at scale 2**0: flushes to zero


def crafted_rows() -> torch.Tensor:
    """Two rows of two 32-blocks (bf16, every value exact):

    * row 0: ``[448, 1.0625, 2**-11, 0...]`` (scale 2**0 under both roundings: 448 stays 448,
      saturated; 1.0625 is a tie between 1 and 1.125 and rounds to even, 1; 2**-11 flushes),
      then an all-zero block (no scale exponent);
    * row 1: ``[500, 0...]`` (rceil: scale 2**1, 250 -> 256, so 512; floor: scale 2**0, 500
      clamped to 448), then ``[14336 = 448 * 2**5, 3, 0...]`` (scale 2**5 under both: 448,
      saturated, and 3 / 32 = 0.09375, exact).
    """
    x = torch.zeros(2, 64)
    x[0, :3] = torch.tensor([448.0, 1.0625, TINY])
    x[1, 0] = 500.0
    x[1, 32:34] = torch.tensor([14336.0, 3.0])
    return x.bfloat16()


SQ_REF = 448.0**2 + 1.0625**2 + TINY**2 + 500.0**2 + 14336.0**2 + 9.0
EXPECTED = {
    "rceil": dict(sq_err=0.0625**2 + TINY**2 + 12.0**2, saturated=2, exponents=(0, 5)),
    "floor": dict(sq_err=0.0625**2 + TINY**2 + 52.0**2, saturated=3, exponents=(0, 5)),
}


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_stats_of_crafted_blocks(rounding):
    want = EXPECTED[rounding]
    s = LegStats.of_rows(crafted_rows(), rounding).summary()
    assert s["rel_l2_err"] == pytest.approx(math.sqrt(want["sq_err"] / SQ_REF), rel=1e-12)
    assert s["saturated_block_frac"] == want["saturated"] / 4
    assert s["flushed_frac"] == 1 / 6  # of the six nonzero elements, 2**-11
    assert (s["scale_exp_min"], s["scale_exp_max"]) == want["exponents"]


def test_rows_without_data_take_no_part():
    rows = crafted_rows()
    rows[1, 5] = float("nan")  # a row that carries no data may hold anything
    s = LegStats.of_rows(rows, "rceil", valid=torch.tensor([True, False])).summary()
    assert s["rel_l2_err"] == pytest.approx(math.sqrt((0.0625**2 + TINY**2) / (448.0**2 + 1.0625**2 + TINY**2)))
    assert s["saturated_block_frac"] == 1 / 2 and s["flushed_frac"] == 1 / 3
    assert (s["scale_exp_min"], s["scale_exp_max"]) == (0, 0)


def test_nothing_sampled_and_nothing_nonzero():
    assert LegStats.of_rows(torch.zeros(0, 32), "rceil").summary() == dict.fromkeys(NUMERICS_STATS)
    zeros = LegStats.of_rows(torch.zeros(3, 32), "rceil").summary()
    assert zeros == dict(rel_l2_err=0.0, saturated_block_frac=0.0, flushed_frac=0.0,
                         scale_exp_min=None, scale_exp_max=None)


def test_stats_add_up_over_calls():
    rows = crafted_rows()
    both = LegStats.of_rows(rows[:1], "floor")
    both.add(LegStats.of_rows(rows[1:], "floor"))
    assert torch.equal(both.values, LegStats.of_rows(rows, "floor").values)


def test_sample_is_spread_and_bounded():
    assert sample_rows(10, 4, torch.device("cpu")).tolist() == [0, 2, 5, 7]
    assert sample_rows(3, 64, torch.device("cpu")).tolist() == [0, 1, 2]
    assert sample_rows(0, 64, torch.device("cpu")).numel() == 0
    assert sample_rows(1000, SAMPLE_ROWS, torch.device("cpu")).numel() == SAMPLE_ROWS


class _Ops(TorchDispatchMode):
    """Every aten op run inside, and whether any gave a Python value (a host sync on a GPU:
    ``.item()``, ``bool(t)``, ``torch.equal``)."""

    def __init__(self):
        super().__init__()
        self.ops, self.host_values = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func)
        if not isinstance(out, (torch.Tensor, tuple, list)) and out is not None:
            self.host_values.append(func)
        if func in (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default):
            self.host_values.append(func)  # output size read on the host
        return out


def test_unarmed_probe_does_nothing_and_armed_probe_never_syncs():
    probe, rows = NumericsProbe(sample=8), torch.randn(40, 64).bfloat16()
    with _Ops() as unarmed:
        probe.observe("layer", "dispatch_fwd", rows, "rceil")
    assert unarmed.ops == [] and not probe.pending and probe.collect() == {}

    probe.armed = True
    with _Ops() as armed:
        probe.observe("layer", "dispatch_fwd", rows, "rceil")
        probe.observe("layer", "dispatch_fwd", rows, "rceil", valid=torch.arange(40) % 3 > 0)
    assert armed.ops and armed.host_values == []
    (key, stats), = probe.collect().items()
    assert key == ("layer", "dispatch_fwd") and not probe.pending
    index = sample_rows(40, 8, rows.device)
    want = LegStats.of_rows(rows[index], "rceil")
    want.add(LegStats.of_rows(rows[index], "rceil", valid=index % 3 > 0))
    assert torch.equal(stats.values, want.values)


def _reduce(rank, _world):
    """Rank r holds crafted row r: summed over ranks they are both rows; the range widens."""
    setup_rank()
    mine = LegStats.of_rows(crafted_rows()[rank : rank + 1], "floor")
    empty = LegStats.of_rows(torch.zeros(0, 64).bfloat16(), "floor")
    reduced, nothing = reduce_over_ranks([mine, empty])
    assert torch.equal(reduced.values, LegStats.of_rows(crafted_rows(), "floor").values)
    assert nothing.summary() == dict.fromkeys(NUMERICS_STATS)


TOKENS, DIM, EXPERTS_PER_RANK = 12, 64, 2


def _inputs(rank, world, top_k):
    """Rank ``rank``'s tokens, routing and output gradient: the same on every rank that asks, so
    each rank can work out what its peers send it."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, DIM, generator=g).bfloat16()
    scores, ids = torch.randn(TOKENS, EXPERTS_PER_RANK * world, generator=g).softmax(-1).topk(top_k, dim=-1)
    grad_out = torch.randn(TOKENS, DIM, generator=g).bfloat16()
    return x, scores, ids, grad_out


def _round_trip(disp, rank, world, top_k, armed=True):
    """dispatch -> experts (times 3) -> combine -> backward, the probe armed throughout; what it
    collected, the expert outputs and the expert inputs' gradient."""
    x, scores, ids, grad_out = _inputs(rank, world, top_k)
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS_PER_RANK * world)
    PROBE.armed = armed
    try:
        routed, _, meta = disp.dispatch(x.clone().requires_grad_(), scores.clone().requires_grad_(), ids, counts)
        grads = {}
        routed.register_hook(lambda grad: grads.setdefault("routed", grad))
        expert_out = routed * 3
        disp.combine(expert_out, meta).backward(grad_out)
    finally:
        PROBE.armed = False
    return PROBE.collect(), expert_out.detach(), grads["routed"], meta


def _stats(rows, valid):
    index = sample_rows(rows.shape[0], SAMPLE_ROWS, rows.device)
    return LegStats.of_rows(rows[index], "floor", None if valid is None else valid[index]).values


def _sorted(ids):
    """Each expert-sorted row's slot (token * K + k), and whether its expert is another rank's."""
    return torch.argsort(ids.reshape(-1), stable=True)


def _expert_bound_legs(rank, world):
    """dispatch's forward and combine's backward report what they quantize: symm at top-k > 1
    each token a peer needs, once and unweighted (the owner applies the score after decoding);
    the fused nccl transport each row that leaves, combine's backward times its router score;
    symm at top-1 with the scores before the experts (Llama4) each leaving row times its score.
    bf16 legs and an unarmed probe report nothing."""
    from mxfp8_ep.config import A2AConfig
    from mxfp8_ep.dispatcher import TokenDispatcher
    from tests.distributed import rank_device

    setup_rank()
    for transport in rank_transports():
        for top_k, scores_first in ((2, False), (1, True)):
            config = TokenDispatcher.Config(
                num_experts=EXPERTS_PER_RANK * world, top_k=top_k, score_before_experts=scores_first,
                max_tokens_per_rank=MAX_TOKENS, check_inputs=True,
                a2a=A2AConfig.preset("mxfp8", transport=transport, scale_rounding="floor"))
            disp = config.build(dist.group.WORLD, rank_device())
            assert _round_trip(disp, rank, world, top_k, armed=False)[0] == {}
            collected = _round_trip(disp, rank, world, top_k)[0]
            where = (transport, top_k)
            assert set(collected) == {(disp, "dispatch_fwd"), (disp, "combine_bwd")}, where
            x, scores, ids, grad_out = _inputs(rank, world, top_k)
            leaves = ids // EXPERTS_PER_RANK != rank  # (T, K)
            slot = _sorted(ids)
            tokens, weights, crossing = slot // top_k, scores.reshape(-1)[slot], leaves.reshape(-1)[slot]

            def weighted(rows):
                return (rows[tokens].float() * weights.unsqueeze(1)).bfloat16()

            if transport == "symm" and top_k > 1:
                want = {"dispatch_fwd": (x, leaves.any(dim=1)), "combine_bwd": (grad_out, leaves.any(dim=1))}
            elif scores_first:
                want = {"dispatch_fwd": (weighted(x), crossing), "combine_bwd": (grad_out[tokens], crossing)}
            else:
                want = {"dispatch_fwd": (x[tokens], crossing), "combine_bwd": (weighted(grad_out), crossing)}
            for leg, (rows, valid) in want.items():
                assert torch.equal(collected[disp, leg].values, _stats(rows, valid)), (*where, leg)
            # not the rows before the weighting, where the leg weighs them
            if transport == "nccl" and top_k > 1:
                assert not torch.equal(collected[disp, "combine_bwd"].values,
                                       _stats(grad_out[tokens], crossing)), where


def _token_bound_legs(rank, world):
    """combine's forward and dispatch's backward report what they quantize: on symm (top-k > 1,
    scores after the experts) the partial sums it sends, one per token of the peer and this
    rank, combine's forward weighted by the router scores, worked out here from the peer's
    tokens, scores and gradient; on the fused nccl transport the expert-major rows that go back
    to another rank, as they are."""

    setup_rank()
    assert world == 2
    top_k, peer = 2, 1 - rank
    # Only the token-bound legs in MXFP8: the rows they are made of are exact.
    legs = {"combine_fwd": "mxfp8", "dispatch_bwd": "mxfp8"}
    for transport in rank_transports():
        disp = build_dispatcher(transport, "bf16", top_k=top_k, scale_rounding="floor", **legs)
        collected, expert_out, grad_routed, meta = _round_trip(disp, rank, world, top_k)
        assert set(collected) == {(disp, "combine_fwd"), (disp, "dispatch_bwd")}, transport
        if transport == "nccl":
            back = (meta.row_source >= 0) & (meta.row_source != rank)
            want = {"combine_fwd": (expert_out, back), "dispatch_bwd": (grad_routed, back)}
        else:
            x, scores, ids, grad_out = _inputs(peer, world, top_k)
            here = ids // EXPERTS_PER_RANK == rank  # (T, K): the peer's rows on this rank
            out_rows = (x.float() * 3).bfloat16().float()  # an expert output row of token t: 3 x_t
            grad_rows = ((grad_out.float().unsqueeze(1) * scores.unsqueeze(2)).bfloat16().float()
                         * 3).bfloat16().float()
            partial = {
                "combine_fwd": (out_rows.unsqueeze(1) * scores.unsqueeze(2) * here.unsqueeze(2)).sum(dim=1),
                "dispatch_bwd": (grad_rows * here.unsqueeze(2)).sum(dim=1),
            }
            want = {}
            for leg, sums in partial.items():
                rows = torch.zeros(MAX_TOKENS, DIM, dtype=torch.bfloat16)  # the peer's token slots
                rows[:TOKENS] = sums.bfloat16()
                valid = torch.zeros(MAX_TOKENS, dtype=torch.bool)
                valid[:TOKENS] = here.any(dim=1)
                want[leg] = (rows, valid)
            # not the expert-major rows the sums are made of
            unweighted = _stats(expert_out, meta.row_source >= 0)
            assert not torch.equal(collected[disp, "combine_fwd"].values, unweighted)
        for leg, (rows, valid) in want.items():
            assert torch.equal(collected[disp, leg].values, _stats(rows, valid)), (transport, leg)


def test_over_ranks_and_from_the_dispatchers():
    preload(titan=False)
    run_forked(2, _reduce)
    run_forked(2, _expert_bound_legs)
    run_forked(2, _token_bound_legs)
