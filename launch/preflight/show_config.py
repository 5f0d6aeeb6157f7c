"""``python launch/train.py [--multirun] --cfg job [overrides]``: the config a launch with these
overrides would run with, checked as a launch checks it, and nothing started; with
``--multirun``, each sweep point's (all checked before any is printed).

Hydra's own ``--cfg job`` prints the composed config before any check, with the fields a launch
fills in (the wandb group and run name, the learning-rate schedule's length; a resume's saved
config) still null. This composes the same command line, prepares it as
``launch.preflight.callbacks.PrepareRun`` does (resume, defaults, validation: a mistake is the
usual one message and exit 2) and prints what the workers would get (``train_config.yaml``),
less the wandb run id, which each new run draws at launch. A config that names the GPUs it is
meant for (``validate.gpu_mem_gib``, as the 8-GPU recipes do) is checked on a node of them, not
on this machine: an 8-GPU recipe can be checked from a laptop or a login node.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf, open_dict

from launch.preflight import config_store  # noqa: F401  (registers the schemas and resolvers)
from launch.launchers.machine import Machine
from launch.preflight.prepare import meant_for, prepare_run, task_config
from launch.preflight.validate import memory_report

# What ``--cfg job`` prints above the config.
HEADER = "# the config this command line launches with (checked; logging.run_id: a new one at each launch)"


def job_config_text(conf: Path, overrides: list[str]) -> str:
    """The prepared config of ``overrides`` as YAML (raises ``ConfigError`` for a mistake, and
    Hydra's errors for one it finds while composing)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        composed = compose("train", overrides=overrides, return_hydra_config=True)
        given = any(o.lstrip("+").startswith("hydra.run.dir=") for o in overrides)
        cfg, _, resume = prepare_run(task_config(composed), [o for o in overrides if not o.startswith("hydra.")],
                                     str(composed.hydra.run.dir), lambda ovs: compose("train", overrides=ovs), given,
                                     dry_run=True)
    if resume is None or resume.step is None:
        with open_dict(cfg):
            cfg.logging.run_id = None
    node = meant_for(cfg)
    where = (f"\n# checked for {node.gpus} GPU(s) of {cfg.validate.gpu_mem_gib:g} GiB per node (validate.gpu_mem_gib), "
             f"not this machine" if node is not None else "")
    memory = "".join(f"\n# {line}" for line in memory_report(cfg, node or Machine.probe()))
    return f"{HEADER}{where}{memory}\n{OmegaConf.to_yaml(cfg, resolve=True)}"


def sweep_job_configs(conf: Path, overrides: list[str]) -> str:
    """Each point of the sweep ``--multirun`` would launch with ``overrides``, checked: its
    prepared config under a line naming it. Every point's mistakes are raised together as one
    ``ConfigError`` (Hydra's composition errors translated by ``launch.preflight.hydra_errors``)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from launch.config.problems import ConfigError
    from launch.preflight.callbacks import sweep_points
    from launch.preflight.hydra_errors import explain

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        points = sweep_points(loader.load_configuration("train", overrides, run_mode=RunMode.MULTIRUN))
    texts, problems = [], []
    for num, point in enumerate(points):
        shown = " ".join(o for o in point if not o.startswith("hydra.")) or "(the defaults)"
        try:
            text = job_config_text(conf, point)
        except Exception as e:  # noqa: BLE001 - a config mistake of this point, said as ours
            error = explain(e, point)
            if error is None:
                raise
            problems += [f"sweep job #{num} ({shown}): {p}" for p in error.problems]
            continue
        texts.append(f"# ==== sweep job #{num} of {len(points)}: {shown}\n{text.removeprefix(HEADER + chr(10))}")
    if problems:
        raise ConfigError(problems, note=f"fix or drop these points of the {len(points)}-job sweep")
    return f"{HEADER}, for each of the {len(points)} sweep jobs\n" + "".join(texts)


def wants_job_config(args: list[str]) -> bool:
    """Whether the command line is ``--cfg job`` / ``-c job`` (a single run's, or with
    ``--multirun`` each sweep point's: :func:`is_sweep`)."""
    flags = {"--cfg", "-c"}
    shown = [args[i + 1] for i, a in enumerate(args[:-1]) if a in flags]
    return shown == ["job"]


def is_sweep(args: list[str]) -> bool:
    return bool({"--multirun", "-m"} & set(args))


def overrides_of(args: list[str]) -> list[str]:
    """The command line's overrides, without Hydra's flags and their values."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp"):
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out
