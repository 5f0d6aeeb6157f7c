"""`python launch/train.py` end to end on CPU: 2 gloo worker processes started by torch's
elastic launcher, the real torchtitan trainer (tiny Llama4 MoE, EP 2), offline wandb read back.

About 2 minutes on 2 cores: three launches (bf16, mxfp8, a 2-point sweep) of 4-6 steps each.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.hydra_compose import REPO

from launch.compare_runs import main as compare_main
from launch.wandb_offline import find_runs, read_run

TRAIN = REPO / "launch" / "train.py"
LOSS = "loss_metrics/global_avg_loss"
BYTES = "a2a/bytes_per_step"


def train(tmp: Path, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.pop("MXFP8EP_RUNNER", None)  # the real trainer
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *overrides], cwd=tmp, env=env,
        capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def check_run(run_dir: Path, steps: int, a2a: str) -> dict:
    """summary.json and the offline wandb run agree and look like training."""
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["a2a"] == a2a and s["model"] == "tiny_llama4" and s["world_size"] == 2 and s["ep"] == 2
    m = s["metrics"]
    assert m["steps"] == steps
    losses = s["result"]["losses"]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
    assert m["final_loss"] == pytest.approx(losses[-1])
    assert m["tokens_per_s"] > 0 and m["step_time_s"] > 0 and m["a2a_bytes_per_step"] > 0

    # the offline wandb run, read back from its .wandb file
    assert len(s["wandb_dirs"]) == 1 and find_runs(str(run_dir)) == s["wandb_dirs"]
    run = read_run(s["wandb_dirs"][0])
    assert run.name == s["run_name"] and f"a2a={a2a}" in run.name
    assert run.group == "default" and run.project == "mxfp8-ep"
    assert run.config["recipe"]["a2a"]["name"] == a2a
    assert [row["_step"] for row in run.history] == list(range(1, steps + 1))
    wandb_losses = run.series(LOSS)
    assert wandb_losses == pytest.approx(losses)
    assert all(b > 0 for b in run.series(BYTES))
    assert run.exit_code == 0
    return s


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("bf16")
    proc = train(tmp, "training.steps=6", f"hydra.run.dir={tmp / 'run'}")
    return tmp / "run", proc


def test_default_run(bf16_run):
    run_dir, proc = bf16_run
    s = check_run(run_dir, steps=6, a2a="bf16")
    assert s["launcher"] == "local" and s["wandb_mode"] == "offline"
    # the final summary printed by the launcher
    out = proc.stdout
    assert "==== mxfp8ep run a2a=bf16,training.steps=6 ====" in out
    for text in ("final loss", "tokens/s", str(run_dir), s["wandb_dirs"][0], "wandb sync"):
        assert text in out
    # the per-rank logs of the elastic launcher, and the config the workers got
    assert list((run_dir / "worker_logs").rglob("stdout.log"))
    assert (run_dir / "train_config.yaml").is_file()


def test_mxfp8_run(tmp_path, bf16_run):
    train(tmp_path, "a2a=mxfp8", "training.steps=6", f"hydra.run.dir={tmp_path / 'run'}")
    s = check_run(tmp_path / "run", steps=6, a2a="mxfp8")
    bf16 = json.loads((bf16_run[0] / "summary.json").read_text())
    # two of four legs at ~1.03 instead of 2 bytes per element: ~0.76 of bf16's bytes
    ratio = s["metrics"]["a2a_bytes_per_step"] / bf16["metrics"]["a2a_bytes_per_step"]
    assert 0.6 < ratio < 0.9, ratio
    # same data and init: the losses stay close
    assert s["metrics"]["final_loss"] == pytest.approx(bf16["metrics"]["final_loss"], abs=0.1)


def test_multirun_sweep_and_compare(tmp_path):
    sweep = tmp_path / "sweep"
    proc = train(tmp_path, "--multirun", "a2a=bf16,mxfp8", "training.steps=4",
                 f"hydra.sweep.dir={sweep}")
    assert "Launching 2 jobs locally" in proc.stdout + proc.stderr
    runs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in runs] == ["0_a2a=bf16,training.steps=4", "1_a2a=mxfp8,training.steps=4"]
    check_run(runs[0], steps=4, a2a="bf16")
    check_run(runs[1], steps=4, a2a="mxfp8")

    out = tmp_path / "cmp.json"
    assert compare_main([str(sweep), "--out", str(out)]) == 0
    cmp = json.loads(out.read_text())
    by_a2a = {r["a2a"]: r for r in cmp["runs"]}
    assert set(by_a2a) == {"bf16", "mxfp8"}
    assert by_a2a["mxfp8"]["vs_baseline"]["baseline"] == by_a2a["bf16"]["name"]
    assert by_a2a["mxfp8"]["vs_baseline"]["bytes_ratio"] < 0.9
    assert all(r["source"] == "summary" for r in cmp["runs"])

    # the same comparison from the offline wandb runs alone
    for p in runs:
        (p / "summary.json").unlink()
    assert compare_main([str(sweep), "--out", str(out)]) == 0
    cmp = json.loads(out.read_text())
    assert sorted(r["a2a"] for r in cmp["runs"]) == ["bf16", "mxfp8"]
    assert all(r["source"] == "wandb" for r in cmp["runs"])
    assert all(r["metrics"]["final_loss"] is not None for r in cmp["runs"])
