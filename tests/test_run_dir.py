"""launch/run/run_dir.py: which run dir training.resume picks, and the wandb run a run dir keeps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch.run.run_dir import (RUN_CONFIG, RunDirBefore, checkpoint_steps, claim_resume, claim_run_config,
                                earlier_logging, folder_name, latest_run_config, resolve_run_dir, run_name)


def _checkpoint(run_dir: Path, step: int, mtime: float, run: bool = True) -> None:
    d = run_dir / "checkpoint" / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_text("")
    os.utime(d / ".metadata", (mtime, mtime))
    if run:
        (run_dir / "train_config.yaml").write_text("training:\n  steps: 20\n")


def test_resume_picks_the_run_with_the_newest_checkpoint(tmp_path):
    base = tmp_path / "outputs" / "exp"
    assert resolve_run_dir(str(base), "T0", "auto", "checkpoint") == f"{base}/T0"  # nothing yet
    _checkpoint(base / "a", 10, mtime=1000)
    _checkpoint(base / "b", 5, mtime=2000)  # fewer steps but saved last
    (base / "c" / "checkpoint" / "step-20").mkdir(parents=True)  # incomplete: no .metadata
    assert checkpoint_steps(base / "c", "checkpoint") == []
    _checkpoint(base / "d", 5, mtime=3000, run=False)  # a checkpoint, but not a run's folder
    assert resolve_run_dir(str(base), "T1", "auto", "checkpoint") == str(base / "b")
    assert resolve_run_dir(str(base), "T1", None, "checkpoint") == f"{base}/T1"  # a new run
    assert resolve_run_dir(str(base), "T1", "/some/run", "checkpoint") == "/some/run"


def test_a_new_run_whose_folder_name_is_taken_gets_the_next_free_one(tmp_path):
    base = tmp_path / "outputs" / "exp"
    (base / "T_a2a=bf16").mkdir(parents=True)  # a launch in the same second, same overrides
    assert resolve_run_dir(str(base), "T_a2a=bf16", None, "checkpoint") == f"{base}/T_a2a=bf16_2"
    (base / "T_a2a=bf16_2").mkdir()
    assert resolve_run_dir(str(base), "T_a2a=bf16", "auto", "checkpoint") == f"{base}/T_a2a=bf16_3"


def test_a_new_run_claims_its_config_exclusively(tmp_path):
    claim_run_config(tmp_path, "first")
    with pytest.raises(FileExistsError):  # a second launch racing into the same folder
        claim_run_config(tmp_path, "second")
    assert (tmp_path / RUN_CONFIG).read_text() == "first"


def test_each_resume_keeps_its_own_config_beside_the_first(tmp_path):
    claim_run_config(tmp_path, "training:\n  steps: 200\n")
    assert latest_run_config(tmp_path) == tmp_path / RUN_CONFIG
    assert (claim_resume(tmp_path), claim_resume(tmp_path)) == (1, 2)  # two resumes racing
    claim_run_config(tmp_path, "training:\n  steps: 110\n", resume=1)
    assert latest_run_config(tmp_path) == tmp_path / "resumes" / "1" / RUN_CONFIG  # 2 has none yet
    claim_run_config(tmp_path, "training:\n  steps: 120\n", resume=2)
    with pytest.raises(FileExistsError):
        claim_run_config(tmp_path, "again", resume=2)
    assert latest_run_config(tmp_path).read_text() == "training:\n  steps: 120\n"
    assert (tmp_path / RUN_CONFIG).read_text() == "training:\n  steps: 200\n"  # the first launch's


def test_what_a_refused_launch_added_is_taken_back(tmp_path):
    run = tmp_path / "run"
    before = RunDirBefore.take(run)  # a new run: not there yet
    (run / ".hydra").mkdir(parents=True)
    (run / "console.log").write_text("")
    before.restore()
    assert not run.exists()

    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "1_submitted.pkl").write_text("job 1")
    (run / "console.log").write_text("step 1/2\n")
    (run / RUN_CONFIG).write_text("the run's")
    before = RunDirBefore.take(run)  # a resume of that run
    (run / "resumes" / "1" / ".hydra").mkdir(parents=True)
    (run / "slurm" / "2_submitted.pkl").write_text("job 2")
    with (run / "console.log").open("a") as f:
        f.write("==== resume 1 ====\n")
    before.restore()
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == [
        "console.log", "slurm", "slurm/1_submitted.pkl", RUN_CONFIG]
    assert (run / "console.log").read_text() == "step 1/2\n"


def test_a_run_dir_keeps_its_wandb_run(tmp_path):
    run_id, name = earlier_logging(tmp_path)
    assert len(run_id) == 8 and name is None
    assert earlier_logging(tmp_path)[0] != run_id  # no earlier launch: a new id each time
    (tmp_path / "train_config.yaml").write_text("logging:\n  run_id: abc12345\n  run_name: a2a=bf16\n")
    assert earlier_logging(tmp_path) == ("abc12345", "a2a=bf16")


def test_run_names_carry_what_is_trained():
    assert run_name([], "bf16") == "a2a=bf16"
    ovs = ["training.steps=5", "launcher=slurm", "launcher.partition=gpu", "logging=none",
           "+recipe=x", "training.resume=auto", "model=tiny_dsv3", "experiment=abl", "validate.memory=warn"]
    assert run_name(ovs, "bf16") == "a2a=bf16,model=tiny_dsv3,training.steps=5"
    assert run_name(["a2a=mxfp8", "training.steps=5"], "mxfp8") == "a2a=mxfp8,training.steps=5"


def test_folder_names_name_the_experiment_and_hash_the_rest():
    assert folder_name(["model=tiny_dsv3", "launcher=slurm"], "mxfp8") == "a2a=mxfp8,model=tiny_dsv3"
    # steps (a resume may change them), checkpoint flags and paths: only a hash of them
    name = folder_name(["model=tiny_dsv3", "training.steps=200", "training.checkpoint_enable=true",
                        "training.dataset_path=/data/corpora/debian_docs/v2"], "bf16")
    assert name.startswith("a2a=bf16,model=tiny_dsv3,others=") and len(name) == len(
        "a2a=bf16,model=tiny_dsv3,others=") + 6 and "/" not in name and "steps" not in name
    other = folder_name(["model=tiny_dsv3", "training.steps=100", "training.checkpoint_enable=true",
                         "training.dataset_path=/data/corpora/debian_docs/v2"], "bf16")
    assert other != name and other.startswith("a2a=bf16,model=tiny_dsv3,others=")
    # a sweep over many fields: capped, the names that fit first, then the hash of the rest
    many = [f"a2a.{leg}=mxfp8" for leg in ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd")]
    many += ["parallelism.ep=2", "parallelism.procs_per_node=2", "training.seq_len=4096",
             "training.local_batch_size=8", "training.lr=0.0003", "model=parity_tiny_dsv3"]
    long = folder_name(many, "custom")
    assert len(long) <= 140 and long.startswith("a2a=custom,model=parity_tiny_dsv3,a2a.combine_bwd=mxfp8,")
    assert ",others=" in long
    assert long != folder_name(many[:-1] + ["model=tiny_dsv3"], "custom")


def test_a_single_runs_folder_names_its_overrides():
    """As a sweep's folders do: outputs/<experiment>/<time>_<what is trained>."""
    import re

    from tests.hydra_compose import compose_cfg

    overrides = ("a2a=mxfp8", "model=tiny_dsv3", "training.steps=5", "launcher=slurm")
    cfg = compose_cfg(*overrides, hydra_node=True)
    name = folder_name(overrides, "mxfp8")
    assert name.startswith("a2a=mxfp8,model=tiny_dsv3,others=")
    assert re.fullmatch(r"outputs/default/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_" + re.escape(name),
                        cfg.hydra.run.dir), cfg.hydra.run.dir
    cfg = compose_cfg(hydra_node=True)
    assert cfg.hydra.run.dir.endswith("_a2a=bf16")
