# One H200: reduce_slots / push_tokens launch shapes at the DeepSeek-V3-like EP=2 leg, then the
# one-rank layer with the MXFP8 reduce at 1,4,1024 (now) and 1,4,512, alternating.
out=$1
S=$(date +%s)
timeout 300 torchrun --nproc_per_node=1 benchmarks/push_sweep.py --rounds 1 \
  --reduce-shapes "1,4,512;1,4,1024;2,4,512;1,8,1024;2,8,1024;1,8,512" \
  --push-tokens-shapes "2,4,1024;1,4,1024;2,8,1024" \
  --json $out/push_sweep.json > $out/push_sweep.log 2>&1; echo "sweep rc=$? $(( $(date +%s)-S )) s"
for i in 1 2; do for d in 1024 512; do
  S=$(date +%s)
  REDUCE_MXFP8=1,4,$d timeout 75 torchrun --nproc_per_node=1 .scratch/with_shapes.py benchmarks/dispatcher.py --bench moe_layer \
    --shapes dsv3_rank --arms bf16/symm,mxfp8_all/symm --rounds 1 --json $out/layer_${d}_$i.json > $out/layer_${d}_$i.log 2>&1
  echo "layer $d run $i rc=$? $(( $(date +%s)-S )) s"
done; done
python3 - "$out" <<'PY'
import json, sys, glob, collections
out = sys.argv[1]
rows = json.load(open(f"{out}/push_sweep.json"))
t = collections.defaultdict(dict)
for r in rows:
    t[(r["kernel"], json.dumps(r["launch"]))][r["fmt"]] = r["ms"]
for (k, l), v in t.items():
    if "reduce" in k or "push_tokens" in k:
        print(f"{k:<36} {l:<44} bf16 {v.get('bf16', 0):.4f}  mxfp8 {v.get('mxfp8', 0):.4f}")
for f in sorted(glob.glob(f"{out}/layer_*.json")):
    print(f.split("/")[-1], [(r["arm"], r["pass"], r["ms"]) for r in json.load(open(f))])
PY
