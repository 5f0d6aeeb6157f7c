"""``launcher=slurm``: submit the run as one SLURM job with submitit.

One task per process (``parallelism.nodes`` × ``parallelism.procs_per_node``); every task sets
up torch.distributed from SLURM's environment and calls ``run_training``. A job that is
preempted or reaches its time limit gets SLURM's SIGUSR2 first: the run stops at the next step
boundary with a checkpoint and a finished wandb run, then submitit requeues the job (up to
``launcher.max_num_timeout`` times) and it resumes from that checkpoint in the same run dir,
in the same wandb run. ``scancel`` (SIGTERM) stops it the same way, without requeueing.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from launch.launchers import slurm_cluster
from launch.launchers.launcher import LauncherConfig, RunFailed, RunRefused, RunStopped, Target
from launch.launchers.machine import GIB, Machine
from launch.run import console, run_lock, slurm_jobs
from launch.run.run_dir import CONSOLE_LOG, SUMMARY, checkpoint_steps
from launch.run.run_summary import RunSummary

log = logging.getLogger(__name__)

# The ports a job's rank-0 store listens on: below Linux's default ephemeral range (32768-60999),
# where any process's outgoing connection on the first node (gloo's pairs, wandb, the SLURM
# daemons') may hold the port a job drew.
RENDEZVOUS_PORTS = (20000, 32767)


def rendezvous_port(job_id: str) -> int:
    """The port of job ``job_id``'s rank-0 store (MASTER_PORT): drawn from the job id, so that
    every task of the job draws the same one, in ``RENDEZVOUS_PORTS``."""
    return random.Random(job_id).randint(*RENDEZVOUS_PORTS)


def export_distributed_env():
    """Set torch.distributed's environment from SLURM's (MASTER_ADDR/PORT, RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE) and return submitit's view of it. A MASTER_PORT the job was
    given is kept; else the job's ``rendezvous_port``. CUDA_VISIBLE_DEVICES is kept: torchtitan
    picks cuda:LOCAL_RANK itself."""
    import submitit

    os.environ.setdefault("MASTER_PORT", str(rendezvous_port(submitit.JobEnvironment().job_id)))
    return submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    """``launcher=slurm``: what the job asks SLURM for. Nodes and tasks per node come from the
    parallelism group."""

    _target_: str = "launch.launchers.slurm.SlurmLauncher"
    name: str = "slurm"
    # sbatch --partition / --account / --qos; None = SLURM's default.
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    # Wall-clock limit of one job (minutes).
    time_min: int = 60
    # Requeue on preemption / time limit, resuming from the last checkpoint, up to this often.
    max_num_timeout: int = 3
    # None = SLURM's default for the partition.
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None
    constraint: Optional[str] = None
    exclusive: bool = False
    # GPUs to request per node; None = one per process (parallelism.procs_per_node); 0 on a
    # CPU-only cluster.
    gpus_per_node: Optional[int] = None
    # pyxis/enroot container image (srun --container-image); None = run on the host.
    container_image: Optional[str] = None
    container_mounts: Optional[str] = None
    # Extra arguments for the srun that starts the tasks (after the pyxis ones).
    srun_args: list[str] = field(default_factory=list)
    # Extra #SBATCH lines as {key: value}.
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    # Shell lines run in the batch script before srun.
    setup: list[str] = field(default_factory=list)
    # sbatch --job-name; None = "mxfp8ep-<experiment>".
    job_name: Optional[str] = None
    # Block until the job ends and report its state.
    wait: bool = False


class SlurmLauncher:
    """Submits one job per run (per sweep point with --multirun); returns right after
    submission unless ``launcher.wait=true``, which follows the job's console lines and
    returns its summary."""

    Config = SlurmLauncherConfig

    def target(self, cfg: Any, machine: Machine) -> Target:  # noqa: ARG002 (the Launcher protocol)
        lc = cfg.launcher
        if lc.gpus_per_node == 0:
            ram = lc.mem_gb * GIB if lc.mem_gb else None
            cores = lc.cpus_per_task * cfg.parallelism.procs_per_node if lc.cpus_per_task else None
            return Target("cpu", ram, "launcher.mem_gb", "launcher.gpus_per_node=0 (a CPU cluster)",
                          cores=cores)
        # The compute nodes' GPUs cannot be seen from here: the memory the config says they have.
        gib = cfg.validate.gpu_mem_gib
        if gib is not None and gib > 0:
            return Target("cuda", int(gib * GIB), f"each GPU's memory (validate.gpu_mem_gib={gib:g})",
                          "the job asks for GPUs")
        return Target("cuda", None, "each GPU's memory", "the job asks for GPUs")

    def check(self, cfg: Any, machine: Machine, report: Any) -> None:  # noqa: ARG002 (the Launcher protocol)
        lc, p = cfg.launcher, cfg.parallelism
        if lc.time_min <= 0:
            report.error(f"launcher.time_min={lc.time_min} must be > 0 (minutes)")
        if lc.max_num_timeout < 0:
            report.error(f"launcher.max_num_timeout={lc.max_num_timeout} must be >= 0")
        gpus = lc.gpus_per_node
        if gpus is not None and gpus < 0:
            report.error(f"launcher.gpus_per_node={gpus} must be >= 0 (or null: one per process)")
        elif gpus and gpus < p.procs_per_node:
            report.error(
                f"launcher.gpus_per_node={gpus} < parallelism.procs_per_node={p.procs_per_node}: "
                f"each process needs its own GPU; set launcher.gpus_per_node=null"
            )
        if p.share_gpu:
            report.error("parallelism.share_gpu=true puts every process on one GPU of the machine it runs on, "
                         "for numerics studies: use launcher=local, or parallelism.share_gpu=false on SLURM "
                         "(a GPU per process)")
        if lc.container_mounts and not lc.container_image:
            report.error("launcher.container_mounts is set but launcher.container_image is not")
        if lc.max_num_timeout > 0 and not cfg.training.checkpoint_enable:
            report.warn(
                "launcher=slurm requeues a preempted or timed-out job, but training.checkpoint_enable="
                "false: a requeued job starts again from step 0"
            )
        slurm_cluster.check_request(cfg, job_gpus_per_node(cfg), report)

    def launch(self, cfg: Any, run_dir: str) -> Optional[RunSummary]:
        sub = submit(cfg, run_dir)
        if sub.state is None:
            return None
        return RunSummary.read(run_dir)


def slurm_executor_params(cfg: Any, workdir: Path | str | None = None) -> dict[str, Any]:
    """``AutoExecutor.update_parameters`` arguments for ``cfg`` (pure: no cluster needed).
    ``workdir``: the tasks' working directory inside a container (default: this one)."""
    lc, p = cfg.launcher, cfg.parallelism
    params: dict[str, Any] = {
        "name": lc.job_name or f"mxfp8ep-{cfg.experiment}",
        "nodes": p.nodes,
        "tasks_per_node": p.procs_per_node,
        "timeout_min": lc.time_min,
        # Task 0's stdout and stderr in one file: the log path we print.
        "stderr_to_stdout": True,
    }
    gpus = job_gpus_per_node(cfg)
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
        srun_args.append(f"--container-workdir={workdir or os.getcwd()}")
    srun_args.extend(lc.srun_args)
    params["slurm_srun_args"] = srun_args
    if lc.setup:
        params["slurm_setup"] = list(lc.setup)
    if lc.additional_parameters:
        params["slurm_additional_parameters"] = dict(lc.additional_parameters)
    return params


