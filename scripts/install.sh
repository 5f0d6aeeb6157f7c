#!/usr/bin/env bash
# Install mxfp8-ep and its tested pins (pyproject.toml) into the current Python, one line per
# stage (a fresh venv is the usual place: python3 -m venv .venv && . .venv/bin/activate):
#   bash scripts/install.sh                       # then: python launch/train.py
#   bash scripts/install.sh --torchtitan 0.3.0    # the torchtitan 0.3.0 stack instead of 0.2.2
#   bash scripts/install.sh --dry-run             # print what it would install, change nothing
#
# torch comes first, pinned (2.13.0), from the index that fits this machine (torch_index.sh: the
# CPU build without an NVIDIA GPU, PyPI's CUDA build with one; TORCH_INDEX_URL overrides). A
# torch already installed in the stack's tested range (e.g. a GPU image's) is kept. With a CPU
# build (no triton of its own), triton comes pinned too. The package step is skipped when this
# Python's packages, pyproject.toml, the stack and the checkout are what the last install here
# left (a stamp in the environment). Environment: PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/torch_index.sh
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

say "1/3 python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

installed=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [ -n "$installed" ] && "$PY" - "$installed" "$TORCH_MIN" "$TORCH_END" <<'PYEOF'
import sys
version, low, end = (tuple(int(p) for p in v.split("+")[0].split(".")[:2]) for v in sys.argv[1:])
sys.exit(0 if low <= version < end else 1)
PYEOF
then
  say "2/3 torch: $installed is installed, in the tested range ($TORCH_RANGE): kept"
else
  IFS="|" read -r index why <<<"$(torch_index "$PY")"
  from=${index:-PyPI}
  now=${installed:+ (replacing $installed, outside $TORCH_RANGE)}
  say "2/3 torch: installing torch==$TORCH_PIN from $from ($why)$now ..."
  if [[ "$why" == "an NVIDIA GPU"* ]]; then say "  $TORCH_GPU_NOTE"; fi
  run "$PY" -m pip install -q ${index:+--index-url "$index"} "torch==$TORCH_PIN"
  # torch's CUDA builds pin their own triton, its CPU builds none: then the one tested with it.
  triton="triton==$TRITON_PIN"
fi

# What this Python's packages, the stack and the checkout are now: equal to the stamp, nothing to install.
state() {
  { pwd; echo "$EXTRA"; sha256sum pyproject.toml; "$PY" -m pip list --format=freeze 2>/dev/null; } \
    | sha256sum | cut -d' ' -f1
}
stamp="$("$PY" -c 'import sys; print(sys.prefix)')/.mxfp8-ep-install"
what="mxfp8-ep, torchtitan $TITAN and their pinned dependencies"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$(state)" ]]; then
  say "3/3 $what: installed, unchanged since the last install (pyproject.toml, packages): kept"
else
  say "3/3 $what (pip install -e '.[test,$EXTRA]') ..."
  run "$PY" -m pip install -q -e ".[test,$EXTRA]" ${triton:+"$triton"}
fi
if [ "$DRY_RUN" = 1 ]; then
  say "dry run: nothing was installed"
else
  "$PY" -c "import mxfp8_ep, launch.train" >/dev/null
  { state > "$stamp"; } 2>/dev/null || true  # an environment that is not writable: no stamp
  say "done in $((SECONDS - START)) s; train a tiny MoE with: python launch/train.py$MODEL"
fi
