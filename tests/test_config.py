"""Composition of every config option, schema enforcement, presets, recipes, and the big
model flavors' args (instantiated on the meta device)."""

from __future__ import annotations

import pytest
import torch
from tests.corpus_files import sample_texts, write_corpus
from tests.hydra_compose import CONF, GROUPS, REPO, compose_cfg, no_slurm_cluster, options  # noqa: F401
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

import dataclasses
import re

from launch.launchers.launcher import LauncherConfig, with_typed_launcher
from launch.launchers.local import LocalLauncher, LocalLauncherConfig
from launch.launchers.machine import GIB, Machine
from launch.run.run_dir import NOT_IN_RUN_NAME
from launch.config.schema import A2ASchema, ModelConfig, TrainConfig
from launch.launchers.slurm import SlurmLauncher
from launch.titan.data import CORPUS_DATASET
from launch.titan.models import model_args
from launch.preflight.validate import validate
from mxfp8_ep.config import LEGS, PRESETS, A2AConfig
from mxfp8_ep.format.wire_format import WireFormat

GPU_BOX = Machine(ram_bytes=2048 * GIB, cpu_count=128, gpu_memory_bytes=(141 * GIB,) * 8)


def test_defaults():
    cfg = compose_cfg()
    assert OmegaConf.get_type(cfg) is TrainConfig
    assert cfg.model.name == "tiny_llama4" and cfg.model.family == "llama4"
    assert cfg.model.flavor == "tiny"
    assert (cfg.parallelism.name, cfg.parallelism.nodes, cfg.parallelism.procs_per_node) == ("ep2", 1, 2)
    assert cfg.parallelism.ep == 2
    assert cfg.a2a.name == "bf16"
    assert cfg.launcher.name == "local" and cfg.launcher._target_ == "launch.launchers.local.LocalLauncher"
    # the launcher group is typed by the launcher's own Config once chosen
    assert OmegaConf.get_type(with_typed_launcher(cfg).launcher) is LocalLauncherConfig
    assert cfg.logging.name == "wandb_offline" and cfg.logging.wandb_mode == "offline"
    assert cfg.training.steps > 0
    assert not OmegaConf.missing_keys(cfg)


def test_every_group_has_the_required_options():
    assert set(options("model")) >= {
        "tiny_llama4", "tiny_dsv3", "llama4_debugmodel", "llama4_17bx16e", "llama4_17bx128e",
        "dsv3_debugmodel", "dsv3_16b", "dsv3_671b",
    }
    assert set(options("parallelism")) >= {"single", "ep2", "ep8", "2nodes_8gpus"}
    assert set(options("a2a")) == set(PRESETS)
    assert set(options("launcher")) == {"local", "slurm"}
    assert set(options("logging")) == {"wandb_offline", "wandb_online", "none"}


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in options(g)], ids=lambda x: str(x)
)
def test_every_option_composes(group, option):
    cfg = compose_cfg(f"{group}={option}")
    node = cfg[group]
    assert node.name == option, f"conf/{group}/{option}.yaml must set name: {option}"
    assert not OmegaConf.missing_keys(cfg)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a2a_options_are_the_library_presets(preset):
    cfg = compose_cfg(f"a2a={preset}")
    assert cfg.a2a.name == preset
    for leg in LEGS:
        assert cfg.a2a[leg] == PRESETS[preset][leg]
    # the yaml spells out only the transport; the legs come from mxfp8_ep.config
    text = (CONF / "a2a" / f"{preset}.yaml").read_text()
    assert "transport: auto" in text and not any(f"{leg}:" in text for leg in LEGS)
    # and the group is accepted by the core's own config type, its ceiling ("auto": what fits
    # the memory) resolved as a worker resolves it (here: no symm, the library's default)
    from launch.titan.runner import a2a_config

    assert cfg.a2a.capacity_ceiling == "auto"
    assert a2a_config(cfg) == A2AConfig.preset(preset)


def test_two_hop_runs_without_the_activation_pool():
    """The pool holds the symm transport's kept rows; two_hop's fan-out takes none, so a worker
    builds its A2AConfig without one (docs/configuration.md) and symm keeps its own."""
    from launch.titan.runner import a2a_config

    two_hop = compose_cfg("a2a.transport=two_hop", "parallelism.procs_per_node=4", "parallelism.ep=4",
                          "a2a.ranks_per_node=2")
    assert two_hop.a2a.activation_pool_factor is not None
    built = a2a_config(two_hop)
    assert built.activation_pool_factor is None and built.ranks_per_node == 2 and built.transport == "two_hop"
    assert a2a_config(compose_cfg("a2a.transport=symm")).activation_pool_factor == two_hop.a2a.activation_pool_factor


