"""Check a composed training config before any process or job is started.

Everything that can be known without starting a process is checked here, in well under two
seconds (no torch, no torchtitan: model numbers come from ``launch.config.model_facts``, the machine
from ``launch.launchers.machine``): keys the schema does not have (also ones added with ``+``), values,
what torchtitan requires of the sequence length and the parallel degrees, the model against
the parallel layout, the kernel and transport against the device, data and tokenizer paths,
the launcher's own settings, a memory estimate against this machine and, for CPU processes, a
bound on the time of a step.

Every problem found is collected and raised together as one :class:`ConfigError`, each line
saying what to change. Things that are legal but probably not what the user meant come back
as warnings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from launch.config import model_facts
from launch.config.memory import (AUTO_CEILING, MemoryEstimate, ep_transport, fitting_ceiling, gib, run_estimate,
                                  runs_sync_free)
from launch.config.model_facts import ModelFacts
from launch.config.node_limited import ep_nodes, node_limited_problems
from launch.config.problems import (ConfigError, Report, choice_problem, did_you_mean, type_problem,
                                    unknown_key_problem)
from launch.config.schema import PROFILER_WARMUP_STEPS, TrainConfig, TrainingConfig
from launch.config.stack import CPU_MODELS, FAMILIES_BY_STACK, INSTALL, StackError, family_problem, installed_torchtitan
from launch.config.step_time import CPU_FLOPS_PER_CORE, cpu_step_seconds, step_flops
from launch.config.two_hop_layout import two_hop_problems
from launch.launchers.launcher import Launcher, Target, launcher_class, typed_launcher
from launch.launchers.machine import GIB, Machine
from launch.run.console import format_eta
from launch.titan.data import check_data
from mxfp8_ep.config import (DEFAULT_POOL_CEILING, DEFAULT_POOL_FACTOR, FIELD_CHOICES, LEGS, PRESETS,
                             capacity_factor_error, pool_ceiling_error)
from mxfp8_ep.transport import Transport
from mxfp8_ep.format.wire_format import WireFormat, quantized_formats

WANDB_MODES = ("offline", "online", "disabled")
ACTIVATION_CHECKPOINT = ("none", "full", "selective")
MEMORY_CHECK = ("error", "warn")
# a2a.name for legs set by hand (no preset).
CUSTOM_A2A = "custom"


def validate(cfg: Any, machine: Optional[Machine] = None) -> list[str]:
    """Raise :class:`ConfigError` listing every problem in ``cfg``; return the warnings.

    ``cfg`` is the composed config (``launch.config.schema.TrainConfig``); ``machine`` defaults to
    this one (``Machine.probe()``).
    """
    machine = machine or Machine.probe()
    r = Report()
    launcher = _launcher(cfg, r)
    if not _check_keys(cfg, r, launcher):
        raise ConfigError(r.errors)  # the checks below read the schema's keys
    if launcher is not None:
        cfg = _with_launcher_types(cfg, launcher, r)
    _check_training(cfg, r)
    world = _check_parallelism(cfg, r)
    quantized = _check_a2a(cfg, r)
    facts = _check_model(cfg, r)
    if facts is not None:
        _check_model_vs_parallelism(cfg, r, facts, quantized)
    _check_data(cfg, r, facts, world)
    _check_logging(cfg, r)
    if launcher is not None and not r.errors:
        machine_launcher = launcher()
        machine_launcher.check(cfg, machine, r)
        target = machine_launcher.target(cfg, machine)
        _check_device(cfg, r, target, facts)
        if facts is not None and world is not None:
            _check_memory(cfg, r, target, facts)
        if facts is not None:
            _check_step_time(cfg, r, target, facts)
    if r.errors:
        raise ConfigError(r.errors)
    return r.warnings


# ------------------------------------------------------------------------------- keys
def _check_keys(cfg: Any, r: Report, launcher: Optional[type[Launcher]]) -> bool:
    """Keys the schema does not know: Hydra rejects ``training.stepz=3`` but lets
    ``+training.stepz=3`` add one. The ``launcher`` group is checked against the chosen
    launcher's own ``Config``."""
    before = len(r.errors)
    _unknown_keys(cfg, TrainConfig, "", r)
    if launcher is not None and isinstance(cfg.get("launcher"), DictConfig):
        _unknown_keys(cfg.launcher, launcher.Config, "launcher.", r,
                      owner=f"launcher={cfg.launcher.get('name')}")
    return len(r.errors) == before


