"""Triton kernels vs the torch reference, bit for bit. On CPU they run under the Triton
interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on the GPU machine, compiled."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxfp8_ep.format.mxfp8 import dequantize_reference, quantize_reference
from mxfp8_ep.kernels.quantize import dequantize, quantize
from mxfp8_ep.kernels.triton_kernels import dequantize_triton, quantize_triton
from tests.test_mxfp8 import assert_bits_equal, edge_blocks, random_input

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (rows, cols): a partial row tile, a partial column tile (K % 256 != 0), 3-D input.
SHAPES = [(37, 96), (16, 256), (5, 800), (2, 3, 160)]


def _inputs(dtype):
    for i, shape in enumerate(SHAPES):
        rows = shape[0] * (shape[1] if len(shape) == 3 else 1)
        yield random_input(rows, shape[-1], dtype, seed=i).reshape(shape)
    yield edge_blocks(dtype)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference(rounding, dtype):
    for x in _inputs(dtype):
        x = x.to(DEVICE)
        ref = quantize_reference(x, rounding)
        got = quantize_triton(x, rounding)
        assert_bits_equal(got.scale, ref.scale)
        assert_bits_equal(got.data, ref.data)
        for out_dtype in (torch.float32, torch.bfloat16):
            # Dequantized NaNs compare as NaN: torch writes bf16 NaN as 0xFFFF, Triton as 0x7FC0.
            assert_bits_equal(
                dequantize_triton(ref, out_dtype), dequantize_reference(ref, out_dtype), nan_equal=True
            )


def test_triton_handles_zero_rows_and_rejects_bad_shapes():
    q = quantize_triton(torch.zeros(0, 64, device=DEVICE))
    assert q.data.shape == (0, 64) and dequantize_triton(q).shape == (0, 64)
    with pytest.raises(ValueError, match=r"multiple of 32.*\(4, 40\)"):
        quantize_triton(torch.zeros(4, 40, device=DEVICE))
    with pytest.raises(TypeError, match="float16"):
        dequantize_triton(q, torch.float16)


def test_quantize_runs_the_kernel_it_picks_and_the_kernels_agree(monkeypatch):
    """``kernel="auto"`` is Triton on CUDA and the torch reference elsewhere; ``triton`` and
    ``torch`` run what they name (seen through spies on both implementations), and the two
    give the same bits."""
    import mxfp8_ep.kernels.quantize as quantize_module
    import mxfp8_ep.kernels.triton_kernels as triton_module

    ran = []
    for module, name, tag in ((triton_module, "quantize_triton", "triton"),
                              (quantize_module, "quantize_reference", "torch"),
                              (triton_module, "dequantize_triton", "triton"),
                              (quantize_module, "dequantize_reference", "torch")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _tag=tag, **k: ran.append(_tag) or _f(*a, **k))
    x = random_input(24, 128, torch.bfloat16, seed=11).to(DEVICE)
    picked = "triton" if DEVICE == "cuda" else "torch"
    results = {}
    for kernel, expected in (("auto", picked), ("triton", "triton"), ("torch", "torch")):
        ran.clear()
        q = quantize(x, kernel=kernel)
        results[kernel] = (q, dequantize(q, kernel=kernel))
        assert ran == [expected, expected], (kernel, ran)
    for kernel in ("auto", "triton"):
        assert_bits_equal(results[kernel][0].data, results["torch"][0].data)
        assert_bits_equal(results[kernel][0].scale, results["torch"][0].scale)
        assert_bits_equal(results[kernel][1], results["torch"][1], nan_equal=True)
    with pytest.raises(ValueError, match="kernel"):
        quantize(x, kernel="cuda")


def test_kernels_compile_for_hopper_without_ue8m0_cvt():
    """Every kernel compiles to a cubin for sm_90 on this machine (Triton ships ptxas; the
    interpreter accepts code the GPU compiler rejects), and the PTX builds e8m0 bytes without
    the `cvt ... .ue8m0x2` that ptxas rejects for sm_90a (the reason torchao 0.18's MXFP8
    quantizer does not run on Hopper). The quantizing kernels use the hardware e4m3
    conversion, and the symm push and receive kernels store rows as 16-byte vectors (a scalar
    store per element to a peer costs most of NVLink's bandwidth). Runs in a fresh process:
    this one may have the Triton interpreter on."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_compile_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"quantize_bf16_rceil", "dequantize_bf16", "push_mxfp8", "push_bf16", "push_tokens_mxfp8_w2",
            "receive_mxfp8", "receive_mxfp8_stage_row", "receive_bf16_stage_row", "reduce_mxfp8",
            "reduce_mxfp8_stage_row", "push_partials_bf16", "reduce_bf16_partials", "push_partials_mxfp8",
            "reduce_mxfp8_partials", "sorted_rows", "expert_rows", "swiglu_backward",
            "push_counts", "routing_histogram_e256", "routing_faults_e256"} <= set(report)
    for name, info in report.items():
        assert info["cubin_bytes"] > 0 and not info["ue8m0_in_ptx"], (name, info)
    for name in ("quantize_bf16_rceil", "quantize_fp32_floor", "push_mxfp8", "push_tokens_mxfp8_w8",
                 "push_tokens_mxfp8_w8_weighted", "push_partials_mxfp8"):
        assert report[name]["hw_e4m3_cvt"], (name, report[name])
    for name in ("push_mxfp8", "push_bf16", "push_tokens_mxfp8_w2", "push_tokens_bf16_w8", "push_partials_bf16",
                 "push_partials_mxfp8",
                 "push_tokens_mxfp8_w2_weighted", "push_tokens_bf16_w2_weighted", "receive_mxfp8",
                 "receive_mxfp8_stage_row", "receive_mxfp8_weighted", "receive_bf16_stage_row",
                 "receive_bf16_stage_row_weighted", "swiglu_backward"):
        assert report[name]["vector_stores"] > 0 and report[name]["scalar_b16_stores"] == 0, (name, report[name])
