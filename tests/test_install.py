"""scripts/install.sh: one line per stage, and the torch build it picks, read from
``--dry-run`` (which prints the pip commands instead of running them; nothing is downloaded).

Pythons without torch (or with an old one) are venvs made here, so the choice is tested without
changing this machine's packages."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.hydra_compose import REPO

SCRIPT = REPO / "scripts" / "install.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
HAS_GPU = bool(shutil.which("nvidia-smi") or glob.glob("/dev/nvidia[0-9]*"))


def dry_run(tmp_path: Path, python: str, gpu: bool, *args: str, **env: str) -> list[str]:
    """install.sh --dry-run's lines (``args``: its further arguments), with an nvidia-smi on PATH or none."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    if gpu:
        smi.write_text("#!/bin/sh\necho 81559\n")
        smi.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])
    env = {"PATH": path, "HOME": str(tmp_path), "PYTHON": python, **env}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return proc.stdout.splitlines()


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A Python without torch."""
    venv = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return str(venv / "bin" / "python")


@pytest.fixture(scope="module")
def old_torch_python(tmp_path_factory) -> str:
    """A Python whose torch is older than the tested range (a stand-in package)."""
    venv = tmp_path_factory.mktemp("old")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("__version__ = '2.9.1+cu128'\n")
    return str(venv / "bin" / "python")


def test_one_line_per_stage_and_an_installed_torch_is_kept(tmp_path):
    import torch

    lines = dry_run(tmp_path, sys.executable, gpu=False)
    assert lines[0] == f"[install] 1/3 python: {sys.executable} {sys.version.split()[0]}"
    assert lines[1] == (f"[install] 2/3 torch: {torch.__version__} is installed, in the tested "
                        f"range (2.11 to 2.15): kept")
    assert lines[2] == ("[install] 3/3 mxfp8-ep, torchtitan 0.2.2 and their pinned dependencies "
                        "(pip install -e '.[test,titan022]') ...")
    assert lines[3] == f"[install]   would run: {sys.executable} -m pip install -q -e .[test,titan022]"
    assert lines[4:] == ["[install] dry run: nothing was installed"]


@pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU: the CPU choice cannot be seen")
def test_without_a_gpu_the_cpu_build(tmp_path, bare_python):
    lines = dry_run(tmp_path, bare_python, gpu=False)
    assert lines[1] == (f"[install] 2/3 torch: installing torch==2.13.0 from {CPU_INDEX} (no "
                        f"NVIDIA GPU found: the CPU build; TORCH_INDEX_URL=<index> to choose) ...")
    assert lines[2] == (f"[install]   would run: {bare_python} -m pip install -q --index-url "
                        f"{CPU_INDEX} torch==2.13.0")
    # a CPU build brings no triton: the one tested with it comes with the package
    assert lines[4].endswith("-m pip install -q -e .[test,titan022] triton==3.6.0")


def test_with_a_gpu_pypis_build(tmp_path, bare_python):
    lines = dry_run(tmp_path, bare_python, gpu=True)
    assert lines[1] == ("[install] 2/3 torch: installing torch==2.13.0 from PyPI (an NVIDIA GPU was "
                        "found: PyPI's CUDA build) ...")
    assert lines[2] == f"[install]   would run: {bare_python} -m pip install -q torch==2.13.0"


def test_torch_index_url_wins_and_an_old_torch_is_replaced(tmp_path, old_torch_python):
    index = "https://download.pytorch.org/whl/cu130"
    lines = dry_run(tmp_path, old_torch_python, gpu=False, TORCH_INDEX_URL=index)
    assert lines[1] == (f"[install] 2/3 torch: installing torch==2.13.0 from {index} "
                        f"(TORCH_INDEX_URL) (replacing 2.9.1+cu128, outside 2.11 to 2.15) ...")
    assert lines[2].endswith(f"pip install -q --index-url {index} torch==2.13.0")
    lines = dry_run(tmp_path, old_torch_python, gpu=False, TORCH_INDEX_URL="")  # PyPI, by choice
    assert lines[2].endswith("-m pip install -q torch==2.13.0")


def test_torchtitan_030_installs_its_stack(tmp_path, bare_python):
    """--torchtitan 0.3.0: the titan030 extra, torch in 0.3.0's tested range (2.13 to 2.15; an
    older one is replaced), and a closing line that names a model 0.3.0 trains."""
    import torch

    lines = dry_run(tmp_path, sys.executable, False, "--torchtitan", "0.3.0")
    assert lines[1] == (f"[install] 2/3 torch: {torch.__version__} is installed, in the tested "
                        f"range (2.13 to 2.15): kept")
    assert lines[2] == ("[install] 3/3 mxfp8-ep, torchtitan 0.3.0 and their pinned dependencies "
                        "(pip install -e '.[test,titan030]') ...")
    assert lines[3] == f"[install]   would run: {sys.executable} -m pip install -q -e .[test,titan030]"
    lines = dry_run(tmp_path, bare_python, False, "--torchtitan", "0.3.0")
    assert lines[4].endswith("pip install -q -e .[test,titan030] triton==3.6.0")


@pytest.mark.parametrize("args", [("--torchtitan", "0.4.0"), ("--torchtitan",), ("--titan",)])
def test_a_stack_it_does_not_know_is_refused(tmp_path, args):
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().endswith("usage: bash scripts/install.sh [--torchtitan 0.2.2|0.3.0] [--dry-run]")
