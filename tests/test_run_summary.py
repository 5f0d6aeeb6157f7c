"""launch/run/run_summary.py: a run's headline throughput, step time and bytes per step are totals
over its steady log windows, so tokens/s and step time agree however uneven the windows are."""

from __future__ import annotations

import pytest

from launch.run import run_summary as names
from launch.run.console import format_summary
from launch.run.run_summary import RunSummary, steady_numbers
from launch.run.shared_gpu import SHARED_GPU_NOTE, gpu_shared
from launch.run.wandb_offline import OfflineRun

WORLD, TOKENS_PER_RANK_STEP = 2, 256
# (last step of the window, step time of the window, a2a bytes per step): windows of 1, 1, 3, 1
# and 4 steps, the first one slow (warm-up), the others uneven as on a shared CPU.
WINDOWS = [(1, 2.0, 900.0), (2, 0.1, 1000.0), (5, 0.3, 1200.0), (6, 0.1, 1000.0), (10, 0.2, 800.0)]
FLOPS_PER_TOKEN = 1e9
PEAK_FLOPS = 1e12


def logged_rows() -> list[dict]:
    """The wandb rows RecipeMetricsProcessor.log writes for WINDOWS (loss left out)."""
    rows = []
    for step, step_time, nbytes in WINDOWS:
        tps = TOKENS_PER_RANK_STEP / step_time  # per rank, as torchtitan's throughput(tps)
        rows.append({"_step": step, names.LOSS: 5.0, names.TOKENS_PER_S: tps,
                     names.TOKENS_PER_S_GLOBAL: WORLD * tps, names.STEP_TIME: step_time,
                     names.TFLOPS: FLOPS_PER_TOKEN * tps / 1e12, names.MFU: 100 * FLOPS_PER_TOKEN * tps / PEAK_FLOPS,
                     names.A2A_BYTES: nbytes, names.a2a_leg_metric("dispatch_fwd"): nbytes / 2})
    return rows


def expected() -> dict:
    steady = WINDOWS[1:]
    steps = [s - before for (s, _, _), (before, _, _) in zip(steady, WINDOWS)]
    seconds = sum(t * n for (_, t, _), n in zip(steady, steps))
    tokens = WORLD * TOKENS_PER_RANK_STEP * sum(steps)
    per_rank = tokens / WORLD / seconds
    return {"tokens_per_s_global": tokens / seconds, "tokens_per_s": per_rank,
            "step_time_s": seconds / sum(steps),
            "a2a_bytes_per_step": sum(b * n for (_, _, b), n in zip(steady, steps)) / sum(steps),
            "tflops": FLOPS_PER_TOKEN * per_rank / 1e12, "mfu_pct": 100 * FLOPS_PER_TOKEN * per_rank / PEAK_FLOPS,
            "steady_steps": sum(steps)}


def from_wandb(share_gpu: bool | None = None, device: str = "cuda") -> RunSummary:
    run = OfflineRun(path="/r", run_id="x", name="a2a=bf16", history=logged_rows(), config={"device": device})
    parallelism = {"nodes": 1, "procs_per_node": WORLD, "ep": WORLD}
    if share_gpu is not None:
        parallelism["share_gpu"] = share_gpu
    recipe = {"parallelism": parallelism, "a2a": {"name": "bf16"}}
    return RunSummary.from_wandb(run, recipe, "/r")


def test_a_run_whose_ranks_shared_one_gpu_says_so(tmp_path):
    """parallelism.share_gpu on CUDA with several ranks: the summary says the GPU was shared (also
    read back from wandb and from summary.json) and the console marks its tokens/s; on CPU, or
    without the option (older runs), it was not."""
    assert gpu_shared(True, "cuda", 2) and not gpu_shared(True, "cuda", 1)
    assert not gpu_shared(True, "cpu", 2) and not gpu_shared(False, "cuda", 2)
    shared = from_wandb(share_gpu=True)
    assert shared.gpu_shared
    assert not from_wandb(share_gpu=True, device="cpu").gpu_shared
    assert not from_wandb().gpu_shared and not from_wandb(share_gpu=False).gpu_shared
    shared.write(tmp_path)
    assert RunSummary.read(tmp_path).gpu_shared
    assert SHARED_GPU_NOTE in format_summary(shared) and SHARED_GPU_NOTE not in format_summary(from_wandb())


