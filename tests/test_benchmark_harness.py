"""benchmarks/harness.py: arms and their launch shapes, shapes, routings, speed-up ratios, and rows
written with their provenance. No timing is asserted: speed is measured on the GPU machine."""

import argparse
import json

import pytest
import torch

from benchmarks.harness import (
    SHAPES,
    Results,
    add_speedups,
    format_table,
    launches,
    leg_routing,
    parse_arm,
    parse_arms,
    parse_launch_options,
    parse_shape_names,
    parsed,
)
from mxfp8_ep.kernels.launch_shapes import KernelShapes, LaunchShape


def test_arms_parse_into_a2a_configs_and_modifiers():
    arms = parse_arms("mxfp8/symm,bf16/symm:rows:overlap,mxfp8_all/nccl@local", first="torchtitan")
    assert [a.name for a in arms] == ["torchtitan", "mxfp8/symm", "bf16/symm:rows:overlap", "mxfp8_all/nccl@local"]
    titan, mx, rows, local = arms
    assert titan.baseline and not mx.baseline and mx.launch_shapes() is None
    assert mx.a2a().transport == "symm" and mx.a2a().symm_combine_partial_sums and mx.a2a().any_quantized
    assert rows.rows and rows.overlap and not rows.a2a().symm_combine_partial_sums and not rows.a2a().any_quantized
    assert local.local and local.a2a().transport == "nccl"
    # the reference leads once, named or not
    assert [a.name for a in parse_arms("bf16/symm,torchtitan", first="torchtitan")] == ["torchtitan", "bf16/symm"]


def test_launch_modifiers_give_the_dispatcher_its_shapes_per_format():
    arm = parse_arm("mxfp8_all/symm:push_tokens=2x4x1024:push_partials.bf16=2x4x512")
    shapes = arm.launch_shapes()
    assert set(shapes) == {"bf16", "mxfp8"}
    two = LaunchShape(2, 4, 1024)
    assert shapes["bf16"].push_tokens == shapes["mxfp8"].push_tokens == two
    assert shapes["bf16"].push_partials == LaunchShape(2, 4, 512)
    assert shapes["mxfp8"].push_partials == KernelShapes.default("mxfp8").push_partials  # bf16 only
    assert shapes["mxfp8"].reduce_slots == KernelShapes.default("mxfp8").reduce_slots  # others: defaults
    push = parse_arm("bf16/symm:push_rows=8x8x512x4x2").launch_shapes()["bf16"].push_rows
    assert (push.block, push.warps, push.block_d, push.stripes, push.stages) == (8, 8, 512, 4, 2)


