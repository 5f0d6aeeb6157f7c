#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this): install, lint (ruff), then
# run the suite on the CPU: gloo process groups for every collective path, Triton kernels under
# the Triton interpreter, and a local SLURM cluster that the SLURM tests start themselves
# (root + apt); then the Triton kernel tests under the newest triton the pins allow
# (test_triton_newest.sh) and tests/titan030 in the torchtitan 0.3.0 venv. pytest prints one
# line per test file. PYTHON picks the Python (default python3), as for install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}
START=$SECONDS
stage() { echo "[test] $1 (at $((SECONDS - START)) s)"; }

stage "1/5 install"
bash scripts/install.sh
stage "2/5 lint: ruff check ."
"$PYTHON" -m ruff check .  # the lint rules: pyproject.toml [tool.ruff]
stage "3/5 the suite: pytest tests"
"$PYTHON" -m pytest --durations=15 tests  # the slowest tests, to keep this stage under 20 minutes
stage "4/5 the Triton kernel tests under the newest triton allowed: scripts/test_triton_newest.sh"
bash scripts/test_triton_newest.sh
stage "5/5 torchtitan 0.3.0 env: pytest tests/titan030"
bash scripts/setup_titan030.sh && .venv-titan030/bin/python -m pytest tests/titan030
stage "done"
