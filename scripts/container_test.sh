#!/usr/bin/env bash
# Build the Dockerfile's two images with buildah on a CPU base made here, and run them:
#   bash scripts/container_test.sh
#   bash scripts/container_test.sh --tested   # exit 0 when the inputs are those of the last pass
#
#   1 tools     buildah and debootstrap (Debian packages), installed if missing
#   2 base      Debian bookworm (Python 3.11) with torch $TORCH_PIN, CPU build, and the triton
#               install.sh puts beside it ($TRITON_PIN), in the venv /opt/venv first on PATH: a
#               CPU stand-in for the official pytorch/pytorch image, whose Python is /opt/conda's
#               (its CUDA torch brings its triton)
#   3 runtime   the Dockerfile's default target, BASE_IMAGE=<the base> TORCH_VERSION=$TORCH_PIN
#   4 test      its `test` target
#   5 help      `python launch/train.py --help` in the runtime image
#   6 train     a 4-step MXFP8 run in the runtime image: EP=2 on 2 CPU processes, wandb offline
#   7 suite     the test image's own command (its CMD: the CPU suite)
#
# Each stage prints its time and the disk the script holds; everything it made (images,
# containers, the base) is removed at the end, also on failure. Needs root (debootstrap, buildah
# --isolation chroot), the network to Debian's mirror and PyPI, and about 12 GB free under
# CONTAINER_TEST_DIR (default /var/tmp/mxfp8-ep-container-test) with overlay storage; buildah
# falls back to vfs storage (a full copy of the image per layer, ~40 GB) where overlay does not
# mount. torch for the base comes as install.sh's would on a machine without a GPU
# (torch_index.sh).
#
# A pass writes the sha256 of what the images are built from and how (INPUTS) to
# .ci/container_tested; .ci/run runs this script when the inputs differ from it.
set -euo pipefail
cd "$(dirname "$0")/.."
INPUTS=(Dockerfile .dockerignore pyproject.toml scripts/install.sh scripts/torch_index.sh scripts/container_test.sh)
STAMP=.ci/container_tested
inputs_sha() { sha256sum "${INPUTS[@]}" | sha256sum | cut -d' ' -f1; }
if [ "${1:-}" = --tested ]; then
  if [ -f "$STAMP" ] && [ "$(grep -v '^#' "$STAMP")" = "$(inputs_sha)" ]; then
    echo "container_test.sh: ${INPUTS[*]} are as the last pass built them ($STAMP)"
    exit 0
  fi
  echo "container_test.sh: ${INPUTS[*]} changed since the last pass ($STAMP)"
  exit 1
