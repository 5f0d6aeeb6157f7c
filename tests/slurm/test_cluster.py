"""Plain submitit against the live local SLURM cluster (scripts/slurm_local.sh).

What the launcher relies on, checked without it: multi-node torch.distributed (gloo) through
submitit's environment, failures and cancellations surfacing as errors (not hangs), clear
submission errors, and checkpoint + requeue continuing from state on disk.
Every wait is bounded; a stuck job is cancelled at teardown.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError, UncompletedJobError

from tests.slurm.polling import wait_until

pytestmark = pytest.mark.slurm

# The job functions below live in this test module, which the job's Python cannot import:
# ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------------------------ helpers
def _executor(folder: Path, partition: str, **params) -> submitit.AutoExecutor:
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    ex.update_parameters(timeout_min=5, slurm_partition=partition, cpus_per_task=1, **params)
    return ex


def _state(job: submitit.Job) -> str:
    return job.get_info(mode="force").get("State", "UNKNOWN")


_ACTIVE = ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "SUSPENDED", "UNKNOWN")


def _wait_done(job: submitit.Job, timeout: float) -> str:
    """Until SLURM (sacct) reports a final state -- result files can appear before that."""
    wait_until(lambda: not _state(job).startswith(_ACTIVE), timeout, f"job {job.job_id} to end ({job.state})")
    return _state(job)


def _call_bounded(fn, timeout: float):
    """fn() in a daemon thread; returns (value, exception); fails the test if it blocks."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"{fn} still blocked after {timeout}s (submitit hang)")
    return box.get("value"), box.get("error")


def _squeue_ids() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=10)
    return set(out.stdout.split())


@pytest.fixture
def jobs():
    """Jobs submitted by a test; any still queued/running at teardown is cancelled."""
    submitted: list[submitit.Job] = []
    yield submitted
    live = _squeue_ids()
    for job in submitted:
        if str(job.job_id) in live:
            subprocess.run(["scancel", str(job.job_id)], timeout=10, check=False)


# ------------------------------------------------------------------------------ job payloads
def _allreduce_job():
    import datetime
    import os

    import torch
    import torch.distributed as dist

    env = submitit.JobEnvironment()
    denv = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        t = torch.tensor([float(denv.rank + 1), 1.0])
        dist.all_reduce(t)
        nodes: list = [None] * denv.world_size
        dist.all_gather_object(nodes, os.environ["SLURMD_NODENAME"])
    finally:
        dist.destroy_process_group()
    return {
        "rank": denv.rank,
        "world_size": denv.world_size,
        "local_rank": denv.local_rank,
        "local_world_size": denv.local_world_size,
        "master_addr": denv.master_addr,
        "submitit_rank": env.global_rank,
        "num_nodes": env.num_nodes,
        "node": os.environ["SLURMD_NODENAME"],
        "node_id": int(os.environ["SLURM_NODEID"]),
        "sum": t.tolist(),
        "all_nodes": nodes,
    }


def _hard_crash():
    import os

    print("about to die without a result", flush=True)
    print("CRASH-MARKER on stderr", file=sys.stderr, flush=True)
    os._exit(17)


def _raise():
    raise ValueError("python-level failure 42")


