"""launch/run_dir.py: which run dir training.resume picks, and the wandb run a run dir keeps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch.run_dir import RUN_CONFIG, checkpoint_steps, claim_run_config, earlier_logging, resolve_run_dir


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
    claim_run_config(tmp_path, "first", new_run=True)
    with pytest.raises(FileExistsError):  # a second launch racing into the same folder
        claim_run_config(tmp_path, "second", new_run=True)
    assert (tmp_path / RUN_CONFIG).read_text() == "first"
    claim_run_config(tmp_path, "resumed", new_run=False)  # a resumed run rewrites its own
    assert (tmp_path / RUN_CONFIG).read_text() == "resumed"


def test_a_run_dir_keeps_its_wandb_run(tmp_path):
    run_id, name = earlier_logging(tmp_path)
    assert len(run_id) == 8 and name is None
    assert earlier_logging(tmp_path)[0] != run_id  # no earlier launch: a new id each time
    (tmp_path / "train_config.yaml").write_text("logging:\n  run_id: abc12345\n  run_name: a2a=bf16\n")
    assert earlier_logging(tmp_path) == ("abc12345", "a2a=bf16")


def test_run_names_carry_what_is_trained():
    from launch.run_dir import run_name

    assert run_name([], "bf16") == "a2a=bf16"
    ovs = ["training.steps=5", "launcher=slurm", "launcher.partition=gpu", "logging=none",
           "+recipe=x", "training.resume=auto", "model=tiny_dsv3", "experiment=abl", "validate.memory=warn"]
    assert run_name(ovs, "bf16") == "a2a=bf16,model=tiny_dsv3,training.steps=5"
    assert run_name(["a2a=mxfp8", "training.steps=5"], "mxfp8") == "a2a=mxfp8,training.steps=5"
    # a folder name: no "/" (it would nest folders), cut to what file systems take
    assert run_name(["training.tokenizer_path=/a/b"], "bf16", for_path=True) == (
        "a2a=bf16,training.tokenizer_path=_a_b")
    assert len(run_name([f"training.steps={'9' * 300}"], "bf16", for_path=True)) <= 180


def test_a_single_runs_folder_names_its_overrides():
    """As a sweep's folders do: outputs/<experiment>/<time>_<what is trained>."""
    import re

    from tests.hydra_compose import compose_cfg

    cfg = compose_cfg("a2a=mxfp8", "training.steps=5", "launcher=slurm", hydra_node=True)
    assert re.fullmatch(r"outputs/default/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_a2a=mxfp8,training.steps=5",
                        cfg.hydra.run.dir), cfg.hydra.run.dir
    cfg = compose_cfg(hydra_node=True)
    assert cfg.hydra.run.dir.endswith("_a2a=bf16")
