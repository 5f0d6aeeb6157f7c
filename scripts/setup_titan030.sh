#!/usr/bin/env bash
# Build the torchtitan 0.3.0 test environment: the venv .venv-titan030 (ignored by git), for
# mxfp8_ep.titan030 and tests/titan030.
#   bash scripts/setup_titan030.sh        # then: .venv-titan030/bin/python -m pytest tests/titan030
#
# The venv sees the project's own environment, the Python that scripts/install.sh installed into
# (PYTHON, default python3: torch 2.13 CPU, triton, torchao, pytest, mxfp8-ep itself), through a
# .pth file that adds that environment's site-packages after the venv's own, and installs the
# pyproject.toml extra `titan030` (torchtitan 0.3.0 and the pins it needs) into the venv, where
# they shadow torchtitan 0.2.2 without touching it. The `titan030` extra conflicts with the
# `titan022` one the base environment has, so it is read from pyproject.toml, not installed as
# `.[titan030]`. (A whole 0.3.0 environment: `bash scripts/install.sh --torchtitan 0.3.0`.) A
# torch outside 2.12-2.14 (0.3.0 needs >= 2.12) is replaced in the venv by torch 2.13.0 from the
# index install.sh would pick (torch_index.sh). Reruns with unchanged pins and the same base
# environment do nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch_index.sh
VENV=${TITAN030_VENV:-.venv-titan030}
PY=${PYTHON:-python3}

pins=$("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["titan030"]))')
# One `site.addsitedir` per site-packages folder of $PY's environment (a venv's own, and the
# base interpreter's where the venv was made with --system-site-packages), so that their .pth
# files (an editable install's) work too.
base_env=$("$PY" -c 'import site; print("; ".join(["import site"] + [f"site.addsitedir({p!r})" for p in site.getsitepackages()]))')
stamp="$VENV/.titan030-pins"
if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$pins"$'\n'"$base_env" ]]; then
  exit 0
fi

rm -rf "$VENV"
"$PY" -m venv --without-pip "$VENV"
echo '*' > "$VENV/.gitignore"
VPY="$VENV/bin/python"
echo "$base_env" > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/mxfp8-ep-base-env.pth"
if ! "$VPY" -c "import torch, sys; v = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if (2, 12) <= v < (2, 15) else 1)" 2>/dev/null; then
  IFS="|" read -r index why <<<"$(torch_index "$VPY")"
  echo "[titan030] torch==$TORCH_PIN from ${index:-PyPI} ($why) ..."
  "$VPY" -m pip install -q ${index:+--index-url "$index"} "torch==$TORCH_PIN"
fi
# pip's conflict report about the base environment's torchtitan 0.2.2 is expected here (0.3.0
# shadows it on purpose): drop those lines, keep the rest.
mapfile -t reqs <<< "$pins"
"$VPY" -m pip install -q "${reqs[@]}" 2> >(grep -v -e "resolver does not currently take into account" \
  -e "mxfp8-ep .* requires torchtitan==0.2.2" >&2)
"$VPY" -c "from importlib.metadata import version; v = version('torchtitan'); assert v == '0.3.0', v"
printf '%s\n%s\n' "$pins" "$base_env" > "$stamp"
