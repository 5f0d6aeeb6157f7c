# One H200: push_tokens at one token per program (PUSH_TOKENS_SHAPES), compiled tests, then the one-rank layer against :push2.
out=$1
S=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_symm_kernels.py 2>&1 | tee $out/test_symm_kernels.log | tail -2
echo "symm kernels $(( $(date +%s)-S )) s"; S=$(date +%s)
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -k "sharing_one_gpu and not fuzz_against" tests/test_dispatcher_gpu.py > $out/test_symm_one_gpu.log 2>&1; tail -2 $out/test_symm_one_gpu.log
echo "sharing one gpu $(( $(date +%s)-S )) s"; S=$(date +%s)
timeout 150 torchrun --nproc_per_node=1 benchmarks/dispatcher.py --bench moe_layer --shapes dsv3_rank \
   --arms bf16/symm,bf16/symm:push2,mxfp8_all/symm,mxfp8_all/symm:push2 --rounds 2 --json $out/layer_push2.json > $out/layer_push2.log 2>&1
echo "layer rc=$? $(( $(date +%s)-S )) s"
grep -v "^W" $out/layer_push2.log | grep moe_layer | cut -c1-100
