"""launch/run_dir.py: which run dir training.resume picks, and the wandb run a run dir keeps."""

from __future__ import annotations

import os
from pathlib import Path

from launch.run_dir import checkpoint_steps, earlier_logging, resolve_run_dir


def _checkpoint(run_dir: Path, step: int, mtime: float) -> None:
    d = run_dir / "checkpoint" / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_text("")
    os.utime(d / ".metadata", (mtime, mtime))


def test_resume_picks_the_run_with_the_newest_checkpoint(tmp_path):
    base = tmp_path / "outputs" / "exp"
    assert resolve_run_dir(str(base), "T0", "auto", "checkpoint") == f"{base}/T0"  # nothing yet
    _checkpoint(base / "a", 10, mtime=1000)
    _checkpoint(base / "b", 5, mtime=2000)  # fewer steps but saved last
    (base / "c" / "checkpoint" / "step-20").mkdir(parents=True)  # incomplete: no .metadata
    assert checkpoint_steps(base / "c", "checkpoint") == []
    assert resolve_run_dir(str(base), "T1", "auto", "checkpoint") == str(base / "b")
    assert resolve_run_dir(str(base), "T1", None, "checkpoint") == f"{base}/T1"  # a new run
    assert resolve_run_dir(str(base), "T1", "/some/run", "checkpoint") == "/some/run"


def test_a_run_dir_keeps_its_wandb_run(tmp_path):
    run_id, name = earlier_logging(tmp_path)
    assert len(run_id) == 8 and name is None
    assert earlier_logging(tmp_path)[0] != run_id  # no earlier launch: a new id each time
    (tmp_path / "train_config.yaml").write_text("logging:\n  run_id: abc12345\n  run_name: a2a=bf16\n")
    assert earlier_logging(tmp_path) == ("abc12345", "a2a=bf16")
