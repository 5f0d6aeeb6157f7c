"""``python launch/train.py --cfg job [overrides]``: the config a launch with these overrides
would run with, checked as a launch checks it, and nothing started.

Hydra's own ``--cfg job`` prints the composed config before any check, with the fields a launch
fills in (the wandb group and run name, the learning-rate schedule's length; a resume's saved
config) still null. This composes the same command line, prepares it as
``launch.preflight.callbacks.PrepareRun`` does (resume, defaults, validation: a mistake is the
usual one message and exit 2) and prints what the workers would get (``train_config.yaml``),
less the wandb run id, which each new run draws at launch.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf, open_dict

from launch.preflight import config_store  # noqa: F401  (registers the schemas and resolvers)
from launch.preflight.prepare import prepare_run, task_config

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
                                     str(composed.hydra.run.dir), lambda ovs: compose("train", overrides=ovs), given)
    if resume is None or resume.step is None:
        with open_dict(cfg):
            cfg.logging.run_id = None
    return f"{HEADER}\n{OmegaConf.to_yaml(cfg, resolve=True)}"


def wants_job_config(args: list[str]) -> bool:
    """Whether the command line is ``--cfg job`` / ``-c job`` for a single run."""
    flags = {"--cfg", "-c"}
    shown = [args[i + 1] for i, a in enumerate(args[:-1]) if a in flags]
    return shown == ["job"] and not {"--multirun", "-m"} & set(args)


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
