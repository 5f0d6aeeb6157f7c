"""The recipe end to end on torchtitan 0.3.0, on CPU (2 gloo processes): `python launch/train.py`
as a user runs it, on 0.3.0's trainer.

* a sweep of the three a2a presets at the default size (20 steps of 4 x 64 tokens per rank,
  tiny DeepSeek-V3, EP 2), checkpointing on, MXFP8 telemetry sampled: each run trains, records
  its stack (summary.json, stack.json, the wandb config) and its legs' bytes; `compare_runs`
  compares them without a stack warning;
* console.log: the start-up stages, one line per step, the ending;
* one of them resumed from its checkpoint for four more steps (its learning-rate schedule given
  the new length): the step count and the loss curve continue, what cut-short checkpoint writes
  left is removed first;
* configs 0.3.0 cannot run, refused before launch in one line (Llama4; a flex-attention model
  on CPU);
* the symm transport at an elastic capacity with forced replays (and spills), validation and a
  resume, through ``run_training``: the 0.2.2 stack's test itself (tests/test_titan_runner.py),
  run here on 0.3.0's trainer.

About 6 minutes on 2 cores (4 of them the symm test's five trainings).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

from tests.test_titan_runner import test_symm_capacity_overflows_replay_to_the_worst_case_losses  # noqa: E402,F401
from tests.train_cli import run_train  # noqa: E402

from launch.config.stack import installed  # noqa: E402
from launch.run.run_dir import STACK  # noqa: E402
from launch.run.run_summary import RunSummary  # noqa: E402
from launch.run.wandb_offline import read_runs  # noqa: E402
from launch.tools.compare_runs import main as compare_main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PRESETS = ("bf16", "mxfp8", "mxfp8_all")
SWEEP = ("--multirun", f"a2a={','.join(PRESETS)}", "model=tiny_dsv3", "training.checkpoint_enable=true",
         "training.checkpoint_interval=10", "logging.numerics_every=10")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, dict[str, Path], str]:
    """The sweep's folder, its run folder per preset and its console."""
    cwd = tmp_path_factory.mktemp("sweep")
    proc = run_train(cwd, *SWEEP, "hydra.sweep.dir=multirun", timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    runs = {RunSummary.read(d).a2a: d for d in (cwd / "multirun").iterdir() if (d / "summary.json").is_file()}
    assert sorted(runs) == sorted(PRESETS), out[-3000:]
    return cwd / "multirun", runs, out


def test_the_readmes_030_command_trains_what_the_sweep_trains():
    """The README's 0.3.0 quick start: the install line, then `python launch/train.py` with the
    overrides of the sweep's runs (the sweep trains its model at the default size)."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
                if "--torchtitan 0.3.0" in b]
    install, command = block.strip().split("&&")
    assert install.strip() == "bash scripts/install.sh --torchtitan 0.3.0"
    words = command.split()
    assert words[:2] == ["python", "launch/train.py"] and set(words[2:]) <= set(SWEEP), words


def test_each_preset_trains_and_records_its_stack(sweep):
    _, runs, out = sweep
    stack = installed()
    assert stack.torchtitan == "0.3.0"
    assert out.count(f"  stack           {stack.label}\n") == len(PRESETS)
    for a2a, run_dir in runs.items():
        s = RunSummary.read(run_dir)
        assert s.model == "tiny_dsv3" and s.model_flavor == "deepseek_v3/tiny" and (s.world_size, s.ep) == (2, 2)
        assert s.steps == 20 and s.logged_steps == list(range(1, 21)) and s.stopped_by is None
        assert all(math.isfinite(x) for x in s.losses) and s.losses[-1] < s.losses[0] - 0.1, s.losses
        assert s.checkpoint == str(run_dir / "checkpoint" / "step-20")
        assert s.stack == stack.to_dict() == json.loads((run_dir / STACK).read_text())
        # console.log: the header, a line as each stage of the start begins, one per step, the ending
        console = (run_dir / "console.log").read_text().splitlines()
        progress = [line for line in console if line.startswith("step ")]
        assert console[0].startswith(f"mxfp8ep: model=tiny_dsv3 a2a={a2a} ") and console[1].endswith(run_dir.name)
        assert console[3:console.index(progress[0])] == [
            "start-up: starting 2 CPU processes (gloo)", "start-up: 2 processes started, importing torchtitan",
            "start-up: process group, data and model (tiny_dsv3, EP 2)", "start-up: wandb (offline)",
            "start-up: the first step (the slowest: warm-up)"], console
        assert len(progress) == 20 and "eta" not in progress[0] and "eta" in progress[1]
        assert "finishing: summary.json and wandb" in console[console.index(progress[-1]):]
        assert set(s.moe_imbalance) == {"ep2", "ep4", "ep8"}, s.moe_imbalance  # the routing telemetry
        (wandb_run,) = read_runs(str(run_dir))
        assert wandb_run.config["stack"] == stack.to_dict()
        assert wandb_run.config["recipe"]["a2a"]["name"] == a2a
        assert wandb_run.config["torchtitan"]["override"]["imports"][0][0] == "mxfp8_ep.titan030.token_dispatcher"
        legs = s.a2a_bytes_per_step_by_leg
        # What crosses as MXFP8 is 1 byte + 1/32 scale byte per element, bf16 2 bytes: the same rows.
        mxfp8 = {leg for leg in legs if RunSummary.read(run_dir).a2a_legs[leg] == "mxfp8"}
        assert {leg for leg in legs if legs[leg] == pytest.approx(legs["dispatch_bwd" if a2a != "mxfp8_all" else
                                                                       "dispatch_fwd"])} >= set(legs) - mxfp8
        for leg in mxfp8:
            assert legs[leg] < legs["combine_fwd"] or a2a == "mxfp8_all", legs
        # the telemetry of the MXFP8 legs, at steps 10 and 20
        assert bool(s.numerics) == (a2a != "bf16"), s.numerics
        if a2a == "mxfp8":
            assert s.numerics["numerics/dispatch_fwd/rel_l2_err"]["n"] == 2
    mx = RunSummary.read(runs["mxfp8"]).a2a_bytes_per_step_by_leg
    assert mx["dispatch_fwd"] == pytest.approx(mx["dispatch_bwd"] * 33 / 64, rel=1e-6), mx


def test_compare_runs_compares_the_sweep(sweep, capsys):
    folder, _, out = sweep
    assert f"python launch/compare_runs.py {folder.name}" in out
    assert compare_main([str(folder)]) == 0
    table = capsys.readouterr().out
    assert "different stacks" not in table
    written = json.loads((folder / "comparison.json").read_text())
    assert written["stack_warning"] is None
    assert sorted(r["a2a"] for r in written["runs"]) == sorted(PRESETS)
    assert {r["stack"]["torchtitan"] for r in written["runs"]} == {"0.3.0"}


def test_a_run_resumes_from_its_checkpoint(sweep):
    folder, runs, _ = sweep
    run_dir = runs["mxfp8"]
    before = RunSummary.read(run_dir)
    # what checkpoint writes cut short leave (a renamed write's folder; a step without DCP's .metadata)
    left = [run_dir / "checkpoint" / ".step22.incomplete", run_dir / "checkpoint" / "step-23"]
    for folder in left:
        folder.mkdir()
    # past the run's 20-step learning-rate schedule: the schedule is given the new length too
    proc = run_train(folder.parent, f"training.resume={run_dir}", "training.steps=24", "training.lr_schedule_steps=24",
                     timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"resuming {run_dir} from step 20" in proc.stdout + proc.stderr
    s = RunSummary.read(run_dir)
    assert s.start_step == 20 and s.steps == 24 and s.logged_steps == list(range(1, 25))
    assert s.losses[:20] == before.losses and all(math.isfinite(x) for x in s.losses[20:])
    assert s.checkpoint == str(run_dir / "checkpoint" / "step-24")
    assert not any(folder.exists() for folder in left) and (run_dir / "checkpoint" / "step-24" / ".metadata").is_file()
    console = (run_dir / "console.log").read_text().splitlines()
    resumed = console[console.index("start-up: the newest checkpoint, then the first step (the slowest: warm-up)"):]
    assert [line.split()[1] for line in resumed if line.startswith("step ")] == ["21/24", "22/24", "23/24", "24/24"]
    (wandb_run,) = read_runs(str(run_dir))  # both launches, one wandb run
    assert wandb_run.run_id == before.wandb_run_id and len(wandb_run.paths) == 2


@pytest.mark.parametrize("overrides, message", [
    (("model=tiny_llama4",), "model=tiny_llama4: Llama4 is not in torchtitan 0.3.0 (removed upstream"),
    (("model=dsv3_debugmodel",), "model=dsv3_debugmodel uses flex attention (deepseek_v3/debugmodel), which torch "
                                 "cannot train on CPU"),
    (("model=tiny_dsv3", "parallelism=single", "a2a=mxfp8", "a2a.quantize_local_rows=true"),
     "a2a.quantize_local_rows=true with parallelism.ep=1 routes the MoE layers through the dispatcher on each "
     "rank alone, which the recipe does on torchtitan 0.2.2 only"),
], ids=["llama4", "flex-on-cpu", "local-rows"])
def test_what_030_cannot_run_is_refused_before_launch(tmp_path, overrides, message):
    proc = run_train(tmp_path, *overrides, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("[mxfp8ep] 1 problem(s) in the training config:\n  - ")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists()  # nothing was started, no folder made
