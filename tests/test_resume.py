"""training.resume (launch/resume.py, launch/prepare.py): a run folder continues with its saved
config, the command line's changes listed; anything that cannot be resumed is refused before a
folder is made, with exit code 2. The real trainer resuming (checkpoint, wandb run) is in
test_train_e2e.py; here the runs are folders as a run leaves them, and the launcher records."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tests.hydra_compose import compose_cfg, no_slurm_cluster  # noqa: F401 (autouse)
from tests.launch_recorder import LAUNCHED
from tests.train_cli import run_train

from launch.prepare import prepare, prepare_run, task_config
from launch.problems import ConfigError
from launch.run_dir import RUN_CONFIG
from launch.train import literal_paths

RECORDER = "launcher._target_=tests.launch_recorder.Recorder"


def make_run(run_dir: Path, *overrides: str, checkpoints=(6,), complete=True) -> dict:
    """A run folder as a launch leaves it: its config, and checkpoints of these steps."""
    cfg, _ = prepare(compose_cfg(*overrides), list(overrides))
    run_dir.mkdir(parents=True)
    (run_dir / RUN_CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    for step in checkpoints:
        d = run_dir / "checkpoint" / f"step-{step}"
        d.mkdir(parents=True)
        if complete:
            (d / ".metadata").write_text("")
    return OmegaConf.to_container(cfg)


def prepared(*overrides: str):
    """What launch.callbacks.PrepareRun does for this command line: (config, warnings, line)."""
    args = literal_paths(list(overrides))
    cfg = compose_cfg(*args, hydra_node=True)
    given = any(a.startswith("hydra.run.dir=") for a in args)
    return prepare_run(task_config(cfg), list(cfg.hydra.overrides.task), str(cfg.hydra.run.dir),
                       lambda ovs: compose_cfg(*ovs), given)


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        prepared(*overrides)
    (problem,) = e.value.problems
    return problem


# A run of 10 steps with checkpoints, trained at seq_len 32 (not conf/'s 64).
RUN = ("training.checkpoint_enable=true", "training.checkpoint_interval=2", "training.steps=10",
       "training.seq_len=32")


def test_resume_takes_the_runs_config_and_lists_the_changes(tmp_path):
    run = tmp_path / "outputs" / "run,a2a=bf16"  # folder names hold "," and "="
    saved = make_run(run, *RUN)
    cfg, _, line = prepared(f"training.resume={run}")
    assert line == (f"[mxfp8ep] resuming {run} from step 6 (its newest checkpoint) with its saved "
                    f"config; nothing changed on the command line")
    assert cfg.training.seq_len == 32 and cfg.training.steps == 10  # the run's, not conf/'s
    assert cfg.training.checkpoint_enable and cfg.logging.run_id == saved["logging"]["run_id"]

    cfg, _, line = prepared(f"training.resume={run}", "training.steps=20", "a2a=mxfp8",
                            "training.seq_len=32", "logging=none")
    assert line.endswith("changed on the command line: training.steps=20 a2a=mxfp8 logging=none")
    assert cfg.training.steps == 20 and cfg.a2a.name == "mxfp8" and cfg.a2a.dispatch_fwd == "mxfp8"
    # a new logging group keeps the run's wandb run
    assert (cfg.logging.run_id, cfg.logging.run_name) == (saved["logging"]["run_id"],
                                                          saved["logging"]["run_name"])
    assert cfg.logging.wandb_mode == "disabled"


@pytest.mark.parametrize("case,overrides,text", [
    ("missing", (), "training.resume={run}/nope: no such folder"),
    ("not a run", (), "not a run folder (it has no train_config.yaml)"),
    ("finished", ("training.resume={run}",), "has trained 10 of training.steps=10: nothing left to "
                                             "train. Add training.steps=<more than 10>"),
    ("model", ("training.resume={run}", "training.steps=20", "model=tiny_dsv3"),
     "model=tiny_dsv3: a resumed run keeps model as it was (the checkpoint holds this model's "
     "weights)"),
    ("no checkpointing", ("training.resume={run}", "training.steps=20",
                          "training.checkpoint_enable=false"), "training.checkpoint_enable=false: "
                                                               "a resumed run loads its checkpoint"),
    ("two folders", ("training.resume={run}", "training.steps=20", "hydra.run.dir={run}2"),
     "name two folders"),
    ("into a run", ("hydra.run.dir={run}",), "already holds a run (train_config.yaml); launching "
                                             "into it would overwrite it. Continue it with "
                                             "training.resume={run}"),
])
def test_what_cannot_be_resumed_is_refused(tmp_path, case, overrides, text):
    run = tmp_path / "run"
    make_run(run, *RUN, checkpoints=(4, 10))
    if case == "missing":
        overrides = (f"training.resume={run}/nope",)
    elif case == "not a run":
        overrides = (f"training.resume={tmp_path}",)
    overrides = tuple(o.format(run=run) for o in overrides)
    assert text.format(run=run) in refused(*overrides)


def test_a_run_without_a_checkpoint_says_why(tmp_path):
    make_run(tmp_path / "off", "training.steps=10", checkpoints=())
    assert refused(f"training.resume={tmp_path / 'off'}").endswith(
        "has no complete checkpoint to resume from (it ran with training.checkpoint_enable=false). "
        "Start a new run (without training.resume), with training.checkpoint_enable=true to be "
        "able to resume it")
    make_run(tmp_path / "early", *RUN, complete=False)  # killed while writing its first one
    assert "it stopped before its first checkpoint was complete" in refused(
        f"training.resume={tmp_path / 'early'}")


def test_auto_says_whether_it_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _, line = prepared("training.resume=auto", *RUN)
    assert line.startswith("[mxfp8ep] training.resume=auto: no run of this experiment has a "
                           "checkpoint; starting a new run in outputs/default/")
    assert cfg.training.steps == 10
    make_run(tmp_path / "outputs" / "default" / "a", *RUN, checkpoints=(4,))
    cfg, _, line = prepared("training.resume=auto", "training.checkpoint_enable=true")
    assert line == (f"[mxfp8ep] training.resume=auto: resuming {Path('outputs/default/a')} from step "
                    f"4 (its newest checkpoint) with its saved config; nothing changed on the "
                    f"command line")
    assert cfg.training.seq_len == 32


def test_cli_resume_continues_the_run_with_its_config(tmp_path):
    """python launch/train.py training.resume=<run dir>: the launcher gets the run's config with
    the command line's changes, the run keeps its folder and wandb run, and its config file
    says what this launch runs."""
    run = tmp_path / "run"
    first = run_train(tmp_path, RECORDER, *RUN, f"hydra.run.dir={run}", timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    before = OmegaConf.load(run / RUN_CONFIG)
    (run / "checkpoint" / "step-6").mkdir(parents=True)
    (run / "checkpoint" / "step-6" / ".metadata").write_text("")

    proc = run_train(tmp_path, f"training.resume={run}", "training.steps=12", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == (
        f"[mxfp8ep] resuming {run} from step 6 (its newest checkpoint) with its saved config; "
        f"changed on the command line: training.steps=12")
    launched = OmegaConf.load(run / LAUNCHED)
    assert launched.training.steps == 12 and launched.training.seq_len == 32
    assert launched.logging.run_id == before.logging.run_id
    assert OmegaConf.load(run / RUN_CONFIG) == launched
    assert not (tmp_path / "outputs").exists()  # no new run was made


def test_cli_resume_of_a_folder_that_is_not_there_makes_nothing(tmp_path):
    proc = run_train(tmp_path, f"training.resume={tmp_path}/no/such/dir", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"[mxfp8ep] 1 problem(s) in the training config:\n  - "
                                  f"training.resume={tmp_path}/no/such/dir: no such folder")
    assert not (tmp_path / "no").exists() and not (tmp_path / "outputs").exists()
    proc = run_train(tmp_path, "--multirun", "training.resume=auto", "a2a=bf16,mxfp8", timeout=60)
    assert proc.returncode == 2 and "drop --multirun" in proc.stderr
    assert not (tmp_path / "multirun").exists()
