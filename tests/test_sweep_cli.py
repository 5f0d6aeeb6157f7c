"""A sweep's command line as a user types it: ``--multirun --cfg job`` (each point's checked
config, nothing started), a comma list without ``--multirun``, a sweep with an unknown option."""

from __future__ import annotations

import re

import yaml

from tests.train_cli import run_train


def test_multirun_cfg_job_prints_each_points_checked_config(tmp_path):
    proc = run_train(tmp_path, "--multirun", "--cfg", "job", "a2a=bf16,mxfp8", "training.steps=3", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    head, *points = proc.stdout.split("# ==== sweep job #")
    assert "for each of the 2 sweep jobs" in head
    assert [p.splitlines()[0] for p in points] == ["0 of 2: a2a=bf16 training.steps=3",
                                                   "1 of 2: a2a=mxfp8 training.steps=3"]
    configs = [yaml.safe_load(p.split("\n", 1)[1]) for p in points]
    assert [c["a2a"]["name"] for c in configs] == ["bf16", "mxfp8"]
    assert all(c["training"]["steps"] == 3 and c["logging"]["run_name"] for c in configs)  # prepared
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


def test_multirun_cfg_job_names_every_bad_point(tmp_path):
    proc = run_train(tmp_path, "-m", "-c", "job", "a2a=bf16,mxfp9", "parallelism.ep=16", timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert any(ln.startswith("  - sweep job #1 (a2a=mxfp9 parallelism.ep=16): a2a=mxfp9: no such option; "
                             "did you mean a2a=mxfp8?") for ln in lines)
    assert any(ln.startswith("  - sweep job #0 (a2a=bf16 parallelism.ep=16): parallelism.ep=16") for ln in lines)


def test_comma_list_without_multirun_says_to_add_it(tmp_path):
    proc = run_train(tmp_path, "a2a=bf16,mxfp8", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[1] == (
        "  - a2a=bf16,mxfp8: a comma list is a sweep, one run per value: add --multirun before the "
        "overrides (python launch/train.py --multirun a2a=bf16,mxfp8); for one value holding commas, "
        "quote it (a2a='bf16,mxfp8')")
    assert not (tmp_path / "outputs").exists()


def test_sweep_with_an_unknown_option_is_one_line(tmp_path):
    proc = run_train(tmp_path, "--multirun", "a2a=bf16,mxfp9", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "[mxfp8ep] 1 problem(s) in the training config:",
        "  - sweep job #1 (a2a=mxfp9): a2a=mxfp9: no such option; did you mean a2a=mxfp8? a2a has bf16, "
        "mxfp8, mxfp8_all",
        "nothing was started: fix or drop these points of the 2-job sweep"]
    assert not (tmp_path / "multirun").exists()


def test_a_stopped_sweep_names_what_did_not_run_and_its_command_finishes_it(tmp_path):
    """Ctrl-C in point #1 of a 3-point sweep (after its checkpoint of step 2): the points that did
    not run are named with the command that finishes the sweep, which keeps #0, resumes #1 and
    starts #2 in the same sweep folder."""
    import os
    import shlex
    import signal
    import subprocess
    import time

    from launch.run.run_summary import RunSummary
    from tests.train_cli import train_cmd, train_env

    sweep = tmp_path / "sweep"
    args = ["--multirun", "a2a=bf16,mxfp8,mxfp8_all", "training.steps=4", "training.checkpoint_enable=true",
            "training.checkpoint_interval=2", "logging=none", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(train_cmd(*args), cwd=tmp_path, env=train_env(), text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 400
    while not [c for c in sweep.glob("1_*/checkpoint/step-2/.metadata")]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = err.splitlines()
    cut = re.fullmatch(r"\[mxfp8ep\] the sweep stopped: 2 of its 3 points did not run: #1 \(a2a=mxfp8, cut at a "
                       r"checkpoint of step ([23])\), #2 \(a2a=mxfp8_all, not started\)", lines[-2])
    assert cut, err  # the stop saves the step it stopped at
    finish = lines[-1].split(" with: ", 1)[1]
    assert finish.endswith(f" hydra.sweep.dir={sweep}")

    again = run_train(tmp_path, *shlex.split(finish)[2:], timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines()[0] == (
        f"[mxfp8ep] finishing the sweep in {sweep}: #0 (a2a=bf16) done (step 4); #1 (a2a=mxfp8) resumes "
        f"from its checkpoint of step {cut.group(1)}; #2 (a2a=mxfp8_all) starts")
    summaries = [RunSummary.read(d) for d in sorted(sweep.glob("[0-9]_*"))]
    assert [(s.a2a, s.steps, s.start_step) for s in summaries] == [("bf16", 4, 0), ("mxfp8", 4, int(cut.group(1))),
                                                                    ("mxfp8_all", 4, 0)]
    assert (sorted(sweep.glob("1_*"))[0] / "resumes" / "1").is_dir()


def test_a_sweep_folder_with_runs_of_another_sweep_is_refused(tmp_path):
    stranger = tmp_path / "sweep" / "0_a2a=mxfp8_all"
    stranger.mkdir(parents=True)
    (stranger / "train_config.yaml").write_text("a2a: {name: mxfp8_all}\n")
    proc = run_train(tmp_path, "--multirun", "a2a=bf16,mxfp8", f"hydra.sweep.dir={tmp_path / 'sweep'}", timeout=120)
    assert proc.returncode == 2
    assert f"hydra.sweep.dir={tmp_path / 'sweep'} holds runs that are no point of this sweep (0_a2a=mxfp8_all)" \
        in proc.stderr
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["0_a2a=mxfp8_all"]
