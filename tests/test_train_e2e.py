"""`python launch/train.py` end to end on CPU: 2 gloo worker processes started by torch's
elastic launcher, the real torchtitan trainer (tiny Llama4 MoE, EP 2), offline wandb read back.

The README's first command with its console; a 2-point sweep with its comparison and plots;
Ctrl-C and SIGTERM stopping a run cleanly, and the stopped run resumed into the same wandb run;
--help. About 3-4 minutes on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tests.hydra_compose import REPO
from tests.train_cli import TRAIN, run_train, train_cmd, train_env

from launch.tools.compare_runs import main as compare_main
from launch.run.run_dir import folder_name
from launch.run.run_summary import A2A_BYTES, LOSS, STEP_TIME, TOKENS_PER_S_GLOBAL, RunSummary
from launch.run.wandb_offline import find_runs, read_run, read_runs

# What the console used to be full of: torchtitan's log, library warnings, wandb's banner,
# torch elastic's per-rank prefixes and its own log lines, the model dump.
NOISE = re.compile(r"lspci|Peak flops|NCCL|wandb:|Warning|\[titan\]|\[rank\d|torch\.distributed|"
                   r"^[EWI]\d{4} |Traceback|\"dim\":|DTensor")


def readme_first_command() -> list[str]:
    """The training half of the README's first command (`bash scripts/install.sh && ...`)."""
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1).strip()
    install, command = first_block.split("&&")
    assert install.strip() == "bash scripts/install.sh"
    words = command.split()
    assert words[:2] == ["python", "launch/train.py"], words
    return words[2:]


