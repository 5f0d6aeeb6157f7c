"""benchmarks/run.sh: its suites and usage errors, the commit it needs where there is no git, a
failing step failing the suite, and a suite run end to end on CPU (one process, tiny shape)
whose rows record the command that made them."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.needs_git import git_checkout

REPO = Path(__file__).resolve().parents[1]
SUITES = {"layer", "layer_rank", "legs", "links", "train", "train_shm", "train_debug", "step_profile", "kernels",
          "profile", "power", "titan030", "capacity_1gpu", "checkpoint_1gpu", "memory_1gpu", "tests_1gpu",
          "tests_1gpu_fuzz", "tests_2gpu", "numerics", "internode_bytes"}


# run.sh calls `python3`: this Python's, also when its venv is not activated.
PATH = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"


def run_sh(*args, cwd=REPO, **env):
    """run.sh in ``cwd``, with no $MXFP8EP_COMMIT but one in ``env`` (the test image sets one)."""
    base = {k: v for k, v in os.environ.items() if k != "MXFP8EP_COMMIT"}
    return subprocess.run(["bash", str(Path(cwd) / "benchmarks/run.sh"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={**base, "PATH": PATH, **env})


def test_usage_lists_every_suite_and_unknown_suites_fail():
    proc = run_sh()
    assert proc.returncode == 2 and proc.stderr.startswith("usage: bash benchmarks/run.sh SUITE OUT")
    listed = {line.split()[0] for line in proc.stderr.splitlines()[2:]}
    assert listed == SUITES
    one_gpu = {"layer_rank", "kernels", "capacity_1gpu", "checkpoint_1gpu", "memory_1gpu", "tests_1gpu",
               "tests_1gpu_fuzz", "numerics"}
    assert all(("1 GPU" in line) == (line.split()[0] in one_gpu) for line in proc.stderr.splitlines()[2:])
    proc = run_sh("gpu_everything", "/tmp/unused")
    assert proc.returncode == 2 and "unknown suite 'gpu_everything'" in proc.stderr
    assert run_sh("layer").returncode == 2


def test_a_copied_tree_without_git_needs_the_commit(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(REPO / "benchmarks/run.sh", tmp_path / "benchmarks/run.sh")
    proc = run_sh("layer", str(tmp_path / "out"), cwd=tmp_path, GIT_CEILING_DIRECTORIES=str(tmp_path.parent))
    assert proc.returncode == 2 and "set MXFP8EP_COMMIT" in proc.stderr
    assert not (tmp_path / "out").exists()


@git_checkout
def test_a_failing_step_fails_the_suite(tmp_path):
    proc = run_sh("layer_rank", str(tmp_path), BENCH_ARGS="--no-such-option")
    assert proc.returncode != 0 and "unrecognized arguments: --no-such-option" in proc.stdout
    assert "layer_rank done" not in proc.stdout
    assert not list(tmp_path.glob("*.jsonl"))


@git_checkout
def test_a_suite_writes_rows_that_name_their_command(tmp_path):
    small = "--shapes tiny --arms bf16/symm --iters 1 --warmup 0 --group 1 --rounds 1"  # BENCH_ARGS come last
    proc = run_sh("layer_rank", str(tmp_path), BENCH_ARGS=small)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*_cpux1_layer.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["arm"], r["pass"], r["shape"]) for r in rows] == [
        (arm, p, "tiny") for arm in ("torchtitan", "bf16/symm") for p in ("fwd", "fwd+bwd")]
    command = rows[0]["command"]
    assert command.startswith("torchrun --nproc_per_node=1 -m benchmarks.layer --out ")
    assert command.endswith("--shapes dsv3_rank --arms torchtitan,bf16/symm,mxfp8/symm,mxfp8_all/symm " + small)
    assert all(r["command"] == command for r in rows)
    log = (tmp_path / "layer_rank.log").read_text()
    assert "+ " + command in log and "layer_rank done" in log


FAKE_TRAIN = '''
import subprocess, sys
from benchmarks import train
from launch.run.run_summary import RunSummary

def launch_run(overrides, run_dir):  # no training: a summary as launch/train.py leaves one
    run_dir.mkdir(parents=True)
    every = int(overrides[-1].removeprefix("logging.numerics_every="))
    RunSummary(run_name=run_dir.name, experiment="e", a2a="mxfp8_all", a2a_legs={}, model="m", model_flavor="f",
               parallelism="single", world_size=1, ep=1, launcher="local", device="cpu", run_dir=str(run_dir),
               steps=6, target_steps=6, step_time_s=0.1 + every / 1000, tokens_per_s=1.0).write(run_dir)
    print("launched", " ".join(overrides))
    return subprocess.CompletedProcess(overrides, 0, "", "")

train.launch_run = launch_run
train.main(sys.argv[1:])
'''


@git_checkout
def test_the_numerics_suite_writes_its_rows_through_benchmarks_train(tmp_path):
    """The suite's own command line, its recipe runs stood in for (a ``python3`` on PATH that
    runs ``benchmarks.train`` with ``launch_run`` faked)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "fake_train.py").write_text(FAKE_TRAIN)
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/bash\nif [ "$1 $2" = "-m benchmarks.train" ]; then shift 2; '
                       f'exec {sys.executable} {tmp_path / "fake_train.py"} "$@"; fi\n'
                       f'exec {sys.executable} "$@"\n')
    python3.chmod(0o755)
    out = tmp_path / "out"
    proc = run_sh("numerics", str(out), PATH=f"{bin_dir}:{PATH}", STEPS="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("*_numerics_overhead.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["arm"], r["numerics_every"]) for r in rows] == [("off", 0), ("on", 50), ("off", 0), ("on", 50),
                                                               ("on_vs_off", 50)]
    assert rows[-1]["overhead_pct"] > 0 and "training.steps=6" in rows[-1]["overrides"]
    assert all(r["command"].startswith("python3 -m benchmarks.train --numerics-every 50 --repeats 2 --out ")
               for r in rows)
    assert "launched model=dsv3_debugmodel" in (out / "numerics.log").read_text()


@git_checkout
def test_the_internode_bytes_suite_runs_on_cpu_and_its_rows_name_their_command(tmp_path):
    proc = run_sh("internode_bytes", str(tmp_path), BENCH_ARGS="--tokens 512 --layers 1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*_cpux1_internode_bytes.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["arm"] for r in rows} == {"flat_bf16", "flat_mxfp8", "flat_mxfp8_all", "dedup_bf16", "dedup_mxfp8",
                                        "dedup_mxfp8_all"}
    assert all(r["command"] == f"python3 -m benchmarks.internode_bytes --out {tmp_path} --tokens 512 --layers 1"
               for r in rows)