def job_gpus_per_node(cfg: Any) -> int:
    """GPUs the job asks for on each node: ``launcher.gpus_per_node``, or one per process."""
    lc = cfg.launcher
    return cfg.parallelism.procs_per_node if lc.gpus_per_node is None else lc.gpus_per_node


def slurm_executor_kwargs(cfg: Any) -> dict[str, Any]:
    """``AutoExecutor(...)`` constructor arguments (requeue budget, python inside containers)."""
    kwargs: dict[str, Any] = {"slurm_max_num_timeout": cfg.launcher.max_num_timeout}
    if cfg.launcher.container_image:
        # The submitting interpreter's path need not exist inside the image.
        kwargs["slurm_python"] = "python"
    return kwargs


class SlurmTrainJob:
    """The function submitit runs in every task; requeues itself on preemption / timeout."""

    def __init__(self, cfg_yaml: str, run_dir: str, requeues: int = 0, script: str = "launch/train.py"):
        self.cfg_yaml = cfg_yaml
        self.run_dir = run_dir
        self.requeues = requeues
        self.script = script  # the entry point as the launch named it: the resume command's

    def __call__(self) -> Optional[RunSummary]:
        from launch.launchers.worker import run_worker
        from launch.run.stop import Stopped, StopSignals

        env = export_distributed_env()
        if env.rank == 0 and self.requeues:
            line = (f"[mxfp8ep] requeued run (attempt {self.requeues + 1}): resuming from the "
                    f"last checkpoint in {self.run_dir}")
            print(line, flush=True)
            with Path(self.run_dir, CONSOLE_LOG).open("a") as f:
                f.write(f"==== {line.removeprefix('[mxfp8ep] ')} ====\n")
        # The runner writes the run's summary.json (rank 0) and stops cleanly on signals.
        stopped_by = None
        try:
            with StopSignals():  # from here on, SIGINT / SIGTERM / SIGUSR2 stop the run cleanly
                summary = run_worker(self.cfg_yaml, self.run_dir)
        except Stopped as e:
            summary, stopped_by = e.summary, e.signum
        except BaseException as e:
            self._record_end(env.rank, f"failed on rank {env.rank}: {type(e).__name__}: {e}")
            raise
        if summary is not None:
            self._say(env.rank, console.format_summary(summary))
        if stopped_by == signal.SIGUSR2 and self._requeue():
            return summary  # the requeued job keeps the run dir's hold
        if stopped_by is not None:  # the line with the command that continues the run
            resume = console.resume_command(os.path.abspath(self.run_dir), self.script)
            self._say(env.rank, console.stop_line(stopped_by, summary, self.run_dir, resume))
        self._record_end(env.rank, console.how_it_ended(summary, stopped_by))
        if stopped_by == signal.SIGTERM:  # scancel: the job was cancelled, not completed
            sys.stdout.flush()
            raise SystemExit(128 + stopped_by)
        return summary

    def _say(self, rank: int, text: str) -> None:
        """Rank 0: ``text`` in the job's log, and in ``console.log`` when no launcher waits for
        the job (one that waits prints and keeps its own)."""
        from launch.config.schema import config_from_yaml

        if rank != 0:
            return
        print(text, flush=True)
        if not config_from_yaml(self.cfg_yaml).launcher.wait:
            with Path(self.run_dir, CONSOLE_LOG).open("a") as f:
                f.write(text + "\n")

    def _requeue(self) -> bool:
        """After SLURM's notice of a preemption / the time limit stopped the run with a
        checkpoint: submitit's SIGUSR2 handler (restored after training) does what it does: on
        rank 0 call :meth:`checkpoint`, requeue the job, exit. Whether it requeued: not once
        ``launcher.max_num_timeout`` requeues are used up (it says why; the run ends here)."""
        from submitit.core.utils import UncompletedJobError

        try:
            signal.getsignal(signal.SIGUSR2)(signal.SIGUSR2, None)
        except UncompletedJobError as e:
            print(f"[mxfp8ep] {e}", flush=True)
            return False
        return True

    def _record_end(self, rank: int, how: str) -> None:
        """Rank 0, as the job ends: how it ended goes at the end of ``console.log`` when no
        launcher waits for the job to say so (``launcher.wait=false``), and into ``summary.json``
        (``ended`` and ``ended_at``; a job that failed before rank 0 wrote a summary gets one from
        its config); then the job's hold on the run dir goes (``launch.run.run_lock``). Quick: after
        ``scancel`` SLURM kills what is left of the job ``KillWait`` seconds later."""
        from launch.config.schema import config_from_yaml

        if rank != 0:
            return
        cfg = config_from_yaml(self.cfg_yaml)
        if not cfg.launcher.wait:
            console.record_end(self.run_dir, how)
        summary = RunSummary.read(self.run_dir)
        if summary is None and how.startswith("failed"):
            summary = RunSummary.before_training(cfg, self.run_dir, _resumed_from(self.run_dir, cfg))
        if summary is not None:
            summary.record_end(how)
            summary.write(self.run_dir)
        job_id = os.environ.get("SLURM_JOB_ID")
        if job_id:
            run_lock.release_job(self.run_dir, job_id)

    def checkpoint(self, *args: Any, **kwargs: Any):
        """Called by submitit on preemption / time limit: resubmit the same run. torchtitan
        loads the newest checkpoint under the run dir when the new job starts, and the wandb
        run id in the config is the same."""
        import submitit

        return submitit.helpers.DelayedSubmission(
            SlurmTrainJob(self.cfg_yaml, self.run_dir, self.requeues + 1, self.script)
        )