def _unknown_keys(node: Any, schema: type, prefix: str, r: Report, owner: Optional[str] = None) -> None:
    known = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys() if isinstance(node, DictConfig) else ():
        if key == "hydra" and not prefix:
            continue
        if key not in known:
            r.error(unknown_key_problem(f"{prefix}{key}", known, owner))
            continue
        child = node._get_node(key)
        child_schema = OmegaConf.get_type(child) if isinstance(child, DictConfig) else None
        if child_schema is not None and dataclasses.is_dataclass(child_schema):
            _unknown_keys(child, child_schema, f"{prefix}{key}.", r)


def _with_launcher_types(cfg: Any, launcher: type[Launcher], r: Report) -> Any:
    """``cfg`` with its ``launcher`` node typed (a copy); a wrong type is a problem."""
    import copy

    try:
        node = typed_launcher(launcher, cfg.launcher)
    except OmegaConfBaseException as e:
        key = getattr(e, "key", None)
        value = cfg.launcher.get(key) if key else None
        r.error(type_problem(f"launcher.{key}", value, str(e)) if key else f"launcher: {e}")
        return cfg
    out = copy.deepcopy(cfg)
    OmegaConf.set_readonly(out, False)
    with open_dict(out):
        out.launcher = node
    return out


# --------------------------------------------------------------------------- training
def _check_training(cfg: Any, r: Report) -> None:
    t = cfg.training
    for key in ("steps", "seq_len", "local_batch_size"):
        if getattr(t, key) <= 0:
            r.error(f"training.{key}={getattr(t, key)} must be > 0 (the default: training.{key}="
                    f"{getattr(TrainingConfig, key)})")
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
    if t.checkpoint_keep == 1 or t.checkpoint_keep < 0:
        r.error(f"training.checkpoint_keep={t.checkpoint_keep}: 0 (keep all) or >= 2 (torchtitan "
                f"keeps the one being written besides the newest complete one)")
    if t.activation_checkpoint not in ACTIVATION_CHECKPOINT:
        r.error(choice_problem("training.activation_checkpoint", t.activation_checkpoint,
                               ACTIVATION_CHECKPOINT))
    warmup_and_active = PROFILER_WARMUP_STEPS + 1
    if t.profile_freq != 0 and t.profile_freq < warmup_and_active:
        r.error(
            f"training.profile_freq={t.profile_freq}: 0 (off) or >= {warmup_and_active} (the "
            f"profiler warms up {PROFILER_WARMUP_STEPS} steps before the step it records)"
        )
    if cfg.validate.memory not in MEMORY_CHECK:
        r.error(choice_problem("validate.memory", cfg.validate.memory, MEMORY_CHECK))
    gpu_mem = cfg.validate.gpu_mem_gib
    if gpu_mem is not None and gpu_mem <= 0:
        r.error(f"validate.gpu_mem_gib={gpu_mem}: the memory of each GPU the config is meant for, GiB (an 80 GB "
                f"H100: 79.6), or null (this machine's)")
    if cfg.validate.max_step_s < 0:
        r.error(f"validate.max_step_s={cfg.validate.max_step_s}: 0 (no check) or the seconds a "
                f"step on CPU may take at most (e.g. 300)")
    _check_schedule(t, r)


def _check_schedule(t: Any, r: Report) -> None:
    """``training.lr_schedule_steps`` against the steps it must span."""
    n = t.lr_schedule_steps
    if n is None:
        return
    if n <= 0:
        r.error(f"training.lr_schedule_steps={n} must be > 0 (or null: training.steps)")
    elif t.steps > n:
        r.error(f"training.steps={t.steps} > training.lr_schedule_steps={n}: the learning rate decays to 0 at "
                f"step {n} and would stay there; use training.lr_schedule_steps >= {t.steps}, or leave it out "
                f"(the schedule spans training.steps)")


# ------------------------------------------------------------------------ parallelism
# torchtitan 0.2.2's ParallelismConfig.fsdp_reshard_after_forward values.
FSDP_RESHARD_POLICIES = ("default", "always", "never")


