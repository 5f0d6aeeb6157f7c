"""The console's heartbeat: while a training step runs longer than ``logging.heartbeat_s``,
rank 0 adds a line to ``console.log`` every that many seconds saying which step is still running
and for how long (``launch.run.console.still_running_line``). A first step that takes minutes (a
long sequence on CPU, a slow compile, a rank waiting in a collective) then no longer looks like
a hang, and a hang says where it is. Before the first step and after the last, :func:`stage`
says which stage of starting or ending the run begins."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator, Optional

from launch.run.console import still_running_line
from launch.run.run_dir import CONSOLE_LOG


def append_line(path: str) -> Callable[[str], None]:
    """A writer of whole lines to the end of ``path`` (one ``write`` each: lines written by
    another open handle of the file are never cut)."""

    def write(line: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    return write


def stage(run_dir: str, text: str) -> None:
    """Rank 0 (``RANK``): a line in ``console.log`` as a stage of starting or ending a run
    begins (importing torchtitan, building the model, wandb, the first step, finishing), so the
    console is not silent for long between the header and the first step, or after the last."""
    if os.environ.get("RANK", "0") == "0":
        append_line(os.path.join(run_dir, CONSOLE_LOG))(text)


class StepHeartbeat:
    """One thread that watches the step in :meth:`step` and calls ``write`` with a line every
    ``every_s`` seconds it runs on."""

    def __init__(self, write: Callable[[str], None], steps: int, every_s: float):
        self._write = write
        self._steps = steps
        self._every_s = every_s
        self._cond = threading.Condition()
        self._step: Optional[int] = None
        self._since = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="step-heartbeat", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Watch the step that runs in the block."""
        with self._cond:
            self._step, self._since = step, time.monotonic()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._step = None
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._step is None:
                    self._cond.wait()
                    continue
                step, since = self._step, self._since
                beats = int((time.monotonic() - since) // self._every_s) + 1
                due = since + beats * self._every_s
                self._cond.wait(timeout=max(0.0, due - time.monotonic()))
                now = time.monotonic()
                if not self._closed and (self._step, self._since) == (step, since) and now >= due:
                    self._write(still_running_line(step, self._steps, now - since))