def test_block_size_is_the_formats():
    """The validator reads the block size from the torch-free WireFormat; the MXFP8 module's
    constant must not drift from it."""
    from mxfp8_ep.format.mxfp8 import BLOCK_SIZE

    assert BLOCK_SIZE == WireFormat.MXFP8.block_size == 32


@pytest.mark.parametrize("field, value", [
    ("dispatch_fwd", "fp8"), ("scale_rounding", "nearest"), ("kernel", "cuda"), ("transport", "nvshmem"),
    ("symm_combine_partial_sums", "yes"), ("quantize_local_rows", "yes"),
])
def test_a2a_config_rejects_values_it_does_not_know(field, value):
    config = A2AConfig(**{field: value})  # checked where it is used (a dispatcher's build), or by check()
    assert len(config.problems()) == 1 and f"A2AConfig.{field}='{value}'" in config.problems()[0]
    with pytest.raises(ValueError, match=f"A2AConfig.{field}='{value}'"):
        config.check()


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "2", True])
def test_capacity_factor_is_a_positive_number_or_none(value):
    with pytest.raises(ValueError, match=r"A2AConfig.capacity_factor=.*expected a finite number > 0"):
        A2AConfig(capacity_factor=value).check()
    for ok in (None, 0.5, 1, 1.0, 1.25, 8):
        assert A2AConfig(capacity_factor=ok).check().capacity_factor == ok


def test_quantize_local_rows_needs_an_mxfp8_leg():
    with pytest.raises(ValueError, match="quantize_local_rows=True .* but every leg is bf16"):
        A2AConfig(quantize_local_rows=True).check()
    assert A2AConfig.preset("mxfp8", quantize_local_rows=True).check().quantize_local_rows


def test_every_preset_passes_its_checks():
    for name in PRESETS:
        assert A2AConfig.preset(name).problems() == [], name


def test_a2a_schema_is_the_library_config_plus_a_name():
    """The recipe's a2a group: A2AConfig's fields and defaults, a preset name, and a ceiling
    that defaults to ``auto`` (the library's ceiling where it fits the memory, launch/config/memory.py)."""
    schema = {f.name: f.default for f in dataclasses.fields(A2ASchema)}
    library = {f.name: f.default for f in dataclasses.fields(A2AConfig)}
    assert schema.pop("name") is not None and schema.pop("capacity_ceiling") == "auto"
    assert library.pop("capacity_ceiling") is not None and schema == library
    assert list(schema)[:4] == list(LEGS)


def test_parallelism_options():
    expect = {
        "single": (1, 1, 1),
        "ep2": (1, 2, 2),
        "ep8": (1, 8, 8),
        "2nodes_8gpus": (2, 8, 8),
    }
    for name, (nodes, procs, ep) in expect.items():
        p = compose_cfg(f"parallelism={name}").parallelism
        assert (p.nodes, p.procs_per_node, p.ep) == (nodes, procs, ep), name
        assert p.fsdp == -1 and p.tp == 1


def test_each_launcher_names_its_class():
    from launch.launchers.launcher import launcher_for

    slurm = compose_cfg("launcher=slurm")
    assert slurm.launcher._target_ == "launch.launchers.slurm.SlurmLauncher"
    assert isinstance(launcher_for(slurm), SlurmLauncher)
    assert isinstance(launcher_for(compose_cfg()), LocalLauncher)
    assert slurm.launcher.gpus_per_node is None and slurm.launcher.srun_args == []
    # each launcher has its own fields: launcher=local has no SLURM ones
    with pytest.raises(ConfigCompositionException, match="launcher.gpus_per_node"):
        compose_cfg("launcher.gpus_per_node=0")


@pytest.mark.parametrize("option", options("launcher"))
def test_launcher_configs_are_a_base_and_one_dataclass_per_launcher(option):
    """As hydra-submitit-launcher's queues: every launcher's Config derives from LauncherConfig
    and names its class in _target_; its yaml spells out every field with the Config's default
    (so `launcher.<field>=...` works without +, and the defaults live in one place)."""
    from launch.launchers.launcher import launcher_class

    cfg = compose_cfg(f"launcher={option}")
    cls = launcher_class(cfg)
    assert issubclass(cls.Config, LauncherConfig) and cls.Config is not LauncherConfig
    defaults = OmegaConf.to_container(OmegaConf.structured(cls.Config))
    assert defaults["_target_"] == cfg.launcher._target_ == f"{cls.__module__}.{cls.__name__}"
    assert defaults["name"] == option
    assert OmegaConf.to_container(cfg.launcher) == defaults
    assert [f.name for f in dataclasses.fields(LauncherConfig)] == ["_target_", "name"]


