# One H200: the reduce's skipped staged loads, compiled: twins, the reduce rows, the one-rank layer (new vs HEAD's library).
out=$1
S=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -k "equal_torch_twins or round_trip" tests/test_symm_kernels.py > $out/test_symm_kernels.log 2>&1; echo "twins rc=$? $(( $(date +%s)-S )) s"; tail -1 $out/test_symm_kernels.log
S=$(date +%s)
timeout 80 torchrun --nproc_per_node=1 benchmarks/push_sweep.py --rounds 1 --json $out/push_sweep.json > $out/push_sweep.log 2>&1; echo "sweep rc=$? $(( $(date +%s)-S )) s"
grep -E "reduce_slots|push_partials" $out/push_sweep.log | cut -c1-110
for lib in new old; do
  S=$(date +%s)
  if [ $lib = old ]; then P="$PWD/.scratch/old_lib:$PYTHONPATH"; else P="$PYTHONPATH"; fi
  PYTHONPATH="$P" timeout 65 torchrun --nproc_per_node=1 benchmarks/dispatcher.py --bench moe_layer --shapes dsv3_rank \
    --arms bf16/symm,mxfp8_all/symm --rounds 1 --json $out/layer_$lib.json > $out/layer_$lib.log 2>&1
  echo "layer $lib rc=$? $(( $(date +%s)-S )) s $(cd /tmp && PYTHONPATH="$P" python3 -c 'import mxfp8_ep.symm_kernels as s; print(s.__file__, "skip" if "no token of the block reads one" in open(s.__file__).read() else "noskip")')"
  grep -E "symm" $out/layer_$lib.log | cut -c1-80
done
