"""Compile the MXFP8 Triton kernels for sm_90 (Hopper) without a GPU and print a JSON report.
Used by tests/test_triton_kernels.py; must run without TRITON_INTERPRET."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mxfp8_ep import triton_kernels as tk  # noqa: E402

QUANT = {"x_ptr": None, "data_ptr": "*u8", "scale_ptr": "*u8", "M": "i32", "K": "i32",
         "IN_BF16": "constexpr", "ROUNDING": "constexpr", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr"}
DEQUANT = {"data_ptr": "*u8", "scale_ptr": "*u8", "out_ptr": None, "M": "i32", "K": "i32",
           "OUT_BF16": "constexpr", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr"}
CASES = {
    "quantize_bf16_rceil": (tk._quantize_kernel, {**QUANT, "x_ptr": "*i16"}, {"IN_BF16": True, "ROUNDING": 0}),
    "quantize_fp32_floor": (tk._quantize_kernel, {**QUANT, "x_ptr": "*fp32"}, {"IN_BF16": False, "ROUNDING": 1}),
    "dequantize_bf16": (tk._dequantize_kernel, {**DEQUANT, "out_ptr": "*i16"}, {"OUT_BF16": True}),
    "dequantize_fp32": (tk._dequantize_kernel, {**DEQUANT, "out_ptr": "*fp32"}, {"OUT_BF16": False}),
}

report = {}
for name, (fn, signature, consts) in CASES.items():
    consts = {**consts, "BLOCK_M": 16, "BLOCK_K": 256}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    report[name] = {"cubin_bytes": len(compiled.asm["cubin"]), "ue8m0_in_ptx": "ue8m0" in compiled.asm["ptx"]}
print(json.dumps(report))
