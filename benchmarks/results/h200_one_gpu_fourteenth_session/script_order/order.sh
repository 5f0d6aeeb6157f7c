# One H200: push_tokens 0.22 ms (13th session) vs 0.33-0.44 ms (14th): the script of 77443cc against today's, alternating.
# .scratch/push_sweep_old.py: git show 77443cc:benchmarks/push_sweep.py (the script the thirteenth session ran).
out=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu,ecc.mode.current --format=csv > $out/gpu.txt
for i in 1 2; do for s in old new; do
  S=$(date +%s)
  if [ $s = old ]; then f=.scratch/push_sweep_old.py; else f=benchmarks/push_sweep.py; fi
  timeout 100 torchrun --nproc_per_node=1 $f --rounds 1 --push-tokens-shapes "2,4,1024" --json $out/order_${s}_$i.json > $out/order_${s}_$i.log 2>&1
  echo "$s $i rc=$? $(( $(date +%s)-S )) s"
done; done
cat $out/gpu.txt
python3 - "$out" <<'PY'
import json, sys, glob, collections
out = sys.argv[1]
t = collections.defaultdict(dict)
for f in sorted(glob.glob(f"{out}/order_*.json")):
    tag = f.split("/")[-1][6:-5]
    for r in json.load(open(f)):
        t[(r["kernel"], r["fmt"])][tag] = r["ms"]
tags = sorted({k for v in t.values() for k in v})
print(" " * 46 + " ".join(f"{x:>8}" for x in tags))
for (k, fmt), v in t.items():
    print(f"{k:<38} {fmt:<6} " + " ".join(f"{v.get(x, 0):8.4f}" for x in tags))
PY
