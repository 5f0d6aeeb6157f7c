"""Register the recipe's structured configs and resolvers with Hydra / OmegaConf.

* ``train_schema`` (``launch.schema.TrainConfig``) starts ``conf/train.yaml``'s defaults list
  and types every group: a misspelled key or a wrong type fails while Hydra composes.
* ``a2a_preset_<name>`` for every preset in ``mxfp8_ep.config.PRESETS``: the legs of
  ``conf/a2a/<name>.yaml`` come from there (root-level nodes, so ``--help`` does not list
  them as a group).
* ``${mxfp8ep.run_dir:...}`` (``hydra.run.dir``): the run dir ``training.resume`` asks for.
* ``${mxfp8ep.not_in_run_name:}`` (``override_dirname.exclude_keys``): the keys that say where
  and how a run is launched or logged, not what it trains, so sweep folders and wandb run
  names leave them out.
"""

from __future__ import annotations

import dataclasses

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from launch.run_dir import resolve_run_dir
from launch.schema import A2ASchema, LauncherConfig, LoggingConfig, TrainConfig, ValidateConfig
from mxfp8_ep.config import PRESETS

# Groups (and top-level nodes) that do not change what is trained.
_NOT_TRAINING = {"launcher": LauncherConfig, "logging": LoggingConfig, "validate": ValidateConfig}


def not_in_run_name() -> list[str]:
    """Override keys left out of run names and sweep folder names: the launcher, logging and
    validation settings (each group and each of its fields), the recipe, the resume target and
    Hydra's own output dirs."""
    keys = ["recipe", "training.resume", "hydra.run.dir", "hydra.sweep.dir"]
    for group, schema in _NOT_TRAINING.items():
        keys += [group] + [f"{group}.{f.name}" for f in dataclasses.fields(schema)]
    return keys


def register_configs() -> None:
    """Idempotent: safe to call from the Hydra app and from tests."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name, legs in PRESETS.items():
        cs.store(name=f"a2a_preset_{name}", node=A2ASchema(name=name, **legs))
    OmegaConf.register_new_resolver("mxfp8ep.run_dir", resolve_run_dir, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("mxfp8ep.not_in_run_name", not_in_run_name, replace=True)


register_configs()
