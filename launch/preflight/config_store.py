"""Register the recipe's structured configs and resolvers with Hydra / OmegaConf.

* ``train_schema`` (``launch.config.schema.TrainConfig``) starts ``conf/train.yaml``'s defaults list
  and types every group but ``launcher`` (each launcher types its own fields: launch/launchers/launcher.py):
  a misspelled key or a wrong type fails while Hydra composes.
* ``model/default``: the conf/model option of the installed stack's default model
  (``launch.config.stack.default_model``: ``tiny_llama4`` on torchtitan 0.2.2, ``tiny_dsv3`` on
  0.3.0, which has no Llama4), the model ``conf/train.yaml`` trains without ``model=...``.
* ``a2a_preset_<name>`` for every preset in ``mxfp8_ep.config.PRESETS``: the legs of
  ``conf/a2a/<name>.yaml`` come from there (root-level nodes, so ``--help`` does not list
  them as a group).
* ``${mxfp8ep.run_dir:...}`` (``hydra.run.dir``): the run dir ``training.resume`` asks for.
* ``${mxfp8ep.folder_name:<overrides>,<a2a>}`` (run and sweep folder names): what the run
  trains, from its overrides (``launch.run.run_dir.folder_name``).
* ``${mxfp8ep.help_stack:}``, ``${mxfp8ep.help_first_example:<family>}``: ``--help``'s words for
  the installed torchtitan stack (``launch.config.stack``).
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from launch.config.schema import A2ASchema, TrainConfig
from launch.config.stack import default_model, help_first_example, help_stack
from launch.run.run_dir import folder_name, resolve_run_dir
from mxfp8_ep.config import PRESETS


CONF = Path(__file__).resolve().parents[2] / "conf"


def register_configs() -> None:
    """Idempotent: safe to call from the Hydra app and from tests."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="default", node=OmegaConf.load(CONF / "model" / f"{default_model()}.yaml"))
    for name, legs in PRESETS.items():
        cs.store(name=f"a2a_preset_{name}", node=A2ASchema(name=name, **legs))
    OmegaConf.register_new_resolver("mxfp8ep.run_dir", resolve_run_dir, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("mxfp8ep.folder_name",
                                     lambda overrides, a2a: folder_name(list(overrides or []), a2a),
                                     replace=True)
    # --help names the installed stack's models and a first example that trains on it.
    OmegaConf.register_new_resolver("mxfp8ep.help_stack", help_stack, replace=True)
    OmegaConf.register_new_resolver("mxfp8ep.help_first_example", help_first_example, replace=True)


register_configs()