class Resumable:
    """Counts to `total` steps, saving progress to `state_file` after each; on preemption
    (`checkpoint`) it is requeued and the next run continues from the saved step."""

    def __init__(self, state_file: str, total: int, step_s: float) -> None:
        self.state_file = state_file
        self.total = total
        self.step_s = step_s

    def _load(self) -> dict:
        p = Path(self.state_file)
        return json.loads(p.read_text()) if p.exists() else {"step": 0, "checkpoints": 0}

    def __call__(self) -> dict:
        import os

        state = self._load()
        started_at = state["step"]
        for step in range(started_at, self.total):
            time.sleep(self.step_s)
            state["step"] = step + 1
            tmp = Path(self.state_file + ".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(self.state_file)
        return {
            "started_at": started_at,
            "step": state["step"],
            "checkpoints": state["checkpoints"],
            "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        }

    def checkpoint(self, *args, **kwargs):
        state = self._load()
        state["checkpoints"] += 1
        Path(self.state_file).write_text(json.dumps(state))
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


# ------------------------------------------------------------------------------------ tests
def test_two_nodes_gloo_allreduce(slurm_cluster, submitit_folder, jobs):
    ex = _executor(submitit_folder, slurm_cluster.partition, nodes=2, tasks_per_node=2)
    job = ex.submit(_allreduce_job)
    jobs.append(job)
    _wait_done(job, 120)
    results, err = _call_bounded(job.results, 60)
    assert err is None, f"{err}\nstderr:\n{job.stderr()}"
    assert len(results) == 4
    results = sorted(results, key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["world_size"] == 4 and r["local_world_size"] == 2 and r["num_nodes"] == 2
        assert r["submitit_rank"] == r["rank"]
        assert r["sum"] == [10.0, 4.0]  # 1+2+3+4, and 4 ranks
        assert r["master_addr"] == "n1"
        assert r["all_nodes"] == ["n1", "n1", "n2", "n2"]
    # ranks 0,1 on the first node, 2,3 on the second; local ranks 0,1 on each
    assert [(r["node_id"], r["local_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert _wait_done(job, 30) == "COMPLETED"


def test_crash_is_failed_not_hang(slurm_cluster, submitit_folder, jobs):
    ex = _executor(submitit_folder, slurm_cluster.partition)
    job = ex.submit(_hard_crash)
    jobs.append(job)
    t0 = time.monotonic()
    # The real API a waiting launcher uses, unpatched: must raise, not block (needs sacct).
    _, err = _call_bounded(job.result, 90)
    elapsed = time.monotonic() - t0
    assert isinstance(err, UncompletedJobError), repr(err)
    assert "FAILED" in str(err)
    assert "CRASH-MARKER" in str(err)  # the job's stderr is included in the message
    assert _state(job) == "FAILED"
    print(f"crash reported after {elapsed:.1f}s")


def test_python_exception_is_failed_job_error(slurm_cluster, submitit_folder, jobs):
    ex = _executor(submitit_folder, slurm_cluster.partition)
    job = ex.submit(_raise)
    jobs.append(job)
    _wait_done(job, 60)
    _, err = _call_bounded(job.result, 30)
    assert isinstance(err, FailedJobError), repr(err)
    assert "python-level failure 42" in str(err)


def test_scancel_is_cancelled(slurm_cluster, submitit_folder, jobs):
    ex = _executor(submitit_folder, slurm_cluster.partition)
    job = ex.submit(time.sleep, 600)
    jobs.append(job)
    wait_until(lambda: _state(job) == "RUNNING", 60, "job to start")
    job.cancel()
    state = _wait_done(job, 60)
    assert state.startswith("CANCELLED"), state
    job._results_timeout_s = 2  # no result file will ever come; do not wait 15 s for it
    _, err = _call_bounded(job.result, 30)
    assert isinstance(err, UncompletedJobError) and "CANCELLED" in str(err), repr(err)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"slurm_partition": "no_such_partition"}, "Invalid partition"),
        # `short` has MaxTime=5 min, enforced at submission (EnforcePartLimits=ALL)
        ({"slurm_partition": "short", "timeout_min": 10}, "time limit"),
    ],
    ids=["bad_partition", "over_time_limit"],
)
def test_bad_submission_is_clear_error(slurm_cluster, submitit_folder, params, message):
    assert slurm_cluster.bad_partition == "no_such_partition"
    before = _squeue_ids()
    ex = _executor(submitit_folder, slurm_cluster.partition)
    ex.update_parameters(**params)
    # submitit 1.5.4 raises FailedJobError carrying sbatch's stderr when sbatch rejects a job
    # (FailedSubmissionError only when sbatch's output cannot be parsed).
    with pytest.raises((FailedJobError, FailedSubmissionError), match=f"(?i){message}"):
        ex.submit(time.sleep, 1)
    assert _squeue_ids() <= before  # nothing was queued
    assert not list(submitit_folder.glob("*_submission.sh"))  # and submitit kept no job


@pytest.mark.parametrize("how", ["usr2", "scontrol_requeue"])
def test_requeue_resumes_from_disk(slurm_cluster, submitit_folder, jobs, tmp_path, how):
    """usr2: the preemption notice (what SLURM sends before a preemption / at the time limit;
    USR2 is submitit's signal): submitit calls checkpoint() and requeues the job itself.
    scontrol_requeue: an admin/external requeue, no notice: the job is killed and rerun from
    its original pickle, and continues from the state it saved on disk."""
    state_file = tmp_path / "progress.json"
    # An external requeue kills the job only after KillWait (5 s; SIGTERM is ignored by
    # submitit meanwhile): give it more than 5 s of work left.
    total = 12 if how == "usr2" else 24
    ex = _executor(submitit_folder, slurm_cluster.partition)
    job = ex.submit(Resumable(str(state_file), total=total, step_s=0.5))
    jobs.append(job)

    def progress() -> int:
        try:
            return json.loads(state_file.read_text())["step"]
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    wait_until(lambda: progress() >= 3, 60, "3 steps of progress")
    if how == "usr2":
        subprocess.run(["scancel", "--signal=USR2", str(job.job_id)], check=True, timeout=10)
    else:
        subprocess.run(["scontrol", "requeue", str(job.job_id)], check=True, timeout=10)
    at_signal = progress()

    # SLURM 22.05 holds a requeued job for 120 s (Reason=BeginTime); release it at once.
    def restarted() -> bool:
        info = subprocess.run(
            ["scontrol", "-o", "show", "job", str(job.job_id)], capture_output=True, text=True, timeout=10
        ).stdout
        if "Restarts=0" in info:
            return False
        if "JobState=PENDING" in info:
            subprocess.run(
                ["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], timeout=10, check=False
            )
        # not COMPLETING/REQUEUED/PENDING: the second attempt runs (or already ended)
        return re.search(r"JobState=(RUNNING|COMPLETED|FAILED|CANCELLED|TIMEOUT)", info) is not None

    wait_until(restarted, 60, "the job to be requeued", interval=0.5)
    _wait_done(job, 90)
    result, err = _call_bounded(job.result, 30)
    assert err is None, f"{err}\n{job.stderr()}"
    assert result["step"] == total
    assert result["checkpoints"] == (1 if how == "usr2" else 0)
    assert result["restart_count"] == 1
    # continued from the saved step, not from 0 (a step may land between signal and exit)
    assert at_signal <= result["started_at"] < total, (at_signal, result)
    assert _wait_done(job, 30) == "COMPLETED"
    history = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-j", str(job.job_id), "-o", "State"],
        capture_output=True, text=True, timeout=10,
    ).stdout.split()
    assert history[0] == "REQUEUED" and history[-1] == "COMPLETED", history
