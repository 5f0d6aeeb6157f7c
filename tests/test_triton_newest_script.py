"""scripts/test_triton_newest.sh: the kernel tests under the newest triton the pins allow, installed
once into its own folder, which shadows the environment's triton. Run through a wrapper Python
whose ``pip install --target`` writes a stand-in triton package of the version asked for (or of
$VERSION) and whose ``pytest`` is recorded: nothing is downloaded and no test runs twice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.hydra_compose import REPO

SCRIPT = REPO / "scripts" / "test_triton_newest.sh"
KERNEL_TESTS = ["tests/test_symm_kernels.py", "tests/test_triton_kernels.py", "tests/test_dispatch_checks.py",
                "tests/test_grouped_experts.py"]
WRAPPER = """#!/bin/bash
# pip install --target DIR triton==V: a stand-in triton V (or $VERSION) in DIR; pytest: recorded.
if [ "$1 $2 $3" = "-m pip install" ]; then
  echo "$*" >> "$LOG"
  args=("$@"); for i in "${!args[@]}"; do [ "${args[$i]}" = --target ] && dir=${args[$((i + 1))]}; done
  mkdir -p "$dir/triton"
  spec=${!#}
  echo "__version__ = '${VERSION:-${spec#triton==}}'" > "$dir/triton/__init__.py"
  exit 0
fi
if [ "$1 $2" = "-m pytest" ]; then echo "$*" >> "$LOG"; exit 0; fi
exec "$REAL" "$@"
"""


def run_script(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    python = tmp_path / "python"
    python.write_text(WRAPPER)
    python.chmod(0o755)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(python), "REAL": sys.executable,
                               "LOG": str(log), "TRITON_NEWEST_DIR": str(tmp_path / "triton"), **env})
    return proc, log.read_text().splitlines() if log.exists() else []


def test_installs_once_and_runs_the_kernel_tests_under_it(tmp_path):
    folder = tmp_path / "triton"
    proc, calls = run_script(tmp_path, "-x")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [f"[triton-newest] installing triton==3.9.0 into {folder} ...",
                                        f"[triton-newest] triton 3.9.0 ({folder}/triton/__init__.py)"]
    assert calls == [f"-m pip install -q --no-deps --target {folder} triton==3.9.0",
                     " ".join(["-m pytest", *KERNEL_TESTS, "-x"])]
    # a rerun finds the folder: nothing installed
    proc, calls = run_script(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [f"[triton-newest] triton 3.9.0 ({folder}/triton/__init__.py)"]
    assert calls == [" ".join(["-m pytest", *KERNEL_TESTS])]


def test_another_triton_imported_stops_before_the_tests(tmp_path):
    proc, calls = run_script(tmp_path, VERSION="3.6.0")
    assert proc.returncode != 0
    assert f"imported triton 3.6.0 from {tmp_path}/triton/triton/__init__.py, not 3.9.0" in proc.stderr
    assert not any(" pytest " in f" {c} " for c in calls)
