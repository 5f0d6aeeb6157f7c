#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this): install, lint (ruff), then
# run the suite on the CPU: gloo process groups for every collective path, Triton kernels under
# the Triton interpreter, and a local SLURM cluster that the SLURM tests start themselves
# (root + apt).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check .  # the lint rules: pyproject.toml [tool.ruff]
python3 -m pytest -q --durations=15 tests  # the slowest tests, to keep the suite near 15 minutes
bash scripts/setup_titan030.sh && .venv-titan030/bin/python -m pytest -q tests/titan030  # torchtitan 0.3.0 env
