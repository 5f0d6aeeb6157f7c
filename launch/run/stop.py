"""Stop a run cleanly on Ctrl-C (SIGINT), SIGTERM (kill, scancel, torch elastic shutting its
workers down) or SIGUSR2 (SLURM's notice before a preemption or the time limit).

Python's defaults would kill a worker mid-step (SIGTERM) or raise KeyboardInterrupt wherever
it happens to be (SIGINT): the step's logged metrics never reach wandb and no checkpoint is
written. Instead, while training, the handlers only note the signal; at the next step
boundary every rank learns whether any rank got one (:meth:`StopSignals.agreed`, a small
all-reduce) and they stop together: the trainer saves a checkpoint, finishes wandb and writes
the summary. The previous handlers (Python's, submitit's) come back afterwards.

Before the first step is trained there is nothing to save: with ``exit_before_training`` a
stop signal ends the process at once (a Ctrl-C during start-up returns in a moment, not after
the rest of the start-up and a first step), until the trainer calls :meth:`StopSignals.trained`.
"""

from __future__ import annotations

import signal
import threading
from datetime import timedelta
from typing import Any, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)

_active: Optional["StopSignals"] = None  # the one whose handlers are installed


class StopSignals:
    """Context manager: notes the first stop signal this process gets. Nested use (a worker
    entry point installs it as early as it can, the runner enters it again) shares the
    outer one; only the outermost restores the previous handlers."""

    def __init__(self, exit_before_training: bool = False) -> None:
        self.received: Optional[int] = None
        self.exit_before_training = exit_before_training
        self._previous: dict[int, Any] = {}
        self._nested = False
        self._agreements = 0  # agreements this process took part in (the same count on every rank)

    def __enter__(self) -> "StopSignals":
        global _active
        if _active is not None:
            self._nested = True
            return _active
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                # start-up: the system's default ends the process at once, also inside a long call
                # into C++ (a rendezvous waiting for a rank that is gone), where no Python handler runs
                self._previous[sig] = signal.signal(sig, signal.SIG_DFL if self.exit_before_training
                                                    else self._note)
            _active = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        if self._nested:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if _active is self:
            _active = None

    def _note(self, signum: int, frame: Any) -> None:  # noqa: ARG002 (a signal handler's signature)
        if self.received is None:
            self.received = signum

    def trained(self) -> None:
        """A step is trained: from now on a stop signal waits for the next step boundary."""
        if self.exit_before_training and self._previous:
            for sig in SIGNALS:
                signal.signal(sig, self._note)
        self.exit_before_training = False

    def agreed(self, group: Any = None, timeout_s: Optional[float] = None) -> Optional[int]:
        """The stop signal if any rank of ``group`` got one, else None (collective: every rank
        calls it at the same point; without a process group, this process's own). With
        ``timeout_s`` (``group`` a gloo group, or the default one on gloo), a rank still waiting
        for the others after that long raises ``launch.run.rank_meeting.RanksMissing`` naming the
        ranks that did not arrive and where they are."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.received
        flag = torch.tensor([self.received or 0], dtype=torch.int64)
        if timeout_s is None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            return int(flag.item()) or None
        from launch.run import rank_meeting

        self._agreements += 1
        meeting = f"the stop agreement of step boundary {self._agreements}"
        rank_meeting.arrive(meeting)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise rank_meeting.missing(meeting, timeout_s) from e
        return int(flag.item()) or None


class Stopped(Exception):
    """Raised by the runner on every rank after a clean stop (checkpoint saved, wandb
    finished, summary written): how the process ends is the launcher's business."""

    def __init__(self, signum: int, summary: Any = None):
        super().__init__(signal_name(signum))
        self.signum = signum
        self.summary = summary  # rank 0's RunSummary, None elsewhere


def signal_name(signum: Optional[int]) -> Optional[str]:
    return None if signum is None else signal.Signals(signum).name
