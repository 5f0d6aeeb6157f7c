"""What SLURM says about one job: queued, running or ended (``squeue``), and how it ended
(``sacct``). Where SLURM cannot be asked (no client on PATH, a controller that does not
answer) the answer is None: the callers say so rather than guess."""

from __future__ import annotations

import subprocess
from typing import Optional

# squeue states of a job with processes that may still write into the run dir (or about to).
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                    "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"})
# Of those, the states of a job that has not started (or waits to start again).
QUEUED = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


def _ask(args: list[str]) -> Optional[subprocess.CompletedProcess]:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def queue_state(job_id: str) -> Optional[str]:
    """The job's state as ``squeue`` lists it (``PENDING``, ``RUNNING``, ``COMPLETED`` ...); ""
    when SLURM no longer knows the job (it ended a while ago); None when SLURM cannot be asked."""
    done = _ask(["squeue", "-h", "-j", str(job_id), "-o", "%T"])
    if done is None:
        return None
    if done.returncode != 0:
        return "" if "Invalid job id" in done.stderr else None
    states = done.stdout.split()
    return states[0] if states else ""


def is_active(state: Optional[str]) -> bool:
    """Whether a :func:`queue_state` is a job still queued or running."""
    return bool(state) and state in ACTIVE


def final_state(job_id: str) -> Optional[str]:
    """How the job ended as ``sacct`` records it (``COMPLETED``, ``FAILED``, ``CANCELLED`` ...,
    without sacct's " by <uid>"); None when sacct cannot be asked or has no record."""
    done = _ask(["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "State"])
    if done is None or done.returncode != 0:
        return None
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return lines[-1].split()[0] if lines else None
