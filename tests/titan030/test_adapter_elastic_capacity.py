"""The elastic capacity through the torchtitan 0.3.0 adapter: our symm dispatcher in 0.3.0's MoE
layer (2 gloo ranks, its load-balancing counts on), each step run through
``mxfp8_ep.elastic.ReplayGuard``. At half the balanced case's rows the first step overflows and
runs again; every step's output, input gradient, parameter gradients and the layer's
``tokens_per_expert_E`` (what its expert-bias update reads: a replay must not count a step twice)
are then the worst-case capacity's, bit for bit. Without a guard each dispatch reads its rows on
the host and grows before any row moves: the worst case's results too, bit for bit."""

from __future__ import annotations

import json

import pytest

titan030 = pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

import torch  # noqa: E402

from mxfp8_ep.config import A2AConfig  # noqa: E402
from mxfp8_ep.dispatcher import release_peer_buffers  # noqa: E402
from tests.moe_harness import run_forked  # noqa: E402
from tests.titan030.moe_layer import MoESpec, reference_config, run_arm, setup_rank  # noqa: E402

SPEC = MoESpec()
LEG_ROWS = ("expert_input", "expert_output_grad")  # the experts' rows: tensors of the capacity's rows


def _arm(factor):
    return titan030.replacement_config(reference_config(SPEC, None),
                                       A2AConfig.preset("mxfp8_all", transport="symm", capacity_factor=factor))


def _differ(got: dict, want: dict) -> list[str]:
    """The tensors that differ; the experts' rows (tensors of each run's capacity) up to the
    last expert segment, the rows the experts use."""
    rows = int(want["tokens_per_expert"].sum())
    differ = []
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            a, b = (got[name][:rows], value[:rows]) if name in LEG_ROWS else (got[name], value)
            if not torch.equal(a, b):
                differ.append(name)
    return differ


def compare(rank: int, world: int, out_dir) -> None:
    mesh = setup_rank(world)
    worst = run_arm(SPEC, _arm(None), mesh, replay=True)
    release_peer_buffers()
    elastic = run_arm(SPEC, _arm(0.5), mesh, replay=True)
    release_peer_buffers()
    report = {"replays": [s["replays"] for s in elastic], "worst_replays": [s["replays"] for s in worst],
              "differ": [_differ(e, w) for e, w in zip(elastic, worst, strict=True)]}
    unguarded = run_arm(SPEC, _arm(0.5), mesh)
    report["unguarded_differ"] = [_differ(u, {k: v for k, v in w.items() if k in u})
                                  for u, w in zip(unguarded, worst, strict=True)]
    release_peer_buffers()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


def test_an_overflowed_step_replays_to_the_worst_case_bit_for_bit(tmp_path):
    run_forked(2, compare, tmp_path)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["worst_replays"] == [0] * SPEC.steps, report
        assert report["replays"][0] == 1, report
        assert report["differ"] == [[]] * SPEC.steps, report
        assert report["unguarded_differ"] == [[]] * SPEC.steps, report


def _pooled(rank: int, world: int, out_dir) -> None:
    """Three layers at the worst case, and at a capacity and activation pool of their own."""
    from mxfp8_ep.pool import activation_pool

    mesh = setup_rank(world)
    activation_pool._FILL = float("nan")  # a backward that read a row past a layer's count shows
    worst = run_arm(SPEC, _arm(None), mesh, replay=True, layers=3)
    release_peer_buffers()
    activation_pool.release_pools()
    pooled_arm = titan030.replacement_config(reference_config(SPEC, None), A2AConfig.preset(
        "mxfp8_all", transport="symm", capacity_ceiling=None, activation_pool_factor=1.0,
        activation_pool_ceiling=None))
    pooled = run_arm(SPEC, pooled_arm, mesh, replay=True, layers=3)
    report = {"differ": [_differ(p, w) for p, w in zip(pooled, worst, strict=True)],
              "depth": [p.depth_seen for p in activation_pool.pools()], "planes": sum(
                  len(p.planes) for p in activation_pool.pools())}
    release_peer_buffers()
    activation_pool.release_pools()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


def test_the_activation_pool_keeps_three_layers_rows_and_matches_the_worst_case(tmp_path):
    """The pool through the 0.3.0 adapter: the experts (``ValidRowGroupedExperts``) and combine
    keep their saved rows in it, every layer but the last (which keeps its own); the steps'
    outputs and gradients are the worst case's bit for bit."""
    run_forked(2, _pooled, tmp_path)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["differ"] == [[]] * SPEC.steps, report
        # two layers moved in (the last stays out); the experts' input, h1, h3, product and
        # combine's expert outputs: five planes
        assert report["depth"] == [2] and report["planes"] == 5, report
