"""Compose the recipe's Hydra config in tests (no @hydra.main, no process launched)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import launch.preflight.config_store  # noqa: F401  (registers the schemas)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
GROUPS = ("model", "parallelism", "a2a", "launcher", "logging")


def compose_cfg(*overrides: str, hydra_node: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra_node)


def options(group: str) -> list[str]:
    """Option names of a config group (its YAML files; the ConfigStore schemas aside)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(autouse=True)
def no_slurm_cluster(monkeypatch):
    """What sinfo would list: nothing (not a SLURM login node), so checks of a launcher=slurm
    config do not depend on whether a cluster is up on this machine. Tests that want a
    cluster's partitions pass a ``ClusterView`` or patch ``partitions`` themselves."""
    from launch.launchers import slurm_cluster

    monkeypatch.setattr(slurm_cluster, "partitions", lambda: None)
