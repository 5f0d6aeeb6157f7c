#!/usr/bin/env bash
# GPU evidence on a 2-GPU machine, in one call each (the device lease is short):
#   bash benchmarks/gpu_evidence.sh core  OUT_DIR   # GPU variants of the tests + a2a benchmark
#   bash benchmarks/gpu_evidence.sh train OUT_DIR   # llama4/dsv3 debugmodel, EP=2, bf16 vs mxfp8
#   bash benchmarks/gpu_evidence.sh dispatcher OUT_DIR  # symm/nccl dispatcher: GPU tests + benchmark
#     (dispatcher_tests / dispatcher_bench: each half alone, for the 600 s limit of one device call)
#   bash benchmarks/gpu_evidence.sh one_gpu_tests OUT_DIR  # ONE GPU: kernels + symm with ranks sharing it
#   bash benchmarks/gpu_evidence.sh one_gpu_fuzz OUT_DIR   # ONE GPU: the 200-routing fuzz, 2-4 ranks sharing it
#   bash benchmarks/gpu_evidence.sh transports OUT_DIR  # dsv3_ep_bench, 50 steps: bf16/nccl vs */symm
#   bash benchmarks/gpu_evidence.sh step_profile OUT_DIR  # dsv3_ep_bench: one step's GPU time by category
#   bash benchmarks/gpu_evidence.sh profile OUT_DIR     # per-kernel sweep + layer timelines
#   bash benchmarks/gpu_evidence.sh power OUT_DIR       # SM clock / power / energy per MoE-layer arm
#   bash benchmarks/gpu_evidence.sh links OUT_DIR       # dispatch/combine legs over NVLink, SHM, sockets
#   bash benchmarks/gpu_evidence.sh shm_train OUT_DIR   # dsv3_ep_bench, 50 steps, NCCL over SHM: */nccl
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
  python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_mxfp8.py 2>&1 | tee "$out/test_kernels.log" | tail -3
  # NCCL: the op fuzz (under sync-debug 'error') and torchtitan EP, on 2 GPUs.
  python3 -m pytest -q -p no:cacheprovider tests/test_all_to_all.py tests/test_titan022.py -k "nccl" 2>&1 | tee "$out/test_nccl.log" | tail -3
  torchrun --nproc_per_node=2 benchmarks/a2a.py --json "$out/a2a.json" 2>&1 | tee "$out/a2a.log" | grep -v "^W"
elif [ "$what" = dispatcher ] || [ "$what" = dispatcher_tests ] || [ "$what" = dispatcher_bench ]; then
  # Together these take longer than one 600 s device call: dispatcher_tests, then dispatcher_bench.
  if [ "$what" != dispatcher_bench ]; then
    python3 -m pytest -q -p no:cacheprovider -k "not sharing_one_gpu" tests/test_triton_kernels.py tests/test_mxfp8.py tests/test_dispatcher_gpu.py tests/test_grouped_experts.py tests/test_symm_kernels.py 2>&1 | tee "$out/test_dispatcher_gpu.log" | tail -3
  fi
  if [ "$what" != dispatcher_tests ]; then
    torchrun --nproc_per_node=2 benchmarks/dispatcher.py --json "$out/dispatcher.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/dispatcher.log" | grep -v "^W"
  fi
elif [ "$what" = one_gpu_tests ] || [ "$what" = one_gpu_fuzz ]; then
  # A one-GPU machine: the symm dispatcher with 2-4 ranks sharing the GPU (tests/shared_gpu.py:
  # CUDA IPC peers, a host barrier; no NVLink, no nccl transport). Each half takes ~5 min.
  if [ "$what" = one_gpu_tests ]; then
    python3 -m pytest -q -p no:cacheprovider --durations=10 tests/test_triton_kernels.py tests/test_mxfp8.py tests/test_grouped_experts.py tests/test_symm_kernels.py 2>&1 | tee "$out/test_kernels.log" | tail -15
    python3 -m pytest -q -s -p no:cacheprovider --durations=10 -k "sharing_one_gpu and not fuzz_against" tests/test_dispatcher_gpu.py 2>&1 | tee "$out/test_symm_one_gpu.log" | tail -15
  else
    python3 -m pytest -q -p no:cacheprovider --durations=10 -k "sharing_one_gpu and fuzz_against" tests/test_dispatcher_gpu.py 2>&1 | tee "$out/test_fuzz_one_gpu.log" | tail -15
  fi
