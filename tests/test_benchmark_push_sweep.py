"""benchmarks/push_sweep.py: its routing is a valid rank 0 of 2 or 4 (a sorted row per slot,
each owner's rows numbered 0.. in sorted order), peer 1's rows come from every rank, and the
script runs end to end on one CPU process at EP=2 and 4 (Triton interpreter, tiny shape at 16
tokens, one launch shape). No timing is asserted."""

import json
import subprocess
import sys

import torch

import pytest

from benchmarks.push_sweep import peer_one_rows, sorted_routing
from mxfp8_ep.peer_memory import OneProcessPeers
from mxfp8_ep.staging import token_map, token_map_offset


@pytest.mark.parametrize("world", [2, 4])
def test_sorted_routing_is_rank_0_of_world(world):
    dst_rank, dst_row, slot, inv = sorted_routing(32, 8, 3, world, torch.device("cpu"))
    assert sorted(slot.tolist()) == list(range(96)) and torch.equal(slot[inv], torch.arange(96))
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


@pytest.mark.parametrize("world", [2, 4])
def test_script_writes_a_row_per_kernel_and_format(tmp_path, world):
    out = tmp_path / "push.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "benchmarks/push_sweep.py",
         "--shapes", "tiny", "--iters", "1", "--warmup", "0", "--group", "1", "--rounds", "1", "--world", str(world),
         "--push-tokens-shapes", "2,4,256", "--reduce-shapes", "1,4,256;2,4,128", "--push-partials-shapes", "1,4,128;2,4,256",
         "--tokens", "16", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["kernel"], r["fmt"]) for r in rows} == {
        (k, f) for k in ("push_rows", "push_tokens", "receive_rows", "receive_rows (token map)", "push_rows (weighted)",
                         "push_tokens (weighted)", "receive_rows (token map, weighted)", "push_tokens (weighted, local dots)",
                         "receive_rows (token map, weighted, dots)") for f in ("bf16", "mxfp8")
    } | {(k, f) for k in ("push_rows (token-bound)", "push_partials", "reduce_slots", "reduce_slots (partials)",
                          "push_partials (weighted)", "reduce_slots (weighted, keeps rows)", "reduce_slots (weighted partials)")
         for f in ("bf16", "mxfp8")}
    reduce_launches = {(r["kernel"], r["fmt"], json.dumps(r["launch"])) for r in rows if r["kernel"].startswith("reduce_slots")}
    assert len(reduce_launches) == 4 * 2 * 2  # every reduce variant and format at each --reduce-shapes launch
    partials_launches = {(r["kernel"], r["fmt"], json.dumps(r["launch"])) for r in rows if r["kernel"].startswith("push_partials")}
    assert len(partials_launches) == 2 * 2 * 2  # both push_partials variants and formats at each launch
    for r in rows:
        assert r["ms"] > 0 and r["rounds_ms"] == [r["ms"]] and 0 < r["rows_to_peer"] < 16 * 2 and r["world"] == world
