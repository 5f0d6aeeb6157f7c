"""``python launch/train.py --cfg job [overrides]``: the config a launch with these overrides
would run with, checked as a launch checks it, and nothing started.

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
from launch.preflight.prepare import meant_for, prepare_run, task_config

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
    return f"{HEADER}{where}\n{OmegaConf.to_yaml(cfg, resolve=True)}"


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
