"""benchmarks/layer.py runs end to end (gloo, tiny shape, symm over shared memory) and writes a row
per arm and pass, every arm checked against torchtitan's; its reading of nvidia-smi samples for
``--power``. No timing is asserted: speed is measured on the GPU machine."""

import json
import subprocess
import sys

import pytest

from benchmarks.layer import parse_sample, phase_stats, smi_index_by_uuid

ARMS = ["bf16/symm", "mxfp8/symm", "mxfp8/symm:rows", "mxfp8/nccl", "mxfp8_all/symm:push_tokens=2x4x1024",
        "bf16/symm@local"]


def test_script_writes_rows_with_checked_arms(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "benchmarks.layer",
         "--shapes", "tiny", "--iters", "2", "--warmup", "1", "--group", "2", "--rounds", "2",
         "--arms", ",".join(ARMS), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*_cpux2_layer.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # torchtitan, the reference, runs first and once, whether --arms names it or not.
    assert [(r["arm"], r["pass"]) for r in rows] == [(a, p) for a in ["torchtitan", *ARMS] for p in ("fwd", "fwd+bwd")]
    for r in rows:
        assert r["bench"] == "layer" and r["shape"] == "tiny" and r["ep"] == 2 and r["commit"]
        assert r["ms"] > 0 and r["ms_synced"] > 0 and r["speedup_vs_torchtitan"] > 0
        assert r["speedup_vs_bf16_nccl"] is None  # no bf16/nccl arm in this run
        assert r["timing"] == {"iters": 2, "warmup": 1, "group": 2, "rounds": 2}
        errs = r["rel_err"]
        if r["arm"].endswith("@local"):  # another layer (each rank alone): not comparable
            assert errs == {}
        elif r["arm"] == "torchtitan":
            assert errs == {"out": 0.0, "x_grad": 0.0, "w1_grad": 0.0} and r["speedup_vs_torchtitan"] == 1.0
        else:  # bf16 legs: summation order only; MXFP8 legs: the format's error
            bound = 2.0**-6 if r["arm"].startswith("bf16") else 2.0**-3
            assert max(errs.values()) < bound, r


def test_bad_arms_and_power_without_gpus_fail_before_the_group_starts(tmp_path, capsys):
    from benchmarks.layer import main

    with pytest.raises(SystemExit):
        main(["--arms", "bf16/symm:push1", "--out", str(tmp_path)])
    assert "unknown modifier 'push1'" in capsys.readouterr().err
    if not __import__("torch").cuda.is_available():
        with pytest.raises(SystemExit, match="needs CUDA GPUs"):
            main(["--power", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_parse_sample_reads_the_power_cap_bit():
    assert parse_sample("0, 1605, 596.31, 0x0000000000000004\n") == (0, 1605.0, 596.31, True)
    assert parse_sample("1, 1980, 80.2, 0x0000000000000000") == (1, 1980.0, 80.2, False)
    # Another reason alone (0x1: idle) is not the power cap.
    assert parse_sample("1, 345, 70.0, 0x0000000000000001")[3] is False


def test_parse_sample_skips_lines_it_cannot_read():
    assert parse_sample("0, [N/A], 500.0, 0x4") is None
    assert parse_sample("garbage") is None


def test_phase_stats_keeps_one_gpu_inside_the_window_after_the_ramp():
    samples = [
        (9.0, 0, 1980.0, 100.0, False),  # before the passes
        (10.1, 0, 1900.0, 650.0, False),  # ramp-up, skipped
        (10.5, 0, 1600.0, 600.0, True),
        (10.6, 1, 1000.0, 999.0, True),  # the other GPU
        (11.0, 0, 1700.0, 620.0, True),
        (11.5, 0, 1800.0, 640.0, False),
        (12.5, 0, 1980.0, 90.0, False),  # after
    ]
    stats = phase_stats(samples, 0, 10.0, 12.0, skip_s=0.3)
    assert stats == {"samples": 3, "sm_mhz": 1700, "power_w": 620, "power_capped": 0.67}
    assert phase_stats(samples, 2, 10.0, 12.0, skip_s=0.3)["samples"] == 0


def test_smi_index_by_uuid_maps_torch_uuids_to_nvidia_smi_indices():
    text = ("0, GPU-50919755-736b-af4c-5e43-836a4aa19c42\n"
            "1, GPU-30ce921e-2af1-e69d-d690-95273369cd60\n")
    # torch's device UUID has no "GPU-" prefix.
    assert smi_index_by_uuid(text) == {"50919755-736b-af4c-5e43-836a4aa19c42": 0,
                                       "30ce921e-2af1-e69d-d690-95273369cd60": 1}
