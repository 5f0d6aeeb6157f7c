"""scripts/install.sh: one line per stage, the torch build it picks (read from ``--dry-run``,
which prints the pip commands instead of running them), and reruns that install nothing.

The Pythons are venvs made here, run through a wrapper that answers pip's look-up of the CPU
index as that index would (or as an unreachable one) and records ``pip install`` instead of
installing: nothing is downloaded and this machine's packages are not changed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from tests.hydra_compose import REPO

import torch

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
LISTED = "torch (2.13.0+cpu)\nAvailable versions: 2.13.0+cpu, 2.12.0+cpu"
WRAPPER = """#!/bin/bash
# pip's look-up of an index answers $ANSWER a line at a time, as pip writes it (none: fails as an
# unreachable index does); pip install is recorded in $LOG; everything else runs the real Python.
if [ "$1 $2" = "-m pip" ]; then
  case " $* " in
    *" index versions "*) echo "$*" >> "$LOG"
                          if [ -n "$ANSWER" ]; then
                            while IFS= read -r line; do echo "$line"; sleep 0.2; done <<< "$ANSWER"; exit 0
                          fi
                          echo "ERROR: No matching distribution found for torch" >&2; exit 1 ;;
    *" install "*) echo "$*" >> "$LOG"; exit 0 ;;
  esac
fi
exec "$REAL" "$@"
"""


def purelib(python: Path) -> Path:
    """Where ``python`` installs packages."""
    return Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())


def make_python(tmp_path: Path, name: str, torch_version: str | None) -> Path:
    """A wrapped venv Python (module docstring). ``torch_version`` None: no torch; "this": this
    environment's packages (torch, pip, mxfp8-ep) through a .pth file; else a stand-in torch
    package of that version."""
    venv = tmp_path / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = purelib(venv / "bin" / "python")
    if torch_version == "this":
        (site / "this-env.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    elif torch_version:
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text(f"__version__ = {torch_version!r}\n")
    wrapper = venv / "wrapped-python"
    wrapper.write_text(WRAPPER.replace("$REAL", str(venv / "bin" / "python")))
    wrapper.chmod(0o755)
    return wrapper


def install(tmp_path: Path, python: Path, *args: str, gpu: bool = False, answer: str | None = LISTED,
            script: Path = REPO / "scripts" / "install.sh", **env: str) -> tuple[list[str], list[str]]:
    """install.sh's lines and the pip commands it ran, with an nvidia-smi on PATH or none."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.unlink(missing_ok=True)
    if gpu:
        smi.write_text("#!/bin/sh\necho 81559\n")
        smi.chmod(0o755)
    log = tmp_path / "pip.log"
    log.unlink(missing_ok=True)
    env = {"PATH": os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"]), "HOME": str(tmp_path),
           "PYTHON": str(python), "LOG": str(log), "ANSWER": answer or "", **env}
    proc = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    return proc.stdout.splitlines(), log.read_text().splitlines() if log.exists() else []


@pytest.fixture(scope="module")
def this_python(tmp_path_factory) -> Path:
    return make_python(tmp_path_factory.mktemp("this"), "venv", "this")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    return make_python(tmp_path_factory.mktemp("bare"), "venv", None)


