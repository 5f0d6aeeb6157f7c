"""Test-only trainer wrapper for tests/slurm/test_train_slurm.py, plugged in through the
worker's existing debug hook ``MXFP8EP_RUNNER=slurm_fault_runner:run_training`` (this folder
on ``PYTHONPATH``, which sbatch passes on to the job). Runs the real
``launch.titan.runner.run_training``, optionally with faults:

  MXFP8EP_TEST_CRASH_RANK=1 MXFP8EP_TEST_CRASH_STEP=3   that rank dies (os._exit(3), no
                                                          Python cleanup) before step 3
  MXFP8EP_TEST_STEP_SLEEP=0.5                           every rank sleeps this long per step
                                                          (room to preempt a tiny run mid-way)

``MXFP8EP_RUNNER=slurm_fault_runner:raise_on_rank`` trains nothing: the rank named by
``MXFP8EP_TEST_CRASH_RANK`` (default 0) raises a Python exception, the others return.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def run_training(cfg: Any, run_dir: str) -> Any:
    from torchtitan.train import Trainer

    from launch.titan import runner as titan_runner

    rank = int(os.environ.get("RANK", "0"))
    crash_rank = int(os.environ.get("MXFP8EP_TEST_CRASH_RANK", "-1"))
    crash_step = int(os.environ.get("MXFP8EP_TEST_CRASH_STEP", "1"))
    step_sleep = float(os.environ.get("MXFP8EP_TEST_STEP_SLEEP", "0"))

    if rank == crash_rank:
        recipe_step = titan_runner.RecipeTrainer.train_step

        def crash_first(self: Any, *args: Any, **kwargs: Any) -> Any:
            # torchtitan increments self.step before calling train_step
            if self.step >= crash_step:
                print(f"[fault-runner] rank {rank}: injected crash at step {self.step}", flush=True)
                print(f"[fault-runner] rank {rank}: injected crash", file=sys.stderr, flush=True)
                os._exit(3)
            return recipe_step(self, *args, **kwargs)

        titan_runner.RecipeTrainer.train_step = crash_first
    if step_sleep > 0:
        titan_step = Trainer.train_step

        def slow(self: Any, *args: Any, **kwargs: Any) -> Any:  # part of the step, as a slow one
            time.sleep(step_sleep)
            return titan_step(self, *args, **kwargs)

        Trainer.train_step = slow

    return titan_runner.run_training(cfg, run_dir)


def raise_on_rank(cfg: Any, run_dir: str) -> Any:  # noqa: ARG001 (run_training's signature)
    """A worker whose Python code fails: its exception reaches torch elastic's error file."""
    if int(os.environ.get("RANK", "0")) == int(os.environ.get("MXFP8EP_TEST_CRASH_RANK", "0")):
        raise ValueError("injected failure")
