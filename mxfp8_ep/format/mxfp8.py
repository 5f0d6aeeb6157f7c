"""MXFP8 (OCP microscaling, e4m3 elements) along the last dim: the torch reference, and the
codec of ``WireFormat.MXFP8`` (``encode_rows`` / ``decode_rows``).

One block = 32 consecutive elements of the last dim, sharing one e8m0 scale byte
(a biased power-of-two exponent: value 2**(byte - 127); byte 0xFF is NaN).

Scale choice (``rounding``):

* ``"rceil"`` (default; cuBLAS, torchao, Hopper/Blackwell ``cvt.rp...ue8m0``):
  ``descale = amax / 448`` in fp32 (IEEE round-to-nearest division), then the scale is the
  smallest power of two >= descale: byte = biased exponent of descale, plus one when its
  mantissa is non-zero. Elements are ``x * 2**(127 - byte)``, which then lie in [-448, 448].
* ``"floor"`` (OCP MX v1.0 spec): ``byte = floor(log2(amax)) - 8 + 127`` read from amax's
  exponent bits; elements are ``x / 2**(byte - 127)`` and can exceed 448 before the
  saturating clamp (up to 512 -> 448): this clipping is why floor can diverge in training.

Elements are clamped to [-448, 448] and rounded to e4m3 with round-to-nearest-even.

Edge cases (bit-identical to torchao 0.18's ``to_mx``):

* all-zero block: scale byte 0 (2**-127), elements 0 (sign of zero kept).
* tiny blocks (amax <= 448 * 2**-127 under rceil): byte 0, elements flush to +-0.
* subnormal inputs: handled by the same arithmetic (fp32 subnormals are not flushed).
* values beyond the e4m3 range: cannot occur under rceil for finite blocks; under floor they
  saturate to +-448.
* +-inf in a block (no NaN): byte 254, the inf element becomes +-448 and dequantizes to
  +-inf again (448 * 2**127 overflows fp32/bf16); the block's finite elements flush to 0.
* NaN anywhere in a block: byte 0xFF (OCP NaN scale), so the whole block dequantizes to NaN.

Dequantization: ``e4m3 * 2**(byte - 127)`` computed in fp32 (exact), then cast to the output
dtype; byte 0xFF gives NaN for the whole block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxfp8_ep.format.wire_format import WireFormat

BLOCK_SIZE = WireFormat.MXFP8.block_size
E4M3_MAX = WireFormat.MXFP8.element_max
E8M0_BIAS = WireFormat.MXFP8.scale_bias
E8M0_NAN = WireFormat.MXFP8.scale_nan
E8M0_INF_SCALE = 0xFE
# floor rule: largest power of two an e4m3 element holds is 2**8 (256 <= 448 < 512).
E4M3_MAX_POW2 = 8
SUPPORTED_INPUT_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class MXFP8Tensor:
    """Quantized payload: ``data`` (float8_e4m3fn, input shape) and ``scale`` (uint8 e8m0
    bytes, shape ``[..., K // 32]``). Scales are kept as raw uint8 bytes because NCCL and gloo
    cannot send float8_e8m0fnu; ``scale_e8m0`` gives the typed view."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def scale_e8m0(self) -> torch.Tensor:
        return self.scale.view(torch.float8_e8m0fnu)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def check_quantizable(x: torch.Tensor) -> None:
    """Raise a clear error for inputs no MXFP8 kernel can take."""
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise TypeError(
            f"MXFP8 quantize takes bfloat16 or float32 input, got {x.dtype} (shape {tuple(x.shape)})"
        )
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"MXFP8 quantize needs the last dim to be a multiple of {BLOCK_SIZE}, "
            f"got shape {tuple(x.shape)}"
        )


def check_rounding(rounding: str) -> None:
    if rounding not in ("rceil", "floor"):
        raise ValueError(f"scale rounding must be 'rceil' or 'floor', got {rounding!r}")


def _fp32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _pow2_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """Exact 2**exp in fp32 for integer exp in [-149, 127] (subnormals included)."""
    exp = exp.to(torch.int32)
    normal = ((exp.clamp(min=-126) + 127) << 23).view(torch.float32)
    subnormal = (torch.ones_like(exp) << (exp.clamp(-149, -127) + 149)).view(torch.float32)
    return torch.where(exp >= -126, normal, subnormal)


def _rceil_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= amax/448 as a biased e8m0 byte (int32 tensor)."""
    descale = amax / E4M3_MAX
    bits = _fp32_bits(descale)
    exp_field = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    # Normal descale: exponent, +1 if not a power of two. Subnormal descale (exp_field 0):
    # descale = m * 2**-149, whose ceil-power is > 2**-127 (byte 1) only when m > 2**22.
    normal = exp_field + (mantissa != 0).to(torch.int32)
    subnormal = (mantissa > (1 << 22)).to(torch.int32)
    byte = torch.where(exp_field == 0, subnormal, normal).clamp(max=E8M0_INF_SCALE)
    return torch.where(torch.isnan(descale), torch.full_like(byte, E8M0_NAN), byte)


def _floor_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    exp_unbiased = ((_fp32_bits(amax) >> 23) & 0xFF) - 127
    byte = (exp_unbiased - E4M3_MAX_POW2).clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    return torch.where(torch.isnan(amax), torch.full_like(byte, E8M0_NAN), byte)


def quantize_reference(x: torch.Tensor, rounding: str = "rceil") -> MXFP8Tensor:
    """Quantize ``x`` along its last dim to MXFP8 with plain torch ops (any device)."""
    check_quantizable(x)
    check_rounding(rounding)
    shape = x.shape
    blocks = x.reshape(*shape[:-1], shape[-1] // BLOCK_SIZE, BLOCK_SIZE).to(torch.float32)
    # amax propagates NaN (torch.amax returns NaN if any element is NaN).
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if rounding == "rceil":
        byte = _rceil_scale_bytes(amax)
        # Multiplier 2**(127 - byte); byte 0 (amax <= 448 * 2**-127) uses 1.0 and byte 0xFF
        # (NaN block) uses NaN, as cuBLAS / TransformerEngine / torchao do.
        multiplier = _pow2_from_exponent(E8M0_BIAS - byte)
        multiplier = torch.where(byte == 0, torch.ones_like(multiplier), multiplier)
        multiplier = torch.where(byte == E8M0_NAN, torch.full_like(multiplier, float("nan")), multiplier)
        scaled = blocks * multiplier
    else:
        byte = _floor_scale_bytes(amax)
        # Divide by 2**(byte-127), never below the smallest normal fp32 (as torchao does).
        divisor = _pow2_from_exponent((byte - E8M0_BIAS).clamp(min=-126))
        divisor = torch.where(byte == E8M0_NAN, torch.full_like(divisor, float("inf")), divisor)
        scaled = blocks / divisor
    # Explicit saturating clamp: eager casts to e4m3 do not saturate on every torch version.
    scaled = scaled.clamp(-E4M3_MAX, E4M3_MAX)
    # One canonical NaN byte (0x7F) whatever the sign of the NaN the arithmetic produced.
    scaled = torch.where(torch.isnan(scaled), torch.full_like(scaled, float("nan")), scaled)
    data = scaled.to(torch.float8_e4m3fn).reshape(shape)
    scale = byte.squeeze(-1).to(torch.uint8)
    return MXFP8Tensor(data=data, scale=scale)


def scale_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (uint8) -> exact fp32 powers of two; 0xFF -> NaN."""
    byte = scale.view(torch.uint8).to(torch.int32)
    value = _pow2_from_exponent(byte - E8M0_BIAS)
    return torch.where(byte == E8M0_NAN, torch.full_like(value, float("nan")), value)


def dequantize_reference(q: MXFP8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP8 -> ``dtype``: ``e4m3 * 2**(byte - 127)`` in fp32 (exact), then one cast."""
    data, scale = q.data, q.scale
    if data.shape[-1] != scale.shape[-1] * BLOCK_SIZE or data.shape[:-1] != scale.shape[:-1]:
        raise ValueError(
            f"MXFP8 data shape {tuple(data.shape)} does not match scale shape {tuple(scale.shape)} "
            f"(expected scale [..., {data.shape[-1]} // {BLOCK_SIZE}])"
        )
    shape = data.shape
    blocks = data.reshape(*shape[:-1], shape[-1] // BLOCK_SIZE, BLOCK_SIZE).to(torch.float32)
    out = blocks * scale_to_fp32(scale).unsqueeze(-1)
    return out.reshape(shape).to(dtype)


def encode_rows(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``WireFormat.MXFP8``'s encoding of rows: their e4m3 bytes and e8m0 scale bytes (uint8)."""
    q = quantize_reference(x, rounding)
    return q.data.view(torch.uint8), q.scale


def decode_rows(elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows from their e4m3 bytes and e8m0 scale bytes (``encode_rows``), as ``dtype``."""
    return dequantize_reference(MXFP8Tensor(elements.view(torch.float8_e4m3fn), scales), dtype)
