#!/usr/bin/env bash
# Build the torchtitan 0.3.0 test environment: the venv .venv-titan030 (ignored by git), for
# mxfp8_ep.titan030 and tests/titan030.
#   bash scripts/setup_titan030.sh        # then: .venv-titan030/bin/python -m pytest tests/titan030
#
# The venv sees the project's own environment, PYTHON's (--system-site-packages, or that venv's
# site-packages where PYTHON is a venv's: torch 2.13 CPU, triton, torchao, pytest, mxfp8-ep
# itself, as scripts/install.sh installed them) and installs the
# pyproject.toml extra `titan030` (torchtitan 0.3.0 and the pins it needs) into the venv, where
# they shadow torchtitan 0.2.2 without touching it. The `titan030` extra conflicts with the
# `titan022` one the base environment has, so it is read from pyproject.toml, not installed as
# `.[titan030]`. (A whole 0.3.0 environment: `bash scripts/install.sh --torchtitan 0.3.0`.) A torch outside 2.12–2.14 (0.3.0 needs >= 2.12) is replaced in the
# venv by torch 2.13.0 (TORCH_INDEX_URL as in install.sh). Reruns with unchanged pins do nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TITAN030_VENV:-.venv-titan030}
PY=${PYTHON:-python3}

pins=$("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["titan030"]))')
stamp="$VENV/.titan030-pins"
if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$pins" ]]; then
  exit 0
fi

rm -rf "$VENV"
"$PY" -m venv --system-site-packages --without-pip "$VENV"
echo '*' > "$VENV/.gitignore"
VPY="$VENV/bin/python"
# A venv made from a venv's python sees the base interpreter's packages, not that venv's: a .pth
# file puts the project environment's site-packages after the new venv's own (which shadow them).
"$PY" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")' \
  > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/project_env.pth"
if ! "$VPY" -c "import torch, sys; v = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if (2, 12) <= v < (2, 15) else 1)" 2>/dev/null; then
  "$VPY" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
fi
# pip's conflict report about the base environment's torchtitan 0.2.2 is expected here (0.3.0
# shadows it on purpose): drop those lines, keep the rest.
mapfile -t reqs <<< "$pins"
"$VPY" -m pip install -q "${reqs[@]}" 2> >(grep -v -e "resolver does not currently take into account" \
  -e "mxfp8-ep .* requires torchtitan==0.2.2" >&2)
"$VPY" -c "from importlib.metadata import version; v = version('torchtitan'); assert v == '0.3.0', v"
echo "$pins" > "$stamp"