@pytest.mark.parametrize("bad, message", [
    ("bf16/ib", "transport symm or nccl"),
    ("fp4/symm", "preset in"),
    ("alltoall", "expected one of"),
    ("bf16/symm:push2", "unknown modifier 'push2'"),
    ("bf16/symm:push_tokens=3x4", "power of two"),
    ("bf16/symm:push_tokens.fp4=2x4", "FMT bf16 or mxfp8"),
    ("bf16/symm:pull=2x4", "KERNEL in"),
])
def test_bad_arms_fail_before_anything_starts(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_arm(bad)


def test_a_value_that_does_not_parse_is_a_usage_error(capsys):
    parser = argparse.ArgumentParser(prog="bench")
    assert [a.name for a in parsed(parser, parse_arms, "bf16/symm", first="torchtitan")] == ["torchtitan", "bf16/symm"]
    with pytest.raises(SystemExit) as exit_:
        parsed(parser, parse_arms, "bf16/ib")
    assert exit_.value.code == 2 and "bench: error: arm 'bf16/ib'" in capsys.readouterr().err


def test_an_arm_named_twice_is_refused():
    with pytest.raises(ValueError, match="named twice"):
        parse_arms("bf16/symm,bf16/symm")


def test_launch_options_add_shapes_after_the_default():
    options = parse_launch_options(["push_tokens=2x4x1024,1x4x1024", "push_tokens.mxfp8=4x4", "reduce_slots.bf16=2x4"])
    default = KernelShapes.default("mxfp8").push_tokens
    assert launches(options, "push_tokens", "mxfp8") == [default, LaunchShape(2, 4, 1024), LaunchShape(1, 4, 1024),
                                                         LaunchShape(4, 4)]
    # each shape once: bf16's default push_tokens is (1, 4, 1024)
    assert launches(options, "push_tokens", "bf16") == [LaunchShape(1, 4, 1024), LaunchShape(2, 4, 1024)]
    assert launches(options, "reduce_slots", "mxfp8") == [KernelShapes.default("mxfp8").reduce_slots]
    assert launches({}, "receive_rows", "bf16") == [KernelShapes.default("bf16").receive_rows]


def test_shapes_by_name():
    assert [s.name for s in parse_shape_names("dsv3,llama4")] == ["dsv3", "llama4"]
    dsv3, rank = SHAPES["dsv3"], SHAPES["dsv3_rank"]
    assert (dsv3.dim, dsv3.experts, dsv3.top_k, dsv3.tokens) == (7168, 256, 8, 8192)
    assert (SHAPES["llama4"].dim, SHAPES["llama4"].experts, SHAPES["llama4"].top_k, SHAPES["llama4"].tokens) == (
        5120, 16, 1, 16384)
    assert rank.experts * 2 == dsv3.experts
    assert (rank.dim, rank.tokens, rank.top_k) == (dsv3.dim, dsv3.tokens, dsv3.top_k)
    assert dsv3.row_fields()["dims"] == {"dim": 7168, "hidden": 2048, "experts": 256, "top_k": 8,
                                         "tokens_per_rank": 8192}
    with pytest.raises(Exception, match="unknown shapes"):
        parse_shape_names("dsv3,gpt5")


def test_leg_routing_even_splits_ranks_and_zipf_prefers_rank_0():
    scores, ids, counts = leg_routing(64, 8, 2, "even", torch.device("cpu"), rank=1)
    assert ids.shape == scores.shape == (64, 2) and int(counts.sum()) == 128
    assert (counts == 16).all(), "even routing fills every expert alike"
    _, ids, counts = leg_routing(4096, 64, 8, "zipf", torch.device("cpu"), rank=0)
    assert all(len(set(row.tolist())) == 8 for row in ids[:64]), "top-k picks distinct experts"
    assert counts[:32].sum() > 2 * counts[32:].sum(), "popular experts live on rank 0"
    with pytest.raises(ValueError, match="routing"):
        leg_routing(8, 8, 2, "uniform", torch.device("cpu"), rank=0)


def test_speedups_compare_rows_of_the_same_shape_and_pass():
    rows = [{"shape": s, "pass": p, "arm": a, "ms": ms, "ms_synced": 2 * ms}
            for s, p, a, ms in [("a", "fwd", "torchtitan", 10.0), ("a", "fwd", "bf16/nccl", 8.0),
                                ("a", "fwd", "mxfp8/symm", 5.0), ("b", "fwd", "mxfp8/symm", 1.0)]]
    add_speedups(rows, ("torchtitan", "bf16/nccl"))
    assert [r["speedup_vs_torchtitan"] for r in rows] == [1.0, 1.25, 2.0, None]
    assert [r["speedup_vs_bf16_nccl"] for r in rows] == [0.8, 1.0, 1.6, None]
    assert rows[2]["speedup_synced_vs_torchtitan"] == 2.0


def test_results_rows_carry_provenance_and_the_benchs_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("MXFP8EP_BENCH_COMMAND", "torchrun --nproc_per_node=2 -m benchmarks.layer --out X")
    results = Results("layer", str(tmp_path))
    results.write([{"shape": "tiny", "arm": "bf16/symm", "pass": "fwd", "ms": 1.5}], ("arm", "ms"))
    (path,) = tmp_path.glob("*.jsonl")
    assert path.name.endswith("_cpux1_layer.jsonl")
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["command"] == "torchrun --nproc_per_node=2 -m benchmarks.layer --out X"
    assert row["bench"] == "layer" and len(row["commit"]) == 40 and row["date"].endswith("Z")
    assert row["machine"]["gpu"] == "cpu" and row["versions"]["torch"] == torch.__version__
    assert (row["shape"], row["arm"], row["pass"], row["ms"]) == ("tiny", "bf16/symm", "fwd", 1.5)
    with pytest.raises(ValueError, match="provenance"):
        results.write([{"commit": "x"}])


def test_results_record_the_link_nccl_crossed(tmp_path):
    Results("legs_shm", str(tmp_path), link="shm", count=2).write([{"ms": 1.0}])
    (row,) = [json.loads(line) for p in tmp_path.glob("*.jsonl") for line in p.read_text().splitlines()]
    assert row["machine"]["link"] == "nccl-shm" and row["machine"]["count"] == 2


def test_format_table_aligns_columns():
    text = format_table([{"arm": "torchtitan", "ms": 12.3456}, {"arm": "x", "ms": None}], ("arm", "ms"))
    assert text.splitlines() == ["arm         ms   ", "torchtitan  12.35", "x           -    "]


def test_a_rows_file_names_the_gpu_model_not_its_memory():
    from benchmarks.rows import Machine

    slugs = {name: Machine(name, 2, "nvlink", 16).slug
             for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "cpu")}
    assert slugs == {"NVIDIA H100 80GB HBM3": "h100x2", "NVIDIA H200": "h200x2", "NVIDIA A100-SXM4-80GB": "a100x2",
                     "cpu": "cpux2"}, slugs
