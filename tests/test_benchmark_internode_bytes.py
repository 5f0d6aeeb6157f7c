"""benchmarks/internode_bytes.py: its rows crossing nodes and inside them against a count by
hand over small routings (flat: one row per token and expert; dedup: one per token and node),
the bytes from each leg's wire format, and the rows a run writes (one per node count, arm and
node-limited routing, the node-limited ones within their limit). Seconds."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import internode_bytes as ib

LAYOUTS = [ib.Layout(2, 2, 8), ib.Layout(3, 2, 12), ib.Layout(2, 4, 16), ib.Layout(4, 2, 8)]


def by_hand(expert_ids: list[list[int]], source: list[int], layout: ib.Layout) -> dict[str, tuple[int, int]]:
    """(between nodes, inside a node) rows of one leg, token by token, from the rules."""
    per_rank = layout.num_experts // layout.ranks
    g = layout.gpus_per_node
    flat_inter = flat_intra = dedup_inter = dedup_intra = 0
    for experts, rank in zip(expert_ids, source):
        home = rank // g
        for e in experts:  # flat: every (token, expert) pair
            if (e // per_rank) // g != home:
                flat_inter += 1
            elif e // per_rank != rank:
                flat_intra += 1
        ranks = {e // per_rank for e in experts}  # dedup: each GPU once, each node once
        for node in {r // g for r in ranks}:
            lands_on = rank if node == home else node * g + rank % g
            dedup_inter += node != home
            dedup_intra += len({r for r in ranks if r // g == node} - {lands_on})
    return {"flat": (flat_inter, flat_intra), "dedup": (dedup_inter, dedup_intra)}


def test_a_token_worked_by_hand():
    """2 nodes x 2 GPUs, 2 experts per GPU: a token on GPU 0 routed to experts 2, 3 (GPU 1, its
    node) and 6 (GPU 3, the other node; the row lands on GPU 2, local index 0, and goes on to 3)."""
    layout = ib.Layout(2, 2, 8)
    ids, source = torch.tensor([[2, 3, 6]]), torch.tensor([0])
    flat, dedup = ib.flat_crossings(ids, source, layout), ib.dedup_crossings(ids, source, layout)
    assert (flat.inter, flat.intra) == (1, 2)  # expert 6 across; experts 2 and 3 on NVLink
    assert (dedup.inter, dedup.intra) == (1, 2)  # node 1 once; GPU 1 once, GPU 2 -> 3 once
    assert by_hand([[2, 3, 6]], [0], layout) == {"flat": (1, 2), "dedup": (1, 2)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.nodes}x{lay.gpus_per_node}_{lay.num_experts}")
def test_crossings_match_the_count_by_hand(layout: ib.Layout):
    g = torch.Generator().manual_seed(layout.ranks)
    tokens, top_k = layout.ranks * 5, 3
    ids = torch.stack([torch.randperm(layout.num_experts, generator=g)[:top_k] for _ in range(tokens)])
    source = layout.source_ranks(tokens)
    hand = by_hand(ids.tolist(), source.tolist(), layout)
    for send, count in (("flat", ib.flat_crossings), ("dedup", ib.dedup_crossings)):
        c = count(ids, source, layout)
        assert (c.inter, c.intra, c.tokens) == (*hand[send], tokens), send
        assert ib.crossings(send, ids, layout) == c


def test_bytes_per_token_are_each_legs_wire_bytes():
    dim, rows = 2048, ib.Crossings(inter=300, intra=50, tokens=100)
    bf16, mxfp8 = 2 * dim, dim + dim // 32  # bytes per row
    expected = {"bf16": 4 * bf16, "mxfp8": 2 * mxfp8 + 2 * bf16, "mxfp8_all": 4 * mxfp8}  # the presets' legs
    for arm in ib.ARMS:
        send, preset = ib.split_arm(arm)
        f = ib.arm_fields(arm, rows, dim, tokens_per_gpu=1000)
        assert f["bytes_per_token"] == pytest.approx(3 * expected[preset]), arm
        assert f["intra_bytes_per_token"] == pytest.approx(0.5 * expected[preset]), arm
        assert sum(f["leg_bytes_per_token"].values()) == pytest.approx(f["bytes_per_token"])
        assert f["modelled_fwd_ms"] < f["modelled_ms"]
    # the time model: flat's NVLink share runs beside its inter-node share, dedup's after it
    flat, dedup = (ib.arm_fields(a, rows, dim, 1000)["modelled_ms"] for a in ("flat_bf16", "dedup_bf16"))
    assert dedup > flat


def test_two_hop_sends_its_blocks_full_or_not():
    """2 nodes x 2 GPUs, 8 experts, top-2, 100 tokens per GPU: a token reaches the other node
    with chance 1 - (4/8)(3/7) = 11/14 (``remote_node_share``); at factor 1.0 a block holds
    ceil(100 x 11/14) = 79 rows. mxfp8_all, dim 64: 66 wire bytes, 80 padded to 16; dispatch
    forward adds 2 x 4 x 2 bytes of side columns, its backward 1 x 4 x 2."""
    layout, rows = ib.Layout(2, 2, 8), ib.Crossings(inter=158, intra=0, tokens=200)
    f = ib.two_hop_fields("mxfp8_all", rows, layout, dim=64, top_k=2, tokens_per_gpu=100, factor=1.0)
    assert f["two_hop_capacity_rows"] == 79
    assert f["two_hop_bytes_per_token"] == pytest.approx(79 * (4 * 80 + 16 + 8) / 100)
    assert f["two_hop_fill"] == pytest.approx(0.79 / 0.79)
    worst = ib.two_hop_fields("mxfp8_all", rows, layout, dim=64, top_k=2, tokens_per_gpu=100, factor=None)
    assert worst["two_hop_capacity_rows"] == 100 and worst["two_hop_fill"] == pytest.approx(0.79)


def test_a_run_writes_one_row_per_nodes_arm_and_node_limit(tmp_path):
    assert ib.main(["--out", str(tmp_path), "--tokens", "512", "--layers", "2"]) == 0
    (path,) = tmp_path.glob("*_cpux1_internode_bytes.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [(r["nodes"], r["arm"], r["node_limited"]) for r in rows]
    assert sorted(keys, key=str) == sorted([(n, a, m) for n in ib.NODES for a in ib.ARMS for m in (None, n // 2)],
                                           key=str)
    for r in rows:
        assert r["bench"] == "internode_bytes" and r["gpus_per_node"] == 8 and r["ep"] == 8 * r["nodes"]
        assert r["bytes_per_token"] > 0 and r["modelled_ms"] > 0 and "model:" in r["time_model"]
        assert "TokenChoiceTopKRouter" in r["routing"] and r["moe_layers"] == 2 and r["tokens"] == 512
        assert r["num_expert_groups"] == (r["nodes"] if r["node_limited"] else None)
        if r["arm"] == ib.BASELINE:
            assert r["of_flat_bf16"] == 1
        if r["arm"].startswith("dedup"):  # the transport sends at least the rows the routing needs
            assert r["two_hop_bytes_per_token"] >= r["bytes_per_token"] and 0 < r["two_hop_fill"] <= 1
        else:
            assert "two_hop_bytes_per_token" not in r
        if r["node_limited"] and r["arm"].startswith("dedup"):
            # a token's experts on at most node_limited nodes: at most that many other nodes
            assert r["inter_rows_per_token"] <= r["node_limited"]
    by = {(r["nodes"], r["arm"], r["node_limited"]): r for r in rows}
    for n in ib.NODES:  # the same routing, sent flat or once per node
        for m in (None, n // 2):
            assert by[n, "dedup_bf16", m]["bytes_per_token"] < by[n, "flat_bf16", m]["bytes_per_token"]
    # without a limit a token's six experts leave its node more often than with one
    assert by[2, "dedup_bf16", 1]["inter_rows_per_token"] < by[2, "dedup_bf16", None]["inter_rows_per_token"]


@pytest.mark.parametrize("args,expected", [(["--tokens", "100"], "a positive multiple of 64"),
                                           (["--layers", "27"], "1 to 26")])
def test_bad_options_are_refused_before_anything_runs(args, expected, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ib.main(["--out", str(tmp_path / "out"), *args])
    assert e.value.code == 2 and expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
