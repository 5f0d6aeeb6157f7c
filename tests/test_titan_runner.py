"""End-to-end: ``launch.titan.runner.run_training`` trains torchtitan's Llama4 and DeepSeek-V3
(tiny flavors) with EP=2 on two gloo processes, logs to an offline wandb run under the run dir,
writes the run's ``RunSummary``, and resumes from its checkpoint with the step count continuing.

Each run takes ~10-20 s on 2 CPU cores (most of it process start-up and torch imports).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from launch.config.schema import (
    A2ASchema,
    LoggingConfig,
    ModelConfig,
    ParallelismConfig,
    TrainConfig,
    TrainingConfig,
)
from launch.launchers.launcher import LauncherConfig
from launch.run.run_summary import RunSummary
from mxfp8_ep.config import PRESETS
from tests.corpus_files import sample_texts, write_corpus

REPO = Path(__file__).resolve().parents[1]
WORLD = 2


def make_cfg(
    family: str,
    *,
    a2a: str = "bf16",
    steps: int = 8,
    wandb_mode: str = "offline",
    checkpoint: bool = False,
    experiment: str = "test_runner",
    **a2a_fields: Any,
) -> Any:
    return OmegaConf.structured(
        TrainConfig(
            model=ModelConfig(name=f"tiny_{family}", family=family, flavor="tiny"),
            parallelism=ParallelismConfig(name="ep2", procs_per_node=WORLD, ep=2, fsdp=-1, tp=1),
            a2a=A2ASchema(name=a2a, **PRESETS[a2a], **a2a_fields),
            launcher=LauncherConfig(name="local"),
            logging=LoggingConfig(
                name=f"wandb_{wandb_mode}", wandb_mode=wandb_mode, tags=["ci", a2a],
                run_name=f"a2a={a2a}",
            ),
            training=TrainingConfig(
                steps=steps,
                seq_len=64,
                local_batch_size=4,
                lr=3e-3,
                warmup_steps=2,
                seed=0,
                checkpoint_enable=checkpoint,
                checkpoint_interval=3,
            ),
            experiment=experiment,
        )
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg_yaml: str, run_dir: str, out: str,
            backward_thread: bool = False) -> None:
    if backward_thread:
        _backward_on_another_thread()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from launch.titan.runner import run_training

    result = run_training(OmegaConf.create(cfg_yaml), run_dir)
    if rank == 0:
        assert result == RunSummary.read(run_dir)  # what it returns is what it wrote
        with open(out, "w") as f:
            json.dump(dataclasses.asdict(result), f)
    else:
        assert result is None


def _backward_on_another_thread() -> None:
    """Every ``Tensor.backward`` of this process runs on another thread, the caller waiting:
    where CUDA runs a backward (its device thread), emulated on the CPU."""
    import torch

    from tests.pool_stack import on_another_thread

    run = torch.Tensor.backward
    torch.Tensor.backward = lambda self, *args, **kwargs: on_another_thread(lambda: run(self, *args, **kwargs))


def train(cfg: Any, run_dir: Path, backward_thread: bool = False) -> dict[str, Any]:
    """``run_training`` on WORLD spawned processes (``backward_thread``: each backward on another
    thread); rank 0's summary."""
    out = run_dir.parent / f"{run_dir.name}.summary.json"
    out.unlink(missing_ok=True)
    mp.start_processes(
        _worker,
        args=(WORLD, _free_port(), OmegaConf.to_yaml(cfg), str(run_dir), str(out), backward_thread),
        nprocs=WORLD,
        join=True,
        start_method="spawn",
    )
    return json.loads(out.read_text())


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def assert_learns(losses: list[float]) -> None:
    assert all(x == x and abs(x) < 1e4 for x in losses), losses  # finite
    head, tail = _mean(losses[:3]), _mean(losses[-3:])
    assert tail < head - 0.1, f"loss did not fall: first-3 mean {head:.3f}, last-3 {tail:.3f}"