@pytest.mark.parametrize(
    "override",
    ["training.stpes=3", "model.flavour=tiny", "a2a.dispatch=mxfp8", "parallelism.gpus=2"],
)
def test_misspelled_key_fails_at_composition(override):
    with pytest.raises(ConfigCompositionException, match="Could not override"):
        compose_cfg(override)


@pytest.mark.parametrize(
    "override", ["training.steps=abc", "parallelism.ep=two", "launcher.exclusive=maybe",
                 "a2a.symm_combine_partial_sums=maybe"]
)
def test_wrong_type_fails_at_composition(override):
    with pytest.raises(ConfigCompositionException):
        compose_cfg(override)


@pytest.mark.parametrize("override", ["a2a=fp4", "model=llama5", "parallelism=ep3"])
def test_unknown_option_fails_at_composition(override):
    with pytest.raises(MissingConfigException):
        compose_cfg(override)


def test_typo_inside_a_group_file_fails(tmp_path):
    """A YAML option with a misspelled key is rejected by the schema (TrainConfig types it)."""
    import shutil

    from hydra import compose, initialize_config_dir

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf, symlinks=True)
    (conf / "model" / "broken.yaml").write_text(
        "name: broken\nfamily: llama4\nflavr: tiny\n"
    )
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises((ConfigCompositionException, ConfigKeyError, ValidationError)):
            compose("train", overrides=["model=broken"])


def test_hydra_settings():
    cfg = compose_cfg(hydra_node=True)
    assert cfg.hydra.job.chdir is False
    assert {"recipe", "launcher", "logging", "validate", "training.resume"} <= set(NOT_IN_RUN_NAME)
    assert not any(k.startswith(("training.steps", "a2a", "model", "parallelism"))
                   for k in NOT_IN_RUN_NAME)


def test_the_default_model_is_the_installed_stacks_tiny_model():
    """conf/train.yaml's ``model: default``: tiny Llama4 on torchtitan 0.2.2, tiny DeepSeek-V3 on
    0.3.0 (which has no Llama4), so a plain ``python launch/train.py`` trains on either."""
    from launch.config.stack import DEFAULT_MODEL, FAMILIES_BY_STACK, installed_torchtitan

    assert DEFAULT_MODEL == {"0.2.2": "tiny_llama4", "0.3.0": "tiny_dsv3"}
    for stack, model in DEFAULT_MODEL.items():
        assert OmegaConf.load(CONF / "model" / f"{model}.yaml").family in FAMILIES_BY_STACK[stack]
    chosen = OmegaConf.load(CONF / "model" / f"{DEFAULT_MODEL[installed_torchtitan()]}.yaml")
    composed = compose_cfg().model  # the file's fields, and the schema's defaults of the others
    assert {key: composed[key] for key in chosen} == OmegaConf.to_container(chosen)
    row = f"| the model `python launch/train.py` trains (`model=default`) | `{DEFAULT_MODEL['0.2.2']}` | " \
          f"`{DEFAULT_MODEL['0.3.0']}` |"
    assert row in (REPO / "docs" / "torchtitan_030.md").read_text()


def test_configuration_md_lists_every_model():
    """docs/configuration.md's model group names every conf/model option, and the default."""
    text = (REPO / "docs" / "configuration.md").read_text()
    models = text.split("**`model`**:", 1)[1].split("Fields:", 1)[0]
    listed = set(re.findall(r"`([a-z0-9_]+)`", models))
    assert set(options("model")) | {"default"} <= listed, sorted(set(options("model")) - listed)


