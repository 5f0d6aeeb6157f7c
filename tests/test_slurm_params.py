"""SLURM submission built from the config, without a cluster: ``slurm_executor_params`` and
the sbatch script submitit would submit; the job object's requeue contract."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import submitit
from tests.hydra_compose import compose_cfg

from launch.slurm import SlurmTrainJob, slurm_executor_kwargs, slurm_executor_params
from launch.worker import config_from_yaml, config_to_yaml


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
    srun = next(l for l in script.splitlines() if l.startswith("srun "))
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
    srun = next(l for l in script.splitlines() if l.startswith("srun "))
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
    job = SlurmTrainJob(config_to_yaml(cfg), str(tmp_path))
    job = pickle.loads(pickle.dumps(job))
    delayed = job.checkpoint()
    assert isinstance(delayed, submitit.helpers.DelayedSubmission)
    again = delayed.function
    assert isinstance(again, SlurmTrainJob)
    assert again.cfg_yaml == job.cfg_yaml and again.run_dir == job.run_dir
    assert again.requeues == 1
    assert again.checkpoint().function.requeues == 2


def test_submit_without_sbatch_says_what_to_do(monkeypatch, tmp_path):
    import launch.slurm as slurm

    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="needs the SLURM client"):
        slurm.submit(compose_cfg("launcher=slurm"), str(tmp_path))


def test_site_launcher_file_built_on_the_slurm_one(tmp_path):
    """A cluster's own defaults as conf/launcher/<site>.yaml on top of slurm.yaml: launched
    with SLURM (its _target_), no Python change."""
    import shutil

    from hydra import compose, initialize_config_dir
    from tests.hydra_compose import CONF

    from launch.launcher import launcher_for
    from launch.slurm import SlurmLauncher
    from launch.validate import validate

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


def test_ctrl_c_while_waiting_cancels_the_job(tmp_path):
    """launcher.wait=true: Ctrl-C stops the run as it does a local one (scancel: SIGTERM to
    every task, which stop cleanly) and reports it as a stop."""
    from launch.launcher import RunStopped
    from launch.slurm import SlurmSubmission, _wait

    class Job:
        cancelled = False

        def results(self):
            raise KeyboardInterrupt

        def cancel(self, check=True):
            Job.cancelled = True

        def get_info(self, mode="cache"):
            return {"State": "CANCELLED by 0"}

    with pytest.raises(RunStopped) as e:
        _wait(Job(), SlurmSubmission("7", "log", str(tmp_path)), str(tmp_path))
    assert Job.cancelled and e.value.signum == 2 and e.value.summary is None
