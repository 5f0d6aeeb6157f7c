"""What a launcher is, and the one place that finds the launcher a config names.

A launcher is a class with a nested ``Config`` dataclass (its ``launcher.*`` fields, derived
from :class:`LauncherConfig`, ``_target_`` naming the class), the way hydra-submitit-launcher
types its queues. ``conf/launcher/<name>.yaml`` picks it with ``_target_`` and sets the
fields' values. A new launcher is one Python file and one yaml::

    # launch/launchers/mine.py
    @dataclass
    class MyLauncherConfig(LauncherConfig):
        _target_: str = "launch.launchers.mine.MyLauncher"
        name: str = "mine"
        host: Optional[str] = None

    class MyLauncher:
        Config = MyLauncherConfig
        def target(self, cfg, machine): ...
        def check(self, cfg, machine, report): ...
        def launch(self, cfg, run_dir): ...

    # conf/launcher/mine.yaml
    _target_: launch.launchers.mine.MyLauncher
    name: mine

``launch/train.py`` and ``launch/preflight/validate.py`` only go through this interface; they never ask
which launcher it is. Importing a launcher's module must stay cheap (no torch at module
level): the checks before launch use it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol

from omegaconf import MISSING, DictConfig, OmegaConf, open_dict, read_write

if TYPE_CHECKING:
    from launch.config.problems import Report
    from launch.launchers.machine import Machine
    from launch.run.run_summary import RunSummary


@dataclass
class LauncherConfig:
    """Fields every launcher has; each launcher's ``Config`` derives from it."""

    # The launcher class, "module.Class" (Hydra's convention for what a config builds).
    _target_: str = MISSING
    # The config-group option (conf/launcher/<name>.yaml): how messages and run summaries name it.
    name: str = MISSING


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
    # device "cpu": the cores one node gives the run's processes; None when not known before
    # the job starts.
    cores: Optional[int] = None


class Launcher(Protocol):
    # The dataclass of this launcher's ``launcher.*`` fields.
    Config: ClassVar[type[LauncherConfig]]

    def target(self, cfg: Any, machine: "Machine") -> Target:
        """Where the processes will run (for the device and memory checks)."""

    def check(self, cfg: Any, machine: "Machine", report: "Report") -> None:
        """Add this launcher's own problems (``report.error``) and warnings (``report.warn``)."""

    def launch(self, cfg: Any, run_dir: str) -> Optional["RunSummary"]:
        """Run (or submit) the training; the run's summary when it is known here.
        Raises :class:`RunStopped` when a signal stopped it, :class:`RunFailed` when it
        failed, :class:`RunRefused` when it could not be started."""


class RunStopped(Exception):
    """The run was stopped by a signal (Ctrl-C, SIGTERM); it saved what it could."""

    def __init__(self, signum: int, summary: Optional["RunSummary"]):
        super().__init__(signum)
        self.signum = signum
        self.summary = summary


class RunFailed(Exception):
    """The run failed; the message says where and names the full log."""


class RunRefused(Exception):
    """The run could not be started (say, SLURM refused the job) for a reason fixed in the
    config or the environment; the message names what to change. Nothing was started."""


def launcher_class(cfg: Any) -> type[Launcher]:
    """The class ``cfg.launcher._target_`` names (ImportError / AttributeError if none)."""
    from hydra.utils import get_class

    return get_class(cfg.launcher._target_)


def launcher_for(cfg: Any) -> Launcher:
    """An instance of the class ``cfg.launcher._target_`` names."""
    return launcher_class(cfg)()


def typed_launcher(cls: type[Launcher], node: Any) -> DictConfig:
    """``node`` (the composed ``launcher`` group) typed by ``cls.Config``, every field filled
    with its default. Raises omegaconf's errors for an unknown key or a wrong type."""
    return OmegaConf.merge(OmegaConf.structured(cls.Config), node)


def with_typed_launcher(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` whose ``launcher`` node is typed by its launcher's ``Config``
    (``launch.preflight.validate.validate`` reports, key by key, what stops that)."""
    out = copy.deepcopy(cfg)
    node = typed_launcher(launcher_class(cfg), cfg.launcher)
    with read_write(out), open_dict(out):
        out.launcher = node
    return out
