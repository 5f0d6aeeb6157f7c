"""What a run prints: a header, one line per log window, the summary, and nothing else.

The launching process prints the header and, at the end, the summary (or one line when a
signal stopped the run or a rank failed). Rank 0 writes the progress lines to
``<run dir>/console.log`` (and, while a step runs longer than ``logging.heartbeat_s``, a line
that says so); the launcher prints what is added to that file while the run goes
(:func:`follow`), and adds its own lines to it (:func:`show`), so the file holds what the
console showed. A resumed run appends to the file below a line that names the resume
(:func:`start_console_log`). Everything else the processes print (torchtitan's log, wandb,
library warnings) goes to the run's log files, named in the header; the launching process's
own record (what was launched, the torch elastic agent, how it ended) to ``train.log``.
``logging.verbose=true`` shows all of it on the console.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import shlex
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from launch.config.stack import Stack
from launch.run.run_dir import CONSOLE_LOG, resume_folder
from launch.run.run_summary import INTER_NODE, RunSummary
from launch.run.shared_gpu import SHARED_GPU_NOTE

if TYPE_CHECKING:
    from launch.run.resume import Resume


def _num(x: Optional[float], spec: str) -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def format_eta(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``3s``."""
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def header(cfg: Any, run_dir: str, processes: str, logs: str) -> str:
    """``processes``: e.g. "2 CPU processes (gloo)"; ``logs``: where the full output goes,
    relative to the run dir."""
    p = cfg.parallelism
    return (f"mxfp8ep: model={cfg.model.name} a2a={cfg.a2a.name} parallelism={p.name} (EP {p.ep}), "
            f"{cfg.training.steps} steps on {processes}\n"
            f"  run dir {run_dir}\n"
            f"  logs    {logs} in the run dir")


def progress_line(step: int, steps: int, loss: float, tokens_per_s: float, eta_s: Optional[float]) -> str:
    """One log window's line; ``eta_s`` None (the first window, start-up in its time) leaves the
    estimate out."""
    width = len(str(steps))
    eta = f"  eta {format_eta(eta_s)}" if eta_s is not None else ""
    return f"step {step:>{width}}/{steps}  loss {loss:.4f}  tokens/s {_num(tokens_per_s, ',.0f')}{eta}"


def validation_line(step: int, steps: int, loss: float) -> str:
    width = len(str(steps))
    return f"step {step:>{width}}/{steps}  val loss {loss:.4f}"


def _steady(s: RunSummary) -> str:
    """What the throughput and step time are over: the steps after the first log window."""
    return f" (tokens / time of the last {s.steady_steps} steps)" if s.steady_steps else ""


def _capacity(s: RunSummary) -> str:
    """The symm transport's expert capacity at the end and its ceiling, the steps run again to
    grow it, and those that needed more than the ceiling."""
    if s.capacity_rows is None:
        return ""
    ceiling = f" (ceiling {s.capacity_ceiling_rows:,})" if s.capacity_ceiling_rows else ""
    steps = ", ".join(str(step) for step in s.capacity_replay_steps)
    replays = f", {s.capacity_replays} steps run again to grow it ({steps})" if s.capacity_replays else ""
    spill_steps = ", ".join(str(step) for step in s.capacity_spill_steps)
    spills = (f"; {s.capacity_spills} of them past the ceiling, run at exactly their rows ({spill_steps})"
              if s.capacity_spills else "")
    return f"  a2a capacity    {s.capacity_rows:,} expert rows{ceiling}{replays}{spills}\n"


def _routing(s: RunSummary) -> str:
    """The routing telemetry's largest load per EP degree (busiest rank over balanced)."""
    if not s.moe_imbalance:
        return ""
    loads = ", ".join(f"EP {k.removeprefix('ep')} {v['max']:.2f}" for k, v in s.moe_imbalance.items())
    return f"  routing load    {loads} (busiest rank / balanced, largest of any step)\n"


def still_running_line(step: int, steps: int, seconds: float) -> str:
    """The heartbeat while a step runs long (``logging.heartbeat_s``)."""
    return (f"step {step:>{len(str(steps))}}/{steps}  still running ({format_eta(seconds)} so "
            f"far; stuck? see docs/usage.md#when-a-step-never-finishes)")


def resume_line(resume: "Resume") -> str:
    """The line in ``console.log`` above a resumed launch's lines."""
    changed = " ".join(resume.changed) or "nothing"
    notes = "".join(f"; {note}" for note in resume.notes)
    return (f"==== resume {resume.number} ({datetime.datetime.now():%Y-%m-%d %H:%M:%S}): from "
            f"step {resume.step}, changed on the command line: {changed}{notes}; its config in "
            f"{resume_folder('.', resume.number or 0)}/ ====")


