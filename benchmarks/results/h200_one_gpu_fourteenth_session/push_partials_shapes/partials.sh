# One H200: push_partials launch shapes (never swept) at the DeepSeek-V3-like leg, EP=2 and EP=8, two passes.
out=$1
SH="${SH:-1,4,512;2,4,512;4,4,512;1,4,1024;2,4,1024;4,4,1024;2,8,1024;4,8,1024;2,8,2048}"; TAG=${TAG:-partials}
for i in 1 2; do for w in 2 8; do
  S=$(date +%s)
  timeout 150 torchrun --nproc_per_node=1 benchmarks/push_sweep.py --rounds 1 --world $w --push-tokens-shapes "2,4,1024" \
    --push-partials-shapes "$SH" --json $out/${TAG}_w${w}_$i.json > $out/${TAG}_w${w}_$i.log 2>&1
  echo "world $w pass $i rc=$? $(( $(date +%s)-S )) s"
done; done
python3 - "$out" <<'PY'
import json, sys, glob, collections
out = sys.argv[1]
t = collections.defaultdict(dict)
for f in sorted(glob.glob(f"{out}/*_w*.json")):
    tag = f.split("/")[-1][:-5]
    for r in json.load(open(f)):
        if r["kernel"].startswith("push_partials"):
            t[(r["kernel"], r["fmt"], json.dumps(r["launch"]))][tag] = r["ms"]
tags = sorted({k for v in t.values() for k in v})
print(" " * 82 + " ".join(f"{x:>7}" for x in tags))
for (k, fmt, l), v in sorted(t.items()):
    print(f"{k:<26} {fmt:<6} {l:<48} " + " ".join(f"{v.get(x, 0):7.4f}" for x in tags))
PY
