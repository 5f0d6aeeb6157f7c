"""Typed structured configs for the training recipe (registered in Hydra's ConfigStore by
``launch/preflight/config_store.py``). ``conf/`` YAML files fill these; a typo or a wrong type fails at
composition, before anything starts (``launch/preflight/validate.py`` catches keys added with ``+``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from launch.config.memory import AUTO_CEILING
from mxfp8_ep.config import A2AConfig


@dataclass
class ModelConfig:
    # Config-group option name (e.g. "tiny_llama4", "dsv3_16b").
    name: str = MISSING
    # torchtitan model family: "llama4" or "deepseek_v3".
    family: str = MISSING
    # torchtitan flavor inside that family ("debugmodel", "17bx16e", ...) or one of ours ("tiny").
    flavor: str = MISSING
    # Node-limited routing (DeepSeek-V3's group-limited routing; torchtitan's router fields of the
    # same names): the routed experts split into num_expert_groups groups, one per node the EP
    # group spans, and a token picks its top-k among the experts of its num_limited_groups best
    # groups: its rows cross to at most that many nodes. Checked against parallelism before launch
    # (launch/config/node_limited.py). null (both): off, also for flavors whose torchtitan args
    # set them (236B, 671B).
    num_expert_groups: Optional[int] = None
    num_limited_groups: Optional[int] = None


@dataclass
class ParallelismConfig:
    name: str = MISSING
    nodes: int = 1
    # Processes per node: one per GPU; on a CPU-only machine, CPU worker processes (gloo).
    procs_per_node: int = 2
    ep: int = 2
    # FSDP shard degree; -1 = whatever is left of the world size after TP.
    fsdp: int = -1
    tp: int = 1
    # Run each MoE layer's shared experts on a CUDA side stream, beside the dispatch. Pays where
    # the GPU waits on a slow link (transport nccl across nodes); no gain measured on symm, whose
    # pushes hold every SM. x's bf16 gradient terms then add in another order than torchtitan's.
    overlap_shared_experts: bool = False
    # Every process on this machine's first GPU (launcher=local, one node), talking over gloo,
    # the EP exchange through the symm transport's peer buffers over CUDA IPC: EP numerics on a
    # one-GPU machine (launch/run/shared_gpu.py). Its throughput is no speed figure: the ranks take
    # turns on one GPU. Without it a machine needs a GPU per process.
    share_gpu: bool = False
    # torchtitan's FSDP policy for the gathered weights after forward: "default" (regathered in
    # backward), "always" or "never" (kept from forward to backward: one all-gather fewer per
    # block, the gathered bf16 weights of every block held through the step).
    fsdp_reshard_after_forward: str = "default"


def _a2a_schema() -> type:
    """``A2AConfig``'s fields with its defaults (the four legs, scale rounding, kernel,
    transport: whatever the library's config has), plus the preset ``name``."""
    types = typing.get_type_hints(A2AConfig)

    def schema_field(f: dataclasses.Field) -> tuple:
        if f.name == "capacity_ceiling":  # a number, null, or "auto": what fits the memory (launch/config/memory.py)
            return f.name, Any, field(default=AUTO_CEILING)
        return f.name, types[f.name], field(default=f.default)

    schema = dataclasses.make_dataclass(
        "A2ASchema", [("name", str, field(default=MISSING))] + [schema_field(f) for f in dataclasses.fields(A2AConfig)])
    schema.__module__ = __name__
    schema.__doc__ = ("The ``a2a`` group: a preset name (mxfp8_ep.config.PRESETS, or custom) and "
                      "the fields of mxfp8_ep.config.A2AConfig.")
    return schema


A2ASchema = _a2a_schema()


@dataclass
class LoggingConfig:
    name: str = MISSING
    # offline (default: nothing leaves the machine) | online | disabled
    wandb_mode: str = "offline"
    project: str = "mxfp8-ep"
    entity: Optional[str] = None
    # wandb group; default = experiment name, so a sweep's bf16 and mxfp8 runs sit together.
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    # Run name; default = the overrides that change what is trained (e.g. "a2a=mxfp8,model=dsv3_16b").
    run_name: Optional[str] = None
    # wandb run id; default = a new one (a resumed run keeps its own: launch/run/resume.py).
    run_id: Optional[str] = None
    log_freq: int = 1
    # Every this many steps, the quantization telemetry of the MXFP8 legs (launch/run/numerics_log.py:
    # per MoE layer and leg, the round trip's relative error, saturated blocks, flushed values,
    # the scales' range) on a sample of each leg's rows, logged under numerics/; 0: off.
    numerics_every: int = 0
    # Console: header, one line per log window and the summary; true = every process's full
    # output (torchtitan, wandb, warnings), as in the run's log files.
    verbose: bool = False
    # While a step runs longer than this, a console line every this many seconds says which step
    # is still running and for how long (launch/run/heartbeat.py); 0: off.
    heartbeat_s: int = 60


