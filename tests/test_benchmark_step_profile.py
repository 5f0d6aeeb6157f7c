"""``benchmarks/step_profile.py`` on a hand-made Chrome trace: kernels sorted by name, this
repo's Triton kernels by their source, leftovers by the CPU region that launched them; the
step's span, busy time (a union over streams) and idle time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.step_profile import newest_traces, our_kernel_names, summarize


def _kernel(name, ts, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"correlation": corr}}


def _launch(ts, corr, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "pid": 9,
            "tid": tid, "args": {"correlation": corr}}


def _region(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "pid": 9, "tid": tid}


def test_our_kernels_come_from_the_source():
    names = our_kernel_names()
    assert names["_push_rows_kernel"] == "dispatcher (mxfp8_ep Triton)"
    assert names["_quantize_kernel"] == "dispatcher (mxfp8_ep Triton)"
    assert names["_rows_kernel"] == "expert activation (mxfp8_ep Triton)"


def test_step_is_split_into_categories(tmp_path: Path):
    events = [
        _region("Optimizer.step#AdamW.step", 500, 100),
        _region("FSDP::all_gather_copy_in", 10, 5, tid=2),
        _launch(0, 1), _kernel("void cutlass::device_kernel<GemmGrouped>", 100, 300, 1),
        # a second stream, overlapping the GEMM: counted in its category, not twice in busy
        _launch(1, 2), _kernel("_push_rows_kernel", 200, 150, 2, stream=8),
        _launch(2, 3), _kernel("ncclDevKernel_SendRecv(x)", 450, 50, 3),
        _launch(510, 4), _kernel("void multi_tensor_apply_kernel<FusedAdam>", 600, 40, 4),
        _launch(12, 5, tid=2), _kernel("void at::native::elementwise_kernel<copy>", 640, 10, 5),
        _launch(3, 6), _kernel("void multi_tensor_apply_kernel<LpNorm>", 700, 20, 6),
        _launch(4, 7), _kernel("nvjet_sm90_tst_256x128", 720, 30, 7),
        _launch(5, 8), _kernel("_rows_kernel", 750, 5, 8),
        _launch(6, 9), _kernel("void at::native::vectorized_elementwise_kernel<add>", 760, 40, 9),
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 800, "dur": 4, "pid": 0, "tid": 7,
         "args": {"correlation": 10}},
    ]
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    p = summarize(path)
    cats = p.categories_ms
    assert cats["expert GEMMs (grouped)"] == pytest.approx(0.300)
    assert cats["dispatcher (mxfp8_ep Triton)"] == pytest.approx(0.150)
    assert cats["NCCL all-to-all"] == pytest.approx(0.050)
    assert cats["optimizer step"] == pytest.approx(0.040)
    assert cats["FSDP copies / casts"] == pytest.approx(0.010)
    assert cats["foreach kernels outside the optimizer (grad norm, clipping)"] == pytest.approx(0.020)
    assert cats["dense GEMMs"] == pytest.approx(0.030)
    assert cats["expert activation (mxfp8_ep Triton)"] == pytest.approx(0.005)
    assert cats["other (elementwise, copies, reductions)"] == pytest.approx(0.044)
    assert p.span_ms == pytest.approx(0.704)  # 100 .. 804 us
    # busy: 100-400 (the push inside the GEMM), 450-500, 600-650, 700-755, 760-804
    busy_us = 300 + 50 + 50 + 55 + 44
    assert p.busy_ms == pytest.approx(busy_us / 1e3)
    assert p.idle_ms == pytest.approx((704 - busy_us) / 1e3)


def test_newest_iteration_and_cpu_only_traces(tmp_path: Path):
    for step in (5, 10):
        d = tmp_path / f"iteration_{step}"
        d.mkdir()
        for r in range(2):
            (d / f"rank{r}_trace.json").write_text(json.dumps({"traceEvents": [_region("x", 0, 1)]}))
    traces = newest_traces(tmp_path)
    assert [t.parent.name for t in traces] == ["iteration_10", "iteration_10"]
    with pytest.raises(ValueError, match="no GPU events"):
        summarize(traces[0])
    with pytest.raises(FileNotFoundError, match="profile_freq"):
        newest_traces(tmp_path / "iteration_5" / "nothing")
