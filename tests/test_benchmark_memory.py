"""benchmarks/memory.py: the recipe's estimate as rows, and the layer run end to end on 2 gloo
ranks (tiny shape, symm over shared memory): a row per arm, the symm arms' expert capacity at the
default factor and at the worst case. No memory figure is asserted on CPU: the peaks are measured
on the GPU machine."""

import json
import subprocess
import sys

from benchmarks.harness import SHAPES
from benchmarks.memory import ESTIMATE_ARMS, estimate_rows
from mxfp8_ep.exchange.capacity import expert_major_capacity, worst_case_capacity
from mxfp8_ep.config import DEFAULT_CAPACITY_FACTOR


def test_estimate_rows_set_symm_against_nccl_at_each_checkpointing():
    rows = estimate_rows()
    assert {(r["activation_checkpoint"], r["arm"]) for r in rows} == {
        (c, a) for c in ("none", "selective", "full") for a in ESTIMATE_ARMS}
    for ckpt in ("none", "selective", "full"):
        by_arm = {r["arm"]: r for r in rows if r["activation_checkpoint"] == ckpt}
        assert by_arm["nccl"]["vs_nccl"] == 1.0 and by_arm["nccl"]["peer_buffers_gib"] == 0
        assert by_arm["symm"]["gib"] < by_arm["symm:worst"]["gib"], ckpt
        assert abs(by_arm["symm"]["vs_nccl"] - by_arm["symm"]["gib"] / by_arm["nccl"]["gib"]) < 1e-3
        # the pool at its ceiling keeps more; every layer at the worst case keeps no pool
        assert by_arm["symm:worst"]["activation_pool_gib"] == by_arm["nccl"]["activation_pool_gib"] == 0
        assert by_arm["symm"]["layer_transient_gib"] < by_arm["symm:ceiling"]["layer_transient_gib"], ckpt
        assert by_arm["symm"]["activation_pool_gib"] <= by_arm["symm:ceiling"]["activation_pool_gib"], ckpt


def test_layer_run_writes_a_row_per_arm_with_the_capacity(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "benchmarks.memory", "--layer",
         "--shape", "tiny", "--arms", "torchtitan,bf16/symm,bf16/symm:worst", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*_cpux2_layer_memory.jsonl")
    rows = {r["arm"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert list(rows) == ["torchtitan", "bf16/symm", "bf16/symm:worst"]
    s = SHAPES["tiny"]
    shape = (s.tokens, s.top_k, 2, s.experts // 2, 8)  # 8: torchtitan's grouped-GEMM alignment
    assert rows["bf16/symm"]["capacity_rows"] == expert_major_capacity(*shape, DEFAULT_CAPACITY_FACTOR)
    assert rows["bf16/symm:worst"]["capacity_rows"] == worst_case_capacity(*shape)
    assert rows["torchtitan"]["capacity_rows"] is None
    # what each arm holds across steps: the symm arms their peer buffers, torchtitan none
    assert rows["bf16/symm"]["peer_buffers_gib"] > 0 and rows["torchtitan"]["peer_buffers_gib"] == 0
    assert all(r["ep"] == 2 and r["gpu_shared"] is False and r["bench"] == "layer_memory" for r in rows.values())