def step_tokens(run_dir: Path) -> int:
    """Tokens of one training step over all ranks, from the run's config."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "train_config.yaml")
    ranks = cfg.parallelism.nodes * cfg.parallelism.procs_per_node
    return ranks * cfg.training.local_batch_size * cfg.training.seq_len


def agrees_with_step_time(tokens_per_s: float, step_time_s: float, run_dir: Path) -> bool:
    """tokens/s within 1% of world x tokens per step / step time."""
    return abs(tokens_per_s * step_time_s / step_tokens(run_dir) - 1) < 0.01


def check_run(run_dir: Path, steps: int, a2a: str) -> RunSummary:
    """summary.json and the offline wandb run agree and look like training."""
    s = RunSummary.read(run_dir)
    assert s.a2a == a2a and s.model == "tiny_llama4" and s.world_size == 2 and s.ep == 2
    assert s.steps == steps and s.stopped_by is None
    assert s.logged_steps == list(range(1, steps + 1))
    assert all(math.isfinite(x) for x in s.losses) and s.losses[-1] < s.losses[0], s.losses
    assert s.final_loss == s.losses[-1]
    assert s.tokens_per_s > 0 and s.step_time_s > 0 and s.a2a_bytes_per_step > 0
    assert s.tflops is None and s.mfu_pct is None  # n/a on CPU

    (run,) = read_runs(str(run_dir))
    assert run.run_id == s.wandb_run_id and run.paths == s.wandb_dirs == find_runs(str(run_dir))
    assert run.name == s.run_name and f"a2a={a2a}" in run.name
    assert run.group == "default" and run.project == "mxfp8-ep"
    assert run.config["recipe"]["a2a"]["name"] == a2a
    assert [row["_step"] for row in run.history] == s.logged_steps
    assert run.series(LOSS) == pytest.approx(s.losses)
    # one metrics contract: console, summary.json and wandb's summary show the same numbers
    assert run.summary[A2A_BYTES] == pytest.approx(s.a2a_bytes_per_step)
    assert run.summary[TOKENS_PER_S_GLOBAL] == pytest.approx(s.tokens_per_s_global)
    assert run.summary[STEP_TIME] == pytest.approx(s.step_time_s)
    # tokens/s and step time describe the same steps
    assert agrees_with_step_time(s.tokens_per_s_global, s.step_time_s, run_dir)
    assert s.tokens_per_s * s.world_size == pytest.approx(s.tokens_per_s_global)
    assert s.steady_steps == steps - 1  # every window but the first (one step each)
    assert run.exit_code == 0
    return s


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp("readme")
    args = readme_first_command()
    proc = run_train(cwd, *args)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    (run_dir,) = (cwd / "outputs" / "default").iterdir()
    # the folder says what was trained, as a sweep's folders do: <time>_a2a=bf16[,overrides]
    assert run_dir.name.endswith("_" + folder_name(args, "bf16")), run_dir.name
    return run_dir, proc


def test_readme_command_has_a_quiet_console(readme_run):
    run_dir, proc = readme_run
    s = check_run(run_dir, steps=20, a2a="bf16")
    assert s.launcher == "local" and s.wandb_mode == "offline"
    lines = (proc.stdout + proc.stderr).splitlines()
    print("\n".join(lines))
    assert len(lines) <= 42, len(lines)  # header 3, start-up 5, steps 20, finishing 1, summary 13
    assert not [line for line in lines if NOISE.search(line)]
    assert proc.stderr == ""
    # header, one line per log window, the summary
    assert lines[0].startswith("mxfp8ep: model=tiny_llama4 a2a=bf16 parallelism=ep2 (EP 2), 20 steps "
                               "on 2 CPU processes (gloo)")
    progress = [line for line in lines if line.startswith("step ")]
    assert len(progress) == 20 and re.fullmatch(r"step  1/20  loss \d+\.\d{4}  tokens/s [\d,]+", progress[0])
    assert re.fullmatch(r"step  2/20  loss \d+\.\d{4}  tokens/s [\d,]+  eta \d+s", progress[1])
    # between the header and step 1, a line as each stage of the start begins
    assert lines[3:lines.index(progress[0])] == [
        "start-up: starting 2 CPU processes (gloo)", "start-up: 2 processes started, importing torchtitan",
        "start-up: process group, data and model (tiny_llama4, EP 2)", "start-up: wandb (offline)",
        "start-up: the first step (the slowest: warm-up)"]
    out = proc.stdout
    assert "==== mxfp8ep run a2a=bf16 ====" in out
    assert f"a2a bytes/step  {s.a2a_bytes_per_step:,.0f}" in out
    assert f"tokens/s        {s.tokens_per_s_global:,.0f} all ranks" in out
    assert f"step time (s)   {s.step_time_s:.4f}" in out
    assert "TFLOPS, MFU     n/a, n/a" in out
    for text in ("final loss", str(run_dir), os.path.basename(s.wandb_dirs[0]), "wandb sync"):
        assert text in out
    # the full output went to the run's log files
    assert list((run_dir / "worker_logs").rglob("stderr.log"))
    rank0 = "".join(p.read_text() for p in (run_dir / "worker_logs").rglob("0/*.log"))
    assert "lspci" in rank0 and "wandb:" in rank0 and "step: 20/20" in rank0
    assert (run_dir / "train_config.yaml").is_file()


def test_multirun_sweep_compare_and_plots(tmp_path, readme_run, capsys):
    sweep = tmp_path / "sweep"
    proc = run_train(tmp_path, "--multirun", "a2a=bf16,mxfp8", "training.steps=4",
                     "logging.verbose=true", "logging.tags=[ci]", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    out = proc.stdout + proc.stderr
    assert "[mxfp8ep] sweep of 2 runs, launched one after another with launcher=local" in out
    assert "[HYDRA]" not in out
    assert "[rank0]:" in out and "[titan]" in out  # logging.verbose=true: everything
    # launcher / logging overrides stay out of folder and run names
    runs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in runs] == [f"{n}_{folder_name([f'a2a={a2a}', 'training.steps=4'], a2a)}"
                                      for n, a2a in enumerate(("bf16", "mxfp8"))]
    bf16, mxfp8 = check_run(runs[0], steps=4, a2a="bf16"), check_run(runs[1], steps=4, a2a="mxfp8")
    # the sweep ends with the command that compares it
    assert proc.stdout.rstrip().endswith(f"python launch/compare_runs.py {sweep}")

    # two of four legs at ~1.03 instead of 2 bytes per element: ~0.76 of bf16's bytes
    assert 0.6 < mxfp8.a2a_bytes_per_step / bf16.a2a_bytes_per_step < 0.9
    assert mxfp8.final_loss == pytest.approx(bf16.final_loss, abs=0.1)  # same data and init

    for s in (bf16, mxfp8):  # the console's summary of each run
        assert f"tokens/s        {s.tokens_per_s_global:,.0f} all ranks" in proc.stdout
        assert f"step time (s)   {s.step_time_s:.4f}" in proc.stdout

    capsys.readouterr()
    assert compare_main([str(sweep)]) == 0
    table = capsys.readouterr().out.split("\n\n")[0]
    cmp = json.loads((sweep / "comparison.json").read_text())
    by_a2a = {r["a2a"]: r for r in cmp["runs"]}
    assert set(by_a2a) == {"bf16", "mxfp8"} and all(r["source"] == "summary" for r in cmp["runs"])
    for run_dir, s in zip(runs, (bf16, mxfp8)):
        r = by_a2a[s.a2a]
        assert agrees_with_step_time(r["tokens_per_s_global"], r["step_time_s"], run_dir)
        (line,) = [t for t in table.splitlines() if t.startswith(s.run_name + " ")]
        assert f"{s.tokens_per_s_global:,.0f}" in line and f"{s.step_time_s:.4f}" in line
    assert by_a2a["mxfp8"]["vs_baseline"]["tokens_per_s_ratio"] == pytest.approx(
        bf16.step_time_s / mxfp8.step_time_s, rel=0.01)
    assert by_a2a["mxfp8"]["vs_baseline"]["baseline"] == by_a2a["bf16"]["run_name"]
    assert by_a2a["mxfp8"]["vs_baseline"]["bytes_ratio"] < 0.9
    for png in ("comparison_loss.png", "comparison_throughput.png"):
        assert (sweep / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the same comparison from the offline wandb runs alone
    for p in runs:
        (p / "summary.json").unlink()
    out_json = tmp_path / "cmp.json"
    assert compare_main([str(sweep), "--out", str(out_json)]) == 0
    cmp = json.loads(out_json.read_text())
    assert sorted(r["a2a"] for r in cmp["runs"]) == ["bf16", "mxfp8"]
    assert all(r["source"] == "wandb" for r in cmp["runs"])
    assert {r["a2a"]: r["a2a_bytes_per_step"] for r in cmp["runs"]} == pytest.approx(
        {"bf16": bf16.a2a_bytes_per_step, "mxfp8": mxfp8.a2a_bytes_per_step})
    # ... and the same throughput and step time, read from the logged windows
    for r in cmp["runs"]:
        s = bf16 if r["a2a"] == "bf16" else mxfp8
        assert (r["tokens_per_s_global"], r["step_time_s"]) == pytest.approx((s.tokens_per_s_global, s.step_time_s))


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    """train.py in its own process group, as a shell starts a foreground job."""
    return subprocess.Popen(train_cmd(*args), cwd=tmp_path, env=train_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _wait_for_steps(run_dir: Path, proc: subprocess.Popen, steps: int, timeout: float = 240) -> None:
    console = run_dir / "console.log"
    deadline = time.monotonic() + timeout
    while not (console.is_file()
               and sum(line.startswith("step ") for line in console.read_text().splitlines()) >= steps):
        assert proc.poll() is None, proc.communicate()
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no step {steps} after {timeout}s: {proc.communicate()}")
        time.sleep(0.2)


def test_ctrl_c_stops_cleanly_and_resume_continues_the_same_wandb_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, "training.steps=200", "training.checkpoint_enable=true",
                  "training.checkpoint_interval=100", f"hydra.run.dir={run_dir}")
    _wait_for_steps(run_dir, proc, 3)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out[-3000:], err[-3000:])

    s = RunSummary.read(run_dir)
    assert s.stopped_by == "SIGINT" and 3 <= s.steps < 200
    assert s.checkpoint == str(run_dir / "checkpoint" / f"step-{s.steps}")
    assert (run_dir / "checkpoint" / f"step-{s.steps}" / ".metadata").is_file()
    assert err.splitlines() == [
        f"[mxfp8ep] stopped by SIGINT at step {s.steps}/200: checkpoint {s.checkpoint}, wandb run "
        f"{s.wandb_run_id} finished; continue with: python {TRAIN} training.resume={run_dir}"
    ]
    hint = shlex.split(err.split("continue with: ")[1])
    assert not [line for line in out.splitlines() if NOISE.search(line)]
    # no logged step lost: wandb has every step up to the stop, and was finished
    (run,) = read_runs(str(run_dir))
    assert [row["_step"] for row in run.history] == list(range(1, s.steps + 1))
    assert run.exit_code == 0

    # Resume with the printed command (two more steps, not the run's 200): its saved config
    # (checkpointing on), its newest checkpoint, the same wandb run with the history appended.
    steps = s.steps + 2
    assert hint[:2] == ["python", str(TRAIN)]
    proc = run_train(tmp_path, *hint[2:], f"training.steps={steps}")
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.splitlines()[0] == (
        f"[mxfp8ep] resuming {run_dir} from step {s.steps} (its newest checkpoint) with its saved "
        f"config; changed on the command line: training.steps={steps}; the learning-rate schedule keeps "
        f"its 200 steps (training.lr_schedule_steps=<n> changes it)")
    assert f"run dir {run_dir}" in proc.stdout
    resumed = RunSummary.read(run_dir)
    assert resumed.start_step == s.steps and resumed.steps == steps
    assert resumed.wandb_run_id == s.wandb_run_id and resumed.run_name == s.run_name
    assert resumed.logged_steps == list(range(1, steps + 1))
    (run,) = read_runs(str(run_dir))
    assert len(run.paths) == 2 and run.run_id == s.wandb_run_id
    assert [row["_step"] for row in run.history] == list(range(1, steps + 1))
    # what wandb sync uploads, launch after launch: no step logged twice, none lost
    assert [row["_step"] for p in run.paths for row in read_run(p).history] == list(range(1, steps + 1))
    assert run.series(LOSS)[: s.steps] == pytest.approx(s.losses)
    assert not list(tmp_path.glob("outputs"))  # no new run dir was made
    # console.log: the first launch's lines, then the resume's below the line that names it; the
    # stop line with its command and the summary, as the console showed them
    text = (run_dir / "console.log").read_text()
    assert err.strip() in text and f"  steps           {steps}/{steps}, resumed from step {s.steps}" in text
    lines = [line for line in text.splitlines() if line.startswith(("step ", "==== ended", "==== resume"))]
    assert [int(line.split()[1].split("/")[0]) for line in lines[: s.steps]] == list(range(1, s.steps + 1))
    assert lines[s.steps].endswith(f": stopped by SIGINT at step {s.steps}/200 (checkpoint step-{s.steps}) ====")
    assert lines[s.steps + 1].startswith("==== resume 1 (") and f"from step {s.steps}," in lines[s.steps + 1]
    assert [line.split()[1] for line in lines[s.steps + 2:-1]] == [f"{n}/{steps}"
                                                                   for n in range(s.steps + 1, steps + 1)]
    assert lines[-1].endswith(f": completed step {steps}/{steps} ====")


def test_sigterm_to_the_launcher_stops_the_workers(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, "training.steps=200", "logging=none", f"hydra.run.dir={run_dir}")
    _wait_for_steps(run_dir, proc, 2)
    proc.send_signal(signal.SIGTERM)  # kill <pid>: the launcher alone
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (out[-3000:], err[-3000:])
    s = RunSummary.read(run_dir)
    assert s.stopped_by == "SIGTERM" and s.checkpoint is None
    assert err.splitlines() == [
        f"[mxfp8ep] stopped by SIGTERM at step {s.steps}/200: no checkpoint "
        f"(training.checkpoint_enable=false), so it cannot be resumed"
    ]


def test_a_long_step_says_it_is_still_running(tmp_path):
    """logging.heartbeat_s: while a step runs longer than that, the console says which step and
    for how long (a first step that takes minutes no longer looks like a hang)."""
    slow_steps = {"PYTHONPATH": os.pathsep.join((str(REPO / "tests" / "slurm"), str(REPO))),
                  "MXFP8EP_RUNNER": "slurm_fault_runner:run_training", "MXFP8EP_TEST_STEP_SLEEP": "2.5"}
    proc = run_train(tmp_path, "training.steps=2", "logging=none", "logging.heartbeat_s=1", **slow_steps)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    lines = proc.stdout.splitlines()
    for step in (1, 2):
        done = next(i for i, line in enumerate(lines) if line.startswith(f"step {step}/2  loss"))
        assert lines[done - 1].startswith(f"step {step}/2  still running ("), lines
        assert lines[done - 1].endswith(" so far; stuck? see docs/usage.md#when-a-step-never-finishes)")


def test_help_lists_groups_options_and_examples(tmp_path):
    proc = run_train(tmp_path, "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("mxfp8ep: train torchtitan 0.2.2's MoE models")
    assert "a2a: bf16, mxfp8, mxfp8_all" in text
    assert "launcher: local, slurm" in text and "model: default, dsv3_16b," in text  # default: the stack's tiny model
    assert "parallelism: 2nodes_8gpus, 4nodes_8gpus, ep2, ep2_shared_gpu, ep4, ep4_shared_gpu, ep8, single" in text
    examples = text.split("== Examples ==")[1]
    assert examples.count("python launch/train.py") == 6 and "a2a.capacity_factor=" in examples
    assert "python launch/train.py                                      # tiny Llama4, EP 2, 20 steps" in examples