def test_llama4_ep2_trains_and_logs_offline_wandb(tmp_path: Path) -> None:
    from launch.run.wandb_offline import find_runs, read_run

    run_dir = tmp_path / "llama4"
    summary = train(make_cfg("llama4", steps=10), run_dir)

    assert summary["steps"] == 10 and summary["target_steps"] == 10 and summary["start_step"] == 0
    assert summary["stopped_by"] is None and summary["checkpoint"] is None
    assert summary["logged_steps"] == list(range(1, 11))
    assert len(summary["losses"]) == 10
    assert_learns(summary["losses"])
    assert summary["final_loss"] == summary["losses"][-1]
    assert summary["tokens_per_s"] > 0
    assert summary["tokens_per_s_global"] == pytest.approx(WORLD * summary["tokens_per_s"])
    assert summary["a2a"] == "bf16" and summary["model_flavor"] == "llama4/tiny"
    assert summary["device"] == "cpu" and summary["ep"] == 2 and summary["world_size"] == WORLD
    # MFU / TFLOPS need an accelerator's peak FLOPS: not on CPU (not the A100 fallback)
    assert summary["tflops"] is None and summary["mfu_pct"] is None
    # where the numbers come from: the recipe's commit, when, where, on what
    from launch.run.provenance import git_commit, host_name

    assert (summary["commit"], summary["dirty"]) == git_commit()[:2]
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
    assert re.fullmatch(stamp, summary["started_at"]) and re.fullmatch(stamp, summary["ended_at"])
    assert summary["started_at"] <= summary["ended_at"]
    assert summary["hosts"] == [host_name()] and (summary["gpu"], summary["gpu_count"]) == ("cpu", WORLD)
    assert summary["stack"]["torchtitan"] and summary["stack"]["torch"]

    runs = find_runs(str(run_dir))
    assert len(runs) == 1, runs
    assert Path(runs[0]).is_relative_to(run_dir / "wandb") and summary["wandb_dirs"] == runs
    run = read_run(runs[0])
    assert run.run_id == summary["wandb_run_id"] and run.name == "a2a=bf16"
    assert run.group == "test_runner" and run.project == "mxfp8-ep"
    assert set(run.tags) == {"ci", "bf16"}
    for key in (
        "loss_metrics/global_avg_loss",
        "grad_norm",
        "throughput(tps)",
        "throughput/global_tps",
        "memory/max_reserved(GiB)",
        "time_metrics/end_to_end(s)",
        "a2a/bytes_per_step",
        "lr",
    ):
        assert len(run.series(key)) == 10, key
    # no estimate from the first window (start-up in its time): from step 2 on
    assert [row["_step"] for row in run.history if "time_metrics/eta(s)" in row] == list(range(2, 11))
    assert not run.series("tflops") and not run.series("mfu(%)")
    assert run.series("loss_metrics/global_avg_loss") == pytest.approx(summary["losses"])
    # One metrics contract: wandb's run summary holds the summary's numbers, not the last step's
    assert run.summary["a2a/bytes_per_step"] == pytest.approx(summary["a2a_bytes_per_step"])
    assert run.summary["throughput/global_tps"] == pytest.approx(summary["tokens_per_s_global"])
    assert run.summary["a2a/bytes_per_step"] != pytest.approx(run.series("a2a/bytes_per_step")[-1])
    # the console lines of rank 0: each stage of starting and ending, one line per logged step
    console = (run_dir / "console.log").read_text().splitlines()
    assert console[:3] == ["start-up: process group, data and model (tiny_llama4, EP 2)", "start-up: wandb (offline)",
                           "start-up: the first step (the slowest: warm-up)"]
    assert [line.split()[1] for line in console[3:-1]] == [f"{n}/10" for n in range(1, 11)]
    assert console[-1] == "finishing: summary.json and wandb"
    assert re.fullmatch(r"step  1/10  loss \d\.\d{4}  tokens/s [\d,]+", console[3])  # no eta yet
    assert re.fullmatch(r"step  2/10  loss \d\.\d{4}  tokens/s [\d,]+  eta \d+s", console[4])
    # The full composed recipe config, not only torchtitan's.
    assert run.config["recipe"]["model"]["family"] == "llama4"
    assert run.config["recipe"]["a2a"]["name"] == "bf16"
    assert run.config["recipe"]["experiment"] == "test_runner"
    assert run.config["torchtitan"]["parallelism"]["expert_parallel_degree"] == 2


def test_deepseek_v3_ep2_resumes_from_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "dsv3"
    first = train(make_cfg("deepseek_v3", steps=6, checkpoint=True, wandb_mode="disabled"), run_dir)
    assert first["steps"] == 6 and first["start_step"] == 0
    ckpt = run_dir / "checkpoint"
    assert (ckpt / "step-3").is_dir() and (ckpt / "step-6").is_dir()
    assert first["checkpoint"] == str(ckpt / "step-6")
    assert not (run_dir / "wandb").exists()  # wandb_mode=disabled

    second = train(make_cfg("deepseek_v3", steps=10, checkpoint=True, wandb_mode="disabled"), run_dir)
    assert second["start_step"] == 6, "did not resume from the step-6 checkpoint"
    assert second["steps"] == 10 and second["checkpoint"] == str(ckpt / "step-10")
    # the run's whole loss curve: the first launch's steps from its summary, then this one's
    assert second["logged_steps"] == list(range(1, 11))
    assert second["losses"][:6] == first["losses"]
    assert (ckpt / "step-10").is_dir()
    assert_learns(second["losses"])


