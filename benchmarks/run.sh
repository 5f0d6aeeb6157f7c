#!/usr/bin/env bash
# The benchmarks and the GPU test suites, one suite per call:
#     bash benchmarks/run.sh SUITE OUT
# Results rows (JSON Lines, benchmarks/rows.py) and a log per suite go to OUT. Each suite ends
# within 10 minutes on a 2-GPU H200 machine; suites marked "1 GPU" need only one, "CPU" none.
# BENCH_ARGS is appended to every benchmark script's options (e.g. "--iters 4 --rounds 1");
# STEPS sets the training suites' steps (default 50).
# Without a git checkout (a copied working tree) set MXFP8EP_COMMIT to the copied commit.
set -eo pipefail

suites() {
  cat <<'EOF'
layer           2 GPUs  torchtitan 0.2.2 MoE layer under EP: ExpertParallel vs our arms, DSV3-/Llama4-like
layer_rank      1 GPU   one rank's share of the DSV3-like layer, no exchange (the layer's floor)
legs            2 GPUs  dispatch / combine legs alone over NVLink; all_to_all_v alone (bf16 vs MXFP8)
links           2 GPUs  the legs over NCCL's shared-memory and socket transports
train           2 GPUs  training tokens/s, model=dsv3_ep_bench: bf16/nccl vs {bf16,mxfp8,mxfp8_all}/symm
train_shm       2 GPUs  training tokens/s over NCCL shared memory: */nccl, shared experts overlapped or not
train_debug     2 GPUs  Llama4 / DeepSeek-V3 debugmodels, bf16 vs mxfp8: tokens/s and loss
step_profile    2 GPUs  one dsv3_ep_bench training step's GPU time by category, per arm
kernels         1 GPU   the symm kernels alone at EP=2 and EP=8 (peers emulated), launch shapes side by side
numerics        1 GPU   numerics telemetry: step time at logging.numerics_every=50 vs off (EP=1, every row quantized)
profile         2 GPUs  kernels over NVLink with bandwidths; layer and leg timelines (torch.profiler)
power           2 GPUs  SM clock, power and energy per pass of the DSV3-like layer's arms
titan030        2 GPUs  torchtitan 0.3.0 MoE layer: AllToAll / MinimalAsyncEP vs ours (TITAN030_SITE)
internode_bytes CPU     inter-node bytes per token, flat vs node-deduplicated, DSV3 16B routing at 2/4/8 nodes (+ modelled time)
capacity_1gpu   1 GPU   elastic capacity, ranks on one GPU: GPU tests, layer memory EP 2/4, parity_dsv3 EP=4 1,000 steps
checkpoint_1gpu 1 GPU   activation checkpointing in guarded steps, ranks on one GPU: GPU tests; parity_dsv3 EP=4 full and selective vs the worst case
memory_1gpu     1 GPU   parity_dsv3 EP=4 200 steps, ranks on one GPU: peak memory with the activation pool and without it
tests_1gpu      1 GPU   compiled kernel tests; symm checks with 2-4 ranks sharing the GPU
tests_1gpu_fuzz 1 GPU   the symm fuzz against torchtitan, 2-4 ranks sharing the GPU
tests_2gpu      2 GPUs  the dispatcher GPU tests and fuzz, a GPU per rank; the NCCL tests
EOF
}

usage() {
  echo "usage: bash benchmarks/run.sh SUITE OUT" >&2
  echo "suites:" >&2
  suites | sed 's/^/  /' >&2
  exit 2
}

