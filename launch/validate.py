"""Check a composed training config before anything is launched.

Every problem found is collected and raised together as one :class:`ConfigError`, each line
saying what to change. Things that are legal but probably not what the user meant (an MXFP8
all-to-all with EP=1, which never crosses a wire) come back as warnings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mxfp8_ep.config import KERNELS, LEG_FORMATS, PRESETS, SCALE_ROUNDINGS, A2AConfig

FAMILIES = ("llama4", "deepseek_v3")
WANDB_MODES = ("offline", "online", "disabled")
ACTIVATION_CHECKPOINT = ("none", "full", "selective")
# a2a.name for legs set by hand (no preset).
CUSTOM_A2A = "custom"
# MXFP8 shares one scale per 32 consecutive elements of a token's hidden vector.
MX_BLOCK = 32


def launcher_kind(cfg: Any) -> Optional[str]:
    """"slurm" for any launcher option built on the SLURM schema (``launcher=slurm``, or a
    site file such as ``conf/launcher/mycluster.yaml`` whose defaults start with
    ``/slurm_launcher_schema@_here_``), "local" for ``launcher=local``, else None."""
    if "gpus_per_node" in cfg.launcher:  # a field only SlurmLauncherConfig has
        return "slurm"
    return "local" if cfg.launcher.name == "local" else None


class ConfigError(ValueError):
    """One or more problems in a training config; ``problems`` lists them."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the training config:\n{lines}")


@dataclass
class ModelFacts:
    """What validation needs to know about a model (read from torchtitan model args)."""

    dim: int
    num_experts: int
    n_heads: int
    n_kv_heads: Optional[int] = None

    @classmethod
    def from_args(cls, args: Any) -> "ModelFacts":
        return cls(
            dim=int(args.dim),
            num_experts=int(args.moe_args.num_experts),
            n_heads=int(args.n_heads),
            n_kv_heads=getattr(args, "n_kv_heads", None),
        )


def resolve_model_args(family: str, flavor: str) -> Any:
    """torchtitan model args for ``family``/``flavor`` via ``launch.titan_models``.

    Falls back to torchtitan's own flavor tables when ``launch.titan_models`` is not importable
    (it adds this recipe's own flavors such as ``tiny``).
    """
    try:
        from launch.titan_models import model_args
    except ImportError:
        model_args = _torchtitan_model_args
    return model_args(family, flavor)


def _torchtitan_model_args(family: str, flavor: str) -> Any:
    if family == "llama4":
        from torchtitan.models.llama4 import llama4_args as table
    elif family == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import deepseekv3_args as table
    else:
        raise KeyError(f"unknown model family {family!r}; known: {list(FAMILIES)}")
    if flavor not in table:
        raise KeyError(f"unknown {family} flavor {flavor!r}; known: {sorted(table)}")
    return table[flavor]


@dataclass
class _Report:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def error(self, msg: str) -> None:
        self.errors.append(msg)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)


def validate(
    cfg: Any,
    *,
    model_args_fn: Callable[[str, str], Any] = resolve_model_args,
    cuda_device_count: Optional[int] = None,
) -> list[str]:
    """Raise :class:`ConfigError` listing every problem in ``cfg``; return the warnings.

    ``cfg`` is the composed config (``launch.schema.TrainConfig`` as a DictConfig or dataclass).
    ``cuda_device_count`` defaults to what torch sees on this machine (local launcher only).
    """
    r = _Report()
    _check_training(cfg, r)
    world = _check_parallelism(cfg, r)
    quantized = _check_a2a(cfg, r)
    facts = _check_model(cfg, r, model_args_fn)
    _check_model_vs_parallelism(cfg, r, facts, world, quantized)
    _check_launcher(cfg, r, world, cuda_device_count)
    _check_logging(cfg, r)
    if r.errors:
        raise ConfigError(r.errors)
    return r.warnings