def test_symm_capacity_overflows_replay_to_the_worst_case_losses(tmp_path: Path) -> None:
    """The symm transport at ``capacity_factor=0.5`` (DeepSeek-V3, whose load-balancing expert
    bias a double update would change): the first step's routing overflows half the balanced
    case's capacity, each such step runs again at a grown capacity, and every step's loss and the
    validation loss (its batches overflow too) are bit for bit the worst-case capacity's. A
    resume from the step-3 checkpoint starts at the configured capacity again and grows it again,
    still without a wrong step. With the ceiling at the start (``capacity_ceiling=0.5``) every
    overflow spills: the step reruns with each dispatch at exactly its rows, the losses are the
    worst case's again and the capacity never passes the ceiling."""
    corpus = write_corpus(tmp_path / "corpus", sample_texts(60), sample_texts(20, offset=300))

    def cfg(factor: Any, steps: int = 6, **a2a: Any) -> Any:
        c = make_cfg("deepseek_v3", a2a="mxfp8", steps=steps, checkpoint=True, wandb_mode="disabled",
                     transport="symm", capacity_factor=factor, **a2a)
        c.training.dataset, c.training.dataset_path = "debian_docs", str(corpus)
        c.training.val_every, c.training.val_batches = 3, 2
        return c

    runs = {}
    for factor, name in ((None, "worst"), (0.5, "elastic")):  # 3 steps, then resumed from step 3 to 6
        runs[name] = (train(cfg(factor, steps=3), tmp_path / name), train(cfg(factor), tmp_path / name))
    (worst, worst_resumed), (elastic, resumed) = runs["worst"], runs["elastic"]
    assert worst_resumed["capacity_replays"] == 0 and worst["capacity_rows"] > 0
    assert elastic["capacity_replay_steps"][:1] == [1], elastic["capacity_replay_steps"]
    assert elastic["capacity_rows"] < worst["capacity_rows"], (elastic["capacity_rows"], worst["capacity_rows"])
    console = (tmp_path / "elastic" / "console.log").read_text()
    assert console.startswith("a2a capacity  starts at "), console
    assert "step 1: a symm dispatch needed more expert rows than its capacity" in console
    assert elastic["losses"] == worst["losses"], (elastic["losses"], worst["losses"])
    assert elastic["val_losses"] == worst["val_losses"] and len(worst["val_losses"]) == 1, (elastic, worst)
    assert resumed["start_step"] == 3
    assert resumed["losses"] == worst_resumed["losses"], (resumed["losses"], worst_resumed["losses"])
    assert resumed["val_losses"] == worst_resumed["val_losses"]
    # The capacity starts over after the resume: the first step after it grows it again.
    assert resumed["capacity_replay_steps"][:len(elastic["capacity_replay_steps"]) + 1] == (
        elastic["capacity_replay_steps"] + [4]), resumed["capacity_replay_steps"]
    assert resumed["capacity_replays"] == len(resumed["capacity_replay_steps"])

    spilled = train(cfg(0.5, steps=3, capacity_ceiling=0.5), tmp_path / "spill")
    assert spilled["losses"] == worst["losses"] and spilled["val_losses"] == worst["val_losses"], spilled
    assert spilled["capacity_spills"] >= 1 and spilled["capacity_spill_steps"][0] == 1, spilled
    assert spilled["capacity_rows"] == spilled["capacity_ceiling_rows"] < worst["capacity_rows"], spilled
    assert "more rows were needed than a ceiling allows (a dispatch needed" in (
        tmp_path / "spill" / "console.log").read_text()


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_symm_under_activation_checkpointing_with_the_backward_on_another_thread_trains_as_the_worst_case(
        tmp_path: Path, checkpointing: str) -> None:
    """The recipe's activation checkpointing with the symm transport, each backward on another
    thread as CUDA runs it (its recomputes outside the training thread's replay scope): at
    ``capacity_factor=0.5`` with the activation pool the first steps overflow and replay, and
    every loss is bit for bit the worst case's (``capacity_factor=None``, no pool)."""

    def cfg(**a2a: Any) -> Any:
        c = make_cfg("deepseek_v3", a2a="mxfp8", steps=4, wandb_mode="disabled", transport="symm", **a2a)
        c.training.activation_checkpoint = checkpointing
        return c

    worst = train(cfg(capacity_factor=None, activation_pool_factor=None), tmp_path / "worst", backward_thread=True)
    elastic = train(cfg(capacity_factor=0.5), tmp_path / "elastic", backward_thread=True)
    assert elastic["capacity_replays"] >= 1 and worst["capacity_replays"] == 0, (elastic, worst)
    assert elastic["losses"] == worst["losses"], (elastic["losses"], worst["losses"])