[ $# -eq 2 ] || usage
suite=$1
out=$2
suites | awk '{print $1}' | grep -qx -- "$suite" || { echo "run.sh: unknown suite '$suite'" >&2; usage; }

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! git rev-parse HEAD >/dev/null 2>&1 && [ -z "${MXFP8EP_COMMIT:-}" ]; then
  echo "run.sh: $PWD is not a git checkout: set MXFP8EP_COMMIT to the commit this tree was copied from" >&2
  exit 2
fi
# NVLink multicast (NVLS) stays off for NCCL and for symmetric memory.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/$suite.log"
steps=${STEPS:-50}
read -r -a extra <<<"${BENCH_ARGS:-}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available(), 'gpus', torch.cuda.device_count())" 2>&1 | tee -a "$log"

# Runs one command; its output goes to the log, the command into every row it writes.
run() {
  export MXFP8EP_BENCH_COMMAND="$*"
  echo "+ $*" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
}

bench() {  # bench NPROC MODULE ARGS...: a benchmark script under torchrun
  local nproc=$1 module=$2
  shift 2
  run torchrun --nproc_per_node="$nproc" -m "benchmarks.$module" --out "$out" "$@" "${extra[@]}"
}

trained=()
train() {  # one launch/train.py call (ARGS...), kept for the rows' command
  run "$@"
  trained+=("$*")
}

train_rows() {  # train_rows ARGS...: the runs under $runs as rows, their training commands recorded
  local rows=(python3 -m benchmarks.train "$runs" --out "$out" "$@")
  export MXFP8EP_BENCH_COMMAND="$(printf '%s && ' "${trained[@]}")${rows[*]}"
  echo "+ ${rows[*]}" | tee -a "$log"
  "${rows[@]}" 2>&1 | tee -a "$log"
}

link_env() {  # NCCL's environment for a link of benchmarks/harness.py's LINKS
  python3 -c "from benchmarks.harness import LINKS; print(' '.join(f'{k}={v}' for k, v in LINKS['$1'].items()))"
}

replay_rows() {  # the runs under $runs as capacity replay rows, their training commands recorded
  local rows=(python3 -m benchmarks.replays "$runs"/* --out "$out")
  export MXFP8EP_BENCH_COMMAND="$(printf '%s && ' "${trained[@]}")${rows[*]}"
  echo "+ ${rows[*]}" | tee -a "$log"
  "${rows[@]}" 2>&1 | tee -a "$log"
  for run_dir in "$runs"/*/; do  # what the rows were read from, beside them
    for f in summary.json console.log routing.jsonl; do
      [ ! -f "$run_dir$f" ] || cp "$run_dir$f" "$out/$(basename "$run_dir").$f"
    done
  done
}

failed=0
tests() {  # tests NAME PYTEST-ARGS...: a GPU test run, its JUnit report in OUT; the suite's other runs still go
  local name=$1
  shift
  run python3 -m pytest -q -p no:cacheprovider --durations=10 --junitxml="$out/$name.xml" "$@" || failed=1
}

runs=$(mktemp -d "${TMPDIR:-/tmp}/mxfp8ep_$suite.XXXXXX")
trap 'rm -rf "$runs"' EXIT
ep_bench=(model=dsv3_ep_bench training.seq_len=4096 training.local_batch_size=2)
common=("${ep_bench[@]}" training.steps="$steps")
# parity_dsv3 at EP=4, the four ranks sharing one GPU: the 1-GPU suites' training runs
parity_ep4=(python3 launch/train.py +recipe=parity_dsv3 parallelism=ep4_shared_gpu a2a=mxfp8 a2a.transport=symm
            training.local_batch_size=2)

case $suite in
layer) bench 2 layer ;;
layer_rank) bench 1 layer --shapes dsv3_rank --arms torchtitan,bf16/symm,mxfp8/symm,mxfp8_all/symm ;;
legs)
  bench 2 legs
  bench 2 legs --a2a
  ;;
links)
  bench 2 legs --link shm
  # A socket leg takes ~0.1-0.3 s: fewer samples, even routing only.
  bench 2 legs --link socket --iters 5 --warmup 2 --group 1 --routings even
  ;;
train)
  train python3 launch/train.py "${common[@]}" experiment=bench_train a2a=bf16 a2a.transport=nccl \
    hydra.run.dir="$runs/bf16_nccl"
  train python3 launch/train.py --multirun "${common[@]}" experiment=bench_train a2a=bf16,mxfp8,mxfp8_all \
    a2a.transport=symm hydra.sweep.dir="$runs/symm"
  train_rows --bench train
  ;;
train_shm)
  read -r -a shm <<<"$(link_env shm)"
  train env "${shm[@]}" python3 launch/train.py --multirun "${common[@]}" experiment=bench_train_shm \
    a2a=bf16,mxfp8,mxfp8_all a2a.transport=nccl hydra.sweep.dir="$runs/serial"
  train env "${shm[@]}" python3 launch/train.py --multirun "${common[@]}" experiment=bench_train_shm \
    a2a=mxfp8,mxfp8_all a2a.transport=nccl parallelism.overlap_shared_experts=true hydra.sweep.dir="$runs/overlap"
  train_rows --bench train_shm --link shm
  ;;
train_debug)
  train python3 launch/train.py --multirun model=llama4_debugmodel,dsv3_debugmodel a2a=bf16,mxfp8 \
    training.steps="$steps" training.seq_len=2048 training.local_batch_size=8 experiment=bench_train_debug \
    hydra.sweep.dir="$runs"
  train_rows --bench train_debug --baseline bf16/auto
  ;;