# ----------------------------------------------------------------------------- recipes
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def test_recipes_exist():
    assert {"tiny_cpu_smoke", "llama4_ep8_bf16_vs_mxfp8", "dsv3_16b_2nodes_sweep"} <= set(RECIPES)
    assert (CONF / "recipe").resolve() == (REPO / "recipes").resolve()


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipes_parallelism_is_an_option_its_messages_can_name(recipe):
    """The checks name ``parallelism=<name>`` (a SLURM partition's GPUs, this machine's): an option
    a user can type."""
    assert compose_cfg(f"+recipe={recipe}").parallelism.name in options("parallelism")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A stand-in for data/corpus (scripts/build_corpus.py), for the recipes that read it."""
    return write_corpus(tmp_path_factory.mktemp("corpus"), sample_texts(200), sample_texts(200, offset=500))


# Recipes of one run, no a2a sweep: a measurement rather than a comparison of the a2a modes.
SINGLE_RUN_RECIPES = {"routing_study_cpu", "routing_study_full_cpu"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_validates_and_sweeps_a2a(recipe, corpus):
    cfg = compose_cfg(f"+recipe={recipe}", hydra_node=True)
    assert cfg.experiment == recipe
    if recipe in SINGLE_RUN_RECIPES:
        assert not cfg.hydra.sweeper.params
        sweep = []
    else:
        sweep = cfg.hydra.sweeper.params["a2a"].split(",")
        assert "bf16" in sweep and any(v.startswith("mxfp8") for v in sweep)
    data = [f"training.dataset_path={corpus}"] if cfg.training.dataset == CORPUS_DATASET else []
    # Valid as composed (a GPU box with 8 GPUs for the local GPU recipes), and for every
    # sweep point.
    validate(compose_cfg(f"+recipe={recipe}", *data), machine=GPU_BOX)
    for value in sweep:
        validate(compose_cfg(f"+recipe={recipe}", f"a2a={value}", *data), machine=GPU_BOX)


EP8_RECIPES = {"dsv3_16b_ep8_bf16_vs_mxfp8": [],
               "dsv3_16b_2nodes_sweep": ["a2a.transport=two_hop", "a2a.transport=nccl"],
               "llama4_ep8_bf16_vs_mxfp8": []}
GPU_80GB = 80 * 10**9


@pytest.mark.parametrize("recipe", sorted(EP8_RECIPES))
def test_ep8_recipes_fit_80gb_gpus_with_the_lightest_checkpointing_that_fits(recipe):
    """Every sweep point's memory estimate (launch/config/memory.py, the symm transport inside a node
    at the default capacity factor) fits an 80 GB GPU with the recipe's activation
    checkpointing, and the next lighter one (full -> selective -> none) does not fit some point:
    the recipe checkpoints no more than it must."""
    from launch.launchers.launcher import Target
    from launch.config.model_facts import facts
    from launch.preflight.validate import memory_estimate

    target = Target(device="cuda", memory_bytes=GPU_80GB, memory_name="an 80 GB GPU", where="")
    base = compose_cfg(f"+recipe={recipe}", hydra_node=True)
    checkpointing = base.training.activation_checkpoint
    lighter = {"full": "selective", "selective": "none"}[checkpointing]
    points = [[f"a2a={a2a}", *extra] for a2a in base.hydra.sweeper.params["a2a"].split(",")
              for extra in ([[e] for e in EP8_RECIPES[recipe]] or [[]])]

    def need(overrides, ckpt):
        cfg = compose_cfg(f"+recipe={recipe}", *overrides, f"training.activation_checkpoint={ckpt}")
        return memory_estimate(cfg, target, facts(cfg.model.family, cfg.model.flavor)).total

    assert all(need(p, checkpointing) <= GPU_80GB for p in points), [need(p, checkpointing) / 2**30 for p in points]
    assert any(need(p, lighter) > GPU_80GB for p in points), [need(p, lighter) / 2**30 for p in points]


def test_weights_kept_from_forward_to_backward_cost_every_blocks_bf16_copy():
    """``fsdp_reshard_after_forward=never`` holds each block's gathered bf16 weights, not two."""
    from launch.config.memory import BF16, estimate
    from launch.config.model_facts import facts

    m = facts("deepseek_v3", "parity")
    kw = dict(world=2, ep=2, tp=1, local_batch_size=4, seq_len=512, activation_checkpoint="none", device="cuda")
    resharded, kept = estimate(m, **kw), estimate(m, **kw, reshard_after_forward=False)
    block = (m.params - m.expert_params - 2 * m.vocab_size * m.dim) / m.n_layers + m.expert_params / m.n_moe_layers / 2
    assert kept.working_copies - resharded.working_copies == pytest.approx((m.n_layers - 2) * block * BF16, abs=1)
    assert kept.total - resharded.total == kept.working_copies - resharded.working_copies


def test_recipe_runs_ep_across_nodes_on_two_hop_and_flat_nccl():
    """dsv3_16b_2nodes_sweep: EP 16 over both nodes, each a2a preset on two_hop and on the flat
    nccl all-to-all (auto picks two_hop there too); EP 8 inside each node stays a valid point."""
    cfg = compose_cfg("+recipe=dsv3_16b_2nodes_sweep", hydra_node=True)
    assert cfg.parallelism.ep == cfg.parallelism.nodes * cfg.parallelism.procs_per_node == 16
    assert cfg.hydra.sweeper.params["a2a.transport"].split(",") == ["two_hop", "nccl"]
    for transport in ("two_hop", "nccl", "auto"):
        validate(compose_cfg("+recipe=dsv3_16b_2nodes_sweep", f"a2a.transport={transport}"), machine=GPU_BOX)
    validate(compose_cfg("+recipe=dsv3_16b_2nodes_sweep", "parallelism.ep=8", "a2a.transport=auto"), machine=GPU_BOX)


