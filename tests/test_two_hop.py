"""The two_hop transport (``mxfp8_ep.dispatcher.two_hop``) on CPU worlds of 2 nodes x 2 ranks
and 3 nodes x 2 ranks (gloo for the node hop, the symm transport's torch twins over shared
memory inside a node; ``A2AConfig.ranks_per_node`` makes the nodes on one host).

A layer of linear experts (expert ``e`` scales its rows by its own weights, element by element) runs through the
two_hop dispatcher and through the flat nccl transport on the same inputs, and a float64 oracle
computes it on each rank from that rank's tokens alone (every expert's weights are known
everywhere). With fp32 tokens and bf16 legs every output and gradient (x, the router scores,
the experts' weights) equals the flat path's within fp32 reduction order (``ORDER_TOL``) and
the oracle's; with MXFP8 legs it is within MXFP8's rounding of the oracle (``MXFP8_TOL``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from mxfp8_ep.telemetry import wire_stats
from tests.moe_harness import preload, run_forked, setup_rank
from tests.two_hop_layer import expert_grad_oracle, layer_config, layer_inputs, layer_oracle, run_layer

ORDER_TOL = 1e-5  # relative: fp32 sums in another order
# relative Frobenius error of MXFP8 legs against the oracle: e4m3 rounds each element to 2^-4 of
# its binade; a value crosses up to three quantizations (dispatch, the fan-out's partial sum and
# the node hop's, on the way back)
MXFP8_TOL = 3 * 2.0**-4


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _compare(rank, world, ranks_per_node, top_k, preset, score_before, seed):
    x, scores, ids, weights, grad_out = layer_inputs(rank, world, top_k, seed)
    group = dist.group.WORLD
    two_hop = layer_config(world, top_k, preset, "two_hop", score_before, ranks_per_node=ranks_per_node).build(
        group, "cpu")
    flat = layer_config(world, top_k, preset, "nccl", score_before).build(group, "cpu")
    wire_stats.reset()
    got = run_layer(two_hop, x, scores, ids, weights, rank, grad_out)
    bytes_two_hop = wire_stats.snapshot(reset=True)
    want = run_layer(flat, x, scores, ids, weights, rank, grad_out)
    oracle = layer_oracle(x, scores, ids, weights, grad_out)
    oracle = (*oracle[:3], expert_grad_oracle(oracle, rank))
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
    setup_rank()
    for top_k, preset, score_before, seed in CASES:
        _compare(rank, world, 2, top_k, preset, score_before, seed)


@pytest.mark.parametrize("nodes", [2, 3])
def test_two_hop_equals_flat_nccl_and_the_fp64_oracle(nodes):
    preload(titan=False)
    run_forked(2 * nodes, _cases, timeout_s=60)
