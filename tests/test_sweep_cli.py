"""A sweep's command line as a user types it: ``--multirun --cfg job`` (each point's checked
config, nothing started), a comma list without ``--multirun``, a sweep with an unknown option."""

from __future__ import annotations

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
