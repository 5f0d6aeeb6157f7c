"""Train an expert-parallel MoE with torchtitan, the all-to-all in bf16 or MXFP8.

    python launch/train.py                                  # tiny Llama4, 2 processes, bf16
    python launch/train.py a2a=mxfp8                        # same, tokens sent as MXFP8
    python launch/train.py --multirun a2a=bf16,mxfp8        # both, one after the other
    python launch/train.py training.resume=<run dir>        # continue a stopped run
    python launch/train.py --help                           # groups, options, examples

Config groups live in conf/ (see conf/train.yaml); recipes in recipes/. Everything that can be
checked is checked before any process starts or any folder is made (launch/preflight/prepare.py); every
config mistake is one message and exit code 2 (launch/config/problems.py). A run prints a header, one
line per log window and a summary (launch/run/console.py); Ctrl-C / SIGTERM stop it cleanly.
"""
# ruff: noqa: E402  (this Python is checked for the recipe's packages before they are imported)

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import shutil
import signal
import sys
import traceback
from pathlib import Path
from typing import Optional


try:  # the package, or where it cannot be imported, the file beside this one
    from launch.recipe_python import require_recipe_python
except ImportError:
    import importlib.util as _util

    _spec = _util.spec_from_file_location("recipe_python", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                         "recipe_python.py"))
    _module = _util.module_from_spec(_spec)  # type: ignore[arg-type]
    _spec.loader.exec_module(_module)  # type: ignore[union-attr]
    require_recipe_python = _module.require_recipe_python

require_recipe_python(("hydra", "launch"))

from launch.launchers import spawned_worker  # noqa: F401  (first: a spawned worker's SIGINT while it imports)

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

from launch.config.problems import ConfigError, reject
from launch.launchers.launcher import RunFailed, RunRefused, RunStopped, launcher_for
from launch.preflight import config_store  # noqa: F401  (registers the schemas and resolvers)
from launch.preflight import prepare, sweep_finish
from launch.preflight.show_config import is_sweep, job_config_text, overrides_of, sweep_job_configs, wants_job_config
from launch.run import console, run_lock
from launch.run.resume import Resume, with_the_runs_options
from launch.run.run_dir import (RUN_CONFIG, RunDirBefore, claim_resume, claim_run_config,
                                 remove_incomplete_checkpoints, resume_folder, trained_nothing)
from launch.run.run_summary import RunSummary

CONF = Path(__file__).resolve().parent.parent / "conf"
# The launching process's record (train.log in the run dir; not the console).
log = logging.getLogger("launch.train")


def resume_command(run_dir: str) -> str:
    """The command that continues the run in ``run_dir``, as this one was started."""
    return f"python {shlex.quote(sys.argv[0])} training.resume={shlex.quote(run_dir)}"


