# One H200: push_tokens' per-slot skip of the local loop, compiled: twins, then push_sweep at EP=2 and 8, new vs HEAD's library.
# .scratch/old_lib: git archive 4ca5207 mxfp8_ep; the new library: HEAD with push_skip.patch (reverted after this run).
out=$1
S=$(date +%s)
timeout 170 python3 -m pytest -q -p no:cacheprovider -k "equal_torch_twins or round_trip or push_tokens" tests/test_symm_kernels.py > $out/test_symm_kernels.log 2>&1; echo "twins rc=$? $(( $(date +%s)-S )) s"; tail -1 $out/test_symm_kernels.log
for w in 2 8; do for lib in new old; do
  S=$(date +%s)
  if [ $lib = old ]; then P="$PWD/.scratch/old_lib:$PYTHONPATH"; else P="$PYTHONPATH"; fi
  PYTHONPATH="$P" timeout 120 torchrun --nproc_per_node=1 benchmarks/push_sweep.py --rounds 1 --world $w \
    --push-tokens-shapes "2,4,1024;1,4,1024" --json $out/sweep_w${w}_$lib.json > $out/sweep_w${w}_$lib.log 2>&1
  echo "sweep world $w $lib rc=$? $(( $(date +%s)-S )) s"
done; done
python3 - "$out" <<'PY'
import json, sys, glob, collections
out = sys.argv[1]
t = collections.defaultdict(dict)
for f in sorted(glob.glob(f"{out}/sweep_w*.json")):
    w, lib = f.split("/")[-1][7:-5].split("_")
    for r in json.load(open(f)):
        t[(w, r["kernel"], r["fmt"], json.dumps(r["launch"]))][lib] = r["ms"]
for (w, k, fmt, l), v in sorted(t.items()):
    print(f"w{w} {k:<38} {fmt:<6} {l:<42} new {v.get('new', 0):.4f} old {v.get('old', 0):.4f}")
PY
