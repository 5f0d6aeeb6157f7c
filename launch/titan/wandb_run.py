"""The run's wandb logger (rank 0), kept whole when wandb's service process dies.

:class:`RecipeWandBLogger` replaces torchtitan's ``WandBLogger`` because that one puts the run
under ``<dump>/tb/<timestamp>`` and logs only torchtitan's config; ours writes
``<run_dir>/wandb/...``, logs the full composed recipe config and resumes the run id the
recipe gives it.

wandb hands every row to its service process (``wandb-core``), which writes the run's files
(offline) or uploads them (online) and exits at once on SIGTERM or SIGINT, losing what it had
not written yet. SLURM signals every process of a job step (``scancel``, the launcher's Ctrl-C):
the training processes stop at the next step boundary, but by then wandb's service is gone. So
the logger keeps every row it was given; when the service is gone (a ``ConnectionError`` from
wandb) it stops calling it, and at the end starts a new one for the same run, into a new folder
beside the first, with the rows the first did not write (``launch.run.wandb_offline.read_runs``
and ``wandb sync`` take the two folders as one run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torchtitan.components.metrics import BaseLogger
from torchtitan.tools.logging import logger

from launch.run import run_summary as names
from launch.run.wandb_offline import OfflineRun, read_run

__all__ = ["ONLINE_INIT_TIMEOUT_S", "RecipeWandBLogger", "WandbSettings", "init_timeout_s", "start_line",
           "start_wandb"]

# The longest an online run waits for wandb's server at its start before it writes its record
# offline instead (wandb's own default: 90 s, in silence); WANDB_INIT_TIMEOUT overrides it.
ONLINE_INIT_TIMEOUT_S = 30.0


def init_timeout_s() -> float:
    """How long ``wandb.init`` may wait for the server: ``$WANDB_INIT_TIMEOUT``, else
    :data:`ONLINE_INIT_TIMEOUT_S`."""
    return float(os.environ.get("WANDB_INIT_TIMEOUT") or ONLINE_INIT_TIMEOUT_S)


def start_line(mode: str) -> str:
    """The console's start-up line for wandb: an online run says how long it waits for the
    server and what it does then."""
    if mode != "online":
        return f"start-up: wandb ({mode})"
    base = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    return (f"start-up: wandb (online): connecting to {base}; without an answer in {init_timeout_s():g} s the "
            f"run's record is written offline instead")


@dataclass(frozen=True)
class WandbSettings:
    """``wandb.init`` arguments from the recipe's ``logging`` config."""

    mode: str
    project: str
    run_id: str
    name: Optional[str]
    group: Optional[str]
    entity: Optional[str]
    tags: tuple[str, ...]
    dir: str


