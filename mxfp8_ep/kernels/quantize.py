"""MXFP8 quantize / dequantize entry points: pick the kernel, expose them as torch.library
custom ops so torch.compile treats them as single opaque nodes (with fake-tensor shapes)."""

from __future__ import annotations

import os

import torch

from mxfp8_ep.config import KERNELS
from mxfp8_ep.format.mxfp8 import (
    BLOCK_SIZE,
    MXFP8Tensor,
    check_quantizable,
    check_rounding,
    dequantize_reference,
    quantize_reference,
)
from mxfp8_ep.format.wire_format import ELEMENT_E4M3, SCALE_E8M0, WireFormat


def encodes(fmt: WireFormat) -> bool:
    """Whether ``quantize`` / ``dequantize`` write and read ``fmt``'s rows: e4m3 elements with one
    e8m0 scale per ``BLOCK_SIZE`` elements."""
    return fmt.quantized and (fmt.element, fmt.scale, fmt.block_size) == (ELEMENT_E4M3, SCALE_E8M0, BLOCK_SIZE)


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``auto`` -> Triton on CUDA, torch reference elsewhere. ``triton`` on CPU needs the
    Triton interpreter (``TRITON_INTERPRET=1`` set before triton is imported)."""
    if kernel == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if kernel == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"kernel='triton' on a {device.type} tensor needs TRITON_INTERPRET=1 "
            "(set before importing triton); use kernel='auto' or 'torch'"
        )
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


@torch.library.custom_op("mxfp8_ep::quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, rounding: str, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    if resolve_kernel(kernel, x.device) == "triton":
        from mxfp8_ep.kernels.triton_kernels import quantize_triton

        q = quantize_triton(x, rounding)
    else:
        q = quantize_reference(x, rounding)
    return q.data, q.scale


@_quantize_op.register_fake
def _(x: torch.Tensor, rounding: str, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ARG001 (the op's)
    data = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    scale = x.new_empty((*x.shape[:-1], x.shape[-1] // BLOCK_SIZE), dtype=torch.uint8)
    return data, scale


@torch.library.custom_op("mxfp8_ep::dequantize", mutates_args=())
def _dequantize_op(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, kernel: str
) -> torch.Tensor:
    q = MXFP8Tensor(data, scale)
    if resolve_kernel(kernel, data.device) == "triton":
        from mxfp8_ep.kernels.triton_kernels import dequantize_triton

        return dequantize_triton(q, dtype)
    return dequantize_reference(q, dtype)


@_dequantize_op.register_fake
def _(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, kernel: str,  # noqa: ARG001 (the op's)
      ) -> torch.Tensor:
    return torch.empty_like(data, dtype=dtype)


def quantize(x: torch.Tensor, rounding: str = "rceil", kernel: str = "auto") -> MXFP8Tensor:
    """Quantize along the last dim (a multiple of 32) to MXFP8."""
    check_quantizable(x)
    check_rounding(rounding)
    data, scale = _quantize_op(x.contiguous(), rounding, kernel)
    return MXFP8Tensor(data, scale)


def dequantize(q: MXFP8Tensor, dtype: torch.dtype = torch.bfloat16, kernel: str = "auto") -> torch.Tensor:
    if dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"MXFP8 dequantize writes bfloat16 or float32, got {dtype}")
    return _dequantize_op(q.data.contiguous(), q.scale.contiguous(), dtype, kernel)
