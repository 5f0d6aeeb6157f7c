#!/usr/bin/env bash
# Install mxfp8-ep and its tested pins (pyproject.toml) into the current Python, one line per
# stage:
#   bash scripts/install.sh                       # then: python launch/train.py
#   bash scripts/install.sh --torchtitan 0.3.0    # the torchtitan 0.3.0 stack instead of 0.2.2
#   bash scripts/install.sh --dry-run             # print what it would install, change nothing
#
# torch comes first, pinned (2.13.0), from the index that fits this machine: without an NVIDIA
# GPU (no nvidia-smi, no /dev/nvidia*) the small CPU build from
# https://download.pytorch.org/whl/cpu, with one PyPI's default (CUDA) build. TORCH_INDEX_URL
# overrides the choice (set it empty for PyPI). A torch already installed in the stack's tested
# range (e.g. a GPU image's) is kept. With a CPU build (no triton of its own), triton comes pinned
# too. Environment: PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_PIN="2.13.0"
TRITON_PIN="3.6.0"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
PY=${PYTHON:-python3}
DRY_RUN=0
TITAN=0.2.2
USAGE="usage: bash scripts/install.sh [--torchtitan 0.2.2|0.3.0] [--dry-run]"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --torchtitan) TITAN=${2:-}; shift $(( $# > 1 )) ;;
    *) echo "$USAGE" >&2; exit 2 ;;
  esac
  shift
done

# The torchtitan stack: its pyproject.toml extra, the torch releases tested with it (the lowest
# and the first one past them) and the model the closing line offers.
case "$TITAN" in
  0.2.2) EXTRA=titan022 TORCH_MIN=2.11 TORCH_END=2.16 MODEL="" ;;
  0.3.0) EXTRA=titan030 TORCH_MIN=2.13 TORCH_END=2.16 MODEL=" model=tiny_dsv3" ;;
  *) echo "--torchtitan ${TITAN:-(none)}: the recipe runs torchtitan 0.2.2 or 0.3.0; $USAGE" >&2; exit 2 ;;
esac
TORCH_RANGE="$TORCH_MIN to 2.$(( ${TORCH_END#2.} - 1 ))"

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
if [ -n "$installed" ] && "$PY" - "$installed" "$TORCH_MIN" "$TORCH_END" <<'EOF'
import sys
version, low, end = (tuple(int(p) for p in v.split("+")[0].split(".")[:2]) for v in sys.argv[1:])
sys.exit(0 if low <= version < end else 1)
EOF
then
  say "2/3 torch: $installed is installed, in the tested range ($TORCH_RANGE): kept"
else
  IFS="|" read -r index why <<<"$(torch_index)"
  from=${index:-PyPI}
  now=${installed:+ (replacing $installed, outside $TORCH_RANGE)}
  say "2/3 torch: installing torch==$TORCH_PIN from $from ($why)$now ..."
  run "$PY" -m pip install -q ${index:+--index-url "$index"} "torch==$TORCH_PIN"
  # torch's CUDA builds pin their own triton, its CPU builds none: then the one tested with it.
  triton="triton==$TRITON_PIN"
fi

say "3/3 mxfp8-ep, torchtitan $TITAN and their pinned dependencies (pip install -e '.[test,$EXTRA]') ..."
run "$PY" -m pip install -q -e ".[test,$EXTRA]" ${triton:+"$triton"}
if [ "$DRY_RUN" = 1 ]; then
  say "dry run: nothing was installed"
else
  "$PY" -c "import mxfp8_ep, launch.train" >/dev/null
  say "done in $((SECONDS - START)) s; train a tiny MoE with: python launch/train.py$MODEL"
fi
