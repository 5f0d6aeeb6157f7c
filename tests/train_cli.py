"""Run `python launch/train.py` the way a user does, from a test: a subprocess with the
repository importable (what `pip install -e .` gives; PYTHONPATH here, so the checkout under
test is what runs) and wandb settings of the caller's environment left out."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.hydra_compose import REPO

TRAIN = REPO / "launch" / "train.py"


def train_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.pop("MXFP8EP_RUNNER", None)  # the real trainer
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, str(TRAIN), *args]


def run_train(cwd, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(*args), cwd=cwd, env=train_env(**env), capture_output=True,
                          text=True, timeout=timeout)
