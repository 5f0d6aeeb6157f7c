# Sourced by install.sh, setup_titan030.sh and container_test.sh: the torch they install (and
# the triton beside a CPU build) and the index it comes from.
#
#   TORCH_INDEX_URL set           that index ("" is pip's configured one, PyPI by default)
#   an NVIDIA GPU (nvidia-smi or /dev/nvidia*), unless the CPU build is asked for
#                                 PyPI's default build (CUDA)
#   else, if the CPU index lists torch==$TORCH_PIN+cpu (one quick look, no retries)
#                                 the CPU index: the small CPU build
#   else                          pip's configured indexes, said in the line; on PyPI that is
#                                 the CUDA build, which runs on CPU too (larger download)
#
# The GPU results (docs/results.md) were measured on torch 2.11.0+cu130; TORCH_GPU_NOTE says how
# to get that build.

TORCH_PIN="2.13.0"
# A CPU build of torch pins no triton: this one comes with it (a CUDA build brings its own).
TRITON_PIN="3.6.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
TORCH_GPU_NOTE="the GPU results were measured on torch 2.11.0+cu130: for that build, first run
  pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130
  (a torch in the tested range that is already installed is kept)"

has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && return 0
  compgen -G "/dev/nvidia[0-9]*" >/dev/null 2>&1
}

# Whether the CPU index lists the pinned CPU build, asked once through $1's pip with nothing of
# pip's configuration (--isolated: no find-links or extra indexes answering in its place). grep
# reads all of pip's answer: `grep -q` would stop at the match, and pip's next write would then
# break the pipe and, under pipefail, count as no answer.
cpu_index_lists_torch() {
  "$1" -m pip --isolated index versions torch --index-url "$TORCH_CPU_INDEX" --retries 0 --timeout 15 \
    2>/dev/null | grep "$TORCH_PIN+cpu" >/dev/null
}

# "<index>|<why>" for installing torch==$TORCH_PIN with python $1; $2=cpu asks for the CPU
# build whatever GPU the machine has.
torch_index() {
  local why="no NVIDIA GPU found"
  [ "${2:-}" = cpu ] && why="the CPU build asked for"
  if [ -n "${TORCH_INDEX_URL+set}" ]; then
    echo "${TORCH_INDEX_URL}|TORCH_INDEX_URL"
  elif [ "${2:-}" != cpu ] && has_nvidia_gpu; then
    echo "|an NVIDIA GPU was found: PyPI's CUDA build"
  elif cpu_index_lists_torch "$1"; then
    echo "$TORCH_CPU_INDEX|$why: the CPU build; TORCH_INDEX_URL=<index> to choose"
  else
    echo "|$why, but $TORCH_CPU_INDEX did not answer: pip's configured indexes (PyPI's build is the CUDA one, which runs on CPU too); TORCH_INDEX_URL=<index> to choose"
  fi
}
