"""``benchmarks/timeline.timeline_gaps`` on a hand-made Chrome trace: busy and idle time, which
gaps the host caused, and each GEMM call with the work beside it on other streams. The profiles
themselves run on the GPU machine (``benchmarks/run.sh profile``)."""

import json

import pytest
import torch

from benchmarks.timeline import main, timeline_gaps


def _kernel(name, ts, dur, stream, correlation):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream, "grid": [132, 1, 1], "correlation": correlation}}


def _launch(ts, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5,
            "args": {"correlation": correlation}}


def test_timeline_gaps_and_gemm_calls(tmp_path):
    events = [
        _kernel("cutlass_grouped_gemm", 0, 100, 7, 1), _launch(-10, 1),
        _kernel("ncclDevKernel_SendRecv", 50, 100, 9, 2), _launch(40, 2),  # beside the GEMM
        _kernel("elementwise", 200, 50, 7, 3), _launch(180, 3),  # launched after the GPU went idle
        _kernel("nvjet_gemm", 300, 20, 7, 4), _launch(100, 4),  # launched early: the GPU was late
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    t = timeline_gaps(str(trace))
    assert t["span_ms"] == 0.32 and t["busy_ms"] == 0.22 and t["idle_ms"] == 0.1
    # Gap 150-200 us: host-late (launched at 180); gap 250-300 us: not (launched at 100).
    assert t["idle_host_late_ms"] == 0.05
    assert [g["host_late"] for g in sorted(t["largest"], key=lambda g: g["after"])] == [True, False]
    assert t["gemm_names"] == ["cutlass_grouped_gemm", "nvjet_gemm"]
    assert t["gemm_calls"] == [[0, 7, [132, 1, 1], 100, ["ncclDevKernel_SendRecv"]], [1, 7, [132, 1, 1], 20, []]]


def test_a_trace_without_gpu_events_has_no_timeline(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [_launch(0, 1)]}))
    assert timeline_gaps(str(trace)) == {}


def test_bad_options_and_a_machine_without_gpus_fail_before_the_group_starts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--parts", "kernels,gemms", "--out", str(tmp_path)])
    assert "--parts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--launch", "push_tokens=2x3", "--out", str(tmp_path)])
    assert "power of two" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs GPUs"):
            main(["--out", str(tmp_path)])
