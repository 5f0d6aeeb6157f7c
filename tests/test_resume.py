"""training.resume (launch/run/resume.py, launch/preflight/prepare.py): a run folder continues with its saved
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

from launch.preflight.prepare import prepare, prepare_run, task_config
from launch.config.problems import ConfigError
from launch.run.run_dir import RUN_CONFIG
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
    """What launch.preflight.callbacks.PrepareRun does for this command line: (config, warnings, what it
    resumes)."""
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


# A run of 10 steps of a 30-step learning-rate schedule with checkpoints, trained at seq_len 32
# (not conf/'s 64).
RUN = ("training.checkpoint_enable=true", "training.checkpoint_interval=2", "training.steps=10",
       "training.lr_schedule_steps=30", "training.seq_len=32")


def test_resume_takes_the_runs_config_and_lists_the_changes(tmp_path):
    run = tmp_path / "outputs" / "run,a2a=bf16"  # folder names hold "," and "="
    saved = make_run(run, *RUN)
    cfg, _, resume = prepared(f"training.resume={run}")
    assert resume.line == (f"[mxfp8ep] resuming {run} from step 6 (its newest checkpoint) with its "
                           f"saved config; nothing changed on the command line")
    assert cfg.training.seq_len == 32 and cfg.training.steps == 10  # the run's, not conf/'s
    assert cfg.training.checkpoint_enable and cfg.logging.run_id == saved["logging"]["run_id"]

    cfg, _, resume = prepared(f"training.resume={run}", "training.steps=20", "training.checkpoint_interval=4",
                              "training.seq_len=32", "logging=none", "launcher.name=local")
    assert resume.line.endswith("changed on the command line: training.steps=20 "
                                "training.checkpoint_interval=4 logging=none; the learning-rate schedule "
                                "keeps its 30 steps (training.lr_schedule_steps=<n> changes it)")
    assert cfg.training.steps == 20 and cfg.training.checkpoint_interval == 4
    assert cfg.training.lr_schedule_steps == 30
    # a new logging group keeps the run's wandb run
    assert (cfg.logging.run_id, cfg.logging.run_name) == (saved["logging"]["run_id"],
                                                          saved["logging"]["run_name"])
    assert cfg.logging.wandb_mode == "disabled"


def test_a_resume_that_changes_what_the_run_measures_is_refused(tmp_path):
    """The a2a legs, the parallel layout, the model, the batch, the data, the optimizer: the run
    would measure one thing up to the checkpoint and another after it, under one name."""
    run = tmp_path / "run"
    make_run(run, *RUN)
    assert refused(f"training.resume={run}", "training.steps=20", "a2a=mxfp8") == (
        f"training.resume={run}: a resumed run keeps what it measures, but the command line changes "
        f"a2a=mxfp8 (was bf16); start a new run for that (a resume may change training.steps, "
        f"training.lr_schedule_steps, training.checkpoint_interval, training.checkpoint_keep, training.val_every, "
        f"training.profile_freq, launcher, logging, validate)")
    problem = refused(f"training.resume={run}", "training.steps=20", "a2a.kernel=torch",
                      "parallelism.ep=1", "model=tiny_dsv3", "training.seq_len=64", "training.lr=0.01",
                      "training.dataset=debian_docs", "experiment=other")
    changes = problem.split("the command line changes ")[1].split("; start a new run")[0].split(", ")
    assert sorted(changes) == sorted([
        "a2a.kernel=torch (was auto)", "parallelism.ep=1 (was 2)", "model=tiny_dsv3 (was tiny_llama4)",
        "training.seq_len=64 (was 32)", "training.lr=0.01 (was 0.0008)",
        "training.dataset=debian_docs (was mxfp8ep_tiny)", "experiment=other (was default)"])


@pytest.mark.parametrize("case,overrides,text", [
    ("missing", (), "training.resume={run}/nope: no such folder"),
    ("not a run", (), "not a run folder (it has no train_config.yaml)"),
    ("finished", ("training.resume={run}",), "has trained 10 of training.steps=10: nothing left to "
                                             "train. Add training.steps=<more than 10> to train it further"),
    ("checkpoint folder", ("training.resume={run}", "training.steps=20",
                           "training.checkpoint_folder=ckpt"),
     "training.checkpoint_folder=ckpt: a resumed run keeps training.checkpoint_folder as it was "
     "(its checkpoints are there)"),
    ("no checkpointing", ("training.resume={run}", "training.steps=20",
                          "training.checkpoint_enable=false"), "training.checkpoint_enable=false: "
                                                               "a resumed run loads its checkpoint"),
    ("two folders", ("training.resume={run}", "training.steps=20", "hydra.run.dir={run}2"),
     "name two folders"),
    ("into a run", ("hydra.run.dir={run}",), "already holds a run (train_config.yaml); launching "
                                             "into it would overwrite it. Continue it with "
                                             "training.resume={run}"),
    ("into a run without checkpoints", ("hydra.run.dir={run}",),
     "launching into it would overwrite it. It has no complete checkpoint to continue from either: "
     "choose a new hydra.run.dir"),
])
def test_what_cannot_be_resumed_is_refused(tmp_path, case, overrides, text):
    run = tmp_path / "run"
    make_run(run, *RUN, checkpoints=() if case == "into a run without checkpoints" else (4, 10))
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


def test_a_run_of_another_torchtitan_release_is_refused(tmp_path):
    """Its checkpoints hold that release's model and optimizer state: it continues only where
    that release is installed (its stack.json says which); a run of this release resumes."""
    from launch.config.stack import Stack, installed
    from launch.run.run_dir import STACK

    here = installed()
    other = "0.3.0" if here.torchtitan == "0.2.2" else "0.2.2"
    run = tmp_path / "run"
    make_run(run, *RUN)
    Stack(torchtitan=other, torch="2.11.0+cu130", triton="3.6.0").write(run / STACK)
    install = "bash scripts/install.sh" + (" --torchtitan 0.3.0" if other == "0.3.0" else "")
    assert refused(f"training.resume={run}") == (
        f"training.resume={run}: the run trained on torchtitan {other} (torchtitan {other}, torch 2.11.0+cu130, "
        f"triton 3.6.0) and this environment runs torchtitan {here.torchtitan}; its checkpoints hold {other}'s "
        f"model and optimizer state. Continue it where torchtitan {other} is installed (`{install}`), or start "
        f"a new run")
    here.write(run / STACK)
    assert prepared(f"training.resume={run}")[2].step == 6


def test_auto_says_whether_it_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _, resume = prepared("training.resume=auto", *RUN)
    assert resume.line.startswith("[mxfp8ep] training.resume=auto: no run of this experiment has a "
                                  "checkpoint; starting a new run in outputs/default/")
    assert cfg.training.steps == 10
    make_run(tmp_path / "outputs" / "default" / "a", *RUN, checkpoints=(4,))
    cfg, _, resume = prepared("training.resume=auto", "training.checkpoint_enable=true")
    assert resume.line == (f"[mxfp8ep] training.resume=auto: resuming {Path('outputs/default/a')} from "
                           f"step 4 (its newest checkpoint) with its saved config; nothing changed on "
                           f"the command line")
    assert cfg.training.seq_len == 32


def test_cli_resume_continues_the_run_and_keeps_its_record(tmp_path):
    """python launch/train.py training.resume=<run dir>: the launcher gets the run's config with
    the command line's changes, the run keeps its folder and wandb run; the first launch's
    record stays as it was, each resume's config and command line is kept beside it, and
    console.log holds every launch's lines, each resume below a line that names it."""
    run = tmp_path / "run"
    first = run_train(tmp_path, RECORDER, *RUN, f"hydra.run.dir={run}", timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {name: (run / name).read_text() for name in (RUN_CONFIG, ".hydra/config.yaml",
                                                          ".hydra/overrides.yaml")}
    (run / "checkpoint" / "step-6").mkdir(parents=True)
    (run / "checkpoint" / "step-6" / ".metadata").write_text("")

    proc = run_train(tmp_path, f"training.resume={run}", "training.steps=12", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == (
        f"[mxfp8ep] resuming {run} from step 6 (its newest checkpoint) with its saved config; "
        f"changed on the command line: training.steps=12; the learning-rate schedule keeps its 30 steps "
        f"(training.lr_schedule_steps=<n> changes it)")
    launched = OmegaConf.load(run / LAUNCHED)
    assert launched.training.steps == 12 and launched.training.seq_len == 32
    assert launched.logging.run_id == OmegaConf.load(run / RUN_CONFIG).logging.run_id
    assert {name: (run / name).read_text() for name in before} == before  # the first launch's record
    assert OmegaConf.load(run / "resumes" / "1" / RUN_CONFIG) == launched
    assert list(OmegaConf.load(run / "resumes" / "1" / ".hydra" / "overrides.yaml")) == [
        f"training.resume='{run}'", "training.steps=12"]
    assert not (tmp_path / "outputs").exists()  # no new run was made

    # A second resume starts from what the first one ran (12 steps), not the first launch.
    (run / "checkpoint" / "step-12").mkdir(parents=True)
    (run / "checkpoint" / "step-12" / ".metadata").write_text("")
    proc = run_train(tmp_path, f"training.resume={run}", "training.steps=14", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert OmegaConf.load(run / "resumes" / "2" / RUN_CONFIG).training.steps == 14
    lines = (run / "console.log").read_text().splitlines()
    assert lines[0] == "launched to step 10" and lines[2] == "launched to step 12"
    assert lines[1].startswith("==== resume 1 (") and lines[1].endswith(
        "): from step 6, changed on the command line: training.steps=12; the learning-rate schedule keeps its "
        "30 steps (training.lr_schedule_steps=<n> changes it); its config in resumes/1/ ====")
    assert lines[3].startswith("==== resume 2 (") and "from step 12" in lines[3]
    assert lines[4:] == ["launched to step 14"]
    log = (run / "train.log").read_text()  # the launching process's record, every launch's
    assert log.count("launch: ") == 3 and "resuming" in log


def test_cli_resume_of_a_folder_that_is_not_there_makes_nothing(tmp_path):
    proc = run_train(tmp_path, f"training.resume={tmp_path}/no/such/dir", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"[mxfp8ep] 1 problem(s) in the training config:\n  - "
                                  f"training.resume={tmp_path}/no/such/dir: no such folder")
    assert not (tmp_path / "no").exists() and not (tmp_path / "outputs").exists()
    proc = run_train(tmp_path, "--multirun", "training.resume=auto", "a2a=bf16,mxfp8", timeout=60)
    assert proc.returncode == 2 and "drop --multirun" in proc.stderr
    assert not (tmp_path / "multirun").exists()


def test_a_resume_keeps_the_runs_learning_rate_schedule(tmp_path):
    """torchtitan decays the learning rate over the schedule's length: a resume that changes
    training.steps keeps the length the run started with (saying so), a longer one is asked
    for explicitly (recorded and said), and training past the schedule is refused."""
    run = tmp_path / "run"
    make_run(run, "training.checkpoint_enable=true", "training.steps=300", checkpoints=(80,))
    assert OmegaConf.load(run / RUN_CONFIG).training.lr_schedule_steps == 300  # fixed at the first launch
    cfg, _, resume = prepared(f"training.resume={run}", "training.steps=90")
    assert cfg.training.lr_schedule_steps == 300 and cfg.training.steps == 90
    assert resume.line.endswith("changed on the command line: training.steps=90; the learning-rate "
                                "schedule keeps its 300 steps (training.lr_schedule_steps=<n> changes it)")
    assert refused(f"training.resume={run}", "training.steps=400") == (
        "training.steps=400 goes past the run's learning-rate schedule of 300 steps (training.lr_schedule_steps, "
        "fixed at its first launch): after step 300 the learning rate would be 0. To train on, give the schedule "
        "that length too: training.lr_schedule_steps=400 (the learning rate then follows the longer schedule "
        "from the step it resumes at)")
    cfg, _, resume = prepared(f"training.resume={run}", "training.steps=400", "training.lr_schedule_steps=400")
    assert cfg.training.lr_schedule_steps == 400
    assert resume.line.endswith("changed on the command line: training.steps=400 training.lr_schedule_steps=400; "
                                "the learning-rate schedule spans 400 steps (was 300)")
    # a run saved before the schedule had a field of its own: its training.steps
    saved = OmegaConf.load(run / RUN_CONFIG)
    del saved.training["lr_schedule_steps"]
    (run / RUN_CONFIG).write_text(OmegaConf.to_yaml(saved))
    cfg, _, _ = prepared(f"training.resume={run}", "training.steps=90")
    assert cfg.training.lr_schedule_steps == 300
    assert "has trained 80 of training.steps=80: nothing left to train. Add training.steps=<more than 80> " \
           "to train it further" in refused(f"training.resume={run}", "training.steps=80")
    make_run(tmp_path / "done", "training.checkpoint_enable=true", "training.steps=10", checkpoints=(10,))
    assert refused(f"training.resume={tmp_path / 'done'}").endswith(
        "nothing left to train. Add training.steps=<more than 10> and training.lr_schedule_steps=<as many> "
        "(its learning-rate schedule ends at step 10) to train it further")


def test_a_resume_changes_fields_of_the_runs_own_launcher(tmp_path):
    """training.resume=<a SLURM run> launcher.wait=true: the command line is composed on the
    run's launcher (slurm), whose fields stay the run's; launcher=local's has no launcher.wait."""
    from launch.run.resume import with_the_runs_options
    from tests.hydra_compose import REPO

    run = tmp_path / "run"
    make_run(run, *RUN, "launcher=slurm", "launcher.partition=debug", "launcher.gpus_per_node=0")
    args = with_the_runs_options([f"training.resume={run}", "launcher.wait=true"], REPO / "conf")
    assert args == [f"training.resume={run}", "launcher.wait=true", "launcher=slurm"]
    cfg, _, resume = prepared(*args)
    assert cfg.launcher.wait is True and cfg.launcher.partition == "debug" and cfg.launcher.gpus_per_node == 0
    assert resume.changed == ["launcher.wait=true"]
    # a new run, or a resume that picks its launcher, is left as it is
    assert with_the_runs_options(["training.steps=3"], REPO / "conf") == ["training.steps=3"]
    assert with_the_runs_options([f"training.resume={run}", "launcher=local", "logging=none"],
                                 REPO / "conf") == [f"training.resume={run}", "launcher=local", "logging=none"]


def test_cfg_job_of_a_resume_shows_the_runs_config_with_the_changes(tmp_path):
    run = tmp_path / "run"
    saved = make_run(run, *RUN)
    proc = run_train(tmp_path, "--cfg", "job", f"training.resume={run}", "training.steps=12", timeout=60)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout.split("\n", 1)[1])
    assert cfg.training.steps == 12 and cfg.training.seq_len == 32 and cfg.training.lr_schedule_steps == 30
    assert cfg.logging.run_id == saved["logging"]["run_id"]  # the run's own wandb run
    assert not (run / "resumes").exists()  # nothing claimed or started
