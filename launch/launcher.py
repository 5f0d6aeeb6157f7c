"""What a launcher is: the class a ``conf/launcher/<name>.yaml`` names in ``_target_`` (as
Hydra's submitit launcher plugin does).

A new launcher is one Python file with such a class and one yaml::

    # conf/launcher/mine.yaml
    _target_: launch.mine.MyLauncher
    name: mine

``launch/train.py`` and ``launch/validate.py`` only go through this interface: they never ask
which launcher it is. Importing the class must stay cheap (no torch at module level): the
checks before launch use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol

if TYPE_CHECKING:
    from launch.machine import Machine
    from launch.run_summary import RunSummary
    from launch.validate import Report


@dataclass(frozen=True)
class Target:
    """Where a run's processes will run, as far as the launcher knows before launching."""

    # "cuda" (one GPU per process) or "cpu" (CPU processes talking over gloo).
    device: str
    # Memory one node offers the run: each GPU's (cuda: per process) or the node's RAM (cpu:
    # shared by its processes); None when it cannot be known before the job starts.
    memory_bytes: Optional[int]
    # How the messages name it, e.g. "this machine's RAM".
    memory_name: str
    # How the messages name the device, e.g. "this machine has no GPU".
    where: str


class Launcher(Protocol):
    # The ``launcher.*`` fields this launcher reads; set ones it does not read draw a warning.
    reads: ClassVar[frozenset[str]]

    def target(self, cfg: Any, machine: "Machine") -> Target:
        """Where the processes will run (for the device and memory checks)."""

    def check(self, cfg: Any, machine: "Machine", report: "Report") -> None:
        """Add this launcher's own problems (``report.error``) and warnings (``report.warn``)."""

    def launch(self, cfg: Any, run_dir: str) -> Optional["RunSummary"]:
        """Run (or submit) the training; the run's summary when it is known here.
        Raises :class:`RunStopped` when a signal stopped it."""


class RunStopped(Exception):
    """The run was stopped by a signal (Ctrl-C, SIGTERM); it saved what it could."""

    def __init__(self, signum: int, summary: Optional["RunSummary"]):
        super().__init__(signum)
        self.signum = signum
        self.summary = summary


class RunFailed(Exception):
    """The run failed; the message says where and names the full log."""


def launcher_for(cfg: Any) -> Launcher:
    """An instance of the class ``cfg.launcher._target_`` names."""
    from hydra.utils import get_class

    return get_class(cfg.launcher._target_)()