def _resumed_from(run_dir: str, cfg: Any) -> int:
    """The step a launch into ``run_dir`` starts from: its newest complete checkpoint, else 0."""
    if not cfg.training.checkpoint_enable:
        return 0
    steps = checkpoint_steps(run_dir, cfg.training.checkpoint_folder)
    return steps[-1] if steps else 0


@dataclass
class SlurmSubmission:
    job_id: str
    log_path: str
    folder: str
    state: Optional[str] = None  # set when waited for: COMPLETED / FAILED / CANCELLED / ...
    submitted_at: float = 0.0  # time.time() just before sbatch


def submit(cfg: Any, run_dir: str) -> SlurmSubmission:
    """Submit the run; with ``launcher.wait`` block until it ends and report its final state.
    Raises :class:`RunRefused` when SLURM (or submitit) does not take the job."""
    if shutil.which("sbatch") is None:
        raise RunRefused(
            "launcher=slurm needs the SLURM client (sbatch) on PATH: run from a SLURM login node, "
            "or use launcher=local"
        )
    import submitit

    from launch.config.schema import config_to_yaml

    folder = os.path.join(run_dir, "slurm")
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm", **slurm_executor_kwargs(cfg))
    except RuntimeError as e:  # submitit's own check of the SLURM client (srun)
        raise RunRefused(f"submitit cannot submit from here ({e}); run from a SLURM login node "
                         f"(sbatch and srun on PATH), or use launcher=local") from e
    try:
        executor.update_parameters(**slurm_executor_params(cfg))
    except (NameError, ValueError, TypeError) as e:  # a parameter submitit does not take
        raise RunRefused(f"submitit rejected the job's parameters ({str(e).splitlines()[0]}); check "
                         f"launcher.additional_parameters and launcher.srun_args") from e
    submitted_at = time.time()
    with _ctrl_c_deferred() as interrupted:  # a job is submitted whole, or not at all
        job = _submit(executor, SlurmTrainJob(config_to_yaml(cfg), run_dir, script=sys.argv[0]), cfg)
    if interrupted.is_set():
        job.cancel(check=False)
        log.info("Ctrl-C while submitting: SLURM job %s cancelled before it started", job.job_id)
        raise KeyboardInterrupt
    sub = SlurmSubmission(job_id=str(job.job_id), log_path=str(job.paths.stdout), folder=folder,
                          submitted_at=submitted_at)
    run_lock.hand_to_job(run_dir, sub.job_id)  # the job trains the run dir now, however long it queues
    log.info("submitted SLURM job %s; task 0's log: %s", sub.job_id, sub.log_path)
    print(f"[mxfp8ep] submitted SLURM job {sub.job_id}\n"
          f"[mxfp8ep]   log (task 0): {sub.log_path}\n"
          f"[mxfp8ep]   run dir:      {run_dir}", flush=True)
    if not cfg.launcher.wait:
        return sub
    return _wait(job, sub, run_dir)


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[threading.Event]:
    """Within the block, Ctrl-C (SIGINT) only sets the event it yields; the handler before it
    comes back after."""
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _submit(executor: Any, fn: Any, cfg: Any) -> Any:
    """``executor.submit(fn)``; a refusal becomes one :class:`RunRefused` that names the
    option to change. submitit prints sbatch's stderr itself before raising: that goes into the
    message instead."""
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            return executor.submit(fn)
    except FailedJobError as e:  # sbatch exited non-zero; its stderr is the message
        raise RunRefused(slurm_cluster.explain_refusal(str(e) or printed.getvalue(), cfg,
                                                       job_gpus_per_node(cfg))) from e
    except FailedSubmissionError as e:  # sbatch said something without a job id
        raise RunRefused(f"sbatch did not return a job id ({str(e).splitlines()[0]}); check the "
                         f"launcher.* options and `sbatch --version`") from e
    except OSError as e:  # sbatch could not be run at all
        raise RunRefused(f"could not run sbatch ({e}); run from a SLURM login node, or use "
                         f"launcher=local") from e


