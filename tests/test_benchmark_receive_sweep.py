"""benchmarks/receive_sweep.py: its made-up EP=2 routing is a valid leg (every slot a sorted
row, half of them staged), and the script runs end to end on one CPU process (Triton
interpreter, tiny shape, one launch shape each). No timing is asserted."""

import json
import subprocess
import sys

import torch

from benchmarks.dispatcher import parse_shapes
from benchmarks.receive_sweep import made_up_routing, merge_rounds


def test_made_up_routing_is_a_permutation_with_half_the_rows_staged():
    inv, row_rank, local_row = made_up_routing(64, 4, torch.device("cpu"))
    assert sorted(inv.tolist()) == list(range(256)) and sorted(local_row.tolist()) == list(range(256))
    assert int((row_rank == 1).sum()) == 128 and set(row_rank.tolist()) == {0, 1}


def test_parse_shapes():
    assert parse_shapes("1,4,1024;2,8,512") == [(1, 4, 1024), (2, 8, 512)]


def test_rounds_merge_into_their_median_and_its_rate():
    runs = [[{"kernel": "k", "ms": ms, "hbm_bytes": 2e6}] for ms in (2.0, 1.0, 4.0)]
    (row,) = merge_rounds(runs)
    assert row["rounds_ms"] == [2.0, 1.0, 4.0] and row["ms"] == 2.0
    assert row["hbm_GBps"] == 1.0 and "hbm_bytes" not in row  # 2e6 bytes in 2 ms
    assert "rounds_ms" not in runs[0][0]  # the rounds' rows are left as they were


def test_script_writes_a_row_per_kernel_format_and_shape(tmp_path):
    out = tmp_path / "sweep.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "benchmarks/receive_sweep.py",
         "--shapes", "tiny", "--iters", "1", "--warmup", "0", "--group", "1", "--rounds", "1",
         "--reduce-shapes", "4,4,512", "--receive-shapes", "8,4", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["kernel"], r["fmt"]) for r in rows} == {
        (k, f) for k in ("reduce_slots", "receive_rows") for f in ("bf16", "mxfp8")}
    for r in rows:
        assert r["rounds_ms"] == [r["ms"]]
        assert r["ms"] > 0 and "hbm_GBps" in r
