"""Compose the recipe's Hydra config in tests (no @hydra.main, no process launched)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import launch.config_store  # noqa: F401  (registers the schemas)
CONF = REPO / "conf"
GROUPS = ("model", "parallelism", "a2a", "launcher", "logging")


def compose_cfg(*overrides: str, hydra_node: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra_node)


def options(group: str) -> list[str]:
    """Option names of a config group (its YAML files; the ConfigStore schemas aside)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))