@pytest.mark.parametrize("family", ["llama4", "deepseek_v3"])
def test_mxfp8_a2a_config_trains(tmp_path: Path, family: str) -> None:
    from benchmarks.train import newest_traces, summarize

    cfg = make_cfg(family, a2a="mxfp8", steps=6, wandb_mode="disabled")
    cfg.training.profile_freq = 5  # torchtitan's profiler: 3 warm-up steps, then step 5 traced
    summary = train(cfg, tmp_path / family)
    traces = newest_traces(tmp_path / family / "profile_traces")
    assert [t.relative_to(tmp_path / family).as_posix() for t in traces] == [
        f"profile_traces/iteration_5/rank{r}_trace.json" for r in range(WORLD)
    ]
    with pytest.raises(ValueError, match="no GPU events"):  # a CPU run's traces have only CPU ops
        summarize(traces[0])
    assert summary["a2a"] == "mxfp8"
    assert summary["steps"] == 6
    losses = summary["losses"]
    assert all(x == x and abs(x) < 1e4 for x in losses), losses
    assert _mean(losses[-2:]) < losses[0]
    legs = summary["a2a_bytes_per_step_by_leg"]
    # Rows cross the EP boundary both ways, the same rows: the forward as MXFP8 (1 byte + 1/32
    # scale byte per element), its gradient as bf16 (2 bytes).
    assert legs.get("dispatch_fwd", 0) > 0 and legs.get("dispatch_bwd", 0) > 0, legs
    assert legs["dispatch_fwd"] == pytest.approx(legs["dispatch_bwd"] * 33 / 64, rel=1e-6), legs


@pytest.mark.parametrize("freq", [0, 7])
def test_profile_freq_turns_on_torchtitans_profiler(freq, tmp_path: Path) -> None:
    from launch.config.schema import PROFILER_WARMUP_STEPS
    from launch.titan.runner import build_job_config

    cfg = make_cfg("deepseek_v3")
    cfg.training.profile_freq = freq
    jc = build_job_config(cfg, str(tmp_path))
    assert jc.profiling.enable_profiling is (freq > 0)
    if freq:
        assert jc.profiling.profile_freq == freq and jc.profiling.profiler_active == 1
        assert jc.profiling.profiler_warmup == PROFILER_WARMUP_STEPS
        assert jc.job.dump_folder == str(tmp_path)  # traces land in <run dir>/profile_traces


@pytest.mark.parametrize("policy", ["default", "never"])
def test_fsdp_reshard_policy_reaches_torchtitan(policy, tmp_path: Path) -> None:
    from launch.titan.runner import build_job_config

    cfg = make_cfg("deepseek_v3")
    cfg.parallelism.fsdp_reshard_after_forward = policy
    assert build_job_config(cfg, str(tmp_path)).parallelism.fsdp_reshard_after_forward == policy


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mixed_precision_param_reaches_torchtitan(dtype, tmp_path: Path) -> None:
    from launch.titan.runner import build_job_config

    cfg = make_cfg("deepseek_v3")
    cfg.training.mixed_precision_param = dtype
    assert build_job_config(cfg, str(tmp_path)).training.mixed_precision_param == dtype


@pytest.mark.parametrize("overlap", [False, True])
def test_install_dispatcher_takes_a2a_tokens_and_shared_expert_overlap_from_the_config(overlap, monkeypatch):
    import mxfp8_ep
    from launch.titan.runner import install_dispatcher
    from mxfp8_ep.config import A2AConfig

    seen: dict = {}
    monkeypatch.setattr(mxfp8_ep, "install_expert_parallel", lambda a2a, **kw: seen.update(a2a=a2a, **kw))
    cfg = make_cfg("deepseek_v3", a2a="mxfp8")
    cfg.parallelism.overlap_shared_experts = overlap
    install_dispatcher(cfg)
    assert seen["a2a"] == A2AConfig.preset("mxfp8")
    assert seen["max_tokens_per_rank"] == 4 * 64  # local batch x seq len
    assert seen["overlap_shared_experts"] is overlap