def _check_training(cfg: Any, r: _Report) -> None:
    t = cfg.training
    for key in ("steps", "seq_len", "local_batch_size"):
        if getattr(t, key) <= 0:
            r.error(f"training.{key}={getattr(t, key)} must be > 0 (e.g. training.{key}=8)")
    if t.lr <= 0:
        r.error(f"training.lr={t.lr} must be > 0")
    if t.warmup_steps < 0:
        r.error(f"training.warmup_steps={t.warmup_steps} must be >= 0")
    elif t.steps > 0 and t.warmup_steps >= t.steps:
        r.warn(
            f"training.warmup_steps={t.warmup_steps} >= training.steps={t.steps}: the learning "
            "rate never leaves warmup"
        )
    if t.max_norm <= 0:
        r.error(f"training.max_norm={t.max_norm} must be > 0")
    if t.checkpoint_enable and t.checkpoint_interval <= 0:
        r.error(f"training.checkpoint_interval={t.checkpoint_interval} must be > 0")
    if t.activation_checkpoint not in ACTIVATION_CHECKPOINT:
        r.error(
            f"training.activation_checkpoint={t.activation_checkpoint!r}: use one of "
            f"{list(ACTIVATION_CHECKPOINT)}"
        )


def _check_parallelism(cfg: Any, r: _Report) -> Optional[int]:
    """Return the world size, or None when the degrees themselves are invalid."""
    p = cfg.parallelism
    ok = True
    for key in ("nodes", "procs_per_node", "ep", "tp"):
        if getattr(p, key) < 1:
            r.error(f"parallelism.{key}={getattr(p, key)} must be >= 1")
            ok = False
    if p.fsdp == 0 or p.fsdp < -1:
        r.error(f"parallelism.fsdp={p.fsdp}: use -1 (the rest of the world size) or a degree >= 1")
        ok = False
    if not ok:
        return None
    world = p.nodes * p.procs_per_node
    where = (
        f"world size = parallelism.nodes × parallelism.procs_per_node = "
        f"{p.nodes} × {p.procs_per_node} = {world}"
    )
    if world % p.tp:
        r.error(f"parallelism.tp={p.tp} does not divide the {where}")
        return world
    fsdp = world // p.tp if p.fsdp == -1 else p.fsdp
    if fsdp * p.tp != world:
        r.error(
            f"parallelism.fsdp × parallelism.tp = {p.fsdp} × {p.tp} = {p.fsdp * p.tp} must equal "
            f"the {where}; set parallelism.fsdp=-1 to use the rest, or parallelism.fsdp="
            f"{world // p.tp}"
        )
    if world % p.ep:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        r.error(
            f"parallelism.ep={p.ep} must divide the {where}; choose parallelism.ep from "
            f"{divisors} or change the number of processes"
        )
    return world


def _check_a2a(cfg: Any, r: _Report) -> bool:
    """Return whether any leg is MXFP8."""
    a = cfg.a2a
    legs = A2AConfig.legs()
    if a.name not in PRESETS and a.name != CUSTOM_A2A:
        r.error(
            f"a2a.name={a.name!r} is not a preset; use a2a=<one of {sorted(PRESETS)}>, or "
            f"a2a.name={CUSTOM_A2A} with the legs set by hand"
        )
    for leg in legs:
        value = getattr(a, leg)
        if value not in LEG_FORMATS:
            r.error(f"a2a.{leg}={value!r}: use one of {list(LEG_FORMATS)}")
    if a.scale_rounding not in SCALE_ROUNDINGS:
        r.error(f"a2a.scale_rounding={a.scale_rounding!r}: use one of {list(SCALE_ROUNDINGS)}")
    if a.kernel not in KERNELS:
        r.error(f"a2a.kernel={a.kernel!r}: use one of {list(KERNELS)}")
    if a.name in PRESETS:
        changed = [f"{leg}={getattr(a, leg)}" for leg in legs if getattr(a, leg) != PRESETS[a.name][leg]]
        if changed:
            r.warn(
                f"a2a legs differ from preset {a.name!r} ({', '.join(changed)}); the run is still "
                f"labelled a2a={a.name} – set a2a.name={CUSTOM_A2A} to make that visible"
            )
    return any(getattr(a, leg) == "mxfp8" for leg in legs)


def _check_model(cfg: Any, r: _Report, model_args_fn: Callable[[str, str], Any]) -> Optional[ModelFacts]:
    m = cfg.model
    if m.family not in FAMILIES:
        r.error(f"model.family={m.family!r}: use one of {list(FAMILIES)}")
        return None
    try:
        args = model_args_fn(m.family, m.flavor)
    except KeyError as e:
        msg = e.args[0] if e.args else str(e)
        r.error(f"model={m.name}: {msg}")
        return None
    except Exception as e:  # noqa: BLE001 - report, don't crash validation
        r.error(f"model={m.name}: could not build {m.family}/{m.flavor} model args: {e!r}")
        return None
    try:
        return ModelFacts.from_args(args)
    except AttributeError as e:
        r.error(f"model={m.name}: {m.family}/{m.flavor} args lack a field validation needs ({e})")
        return None


