"""launch/run/console.py and launch/run/heartbeat.py: what a run prints and records. The local launcher
end to end with a stand-in trainer (tests/console_runner.py): the console shows this launch's
lines only, console.log keeps every launch's, train.log records the launch; the summary names
each long path once; the heartbeat while a step runs long. The real trainer's console is in
test_train_e2e.py."""

from __future__ import annotations

import re
import threading

from tests.train_cli import run_train

from launch.run.console import format_summary
from launch.run.heartbeat import StepHeartbeat, append_line
from launch.run.run_summary import RunSummary

STAND_IN = "tests.console_runner:run_training"


def test_a_resumed_run_prints_its_own_lines_and_keeps_every_launchs(tmp_path):
    run = tmp_path / "run"
    first = run_train(tmp_path, "training.steps=3", "training.lr_schedule_steps=5", "logging=none",
                      "training.checkpoint_enable=true",
                      f"hydra.run.dir={run}", MXFP8EP_RUNNER=STAND_IN, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stand-in step 3/3" in first.stdout
    (run / "checkpoint" / "step-3").mkdir(parents=True)
    (run / "checkpoint" / "step-3" / ".metadata").write_text("")

    resumed = run_train(tmp_path, f"training.resume={run}", "training.steps=5", MXFP8EP_RUNNER=STAND_IN,
                        timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    printed = [line for line in resumed.stdout.splitlines() if line.startswith("stand-in")]
    assert printed == [f"stand-in step {s}/5" for s in range(1, 6)]  # not the first launch's again
    # console.log: what the console showed, launch after launch (the header, the lines, the
    # summary), each launch's end below it
    lines = (run / "console.log").read_text().splitlines()
    resume = next(i for i, line in enumerate(lines) if line.startswith("==== resume 1 ("))
    assert lines[:resume - 1] == first.stdout.splitlines()
    assert lines[0].startswith("mxfp8ep: model=tiny_llama4 ") and "  steps           3/3" in lines
    assert lines[3:8] == ["start-up: starting 2 CPU processes (gloo)",
                          "start-up: 2 processes started, importing torchtitan"] + [
                          f"stand-in step {s}/3" for s in range(1, 4)]
    assert re.fullmatch(r"==== ended \S+ \S+: completed step 3/3 ====", lines[resume - 1])  # how it ended
    assert lines[resume + 1:-1] == resumed.stdout.splitlines()[1:]  # below the "resuming" line
    assert lines[-1].endswith(": completed step 5/5 ====")

    # train.log: what the launching process did, every launch (it was empty after a clean run)
    log = (run / "train.log").read_text()
    assert log.count("launch: ") == 2 and "a new run in" in log and "resuming" in log
    assert "starting 2 CPU processes (gloo)" in log and "every process exited cleanly" in log
    assert "torch.distributed.elastic" in log  # the agent starting and watching the workers
    assert log.count("ended: step ") == 2


def _summary(run_dir: str, mode: str, dirs: list[str]) -> RunSummary:
    return RunSummary(run_name="a2a=bf16", experiment="default", a2a="bf16", a2a_legs={}, model="tiny_llama4",
                      model_flavor="llama4/tiny", parallelism="ep2", world_size=2, ep=2, launcher="local",
                      device="cpu", run_dir=run_dir, steps=110, target_steps=110, start_step=100,
                      wandb_mode=mode, wandb_dirs=dirs)


def test_the_summary_names_each_long_path_once(tmp_path):
    run = str(tmp_path / "outputs" / "default" / ("2026-12-02_13-26-46_a2a=bf16,model=tiny_dsv3," + "x" * 60))
    dirs = [f"{run}/wandb/offline-run-20261202_13265{i}-d3e5b708" for i in (5, 9)]  # a resumed run
    text = format_summary(_summary(run, "offline", dirs))
    assert text.count(run) == 2  # the run dir, and the upload command
    assert (f"  wandb (offline)  wandb/offline-run-20261202_132655-d3e5b708, "
            f"wandb/offline-run-20261202_132659-d3e5b708 (in the run dir)\n"
            f"    upload later with: wandb sync {run}/wandb/offline-run-*") in text
    online = format_summary(_summary(run, "online", [f"{run}/wandb/run-20261202_132655-d3e5b708"]))
    assert online.count(run) == 1 and "wandb/run-20261202_132655-d3e5b708 (in the run dir)" in online


def test_the_summary_names_the_transport_and_the_bytes_between_nodes(tmp_path):
    """The transport the EP layers ran (``auto`` resolved) beside the a2a preset, and the part
    of the bytes that crossed between nodes where a transport counted one (two_hop)."""
    s = _summary(str(tmp_path), "disabled", [])
    s.a2a_bytes_per_step = 1000.0
    lines = format_summary(s).splitlines()
    assert lines[1].startswith("  model tiny_llama4  a2a bf16  parallelism ep2") and "  a2a bytes/step  1,000" in lines
    s.transport, s.a2a_bytes_per_step_by_leg = "two_hop", {"dispatch_fwd": 1000.0, "inter_node": 400.0}
    lines = format_summary(s).splitlines()
    assert lines[1].startswith("  model tiny_llama4  a2a bf16 over two_hop  parallelism ep2 (world 2, ep 2)"), lines
    assert "  a2a bytes/step  1,000, 400 of them between nodes" in lines


def test_the_heartbeat_says_which_step_still_runs(tmp_path):
    console = tmp_path / "console.log"
    console.write_text("step 1/20  loss 6.8\n")
    written = append_line(str(console))
    beats = threading.Event()

    def write(line: str) -> None:
        written(line)
        if console.read_text().count("still running") >= 2:
            beats.set()

    heartbeat = StepHeartbeat(write, steps=20, every_s=0.05)
    with heartbeat.step(2):
        assert beats.wait(timeout=60), console.read_text()  # the step runs until two beats came
    heartbeat.close()
    lines = console.read_text().splitlines()
    assert lines[0] == "step 1/20  loss 6.8"
    assert lines[1].startswith("step  2/20  still running (0s so far; stuck? see docs/usage.md#")
    assert all(line.startswith("step  2/20  still running") for line in lines[1:])

    quiet = tmp_path / "quiet.log"
    heartbeat = StepHeartbeat(append_line(str(quiet)), steps=20, every_s=3600)
    with heartbeat.step(1):  # a step shorter than the interval: nothing to say
        pass
    heartbeat.close()
    assert not quiet.exists()


def test_a_resumed_runs_banner_names_the_resume_beside_the_runs_name(tmp_path):
    """The run keeps its first launch's name (its wandb run's); the banner says which resume this
    is and what it changed, so 'training.steps=300' in the name does not read as this launch's."""
    from launch.run.resume import Resume

    s = _summary(str(tmp_path), "disabled", [])
    s.run_name = "a2a=bf16,training.steps=300"
    resume = Resume(str(tmp_path), str(tmp_path), step=100, changed=["training.steps=110"], number=1)
    assert format_summary(s, resume).splitlines()[0] == (
        "==== mxfp8ep run a2a=bf16,training.steps=300, resume 1: training.steps=110 ====")
    assert format_summary(s).splitlines()[0] == "==== mxfp8ep run a2a=bf16,training.steps=300 ===="


def test_a_sweep_says_a_warning_its_points_share_once(tmp_path):
    """Every point of the sweep warns alike (here the warm-up; on SLURM without checkpoints, the
    requeue that starts again from step 0): the sweep says it once, not once per point."""
    proc = run_train(tmp_path, "--multirun", "a2a=bf16,mxfp8,mxfp8_all", "training.steps=3", "training.warmup_steps=3",
                     "logging=none", f"hydra.sweep.dir={tmp_path / 'sweep'}", MXFP8EP_RUNNER=STAND_IN, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("stand-in step 3/3") == 3
    assert proc.stderr.count("training.warmup_steps=3 >= training.steps=3") == 1, proc.stderr
