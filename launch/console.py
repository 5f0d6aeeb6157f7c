"""What a run prints: a header, one line per log window, the summary, and nothing else.

The launching process prints the header and, at the end, the summary (or one line when a
signal stopped the run). Rank 0 writes the progress lines to ``<run dir>/console.log``; the
launcher follows that file (torch elastic's own ``TailLog``). Everything else the processes
print (torchtitan's log, wandb, library warnings, the torch elastic agent) goes to the run's
log files, named in the header. ``logging.verbose=true`` shows all of it on the console too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from launch.run_dir import CONSOLE_LOG
from launch.run_summary import RunSummary
from launch.shared_gpu import SHARED_GPU_NOTE


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


def progress_line(step: int, steps: int, loss: float, tokens_per_s: float, eta_s: float) -> str:
    width = len(str(steps))
    return (f"step {step:>{width}}/{steps}  loss {loss:.4f}  tokens/s {_num(tokens_per_s, ',.0f')}"
            f"  eta {format_eta(eta_s)}")


def validation_line(step: int, steps: int, loss: float) -> str:
    width = len(str(steps))
    return f"step {step:>{width}}/{steps}  val loss {loss:.4f}"


def _steady(s: RunSummary) -> str:
    """What the throughput and step time are over: the steps after the first log window."""
    return f" (tokens / time of the last {s.steady_steps} steps)" if s.steady_steps else ""


def format_summary(s: RunSummary) -> str:
    wandb = ", ".join(s.wandb_dirs) if s.wandb_dirs else "none"
    if s.wandb_dirs and s.wandb_mode == "offline":
        # wandb sync uploads attempts of one run id one after the other: history appended.
        wandb += "\n    upload later with: wandb sync " + " ".join(s.wandb_dirs)
    stopped = f" (stopped by {s.stopped_by})" if s.stopped_by else ""
    resumed = f", resumed from step {s.start_step}" if s.start_step else ""
    return (
        f"==== mxfp8ep run {s.run_name} ====\n"
        f"  model {s.model}  a2a {s.a2a}  parallelism {s.parallelism} "
        f"(world {s.world_size}, ep {s.ep})\n"
        f"  steps           {s.steps}/{s.target_steps}{resumed}{stopped}\n"
        f"  final loss      {_num(s.final_loss, '.4f')}\n"
        + (f"  val loss        {_num(s.final_val_loss, '.4f')} at step {s.val_logged_steps[-1]}\n"
           if s.val_logged_steps else "")
        + f"  tokens/s        {_num(s.tokens_per_s_global, ',.0f')} all ranks, "
        f"{_num(s.tokens_per_s, ',.0f')} per rank{_steady(s)}"
        + (f" ({SHARED_GPU_NOTE})" if s.gpu_shared else "") + "\n"
        f"  step time (s)   {_num(s.step_time_s, '.4f')}\n"
        f"  TFLOPS, MFU     {_num(s.tflops, ',.2f')}, {_num(s.mfu_pct, '.2f')}"
        f"{'%' if s.mfu_pct is not None else ''}\n"
        f"  a2a bytes/step  {_num(s.a2a_bytes_per_step, ',.0f')}\n"
        f"  run dir         {s.run_dir}\n"
        f"  wandb ({s.wandb_mode})  {wandb}"
    )


def stop_line(signum: int, summary: Optional[RunSummary], run_dir: str, resume_command: str) -> str:
    """The one line printed when a signal stopped a run; ``resume_command`` continues it."""
    import signal

    name = signal.Signals(signum).name
    if summary is None or summary.steps == summary.start_step:
        return f"[mxfp8ep] stopped by {name} before a step was trained; nothing new to resume ({run_dir})"
    saved = (f"checkpoint {summary.checkpoint}" if summary.checkpoint
             else "no checkpoint (training.checkpoint_enable=false), so it cannot be resumed")
    wandb = f", wandb run {summary.wandb_run_id} finished" if summary.wandb_run_id else ""
    again = f"; continue with: {resume_command}" if summary.checkpoint else ""
    return f"[mxfp8ep] stopped by {name} at step {summary.steps}/{summary.target_steps}: {saved}{wandb}{again}"


def warn(message: str) -> None:
    print(f"[mxfp8ep] warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def follow(run_dir: str) -> Iterator[None]:
    """Print rank 0's console lines (``<run dir>/console.log``) while the block runs."""
    from torch.distributed.elastic.multiprocessing.tail_log import TailLog

    path = Path(run_dir) / CONSOLE_LOG
    tail = TailLog("console", {0: str(path)}, sys.stdout, log_line_prefixes={0: ""}).start()
    try:
        yield
    finally:
        tail.stop()


def _ours(record: logging.LogRecord) -> bool:
    return record.name.startswith("launch")


def route_logging(verbose: bool) -> None:
    """In the launching process: our own log records on the console, everything else (torch
    elastic's agent, library warnings) only in the run's ``train.log`` (Hydra's file handler).
    Call it again after importing torch: torch's logging setup replaces the handlers of the
    "torch" logger."""
    logging.captureWarnings(True)
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
