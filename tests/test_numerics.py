"""The quantization telemetry (``mxfp8_ep.numerics``): its statistics against values worked out
by hand on crafted blocks, that an unarmed probe does no work at all and an armed one no host
sync, the sums over ranks, and the dispatchers' one report per MXFP8 leg (gloo, both
transports)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mxfp8_ep.config import NUMERICS_STATS
from mxfp8_ep.numerics import PROBE, SAMPLE_ROWS, LegStats, NumericsProbe, reduce_over_ranks, sample_rows
from tests.moe_harness import preload, run_forked, setup_rank
from tests.round_trips import build_dispatcher, rank_transports

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


def _dispatcher_reports(rank, world):
    """Each MXFP8 leg of a round trip reports its rows once, keyed by the dispatcher: tokens on
    the expert-bound legs, the expert-major rows with data on the token-bound ones; bf16 legs
    and an unarmed probe report nothing."""
    setup_rank()
    g = torch.Generator().manual_seed(rank)
    tokens, dim, top_k = 12, 64, 2
    x = torch.randn(tokens, dim, generator=g).bfloat16()
    scores, ids = torch.randn(tokens, 2 * world, generator=g).softmax(-1).topk(top_k, dim=-1)
    counts = torch.bincount(ids.reshape(-1), minlength=2 * world)
    for transport in rank_transports():
        for preset, legs in (("mxfp8", {"dispatch_fwd", "combine_bwd"}), ("mxfp8_all", None)):
            disp = build_dispatcher(transport, preset, top_k=top_k, scale_rounding="floor")
            for armed in (False, True):
                PROBE.armed = armed
                xg, sg = x.clone().requires_grad_(), scores.clone().requires_grad_()
                routed, _, meta = disp.dispatch(xg, sg, ids, counts)
                expert_out = routed * 3
                out = disp.combine(expert_out, meta)
                grad_out = torch.randn(out.shape, generator=g).bfloat16()
                out.backward(grad_out)
                PROBE.armed = False
                collected = PROBE.collect()
                if not armed:
                    assert collected == {}
                    continue
                assert {leg for _, leg in collected} == (legs or {"dispatch_fwd", "dispatch_bwd", "combine_fwd",
                                                                  "combine_bwd"})
                assert all(reporter is disp for reporter, _ in collected)
                want = {"dispatch_fwd": (x, None), "combine_bwd": (grad_out, None)}
                for leg, (rows, valid) in want.items():
                    index = sample_rows(rows.shape[0], SAMPLE_ROWS, rows.device)
                    expect = LegStats.of_rows(rows[index], "floor")
                    assert torch.equal(collected[disp, leg].values, expect.values), (transport, preset, leg)
                if legs is None:
                    index = sample_rows(expert_out.shape[0], SAMPLE_ROWS, x.device)
                    valid = meta.row_source[index] >= 0
                    expect = LegStats.of_rows(expert_out.detach()[index], "floor", valid)
                    assert torch.equal(collected[disp, "combine_fwd"].values, expect.values), transport
                    assert all(math.isfinite(v) for v in collected[disp, "dispatch_bwd"].values[:6].tolist())


def test_over_ranks_and_from_the_dispatchers():
    preload(titan=False)
    run_forked(2, _reduce)
    run_forked(2, _dispatcher_reports)