def _check_parallelism(cfg: Any, r: Report) -> Optional[int]:
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
    if p.fsdp_reshard_after_forward not in FSDP_RESHARD_POLICIES:
        r.error(f"parallelism.fsdp_reshard_after_forward={p.fsdp_reshard_after_forward!r}: choose one of "
                f"{', '.join(FSDP_RESHARD_POLICIES)}")
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
    elif p.ep > 1 and p.tp > 1 and fsdp == 1:
        r.error(
            f"parallelism.ep={p.ep} with parallelism.tp={p.tp} leaves an FSDP degree of 1 (the world size "
            f"{world} / parallelism.tp), but torchtitan shards the weights of an EP run over an FSDP mesh of "
            f"degree >= 2 (it stops building the model: \"Mesh 'fsdp' is not available\"); use parallelism.tp=1, "
            f"parallelism.procs_per_node={2 * p.procs_per_node} (FSDP 2 × TP {p.tp}) or parallelism.ep=1"
        )
    if world % p.ep:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        r.error(
            f"parallelism.ep={p.ep} must divide the {where}; choose parallelism.ep from "
            f"{divisors} or change the number of processes"
        )
    # torchtitan 0.2.2 (ParallelDims.seq_len_divisor): sequence parallel splits the sequence
    # over TP, and context parallel's load balancing halves it (2 × CP; CP is 1 here).
    divisor = 2 * p.tp
    if cfg.training.seq_len > 0 and cfg.training.seq_len % divisor:
        fixed = -(-cfg.training.seq_len // divisor) * divisor
        r.error(
            f"training.seq_len={cfg.training.seq_len}: torchtitan needs a multiple of 2 × "
            f"parallelism.tp = {divisor}; use training.seq_len={fixed}"
        )
    return world


# -------------------------------------------------------------------------------- a2a
def _check_a2a(cfg: Any, r: Report) -> bool:
    """Return whether any leg is MXFP8."""
    a = cfg.a2a
    if a.name not in PRESETS and a.name != CUSTOM_A2A:
        r.error(
            f"a2a.name={a.name!r} is not a preset; {did_you_mean(a.name, PRESETS, 'a2a={}')}use "
            f"a2a=<one of {sorted(PRESETS)}>, or a2a.name={CUSTOM_A2A} with the legs set by hand"
        )
    for key, allowed in FIELD_CHOICES.items():
        if a[key] not in allowed:
            r.error(choice_problem(f"a2a.{key}", a[key], allowed))
    factor_error = capacity_factor_error(a.capacity_factor)
    if factor_error is not None:
        r.error(f"a2a.capacity_factor={a.capacity_factor!r}: {factor_error}")
    if a.capacity_ceiling != AUTO_CEILING:
        ceiling_error = capacity_factor_error(a.capacity_ceiling)
        if ceiling_error is not None:
            r.error(f"a2a.capacity_ceiling={a.capacity_ceiling!r}: {ceiling_error}, or {AUTO_CEILING} (the largest "
                    f"that fits the memory)")
        elif _ceiling_below_start(a):
            r.error(f"a2a.capacity_ceiling={a.capacity_ceiling!r} is below where the capacity starts "
                    f"(a2a.capacity_factor={a.capacity_factor!r}): use a ceiling >= the factor, {AUTO_CEILING} or null")
    _check_pool(a, r)
    if a.ranks_per_node is not None and a.ranks_per_node < 1:
        r.error(f"a2a.ranks_per_node={a.ranks_per_node}: the EP ranks of one node of the two_hop transport, >= 1, "
                f"or null (the ranks that share a host)")
    formats = quantized_formats(a[leg] for leg in LEGS)
    if a.quantize_local_rows and not formats:
        r.error(f"a2a.quantize_local_rows=true quantizes the rows that stay on their rank on the quantized "
                f"legs, but a2a={a.name} quantizes none; use a2a=mxfp8 or a2a=mxfp8_all with it, "
                f"or drop a2a.quantize_local_rows")
    if a.name in PRESETS:
        changed = [f"{leg}={a[leg]}" for leg in LEGS if a[leg] != PRESETS[a.name][leg]]
        if changed:
            r.warn(
                f"a2a legs differ from preset {a.name!r} ({', '.join(changed)}); the run is still "
                f"labelled a2a={a.name} – set a2a.name={CUSTOM_A2A} to make that visible"
            )
    return formats


def _check_pool(a: Any, r: Report) -> None:
    """``a2a.activation_pool_factor`` and ``a2a.activation_pool_ceiling``, which the library
    refuses too (``A2AConfig.problems``), said with the recipe's keys and the value to use."""
    for key, default, null in (("activation_pool_factor", DEFAULT_POOL_FACTOR, "no pool"),
                               ("activation_pool_ceiling", DEFAULT_POOL_CEILING, "every layer's worst case")):
        if capacity_factor_error(a[key]) is not None:
            r.error(f"a2a.{key}={a[key]!r}: expected a finite number > 0 (the pool's rows as a multiple of the "
                    f"balanced case's, summed over the MoE layers) or null ({null}); the default is "
                    f"a2a.{key}={default}")
    if pool_ceiling_error(a.activation_pool_factor, a.activation_pool_ceiling) is not None:
        r.error(f"a2a.activation_pool_ceiling={a.activation_pool_ceiling!r} is below a2a.activation_pool_factor="
                f"{a.activation_pool_factor!r}, where the pool starts: use a2a.activation_pool_ceiling >= "
                f"{a.activation_pool_factor!r} or null (every layer's worst case), or a smaller "
                f"a2a.activation_pool_factor")


# ------------------------------------------------------------------------------ model
def _check_model(cfg: Any, r: Report) -> Optional[ModelFacts]:
    """The model's facts on the installed torchtitan (None when it has none: refused)."""
    m = cfg.model
    try:
        torchtitan = installed_torchtitan()
    except StackError as e:
        r.error(str(e))
        return None
    problem = family_problem(m.family, torchtitan)
    if problem is not None:
        r.error(f"model={m.name}: {problem}")
        return None
    families = FAMILIES_BY_STACK[torchtitan]
    if m.family not in families:
        r.error(f"model={m.name}: {choice_problem('model.family', m.family, families)}")
        return None
    try:
        return model_facts.facts(m.family, m.flavor, torchtitan)
    except model_facts.UnknownModelError:
        flavors = sorted(f for fam, f in model_facts.models(torchtitan) if fam == m.family)
        r.error(f"model={m.name}: {choice_problem('model.flavor', m.flavor, flavors)} (torchtitan {torchtitan})")
        return None


def _check_model_vs_parallelism(cfg: Any, r: Report, facts: ModelFacts, quantized: list[WireFormat]) -> None:
    p = cfg.parallelism
    if quantized and p.ep == 1 and not cfg.a2a.quantize_local_rows:
        r.warn(
            f"a2a={cfg.a2a.name} quantizes the all-to-all but parallelism.ep=1: every token stays "
            "in its process, nothing crosses a wire, and the MXFP8 legs are skipped. Use "
            "parallelism=ep2 (or higher) to measure anything, or a2a.quantize_local_rows=true to "
            "train with every row quantized as if it crossed."
        )
    if cfg.a2a.quantize_local_rows and p.ep == 1 and installed_torchtitan() != "0.2.2":
        r.error(f"a2a.quantize_local_rows=true with parallelism.ep=1 routes the MoE layers through the "
                f"dispatcher on each rank alone, which the recipe does on torchtitan 0.2.2 only "
                f"(`{INSTALL['0.2.2']}`); on torchtitan {installed_torchtitan()} use parallelism.ep > 1")
    elif cfg.a2a.quantize_local_rows and p.ep == 1 and p.tp > 1:
        r.error(f"a2a.quantize_local_rows=true with parallelism.ep=1 routes the MoE layers through the "
                f"dispatcher on each rank alone, which takes whole experts, but parallelism.tp={p.tp} "
                f"shards them; use parallelism.tp=1 or parallelism.ep > 1")
    if p.ep >= 1 and facts.num_experts % p.ep:
        divisors = [d for d in range(1, facts.num_experts + 1) if facts.num_experts % d == 0]
        r.error(
            f"parallelism.ep={p.ep} must divide the number of experts of model={cfg.model.name} "
            f"({facts.num_experts}); choose parallelism.ep from {divisors}"
        )
    for fmt in quantized:
        if fmt.dim_error(facts.dim):
            r.error(
                f"model={cfg.model.name} has hidden dim {facts.dim}, not a multiple of {fmt.block_size} "
                f"(the {fmt.value} block size), so its tokens cannot be sent as {fmt.value}; use a2a=bf16 "
                f"or a model with dim % {fmt.block_size} == 0"
            )
    errors, warnings = node_limited_problems(cfg.model.num_expert_groups, cfg.model.num_limited_groups,
                                             num_experts=facts.num_experts, top_k=facts.top_k, ep=p.ep,
                                             procs_per_node=p.procs_per_node, model=cfg.model.name)
    for e in errors:
        r.error(e)
    for w in warnings:
        r.warn(w)
    if p.tp > 1:
        for name, heads in (("n_heads", facts.n_heads), ("n_kv_heads", facts.n_kv_heads)):
            if heads % p.tp:
                r.error(f"parallelism.tp={p.tp} must divide {name}={heads} of model={cfg.model.name}")


# ------------------------------------------------------------------------------- data
def _check_data(cfg: Any, r: Report, facts: Optional[ModelFacts], world: Optional[int]) -> None:
    tp = cfg.parallelism.tp
    dp = world // tp if world and tp >= 1 and world % tp == 0 else None
    errors, warnings = check_data(cfg.training, model_vocab=facts.vocab_size if facts else None,
                                  dp_degree=dp)
    for e in errors:
        r.error(e)
    for w in warnings:
        r.warn(w)


# ---------------------------------------------------------------------------- logging
def _check_logging(cfg: Any, r: Report) -> None:
    lg = cfg.logging
    if lg.wandb_mode not in WANDB_MODES:
        r.error(choice_problem("logging.wandb_mode", lg.wandb_mode, WANDB_MODES))
    if lg.wandb_mode == "online":
        from launch.config.wandb_login import login_problem

        problem = login_problem()
        if problem:
            r.error(problem)
    if lg.log_freq < 1:
        r.error(f"logging.log_freq={lg.log_freq} must be >= 1")
    if lg.numerics_every < 0:
        r.error(f"logging.numerics_every={lg.numerics_every}: 0 (off) or the steps between samples (e.g. 50)")
    elif lg.numerics_every > cfg.training.steps > 0:
        r.error(f"logging.numerics_every={lg.numerics_every} > training.steps={cfg.training.steps}: it samples every "
                f"{lg.numerics_every}th step, so this run would sample none and log nothing under numerics/; use "
                f"logging.numerics_every <= {cfg.training.steps} (e.g. {max(1, cfg.training.steps // 2)}) or more "
                f"training.steps")
    elif lg.numerics_every and not quantized_formats(cfg.a2a[leg] for leg in LEGS):
        r.warn(f"logging.numerics_every={lg.numerics_every} measures the MXFP8 legs, but a2a={cfg.a2a.name} "
               f"has none: nothing will be logged under numerics/")
    elif lg.numerics_every and cfg.parallelism.ep == 1 and not cfg.a2a.quantize_local_rows:
        r.warn(f"logging.numerics_every={lg.numerics_every} with parallelism.ep=1: the MoE layers run "
               f"torchtitan's own path, which quantizes nothing, so nothing is logged under numerics/; "
               f"add a2a.quantize_local_rows=true")


# --------------------------------------------------------------------------- launcher
def _launcher(cfg: Any, r: Report) -> Optional[type[Launcher]]:
    try:
        cls = launcher_class(cfg)
    except Exception as e:  # noqa: BLE001 - a bad _target_ is a config problem
        r.error(f"launcher={cfg.launcher.get('name')}: launcher._target_="
                f"{cfg.launcher.get('_target_')!r} does not name a launcher class ({e}); use "
                f"launcher=local or launcher=slurm")
        return None
    if not dataclasses.is_dataclass(getattr(cls, "Config", None)):
        r.error(f"launcher._target_={cfg.launcher._target_}: the class has no Config dataclass "
                f"of its launcher.* fields (launch/launchers/launcher.py says what a launcher is)")
        return None
    return cls


# ----------------------------------------------------------------------------- device
def _check_device(cfg: Any, r: Report, target: Target, facts: Optional[ModelFacts]) -> None:
    a, p = cfg.a2a, cfg.parallelism
    if target.device == "cpu" and a.kernel == "triton":
        r.error(f"a2a.kernel=triton needs CUDA GPUs, but {target.where}; use a2a.kernel=auto "
                f"(Triton on GPUs, torch elsewhere) or a2a.kernel=torch")
    if a.transport == Transport.SYMM:
        why = []
        across = p.nodes > 1 and ep_nodes(p.ep, p.procs_per_node) != 1
        if p.nodes > 1:
            why.append(f"parallelism.nodes={p.nodes} (symmetric memory spans one node"
                       + (f", and parallelism.ep={p.ep} spans nodes of parallelism.procs_per_node="
                          f"{p.procs_per_node})" if across else ")"))
        if target.device == "cpu":
            why.append(target.where)
        if p.procs_per_node < 2:
            why.append(f"parallelism.procs_per_node={p.procs_per_node} (it needs >= 2 GPUs)")
        if why:
            fix = (f"use a2a.transport={Transport.TWO_HOP.value} (each token once per node across the network, "
                   f"symm inside each node) or a2a.transport=auto (which picks it across nodes with CUDA)" if across
                   else "use a2a.transport=auto (symm where it can, nccl elsewhere) or a2a.transport=nccl")
            r.error(f"a2a.transport=symm needs one node with CUDA and >= 2 GPUs, but {'; '.join(why)}; {fix}")
    _check_two_hop(cfg, r, target)
    if p.share_gpu and target.device == "cuda" and not runs_sync_free(cfg, target.device):
        r.error(f"parallelism.share_gpu=true: the ranks on one GPU talk over gloo, whose CUDA all-gather "
                f"torch's functional collectives cannot run, so the EP exchange must be the symm transport "
                f"(peer buffers over CUDA IPC; or two_hop, symm inside each node), but a2a.transport={a.transport} "
                f"with parallelism.ep={p.ep} does not run it; use parallelism.ep >= 2 with a2a.transport=symm or "
                f"auto")
    if facts is not None and target.device == "cpu" and facts.attention == "flex":
        r.error(f"model={cfg.model.name} uses flex attention ({cfg.model.family}/"
                f"{cfg.model.flavor}), which torch cannot train on CPU (no backward kernel), and "
                f"{target.where}; use a model with sdpa attention ({CPU_MODELS[installed_torchtitan()]}) "
                f"or GPUs")


def _check_two_hop(cfg: Any, r: Report, target: Target) -> None:
    """The two_hop transport's nodes (``launch.config.two_hop_layout``) where the EP layers run
    it (asked for, or ``auto`` across nodes with CUDA); ``a2a.ranks_per_node`` set where they
    do not: a warning."""
    a, p = cfg.a2a, cfg.parallelism
    transport = ep_transport(cfg, target.device)
    if transport is Transport.TWO_HOP:
        for problem in two_hop_problems(ep=p.ep, nodes=p.nodes, procs_per_node=p.procs_per_node,
                                        ranks_per_node=a.ranks_per_node, requested=a.transport):
            r.error(problem if a.transport == Transport.TWO_HOP else
                    f"a2a.transport={a.transport} runs two_hop here (CUDA, an EP group across nodes): {problem}")
    elif transport is not None and a.ranks_per_node is not None:
        r.warn(f"a2a.ranks_per_node={a.ranks_per_node} sets the nodes of the two_hop transport, but the EP layers "
               f"run {transport.value} (a2a.transport={a.transport}, parallelism.ep={p.ep}, {target.where}): it "
               f"changes nothing; a2a.transport=two_hop splits the EP group into nodes of that many ranks")


# ----------------------------------------------------------------------------- memory
# The symm transport sizes one layer's expert-side tensors by a2a.capacity_factor (every layer at
# the worst case, EP x top-k rows per token, when null): what to try when that does not fit.
SYMM_MEMORY_HINT = (" (the symm transport keeps the MoE layers' expert rows in an activation pool a little above "
                    "the balanced case, and the layer being computed holds them at a2a.capacity_factor times it: a "
                    "smaller factor keeps fewer of them, a2a.transport=nccl none)")
TWO_HOP_MEMORY_HINT = (" (the two_hop transport keeps every MoE layer's expert rows at a2a.capacity_factor times the "
                       "balanced case, with no activation pool: a smaller factor keeps fewer of them, "
                       "a2a.transport=nccl none)")


def memory_estimate(cfg: Any, target: Target, facts: ModelFacts,
                    capacity_factor: float | None | str = "start") -> MemoryEstimate:
    """``launch.config.memory.run_estimate`` of one process of ``cfg`` run on ``target``: the
    symm capacity and activation pool where they start (``capacity_factor="start"``), or the
    capacity at the factor given with the pool at its ceiling."""
    start = capacity_factor == "start"
    factor = cfg.a2a.capacity_factor if start else capacity_factor
    return run_estimate(cfg, facts, target.device, runs_sync_free(cfg, target.device), factor, at_ceiling=not start)


def memory_report(cfg: Any, machine: Machine) -> list[str]:
    """The memory estimate the check holds ``cfg`` to on ``machine`` (the launch config,
    ``capacity_ceiling`` resolved), as ``--cfg job`` prints it: one process's total and parts
    where it starts; with a sync-free transport (symm, two_hop) at an elastic capacity, the parts
    that differ at its ceilings; where the EP layers run one, the parts that differ with
    ``a2a.transport=nccl``.
    Empty where the memory or the model is unknown."""
    import copy

    target = launcher_class(cfg)().target(cfg, machine)
    try:
        facts = model_facts.facts(cfg.model.family, cfg.model.flavor, installed_torchtitan())
    except (model_facts.UnknownModelError, StackError):
        return []
    if target.memory_bytes is None:
        return []
    start = memory_estimate(cfg, target, facts)
    procs = _processes_per_memory(cfg, target)
    shared = f" × {procs} processes" if procs > 1 else ""
    lines = [f"memory (launch/config/memory.py) per process{shared}, against {target.memory_name} of "
             f"{gib(target.memory_bytes)} GiB: {gib(start.total)} GiB ({start.breakdown()})"]

    def differing(est: MemoryEstimate) -> str:
        before = dict(start.parts())
        return ", ".join(f"{label} {gib(n)}" for label, n in est.parts() if before.get(label) != n) + \
            "".join(f", no {label}" for label in before if label not in dict(est.parts()))

    a = cfg.a2a
    if elastic_capacity(cfg, target) and capacity_factor_error(a.capacity_ceiling) is None:
        top = memory_estimate(cfg, target, facts, a.capacity_ceiling)
        shown = "null" if a.capacity_ceiling is None else a.capacity_ceiling
        pool = ("" if ep_transport(cfg, target.device) is Transport.TWO_HOP else " and a2a.activation_pool_ceiling="
                f"{'null' if a.activation_pool_ceiling is None else a.activation_pool_ceiling}")
        lines.append(f"  at a2a.capacity_ceiling={shown}{pool}: {gib(top.total)} GiB ({differing(top)})")
    if runs_sync_free(cfg, target.device):
        nccl = copy.deepcopy(cfg)
        with open_dict(nccl):
            nccl.a2a.transport = Transport.NCCL.value
        other = memory_estimate(nccl, target, facts)
        lines.append(f"  with a2a.transport=nccl: {gib(other.total)} GiB ({differing(other)})")
    return lines


def _processes_per_memory(cfg: Any, target: Target) -> int:
    """Processes sharing one ``target.memory_bytes``: one per GPU, or every process of a node
    (its RAM, or one GPU shared by them)."""
    return 1 if target.device == "cuda" and not cfg.parallelism.share_gpu else cfg.parallelism.procs_per_node


def elastic_capacity(cfg: Any, target: Target) -> bool:
    """Whether the EP layers run a sync-free transport (symm, two_hop) at an elastic capacity
    (one that grows)."""
    return runs_sync_free(cfg, target.device) and cfg.a2a.capacity_factor is not None


def resolved_ceiling(cfg: Any, target: Target, facts: ModelFacts) -> float | None | str:
    """``a2a.capacity_ceiling`` as the run will take it: ``auto`` becomes the library's ceiling,
    or the largest below it, whose estimate fits ``target``'s memory
    (``launch.config.memory.fitting_ceiling``) where that memory is known and a sync-free
    transport runs at an elastic capacity; otherwise as given."""
    ceiling = cfg.a2a.capacity_ceiling
    if ceiling != AUTO_CEILING or target.memory_bytes is None or not elastic_capacity(cfg, target):
        return ceiling
    return fitting_ceiling(cfg, facts, target.device, target.memory_bytes, _processes_per_memory(cfg, target))


def _check_memory(cfg: Any, r: Report, target: Target, facts: ModelFacts) -> None:
    if target.memory_bytes is None:
        return
    p, t = cfg.parallelism, cfg.training
    est = memory_estimate(cfg, target, facts)
    procs = _processes_per_memory(cfg, target)
    need = est.total * procs
    if need <= target.memory_bytes:
        _check_ceiling_memory(cfg, r, target, facts)
        return

    per = est.breakdown(f"at local_batch_size={t.local_batch_size} × seq_len={t.seq_len}") + ")"
    times = f" × {procs} processes = {gib(need)} GiB" if procs > 1 else ""
    msg = (f"model={cfg.model.name} with parallelism={p.name} needs about {gib(est.total)} GiB per "
           f"process ({per}{times}, but {target.memory_name} is {gib(target.memory_bytes)} GiB. "
           f"Use a smaller model, more GPUs or nodes to shard it over, a smaller "
           f"training.local_batch_size or training.seq_len, or training.activation_checkpoint="
           f"full" + (TWO_HOP_MEMORY_HINT if est.node_hop else SYMM_MEMORY_HINT if est.peer_buffers else "")
           + "; validate.memory=warn launches anyway"
           + _on_its_gpus(cfg, target, facts))
    (r.warn if cfg.validate.memory == "warn" else r.error)(msg)


def _on_its_gpus(cfg: Any, target: Target, facts: ModelFacts) -> str:
    """Where a config that names its GPUs (``validate.gpu_mem_gib``) is refused on a machine
    without GPUs: the estimate on those GPUs, the breakdown ``--cfg job`` prints; else ""."""
    gpu_mem, p = cfg.validate.gpu_mem_gib, cfg.parallelism
    if gpu_mem is None or gpu_mem <= 0 or target.device == "cuda":
        return ""
    node = Machine.with_gpus(1 if p.share_gpu else p.procs_per_node, gpu_mem)
    on_gpus = memory_estimate(cfg, launcher_class(cfg)().target(cfg, node), facts)
    return (f". On the GPUs it names (validate.gpu_mem_gib={gpu_mem:g}, {node.gpus} per node), as `--cfg job` "
            f"checks it from here: {gib(on_gpus.total)} GiB per process ({on_gpus.breakdown()})")


def _ceiling_below_start(a: Any) -> bool:
    """A ceiling given as a number below a starting factor given as one (the library would
    take the factor as the ceiling: the capacity would never grow, surely not what was meant)."""
    numbers = [v for v in (a.capacity_factor, a.capacity_ceiling) if v is not None and not capacity_factor_error(v)]
    return len(numbers) == 2 and a.capacity_ceiling < a.capacity_factor


def _check_ceiling_memory(cfg: Any, r: Report, target: Target, facts: ModelFacts) -> None:
    """An ``a2a.capacity_ceiling`` given as a number (or null, the worst case) whose estimate
    does not fit: the capacity may grow to it hours into a run. ``auto`` fits by construction
    (``resolved_ceiling``)."""
    a = cfg.a2a
    if (not elastic_capacity(cfg, target) or a.capacity_ceiling == AUTO_CEILING
            or capacity_factor_error(a.capacity_ceiling) or _ceiling_below_start(a)):
        return
    est = memory_estimate(cfg, target, facts, a.capacity_ceiling)
    procs = _processes_per_memory(cfg, target)
    if est.total * procs <= target.memory_bytes:
        return
    largest = fitting_ceiling(cfg, facts, target.device, target.memory_bytes, procs)
    grows = "the worst case" if a.capacity_ceiling is None else f"{a.capacity_ceiling} times the balanced case"
    times = f" × {procs} processes" if procs > 1 else ""
    grown = (f"the two_hop transport's expert rows and node hop may grow to {grows}" if est.node_hop else
             f"the symm transport's expert rows may grow to {grows} (its activation pool to its ceiling)")
    parts = (f"node hop {est.node_hop / GIB:,.1f}" if est.node_hop else
             f"activation pool {est.activation_pool / GIB:,.1f}, "
             f"one layer's expert rows {est.layer_transient / GIB:,.1f}")
    (r.warn if cfg.validate.memory == "warn" else r.error)(
        f"a2a.capacity_ceiling={a.capacity_ceiling if a.capacity_ceiling is not None else 'null'}: {grown}, "
        f"where a process needs about {est.total / GIB:,.1f} GiB (activations {est.activations / GIB:,.1f}, "
        f"{parts}){times}, but {target.memory_name} is "
        f"{target.memory_bytes / GIB:,.1f} GiB; the largest ceiling that fits is {largest} "
        f"(a2a.capacity_ceiling={AUTO_CEILING} picks it); validate.memory=warn launches anyway")


# ------------------------------------------------------------------------------ step time
def _check_step_time(cfg: Any, r: Report, target: Target, facts: ModelFacts) -> None:
    """CPU processes: a step that would take longer than ``validate.max_step_s`` even at the
    best speed of a CPU core (``launch.config.step_time``) is refused."""
    limit, p, t = cfg.validate.max_step_s, cfg.parallelism, cfg.training
    if target.device != "cpu" or not target.cores or limit <= 0 or t.seq_len <= 0 or t.local_batch_size <= 0:
        return
    flops = step_flops(facts, local_batch_size=t.local_batch_size, seq_len=t.seq_len, tp=p.tp)
    cores = max(1, target.cores // p.procs_per_node)  # the runner's torch threads per process
    seconds = cpu_step_seconds(flops, cores)
    if seconds <= limit:
        return
    attention = flops.attention / flops.total
    field = (f"training.seq_len={t.seq_len}" if attention > 0.5 else
             f"training.local_batch_size={t.local_batch_size} × training.seq_len={t.seq_len}")
    why = (f"{attention:.0%} of them attention over {t.seq_len:,}² token pairs per sequence, "
           f"which grows with the square of training.seq_len" if attention > 0.5 else
           f"for model={cfg.model.name}")
    r.error(f"{field}: every training step would take at least {format_eta(seconds)} on {cores} CPU "
            f"core(s) per process ({flops.total:.1e} FLOPs per process and step, {why}; a core "
            f"computes at most ~{CPU_FLOPS_PER_CORE:.0e} FLOP/s). Use a smaller training.seq_len or "
            f"training.local_batch_size, or GPUs; validate.max_step_s=0 launches anyway")
