# One H200: push_tokens launch shapes incl. (1, 2, 1024) for MXFP8 (16-byte stores at one token per program), EP=2 and EP=8.
out=$1
for i in 1 2; do for w in 8 2; do
  S=$(date +%s)
  timeout 150 torchrun --nproc_per_node=1 benchmarks/push_sweep.py --world $w --rounds 1 \
     --push-tokens-shapes "2,4,1024;1,4,1024;1,2,1024;2,2,1024" --json $out/push1_w${w}_$i.json > $out/push1_w${w}_$i.log 2>&1
  echo "w$w $i rc=$? $(( $(date +%s)-S )) s"
done; done
python3 - "$out" <<'PY'
import json, sys, glob, collections
out = sys.argv[1]
t = collections.defaultdict(dict)
for f in sorted(glob.glob(f"{out}/push1_*.json")):
    tag = f.split("/")[-1][6:-5]
    for r in json.load(open(f)):
        if r["kernel"].startswith("push_tokens"):
            l = r["launch"]; t[(r["kernel"], r["fmt"], f"{l['tokens']},{l['warps']},{l['block_d']}")][tag] = r["ms"]
tags = sorted({k for v in t.values() for k in v})
print(" " * 55 + " ".join(f"{x:>7}" for x in tags))
for (k, fmt, l), v in sorted(t.items()):
    print(f"{k:<36} {fmt:<6} {l:<10} " + " ".join(f"{v.get(x, 0):7.4f}" for x in tags))
PY
