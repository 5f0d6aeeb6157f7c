"""Bad input to the dispatcher, on gloo process groups of 2 ranks, both transports: a model
dim that is not a multiple of 32 on an MXFP8 leg (on one rank or all) fails on every rank, the
peers naming the rank, and the group stays in step; an EP degree that does not divide the
experts fails at build; NaN and inf travel as the MXFP8 format says; an explicit symm transport
across hosts is a clear error. (tests/test_dispatcher_hardening.py: the other bad inputs.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep.config import PRESETS, SCALE_ROUNDINGS, A2AConfig
from mxfp8_ep.dispatcher import NcclTokenDispatcher
from tests.moe_harness import preload, rel_err, run_forked, setup_rank
from tests.round_trips import TRANSPORTS, build_dispatcher, round_trip, to_next_rank


def _bad_input(rank, world):
    setup_rank()
    quantized = [name for name in sorted(PRESETS) if A2AConfig.preset(name).any_quantized]
    assert quantized
    for transport in TRANSPORTS:
        # A model dim that is not a multiple of 32 with any MXFP8 leg: ValueError, before any
        # row moves, on every rank. First each rank alone (its peers dispatch a valid batch
        # and raise an error naming it: the bad rank takes part in the count exchange with
        # its fault set instead of leaving them waiting there), then all ranks together; at
        # the dispatcher's first dispatch (its agreement with the group carries the error)
        # and after a valid one (the count exchange carries it).
        for preset in quantized:
            for first in (True, False):
                dispatcher = build_dispatcher(transport, preset)
                if not first:
                    round_trip(dispatcher, *to_next_rank(rank, world, 5, 64))
                for alone in (*range(world), None):
                    bad = alone in (rank, None)
                    x, scores, ids, counts = to_next_rank(rank, world, 5, 40 if bad else 64)
                    match = r"multiple of 32.*dim 40" if bad else rf"rank {alone}\b.*(multiple of 32|whole blocks)"
                    with pytest.raises(ValueError, match=match):
                        dispatcher.dispatch(x, scores, ids, counts)
                    dist.barrier()
            # The group is still in step: the same dispatcher then carries a valid batch there
            # and back (through MXFP8: close, not equal).
            x, scores, ids, counts = to_next_rank(rank, world, 5, 64)
            _, out, _, _ = round_trip(dispatcher, x, scores, ids, counts)
            assert 0 < rel_err(out, x) < 2.0**-4, f"{transport} {preset}: tokens did not come back"
        # bf16 legs take any width.
        x, scores, ids, counts = to_next_rank(rank, world, 5, 40)
        _, out, _, _ = round_trip(build_dispatcher(transport, "bf16"), x, scores, ids, counts)
        assert torch.equal(out, x), transport
        # EP that does not divide the experts: ValueError at build, on every rank.
        with pytest.raises(ValueError,
                           match=rf"expert parallelism {world} must divide the number of experts {2 * world + 1}"):
            build_dispatcher(transport, num_experts=2 * world + 1)


def _non_finite(rank, world):
    """Token 0 has a NaN (column 5), token 1 a +inf (column 40), tokens 2-3 are finite; every
    row goes to another rank. What mxfp8_ep/format/mxfp8.py says an MXFP8 leg does: a NaN makes its
    whole 32-block NaN; an inf comes back inf and flushes the finite elements of its block to
    zero (scale 2**127); other blocks and tokens stay finite. bf16 legs carry them as they are."""
    from mxfp8_ep.format.mxfp8 import BLOCK_SIZE

    setup_rank()
    dim = 2 * BLOCK_SIZE
    for transport in TRANSPORTS:
        for preset in sorted(PRESETS):
            for rounding in SCALE_ROUNDINGS:
                a2a = A2AConfig.preset(preset, scale_rounding=rounding)
                x, scores, ids, counts = to_next_rank(rank, world, 4, dim)
                x[0, 5], x[1, 40] = float("nan"), float("inf")
                sent = to_next_rank((rank - 1) % world, world, 4, dim)[0]  # the rows we host
                sent[0, 5], sent[1, 40] = float("nan"), float("inf")
                routed, out, x_grad, score_grad = round_trip(
                    build_dispatcher(transport, preset, scale_rounding=rounding), x, scores, ids, counts)
                where = f"{transport} {preset} {rounding} rank {rank}"
                legs = [getattr(a2a, leg) == "mxfp8" for leg in ("dispatch_fwd", "combine_fwd")]
                # This rank's first expert got the previous rank's 4 tokens, in order; padding
                # rows follow.
                assert (routed[4:] == 0).all(), where
                routed = routed[:4]
                for value, quantized_legs in ((routed, legs[:1]), (out, legs)):
                    source = sent if value is routed else x
                    nan_mask = torch.zeros_like(source, dtype=torch.bool)
                    nan_mask[0, :BLOCK_SIZE] = True if any(quantized_legs) else False
                    nan_mask[0, 5] = True
                    assert torch.equal(value.isnan(), nan_mask), f"NaN pattern: {where}"
                    assert value[1, 40] == float("inf") and torch.isfinite(value[1, :BLOCK_SIZE]).all(), where
                    if any(quantized_legs):
                        assert (value[1, BLOCK_SIZE:].nan_to_num(posinf=0) == 0).all(), f"inf block: {where}"
                    else:
                        assert torch.equal(value[1:], source[1:]), where
                    assert torch.isfinite(value[2:]).all(), where
                assert torch.isfinite(x_grad).all(), f"x grad: {where}"
                assert torch.isfinite(score_grad[2:]).all() and not torch.isfinite(score_grad[:2]).any(), where


def test_bad_input_fails_on_every_rank():
    """dim % 32 != 0 with an MXFP8 leg: ValueError on each rank alone (its peers name it) and
    on all ranks, and the group stays usable; EP not dividing the experts: ValueError at build."""
    preload()
    run_forked(2, _bad_input)


def test_nan_and_inf_tokens_follow_the_mxfp8_format():
    preload()
    run_forked(2, _non_finite)


def _hosts(rank, world):
    from unittest import mock

    from mxfp8_ep.dispatcher import resolve_transport

    setup_rank()
    group, cpu, cuda = dist.group.WORLD, torch.device("cpu"), torch.device("cuda")  # only the type is read
    with mock.patch("socket.gethostname", return_value=f"node{rank}"):
        with pytest.raises(ValueError, match=rf"transport=symm needs every EP rank on one node.*spans {world} hosts"):
            resolve_transport("symm", cpu, group)
        with pytest.raises(ValueError, match=rf"spans {world} hosts.*use transport=two_hop"):
            build_dispatcher("symm")
        assert resolve_transport("auto", cuda, group) == "nccl"  # multi-node: all-to-all
        assert type(build_dispatcher("nccl")) is NcclTokenDispatcher
    with mock.patch("socket.gethostname", return_value="node"):
        assert resolve_transport("auto", cuda, group) == "symm"
        assert resolve_transport("symm", cpu, group) == "symm"
        assert resolve_transport("auto", cpu, group) == "nccl"  # no CUDA: all-to-all


def test_symm_across_hosts_is_a_clear_error():
    """Each rank reports another host name: an explicit symm transport raises on every rank
    (peer memory does not span nodes); auto picks nccl there, symm on one CUDA node."""
    preload()
    run_forked(2, _hosts)
