"""benchmarks/node_hop_capacity.py: per-token expert sets sampled from a telemetry's per-expert
counts, the node hop's need per step, the elastic rule's reruns over the needs, as rows."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.node_hop_capacity import (DEFAULTS, GRID, NodeHop, main, node_counts, sample_experts, simulate,
                                          step_needs)
from benchmarks.capacity_study import target
from benchmarks.rows import read_rows
from mxfp8_ep.exchange.capacity import node_hop_bytes, node_hop_capacity, remote_node_share


def _inclusion(p: torch.Tensor) -> torch.Tensor:
    """Each item's chance to be among two drawn without replacement with chances ``p``: drawn
    first, or second after another one."""
    second = torch.stack([sum(p[j] * p[i] / (1 - p[j]) for j in range(len(p)) if j != i) for i in range(len(p))])
    return p + second


def test_sampled_experts_are_distinct_and_follow_the_loads():
    """One pick follows the loads; two distinct picks follow successive sampling's inclusion
    chances (not twice the loads), as torch.multinomial without replacement draws them; an
    expert without load is never picked."""
    weights = torch.tensor([[8.0, 4.0, 2.0, 1.0, 1.0, 0.0]])
    p = weights[0] / weights.sum()
    tokens = 200_000
    gen = torch.Generator().manual_seed(0)
    one = sample_experts(weights, tokens, 1, gen)
    assert one.shape == (1, tokens, 1)
    assert torch.allclose(torch.bincount(one.flatten(), minlength=6) / tokens, p, atol=0.005)
    two = sample_experts(weights, tokens, 2, gen)[0]
    assert (two[:, 0] != two[:, 1]).all() and not (two == 5).any()
    freq = torch.bincount(two.flatten(), minlength=6) / tokens
    assert torch.allclose(freq, _inclusion(p), atol=0.005) and not torch.allclose(freq, 2 * p, atol=0.05)
    reference = torch.multinomial(weights.expand(tokens, 6), 2, replacement=False, generator=gen)
    assert torch.allclose(freq, torch.bincount(reference.flatten(), minlength=6) / tokens, atol=0.005)


def test_a_layer_with_fewer_loaded_experts_than_top_k_is_a_clear_error():
    with pytest.raises(ValueError, match="at least top_k=3 positive"):
        sample_experts(torch.tensor([[1.0, 1.0, 0.0, 0.0]]), 4, 3, torch.Generator().manual_seed(0))


def test_tokens_per_node_on_a_hand_made_case():
    """Eight experts, two picks per token: a token counts once for a node however many of its
    experts it holds."""
    ids = torch.tensor([[0, 1], [0, 4], [5, 6], [2, 7]])
    assert node_counts(ids, 8, 2).tolist() == [3, 3]  # node 0: experts 0-3; node 1: 4-7
    assert node_counts(ids, 8, 4).tolist() == [2, 1, 2, 2]  # two experts a node
    assert node_counts(ids.view(2, 2, 2), 8, 2).tolist() == [[2, 1], [1, 2]]  # per rank (leading dim)
    with pytest.raises(ValueError, match="8 experts do not split over 3 nodes"):
        node_counts(ids, 8, 3)


def test_a_steps_need_is_its_busiest_layer_and_node():
    """Layer 1 even; layer 2 routes only to node 0's experts (of 2 nodes): every token goes
    there, so the step needs every token at 2 nodes; at 4 nodes the two picks lie on nodes 0
    and 1, and the busier of them takes at least half the tokens."""
    line = {"step": 1, "counts": [[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]}
    needs = step_needs([line, line], tokens=64, top_k=2, node_counts_=(2, 4), source_ranks=2)
    assert needs[2] == [64, 64]
    assert all(32 <= need <= 64 for need in needs[4])
    even = {"step": 1, "counts": [[1] * 8]}
    assert step_needs([even], tokens=64, top_k=2, node_counts_=(2,))[2][0] < 64


def test_reruns_over_a_hand_made_need_sequence():
    """Start 100 rows, ceiling 200, every token 300, growth +25%: 120 grows it to 150 (step 2),
    130 and 149 fit, 151 grows it to 189 (step 5), 250 spills past the ceiling, which the
    capacity takes (step 6), 100 fits."""
    sim = simulate([90, 120, 130, 149, 151, 250, 100], list(range(1, 8)), 100, 200, 300, headroom=0.25)
    assert (sim["replays"], sim["spills"], sim["reruns"], sim["last_rerun_step"]) == (2, 1, 3, 6)
    assert sim["reruns_per_1000"] == round(3000 / 7, 2) and sim["reruns_first_100"] == 3
    assert (sim["start_rows"], sim["peak_rows"], sim["end_rows"]) == (100, 200, 200)
    assert simulate([100] * 4, [1, 2, 3, 4], 100, 200, 300)["reruns"] == 0


def test_the_policy_rows_are_the_dispatchers():
    """Start and ceiling as ``TwoHopTokenDispatcher._node_capacity_held`` takes them: the
    balanced share of the target's tokens at the factor and at the ceiling, at most every token."""
    t = target()
    for nodes in (2, 8):
        hop = NodeHop(t, nodes)
        share = remote_node_share(t.facts.num_experts, t.facts.top_k, nodes)
        assert hop.rows(DEFAULTS.factor) == node_hop_capacity(t.tokens, share, DEFAULTS.factor)
        assert hop.ceiling(DEFAULTS) == max(hop.rows(DEFAULTS.factor), node_hop_capacity(t.tokens, share,
                                                                                         DEFAULTS.ceiling))
    assert NodeHop(t, 2).rows(DEFAULTS.factor) == t.tokens > NodeHop(t, 8).rows(DEFAULTS.factor)