elif [ $# -gt 0 ]; then
  echo "usage: bash scripts/container_test.sh [--tested]" >&2
  exit 2
fi
source scripts/torch_index.sh
WORK=${CONTAINER_TEST_DIR:-/var/tmp/mxfp8-ep-container-test}
BASE=localhost/mxfp8-ep-base:cpu
RUNTIME=localhost/mxfp8-ep:cpu
TEST=localhost/mxfp8-ep:cpu-test
START=$SECONDS

if [ "$(id -u)" != 0 ]; then
  echo "container_test.sh: needs root (debootstrap, buildah --isolation chroot)" >&2
  exit 2
fi
# The commit the test image's benchmark rows record (the Dockerfile's MXFP8EP_COMMIT).
commit=${MXFP8EP_COMMIT:-$(git rev-parse HEAD 2>/dev/null || true)}
if [ -z "$commit" ]; then
  echo "container_test.sh: $PWD is not a git checkout: set MXFP8EP_COMMIT to the commit it was copied from" >&2
  exit 2
fi
if [ -e "$WORK" ]; then
  echo "container_test.sh: $WORK exists (another run, or a stopped one's leftovers: remove it first)" >&2
  exit 2
fi

say() { echo "[container] $*"; }
t0=$SECONDS
took() {  # the stage's time, and the disk this script holds now
  local mb
  mb=$(du -sx --block-size=1M "$WORK" 2>/dev/null | cut -f1)
  say "  done in $((SECONDS - t0)) s (at $((SECONDS - START)) s); $(awk "BEGIN {printf \"%.1f\", ${mb:-0} / 1024}") GB under $WORK"
  t0=$SECONDS
}

say "1/7 tools: buildah, debootstrap"
if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah debootstrap >/dev/null
fi
mkdir -p "$WORK"
# overlay storage where it mounts here, else vfs.
for driver in overlay vfs; do
  B=(buildah --root "$WORK/storage-$driver" --runroot "$WORK/run-$driver" --storage-driver "$driver")
  probe=$("${B[@]}" from scratch 2>/dev/null) || continue
  "${B[@]}" mount "$probe" >/dev/null 2>&1 && mounts=1 || mounts=0
  "${B[@]}" rm "$probe" >/dev/null 2>&1 || true
  [ "$mounts" = 1 ] && break
done
# pip inside the builds trusts what this machine's pip trusts: its CA bundle (a proxy's CA
# included, where there is one), given with a pip.conf naming it, mounted read-only into each
# build step; nothing of it stays in an image.
ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
trust=()
if [ -f "$ca" ]; then
  printf '[global]\ncert = /etc/ssl/build-ca.pem\n' > "$WORK/pip.conf"
  trust=(-v "$ca:/etc/ssl/build-ca.pem:ro" -v "$WORK/pip.conf:/etc/pip.conf:ro")
fi
containers=()
cleanup() {
  local rc=$?
  say "cleanup: containers, images, $WORK"
  for c in "${containers[@]}"; do "${B[@]}" rm "$c" >/dev/null 2>&1 || true; done
  "${B[@]}" rm --all >/dev/null 2>&1 || true
  "${B[@]}" rmi --all --force >/dev/null 2>&1 || true
  rm -rf "$WORK"
  say "total $((SECONDS - START)) s; exit $rc"
}
trap cleanup EXIT
say "  $(buildah --version), $driver storage under $WORK"
took

say "2/7 base: debootstrap bookworm, venv /opt/venv with torch==$TORCH_PIN (CPU), triton==$TRITON_PIN"
IFS="|" read -r index why <<<"$(torch_index "${PYTHON:-python3}" cpu)"
say "  torch from ${index:-PyPI} ($why)"
mkdir -p "$WORK/wheels"
# The wheel for the base's Python (3.11) and this machine's architecture, fetched with this
# machine's pip settings, then installed inside the base with its dependencies and triton from PyPI.
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
  --platform "manylinux_2_28_$(uname -m)" -d "$WORK/wheels" ${index:+--index-url "$index"} "torch==$TORCH_PIN"
base=$("${B[@]}" from scratch)
containers+=("$base")
root=$("${B[@]}" mount "$base")
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
cp /etc/resolv.conf "$root/etc/resolv.conf"
[ -f "$ca" ] && cp "$ca" "$root/etc/ssl/build-ca.pem" && cp "$WORK/pip.conf" "$root/etc/pip.conf"
mkdir -p "$root/tmp/wheels" && cp "$WORK"/wheels/*.whl "$root/tmp/wheels/"
in_base() {  # a command in the base, with its own environment (none of this shell's PIP_* or PATH)
  chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
}
in_base python3 -m venv /opt/venv
in_base pip install -q --no-cache-dir --disable-pip-version-check --find-links /tmp/wheels "torch==$TORCH_PIN" \
  "triton==$TRITON_PIN"
in_base apt-get clean
rm -rf "$root"/tmp/wheels "$root"/var/lib/apt/lists/* "$root"/etc/{resolv.conf,pip.conf,ssl/build-ca.pem} "$WORK/wheels"
"${B[@]}" umount "$base" >/dev/null
"${B[@]}" config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 --cmd python "$base"
"${B[@]}" commit -q --rm "$base" "$BASE" >/dev/null
containers=()
took

build() {  # $1: target, $2: tag; its log shown when it fails
  "${B[@]}" build --isolation chroot --layers --pull=never --target "$1" -t "$2" "${trust[@]}" \
    --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_VERSION="$TORCH_PIN" --build-arg MXFP8EP_COMMIT="$commit" \
    -f Dockerfile . >"$WORK/build-$1.log" 2>&1 \
    || { tail -40 "$WORK/build-$1.log" >&2; exit 1; }
}
say "3/7 runtime image: buildah build --target runtime"
build runtime "$RUNTIME"
took
say "4/7 test image: buildah build --target test"
build test "$TEST"
"${B[@]}" images --format '[container]   {{.Name}}:{{.Tag}} {{.Size}}' | grep -E "mxfp8-ep(-base)?:cpu" || true
took

run_in() {  # $1: image, then the command: run in a fresh container of the image, removed after
  local image=$1 c
  shift
  c=$("${B[@]}" from --pull=never "$image")
  containers+=("$c")
  # --hostname: a name the container's /etc/hosts (the host's, under chroot isolation) resolves;
  # torch's rendezvous looks its own hostname up.
  "${B[@]}" run --isolation chroot --hostname localhost "$c" -- "$@"
}
say "5/7 runtime: python launch/train.py --help"
run_in "$RUNTIME" python launch/train.py --help | head -3
took
say "6/7 runtime: python launch/train.py a2a=mxfp8 training.steps=4 (EP=2, 2 CPU processes, wandb offline)"
run_in "$RUNTIME" python launch/train.py a2a=mxfp8 training.steps=4
took
config=$("${B[@]}" inspect --type image "$TEST")
mapfile -t cmd < <(python3 -c 'import json, sys; print("\n".join(json.loads(sys.argv[1])["OCIv1"]["config"]["Cmd"]))' "$config")
[ "${#cmd[@]}" -gt 0 ] && [ -n "${cmd[0]}" ] || { echo "container_test.sh: $TEST has no CMD" >&2; exit 1; }
say "7/7 test image, its own command: ${cmd[*]}"
run_in "$TEST" "${cmd[@]}"
took
{ echo "# sha256 of ${INPUTS[*]}: scripts/container_test.sh passed with them"; inputs_sha; } > "$STAMP"
say "passed: $STAMP"