elif [ "$what" = profile ]; then
  torchrun --nproc_per_node=2 benchmarks/profile_dispatcher.py --json "$out/profile.json" ${PROFILE_ARGS:-} 2>&1 | tee "$out/profile.log" | grep -v "^W"
elif [ "$what" = power ]; then
  torchrun --nproc_per_node=2 benchmarks/layer_power.py --json "$out/layer_power.json" ${POWER_ARGS:-} 2>&1 | tee "$out/layer_power.log" | grep -v "^W"
elif [ "$what" = links ]; then
  # Socket legs take ~0.1 s each: fewer samples, even routing only.
  for link in nvlink shm socket; do
    extra=""; [ "$link" = socket ] && extra="--iters 5 --warmup 2 --group 1 --routings even"
    env $(python3 -c "from benchmarks.dispatcher import link_env; print(link_env('$link'))") \
      torchrun --nproc_per_node=2 benchmarks/dispatcher.py --bench leg --link $link $extra \
      --json "$out/leg_$link.json" > "$out/leg_$link.log" 2>&1
    echo "$link exit $?"
  done
  python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
keys = ("bench", "link", "shape", "arm", "pass", "ms", "speedup_vs_torchtitan", "speedup_vs_bf16_nccl")
rows = [{k: r.get(k) for k in keys} for link in ("nvlink", "shm", "socket")
        if (out / f"leg_{link}.json").exists() for r in json.loads((out / f"leg_{link}.json").read_text())]
(out / "nccl_links_h200x2.json").write_text(json.dumps(rows, indent=1))
for r in rows:
    print(f"{r['link']:<7} {r['shape'][-5:]:<6} {r['pass']:<13} {r['arm']:<15} {r['ms']:>9.3f} ms "
          f"{r['speedup_vs_torchtitan']:>6.2f}x titan {r['speedup_vs_bf16_nccl'] or 0:>6.2f}x bf16/nccl")
PY
elif [ "$what" = shm_train ]; then
  runs=/tmp/mxfp8ep_shm_runs
  rm -rf "$runs"
  env $(python3 -c "from benchmarks.dispatcher import link_env; print(link_env('shm'))") \
    python3 launch/train.py --multirun model=dsv3_ep_bench training.steps=50 training.seq_len=4096 \
      training.local_batch_size=2 experiment=gpu_shm_link a2a=bf16,mxfp8,mxfp8_all a2a.transport=nccl \
      hydra.sweep.dir="$runs" > "$out/train_shm.log" 2>&1
  echo "shm sweep exit $?"
  python3 launch/compare_runs.py "$runs" --out "$out/compare_shm.json" 2>&1 | tee "$out/compare_shm.txt"
elif [ "$what" = step_profile ]; then
  # torchtitan's profiler traces step 10 of each arm (ARMS: "<preset>/<transport> ...").
  runs=/tmp/mxfp8ep_profile_runs
  rm -rf "$runs"
  for arm in ${ARMS:-bf16/nccl bf16/symm mxfp8/symm}; do
    name=${arm/\//_}
    python3 launch/train.py model=dsv3_ep_bench training.steps=11 training.profile_freq=10 \
        ${TRAIN_ARGS:-training.seq_len=4096 training.local_batch_size=2} experiment=gpu_step_profile \
        a2a=${arm%/*} a2a.transport=${arm#*/} hydra.run.dir="$runs/$name" > "$out/train_$name.log" 2>&1
    echo "$arm exit $?"
    python3 benchmarks/step_profile.py "$runs/$name/profile_traces" --json "$out/step_profile_$name.json" \
        > "$out/step_profile_$name.txt" 2>&1
  done
  tail -n +1 "$out"/step_profile_*.txt
elif [ "$what" = transports ]; then
  runs=/tmp/mxfp8ep_transport_runs
  rm -rf "$runs"
  common="model=dsv3_ep_bench training.steps=${STEPS:-50} ${TRAIN_ARGS:-training.seq_len=4096 training.local_batch_size=2} experiment=gpu_transports"
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
