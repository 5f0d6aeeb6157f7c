"""benchmarks/push_sweep.py: its routing is a valid rank 0 of 2 (a sorted row per slot, each
owner's rows numbered 0.. in sorted order), and the script runs end to end on one CPU process
(Triton interpreter, tiny shape at 16 tokens, one launch shape). No timing is asserted."""

import json
import subprocess
import sys

import torch

from benchmarks.push_sweep import sorted_routing


def test_sorted_routing_is_rank_0_of_2():
    dst_rank, dst_row, slot, inv = sorted_routing(32, 8, 3, torch.device("cpu"))
    assert sorted(slot.tolist()) == list(range(96)) and torch.equal(slot[inv], torch.arange(96))
    assert set(dst_rank.tolist()) == {0, 1}
    for r in (0, 1):
        assert dst_row[dst_rank == r].tolist() == list(range(int((dst_rank == r).sum())))


def test_script_writes_a_row_per_kernel_and_format(tmp_path):
    out = tmp_path / "push.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "benchmarks/push_sweep.py",
         "--shapes", "tiny", "--iters", "1", "--warmup", "0", "--group", "1", "--rounds", "1",
         "--push-tokens-shapes", "2,4,256", "--reduce-shapes", "1,4,256;2,4,128", "--tokens", "16", "--json", str(out)],
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
    for r in rows:
        assert r["ms"] > 0 and r["rounds_ms"] == [r["ms"]] and 0 < r["rows_to_peer"] < 16 * 2
