"""benchmarks/titan030.py runs end to end (gloo, tiny shape) and checks its arms against
0.3.0's AllToAll arm. No timing is asserted: speed is measured on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

ARMS = ["alltoall", "bf16/symm", "mxfp8/nccl"]


def test_benchmark_script_writes_rows_for_every_arm(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "benchmarks.titan030",
         "--shapes", "tiny", "--arms", ",".join(ARMS), "--iters", "1", "--warmup", "0", "--group", "1", "--rounds", "1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*_titan030.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["arm"], r["pass"]) for r in rows] == [(a, p) for a in ARMS for p in ("fwd", "fwd+bwd")]
    for r in rows:
        assert r["bench"] == "titan030" and r["shape"] == "tiny" and r["ms"] > 0 and r["commit"], r
        assert r["versions"]["torchtitan"].startswith("0.3."), r
        assert r["correct"], r
        assert r["speedup_vs_minimal_async_ep"] is None, "no MinimalAsyncEP arm on CPU"
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["alltoall"]["speedup_vs_alltoall"] == 1.0
    assert set(by_arm["alltoall"]["rel_err"].values()) == {0.0}
    assert 0 < by_arm["mxfp8/nccl"]["rel_err"]["w1_grad"] <= 2.0**-4


def test_minimal_async_ep_arm_needs_cuda():
    if __import__("torch").cuda.is_available():
        pytest.skip("CPU-only check")
    from benchmarks.harness import SHAPES, Arm
    from benchmarks.titan030 import dispatcher_config

    with pytest.raises(ValueError, match="needs CUDA symmetric memory"):
        dispatcher_config(Arm("minimal_async_ep"), SHAPES["tiny"], __import__("torch").device("cpu"))