def test_one_line_per_stage_and_an_installed_torch_is_kept(tmp_path, this_python):
    lines, pip = install(tmp_path, this_python, "--dry-run")
    real = this_python.parent / "bin" / "python"
    version = subprocess.run([real, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                             text=True).stdout.strip()
    assert lines[0] == f"[install] 1/3 python: {real} {version}"
    assert lines[1] == (f"[install] 2/3 torch: {torch.__version__} is installed, in the tested "
                        f"range (2.11 to 2.15): kept")
    assert lines[2] == ("[install] 3/3 mxfp8-ep, torchtitan 0.2.2 and their pinned dependencies "
                        "(pip install -e '.[test,titan022]') ...")
    assert lines[3] == f"[install]   would run: {this_python} -m pip install -q -e .[test,titan022]"
    assert lines[4:] == ["[install] dry run: nothing was installed"]
    assert pip == []  # no look-up of an index for a torch that is kept


def test_without_a_gpu_the_cpu_build(tmp_path, bare_python):
    lines, pip = install(tmp_path, bare_python, "--dry-run")
    assert lines[1] == (f"[install] 2/3 torch: installing torch==2.13.0 from {CPU_INDEX} (no "
                        f"NVIDIA GPU found: the CPU build; TORCH_INDEX_URL=<index> to choose) ...")
    assert lines[2] == f"[install]   would run: {bare_python} -m pip install -q --index-url {CPU_INDEX} torch==2.13.0"
    # a CPU build brings no triton: the one tested with it comes with the package
    assert lines[4].endswith("-m pip install -q -e .[test,titan022] triton==3.6.0")
    # one look at the CPU index alone (no configured find-links or indexes answering for it), no retries
    (look,) = pip
    assert look == f"-m pip --isolated index versions torch --index-url {CPU_INDEX} --retries 0 --timeout 15"


def test_an_unreachable_cpu_index_is_said_and_pip_picks(tmp_path, bare_python):
    lines, _ = install(tmp_path, bare_python, "--dry-run", answer=None)
    assert lines[1] == (f"[install] 2/3 torch: installing torch==2.13.0 from PyPI (no NVIDIA GPU found, but "
                        f"{CPU_INDEX} did not answer: pip's configured indexes (PyPI's build is the CUDA one, "
                        f"which runs on CPU too); TORCH_INDEX_URL=<index> to choose) ...")
    assert lines[2] == f"[install]   would run: {bare_python} -m pip install -q torch==2.13.0"
    # an index that answers without the pinned CPU build counts as not answering
    lines, _ = install(tmp_path, bare_python, "--dry-run", answer="torch (2.12.0+cpu)")
    assert "did not answer" in lines[1]


def test_with_a_gpu_pypis_build_and_how_to_get_the_measured_one(tmp_path, bare_python):
    lines, pip = install(tmp_path, bare_python, "--dry-run", gpu=True)
    assert lines[1] == ("[install] 2/3 torch: installing torch==2.13.0 from PyPI (an NVIDIA GPU was "
                        "found: PyPI's CUDA build) ...")
    assert lines[2:5] == [
        "[install]   the GPU results were measured on torch 2.11.0+cu130: for that build, first run",
        "  pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130",
        "  (a torch in the tested range that is already installed is kept)"]
    assert lines[5] == f"[install]   would run: {bare_python} -m pip install -q torch==2.13.0"
    assert pip == []


def test_torch_index_url_wins_and_an_old_torch_is_replaced(tmp_path):
    old = make_python(tmp_path, "old", "2.9.1+cu128")
    index = "https://download.pytorch.org/whl/cu130"
    lines, _ = install(tmp_path, old, "--dry-run", TORCH_INDEX_URL=index)
    assert lines[1] == (f"[install] 2/3 torch: installing torch==2.13.0 from {index} "
                        f"(TORCH_INDEX_URL) (replacing 2.9.1+cu128, outside 2.11 to 2.15) ...")
    assert lines[2].endswith(f"pip install -q --index-url {index} torch==2.13.0")
    lines, _ = install(tmp_path, old, "--dry-run", TORCH_INDEX_URL="")  # PyPI, by choice
    assert lines[2].endswith("-m pip install -q torch==2.13.0")


def test_a_rerun_installs_nothing_until_the_pins_or_the_packages_change(tmp_path, this_python):
    """A copy of the scripts and pyproject.toml, so the pins can change without touching the checkout."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for path in ("scripts/install.sh", "scripts/torch_index.sh", "pyproject.toml"):
        shutil.copy(REPO / path, tree / path)
    script = tree / "scripts" / "install.sh"
    lines, pip = install(tmp_path, this_python, script=script)
    assert pip == ["-m pip install -q -e .[test,titan022]"] and lines[-1].startswith("[install] done in ")
    lines, pip = install(tmp_path, this_python, script=script)
    assert pip == [] and lines[2] == ("[install] 3/3 mxfp8-ep, torchtitan 0.2.2 and their pinned dependencies: "
                                      "installed, unchanged since the last install (pyproject.toml, packages): kept")
    (tree / "pyproject.toml").write_text((tree / "pyproject.toml").read_text().replace("pytest==", "pytest>="))
    assert install(tmp_path, this_python, script=script)[1] == ["-m pip install -q -e .[test,titan022]"]
    assert install(tmp_path, this_python, script=script)[1] == []
    # the other stack is another install
    assert install(tmp_path, this_python, "--torchtitan", "0.3.0", script=script)[1] == [
        "-m pip install -q -e .[test,titan030]"]
    site = purelib(this_python)
    (site / "extra-0.1.dist-info").mkdir()  # a package installed by hand since
    (site / "extra-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: extra\nVersion: 0.1\n")
    assert install(tmp_path, this_python, script=script)[1] == ["-m pip install -q -e .[test,titan022]"]


def test_torchtitan_030_installs_its_stack(tmp_path, this_python, bare_python):
    """--torchtitan 0.3.0: the titan030 extra, torch in 0.3.0's tested range (2.13 to 2.15; an
    older one is replaced), and a closing line that names a model 0.3.0 trains."""
    lines, _ = install(tmp_path, this_python, "--dry-run", "--torchtitan", "0.3.0")
    assert lines[1] == (f"[install] 2/3 torch: {torch.__version__} is installed, in the tested "
                        f"range (2.13 to 2.15): kept")
    assert lines[2] == ("[install] 3/3 mxfp8-ep, torchtitan 0.3.0 and their pinned dependencies "
                        "(pip install -e '.[test,titan030]') ...")
    assert lines[3] == f"[install]   would run: {this_python} -m pip install -q -e .[test,titan030]"
    lines, _ = install(tmp_path, bare_python, "--dry-run", "--torchtitan", "0.3.0")
    assert lines[4].endswith("pip install -q -e .[test,titan030] triton==3.6.0")
    old = make_python(tmp_path, "old", "2.12.1")  # in 0.2.2's range, not in 0.3.0's
    lines, _ = install(tmp_path, old, "--dry-run", "--torchtitan", "0.3.0")
    assert "(replacing 2.12.1, outside 2.13 to 2.15)" in lines[1]


@pytest.mark.parametrize("args", [("--torchtitan", "0.4.0"), ("--torchtitan",), ("--titan",)])
def test_a_stack_it_does_not_know_is_refused(tmp_path, args):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), "--dry-run", *args], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().endswith("usage: bash scripts/install.sh [--torchtitan 0.2.2|0.3.0] [--dry-run]")
