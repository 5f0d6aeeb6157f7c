"""From what Hydra composed to the config a run launches with, before anything is started.

:func:`prepare_run` (a single run; ``launch.preflight.callbacks.PrepareRun`` calls it before Hydra creates
the run dir): resolve ``training.resume`` (``launch.run.resume``), then :func:`prepare`. A sweep's
jobs go through :func:`prepare` alone (``launch/train.py``), after
``launch.preflight.callbacks.CheckEverySweepPoint`` checked every point.

:func:`prepare`: fill the fields whose defaults depend on the rest (wandb group, run id and
name), check everything (``launch.preflight.validate``), type the launcher's fields and
resolve ``a2a.capacity_ceiling=auto`` where the memory is known.
"""

from __future__ import annotations

import copy
import os
import uuid
from typing import Callable, Optional

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from launch.config import model_facts
from launch.config.problems import ConfigError
from launch.launchers.launcher import launcher_class, with_typed_launcher
from launch.launchers.machine import Machine
from launch.preflight.validate import resolved_ceiling, validate
from launch.run.resume import AUTO, Resume, check_new_run_dir, check_resumable, resumed_config
from launch.run.run_dir import RunDirBefore, run_name
from launch.run.run_lock import check_free

# The run dir PrepareRun prepared the config for (train.py does not prepare it again), what
# the launch resumes (None: a new run) and what the run dir held before.
_prepared: Optional[str] = None
_prepared_launch: tuple[Optional[Resume], Optional[RunDirBefore]] = (None, None)


def finalize(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Fill the fields whose defaults depend on the rest of the config (a copy)."""
    cfg = copy.deepcopy(cfg)
    with read_write(cfg):
        lg = cfg.logging
        lg.group = lg.group or cfg.experiment
        lg.run_id = lg.run_id or uuid.uuid4().hex[:8]
        lg.run_name = lg.run_name or run_name(overrides, cfg.a2a.name)
        t = cfg.training
        if t.lr_schedule_steps is None and t.steps > 0:
            t.lr_schedule_steps = t.steps
    return cfg


def meant_for(cfg: DictConfig) -> Optional[Machine]:
    """The node ``cfg`` says it is meant for (``validate.gpu_mem_gib``: a GPU of that memory per
    process, one GPU when they share it); None where it names none."""
    gib = cfg.validate.gpu_mem_gib
    if gib is None or gib <= 0:
        return None
    p = cfg.parallelism
    return Machine.with_gpus(1 if p.share_gpu else p.procs_per_node, gib)


def prepare(cfg: DictConfig, overrides: list[str], machine: Optional[Machine] = None) -> tuple[DictConfig, list[str]]:
    """The launch config and the warnings, checked on ``machine`` (default: this one); raises
    :class:`ConfigError` with every problem."""
    cfg = finalize(cfg, overrides)
    warnings = validate(cfg, machine)
    return with_capacity_ceiling(with_typed_launcher(cfg), machine), warnings


def with_capacity_ceiling(cfg: DictConfig, machine: Optional[Machine] = None) -> DictConfig:
    """``cfg`` with ``a2a.capacity_ceiling=auto`` resolved to the ceiling that fits the
    memory the run's processes get on ``machine`` (default: this one), where it is known before
    launch (``resolved_ceiling``); a SLURM job's workers resolve it on their node
    (``launch.titan.runner.a2a_config``)."""
    target = launcher_class(cfg)().target(cfg, machine or Machine.probe())
    ceiling = resolved_ceiling(cfg, target, model_facts.facts(cfg.model.family, cfg.model.flavor))
    if ceiling == cfg.a2a.capacity_ceiling:
        return cfg
    cfg = copy.deepcopy(cfg)
    with read_write(cfg):
        cfg.a2a.capacity_ceiling = ceiling
    return cfg


def prepare_run(composed: DictConfig, overrides: list[str], run_dir: str,
                compose: Callable[[list[str]], DictConfig],
                run_dir_given: bool = False, dry_run: bool = False) -> tuple[DictConfig, list[str], Optional[Resume]]:
    """A single run: the launch config, the warnings and what ``training.resume`` continues
    (None without it; its ``line`` says what it does). A run folder another launch is training is
    refused (``launch.run.run_lock``). ``composed``: Hydra's config without its own node;
    ``run_dir``: ``hydra.run.dir`` resolved; ``run_dir_given``: set on the command line;
    ``dry_run``: nothing will start here (``--cfg job``), so a config that names the node it is
    meant for (``meant_for``) is checked on that node, not on this machine."""
    asked = composed.training.resume
    resume = None
    cfg = composed
    if not dry_run:
        check_free(run_dir)  # one launch per run folder (launch.run.run_lock)
    if asked is None:
        check_new_run_dir(run_dir, composed.training.checkpoint_folder)
    else:
        if run_dir_given and asked != AUTO and os.path.abspath(asked) != os.path.abspath(run_dir):
            raise ConfigError([f"training.resume={asked} and hydra.run.dir={run_dir} name two "
                               f"folders: give training.resume alone (the run stays in its folder)"])
        step = check_resumable(asked, run_dir, composed.training.checkpoint_folder)
        resume = Resume(run_dir, asked)
        if step is not None:
            cfg, resume = resumed_config(composed, overrides, run_dir, step, compose)
    cfg, warnings = prepare(cfg, overrides, meant_for(cfg) if dry_run else None)
    return cfg, warnings, resume


def mark_prepared(run_dir: str, resume: Optional[Resume], before: RunDirBefore) -> None:
    global _prepared, _prepared_launch
    _prepared = os.path.abspath(run_dir)
    _prepared_launch = (resume, before)


def prepared_launch() -> tuple[Optional[Resume], Optional[RunDirBefore]]:
    """What the prepared launch resumes (None: a new run) and what its run dir held before."""
    return _prepared_launch


def was_prepared(run_dir: str) -> bool:
    return _prepared == os.path.abspath(run_dir)


def replace_task_config(config: DictConfig, cfg: DictConfig) -> None:
    """Put ``cfg`` in place of the task part of Hydra's ``config`` (its ``hydra`` node stays):
    what the job, and ``.hydra/config.yaml``, get."""
    with read_write(config), open_dict(config):
        for key in list(config.keys()):
            if key != "hydra" and key not in cfg:
                del config[key]
        for key in cfg.keys():
            config[key] = cfg[key]


def task_config(config: DictConfig) -> DictConfig:
    """Hydra's ``config`` without its own node."""
    return OmegaConf.masked_copy(config, [k for k in config.keys() if k != "hydra"])