def launch(cfg: DictConfig, run_dir: str, resume: Optional[Resume],
           before: RunDirBefore) -> Optional[RunSummary]:
    """Write the launch's config and hand it to its launcher; map how it ended to an exit code.
    ``resume``: what it continues (None: a new run, whose folder must not hold a run yet);
    ``before``: what the run dir held before, restored when the launcher refuses the run. The
    launch holds the run dir while it lasts (``launch.run.run_lock``; a SLURM launch hands its
    hold to the job)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    number = resume.number if resume is not None else None
    try:
        took_over = run_lock.take(run_dir)
    except ConfigError as e:  # another launch holds it since the check before launch
        if number is not None:
            shutil.rmtree(resume_folder(run_dir, number), ignore_errors=True)
        reject(e)
    if took_over:
        print(took_over, flush=True)
    try:
        return _launch(cfg, run_dir, resume, before)
    finally:
        run_lock.release(run_dir)


def _launch(cfg: DictConfig, run_dir: str, resume: Optional[Resume],
            before: RunDirBefore) -> Optional[RunSummary]:
    """:func:`launch` once the run dir is held."""
    number = resume.number if resume is not None else None
    try:
        claim_run_config(run_dir, OmegaConf.to_yaml(cfg, resolve=True), number)
    except FileExistsError:
        reject(ConfigError([f"hydra.run.dir={run_dir}: another launch started a run in this folder "
                            f"first ({RUN_CONFIG}); nothing was started. Launch again (a new run "
                            f"gets a free folder) or continue that run with training.resume={run_dir}"]))
    console.start_console_log(run_dir, resume)
    log.info("launch: %s", " ".join(sys.argv))
    log.info(resume.line.removeprefix("[mxfp8ep] ") if resume else f"a new run in {run_dir}")
    try:
        summary = launcher_for(cfg).launch(cfg, run_dir)
    except RunStopped as e:
        log.info("stopped by signal %d", e.signum)
        steps = e.summary.steps if e.summary is not None else None
        if resume is None and cfg.launcher.name == "local" and trained_nothing(
                run_dir, steps, cfg.training.checkpoint_folder):
            before.restore()  # a new run that trained no step leaves no folder behind
            print(f"[mxfp8ep] stopped by {signal.Signals(e.signum).name} before a step was trained; "
                  f"its run dir was removed ({run_dir})", file=sys.stderr, flush=True)
            raise SystemExit(128 + e.signum) from None
        console.show(run_dir, console.stop_line(e.signum, e.summary, run_dir, resume_command(os.path.abspath(run_dir))),
                     err=True)
        ended(cfg, run_dir, console.how_it_ended(e.summary, e.signum))
        raise SystemExit(128 + e.signum) from None
    except RunFailed as e:
        log.info("failed: %s", e)
        console.show(run_dir, f"[mxfp8ep] {e}", err=True)
        ended(cfg, run_dir, f"failed: {e}", failed_at=getattr(resume, "step", None) or 0)
        raise SystemExit(1) from None
    except RunRefused as e:
        if cfg.logging.verbose:
            traceback.print_exc()
        before.restore()  # nothing was started: the run dir is as it was before this launch
        reject(str(e))
    except KeyboardInterrupt:  # Ctrl-C before the launcher started anything (it says so itself after)
        before.restore()
        log.info("interrupted before anything was started")
        print("[mxfp8ep] interrupted (SIGINT) before anything was started", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
    if summary is not None:
        log.info("ended: step %d of %d", summary.steps, summary.target_steps)
        console.show(run_dir, console.format_summary(summary, resume))
        ended(cfg, run_dir, console.how_it_ended(summary))
    return summary


def ended(cfg: DictConfig, run_dir: str, how: str, failed_at: Optional[int] = None) -> None:
    """Once no process of the launch is left: ``console.log`` and ``summary.json`` say how it
    ended, and what a checkpoint write cut short by a kill left is removed. ``failed_at``: the
    step a failed launch started from, for the summary it gets when rank 0 wrote none."""
    console.record_end(run_dir, how)
    summary = RunSummary.read(run_dir)
    if summary is None and failed_at is not None:
        summary = RunSummary.before_training(cfg, run_dir, failed_at)
    if summary is not None:
        summary.record_end(how)
        summary.write(run_dir)
    removed = remove_incomplete_checkpoints(run_dir, cfg.training.checkpoint_folder)
    if removed:
        log.info("removed what cut-short checkpoint writes left: %s", ", ".join(removed))


def run(cfg: DictConfig, run_dir: str, overrides: list[str]) -> Optional[RunSummary]:
    """Check and launch a composed config (what a sweep's job does: a new run in a new folder,
    or, finishing a sweep, its point's run resumed or left as it is: launch/preflight/sweep_finish.py).
    When the job ends the sweep, it names the points that did not run and how to finish it."""
    console.route_logging(verbose=cfg.logging.verbose)
    try:
        return _sweep_job(cfg, Path(run_dir).absolute(), overrides)
    except SystemExit as e:
        if e.code:
            lines = sweep_finish.unfinished(HydraConfig.get().job.num)
            if lines:
                print(lines, file=sys.stderr, flush=True)
        raise


def _sweep_job(cfg: DictConfig, point: Path, overrides: list[str]) -> Optional[RunSummary]:
    state, step = sweep_finish.point_state(point, cfg.training.checkpoint_folder)
    if state == sweep_finish.DONE:
        print(f"[mxfp8ep] {point} completed step {step} already: not run again", flush=True)
        return RunSummary.read(point)
    if state == sweep_finish.HELD:
        print(f"[mxfp8ep] {point} is being trained by {step}: left alone", flush=True)
        return None
    resume = None
    try:
        if state == sweep_finish.RESUME:
            from hydra import compose

            with read_write(cfg):
                cfg.training.resume = str(point)
            cfg, warnings, resume = prepare.prepare_run(cfg, overrides, str(point),
                                                        lambda ovs: compose("train", overrides=ovs))
        else:
            cfg, warnings = prepare.prepare(cfg, overrides)
    except ConfigError as e:
        reject(e)
    for w in warnings:
        console.warn(w, once=True)  # once per sweep (the SLURM requeue warning of every point alike)
    if resume is not None:
        print(resume.line, flush=True)
        resume.number = claim_resume(point)
        return launch(cfg, str(point), resume, RunDirBefore.take(point))
    return launch(cfg, str(point), None, RunDirBefore(point, existed=False, kept_ancestor=point.parent))


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> Optional[RunSummary]:
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    if hc.mode == RunMode.RUN and prepare.was_prepared(run_dir):  # by launch.preflight.callbacks.PrepareRun
        console.route_logging(verbose=cfg.logging.verbose)
        return launch(cfg, run_dir, *prepare.prepared_launch())
    return run(cfg, run_dir, list(hc.overrides.task))


def _launcher_fields() -> dict[str, list[str]]:
    """Every launcher option's fields (conf/launcher/*.yaml), for messages about a launcher.*
    key the chosen launcher does not have."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from launch.launchers.launcher import launcher_class

    GlobalHydra.instance().clear()
    out = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for path in sorted((CONF / "launcher").glob("*.yaml")):
            try:
                cfg = compose("train", overrides=[f"launcher={path.stem}"])
                out[path.stem] = [f.name for f in dataclasses.fields(launcher_class(cfg).Config)]
            except Exception:  # noqa: BLE001 - a broken option only loses its hint
                continue
    return out


# Overrides whose value is a folder, taken as written: run folder names hold "=" and ",", which
# Hydra's override grammar reads as syntax unless the value is quoted.
PATH_KEYS = ("training.resume", "hydra.run.dir", "hydra.sweep.dir")


def literal_paths(args: list[str]) -> list[str]:
    """``args`` with the values of :data:`PATH_KEYS` quoted for Hydra (unless already quoted)."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") in PATH_KEYS and value and value[0] not in "'\"":
            quote = "'" if "'" not in value else '"'
            if quote not in value:
                arg = f"{key}={quote}{value}{quote}"
        out.append(arg)
    return out


def cli() -> None:
    """``python launch/train.py``: Hydra's app, with every config mistake Hydra finds while
    composing reported as ours (launch/preflight/hydra_errors.py) and exit code 2."""
    from launch.preflight.hydra_errors import explain, split_overrides

    sys.stdout.reconfigure(line_buffering=True)  # progress lines appear as they come
    # Hydra prints its own errors and exits 1 unless HYDRA_FULL_ERROR is set: then they come here.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    split = None if wants_job_config(sys.argv[1:]) else split_overrides(sys.argv[1:])  # --cfg job: read here
    if split is not None:
        reject(ConfigError([split]))
    sys.argv[1:] = with_the_runs_options(literal_paths(sys.argv[1:]), CONF)
    try:
        if wants_job_config(sys.argv[1:]):  # --cfg job: the launch's config, checked; nothing started
            show = sweep_job_configs if is_sweep(sys.argv[1:]) else job_config_text
            print(show(CONF, overrides_of(sys.argv[1:])), end="", flush=True)
            return
        main()
    except ConfigError as e:
        reject(e)
    except KeyboardInterrupt:  # Ctrl-C before a launcher took over (nothing was started)
        print("[mxfp8ep] interrupted (SIGINT) before anything was started", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    except Exception as e:  # noqa: BLE001 - translated when it is a config mistake
        error = explain(e, overrides_of(sys.argv[1:]), _launcher_fields)
        if error is None:
            raise
        reject(error)


if __name__ == "__main__":
    cli()
