#!/usr/bin/env bash
# The Triton kernel tests under the newest triton pyproject.toml allows (triton<3.10: 3.9.0),
# beside this environment's torch and pytest (scripts/test.sh runs it after the suite, which runs
# the installed triton):
#   bash scripts/test_triton_newest.sh [pytest arguments]
#
# triton==$TRITON_NEWEST goes, without dependencies, into the folder $DIR (named .venv* so that
# git and the image builds leave it out; about 1 GB; TRITON_NEWEST_DIR picks another), once: a
# rerun finds it and installs nothing. PYTHONPATH puts it before the environment's own triton.
# PYTHON picks the Python (default python3), as for install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TRITON_NEWEST=3.9.0
DIR=${TRITON_NEWEST_DIR:-.venv-triton-newest/$TRITON_NEWEST}
# The kernels (symm transport, MXFP8 quantizer, grouped experts, routing checks) and their tests.
KERNEL_TESTS=(tests/test_symm_kernels.py tests/test_triton_kernels.py tests/test_dispatch_checks.py
              tests/test_grouped_experts.py)

if [ ! -f "$DIR/.installed" ]; then
  echo "[triton-newest] installing triton==$TRITON_NEWEST into $DIR ..."
  rm -rf "$DIR"
  "$PY" -m pip install -q --no-deps --target "$DIR" "triton==$TRITON_NEWEST"
  touch "$DIR/.installed"
fi
export PYTHONPATH="$DIR${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - "$TRITON_NEWEST" <<'PYEOF'
import sys
import triton
if triton.__version__ != sys.argv[1]:
    sys.exit(f"[triton-newest] imported triton {triton.__version__} from {triton.__file__}, not {sys.argv[1]}")
print(f"[triton-newest] triton {triton.__version__} ({triton.__file__})")
PYEOF
"$PY" -m pytest "${KERNEL_TESTS[@]}" "$@"