def test_uneven_windows_give_total_tokens_over_total_time():
    s = from_wandb()
    want = expected()
    for name, value in want.items():
        assert getattr(s, name) == pytest.approx(value), name
    # tokens/s and step time agree: their product is the tokens of one step of all ranks
    assert s.tokens_per_s_global * s.step_time_s == pytest.approx(WORLD * TOKENS_PER_RANK_STEP)
    # a mean of the windows' rates would be far off here (3,627 tokens/s of one rank, not 2,425)
    mean_of_rates = sum(TOKENS_PER_RANK_STEP / t for _, t, _ in WINDOWS[1:]) / (len(WINDOWS) - 1)
    assert abs(s.tokens_per_s / mean_of_rates - 1) > 0.3
    assert s.a2a_bytes_per_step_by_leg == {"dispatch_fwd": pytest.approx(want["a2a_bytes_per_step"] / 2)}


def test_the_runners_windows_give_the_same_numbers_as_wandb():
    """RecipeMetricsProcessor keeps each window's steps beside its logged metrics; the runner's
    summary.json and a summary read back from wandb come out the same."""
    windows, last = [], 0
    for row in logged_rows():
        windows.append({names.WINDOW_STEPS: row["_step"] - last,
                        **{k: v for k, v in row.items() if k in names.SUMMARY_METRICS}})
        last = row["_step"]
    runner = steady_numbers(windows)
    read_back = from_wandb()
    for name, value in runner.items():
        assert getattr(read_back, name) == pytest.approx(value), name
    # wandb's run summary gets the same numbers under the logged names
    summary = RunSummary(**{**vars(read_back)}).wandb_summary()
    assert summary[names.TOKENS_PER_S_GLOBAL] == pytest.approx(runner["tokens_per_s_global"])
    assert summary[names.STEP_TIME] == pytest.approx(runner["step_time_s"])


def test_a_single_window_counts_and_cpu_runs_have_no_flops():
    out = steady_numbers([{names.WINDOW_STEPS: 4, names.STEP_TIME: 0.5, names.TOKENS_PER_S_GLOBAL: 1024.0}])
    assert out["tokens_per_s_global"] == 1024.0 and out["step_time_s"] == 0.5 and out["steady_steps"] == 4
    assert out["tflops"] is None and out["mfu_pct"] is None and out["a2a_bytes_per_step_by_leg"] == {}
    assert steady_numbers([])["tokens_per_s_global"] is None


def test_console_prints_what_the_numbers_are_over():
    s = from_wandb()
    text = format_summary(s)
    assert f"tokens/s        {s.tokens_per_s_global:,.0f} all ranks, {s.tokens_per_s:,.0f} per rank" in text
    assert "last 9 steps" in text
    assert f"step time (s)   {s.step_time_s:.4f}" in text


def test_console_and_wandb_summary_keep_the_capacity_replays():
    s = from_wandb()
    assert "a2a capacity" not in format_summary(s)  # no symm buffers: nothing to say
    assert names.A2A_REPLAYS not in s.wandb_summary()
    s.capacity_rows, s.capacity_replays, s.capacity_replay_steps = 88_064, 2, [1, 7]
    assert "a2a capacity    88,064 expert rows, 2 steps run again to grow it (1, 7)" in format_summary(s)
    assert s.wandb_summary()[names.A2A_REPLAYS] == 2 and s.wandb_summary()[names.A2A_CAPACITY_ROWS] == 88_064


def test_a_summary_read_back_from_wandb_has_the_replay_and_spill_steps():
    """The steps the elastic capacity ran again (and spilled) come back from the totals each row
    logs: a step once per replay, as the runner's summary lists them."""
    totals = {1: (2, 1), 2: (2, 1), 3: (3, 1), 4: (3, 1), 5: (5, 2), 6: (5, 2)}  # step: (replays, spills)
    rows = [{"_step": step, names.LOSS: 5.0, names.A2A_CAPACITY_ROWS: 64 * step, names.A2A_REPLAYS: replays,
             names.A2A_SPILLS: spills} for step, (replays, spills) in totals.items()]
    s = RunSummary.from_wandb(OfflineRun(path="/r", run_id="x", name="n", history=rows, config={}), {}, "/r")
    assert (s.capacity_replays, s.capacity_replay_steps) == (5, [1, 1, 3, 5, 5])
    assert (s.capacity_spills, s.capacity_spill_steps) == (2, [1, 5])
    assert s.capacity_rows == 64 * 6
    assert from_wandb().capacity_replay_steps == [] and from_wandb().capacity_rows is None  # no symm capacity
