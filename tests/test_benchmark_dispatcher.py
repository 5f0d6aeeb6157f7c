"""benchmarks/dispatcher.py runs end to end (gloo, tiny shapes, symm over shared memory) and
writes the rows the dispatcher issue asks for, with every arm checked against torchtitan's.
No timing is asserted: speed is measured on the GPU machine (benchmarks/RESULTS.md)."""

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.dispatcher import _leg_routing, _modifiers, launch_shapes

ARMS = ["bf16/symm", "mxfp8/symm", "mxfp8/symm:rows", "mxfp8/nccl", "bf16/symm@local"]


def test_leg_routing_even_splits_ranks_and_zipf_prefers_rank_0():
    scores, ids, counts = _leg_routing(64, 8, 2, "even", torch.device("cpu"), rank=1)
    assert ids.shape == scores.shape == (64, 2) and int(counts.sum()) == 128
    assert (counts == 16).all(), "even routing fills every expert alike"
    _, ids, counts = _leg_routing(4096, 64, 8, "zipf", torch.device("cpu"), rank=0)
    assert all(len(set(row.tolist())) == 8 for row in ids[:64]), "top-k picks distinct experts"
    assert counts[:32].sum() > 2 * counts[32:].sum(), "popular experts live on rank 0"


def test_launch_modifiers_give_the_arms_dispatcher_other_launch_shapes():
    from mxfp8_ep.launch_shapes import KernelShapes, LaunchShape

    assert launch_shapes("mxfp8/symm") is None and launch_shapes("mxfp8/symm:rows@local") is None
    two_tokens = launch_shapes("mxfp8/symm:rows:push2")
    for fmt in ("bf16", "mxfp8"):
        default = KernelShapes.default(fmt)
        assert two_tokens[fmt].push_tokens == LaunchShape(2, 4, 1024) != default.push_tokens
        assert two_tokens[fmt].push_partials == default.push_partials
    both = launch_shapes("mxfp8_all/symm:push2:partials2")
    assert both["bf16"].push_partials == LaunchShape(2, 4, 512) and both["mxfp8"].push_partials == LaunchShape(2, 4, 1024)
    assert both["mxfp8"].push_tokens == LaunchShape(2, 4, 1024)
    assert both["mxfp8"].reduce_slots == KernelShapes.default("mxfp8").reduce_slots
    with pytest.raises(ValueError, match="unknown modifiers"):
        _modifiers("mxfp8/symm:push1")


def test_benchmark_script_writes_rows_with_checked_arms(tmp_path):
    out = tmp_path / "dispatcher.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "benchmarks/dispatcher.py",
         "--shapes", "tiny", "--leg-rows", "256", "--leg-dim", "64", "--iters", "2", "--warmup", "1",
         "--group", "2", "--rounds", "2", "--arms", ",".join(["torchtitan", *ARMS]), "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    layer = [r for r in rows if r["bench"] == "moe_layer"]
    # torchtitan, the reference, runs first and once, whether --arms names it or not.
    assert [(r["arm"], r["pass"]) for r in layer] == [
        (arm, p) for arm in ["torchtitan", *ARMS] for p in ("fwd", "fwd+bwd")
    ]
    for r in rows:
        assert {"bench", "shape", "arm", "pass", "ms", "speedup_vs_torchtitan", "peak_gib"} <= set(r)
        assert r["ms"] > 0 and r["ms_synced"] > 0
    for r in layer:
        errs = r["rel_err"]
        if r["arm"].endswith("@local"):  # another layer (each rank alone): not comparable
            assert errs == {}
        elif r["arm"] == "torchtitan":
            assert errs == {"out": 0.0, "x_grad": 0.0, "w1_grad": 0.0} and r["speedup_vs_torchtitan"] == 1.0
        else:  # bf16 legs: summation order only; MXFP8 legs: the format's error
            bound = 2.0**-6 if r["arm"].startswith("bf16") else 2.0**-3
            assert max(errs.values()) < bound, r
    legs = {(r["shape"].split(", ")[-1], r["pass"]) for r in rows if r["bench"] == "leg"}
    assert legs == {(ro, f"{leg} fwd") for ro in ("even", "zipf") for leg in ("dispatch", "combine")}
