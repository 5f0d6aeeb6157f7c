"""``benchmarks/train.py``: finished training runs become rows with their ratios to the baseline
arm of the same model; one step's profile (a hand-made Chrome trace): kernels sorted by name,
this repo's Triton kernels by their source, leftovers by the CPU region that launched them; the
step's span, busy time (a union over streams) and idle time; the numerics telemetry's cost: the
arms in turn (off, on, off, on), a row per run with its provenance, and the comparison row from
the runs' own step times. The recipe runs are stood in for there (a run with the telemetry on is
tested in tests/test_numerics_recipe.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from benchmarks import train
from benchmarks.rows import OPTIONAL_PROVENANCE_KEYS, read_rows
from benchmarks.train import main, newest_traces, our_kernel_names, summarize
from launch.run.run_summary import RunSummary


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


def _run(root: Path, name: str, a2a: str, transport: str, tps: float, loss: float, overlap: bool = False,
         model: str = "dsv3_ep_bench", gpu_shared: bool = False) -> Path:
    """A finished run dir: its summary.json and train_config.yaml, as launch/train.py leaves them."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    RunSummary(run_name=name, experiment="bench", a2a=a2a, a2a_legs={"transport": transport}, model=model,
               model_flavor="deepseek_v3/ep_bench", parallelism="ep2", world_size=2, ep=2, launcher="local",
               device="cuda", run_dir=str(run_dir), steps=50, target_steps=50, final_loss=loss,
               tokens_per_s_global=tps, tokens_per_s=tps / 2, step_time_s=16384 / tps,
               a2a_bytes_per_step=1e9, gpu_shared=gpu_shared).write(run_dir)
    config = {"parallelism": {"overlap_shared_experts": overlap}, "training": {"seq_len": 4096, "local_batch_size": 2}}
    (run_dir / "train_config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


def test_runs_become_rows_with_ratios_to_the_baseline_arm(tmp_path: Path, monkeypatch):
    runs = tmp_path / "runs"
    _run(runs, "a", "bf16", "nccl", 40000.0, 1.10)
    _run(runs / "symm", "b", "mxfp8", "symm", 48000.0, 1.12)
    _run(runs / "symm", "c", "mxfp8_all", "nccl", 50000.0, 1.08, overlap=True)
    _run(runs, "d", "mxfp8", "auto", 10000.0, 2.0, model="tiny_dsv3")  # no baseline run of its model
    monkeypatch.setenv("MXFP8EP_BENCH_COMMAND", "python3 launch/train.py ... && python3 -m benchmarks.train ...")
    main([str(runs), "--out", str(tmp_path / "out"), "--bench", "train_shm", "--link", "shm"])
    (path,) = (tmp_path / "out").glob("*_train_shm.jsonl")
    rows = {r["arm"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert set(rows) == {"bf16/nccl", "mxfp8/symm", "mxfp8_all/nccl:overlap", "mxfp8/auto"}
    assert rows["bf16/nccl"]["speedup_vs_bf16_nccl"] == 1.0 and rows["bf16/nccl"]["loss_delta_vs_bf16_nccl"] == 0.0
    assert rows["mxfp8/symm"]["speedup_vs_bf16_nccl"] == 1.2
    assert rows["mxfp8_all/nccl:overlap"]["speedup_vs_bf16_nccl"] == 1.25
    assert rows["mxfp8_all/nccl:overlap"]["loss_delta_vs_bf16_nccl"] == pytest.approx(-0.02)
    assert rows["mxfp8/auto"]["speedup_vs_bf16_nccl"] is None
    r = rows["mxfp8/symm"]
    assert (r["model"], r["tokens_per_s"], r["seq_len"], r["local_batch_size"], r["ep"]) == (
        "dsv3_ep_bench", 48000.0, 4096, 2, 2)
    assert r["bench"] == "train_shm" and r["machine"]["link"] == "nccl-shm" and r["machine"]["count"] == 2
    assert r["command"].startswith("python3 launch/train.py")


def test_runs_whose_ranks_shared_a_gpu_are_flagged_and_get_no_speedup(tmp_path: Path):
    runs = tmp_path / "runs"
    _run(runs, "a", "bf16", "symm", 40000.0, 1.10, gpu_shared=True)
    _run(runs, "b", "mxfp8", "symm", 48000.0, 1.12, gpu_shared=True)
    main([str(runs), "--out", str(tmp_path / "out"), "--bench", "train", "--baseline", "bf16/symm"])
    (path,) = (tmp_path / "out").glob("*_train.jsonl")
    rows = {r["arm"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert rows["mxfp8/symm"]["gpu_shared"] is True and rows["mxfp8/symm"]["speedup_vs_bf16_symm"] is None
    assert rows["bf16/symm"]["gpu_shared"] is True
    assert rows["mxfp8/symm"]["loss_delta_vs_bf16_symm"] == pytest.approx(0.02)


def test_step_profiles_become_a_row_per_rank(tmp_path: Path):
    run_dir = _run(tmp_path / "runs", "bf16_symm", "bf16", "symm", 40000.0, 1.1)
    for rank in range(2):
        trace = run_dir / "profile_traces" / "iteration_10" / f"rank{rank}_trace.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        events = [_launch(0, 1), _kernel("nvjet_sm90_tst_256x128", 100, 300 + 100 * rank, 1)]
        trace.write_text(json.dumps({"traceEvents": events}))
    main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--step-profile"])
    (path,) = (tmp_path / "out").glob("*_step_profile.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["arm"], r["rank"], r["iteration"]) for r in rows] == [("bf16/symm", 0, 10), ("bf16/symm", 1, 10)]
    assert [r["categories_ms"] for r in rows] == [{"dense GEMMs": 0.3}, {"dense GEMMs": 0.4}]


def test_no_finished_runs_is_an_error(tmp_path: Path):
    with pytest.raises(SystemExit, match="no finished runs"):
        main([str(tmp_path), "--out", str(tmp_path / "out")])


def fields(row: dict) -> list[str]:
    """A row's keys in order, less those only some rows' provenance has."""
    return [k for k in row if k not in OPTIONAL_PROVENANCE_KEYS]


def _fake_launch(step_times: dict[int, list[float]], launched: list, returncode: int = 0,
                 steady_steps: dict[int, list[int]] | None = None):
    """``launch_run`` without training: each run leaves a summary.json with the next step time
    (and steady steps) of its ``logging.numerics_every``."""
    def launch_run(overrides, run_dir):
        every = int(overrides[-1].removeprefix("logging.numerics_every="))
        launched.append((overrides, run_dir.name))
        run_dir.mkdir(parents=True)
        if returncode == 0:
            nth = sum(1 for o, _ in launched if o[-1] == overrides[-1]) - 1
            step_time = step_times[every][nth]
            RunSummary(run_name="r", experiment="e", a2a="mxfp8", a2a_legs={}, model="m", model_flavor="f",
                       parallelism="single", world_size=1, ep=1, launcher="local", device="cpu",
                       run_dir=str(run_dir), steps=10, target_steps=10, step_time_s=step_time,
                       tokens_per_s=1000.0 / step_time, tokens_per_s_global=1000.0 / step_time,
                       final_loss=2.5, steady_steps=steady_steps[every][nth] if steady_steps else None,
                       ).write(run_dir)
        return subprocess.CompletedProcess(["train.py", *overrides], returncode, "out", "err")

    return launch_run


def test_numerics_arms_in_turn_and_the_overhead_of_their_means(tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr(train, "launch_run", _fake_launch({0: [1.0, 1.2], 5: [1.05, 1.21]}, launched))
    row = main(["--numerics-every", "5", "--repeats", "2", "--out", str(tmp_path), "--", "a2a=mxfp8"])
    assert [(o, name) for o, name in launched] == [
        (["a2a=mxfp8", f"logging.numerics_every={e}"], f"numerics_every_{e}_{r}") for r in (0, 1) for e in (0, 5)]
    (path,) = tmp_path.glob("*_cpux1_numerics_overhead.jsonl")
    rows = read_rows(tmp_path)
    assert [r["arm"] for r in rows] == ["off", "on", "off", "on", "on_vs_off"]
    assert all(r["bench"] == "numerics_overhead" and r["overrides"] == ["a2a=mxfp8"] for r in rows)
    assert row == rows[-1] and row["overhead_pct"] == pytest.approx(100 * (1.13 / 1.1 - 1))
    assert rows[1]["step_time_s"] == 1.05 and rows[1]["numerics_every"] == 5 and rows[1]["repeat"] == 0
    # the fields benchmarks/report.py and claims.yaml read, as the committed rows have them
    committed = read_rows(Path(train.REPO, "benchmarks/results/2026-12-02_616998e_h200x1_numerics_overhead.jsonl"))
    # (less the keys a row has only where its provenance needs them: dirty_reason without git)
    assert [fields(r) for r in rows] == [fields(r) for r in committed]
    assert rows[1]["tokens_per_s"] == pytest.approx(1000.0 / 1.05) and rows[1]["final_loss"] == 2.5
    assert rows[1]["run_dir"].endswith("numerics_every_5_0") and Path(rows[1]["run_dir"]).is_dir()
    assert (row["step_times_off"], row["step_times_on"], row["repeats"]) == ([1.0, 1.2], [1.05, 1.21], 2)


def test_runs_of_unequal_length_weigh_by_their_steps(tmp_path, monkeypatch):
    """Each arm's step time is its runs' seconds over their steps, not the mean of their step times."""
    monkeypatch.setattr(train, "launch_run", _fake_launch({0: [1.0, 2.0], 5: [1.0, 1.0]}, [],
                                                          steady_steps={0: [30, 10], 5: [20, 20]}))
    row = main(["--numerics-every", "5", "--repeats", "2", "--out", str(tmp_path), "--", "a2a=mxfp8"])
    off = (1.0 * 30 + 2.0 * 10) / 40
    assert row["step_time_s_off"] == pytest.approx(off) and row["step_time_s_on"] == pytest.approx(1.0)
    assert row["overhead_pct"] == pytest.approx(100 * (1.0 / off - 1))


def test_a_failed_numerics_run_stops_with_its_output(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "launch_run", _fake_launch({}, [], returncode=1))
    with pytest.raises(SystemExit, match=r"logging.numerics_every=0 failed \(1\):\nout\nerr"):
        main(["--numerics-every", "5", "--out", str(tmp_path), "--", "a2a=mxfp8"])
    assert not list(tmp_path.glob("*.jsonl"))


@pytest.mark.parametrize("argv", [["--numerics-every", "0"], ["--numerics-every", "5", "--repeats", "0"],
                                  ["--numerics-every", "5", "--step-profile"], ["RUNS", "--repeats", "2"], []])
def test_numerics_and_run_options_that_do_not_fit(argv, tmp_path):
    with pytest.raises(SystemExit):
        main([*argv, "--out", str(tmp_path)])
