#!/usr/bin/env bash
# GPU evidence on a 2-GPU machine, in one call each (the device lease is short):
#   bash benchmarks/gpu_evidence.sh core  OUT_DIR   # GPU variants of the tests + a2a benchmark
#   bash benchmarks/gpu_evidence.sh train OUT_DIR   # llama4/dsv3 debugmodel, EP=2, bf16 vs mxfp8
#   bash benchmarks/gpu_evidence.sh dispatcher OUT_DIR  # symm/nccl dispatcher: GPU tests + benchmark
#   bash benchmarks/gpu_evidence.sh transports OUT_DIR  # dsv3_ep_bench, 50 steps: bf16/nccl vs */symm
#   bash benchmarks/gpu_evidence.sh profile OUT_DIR     # per-kernel sweep + layer timelines
# Logs and JSON go to OUT_DIR; a short table is printed last.
set -uo pipefail
what=${1:?core|train}
out=${2:?output dir}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$out/env.txt"

if [ "$what" = core ]; then
  # Triton kernels compiled for the GPU vs the torch reference; the format oracle tests.
  python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_format.py 2>&1 | tee "$out/test_kernels.log" | tail -3
  # NCCL: the op fuzz (under sync-debug 'error') and torchtitan EP, on 2 GPUs.
  python3 -m pytest -q -p no:cacheprovider tests/test_all_to_all.py tests/test_expert_parallel.py -k "nccl" 2>&1 | tee "$out/test_nccl.log" | tail -3
  torchrun --nproc_per_node=2 benchmarks/a2a.py --json "$out/a2a.json" 2>&1 | tee "$out/a2a.log" | grep -v "^W"
elif [ "$what" = dispatcher ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_format.py tests/test_dispatcher_gpu.py tests/test_grouped_experts.py 2>&1 | tee "$out/test_dispatcher_gpu.log" | tail -3
  torchrun --nproc_per_node=2 benchmarks/dispatcher.py --json "$out/dispatcher.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/dispatcher.log" | grep -v "^W"
elif [ "$what" = profile ]; then
  torchrun --nproc_per_node=2 benchmarks/profile_dispatcher.py --json "$out/profile.json" ${PROFILE_ARGS:-} 2>&1 | tee "$out/profile.log" | grep -v "^W"
elif [ "$what" = transports ]; then
  runs=/tmp/mxfp8ep_transport_runs
  rm -rf "$runs"
  common="model=dsv3_ep_bench training.steps=50 training.seq_len=4096 training.local_batch_size=2 experiment=gpu_transports"
  python3 launch/train.py $common a2a=bf16 a2a.transport=nccl hydra.run.dir="$runs/bf16_nccl" > "$out/train_nccl.log" 2>&1
  echo "bf16/nccl exit $?"
  python3 launch/train.py --multirun $common a2a=bf16,mxfp8,mxfp8_all a2a.transport=symm \
      hydra.sweep.dir="$runs/symm" > "$out/train_symm.log" 2>&1
  echo "symm sweep exit $?"
  python3 launch/compare_runs.py "$runs/symm" --out "$out/compare_symm.json" 2>&1 | tee "$out/compare_symm.txt"
  cp "$runs"/bf16_nccl/summary.json "$out/summary_bf16_nccl.json" 2>/dev/null
elif [ "$what" = train ]; then
  runs=/tmp/mxfp8ep_gpu_runs
  rm -rf "$runs"
  python3 launch/train.py --multirun model=llama4_debugmodel,dsv3_debugmodel a2a=bf16,mxfp8 \
      training.steps=50 training.seq_len=2048 training.local_batch_size=8 \
      experiment=gpu_debugmodels hydra.sweep.dir="$runs" > "$out/train.log" 2>&1
  echo "train exit $?"
  python3 launch/compare_runs.py "$runs" --out "$out/compare.json" 2>&1 | tee "$out/compare.txt"
fi