def test_trainer_runs_the_synced_input_checks_for_its_first_steps(monkeypatch):
    """The dispatcher's debug mode (checks that need a host sync) is on for the first
    CHECKED_STEPS steps of a run, also of a resumed one, then off (the environment decides)."""
    from types import SimpleNamespace

    from launch.titan.runner import CHECKED_STEPS, RecipeTrainer
    from mxfp8_ep.dispatcher import checks

    monkeypatch.delenv(checks.DEBUG_ENV, raising=False)
    try:
        for start in (0, 40):  # a fresh run, a run resumed at step 40
            on = []
            for step in range(start, start + CHECKED_STEPS + 3):  # the step before each asks
                RecipeTrainer._set_input_checks(SimpleNamespace(step=step, start_step=start))
                on.append(checks.debug_mode())
            assert on == [True] * CHECKED_STEPS + [False] * 3, start
    finally:
        checks.set_debug(None)


def _lr_schedulers(job_config: Any, optimizer: Any) -> Any:
    """The installed torchtitan's learning-rate schedulers, built as its trainer builds them."""
    from launch.config.stack import installed_torchtitan

    if installed_torchtitan() == "0.2.2":
        from torchtitan.components.lr_scheduler import build_lr_schedulers

        return build_lr_schedulers([optimizer], job_config.lr_scheduler, job_config.training.steps)
    return job_config.lr_scheduler.build(optimizers=[optimizer], training_steps=job_config.training.steps)


def test_the_learning_rate_schedule_spans_the_runs_length_not_the_launchs(tmp_path: Path) -> None:
    """A resumed run that stops earlier (training.steps=90 of a 300-step run) keeps the learning
    rate of its 300-step schedule: torchtitan's decay runs over lr_scheduler.total_steps."""
    import torch

    from launch.titan.runner import build_job_config

    def lr_at(steps: int, schedule: Any, step: int) -> float:
        cfg = make_cfg("deepseek_v3", steps=steps)
        cfg.training.lr_schedule_steps = schedule
        jc = build_job_config(cfg, str(tmp_path))
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(cfg.training.lr))
        sched = _lr_schedulers(jc, opt).schedulers[0]
        for _ in range(step):
            opt.step()
            sched.step()
        return sched.get_last_lr()[0]

    run = lr_at(300, 300, 82)
    assert lr_at(90, 300, 82) == pytest.approx(run)  # the run's schedule, stopped earlier
    assert lr_at(90, 90, 82) < run / 5  # the schedule stretched to this launch: what a resume must not do
    assert lr_at(300, None, 82) == pytest.approx(run)  # none given: training.steps


WRITE_KILLED_LAUNCH = """
import sys, wandb
from launch.run import run_summary as names
wandb.init(project="p", dir=sys.argv[1], id="r1", config={"recipe": {}})
for step, (replays, spills) in enumerate([(2, 1), (2, 1), (3, 1), (3, 1), (5, 2), (5, 2)], start=1):
    wandb.log({names.LOSS: 5.0, names.A2A_CAPACITY_ROWS: 64, names.A2A_REPLAYS: replays,
               names.A2A_SPILLS: spills}, step=step)
wandb.finish()
"""


def test_a_resume_counts_the_replays_of_a_launch_killed_before_its_summary(tmp_path: Path) -> None:
    """A launch that ran again steps 1 (twice, one a spill), 3 and 5 (twice, one a spill) was
    killed after step 6 before its summary; resumed from its step-4 checkpoint, the run's replays
    up to the checkpoint come from its wandb history: steps 1, 1 and 3, spilled at 1."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from launch.titan.recipe_trainer import RecipeTrainerMixin

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")},
           "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(REPO)}
    (tmp_path / "wandb").mkdir()
    subprocess.run([sys.executable, "-c", WRITE_KILLED_LAUNCH, str(tmp_path)], check=True, env=env, timeout=120)

    class Loaded:  # torchtitan's part: the checkpoint's step
        def load_state_dict(self, state_dict: dict) -> None:
            self.step = state_dict["step"]

    class Trainer(RecipeTrainerMixin, Loaded):
        pass

    trainer = object.__new__(Trainer)  # what load_state_dict reads of a built trainer
    trainer.run_dir = str(tmp_path)
    trainer.metrics_processor = SimpleNamespace(start_at=lambda step: None)
    trainer.load_state_dict({"step": 4})
    assert (trainer.earlier_replay_steps, trainer.earlier_spill_steps) == ([1, 1, 3], [1])
    assert (trainer.capacity_replays, trainer.capacity_spills) == (3, 1)
    assert (trainer.metrics_processor.capacity_replays, trainer.metrics_processor.capacity_spills) == (3, 1)