class RecipeWandBLogger(BaseLogger):
    """wandb run under ``settings.dir`` with the full recipe config. ``resume="allow"`` with
    the recipe's run id: a resumed run (same run dir, or a requeued SLURM job) appends to the
    same wandb run (offline: one folder per launch with the same id, which ``wandb sync``
    uploads one after the other)."""

    def __init__(self, settings: WandbSettings, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.settings = settings
        self.config = config
        # Every row given to wandb (step -> its metrics, rows of one step merged, as wandb
        # merges them) and the summary: what a new service process is given if wandb's dies.
        self.rows: dict[int, dict[str, Any]] = {}
        self.summary: dict[str, Any] = {}
        self.lost: Optional[str] = None  # why wandb's service is gone, once it is
        self.closed = False
        os.makedirs(settings.dir, exist_ok=True)
        self.run = self._start()
        logger.info(f"wandb ({settings.mode}) logging to {self.run.dir}")

    def _start(self) -> Any:
        s = self.settings
        run = self.wandb.init(
            entity=s.entity,
            project=s.project,
            name=s.name,
            id=s.run_id,
            resume="allow",
            group=s.group,
            tags=list(s.tags) or None,
            mode=s.mode,  # type: ignore[arg-type]
            dir=s.dir,
            config=self.config,
            settings=self.wandb.Settings(
                # offline: nothing may try the network
                disable_code=s.mode == "offline",
                console="off",  # the worker's own log files already hold its output
                init_timeout=init_timeout_s(),  # online: a bounded wait, then start_wandb goes offline
            ),
        )
        for metric in names.SUMMARY_METRICS:
            # wandb's default summary is the last value; the run writes its own at the end.
            run.define_metric(metric, summary="none")
        return run

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.rows.setdefault(step, {}).update(metrics)
        self._while_connected(lambda: self.wandb.log(metrics, step=step))

    def set_summary(self, values: dict[str, float]) -> None:
        self.summary.update(values)
        self._while_connected(lambda: self.run.summary.update(values))

    def _while_connected(self, call: Any) -> None:
        if self.lost is not None:
            return
        try:
            call()
        except ConnectionError as e:
            self.lost = repr(e)
            logger.warning(f"wandb's service process is gone ({e!r}); the rows logged from now on are "
                           f"written when the run finishes")

    def close(self, exit_code: int = 0) -> None:
        """Finish the wandb run; if wandb's service process is gone, write what it had not
        written through a new one. Training is over by then: a failure here is a warning."""
        if self.closed or self.wandb.run is None:
            return
        self.closed = True
        if self.lost is None:
            try:
                self.wandb.finish(exit_code=exit_code)
                return
            except ConnectionError as e:
                self.lost = repr(e)
        try:
            self._write_again(exit_code)
        except Exception as e:  # noqa: BLE001 - summary.json holds the run's record either way
            logger.warning(f"wandb's service process was gone ({self.lost}) and a new one could not write the "
                           f"run's rows ({e!r}); what it had written: {self.run.dir}")

    def _write_again(self, exit_code: int) -> None:
        """A new service process for the same run: the rows the dead one did not write, the
        summary, the exit code."""
        first = Path(self.run.dir).parent
        written = self._written(first)
        with contextlib.suppress(ConnectionError):
            self.wandb.teardown()  # drops the dead connection; the next init starts a service
        self.run = self._start()
        steps = {int(row["_step"]) for row in written.history if "_step" in row} if written else set()
        missing = [step for step in sorted(self.rows) if step not in steps]
        for step in missing:
            self.wandb.log(self.rows[step], step=step)
        self.run.summary.update(self.summary)
        self.wandb.finish(exit_code=exit_code)
        if self.settings.mode == "offline" and (written is None or not written.run_id):
            shutil.rmtree(first, ignore_errors=True)  # it holds no record of the run at all
        logger.warning(f"wandb's service process was gone ({self.lost}): {len(missing)} of the "
                       f"{len(self.rows)} logged steps written again through a new one, in {self.run.dir}")

    def _written(self, folder: Path) -> Optional[OfflineRun]:
        """What the dead service wrote to its offline files (None when they cannot be read).
        Online, nothing is taken as written: the server keeps the steps it has and ignores
        them when they come again."""
        if self.settings.mode != "offline":
            return None
        try:
            return read_run(str(folder))
        except (OSError, ValueError):
            return None


def start_wandb(settings: WandbSettings, config: dict[str, Any], say: Any) -> Optional[RecipeWandBLogger]:
    """The run's wandb logger. An online run whose ``wandb.init`` fails (no network, the server
    down, a key it refuses) keeps its record offline in the run dir instead; ``say`` gets the line
    that tells the console so. None (and a line saying so) when wandb cannot start at all:
    training goes on, ``summary.json`` holds its numbers."""
    try:
        return RecipeWandBLogger(settings, config)
    except Exception as e:  # noqa: BLE001 - like torchtitan: wandb must not stop training
        failure = f"wandb ({settings.mode}) could not start: {_first_line(e)}"
    if settings.mode == "online":
        import wandb

        with contextlib.suppress(Exception):
            wandb.teardown()  # what the failed start left; the next init starts a new service
        try:
            offline = RecipeWandBLogger(dataclasses.replace(settings, mode="offline"), config)
        except Exception as e:  # noqa: BLE001
            failure += f"; offline neither: {_first_line(e)}"
        else:
            say(f"warning: {failure}; the run's record is written offline instead, in "
                f"{Path(offline.run.dir).parent} (upload it later with wandb sync)")
            return offline
    say(f"warning: {failure}; this run has no wandb record (summary.json holds its numbers)")
    return None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
