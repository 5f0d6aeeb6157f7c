"""SLURM submission built from the config, without a cluster: ``slurm_executor_params`` and
the sbatch script submitit would submit; the job object's requeue contract."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import submitit
from tests.hydra_compose import compose_cfg, no_slurm_cluster  # noqa: F401 (autouse)

from launch.launchers import slurm_cluster
from launch.launchers.launcher import RunRefused
from launch.launchers.machine import GIB, Machine
from launch.config.problems import Report
from launch.launchers.slurm import SlurmTrainJob, slurm_executor_kwargs, slurm_executor_params
from launch.config.schema import config_from_yaml, config_to_yaml


def sbatch_script(cfg, tmp_path: Path) -> str:
    """The batch script submitit would hand to sbatch for this config (no SLURM needed:
    submitit only asks srun for the CPU affinity)."""
    from unittest import mock

    from submitit.slurm.slurm import SlurmExecutor

    with mock.patch.object(SlurmExecutor, "affinity", return_value=1):
        ex = submitit.AutoExecutor(folder=tmp_path / "slurm", cluster="slurm",
                                   **slurm_executor_kwargs(cfg))
    ex.update_parameters(**slurm_executor_params(cfg))  # rejects unknown parameter names
    return ex._executor._make_submission_file_text(ex._executor._submitit_command_str, "uid")


def test_default_slurm_params():
    cfg = compose_cfg("launcher=slurm")
    p = slurm_executor_params(cfg, workdir="/repo")
    assert p["nodes"] == 1 and p["tasks_per_node"] == 2 and p["gpus_per_node"] == 2
    assert p["timeout_min"] == 60 and p["name"] == "mxfp8ep-default"
    # `launch` is an installed package: the job needs no PYTHONPATH edits
    for absent in ("slurm_partition", "slurm_account", "slurm_qos", "slurm_constraint",
                   "slurm_exclusive", "mem_gb", "cpus_per_task", "slurm_setup",
                   "slurm_additional_parameters"):
        assert absent not in p
    assert slurm_executor_kwargs(cfg) == {"slurm_max_num_timeout": 3}
    # A dead rank ends the job instead of leaving NCCL peers waiting for their timeout.
    assert p["slurm_srun_args"] == ["--kill-on-bad-exit=1"]


def test_two_nodes_full_params(tmp_path):
    cfg = compose_cfg(
        "launcher=slurm", "parallelism=2nodes_8gpus", "model=dsv3_16b", "experiment=abl",
        "launcher.partition=gpu", "launcher.account=proj", "launcher.qos=high",
        "launcher.constraint=h200", "launcher.exclusive=true", "launcher.mem_gb=900",
        "launcher.cpus_per_task=12", "launcher.time_min=240", "launcher.max_num_timeout=5",
        "+launcher.additional_parameters.reservation=res1",
        "launcher.setup=[module load cuda,source /venv/bin/activate]",
        "launcher.srun_args=['--cpu-bind=none']",
    )
    p = slurm_executor_params(cfg, workdir="/repo")
    assert p["nodes"] == 2 and p["tasks_per_node"] == 8 and p["gpus_per_node"] == 8
    assert p["slurm_partition"] == "gpu" and p["slurm_account"] == "proj"
    assert p["slurm_qos"] == "high" and p["slurm_constraint"] == "h200"
    assert p["slurm_exclusive"] is True
    assert p["mem_gb"] == 900 and p["cpus_per_task"] == 12 and p["timeout_min"] == 240
    assert p["slurm_additional_parameters"] == {"reservation": "res1"}
    assert p["slurm_setup"] == ["module load cuda", "source /venv/bin/activate"]
    assert p["slurm_srun_args"] == ["--kill-on-bad-exit=1", "--cpu-bind=none"]
    assert p["name"] == "mxfp8ep-abl"
    assert slurm_executor_kwargs(cfg)["slurm_max_num_timeout"] == 5

    script = sbatch_script(cfg, tmp_path)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --qos=high",
                 "#SBATCH --constraint=h200", "#SBATCH --exclusive", "#SBATCH --mem=900GB",
                 "#SBATCH --cpus-per-task=12", "#SBATCH --time=240", "#SBATCH --reservation=res1",
                 "#SBATCH --job-name=mxfp8ep-abl", "module load cuda"):
        assert line in script, f"{line!r} missing from\n{script}"
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--cpu-bind=none" in srun


def test_container_image_goes_to_srun(tmp_path):
    cfg = compose_cfg("launcher=slurm", "launcher.container_image=/img/mxfp8ep.sqsh",
                      "launcher.container_mounts='/data:/data,/repo:/repo'")
    p = slurm_executor_params(cfg, workdir="/repo")
    assert p["slurm_srun_args"] == [
        "--kill-on-bad-exit=1",
        "--container-image=/img/mxfp8ep.sqsh",
        "--container-mounts=/data:/data,/repo:/repo",
        "--container-workdir=/repo",
    ]
    # inside the image, "python" – not the login node's interpreter path
    assert slurm_executor_kwargs(cfg)["slurm_python"] == "python"
    script = sbatch_script(cfg, tmp_path)
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--container-image=/img/mxfp8ep.sqsh" in srun and f"--container-workdir={Path.cwd()}" in srun
    assert " python -u -m submitit.core._submit" in srun


def test_cpu_cluster_requests_no_gpus(tmp_path):
    cfg = compose_cfg("launcher=slurm", "launcher.gpus_per_node=0")
    assert "gpus_per_node" not in slurm_executor_params(cfg)
    assert "gpus-per-node" not in sbatch_script(cfg, tmp_path)


def test_explicit_gpus_per_node():
    cfg = compose_cfg("launcher=slurm", "launcher.gpus_per_node=4")
    assert slurm_executor_params(cfg)["gpus_per_node"] == 4


def test_job_name_override():
    cfg = compose_cfg("launcher=slurm", "launcher.job_name=myrun")
    assert slurm_executor_params(cfg)["name"] == "myrun"


def test_every_recipe_builds_params(tmp_path):
    for recipe in ("llama4_ep8_bf16_vs_mxfp8", "dsv3_16b_2nodes_sweep"):
        cfg = compose_cfg(f"+recipe={recipe}")
        p = slurm_executor_params(cfg)
        assert p["nodes"] * p["tasks_per_node"] == cfg.parallelism.nodes * cfg.parallelism.procs_per_node
        assert p["slurm_exclusive"] is True
        sbatch_script(cfg, tmp_path / recipe)


# ---------------------------------------------------------------------- the job
def test_config_round_trips_through_the_job(tmp_path):
    cfg = compose_cfg("launcher=slurm", "launcher.gpus_per_node=0", "a2a=mxfp8")
    back = config_from_yaml(config_to_yaml(cfg))
    assert back == cfg
    assert back.launcher.gpus_per_node == 0


def test_job_pickles_and_requeues_itself(tmp_path):
    cfg = compose_cfg("launcher=slurm", "training.checkpoint_enable=true")
    job = SlurmTrainJob(config_to_yaml(cfg), str(tmp_path), script="launch/train.py")
    job = pickle.loads(pickle.dumps(job))
    delayed = job.checkpoint()
    assert isinstance(delayed, submitit.helpers.DelayedSubmission)
    again = delayed.function
    assert isinstance(again, SlurmTrainJob)
    assert again.cfg_yaml == job.cfg_yaml and again.run_dir == job.run_dir
    assert again.requeues == 1 and again.script == "launch/train.py"  # its resume command's
    assert again.checkpoint().function.requeues == 2


def test_submit_without_sbatch_says_what_to_do(monkeypatch, tmp_path):
    import launch.launchers.slurm as slurm

    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    with pytest.raises(RunRefused, match="needs the SLURM client"):
        slurm.submit(compose_cfg("launcher=slurm"), str(tmp_path))


# ------------------------------------------------------------- what SLURM says
# What sinfo -h -o '%P|%D|%G|%l' prints: the local test cluster (no GPUs), and a GPU site.
SINFO_CPU = "debug*|2|(null)|infinite\nshort|2|(null)|5:00\n"
SINFO_GPU = ("cpu*|40|(null)|1-00:00:00\ngpu|12|gpu:h200:8(S:0-1)|2-00:00:00\n"
             "gpu|4|gpu:h200:8(S:0-1),nvme:1|2-00:00:00\ndev|2|gpu:2|30:00\n")


def test_sinfo_partitions_are_read():
    cpu = slurm_cluster.parse_sinfo(SINFO_CPU)
    assert cpu["debug"] == slurm_cluster.Partition("debug", True, 2, 0, None)
    assert cpu["short"].time_limit_min == 5 and not cpu["short"].default
    gpu = slurm_cluster.parse_sinfo(SINFO_GPU)
    assert gpu["gpu"] == slurm_cluster.Partition("gpu", False, 16, 8, 2 * 24 * 60)
    assert gpu["dev"].gpus_per_node == 2 and gpu["dev"].time_limit_min == 30
    assert slurm_cluster.parse_time_min("1:30:00") == 90
    assert slurm_cluster.parse_time_min("UNLIMITED") is None


def cluster_problems(sinfo: str, *overrides: str) -> Report:
    cfg = compose_cfg("launcher=slurm", "training.checkpoint_enable=true", *overrides)
    report = Report()
    view = slurm_cluster.ClusterView(slurm_cluster.parse_sinfo(sinfo))
    slurm_cluster.check_request(cfg, slurm_executor_params(cfg).get("gpus_per_node", 0), report, view)
    return report


def test_gpus_asked_on_a_cluster_without_gpus_name_the_option():
    (msg,) = cluster_problems(SINFO_CPU).errors  # launcher=slurm, nothing else
    assert msg == ("the job asks for 2 GPUs per node (launcher.gpus_per_node=null: one per process "
                   "of parallelism=ep2), but partition debug (SLURM's default) has no GPUs (sinfo "
                   "lists no gres/gpu); set launcher.gpus_per_node=0 to run CPU processes (gloo) on "
                   "a cluster without GPUs")
    assert cluster_problems(SINFO_CPU, "launcher.gpus_per_node=0").errors == []
    (msg,) = cluster_problems(SINFO_GPU, "launcher.partition=cpu").errors
    assert "launcher.partition=<one with GPUs: dev, gpu>" in msg


def test_partition_gpus_nodes_and_time_against_sinfo():
    (msg,) = cluster_problems(SINFO_CPU, "launcher.partition=nosuch").errors
    assert msg == ("launcher.partition='nosuch': use one of ['debug', 'short'] (the partitions sinfo "
                   "lists)")
    (msg,) = cluster_problems(SINFO_GPU, "launcher.partition=gpus").errors
    assert "did you mean launcher.partition=gpu?" in msg
    assert cluster_problems(SINFO_GPU, "launcher.partition=gpu", "parallelism=2nodes_8gpus",
                            "model=dsv3_16b").errors == []
    (msg,) = cluster_problems(SINFO_GPU, "launcher.partition=dev", "launcher.time_min=30",
                              "parallelism=ep8", "model=llama4_debugmodel").errors
    assert "at most 2" in msg and "parallelism.procs_per_node" in msg
    found = cluster_problems(SINFO_CPU, "launcher.gpus_per_node=0", "launcher.partition=short",
                             "parallelism.nodes=3", "parallelism.ep=2").errors
    assert any("parallelism.nodes=3, but partition short has 2 node(s)" in p for p in found)
    assert any("launcher.time_min=60 exceeds the time limit of partition short (5 min)" in p
               for p in found)


def test_a_cluster_that_does_not_answer():
    cfg = compose_cfg("launcher=slurm", "launcher.gpus_per_node=0")
    report = Report()
    down = slurm_cluster.ClusterView({}, "slurm_load_partitions: Unable to contact slurm controller")
    slurm_cluster.check_request(cfg, 0, report, down)
    (msg,) = report.errors
    assert "SLURM does not answer" in msg and "scontrol ping" in msg
    report = Report()
    slurm_cluster.check_request(cfg, 0, report, slurm_cluster.ClusterView({}, "slow", timed_out=True))
    assert report.errors == [] and "checked only when sbatch submits" in report.warnings[0]


def test_a_controller_that_is_down_is_an_error_before_sinfo(tmp_path, monkeypatch):
    """A controller that is down: `scontrol ping` says so at once, where sinfo would retry for
    ~10 s and then time out the check into a warning; the launch is refused before sbatch."""
    import stat

    monkeypatch.undo()  # the autouse fixture's "no cluster": ask the fake clients below
    for name, text in (("scontrol", "#!/bin/sh\necho 'Slurmctld(primary) at ctl is DOWN'\nexit 1\n"),
                       ("sinfo", f"#!/bin/sh\ntouch {tmp_path}/sinfo-ran\nsleep 30\n")):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    report = Report()
    slurm_cluster.check_request(compose_cfg("launcher=slurm"), 2, report)
    (msg,) = report.errors
    assert msg == ("launcher=slurm: SLURM does not answer (scontrol ping: Slurmctld(primary) at ctl "
                   "is DOWN); check that the cluster is up (`scontrol ping`), or use launcher=local")
    assert report.warnings == [] and not (tmp_path / "sinfo-ran").exists()

    # a backup controller that is up: sinfo is asked as usual
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho 'Slurmctld(primary) at ctl is DOWN'\n"
                                       "echo 'Slurmctld(backup) at ctl2 is UP'\nexit 1\n")
    (tmp_path / "sinfo").write_text("#!/bin/sh\necho 'debug*|2|(null)|infinite'\n")
    report = Report()
    slurm_cluster.check_request(compose_cfg("launcher=slurm", "launcher.gpus_per_node=0"), 0, report)
    assert report.errors == [] and report.warnings == []


def test_validation_asks_sinfo_for_launcher_slurm(monkeypatch):
    from launch.preflight.validate import ConfigError, validate

    view = slurm_cluster.ClusterView(slurm_cluster.parse_sinfo(SINFO_CPU))
    monkeypatch.setattr(slurm_cluster, "partitions", lambda: view)
    with pytest.raises(ConfigError, match="launcher.gpus_per_node=0"):
        validate(compose_cfg("launcher=slurm"), machine=Machine(24 * GIB, 2))
    validate(compose_cfg("launcher=slurm", "launcher.gpus_per_node=0"), machine=Machine(24 * GIB, 2))


# sbatch's own words (SLURM 22.05), as submitit raises them.
@pytest.mark.parametrize("stderr,option", [
    ("sbatch: error: Invalid generic resource (gres) specification",
     "launcher.gpus_per_node: the job asks for 2 GPUs per node (launcher.gpus_per_node=null"),
    ("sbatch: error: invalid partition specified: nosuch\nsbatch: error: Batch job submission "
     "failed: Invalid partition name specified", "launcher.partition"),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition "
     "combination specified", "launcher.account"),
    ("sbatch: error: Batch job submission failed: Invalid qos specification", "launcher.qos"),
    ("sbatch: error: Batch job submission failed: Requested time limit is invalid (missing or "
     "exceeds some limit)", "launcher.time_min"),
    ("sbatch: error: Batch job submission failed: Node count specification invalid",
     "parallelism.nodes"),
    ("sbatch: error: Batch job submission failed: Invalid feature specification",
     "launcher.constraint"),
    ("sbatch: error: Memory specification can not be satisfied\nsbatch: error: Batch job "
     "submission failed: Requested node configuration is not available", "launcher.mem_gb"),
    ("sbatch: error: Batch job submission failed: More processors requested than permitted",
     "launcher.cpus_per_task"),
])
def test_sbatch_refusals_name_the_option(stderr, option):
    msg = slurm_cluster.explain_refusal(stderr, compose_cfg("launcher=slurm"), 2)
    last = stderr.splitlines()[-1]
    assert msg.startswith(f"SLURM refused the job: {last}. Change {option}"), msg
    assert "\n" not in msg


FAKE_SBATCH = """#!/bin/sh
echo "sbatch: error: Invalid generic resource (gres) specification" >&2
exit 1
"""


@pytest.fixture
def refusing_sbatch(tmp_path, monkeypatch):
    """PATH with an sbatch that refuses every job as a cluster without GPUs does, an srun (what
    submitit looks for) and no sinfo (so nothing is checked before submitting)."""
    import stat
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", "#!/bin/sh\nexit 0\n")):
        exe = bin_dir / name
        exe.write_text(text)
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}")
    return bin_dir


def test_an_sbatch_refusal_is_one_message(refusing_sbatch, tmp_path, capsys):
    import launch.launchers.slurm as slurm

    with pytest.raises(RunRefused) as e:
        slurm.submit(compose_cfg("launcher=slurm"), str(tmp_path))
    assert str(e.value).startswith("SLURM refused the job: sbatch: error: Invalid generic resource "
                                   "(gres) specification. Change launcher.gpus_per_node")
    assert capsys.readouterr().err == ""  # submitit's own print of sbatch's stderr is not shown


def test_submitit_errors_are_one_message(refusing_sbatch, tmp_path, monkeypatch):
    import launch.launchers.slurm as slurm

    (refusing_sbatch / "srun").unlink()
    with pytest.raises(RunRefused, match="submitit cannot submit from here .*srun.*launcher=local"):
        slurm.submit(compose_cfg("launcher=slurm"), str(tmp_path))
    (refusing_sbatch / "srun").write_text("#!/bin/sh\n")
    (refusing_sbatch / "srun").chmod(0o755)
    params = slurm.slurm_executor_params  # one submitit does not know, as a newer key would be
    monkeypatch.setattr(slurm, "slurm_executor_params", lambda cfg: {**params(cfg), "slurm_no_such": 1})
    with pytest.raises(RunRefused, match="submitit rejected the job.s parameters .*slurm_no_such"):
        slurm.submit(compose_cfg("launcher=slurm"), str(tmp_path))


def test_cli_sbatch_refusal_exits_2_without_a_traceback(refusing_sbatch, tmp_path):
    from tests.train_cli import run_train

    proc = run_train(tmp_path, "launcher=slurm", "logging=none", PATH=os.environ["PATH"],
                     timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("[mxfp8ep] SLURM refused the job: sbatch: error: Invalid generic "
                                "resource (gres) specification. Change launcher.gpus_per_node")
    assert "Traceback" not in proc.stderr
    proc = run_train(tmp_path, "launcher=slurm", "logging=none", "logging.verbose=true",
                     PATH=os.environ["PATH"], timeout=120)
    assert proc.returncode == 2 and "Traceback" in proc.stderr  # asked for: the whole story


def test_a_launch_whose_folder_name_is_taken_gets_its_own_folder(tmp_path):
    """Two launches in the same second with the same overrides: the second runs in
    ``<name>_2`` instead of being refused (or overwriting the first)."""
    import datetime

    from launch.run.run_dir import RUN_CONFIG
    from tests.train_cli import run_train

    runs = tmp_path / "outputs" / "default"
    now = datetime.datetime.now()
    taken = [f"{now + datetime.timedelta(seconds=s):%Y-%m-%d_%H-%M-%S}_a2a=bf16" for s in range(-1, 90)]
    for name in taken:  # whatever second the launch lands in, its folder name is taken
        (runs / name).mkdir(parents=True)
        (runs / name / RUN_CONFIG).write_text("an earlier run\n")
    proc = run_train(tmp_path, "launcher._target_=tests.launch_recorder.Recorder", "logging=none",
                     timeout=120)
    assert proc.returncode == 0, proc.stderr
    (new,) = [d for d in runs.iterdir() if d.name not in taken]
    assert new.name in {f"{name}_2" for name in taken}
    assert (new / RUN_CONFIG).read_text() != "an earlier run\n"
    assert all((runs / name / RUN_CONFIG).read_text() == "an earlier run\n" for name in taken)


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): (p.read_bytes() if p.is_file() else b"")
            for p in sorted(d.rglob("*"))}


def test_a_refused_launch_leaves_no_trace(refusing_sbatch, tmp_path):
    """sbatch refuses: a new run leaves no folder behind, a resumed run its folder as it was
    (no resumes/<n>, no submitit files, no lines in its logs): resume and compare_runs never
    meet a run that never ran."""
    from launch.run.run_dir import RUN_CONFIG
    from tests.train_cli import run_train

    proc = run_train(tmp_path, "launcher=slurm", "logging=none", PATH=os.environ["PATH"], timeout=120)
    assert proc.returncode == 2 and "SLURM refused the job" in proc.stderr, proc.stderr
    assert not (tmp_path / "outputs").exists()

    run = tmp_path / "run"
    proc = run_train(tmp_path, "launcher._target_=tests.launch_recorder.Recorder", "logging=none",
                     "training.checkpoint_enable=true", "training.lr_schedule_steps=30", f"hydra.run.dir={run}",
                     timeout=120)
    assert proc.returncode == 0, proc.stderr
    (run / "checkpoint" / "step-10").mkdir(parents=True)
    (run / "checkpoint" / "step-10" / ".metadata").write_text("")
    (run / "slurm").mkdir()
    (run / "slurm" / "7_submitted.pkl").write_text("an earlier job")
    before = _tree(run)
    proc = run_train(tmp_path, f"training.resume={run}", "training.steps=30", "launcher=slurm",
                     PATH=os.environ["PATH"], timeout=120)
    assert proc.returncode == 2 and "SLURM refused the job" in proc.stderr, proc.stderr
    assert _tree(run) == before
    assert (run / RUN_CONFIG).is_file()


def test_a_slurm_sweep_does_not_say_it_launches_locally(refusing_sbatch, tmp_path):
    from tests.train_cli import run_train

    proc = run_train(tmp_path, "--multirun", "launcher=slurm", "logging=none", "a2a=bf16,mxfp8",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", PATH=os.environ["PATH"], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "SLURM refused the job" in proc.stderr, out
    assert "locally" not in out and "[HYDRA]" not in out
    assert "[mxfp8ep] sweep of 2 runs, launched one after another with launcher=slurm" in proc.stdout
    assert not list((tmp_path / "sweep").glob("*/*"))  # the refused point's folder is gone


def test_site_launcher_file_built_on_the_slurm_one(tmp_path):
    """A cluster's own defaults as conf/launcher/<site>.yaml on top of slurm.yaml: launched
    with SLURM (its _target_), no Python change."""
    import shutil

    from hydra import compose, initialize_config_dir
    from tests.hydra_compose import CONF

    from launch.launchers.launcher import launcher_for
    from launch.launchers.slurm import SlurmLauncher
    from launch.preflight.validate import validate

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf, symlinks=True)
    (conf / "launcher" / "mycluster.yaml").write_text(
        "defaults:\n  - slurm\n  - _self_\n"
        "name: mycluster\npartition: h200\naccount: team\nconstraint: nvlink\n"
    )
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("train", overrides=["launcher=mycluster", "training.checkpoint_enable=true"])
    assert isinstance(launcher_for(cfg), SlurmLauncher)
    assert validate(cfg) == []
    p = slurm_executor_params(cfg)
    assert (p["slurm_partition"], p["slurm_account"], p["slurm_constraint"]) == ("h200", "team", "nvlink")
    assert config_from_yaml(config_to_yaml(cfg)) == cfg


@pytest.mark.parametrize("signalled", [True, False], ids=["running", "not_signalled"])
def test_ctrl_c_while_waiting_stops_the_job_at_a_step_boundary(tmp_path, monkeypatch, signalled):
    """launcher.wait=true: Ctrl-C sends the tasks SIGINT (scancel --signal=INT: they stop at the
    next step boundary, as a local run does) and waits until no process of the job is left; the
    job is cancelled at once only where it cannot be signalled (e.g. still pending)."""
    from launch.launchers.launcher import RunStopped
    from launch.launchers.slurm import SlurmSubmission, _wait

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "scancel").write_text(f"#!/bin/sh\necho scancel \"$@\" >> {calls}\nexit {0 if signalled else 1}\n")
    # squeue lists the job RUNNING twice, COMPLETING once, then no more
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho squeue >> {calls}\nn=$(grep -c squeue {calls})\n"
                                    f"[ $n -le 2 ] && echo RUNNING; [ $n -eq 3 ] && echo COMPLETING; exit 0\n")
    for tool in ("scancel", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    class Job:
        cancelled = False

        def results(self):
            raise KeyboardInterrupt

        def cancel(self, check=True):
            Job.cancelled = True

        def get_info(self, mode="cache"):
            return {"State": "COMPLETED" if signalled else "CANCELLED by 0"}

    with pytest.raises(RunStopped) as e:
        _wait(Job(), SlurmSubmission("7", "log", str(tmp_path)), str(tmp_path))
    assert e.value.signum == 2 and e.value.summary is None
    assert calls.read_text().splitlines() == ["scancel --signal=INT 7", "squeue", "squeue", "squeue", "squeue"]
    assert Job.cancelled is not signalled


def test_every_task_of_a_job_listens_and_connects_on_one_port_below_the_ephemeral_range():
    """MASTER_PORT comes from the job id (the same on every task), below Linux's default
    ephemeral range (32768-60999: where any outgoing connection may hold it); one the job was
    given is kept."""
    from unittest import mock

    from launch.launchers.slurm import export_distributed_env

    def task_env(job_id: str, rank: int, **extra: str) -> dict:
        slurm = {"SLURM_JOB_ID": job_id, "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "2",
                 "SLURM_NODEID": str(rank), "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_PROCID": str(rank),
                 "SLURM_LOCALID": "0", "_TEST_CLUSTER_": "slurm", **extra}
        with mock.patch.dict(os.environ, slurm):
            if "MASTER_PORT" not in extra:
                os.environ.pop("MASTER_PORT", None)
            env = export_distributed_env()
            return {"port": int(os.environ["MASTER_PORT"]), "addr": os.environ["MASTER_ADDR"],
                    "rank": env.rank, "world": os.environ["WORLD_SIZE"]}

    ports = set()
    for job in range(1, 400):
        first, second = task_env(str(job), 0), task_env(str(job), 1)
        assert first["port"] == second["port"] and first["addr"] == second["addr"] == "n1"
        assert (first["rank"], second["rank"], first["world"]) == (0, 1, "2")
        ports.add(first["port"])
    assert min(ports) >= 20000 and max(ports) < 32768
    assert len(ports) > 350  # jobs sharing a first node draw different ports
    assert task_env("160", 0, MASTER_PORT="29511")["port"] == 29511


@pytest.mark.parametrize("wait", [False, True])
def test_the_job_itself_records_how_it_ended(tmp_path, monkeypatch, wait):
    """Rank 0 of a SLURM job writes ``ended`` (and when) into summary.json, whether or not a
    launcher waits for the job, and gives up the job's hold on the run dir; a job that failed
    before rank 0 wrote a summary gets one from its config."""
    from launch.run import run_lock
    from launch.run.run_summary import RunSummary

    cfg = compose_cfg("launcher=slurm", f"launcher.wait={str(wait).lower()}")
    job = SlurmTrainJob(config_to_yaml(cfg), str(tmp_path))
    RunSummary.before_training(cfg, tmp_path).write(tmp_path)
    (tmp_path / run_lock.HOLD).write_text('{"host": "n1", "job_id": "41"}')
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    job._record_end(1, "completed step 3/3")  # not rank 0: nothing
    assert RunSummary.read(tmp_path).ended is None
    job._record_end(0, "completed step 3/3")
    s = RunSummary.read(tmp_path)
    assert s.ended == "completed step 3/3" and s.ended_at is not None
    assert not (tmp_path / run_lock.HOLD).exists()
    ending = "==== ended" in (tmp_path / "console.log").read_text() if (tmp_path / "console.log").exists() else False
    assert ending is not wait  # a waiting launcher writes console.log's line itself

    (tmp_path / "summary.json").unlink()
    job._record_end(0, "failed on rank 0: ValueError: x")
    s = RunSummary.read(tmp_path)
    assert s.ended == "failed on rank 0: ValueError: x" and s.steps == 0 and s.launcher == "slurm"