def _wait(job: Any, sub: SlurmSubmission, run_dir: str) -> SlurmSubmission:
    """Follow the job's console lines until no process of it is left, then say how it ended:
    its summary (completed), :class:`RunStopped` (Ctrl-C here, ``scancel``, or SLURM's time-limit
    notice with no requeue left) or :class:`RunFailed` (one line naming the task that failed and
    its log)."""
    from submitit.core.utils import FailedJobError, UncompletedJobError

    failure = None
    with console.follow(run_dir):
        try:
            job.results()
        except KeyboardInterrupt:
            _stop(job, sub)
            raise RunStopped(int(signal.SIGINT), _summary_since(run_dir, sub.submitted_at)) from None
        except (FailedJobError, UncompletedJobError) as e:
            failure = e
        _wait_until_gone(sub.job_id)
    sub.state = _final_state(job) or ("FAILED" if failure else "COMPLETED")
    summary = _summary_since(run_dir, sub.submitted_at)
    if sub.state == "CANCELLED":  # scancel: the tasks stopped as on Ctrl-C, with SIGTERM
        raise RunStopped(int(signal.SIGTERM), summary)
    if failure is not None or sub.state != "COMPLETED":
        raise RunFailed(failed_line(sub))
    if summary is not None and summary.stopped_by:  # the time limit's notice, no requeue left
        raise RunStopped(int(signal.Signals[summary.stopped_by]), summary)
    print(f"[mxfp8ep] SLURM job {sub.job_id} {sub.state}", flush=True)
    return sub


