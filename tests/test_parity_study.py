"""scripts/parity_study.py without starting anything: the arms, what each call does with a run
dir (new / resume / done), the commands, and the refusal without local quantization."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from launch.run_summary import RunSummary
from tests.hydra_compose import REPO

spec = importlib.util.spec_from_file_location("parity_study", REPO / "scripts" / "parity_study.py")
parity_study = importlib.util.module_from_spec(spec)
sys.modules["parity_study"] = parity_study  # dataclasses look their module up there
spec.loader.exec_module(parity_study)


def test_arms_are_the_study():
    arms = {(a.study, a.a2a, a.seed) for a in parity_study.ARMS}
    assert arms == {("dsv3", "bf16", 0), ("dsv3", "bf16", 1), ("dsv3", "mxfp8", 0),
                    ("dsv3", "mxfp8_all", 0), ("llama4", "bf16", 0), ("llama4", "mxfp8_all", 0)}
    assert {a.recipe for a in parity_study.ARMS} == {"parity_dsv3", "parity_llama4"}
    assert all((REPO / "recipes" / f"{a.recipe}.yaml").is_file() for a in parity_study.ARMS)


def test_schema_has():
    assert parity_study.schema_has("training.val_every") and parity_study.schema_has("a2a.dispatch_fwd")
    assert not parity_study.schema_has("training.nope") and not parity_study.schema_has("a2a.dispatch_fwd.x")


def test_each_call_starts_new_resumes_or_skips(tmp_path):
    arm = parity_study.ARMS[0]
    run_dir = arm.run_dir(tmp_path)
    assert parity_study.state(arm, tmp_path)[0] == "new"
    cmd = parity_study.command(arm, tmp_path, "new", ["training.steps=9"])
    assert cmd[1:5] == [str(REPO / "launch" / "train.py"), "+recipe=parity_dsv3", "a2a=bf16", "training.seed=0"]
    assert cmd[-2:] == ["training.steps=9", f"hydra.run.dir={run_dir}"]

    (run_dir / "checkpoint" / "step-250").mkdir(parents=True)
    (run_dir / "checkpoint" / "step-250" / ".metadata").write_text("")
    summary = RunSummary(run_name="r", experiment="parity_dsv3", a2a="bf16", a2a_legs={}, model="m",
                         model_flavor="f/f", parallelism="single", world_size=1, ep=1, launcher="local",
                         device="cuda", run_dir=str(run_dir), steps=250, target_steps=3000,
                         stopped_by="SIGTERM")
    summary.write(run_dir)
    assert parity_study.state(arm, tmp_path)[0] == "resume"
    assert parity_study.command(arm, tmp_path, "resume", [])[-1] == f"training.resume={run_dir}"
    summary.steps, summary.stopped_by = 3000, None
    summary.write(run_dir)
    assert parity_study.state(arm, tmp_path)[0] == "done"


def test_refuses_without_local_quantization(tmp_path, capsys):
    if parity_study.schema_has(parity_study.QUANTIZE_LOCAL_ROWS[0]):
        pytest.skip("this checkout has a2a.quantize_local_rows")
    assert parity_study.main(["--out", str(tmp_path)]) == 2
    assert "a2a.quantize_local_rows" in capsys.readouterr().err
    assert parity_study.main(["--dry-run", "--without-local-quantization", "--study", "llama4",
                              "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("+recipe=parity_llama4") == 2 and "llama4/mxfp8_all: new" in out
    assert parity_study.main(["--study", "gpt", "--out", str(tmp_path)]) == 2
