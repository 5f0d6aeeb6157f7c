"""The recipe's side of the numerics telemetry (``launch/run/numerics_log.py``): metric names, the
model-wide values, the console line, and a tiny run end to end: EP=1 with
``a2a.quantize_local_rows=true`` routes the MoE layers through the dispatcher, and
``logging.numerics_every=2`` puts the numerics of steps 2 and 4 (only) into wandb."""

from __future__ import annotations

import math

import pytest
import torch.nn as nn
from tests.train_cli import run_train

from launch.run.numerics_log import console_line, layer_indices, metrics_of
from launch.run.run_summary import RunSummary, parse_numerics_metric
from launch.run.wandb_offline import read_runs
from mxfp8_ep.config import LEGS, NUMERICS_STATS

# Where rel_l2_err must lie for rows quantized to e4m3 (3 mantissa bits) with rceil scales (no
# element clamped). Rounding to nearest moves an element m * 2**e (1 <= m < 2) by at most half a
# step, 2**(e-4), so by at most 2**-4 of itself: rel_l2_err <= 2**-4 whatever the rows (an element
# in e4m3's subnormal range moves by at most 2**-10 block scales, against a block whose largest
# element exceeds 224 scales: < 1e-9 of the block's squared norm, left out). Rows of trained
# activations and gradients are not on e4m3's grid, so each element's error is spread evenly over
# its half step: mean square 2**(2e-8) / 3, relative to the element 2**-8 / (3 m**2), between
# 2**-8 / 12 (m -> 2) and 2**-8 / 3 (m = 1). rel_l2_err squared is the x**2-weighted mean of
# these, so it lies between 2**-4 / (2 sqrt 3) = 0.018 and 2**-4 / sqrt 3 = 0.036, up to the
# sampling noise of thousands of elements (a few percent). Outside this band the statistic, or
# the quantization it samples, is wrong: twice e4m3's error (a truncating quantizer) lands above
# it, a wrong formula (no square root) far below.
E4M3_REL_L2 = (2**-4 / (2 * math.sqrt(3)), 2**-4 / math.sqrt(3))


def test_model_wide_values_are_layer_means_and_the_exponent_range():
    layer = dict(rel_l2_err=0.02, saturated_block_frac=0.1, flushed_frac=0.0, scale_exp_min=-9, scale_exp_max=2)
    other = dict(rel_l2_err=0.04, saturated_block_frac=0.3, flushed_frac=0.5, scale_exp_min=-4, scale_exp_max=7)
    empty = dict.fromkeys(NUMERICS_STATS)
    metrics = metrics_of({(1, "dispatch_fwd"): layer, (2, "dispatch_fwd"): other, (1, "combine_fwd"): empty})
    assert metrics["numerics/layer2/dispatch_fwd/scale_exp_max"] == 7
    assert metrics["numerics/dispatch_fwd/rel_l2_err"] == pytest.approx(0.03)
    assert metrics["numerics/dispatch_fwd/saturated_block_frac"] == pytest.approx(0.2)
    assert metrics["numerics/dispatch_fwd/flushed_frac"] == pytest.approx(0.25)
    assert (metrics["numerics/dispatch_fwd/scale_exp_min"], metrics["numerics/dispatch_fwd/scale_exp_max"]) == (-9, 7)
    assert not [k for k in metrics if "combine_fwd" in k]  # nothing sampled: nothing logged
    assert console_line(4, metrics) == ("numerics step 4: dispatch_fwd rel_l2 3.00e-02 saturated 20.00% "
                                        "flushed 25.000% scale_exp [-9, 7]")
    assert console_line(4, {}) is None


def test_layers_are_named_by_their_block():
    moe = nn.Module()
    moe.token_dispatcher = object()
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Module(), "7": nn.Module()})
    model.layers["7"].moe = moe
    assert layer_indices([model]) == {moe.token_dispatcher: 7}


def test_ep1_run_logs_every_mxfp8_leg_of_the_sampled_steps(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(tmp_path, "model=tiny_dsv3", "parallelism=single", "a2a=mxfp8_all",
                     "a2a.scale_rounding=rceil", "a2a.quantize_local_rows=true", "logging.numerics_every=2",
                     "training.steps=4", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert RunSummary.read(run_dir).steps == 4
    (run,) = read_runs(str(run_dir))
    keys = {row["_step"]: {k for k in row if k.startswith("numerics/")} for row in run.history}
    assert keys[1] == keys[3] == set() and keys[2] == keys[4]
    parsed = [parse_numerics_metric(k) for k in keys[2]]
    assert None not in parsed and {(leg, stat) for _, leg, stat in parsed} == {
        (leg, stat) for leg in LEGS for stat in NUMERICS_STATS}
    layers = {layer for layer, _, _ in parsed if layer is not None}
    # every leg of every MoE layer, and the model-wide values
    assert layers and len(parsed) == (len(layers) + 1) * len(LEGS) * len(NUMERICS_STATS)
    row = next(r for r in run.history if r["_step"] == 4)
    low, high = E4M3_REL_L2
    for key in sorted(keys[4]):
        if key.endswith("/rel_l2_err"):  # every layer's and the model-wide value of every leg
            assert low <= row[key] <= high, f"{key} = {row[key]:.4f}, e4m3 with rceil: [{low:.4f}, {high:.4f}]"
        elif key.endswith("/scale_exp_min"):
            assert row[key] <= row[key.replace("_min", "_max")], key
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("numerics")] == ["numerics step 2",
                                                                                    "numerics step 4"]
