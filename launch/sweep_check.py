"""Validate every point of a ``--multirun`` sweep before its first job starts.

Hydra's basic sweeper composes all points up front (so typos fail early) but runs our
validation only as each job starts: a sweep with one bad point (say ``parallelism.ep=16``
for a model with 8 experts) would otherwise train or submit the points before it and then
stop. The first job of a sweep calls :func:`check_sweep_once`, which re-derives the points the
way the sweeper does and validates each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from launch.validate import ConfigError, validate

_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
_checked: set[str] = set()


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


def check_sweep_once(hydra_cfg: Any) -> None:
    """In a multirun with the basic sweeper, validate all points (once per sweep); raise
    :class:`ConfigError` naming each bad point and its problems."""
    from hydra import compose
    from hydra.types import RunMode

    if hydra_cfg.mode != RunMode.MULTIRUN or hydra_cfg.sweeper.get("_target_") != _BASIC_SWEEPER:
        return
    saved = Path(hydra_cfg.sweep.dir) / "multirun.yaml"
    if str(saved) in _checked or not saved.is_file():
        return
    _checked.add(str(saved))
    points = sweep_points(OmegaConf.load(saved))
    problems: list[str] = []
    for num, point in enumerate(points):
        cfg = compose(config_name=hydra_cfg.job.config_name, overrides=point)
        try:
            validate(cfg)
        except ConfigError as e:
            shown = " ".join(o for o in point if not o.startswith("hydra."))
            problems += [f"sweep job #{num} ({shown}): {p}" for p in e.problems]
    if problems:
        raise ConfigError(problems + [f"nothing was started: fix or drop these points of the "
                                      f"{len(points)}-job sweep"])
