"""benchmarks/a2a.py runs end to end (gloo, tiny shape) and its routing is what it claims.
No timing is asserted: speed is measured on the GPU machine (benchmarks/RESULTS.md)."""

import json
import subprocess
import sys

import pytest

from benchmarks.a2a import routing_splits


def test_routing_splits_even_and_zipf():
    even = routing_splits(1001, 3, "even", experts=6, zipf_s=1.2)
    assert all(sum(row) == 1001 for row in even) and even[0][:2] == [333, 333]
    zipf = routing_splits(4096, 2, "zipf", experts=64, zipf_s=1.2)
    assert all(sum(row) == 4096 for row in zipf)
    assert zipf[0][0] > 2 * zipf[0][1], "popular experts live on rank 0"
    with pytest.raises(ValueError, match="multiple of the world size"):
        routing_splits(10, 3, "zipf", experts=64, zipf_s=1.2)
    with pytest.raises(ValueError, match="routing"):
        routing_splits(10, 2, "uniform", experts=64, zipf_s=1.2)


def test_benchmark_script_writes_table_and_json(tmp_path):
    out = tmp_path / "a2a.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "benchmarks/a2a.py",
         "--shapes", "2,32,64", "--iters", "2", "--warmup", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bf16_ms mxfp8_ms" in proc.stdout
    report = json.loads(out.read_text())
    assert report["env"]["backend"] == "gloo" and report["env"]["world_size"] == 2
    rows = report["rows"]
    assert len(rows) == 8  # {even, zipf} x {dispatch, combine} x {fwd, fwd+bwd}
    assert {(r["routing"], r["op"], r["pass"]) for r in rows} == {
        (ro, op, pa) for ro in ("even", "zipf") for op in ("dispatch", "combine") for pa in ("fwd", "fwd+bwd")
    }
    for r in rows:
        assert r["bf16_ms"] > 0 and r["mxfp8_ms"] > 0 and r["input_shape"] == [2, 32, 64]