def _telemetry(tmp_path, steps: int, counts=True):
    """Two layers of 64 experts: the first even, the second with EP=8's first rank's 8 experts
    (node 0 of 8 nodes) twice as loaded as the others."""
    layer = [2] * 8 + [1] * 56
    lines = [{"step": i + 1, "layers": [1, 2], "picks": [72, 72], "load": {"8": [1.0, 1.5]},
              **({"counts": [[1] * 64, layer]} if counts else {})} for i in range(steps)]
    path = tmp_path / "routing.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_rows_and_verdict_from_a_telemetry(tmp_path, capsys):
    main([str(_telemetry(tmp_path, 4)), "--out", str(tmp_path / "rows"), "--source", "python x", "--extrapolate"])
    rows = read_rows(tmp_path / "rows")
    assert {r["bench"] for r in rows} == {"node_hop_capacity"}
    need = {r["nodes"]: r for r in rows if r["kind"] == "need"}
    policies = [r for r in rows if r["kind"] == "policy"]
    assert sorted(need) == [2, 4, 8] and len(policies) == 3 * len(GRID)
    assert all(r["source_ranks"] == 1 and r["steps"] == 4 and r["routing_model"] for r in rows)
    t = target()
    for nodes, r in need.items():
        assert r["ep"] == 8 * nodes and r["balanced_rows"] == round(NodeHop(t, nodes).balanced, 1)
        assert r["max_need"] <= t.tokens and r["max_need_factor"] > r["uniform_need_factor"] > 1.0
    (default,) = [r for r in policies if r["defaults"] and r["nodes"] == 8]
    assert (default["capacity_factor"], default["capacity_ceiling"]) == (DEFAULTS.factor, DEFAULTS.ceiling)
    assert default["start_rows"] == NodeHop(t, 8).rows(DEFAULTS.factor) and default["telemetry_source"] == "python x"
    # a preset's widest leg: bf16's dispatch forward (its ids and scores beside each row); MXFP8 rows
    # are about half as wide
    bf16 = node_hop_bytes(8, default["ceiling_rows"], 2 * t.facts.dim, t.facts.top_k, "dispatch_fwd")
    assert default["ceiling_mib_bf16"] == round(bf16 / 2**20, 1)
    assert default["ceiling_mib_mxfp8_all"] < 0.6 * default["ceiling_mib_mxfp8"] < default["ceiling_mib_bf16"]
    # at 2 nodes the start holds every token: nothing to rerun
    assert all(r["reruns"] == 0 for r in policies if r["nodes"] == 2 and r["capacity_factor"] >= 1.25)
    out = capsys.readouterr().out
    assert "8 nodes (EP=64) defaults: " in out and "8 nodes target (<= 10 reruns per 1,000 steps): " in out
    assert "extrapolated (--extrapolate): 4 steps, fewer than the 1,000 a verdict takes" in out


@pytest.mark.parametrize("args,counts,error", [
    ([], True, "would be an extrapolation: 3 steps, fewer than the 1,000"),
    (["--extrapolate", "--source-ranks", "0"], True, "--source-ranks takes at least 1 rank"),
    (["--extrapolate"], False, "a step without per-expert counts"),
])
def test_bad_input_is_refused_before_any_row(tmp_path, capsys, args, counts, error):
    with pytest.raises(SystemExit) as e:
        main([str(_telemetry(tmp_path, 3, counts)), "--out", str(tmp_path / "rows"), *args])
    assert e.value.code == 2 and error in capsys.readouterr().err
    assert not (tmp_path / "rows").exists()