step_profile)
  # torchtitan's profiler traces step 10 of each arm.
  for arm in bf16/nccl bf16/symm mxfp8/symm; do
    train python3 launch/train.py "${ep_bench[@]}" training.steps=11 training.profile_freq=10 \
      experiment=bench_step_profile a2a="${arm%/*}" a2a.transport="${arm#*/}" hydra.run.dir="$runs/${arm/\//_}"
  done
  train_rows --step-profile
  ;;
kernels)
  for world in 2 8; do
    bench 1 kernels --world "$world" --launch push_tokens=2x4x1024 --launch push_partials.bf16=2x4x512 \
      --launch push_partials.mxfp8=2x4x1024 --launch reduce_slots=2x4x1024 --launch receive_rows=8x4,16x8
  done
  ;;
numerics)
  # The smallest MoE model (the telemetry's work weighs most), every leg MXFP8, every row quantized.
  run python3 -m benchmarks.train --numerics-every 50 --repeats 2 --out "$out" -- model=dsv3_debugmodel \
    parallelism=single a2a=mxfp8_all a2a.quantize_local_rows=true training.steps=$((steps * 6)) \
    training.seq_len=2048 training.local_batch_size=8 logging=none experiment=bench_numerics
  ;;
profile) bench 2 timeline ;;
power) bench 2 layer --power --shapes dsv3 --arms torchtitan,bf16/symm,mxfp8/symm,mxfp8_all/symm,mxfp8/nccl --iters 40 --rounds 2 ;;
titan030)
  [ -z "${TITAN030_SITE:-}" ] || export PYTHONPATH="$TITAN030_SITE:$PYTHONPATH"
  version=$(python3 -c "from importlib.metadata import version; print(version('torchtitan'))")
  if [[ $version != 0.3.* ]]; then
    echo "run.sh: titan030 needs torchtitan 0.3.0, found $version: set TITAN030_SITE to a folder holding" \
      "torchtitan==0.3.0 and spmd_types==0.2.3 (pip install --no-deps --target TITAN030_SITE ...)" >&2
    exit 2
  fi
  bench 2 titan030
  ;;
internode_bytes) run python3 -m benchmarks.internode_bytes --out "$out" "${extra[@]}" ;;
capacity_1gpu)
  tests tests_1gpu_capacity -k sharing_one_gpu tests/test_elastic_capacity.py
  bench 2 memory --layer
  # At EP=4 four ranks' worst-case peaks do not fit one 80 GB card: the default's arms only.
  bench 4 memory --layer --tokens 4096 --arms torchtitan,bf16/symm,mxfp8/symm
  train "${parity_ep4[@]}" training.steps="${STEPS:-1000}" experiment=capacity_ep4 hydra.run.dir="$runs/mxfp8_ep4"
  replay_rows
  ;;
checkpoint_1gpu)
  tests tests_1gpu_checkpoint -k sharing_one_gpu tests/test_replay_where_training_runs.py tests/test_activation_pool.py
  for ckpt in full selective; do
    for arm in elastic worst; do
      worst=()
      [ "$arm" = elastic ] || worst=(a2a.capacity_factor=null a2a.activation_pool_factor=null)
      train "${parity_ep4[@]}" training.activation_checkpoint="$ckpt" training.steps="${STEPS:-40}" "${worst[@]}" \
        experiment=checkpoint_ep4 hydra.run.dir="$runs/${ckpt}_$arm"
    done
  done
  replay_rows
  ;;
memory_1gpu)
  for arm in pool no_pool; do
    pool=()
    [ "$arm" = pool ] || pool=(a2a.activation_pool_factor=null)
    train "${parity_ep4[@]}" training.steps="${STEPS:-200}" "${pool[@]}" experiment=pool_memory_ep4 \
      hydra.run.dir="$runs/$arm"
  done
  replay_rows
  ;;
tests_1gpu)
  tests tests_1gpu_kernels tests/test_triton_kernels.py tests/test_mxfp8.py tests/test_grouped_experts.py \
    tests/test_symm_kernels.py tests/test_dispatch_checks.py
  tests tests_1gpu_ranks -s -k "sharing_one_gpu and not fuzz_against" tests/test_dispatcher_gpu.py
  ;;
tests_1gpu_fuzz) tests tests_1gpu_fuzz -k "sharing_one_gpu and fuzz_against" tests/test_dispatcher_gpu.py ;;
tests_2gpu)
  tests tests_2gpu_dispatcher -k "not sharing_one_gpu" tests/test_dispatcher_gpu.py
  tests tests_2gpu_nccl -k nccl tests/test_all_to_all.py tests/test_expert_parallel.py
  ;;
esac
[ "$failed" = 0 ] || { echo "run.sh: $suite: tests failed; reports in $out" | tee -a "$log"; exit 1; }
echo "run.sh: $suite done; rows and logs in $out" | tee -a "$log"