# -------------------------------------------------------------------- model flavors
def _build_on_meta(family: str, args):
    """What torchtitan's Trainer does: finish the args from a job config, build on meta."""
    from torchtitan.config import JobConfig
    from torchtitan.protocols.train_spec import get_train_spec

    job_config = JobConfig()
    job_config.training.seq_len = 4096
    args.update_from_config(job_config)

    model_cls = get_train_spec(family).model_cls
    with torch.device("meta"):
        return model_cls(args)


# option -> (total parameters, lower, upper bound in billions)
BIG = {
    "llama4_17bx16e": (100, 115),
    "llama4_17bx128e": (380, 420),
    "dsv3_16b": (14, 17),
    "dsv3_671b": (660, 690),
}


@pytest.mark.parametrize("option", sorted(BIG))
def test_big_model_flavor_instantiates_on_meta(option):
    m = compose_cfg(f"model={option}").model
    args = model_args(m.family, m.flavor)
    model = _build_on_meta(m.family, args)
    n = sum(p.numel() for p in model.parameters())
    lo, hi = BIG[option]
    assert lo * 1e9 <= n <= hi * 1e9, f"{option}: {n / 1e9:.1f}B parameters"
    assert all(p.device.type == "meta" for p in model.parameters())
    assert args.dim % 32 == 0  # MXFP8 blocks of 32 along the hidden dim


@pytest.mark.parametrize("option", ["tiny_llama4", "tiny_dsv3", "llama4_debugmodel", "dsv3_debugmodel"])
def test_small_model_flavor_instantiates_on_meta(option):
    m = compose_cfg(f"model={option}").model
    model = _build_on_meta(m.family, model_args(m.family, m.flavor))
    assert sum(p.numel() for p in model.parameters()) < 100e6


def test_schema_defaults_match_group_files():
    """The YAML groups spell out the schema's defaults for what they don't change."""
    assert compose_cfg().a2a.scale_rounding == A2ASchema.scale_rounding
    assert OmegaConf.is_missing(OmegaConf.structured(ModelConfig), "name")


# ------------------------------------------------------------------------ launchers
NEW_LAUNCHER = '''
from dataclasses import dataclass

from launch.launchers.launcher import LauncherConfig, Target

CALLS = []


@dataclass
class PrintLauncherConfig(LauncherConfig):
    _target_: str = "printer_launcher.PrintLauncher"
    name: str = "printer"
    partition: str = "plain"


class PrintLauncher:
    Config = PrintLauncherConfig

    def target(self, cfg, machine):
        return Target("cpu", 1 << 40, "the printer's RAM", "it prints")

    def check(self, cfg, machine, report):
        if cfg.launcher.partition != "paper":
            report.error("launcher=printer needs launcher.partition=paper")

    def launch(self, cfg, run_dir):
        CALLS.append(run_dir)
        return None
'''


def test_a_new_launcher_is_one_class_and_one_yaml(tmp_path, monkeypatch):
    """No Python file of the recipe changes: train.py and validate.py go through the class
    the yaml names, its Config types its fields and its checks run."""
    import importlib
    import shutil
    import sys

    from hydra import compose, initialize_config_dir

    from launch import train
    from launch.run import console
    from launch.preflight.validate import ConfigError

    (tmp_path / "printer_launcher.py").write_text(NEW_LAUNCHER)
    monkeypatch.syspath_prepend(str(tmp_path))
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf, symlinks=True)
    (conf / "launcher" / "printer.yaml").write_text(
        "_target_: printer_launcher.PrintLauncher\nname: printer\npartition: plain\n")

    def cfg(*overrides):
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return compose("train", overrides=["launcher=printer", *overrides])

    with pytest.raises(ConfigError, match="launcher=printer needs launcher.partition=paper"):
        validate(cfg())
    assert validate(cfg("launcher.partition=paper")) == []
    with pytest.raises(ConfigError, match="unknown key launcher.account: launcher=printer has"):
        validate(cfg("launcher.partition=paper", "+launcher.account=x"))

    monkeypatch.setattr(console, "route_logging", lambda verbose: None)
    train.run(cfg("launcher.partition=paper"), str(tmp_path / "run"), [])
    assert importlib.import_module("printer_launcher").CALLS == [str(tmp_path / "run")]
    assert (tmp_path / "run" / "train_config.yaml").is_file()
    sys.modules.pop("printer_launcher")
