"""Hydra callbacks (``hydra.callbacks`` in ``conf/train.yaml``).

* :class:`PrepareRun` (a single run): before Hydra creates the run dir, resolve
  ``training.resume``, check the config and hand the job the config it launches with
  (``launch.preflight.prepare.prepare_run``). A mistake is reported before any folder is made. A resume
  gets its own ``resumes/<n>/`` in the run dir, where Hydra writes its ``.hydra/`` files: the
  first launch's stay as they were.
* :class:`CheckEverySweepPoint` (``--multirun``): Hydra's basic sweeper composes all points up front (so typos
  fail early) but our validation would only run as each job starts: a sweep with one bad
  point (say ``parallelism.ep=16`` for a model with 8 experts) would train or submit the
  points before it and then stop. This validates every point before the first job starts.
  Hydra's own "Launching N jobs locally" is replaced by a line that does not assume where the
  jobs run (a SLURM sweep submits them).
  Into a ``hydra.sweep.dir`` that holds the sweep's runs, it finishes the sweep
  (``launch.preflight.sweep_finish``).
* :class:`PrintCompareCommand`: a sweep ends with the command that compares its runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, read_write

from launch.config.problems import ConfigError, reject

_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# The logger of Hydra's basic launcher ("Launching N jobs locally", then one line per job).
_BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher"


def sweep_points(sweep_config: Any) -> list[list[str]]:
    """The override lists of every job, as Hydra's BasicSweeper builds them from the sweep's
    config (``hydra.sweeper.params`` first, then the command line)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = sweep_config.hydra.sweeper.get("params") or {}
    args = [f"{k}={v}" for k, v in params.items()] + list(sweep_config.hydra.overrides.task)
    overrides = OverridesParser.create().parse_overrides(args)
    (points,) = BasicSweeper.split_arguments(overrides, None)
    return points


class PrepareRun(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra import compose

        from launch.preflight import prepare
        from launch.run import console
        from launch.run.run_dir import RunDirBefore, claim_resume, resume_folder

        name = config.hydra.job.config_name
        given = any(str(o).lstrip("+").startswith("hydra.run.dir=")
                    for o in config.hydra.overrides.hydra)
        try:
            run_dir = str(config.hydra.run.dir)
            before = RunDirBefore.take(run_dir)
            cfg, warnings, resume = prepare.prepare_run(
                prepare.task_config(config), list(config.hydra.overrides.task), run_dir,
                lambda overrides: compose(config_name=name, overrides=overrides), given)
        except ConfigError as e:
            reject(e)
        if resume is not None:
            print(resume.line, flush=True)
            if resume.step is None:  # training.resume=auto found nothing: a new run
                resume = None
            else:
                resume.number = claim_resume(run_dir)
                with read_write(config.hydra):
                    config.hydra.output_subdir = str(resume_folder(".", resume.number) / ".hydra")
        for w in warnings:
            console.warn(w)
        prepare.replace_task_config(config, cfg)
        prepare.mark_prepared(run_dir, resume, before)


class CheckEverySweepPoint(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra import compose

        from launch.preflight import sweep_finish
        from launch.preflight.hydra_errors import explain
        from launch.preflight.validate import validate
        from launch.run.run_dir import RUN_CONFIG, folder_name

        problems: list[str] = []
        if config.training.resume is not None:
            problems.append(f"training.resume={config.training.resume} continues one run: drop "
                            f"--multirun (or drop training.resume to sweep new runs)")
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        finishing = bool(list(sweep_dir.glob(f"*/{RUN_CONFIG}")))  # launch.preflight.sweep_finish
        if config.hydra.sweeper.get("_target_") != _BASIC_SWEEPER:
            if finishing:
                problems.append(f"hydra.sweep.dir={sweep_dir} already holds the runs of a sweep; "
                                f"choose another (or leave it out: each sweep gets its own folder)")
            if problems:
                reject(ConfigError(problems))
            return
        points = sweep_points(config)
        named = []
        for num, point in enumerate(points):
            shown = " ".join(o for o in point if not o.startswith("hydra."))
            try:
                composed = compose(config_name=config.hydra.job.config_name, overrides=point)
                validate(composed)
                varying = " ".join(o for o in point if not all(o in other for other in points)) or shown
                named.append(sweep_finish.Point(num, varying, f"{num}_{folder_name(point, composed.a2a.name)}"))
            except Exception as e:  # noqa: BLE001 - Hydra's composition errors, said as ours
                error = explain(e, point)
                if error is None:
                    raise
                problems += [f"sweep job #{num} ({shown}): {p}" for p in error.problems]
        sweep = sweep_finish.Sweep(sweep_dir, named, str(config.training.checkpoint_folder))
        if not problems and finishing:
            problems += sweep_finish.prepare_folder(sweep)
        if problems:
            reject(ConfigError(problems, note=f"nothing was started: fix or drop these points of "
                                              f"the {len(points)}-job sweep"))
        sweep_finish.begin(sweep)
        logging.getLogger(_BASIC_LAUNCHER).setLevel(logging.WARNING)
        runs = f"{len(points)} run{'s' if len(points) != 1 else ''}"
        print(f"[mxfp8ep] sweep of {runs}, launched one after another with "
              f"launcher={config.launcher.get('name')}", flush=True)


class PrintCompareCommand(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print(f"\ncompare the runs (once all have finished):\n"
              f"  python launch/compare_runs.py {config.hydra.sweep.dir}", flush=True)
