#!/usr/bin/env bash
# Install mxfp8-ep and its tested pins (pyproject.toml) into the current Python.
#   bash scripts/install.sh
# torch is installed first and pinned: 2.13.0. On a machine without a GPU you can take the
# small CPU build with TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu; an open range
# would pull a multi-GB CUDA build. An existing torch in 2.11–2.14 is kept (GPU images).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; v = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if (2, 11) <= v < (2, 15) else 1)" 2>/dev/null; then
  "$PY" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