def _check_model_vs_parallelism(
    cfg: Any, r: _Report, facts: Optional[ModelFacts], world: Optional[int], quantized: bool
) -> None:
    p = cfg.parallelism
    if quantized and p.ep == 1:
        r.warn(
            f"a2a={cfg.a2a.name} quantizes the all-to-all but parallelism.ep=1: every token stays "
            "in its process, nothing crosses a wire, and the MXFP8 legs are skipped. Use "
            "parallelism=ep2 (or higher) to measure anything."
        )
    if facts is None:
        return
    if p.ep >= 1 and facts.num_experts % p.ep:
        divisors = [d for d in range(1, facts.num_experts + 1) if facts.num_experts % d == 0]
        r.error(
            f"parallelism.ep={p.ep} must divide the number of experts of model={cfg.model.name} "
            f"({facts.num_experts}); choose parallelism.ep from {divisors}"
        )
    if quantized and facts.dim % MX_BLOCK:
        r.error(
            f"model={cfg.model.name} has hidden dim {facts.dim}, not a multiple of {MX_BLOCK} "
            f"(the MXFP8 block size), so its tokens cannot be sent as MXFP8; use a2a=bf16 or a "
            f"model with dim % {MX_BLOCK} == 0"
        )
    if p.tp > 1:
        for name, heads in (("n_heads", facts.n_heads), ("n_kv_heads", facts.n_kv_heads)):
            if heads and heads % p.tp:
                r.error(
                    f"parallelism.tp={p.tp} must divide {name}={heads} of model={cfg.model.name}"
                )


def _check_launcher(
    cfg: Any, r: _Report, world: Optional[int], cuda_device_count: Optional[int]
) -> None:
    lc, p = cfg.launcher, cfg.parallelism
    kind = launcher_kind(cfg)
    if kind is None:
        r.error(f"launcher.name={lc.name!r}: use launcher=local or launcher=slurm")
        return
    if kind == "local":
        if p.nodes > 1:
            r.error(
                f"launcher=local starts processes on this machine only, but "
                f"parallelism={p.name} asks for {p.nodes} nodes; use launcher=slurm, or "
                f"parallelism.nodes=1"
            )
        if cuda_device_count is None:
            import torch

            cuda_device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cuda_device_count and p.procs_per_node > cuda_device_count:
            r.error(
                f"parallelism.procs_per_node={p.procs_per_node} but this machine has "
                f"{cuda_device_count} GPU(s) (one process per GPU); use a smaller parallelism "
                f"(e.g. parallelism=ep2) or launcher=slurm"
            )
        elif not cuda_device_count and p.procs_per_node > (os.cpu_count() or 1):
            r.warn(
                f"no GPU: {p.procs_per_node} CPU worker processes on {os.cpu_count()} cores will "
                "be slow"
            )
        return
    # slurm
    if lc.time_min <= 0:
        r.error(f"launcher.time_min={lc.time_min} must be > 0 (minutes)")
    if lc.max_num_timeout < 0:
        r.error(f"launcher.max_num_timeout={lc.max_num_timeout} must be >= 0")
    gpus = getattr(lc, "gpus_per_node", None)
    if gpus is not None and gpus < 0:
        r.error(f"launcher.gpus_per_node={gpus} must be >= 0 (or null: one per process)")
    elif gpus and gpus < p.procs_per_node:
        r.error(
            f"launcher.gpus_per_node={gpus} < parallelism.procs_per_node={p.procs_per_node}: each "
            f"process needs its own GPU; set launcher.gpus_per_node=null"
        )
    if lc.container_mounts and not lc.container_image:
        r.error("launcher.container_mounts is set but launcher.container_image is not")
    if lc.max_num_timeout > 0 and not cfg.training.checkpoint_enable:
        r.warn(
            "launcher=slurm requeues a preempted or timed-out job, but training.checkpoint_enable="
            "false: a requeued job starts again from step 0"
        )


def _check_logging(cfg: Any, r: _Report) -> None:
    lg = cfg.logging
    if lg.wandb_mode not in WANDB_MODES:
        r.error(f"logging.wandb_mode={lg.wandb_mode!r}: use one of {list(WANDB_MODES)}")
    if lg.log_freq < 1:
        r.error(f"logging.log_freq={lg.log_freq} must be >= 1")