def start_console_log(run_dir: str, resume: Optional["Resume"]) -> None:
    """Make the run's ``console.log``; a resume appends :func:`resume_line` to the earlier
    launches' lines."""
    with (Path(run_dir) / CONSOLE_LOG).open("a") as f:
        if resume is not None:
            f.write(resume_line(resume) + "\n")


def _wandb_lines(s: RunSummary) -> str:
    """The wandb folders, named once, relative to the run dir; for offline runs the command
    that uploads them (every launch's, one after the other: the history appended)."""
    if not s.wandb_dirs:
        return "none"
    run_dir = Path(s.run_dir).resolve()
    rel = [os.path.relpath(Path(d).resolve(), run_dir) for d in s.wandb_dirs]
    inside = not any(r.startswith("..") for r in rel)
    text = ", ".join(rel if inside else s.wandb_dirs) + (" (in the run dir)" if inside else "")
    if s.wandb_mode == "offline":
        sync = (shlex.quote(str(run_dir / "wandb")) + "/offline-run-*" if inside
                else " ".join(shlex.quote(d) for d in s.wandb_dirs))
        text += f"\n    upload later with: wandb sync {sync}"
    return text


def _between_nodes(s: RunSummary) -> str:
    """The part of the all-to-all bytes that crossed between nodes, where a transport counted it
    (two_hop's node hop), after the bytes per step; else ""."""
    inter = s.a2a_bytes_per_step_by_leg.get(INTER_NODE)
    return f", {inter:,.0f} of them between nodes" if inter else ""


def format_summary(s: RunSummary, resume: Optional["Resume"] = None) -> str:
    """The run's summary; ``resume``: what this launch continued (its number and changes go
    beside the run's name, which stays its first launch's: the wandb run's)."""
    wandb = _wandb_lines(s)
    stopped = f" (stopped by {s.stopped_by})" if s.stopped_by else ""
    resumed = f", resumed from step {s.start_step}" if s.start_step else ""
    this_launch = (f", resume {resume.number}: {' '.join(resume.changed) or 'nothing changed'}"
                   if resume is not None and resume.number else "")
    return (
        f"==== mxfp8ep run {s.run_name}{this_launch} ====\n"
        f"  model {s.model}  a2a {s.a2a}" + (f" over {s.transport}" if s.transport else "")
        + f"  parallelism {s.parallelism} "
        f"(world {s.world_size}, ep {s.ep})\n"
        + (f"  stack           {Stack.from_dict(s.stack).label}\n" if s.stack else "")
        + f"  steps           {s.steps}/{s.target_steps}{resumed}{stopped}\n"
        f"  final loss      {_num(s.final_loss, '.4f')}\n"
        + (f"  val loss        {_num(s.final_val_loss, '.4f')} at step {s.val_logged_steps[-1]}\n"
           if s.val_logged_steps else "")
        + f"  tokens/s        {_num(s.tokens_per_s_global, ',.0f')} all ranks, "
        f"{_num(s.tokens_per_s, ',.0f')} per rank{_steady(s)}"
        + (f" ({SHARED_GPU_NOTE})" if s.gpu_shared else "") + "\n"
        f"  step time (s)   {_num(s.step_time_s, '.4f')}\n"
        f"  TFLOPS, MFU     {_num(s.tflops, ',.2f')}, {_num(s.mfu_pct, '.2f')}"
        f"{'%' if s.mfu_pct is not None else ''}\n"
        f"  a2a bytes/step  {_num(s.a2a_bytes_per_step, ',.0f')}{_between_nodes(s)}\n"
        + _capacity(s)
        + _routing(s)
        + f"  run dir         {s.run_dir}\n"
        f"  wandb ({s.wandb_mode})  {wandb}"
    )


def resume_command(run_dir: str, script: Optional[str] = None) -> str:
    """The command that continues the run in ``run_dir`` (``script``: the entry point as the
    launch named it; default: this process's)."""
    return f"python {shlex.quote(script or sys.argv[0])} training.resume={shlex.quote(run_dir)}"


def stop_line(signum: int, summary: Optional[RunSummary], run_dir: str, resume_command: str) -> str:
    """The one line printed when a signal stopped a run; ``resume_command`` continues it."""
    import signal

    name = signal.Signals(signum).name
    if signum == signal.SIGUSR2:  # with no requeue left (launcher.max_num_timeout), it ends the run
        name += " (SLURM's notice of the time limit or a preemption; no requeue left)"
    if summary is None or summary.steps == summary.start_step:
        return f"[mxfp8ep] stopped by {name} before a step was trained; nothing new to resume ({run_dir})"
    saved = (f"checkpoint {summary.checkpoint}" if summary.checkpoint
             else "no checkpoint (training.checkpoint_enable=false), so it cannot be resumed")
    wandb = f", wandb run {summary.wandb_run_id} finished" if summary.wandb_run_id else ""
    again = f"; continue with: {resume_command}" if summary.checkpoint else ""
    return f"[mxfp8ep] stopped by {name} at step {summary.steps}/{summary.target_steps}: {saved}{wandb}{again}"


