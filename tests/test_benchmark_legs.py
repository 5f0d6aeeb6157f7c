"""benchmarks/legs.py runs end to end (gloo, tiny legs): every arm's leg checked against
torchtitan's, and all_to_all_v alone in both formats; its routings are what they claim. No
timing is asserted: speed is measured on the GPU machine."""

import json
import subprocess
import sys

import pytest

from benchmarks.legs import routing_splits


def _run(tmp_path, *args):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "benchmarks.legs",
         "--iters", "2", "--warmup", "1", "--out", str(tmp_path), *args],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _rows(tmp_path, bench):
    (path,) = tmp_path.glob(f"*_cpux2_{bench}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_legs_write_a_checked_row_per_arm_routing_and_leg(tmp_path):
    arms = ["bf16/symm", "mxfp8/symm", "bf16/nccl", "mxfp8_all/nccl"]
    _run(tmp_path, "--rows", "256", "--dim", "64", "--group", "2", "--rounds", "2", "--arms", ",".join(arms))
    rows = _rows(tmp_path, "legs")
    assert {(r["routing"], r["leg"], r["arm"]) for r in rows} == {
        (ro, leg, arm) for ro in ("even", "zipf") for leg in ("dispatch", "combine") for arm in ["torchtitan", *arms]}
    for r in rows:
        assert r["link"] == "nvlink" and r["pass"] == "fwd" and (r["rows"], r["dim"], r["top_k"]) == (256, 64, 8)
        assert r["ms"] > 0 and r["ms_synced"] > 0 and r["speedup_vs_torchtitan"] > 0 and r["speedup_vs_bf16_nccl"] > 0
        err = r["rel_err"]["dispatch+combine"]
        if r["arm"] in ("torchtitan", "bf16/nccl"):  # bf16/nccl is torchtitan's math, bit for bit
            assert err == 0.0, r
        else:
            assert err < (2.0**-6 if r["arm"].startswith("bf16") else 2.0**-3), r


def test_symm_arms_are_refused_on_nccls_slower_links(tmp_path, capsys):
    from benchmarks.legs import main

    with pytest.raises(SystemExit):
        main(["--link", "shm", "--arms", "bf16/symm", "--out", str(tmp_path)])
    assert "symm arms cross NVLink" in capsys.readouterr().err


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


def test_a2a_writes_a_row_per_format_with_its_ratio_to_bf16(tmp_path):
    _run(tmp_path, "--a2a", "--a2a-shapes", "2x32x64")
    rows = _rows(tmp_path, "a2a")
    timed = [r for r in rows if r["op"] in ("dispatch", "combine")]
    assert len(timed) == 16  # {even, zipf} x {dispatch, combine} x {fwd, fwd+bwd} x {bf16, mxfp8}
    assert {(r["routing"], r["op"], r["pass"], r["arm"]) for r in timed} == {
        (ro, op, pa, fmt) for ro in ("even", "zipf") for op in ("dispatch", "combine") for pa in ("fwd", "fwd+bwd")
        for fmt in ("bf16", "mxfp8")}
    for r in timed:
        assert r["ms"] > 0 and (r["batch"], r["seq"], r["dim"]) == (2, 32, 64) and r["speedup_vs_bf16"] > 0
        assert r["arm"] == "mxfp8" or r["speedup_vs_bf16"] == 1.0
    assert {(r["routing"], r["op"]) for r in rows if r not in timed} == {
        (ro, op) for ro in ("even", "zipf") for op in ("quantize", "dequantize")}