def _summary_since(run_dir: str, t: float) -> Optional[RunSummary]:
    """The run's summary if this job wrote it (after ``t``): not an earlier launch's."""
    path = Path(run_dir) / SUMMARY
    return RunSummary.read(path) if path.is_file() and path.stat().st_mtime >= t else None


def _stop(job: Any, sub: SlurmSubmission) -> None:
    """Ctrl-C while following the job: SIGINT to its tasks (not ``scancel``'s SIGTERM to the
    whole job, which SIGKILLs what is left ``KillWait`` seconds later), so they stop at the
    next step boundary with a checkpoint and a finished wandb run, however long that takes;
    a second Ctrl-C cancels the job at once. Returns once no process of the job is left."""
    with _ctrl_c_deferred() as again:
        print(f"[mxfp8ep] stopping SLURM job {sub.job_id} at the next step boundary (Ctrl-C again cancels "
              f"it at once)", file=sys.stderr, flush=True)
        if _run(["scancel", "--signal=INT", sub.job_id]) is None:  # e.g. still pending: nothing to stop cleanly
            again.set()
        cancelled = False
        while _job_active(sub.job_id):
            if again.is_set() and not cancelled:
                job.cancel(check=False)
                cancelled = True
            again.wait(1.0)
    sub.state = _final_state(job)


def _run(args: list[str]) -> Optional[str]:
    """A SLURM client's output; None when it fails or cannot be run."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _job_active(job_id: str) -> bool:
    """Whether SLURM lists a process of the job (``squeue``: RUNNING, then COMPLETING while the
    last ones end), or the job is still to start."""
    return slurm_jobs.is_active(slurm_jobs.queue_state(job_id))


def _wait_until_gone(job_id: str, timeout_s: float = 300.0) -> None:
    """Until no process of the job is left: its results and ``summary.json`` are final only then."""
    deadline = time.monotonic() + timeout_s
    while _job_active(job_id) and time.monotonic() < deadline:
        time.sleep(1.0)


def failed_line(sub: SlurmSubmission) -> str:
    """The one line of a failed job: its state, the task that failed first (from srun's own
    line in task 0's log) and that task's log."""
    logs = f"{sub.folder}/{sub.job_id}_<task>_log.out"
    try:
        text = Path(sub.log_path).read_text(errors="replace")
    except OSError:
        text = ""
    m = re.search(r"srun: error: \S+: tasks? ([\d,-]+): (.+)", text)
    if m is None:
        return f"SLURM job {sub.job_id} {sub.state}; see {sub.log_path} (every task's log: {logs})"
    task = re.split(r"[,-]", m.group(1))[0]
    log = f"{sub.folder}/{sub.job_id}_{task}_log.out"
    return (f"SLURM job {sub.job_id} {sub.state}; see {log} (task {task}: {m.group(2).strip()}; every "
            f"task's log: {logs})")


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
