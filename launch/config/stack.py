"""Which torchtitan stack this environment runs: the recipe drives torchtitan 0.2.2's or 0.3.0's
trainer, whichever is installed (``bash scripts/install.sh`` / ``--torchtitan 0.3.0``).

The versions come from the installed packages' metadata (``importlib.metadata``: no torch
import, so the checks before launch stay fast). Every run records its stack (torchtitan, torch,
triton) in ``<run dir>/stack.json``, ``summary.json`` and its wandb config; ``compare_runs`` warns
when it compares runs of different stacks, and a run continues only on the stack it started on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

__all__ = ["CPU_MODELS", "DEFAULT_MODEL", "FAMILIES_BY_STACK", "INSTALL", "STACKS", "Stack", "StackError",
           "default_model", "family_problem", "help_first_example", "help_stack", "installed", "installed_torchtitan"]

# The torchtitan releases the recipe runs, and the model families it trains on each.
STACKS = ("0.2.2", "0.3.0")
FAMILIES_BY_STACK = {
    "0.2.2": ("llama4", "deepseek_v3"),
    # torchtitan 0.3.0 removed Llama4 ("deprecate llama4") and brought Qwen3 MoE into the recipe.
    "0.3.0": ("deepseek_v3", "qwen3"),
}
INSTALL = {"0.2.2": "bash scripts/install.sh", "0.3.0": "bash scripts/install.sh --torchtitan 0.3.0"}
# Each family's tiny CPU model: what a refused family's message offers instead.
TINY_MODEL = {"llama4": "tiny_llama4", "deepseek_v3": "tiny_dsv3", "qwen3": "tiny_qwen3"}
# The model a launch trains without model=...: the tiny model of the stack's first family
# (conf/train.yaml's ``model: default``, registered by launch/preflight/config_store.py).
DEFAULT_MODEL = {stack: TINY_MODEL[families[0]] for stack, families in FAMILIES_BY_STACK.items()}
# The models with sdpa attention (torch has no flex-attention backward on CPU) of each stack.
CPU_MODELS = {"0.2.2": "tiny_llama4, tiny_dsv3, llama4_debugmodel, dsv3_debugmodel",
              "0.3.0": "tiny_dsv3, tiny_qwen3, parity_tiny_dsv3"}
FAMILY_NAMES = {"llama4": "Llama4", "deepseek_v3": "DeepSeek-V3", "qwen3": "Qwen3 MoE"}


def _installed_or_default() -> str:
    try:
        return installed_torchtitan()
    except StackError:
        return STACKS[0]


def default_model() -> str:
    """The conf/model option a launch on this stack trains by default (``tiny_dsv3`` on 0.3.0,
    which has no Llama4); 0.2.2's where no stack is installed (the checks then say so)."""
    return DEFAULT_MODEL[_installed_or_default()]


def help_stack() -> str:
    """What ``--help`` says the recipe trains here: ``torchtitan 0.3.0's MoE models (DeepSeek-V3,
    Qwen3 MoE)``."""
    stack = _installed_or_default()
    return f"torchtitan {stack}'s MoE models ({', '.join(FAMILY_NAMES[f] for f in FAMILIES_BY_STACK[stack])})"


def help_first_example(family: str) -> str:
    """``--help``'s first example: the default run (``family``: its model's) where that family
    trains on this stack, else the same run with this stack's first family's tiny model."""
    families = FAMILIES_BY_STACK[_installed_or_default()]
    model = "" if family in families else f" model={TINY_MODEL[families[0]]}"
    shown = family if family in families else families[0]
    return f"{'python launch/train.py' + model:<60}# tiny {FAMILY_NAMES[shown]}, EP 2, 20 steps"


class StackError(RuntimeError):
    """This environment's torchtitan is none the recipe runs."""


def _version(package: str) -> Optional[str]:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def installed_torchtitan() -> str:
    """The installed torchtitan release, one of :data:`STACKS`; :class:`StackError` otherwise."""
    found = _version("torchtitan")
    if found in STACKS:
        return found
    have = f"torchtitan {found}" if found else "no torchtitan"
    raise StackError(f"this environment has {have}; the recipe runs torchtitan {' or '.join(STACKS)}: "
                     f"install one with `{INSTALL['0.2.2']}` or `{INSTALL['0.3.0']}`")


@dataclass(frozen=True)
class Stack:
    """The versions a run trained with."""

    torchtitan: str
    torch: Optional[str]
    triton: Optional[str]

    @property
    def label(self) -> str:
        """``torchtitan 0.3.0, torch 2.13.0+cpu, triton 3.6.0``."""
        return ", ".join(f"{name} {getattr(self, name) or 'none'}" for name in ("torchtitan", "torch", "triton"))

    def to_dict(self) -> dict[str, Optional[str]]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Stack":
        return cls(**{name: values.get(name) for name in ("torchtitan", "torch", "triton")})

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> Optional["Stack"]:
        """The stack recorded in ``path`` (None when there is no such file or it is unreadable)."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError, AttributeError):
            return None


def installed() -> Stack:
    """This environment's stack (:class:`StackError` when its torchtitan is none the recipe runs)."""
    return Stack(torchtitan=installed_torchtitan(), torch=_version("torch"), triton=_version("triton"))


def family_problem(family: str, torchtitan: str) -> Optional[str]:
    """Why the recipe does not train the model family on this torchtitan release, naming the stack
    that does and this stack's tiny models (None when it trains it, or no stack does)."""
    families = FAMILIES_BY_STACK[torchtitan]
    others = [s for s in STACKS if family in FAMILIES_BY_STACK[s]]
    if family in families or not others:
        return None
    here = "here: " + ", ".join(f"model={TINY_MODEL[f]}" for f in families) + ", ..."
    name, other = FAMILY_NAMES[family], others[0]
    if family == "llama4":
        return (f"{name} is not in torchtitan {torchtitan} (removed upstream: \"deprecate llama4\"), which this "
                f"environment runs; {name} trains on the torchtitan {other} stack (`{INSTALL[other]}`); {here}")
    return (f"the recipe trains {name} on torchtitan {other} (`{INSTALL[other]}`), and this environment runs "
            f"torchtitan {torchtitan}; {here}")
