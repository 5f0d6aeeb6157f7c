"""benchmarks/host_time.py runs end to end on one CPU process (tiny shape) and writes a row per
arm. On CPU the host waits for its own work, so host and "GPU done" times agree; the question
it answers is asked on the GPU machine (benchmarks/RESULTS.md)."""

import json
import subprocess
import sys


def test_script_writes_a_row_per_arm(tmp_path):
    out = tmp_path / "host.json"
    arms = ["torchtitan", "bf16/nccl"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "benchmarks/host_time.py",
         "--shape", "tiny", "--experts", "8", "--arms", ",".join(arms), "--calls", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["arm"] for r in rows] == arms
    for r in rows:
        assert 0 < r["host_fwd_ms"] <= r["host_fwd_bwd_ms"] <= r["gpu_fwd_bwd_ms"]
