"""Typed structured configs for the training recipe (registered in Hydra's ConfigStore by
``launch/config_store.py``). ``conf/`` YAML files fill these; a typo or a wrong type fails at
composition, before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    # Config-group option name (e.g. "tiny_llama4", "dsv3_16b").
    name: str = MISSING
    # torchtitan model family: "llama4" or "deepseek_v3".
    family: str = MISSING
    # torchtitan flavor inside that family ("debugmodel", "17bx16e", ...) or one of ours ("tiny").
    flavor: str = MISSING


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


@dataclass
class A2ASchema:
    # Preset name: bf16 | mxfp8 | mxfp8_all (see mxfp8_ep.config.PRESETS).
    name: str = MISSING
    dispatch_fwd: str = "bf16"
    dispatch_bwd: str = "bf16"
    combine_fwd: str = "bf16"
    combine_bwd: str = "bf16"
    scale_rounding: str = "rceil"
    kernel: str = "auto"
    transport: str = "auto"


@dataclass
class LauncherConfig:
    name: str = MISSING
    # slurm only (ignored by local):
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_min: int = 60
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None
    constraint: Optional[str] = None
    exclusive: bool = False
    # pyxis/enroot container image (srun --container-image); None = run on the host.
    container_image: Optional[str] = None
    container_mounts: Optional[str] = None
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)
    # Block until the job ends and report its state (tests; `launcher.wait=true`).
    wait: bool = False
    # Requeue on preemption / time limit, resuming from the last checkpoint.
    max_num_timeout: int = 3


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
    # Run name; default = derived from the Hydra overrides (e.g. "a2a=mxfp8,model=dsv3_16b").
    run_name: Optional[str] = None
    log_freq: int = 1


@dataclass
class TrainingConfig:
    steps: int = 20
    seq_len: int = 64
    local_batch_size: int = 4
    lr: float = 8e-4
    warmup_steps: int = 2
    max_norm: float = 1.0
    seed: int = 0
    # Checkpointing (torchtitan DCP). interval in steps; folder relative to the run dir.
    checkpoint_enable: bool = False
    checkpoint_interval: int = 10
    checkpoint_folder: str = "checkpoint"
    compile: bool = False
    activation_checkpoint: str = "none"  # none | full | selective
    # Data: defaults are the tiny tokenizer and text shipped in assets/ (no download).
    dataset: str = "mxfp8ep_tiny"
    dataset_path: Optional[str] = None
    tokenizer_path: Optional[str] = None


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    parallelism: ParallelismConfig = MISSING
    a2a: A2ASchema = MISSING
    launcher: LauncherConfig = MISSING
    logging: LoggingConfig = MISSING
    training: TrainingConfig = field(default_factory=TrainingConfig)
    # Experiment name: wandb group and output folder prefix.
    experiment: str = "default"
