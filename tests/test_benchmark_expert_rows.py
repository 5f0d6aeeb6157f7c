"""benchmarks/expert_rows.py runs end to end on one CPU process (tiny shape) and writes a row
per arm and pass, each arm checked against torchtitan's experts on the rows that matter. No
timing is asserted: speed is measured on the GPU machine (benchmarks/RESULTS.md)."""

import json
import subprocess
import sys

from benchmarks.expert_rows import ARMS, even_counts
from mxfp8_ep.capacity import expert_major_capacity


def test_even_counts_split_the_rows_and_pad_each_expert():
    counts = even_counts(100, 8, 8)
    assert counts.tolist() == [16] * 8  # 13 or 12 rows each, padded to 8
    assert int(even_counts(4096, 32, 8).sum()) == 4096
    assert expert_major_capacity(256, 2, 2, 4, 8) > int(even_counts(512, 4, 8).sum())


def test_script_writes_checked_rows(tmp_path):
    out = tmp_path / "expert_rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "benchmarks/expert_rows.py",
         "--shapes", "tiny", "--iters", "2", "--warmup", "1", "--group", "1", "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["arm"], r["pass"]) for r in rows} == {(a, p) for a in ARMS for p in ("fwd", "fwd+bwd")}
    for r in rows:
        assert r["ms"] > 0 and r["rel_err"] < 2.0**-7, r  # same math in bf16: summation order only
        assert "capacity" in r["shape"]


def test_rows_kernel_sweep_writes_a_row_per_launch_shape_and_op(tmp_path):
    out = tmp_path / "sweep.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "benchmarks/expert_rows.py",
         "--shapes", "tiny", "--sweep-rows-kernel", "--sweep-launch", "8,2;32,4", "--iters", "1",
         "--warmup", "0", "--group", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["pass"] for r in rows} == {"silu_mul", "silu_mul_backward", "add_rows"}
    assert {r["arm"] for r in rows} == {"8 programs/SM, 2 rows", "32 programs/SM, 4 rows"}
    assert len(rows) == 6 and all(r["ms"] > 0 for r in rows)
