# One H200: the one-rank DeepSeek-V3-like layer (no wire) with today's code: times, then a profile.
out=$1
nvidia-smi --query-gpu=name,clocks.sm,power.limit,temperature.gpu --format=csv > $out/gpu.txt
S=$(date +%s)
timeout 200 torchrun --nproc_per_node=1 benchmarks/dispatcher.py --bench moe_layer --shapes dsv3_rank \
   --arms bf16/symm,mxfp8_all/symm --rounds 2 --json $out/floor_layer.json > $out/floor_layer.log 2>&1
echo "layer rc=$? $(( $(date +%s)-S )) s"; S=$(date +%s)
timeout 250 torchrun --nproc_per_node=1 benchmarks/profile_dispatcher.py --skip-kernels --cpu-ops --layer-shape dsv3_rank \
   --arms torchtitan,bf16/symm,mxfp8_all/symm --json $out/floor_profile.json > $out/floor_profile.log 2>&1
echo "profile rc=$? $(( $(date +%s)-S )) s"
grep -v "^W" $out/floor_layer.log | tail -12
