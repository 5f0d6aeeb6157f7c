"""``launcher=slurm``: submit the run as one SLURM job with submitit.

One task per process (``parallelism.nodes`` × ``parallelism.procs_per_node``); every task sets
up torch.distributed from SLURM's environment and calls ``run_training``. A job that is
preempted or reaches its time limit is requeued (up to ``launcher.max_num_timeout`` times) and
resumes from the last torchtitan checkpoint in the same run directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launch.worker import config_to_yaml, run_worker

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]


def slurm_executor_params(cfg: Any, repo_root: Path | str = REPO_ROOT) -> dict[str, Any]:
    """``AutoExecutor.update_parameters`` arguments for ``cfg`` (pure: no cluster needed)."""
    lc, p = cfg.launcher, cfg.parallelism
    params: dict[str, Any] = {
        "name": lc.job_name or f"mxfp8ep-{cfg.experiment}",
        "nodes": p.nodes,
        "tasks_per_node": p.procs_per_node,
        "timeout_min": lc.time_min,
        # Task 0's stdout and stderr in one file: the log path we print.
        "stderr_to_stdout": True,
    }
    gpus = p.procs_per_node if lc.gpus_per_node is None else lc.gpus_per_node
    if gpus:  # 0 (CPU cluster): no GPU request at all
        params["gpus_per_node"] = gpus
    if lc.cpus_per_task:
        params["cpus_per_task"] = lc.cpus_per_task
    if lc.mem_gb:
        params["mem_gb"] = lc.mem_gb
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(lc, key)
        if value:
            params[f"slurm_{key}"] = value
    if lc.exclusive:
        params["slurm_exclusive"] = True

    # One rank dying ends the step: without this, NCCL ranks would wait in their next
    # collective until its timeout instead of the job failing at once.
    srun_args: list[str] = ["--kill-on-bad-exit=1"]
    if lc.container_image:
        # pyxis: every task runs inside the image, in the same directory as on the host
        # (the repository must be mounted there).
        srun_args.append(f"--container-image={lc.container_image}")
        if lc.container_mounts:
            srun_args.append(f"--container-mounts={lc.container_mounts}")
        srun_args.append(f"--container-workdir={repo_root}")
    srun_args.extend(lc.srun_args)
    params["slurm_srun_args"] = srun_args

    # The pickled job names `launch.*`: make the repository importable wherever sbatch runs.
    params["slurm_setup"] = [f"export PYTHONPATH={repo_root}${{PYTHONPATH:+:$PYTHONPATH}}"] + list(
        lc.setup
    )
    if lc.additional_parameters:
        params["slurm_additional_parameters"] = dict(lc.additional_parameters)
    return params


def slurm_executor_kwargs(cfg: Any) -> dict[str, Any]:
    """``AutoExecutor(...)`` constructor arguments (requeue budget, python inside containers)."""
    kwargs: dict[str, Any] = {"slurm_max_num_timeout": cfg.launcher.max_num_timeout}
    if cfg.launcher.container_image:
        # The submitting interpreter's path need not exist inside the image.
        kwargs["slurm_python"] = "python"
    return kwargs


class SlurmTrainJob:
    """The function submitit runs in every task; requeues itself on preemption / timeout."""

    def __init__(self, cfg_yaml: str, run_dir: str, requeues: int = 0):
        self.cfg_yaml = cfg_yaml
        self.run_dir = run_dir
        self.requeues = requeues

    def __call__(self) -> Optional[dict]:
        import submitit

        # MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from SLURM.
        # Keep CUDA_VISIBLE_DEVICES: torchtitan picks cuda:LOCAL_RANK itself.
        env = submitit.helpers.TorchDistributedEnvironment().export(
            set_cuda_visible_devices=False, overwrite=True
        )
        # Every attempt of a requeued job keeps SLURM's job id: log them all to one wandb run.
        if os.environ.get("SLURM_JOB_ID"):
            os.environ.setdefault("WANDB_RUN_ID", f"mxfp8ep-{os.environ['SLURM_JOB_ID']}")
        if env.rank == 0 and self.requeues:
            print(f"[mxfp8ep] requeued run (attempt {self.requeues + 1}): resuming from the "
                  f"last checkpoint in {self.run_dir}", flush=True)
        result = run_worker(self.cfg_yaml, self.run_dir)
        if env.rank == 0:
            # The submitting process may be long gone: leave the run's summary.json here.
            from launch.summary import format_summary, write_summary
            from launch.worker import config_from_yaml

            summary = write_summary(config_from_yaml(self.cfg_yaml), self.run_dir, result,
                                    {"slurm_job_id": os.environ.get("SLURM_JOB_ID")})
            print(format_summary(summary), flush=True)
        return result

    def checkpoint(self, *args: Any, **kwargs: Any):
        """Called by submitit on preemption / time limit: resubmit the same run. torchtitan
        loads the newest checkpoint under the run dir when the new job starts."""
        import submitit

        return submitit.helpers.DelayedSubmission(
            SlurmTrainJob(self.cfg_yaml, self.run_dir, self.requeues + 1)
        )


@dataclass
class SlurmSubmission:
    job_id: str
    log_path: str
    folder: str
    state: Optional[str] = None  # set when waited for: COMPLETED / FAILED / CANCELLED / ...
    result: Optional[dict] = None


class SlurmJobFailed(RuntimeError):
    pass


def submit(cfg: Any, run_dir: str) -> SlurmSubmission:
    """Submit the run; with ``launcher.wait`` block until it ends and report its final state."""
    if shutil.which("sbatch") is None:
        raise RuntimeError(
            "launcher=slurm needs the SLURM client (sbatch) on PATH: run from a SLURM login node, "
            "or use launcher=local"
        )
    import submitit

    folder = os.path.join(run_dir, "slurm")
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", **slurm_executor_kwargs(cfg))
    executor.update_parameters(**slurm_executor_params(cfg))
    job = executor.submit(SlurmTrainJob(config_to_yaml(cfg), run_dir))
    sub = SlurmSubmission(job_id=str(job.job_id), log_path=str(job.paths.stdout), folder=folder)
    print(f"[mxfp8ep] submitted SLURM job {sub.job_id}\n"
          f"[mxfp8ep]   log (task 0): {sub.log_path}\n"
          f"[mxfp8ep]   run dir:      {run_dir}", flush=True)
    if not cfg.launcher.wait:
        return sub
    return _wait(job, sub)


def _wait(job: Any, sub: SlurmSubmission) -> SlurmSubmission:
    from submitit.core.utils import FailedJobError, UncompletedJobError

    try:
        sub.result = job.results()[0]  # task 0 (global rank 0); the others return None
    except (FailedJobError, UncompletedJobError) as e:
        sub.state = _final_state(job) or "FAILED"
        print(f"[mxfp8ep] SLURM job {sub.job_id} {sub.state}; see {sub.log_path} "
              f"(every task's log: {sub.folder}/{sub.job_id}_<task>_log.out)", flush=True)
        raise SlurmJobFailed(
            f"SLURM job {sub.job_id} ended {sub.state}; log: {sub.log_path} "
            f"(all tasks: {sub.folder})\n{str(e)[-2000:]}"
        ) from None
    sub.state = _final_state(job) or "COMPLETED"
    print(f"[mxfp8ep] SLURM job {sub.job_id} {sub.state}", flush=True)
    return sub


_TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL",
             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _final_state(job: Any, timeout_s: float = 90.0) -> Optional[str]:
    """SLURM's state once the job has left RUNNING/COMPLETING (results can arrive first)."""
    deadline = time.monotonic() + timeout_s
    state = None
    while True:
        try:
            # sacct writes e.g. "CANCELLED by 0"; get_info's cache is stale without "force".
            raw = job.get_info(mode="force").get("State")
            state = raw.split()[0] if raw else state
        except Exception:  # noqa: BLE001 - state is informational
            pass
        if (state and state.startswith(_TERMINAL)) or time.monotonic() > deadline:
            return state
        time.sleep(1.0)
