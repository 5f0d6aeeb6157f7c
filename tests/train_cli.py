"""Run `python launch/train.py` the way a user does, from a test: a subprocess with the
repository importable (what `pip install -e .` gives; PYTHONPATH here, so the checkout under
test is what runs) and wandb settings of the caller's environment left out."""

from __future__ import annotations

import os
import signal
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


def run_side_by_side(cwd, first: tuple[str, ...], second: tuple[str, ...], timeout: float = 300):
    """Two trainings at once (``first``'s arguments and ``second``'s), each checked to have
    exited 0 with its output's tail in the message; returns both ``CompletedProcess``es."""
    background = subprocess.Popen(train_cmd(*first), cwd=cwd, env=train_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        foreground = run_train(cwd, *second, timeout=timeout)
        out, err = background.communicate(timeout=timeout)
    finally:
        if background.poll() is None:
            os.killpg(background.pid, signal.SIGKILL)
    done = subprocess.CompletedProcess(background.args, background.returncode, out, err)
    for proc in (done, foreground):
        assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return done, foreground