# Steps torchtitan's profiler runs (untraced) before the one step it records, each cycle.
PROFILER_WARMUP_STEPS = 3


@dataclass
class TrainingConfig:
    steps: int = 20
    seq_len: int = 64
    local_batch_size: int = 4
    lr: float = 8e-4
    warmup_steps: int = 2
    # Length of the learning-rate schedule (warmup_steps of linear warmup, then linear decay
    # to 0 at this step; torchtitan's lr_scheduler.total_steps). null: training.steps, filled
    # in at a run's first launch; a resume keeps the run's unless given on its command line.
    lr_schedule_steps: Optional[int] = None
    max_norm: float = 1.0
    seed: int = 0
    # Checkpointing (torchtitan DCP). interval in steps; folder relative to the run dir.
    checkpoint_enable: bool = False
    checkpoint_interval: int = 10
    checkpoint_folder: str = "checkpoint"
    # null: a new run in a new run dir; a run dir: continue that run from its newest checkpoint,
    # with its saved config (overrides on the same command line apply on top); "auto": the
    # newest run of this experiment that has a checkpoint, or a new run (launch/run/resume.py).
    resume: Optional[str] = None
    compile: bool = False
    activation_checkpoint: str = "none"  # none | full | selective
    # torchtitan's training.mixed_precision_param: the dtype the weights compute in (FSDP's
    # param dtype; autocast on one process). "float32": full precision, e.g. on a CPU, where
    # torch's bfloat16 backward of the experts' small matmuls runs several times slower.
    mixed_precision_param: str = "bfloat16"  # bfloat16 | float32
    # Every this many steps, torchtitan's profiler writes one step's Chrome trace per rank to
    # <run dir>/profile_traces/iteration_<step>/ (`python -m benchmarks.train RUNS --step-profile` sums them up);
    # 0: off. It records one step after PROFILER_WARMUP_STEPS warm-up steps, so at least 4.
    profile_freq: int = 0
    # Checkpoints kept on disk, newest first (torchtitan's keep_latest_k); 0 keeps all.
    checkpoint_keep: int = 10
    # Data (launch/titan/data.py): mxfp8ep_tiny = the tiny text and tokenizer shipped in
    # launch/titan/assets/; debian_docs = the corpus folder scripts/build_corpus.py writes
    # (dataset_path, default data/corpus; its tokenizer unless tokenizer_path is set).
    dataset: str = "mxfp8ep_tiny"
    dataset_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    # Validation loss on the dataset's held-out split every val_every steps and at the last
    # step (0: off): val_batches batches of the training batch shape, the same tokens every
    # time and in every run with that global batch shape.
    val_every: int = 0
    val_batches: int = 8


@dataclass
class ValidateConfig:
    # The memory estimate against this machine's RAM / GPU memory: "error" stops before
    # launch when it does not fit, "warn" only says so.
    memory: str = "error"
    # CPU processes: refuse a run whose every step would take longer than this (seconds) even at
    # the best speed a CPU core reaches (launch/config/step_time.py); 0: no check.
    max_step_s: int = 300
    # The memory of each GPU the config is meant for, GiB (an 80 GB H100: 79.6). Set, `--cfg job`
    # checks the config on nodes of such GPUs, one per process, not on this machine (a dry run from
    # a laptop or a login node), and launcher=slurm holds the memory estimate against it before
    # sbatch. null: `--cfg job` checks against this machine; launcher=slurm leaves the memory to
    # the job's nodes.
    gpu_mem_gib: Optional[float] = None


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    parallelism: ParallelismConfig = MISSING
    a2a: A2ASchema = MISSING  # type: ignore[valid-type]
    # Typed by the chosen launcher's own Config (a LauncherConfig; launch/launchers/launcher.py), which
    # launch/preflight/validate.py applies: each launcher has its own fields.
    launcher: Any = MISSING
    logging: LoggingConfig = MISSING
    training: TrainingConfig = field(default_factory=TrainingConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    # Experiment name: wandb group and output folder prefix.
    experiment: str = "default"


def config_to_yaml(cfg: DictConfig) -> str:
    """Serialize the composed config (Hydra's own node is not part of it) for another process."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def config_from_yaml(text: str) -> DictConfig:
    """Inverse of :func:`config_to_yaml`: a typed (``TrainConfig``) DictConfig again."""
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.create(text))