def how_it_ended(s: Optional[RunSummary], signum: Optional[int] = None) -> str:
    """How a launch ended, from its summary (``signum``: the signal that stopped it, when it
    has no summary of this launch)."""
    import signal

    if s is None or (s.stopped_by and s.steps == s.start_step):
        name = s.stopped_by if s is not None else signal.Signals(signum).name if signum else "?"
        return f"stopped by {name} before a step was trained"
    if not s.stopped_by:
        return f"completed step {s.steps}/{s.target_steps}"
    saved = f"checkpoint {Path(s.checkpoint).name}" if s.checkpoint else "no checkpoint"
    return f"stopped by {s.stopped_by} at step {s.steps}/{s.target_steps} ({saved})"


def record_end(run_dir: str, how: str) -> None:
    """The line at the end of ``console.log`` that says how the launch ended."""
    with (Path(run_dir) / CONSOLE_LOG).open("a") as f:
        f.write(f"==== ended {datetime.datetime.now():%Y-%m-%d %H:%M:%S}: {how} ====\n")


def show(run_dir: str, text: str, *, err: bool = False) -> None:
    """Print ``text`` (stderr with ``err``) and keep it in ``console.log``: the launching
    process's own lines (the header, the summary, the line a stop or a failure ends with), so the
    file holds what the console showed."""
    print(text, file=sys.stderr if err else sys.stdout, flush=True)
    with (Path(run_dir) / CONSOLE_LOG).open("a") as f:
        f.write(text + "\n")


# The warnings ``warn(..., once=True)`` printed in this process (a sweep's points share them).
_WARNED: set[str] = set()


def warn(message: str, once: bool = False) -> None:
    """Print ``message`` as a warning; with ``once``, only where this process has not yet (a
    sweep's points, checked one after another, say their common warnings once)."""
    if once and message in _WARNED:
        return
    _WARNED.add(message)
    print(f"[mxfp8ep] warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def follow(run_dir: str, every_s: float = 0.2) -> Iterator[None]:
    """Print the lines rank 0 adds to ``<run dir>/console.log`` while the block runs; what the
    file held before (an earlier launch's lines) is not printed again."""
    path = Path(run_dir) / CONSOLE_LOG
    offset = path.stat().st_size if path.is_file() else 0
    done = threading.Event()

    def pump() -> None:
        nonlocal offset
        while True:
            last = done.is_set()
            offset = _print_added(path, offset, whole=last)
            if last:
                return
            done.wait(every_s)

    thread = threading.Thread(target=pump, name="console-follow", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _print_added(path: Path, offset: int, whole: bool) -> int:
    """Print the complete lines of ``path`` from ``offset`` on (``whole``: also a last line
    without its newline); the offset after them."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    end = len(data) if whole else data.rfind(b"\n") + 1
    if end:
        text = data[:end].decode(errors="replace")
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    return offset + end


def _ours(record: logging.LogRecord) -> bool:
    return record.name.startswith("launch") and record.levelno >= logging.WARNING


# torch's loggers whose INFO records go to train.log: the elastic agent starting, watching and
# stopping the workers (torch sets them to WARNING unless LOGLEVEL is set).
_RECORDED = ("torch.distributed.elastic", "torch.distributed.launcher")


def route_logging(verbose: bool) -> None:
    """In the launching process: our own warnings on the console, everything else (our record
    of the launch, torch elastic's agent, library warnings) only in the run's ``train.log``
    (Hydra's file handler). Call it again after importing torch: torch's logging setup
    replaces the handlers of the "torch" logger."""
    logging.captureWarnings(True)
    if "LOGLEVEL" not in os.environ:
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if isinstance(logger, logging.Logger) and name.startswith(_RECORDED):
                logger.setLevel(logging.INFO)
    if verbose:
        return
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    for handler in root.handlers:
        if handler not in files:
            handler.addFilter(_ours)
    # torch's loggers ("torch", "torch.distributed", ...) have stderr handlers of their own.
    loggers = [logging.getLogger("py.warnings")] + [
        logger for name, logger in logging.root.manager.loggerDict.items()
        if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger) and logger.handlers
    ]
    for logger in loggers:
        logger.handlers = list(files)
        logger.propagate = False
