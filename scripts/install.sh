#!/usr/bin/env bash
# Install mxfp8-ep and its tested pins (pyproject.toml) into the current Python, one line per
# stage:
#   bash scripts/install.sh            # then: python launch/train.py
#   bash scripts/install.sh --dry-run  # print what it would install, change nothing
#
# torch comes first, pinned (2.13.0), from the index that fits this machine: without an NVIDIA
# GPU (no nvidia-smi, no /dev/nvidia*) the small CPU build from
# https://download.pytorch.org/whl/cpu, with one PyPI's default (CUDA) build. TORCH_INDEX_URL
# overrides the choice (set it empty for PyPI). A torch already installed in the tested range
# (2.11 to 2.14, e.g. a GPU image's) is kept. Environment: PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_PIN="2.13.0"
TORCH_RANGE="2.11 to 2.14"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
PY=${PYTHON:-python3}
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "usage: bash scripts/install.sh [--dry-run]" >&2; exit 2 ;;
  esac
done

START=$SECONDS
say() { echo "[install] $*"; }
run() {  # the command, or only its line with --dry-run
  if [ "$DRY_RUN" = 1 ]; then echo "[install]   would run: $*"; else "$@"; fi
}

has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && return 0
  compgen -G "/dev/nvidia[0-9]*" >/dev/null 2>&1
}

# The index torch comes from: "" is PyPI; the reason goes into the progress line.
torch_index() {
  if [ -n "${TORCH_INDEX_URL+set}" ]; then
    echo "${TORCH_INDEX_URL}|TORCH_INDEX_URL"
  elif has_nvidia_gpu; then
    echo "|an NVIDIA GPU was found: PyPI's CUDA build"
  else
    echo "${CPU_INDEX}|no NVIDIA GPU found: the CPU build; TORCH_INDEX_URL=<index> to choose"
  fi
}

say "1/3 python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

installed=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [ -n "$installed" ] && "$PY" - "$installed" <<'EOF'
import sys
major, minor = (int(p) for p in sys.argv[1].split("+")[0].split(".")[:2])
sys.exit(0 if (2, 11) <= (major, minor) < (2, 15) else 1)
EOF
then
  say "2/3 torch: $installed is installed, in the tested range ($TORCH_RANGE): kept"
else
  IFS="|" read -r index why <<<"$(torch_index)"
  from=${index:-PyPI}
  now=${installed:+ (replacing $installed, outside $TORCH_RANGE)}
  say "2/3 torch: installing torch==$TORCH_PIN from $from ($why)$now ..."
  run "$PY" -m pip install -q ${index:+--index-url "$index"} "torch==$TORCH_PIN"
fi

say "3/3 mxfp8-ep and its pinned dependencies (pip install -e '.[test]') ..."
run "$PY" -m pip install -q -e ".[test]"
if [ "$DRY_RUN" = 1 ]; then
  say "dry run: nothing was installed"
else
  "$PY" -c "import mxfp8_ep, launch.train" >/dev/null
  say "done in $((SECONDS - START)) s; train the default tiny MoE with: python launch/train.py"
fi
