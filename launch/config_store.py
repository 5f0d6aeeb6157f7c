"""Register the recipe's structured configs (``launch/schema.py``) in Hydra's ConfigStore.

``conf/train.yaml`` starts its defaults list with ``train_schema`` (``TrainConfig``), which types
every group (``model: ModelConfig``, ...): a misspelled key or a wrong type in a group file or
on the command line fails while Hydra composes the config, before anything is launched.
``launcher=slurm`` extends its node to ``SlurmLauncherConfig`` (stored as the root-level
``slurm_launcher_schema``, so it is not offered as a launcher option).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore

from launch.schema import LauncherConfig, TrainConfig


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    """``launcher=slurm``: the fields of LauncherConfig plus the ones only SLURM reads."""

    # GPUs to request per node; None = one per process (parallelism.procs_per_node).
    # Set 0 on a CPU-only cluster.
    gpus_per_node: Optional[int] = None
    # Extra arguments for the srun that starts the tasks (after the pyxis ones).
    srun_args: list[str] = field(default_factory=list)
    # sbatch --job-name; None = "mxfp8ep-<experiment>".
    job_name: Optional[str] = None


def register_configs() -> None:
    """Idempotent: safe to call from the Hydra app and from tests."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="slurm_launcher_schema", node=SlurmLauncherConfig)


register_configs()
