"""`python launch/train.py launcher=slurm` on torchtitan 0.3.0: a job on the local SLURM cluster
(2 fake nodes, one gloo process each, EP 2 across them), tiny DeepSeek-V3 with the MXFP8 legs;
the job's workers run 0.3.0's trainer and the run records that stack. The cluster and the
helpers are tests/slurm's (conftest.py)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

from tests.slurm.test_train_slurm import SLURM_CPU  # noqa: E402

from launch.config.stack import installed  # noqa: E402
from launch.run.run_summary import RunSummary  # noqa: E402

pytestmark = pytest.mark.slurm


def test_a_slurm_job_trains_on_torchtitan_030(train, tmp_path):
    run_dir = tmp_path / "run"
    proc, out = train([*SLURM_CPU, "parallelism.procs_per_node=1", "model=tiny_dsv3", "a2a=mxfp8",
                       "training.steps=4", "launcher.wait=true", "logging=wandb_offline", f"hydra.run.dir={run_dir}"],
                      timeout=300)
    assert proc.returncode == 0, out[-4000:]
    (jid,) = train.jobs
    assert f"SLURM job {jid} COMPLETED" in out
    s = RunSummary.read(run_dir)
    assert s.launcher == "slurm" and s.world_size == 2 and s.ep == 2 and s.steps == 4
    assert all(math.isfinite(x) for x in s.losses) and s.a2a_bytes_per_step_by_leg["dispatch_fwd"] > 0
    assert s.stack == installed().to_dict() and s.stack["torchtitan"] == "0.3.0"
    assert f"  stack           {installed().label}" in out
