"""Hydra callbacks of ``--multirun`` (``hydra.callbacks`` in ``conf/train.yaml``).

* :class:`CheckEverySweepPoint`: Hydra's basic sweeper composes all points up front (so typos
  fail early) but our validation would only run as each job starts: a sweep with one bad
  point (say ``parallelism.ep=16`` for a model with 8 experts) would train or submit the
  points before it and then stop. This validates every point before the first job starts.
* :class:`PrintCompareCommand`: a sweep ends with the command that compares its runs.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


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


class CheckEverySweepPoint(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra import compose

        from launch.validate import ConfigError, validate

        if config.hydra.sweeper.get("_target_") != _BASIC_SWEEPER:
            return
        points = sweep_points(config)
        problems: list[str] = []
        for num, point in enumerate(points):
            try:
                validate(compose(config_name=config.hydra.job.config_name, overrides=point))
            except ConfigError as e:
                shown = " ".join(o for o in point if not o.startswith("hydra."))
                problems += [f"sweep job #{num} ({shown}): {p}" for p in e.problems]
        if problems:
            error = ConfigError(problems + [f"nothing was started: fix or drop these points of "
                                            f"the {len(points)}-job sweep"])
            print(f"[mxfp8ep] {error}", file=sys.stderr, flush=True)
            raise SystemExit(2)


class PrintCompareCommand(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print(f"\ncompare the runs (once all have finished):\n"
              f"  python launch/compare_runs.py {config.hydra.sweep.dir}", flush=True)
