"""benchmarks/kernels.py: its routing is a valid rank 0 of 2 or 4 (a sorted row per slot, each
owner's rows numbered 0.. in sorted order), peer 1's rows come from every rank, rounds merge into
their median, and the script runs end to end on one CPU process at EP=2 and 4 (Triton
interpreter, tiny shape at 16 tokens, extra launch shapes). No timing is asserted."""

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.kernels import merge_rounds, peer_one_rows, sorted_routing
from mxfp8_ep.exchange.peer_memory import OneProcessPeers
from mxfp8_ep.exchange.staging import token_map, token_map_offset


@pytest.mark.parametrize("world", [2, 4])
def test_sorted_routing_is_rank_0_of_world(world):
    dst_rank, dst_row, slot, sorted_row = sorted_routing(32, 8, 3, world, torch.device("cpu"))
    assert sorted(slot.tolist()) == list(range(96)) and torch.equal(slot[sorted_row], torch.arange(96))
    assert set(dst_rank.tolist()) == set(range(world))
    for r in range(world):
        assert dst_row[dst_rank == r].tolist() == list(range(int((dst_rank == r).sum())))


def test_peer_one_rows_come_from_every_rank_once_per_token():
    world, tokens, capacity = 4, 32, 96
    dst_rank = sorted_routing(tokens, 8, 3, world, torch.device("cpu"))[0]
    count = int((dst_rank == 1).sum())
    offset = token_map_offset(world * tokens, 64, torch.bfloat16)
    peers = OneProcessPeers(offset + capacity * 12, world, 0, "cpu")
    token_map(peers.peer(1), offset, capacity)[:count] = torch.randperm(tokens)[:count]  # rank 0's push
    source, tmap, _ = peer_one_rows(peers, offset, capacity, dst_rank, world, tokens)
    assert source[:count].eq(0).all() and source[count * 3:count * 4].eq(1).all() and source[count * 4:].eq(-2).all()
    for r in (0, 2, 3):
        staged = tmap[source == r]
        assert len(staged) == count and staged.unique().numel() == count
        assert staged.ge(r * tokens).all() and staged.lt((r + 1) * tokens).all()


def test_rounds_merge_into_their_median_and_the_ratio_to_the_default_launch():
    def run(ms_default, ms_other):
        common = {"world": 2, "kernel": "k", "variant": "plain", "fmt": "bf16"}
        return [{**common, "default_launch": True, "ms": ms_default},
                {**common, "default_launch": False, "ms": ms_other}]

    runs = [run(2.0, 1.0), run(1.0, 1.0), run(4.0, 4.0)]
    default, other = merge_rounds(runs)
    assert default["rounds_ms"] == [2.0, 1.0, 4.0] and default["ms"] == 2.0 and default["speedup_vs_default"] == 1.0
    assert other["ms"] == 1.0 and other["speedup_vs_default"] == 2.0
    assert "rounds_ms" not in runs[0][0]  # the rounds' rows are left as they were


VARIANTS = {
    "push_rows": {"plain", "weighted", "token-bound"},
    "push_tokens": {"plain", "weighted", "weighted, local dots"},
    "receive_rows": {"by row", "token map", "token map, weighted", "token map, weighted, dots"},
    "push_partials": {"plain", "weighted"},
    "reduce_slots": {"rows", "partials", "weighted, keeps rows", "weighted partials"},
}


@pytest.mark.parametrize("world", [2, 4])
def test_script_writes_a_row_per_kernel_variant_format_and_launch(tmp_path, world):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "-m", "benchmarks.kernels",
         "--shape", "tiny", "--tokens", "16", "--iters", "1", "--warmup", "0", "--group", "1", "--rounds", "1",
         "--world", str(world), "--launch", "push_tokens=2x4x256", "--launch", "reduce_slots=2x4x128",
         "--launch", "push_partials.mxfp8=2x4x128", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*_cpux1_kernels.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {(r["kernel"], r["variant"], r["fmt"]) for r in rows} == {
        (k, v, f) for k, vs in VARIANTS.items() for v in vs for f in ("bf16", "mxfp8")} | {
        ("check_routing", v, None) for v in ("triton", "torch")}
    launches = {}
    for r in rows:
        if r["kernel"] == "check_routing":
            continue
        launches.setdefault((r["kernel"], r["fmt"]), set()).add(json.dumps(r["launch"]))
    # The default launch plus the --launch ones (bf16's default push_tokens block_d differs from 256).
    assert {k: len(v) for k, v in launches.items()} == {
        ("push_rows", "bf16"): 1, ("push_rows", "mxfp8"): 1, ("push_tokens", "bf16"): 2, ("push_tokens", "mxfp8"): 2,
        ("receive_rows", "bf16"): 1, ("receive_rows", "mxfp8"): 1, ("push_partials", "bf16"): 1,
        ("push_partials", "mxfp8"): 2, ("reduce_slots", "bf16"): 2, ("reduce_slots", "mxfp8"): 2}
    for r in rows:
        assert r["ms"] > 0 and r["rounds_ms"] == [r["ms"]] and 0 < r["rows_to_peer"] < 16 * 2 and r["world"] == world
        assert r["speedup_vs_default"] > 0 and (r["speedup_vs_default"] == 1.0 or not r["default_launch"])


def test_an_ep_degree_that_does_not_split_the_experts_is_refused(tmp_path, capsys):
    from benchmarks.kernels import main

    with pytest.raises(SystemExit):
        main(["--world", "3", "--out", str(tmp_path)])
    assert "a divisor of dsv3's 256 experts" in capsys.readouterr().err
