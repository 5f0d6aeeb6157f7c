"""scripts/parity_study.py without starting anything: the arms, what each call does with a run
dir (new / resume / done), the commands, and the refusal without local quantization."""

from __future__ import annotations

import importlib.util
import sys


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


def test_mxfp8_arms_quantize_every_row_and_sample_the_telemetry():
    """The options exist in the recipe's schema, and only the MXFP8 arms take them."""
    from tests.hydra_compose import compose_cfg

    cfg = compose_cfg("+recipe=parity_dsv3", "a2a=mxfp8_all", *parity_study.MXFP8_ARM_OPTIONS)
    assert cfg.a2a.quantize_local_rows is True and cfg.logging.numerics_every == 50
    for arm in parity_study.ARMS:
        expected = list(parity_study.MXFP8_ARM_OPTIONS) if arm.a2a != "bf16" else []
        assert parity_study.study_options(arm) == expected, arm


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


def test_dry_run_prints_the_commands_and_unknown_studies_are_refused(tmp_path, capsys):
    assert parity_study.main(["--dry-run", "--study", "llama4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("+recipe=parity_llama4") == 2 and "llama4/mxfp8_all: new" in out
    assert parity_study.main(["--study", "gpt", "--out", str(tmp_path)]) == 2


def test_a_finished_study_becomes_rows(tmp_path, monkeypatch):
    """One row per arm, from compare_runs' comparison: losses, the verdict, the worst numerics."""
    import json

    from benchmarks.rows import COMMIT_ENV, read_rows

    monkeypatch.setenv(COMMIT_ENV, "a" * 40)
    run = {"model": "parity_dsv3", "seed": 0, "ep": 1, "world_size": 1, "device": "cuda", "steps": 3000,
           "final_loss": 4.84, "val_logged_steps": [100, 200], "val_losses": [7.0, 4.4],
           "tokens_per_s": 1e4, "step_time_s": 0.1, "a2a_bytes_per_step": 0.0}
    comparison = {"runs": [
        {**run, "run_name": "a2a=bf16", "a2a": "bf16", "final_val_loss": 4.40, "numerics_worst": None},
        {**run, "run_name": "a2a=mxfp8_all", "a2a": "mxfp8_all", "final_val_loss": 4.41,
         "numerics_worst": {"dispatch_fwd": {"rel_l2_err": {"value": 0.0266, "layer": 2, "layers": 7}}}},
    ], "verdicts": [{"run": "a2a=mxfp8_all", "baseline": "a2a=bf16", "delta": 0.01, "seed_spread": None,
                     "tolerance": 0.022, "within": True, "text": "mxfp8_all: ..."}]}
    (tmp_path / "comparison.json").write_text(json.dumps(comparison))
    path = parity_study.write_rows(tmp_path, "dsv3", tmp_path / "rows")
    rows = read_rows(path)
    assert [r["arm"] for r in rows] == ["bf16", "mxfp8_all"] and {r["commit"] for r in rows} == {"a" * 40}
    assert rows[0]["val_loss_delta"] is None and rows[0]["baseline"] == "a2a=bf16"
    assert rows[1]["val_loss_delta"] == 0.01 and rows[1]["within_tolerance"] is True
    assert rows[1]["numerics_worst"] == {"dispatch_fwd": {"rel_l2_err": 0.0266}}
    assert rows[1]["val_losses"] == [7.0, 4.4] and rows[1]["study"] == "dsv3"
