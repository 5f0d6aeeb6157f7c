"""The wire formats in Triton: MXFP8 quantize / dequantize kernels, bit-identical to
``mxfp8.py``'s reference, and the in-register code with which the push transports' kernels
(``symm_kernels``) encode and decode rows of any format (``_encode_groups``,
``_decode_groups``, ``_packed_offsets``, ``_store_encoded``, ``_load_decoded``), chosen by the
format's kernel constants (``WireFormat.kernel_constants``).

Built for Hopper and up without the ``cvt ... .ue8m0x2`` instruction (ptxas rejects it for
sm_90a): the e8m0 byte comes from integer work on the fp32 bits of ``amax / 448``, and e4m3
elements are rounded to nearest-even explicitly in fp32 before the cast, so the cast itself
is exact on every backend. The e4m3 and bf16 bytes are then assembled with integer ops rather
than float casts: ``TRITON_INTERPRET=1`` (CPU, CI) casts to float8 without round-to-nearest-even,
turns NaN into a finite byte, and mishandles bf16 subnormals; the GPU's cvt does not. Building
the bits ourselves makes interpreter, GPU and the torch reference agree bit for bit.

Compiled for a GPU (``HW_CONVERT``), the last steps use the hardware's own conversions
instead: fp32 -> e4m3 (``cvt.rn.satfinite.e4m3x2.f32``, round to nearest even, saturating to
+-448 as the integer path's clamp does), e4m3 -> fp32 (exact) and fp32 -> bf16 (round to
nearest even). They give the same bits as the integer path (NaN is canonicalized by hand) at a
fraction of the instructions; the GPU tests compare them with the torch reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mxfp8_ep.format.mxfp8 import BLOCK_SIZE, MXFP8Tensor, check_quantizable, check_rounding
from mxfp8_ep.format.wire_format import ELEMENT_E4M3, SCALE_E8M0

_RCEIL = 0
_FLOOR = 1
# The kernel constants of WireFormat (``ELEMENT``, ``SCALE``) the kernels compare against.
_E4M3 = tl.constexpr(ELEMENT_E4M3)
_E8M0 = tl.constexpr(SCALE_E8M0)
# MXFP8: elements per e8m0 scale.
_MX_BLOCK = tl.constexpr(BLOCK_SIZE)
# 1.5 * 2**23: adding and subtracting it rounds an fp32 |t| < 2**22 to an integer, ties to even.
_RNE_MAGIC = tl.constexpr(12582912.0)
# Hardware float conversions when compiled for a GPU; integer bit-building in the interpreter.
HW_CONVERT = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _pow2(e):
    """Exact fp32 2**e for int32 e in [-149, 127], subnormals included."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub_shift = tl.minimum(tl.maximum(e, -149), -127) + 149
    subnormal = (tl.full(e.shape, 1, tl.int32) << sub_shift).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, subnormal)


@triton.jit
def _round_to_e4m3_grid(v):
    """Round fp32 |v| <= 448 to the nearest e4m3 value (ties to even); NaN stays NaN."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits; below 2**-6 it is subnormal with a fixed step of 2**-9.
    ulp_exp = tl.maximum(exp, -6) - 3
    inv_ulp = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    ulp = ((127 + ulp_exp) << 23).to(tl.float32, bitcast=True)
    steps = (a * inv_ulp + _RNE_MAGIC) - _RNE_MAGIC
    rounded = steps * ulp
    # Put the sign bit back with integer ops: Triton's unary minus is 0 - x, which turns
    # -0.0 into +0.0 (and torch keeps the sign of zero).
    sign = bits & (-2147483648)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(r):
    """Byte of an fp32 value that is exactly an e4m3 number (or NaN -> 0x7F)."""
    bits = r.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80)
    a = tl.abs(r)
    exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    normal = ((exp + 7) << 3) | ((a.to(tl.int32, bitcast=True) >> 20) & 0x7)
    subnormal = (a * 512.0).to(tl.int32)  # multiples of 2**-9 below 2**-6: exact 0..7
    byte = tl.where(exp >= -6, normal, subnormal) | sign
    return tl.where(r != r, 0x7F, byte)


@triton.jit
def _e4m3_value(byte):
    """Exact fp32 value of an e4m3 byte (int32 in 0..255); 0x7F / 0xFF -> NaN."""
    exp4 = (byte >> 3) & 0xF
    m3 = byte & 0x7
    normal = (((exp4 + 120) << 23) | (m3 << 20)).to(tl.float32, bitcast=True)
    subnormal = m3.to(tl.float32) * 0.001953125  # m3 * 2**-9, exact
    mag = tl.where(exp4 == 0, subnormal, normal)
    value = (mag.to(tl.int32, bitcast=True) | ((byte & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((byte & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _bf16_bits(v):
    """fp32 -> bf16 bits (int32 in 0..0xFFFF), round to nearest even (subnormals too); NaN -> 0x7FC0."""
    if HW_CONVERT:
        bits = v.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        raw = v.to(tl.int32, bitcast=True)
        bits = ((raw + 0x7FFF + ((raw >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(v != v, 0x7FC0, bits)


@triton.jit
def _tile_offsets(M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_K] element tile of a row-major [M, K] tensor and the
    matching [BLOCK_M, BLOCK_K // 32] tile of its [M, K // 32] MXFP8 scales: offsets and masks."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    groups = tl.program_id(1) * (BLOCK_K // _MX_BLOCK) + tl.arange(0, BLOCK_K // _MX_BLOCK)
    row_ok = rows[:, None] < M
    offs = rows[:, None].to(tl.int64) * K + cols[None, :]
    soffs = rows[:, None].to(tl.int64) * (K // _MX_BLOCK) + groups[None, :]
    return offs, row_ok & (cols[None, :] < K), soffs, row_ok & (groups[None, :] < K // _MX_BLOCK)


@triton.jit
def _quantize_groups(x3, ROUNDING: tl.constexpr):
    """Quantize fp32 ``[..., G, 32]`` blocks to MXFP8: e4m3 bytes (int32, same shape) and e8m0
    scale bytes (int32, ``[..., G]``), bit-identical to ``mxfp8.quantize_reference``."""
    # One integer max over |x|'s bits: non-negative floats order as their bits do, and every
    # NaN's bits lie above inf's (tl.max over floats would drop NaN on GPU).
    amax_bits = tl.max(x3.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    has_nan = amax_bits > 0x7F800000
    amax = amax_bits.to(tl.float32, bitcast=True)
    if ROUNDING == 0:
        descale = tl.math.div_rn(amax, 448.0)
        bits = descale.to(tl.int32, bitcast=True)
        exp_field = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        normal = exp_field + (mantissa != 0).to(tl.int32)
        subnormal = (mantissa > (1 << 22)).to(tl.int32)
        byte = tl.minimum(tl.where(exp_field == 0, subnormal, normal), 254)
        multiplier = _pow2(127 - byte)
        multiplier = tl.where(byte == 0, 1.0, multiplier)
        multiplier = tl.where(has_nan, float("nan"), multiplier)
        byte = tl.where(has_nan, 255, byte)
        scaled = x3 * multiplier[:, :, None]
    else:
        exp_unbiased = ((amax_bits >> 23) & 0xFF) - 127
        byte = tl.minimum(tl.maximum(exp_unbiased - 8, -127), 128) + 127
        byte = tl.where(has_nan, 255, byte)
        divisor = _pow2(tl.maximum(byte - 127, -126))
        divisor = tl.where(has_nan, float("inf"), divisor)
        scaled = tl.math.div_rn(x3, divisor[:, :, None])
    if HW_CONVERT:
        # cvt.rn.satfinite saturates to +-448 itself (infinities too); NaN is canonicalized here.
        e4m3 = scaled.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
        e4m3 = tl.where(scaled != scaled, 0x7F, e4m3)
    else:
        # Saturating clamp that keeps NaN (comparisons with NaN are false).
        scaled = tl.where(scaled > 448.0, 448.0, scaled)
        scaled = tl.where(scaled < -448.0, -448.0, scaled)
        e4m3 = _e4m3_bits(_round_to_e4m3_grid(scaled))
    return e4m3, byte


@triton.jit
def _bf16_bits_to_fp32(raw):
    """Loaded bf16 bits (int16) -> exact fp32 (bf16 bits are the top half of fp32 bits)."""
    return ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_activation(v, IN_BF16: tl.constexpr):
    """fp32 -> the fp32 value of its bf16 rounding (when the activations are bf16)."""
    if IN_BF16:
        v = _bf16_bits_to_fp32(_bf16_bits(v))
    return v


@triton.jit
def _load_fp32(ptr, offs, mask, IN_BF16: tl.constexpr):
    """Load bf16 (as int16 bits) or fp32 values as exact fp32."""
    if IN_BF16:
        value = _bf16_bits_to_fp32(tl.load(ptr + offs, mask=mask, other=0))
    else:
        value = tl.load(ptr + offs, mask=mask, other=0.0)
    return value


@triton.jit
def _store_fp32(ptr, offs, value, mask, IN_BF16: tl.constexpr):
    """Store fp32 values as bf16 (int16 bits, round to nearest even) or as fp32."""
    if IN_BF16:
        tl.store(ptr + offs, _bf16_bits(value).to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, value, mask=mask)


@triton.jit
def _dequantize_groups(data, byte):
    """e4m3 bytes ``[..., G, 32]`` and e8m0 bytes ``[..., G]`` (int32) -> exact fp32."""
    scale = tl.where(byte == 255, float("nan"), _pow2(byte - 127))
    if HW_CONVERT:
        value = data.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        value = _e4m3_value(data)
    return value * scale[:, :, None]


# The formats' in-register code. A quantized row in a staging buffer is packed: its D element
# bytes, then its D // GROUP scale bytes (``WireFormat.row_bytes``). Tiles are
# [rows, BLOCK_D // GROUP, GROUP]: one scale block per innermost row.


@triton.jit
def _encode_groups(x3, ELEMENT: tl.constexpr, SCALE: tl.constexpr, ROUNDING: tl.constexpr):
    """fp32 ``[..., G, GROUP]`` blocks in a quantized wire format: element codes (int32, same
    shape) and scale codes (int32, ``[..., G]``). ``ROUNDING``: how MXFP8 picks its scales."""
    tl.static_assert(ELEMENT == _E4M3, "the quantized formats have e4m3 elements")
    tl.static_assert(SCALE == _E8M0, "the quantized formats have e8m0 scales")
    return _quantize_groups(x3, ROUNDING)


@triton.jit
def _decode_groups(elements, scales, ELEMENT: tl.constexpr, SCALE: tl.constexpr):
    """Element codes ``[..., G, GROUP]`` and scale codes ``[..., G]`` (int32) -> exact fp32."""
    tl.static_assert(ELEMENT == _E4M3, "the quantized formats have e4m3 elements")
    tl.static_assert(SCALE == _E8M0, "the quantized formats have e8m0 scales")
    return _dequantize_groups(elements, scales)


@triton.jit
def _packed_offsets(rows, cols, start, D: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
                    ELEMENT: tl.constexpr, SCALE: tl.constexpr):
    """Byte offsets of a tile in a packed staging buffer: the element bytes [rows, BLOCK_D //
    GROUP, GROUP], the scale bytes [rows, BLOCK_D // GROUP], and which scales exist."""
    tl.static_assert(ELEMENT == _E4M3, "one byte per element")
    tl.static_assert(SCALE == _E8M0, "one byte per scale")
    base = rows.to(tl.int64) * (D + D // GROUP)
    groups = start // GROUP + tl.arange(0, BLOCK_D // GROUP)
    return base[:, None, None] + cols, base[:, None] + D + groups[None, :], (groups < D // GROUP)[None, :]


@triton.jit
def _store_encoded(ptr, element_delta, scale_delta, element_offsets, scale_offsets, elements, scales, mask,
                   scale_mask, ELEMENT: tl.constexpr, SCALE: tl.constexpr):
    """Encoded elements and scales (``_encode_groups``) at ``ptr`` plus a delta (a peer's
    buffer) plus their byte offsets (``_packed_offsets``)."""
    tl.static_assert(ELEMENT == _E4M3, "one byte per element")
    tl.static_assert(SCALE == _E8M0, "one byte per scale")
    tl.store(ptr + element_delta + element_offsets, elements.to(tl.uint8), mask=mask)
    tl.store(ptr + scale_delta + scale_offsets, scales.to(tl.uint8), mask=scale_mask)


@triton.jit
def _load_decoded(ptr, element_offsets, scale_offsets, mask, scale_mask, ELEMENT: tl.constexpr, SCALE: tl.constexpr):
    """Packed rows' elements and scales (at ``ptr`` plus ``_packed_offsets``) decoded to exact fp32."""
    elements = tl.load(ptr + element_offsets, mask=mask, other=0).to(tl.int32)
    scales = tl.load(ptr + scale_offsets, mask=scale_mask, other=127).to(tl.int32)
    return _decode_groups(elements, scales, ELEMENT, SCALE)


@triton.jit
def _quantize_kernel(
    x_ptr, data_ptr, scale_ptr, M, K,
    IN_BF16: tl.constexpr, ROUNDING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    GROUPS: tl.constexpr = BLOCK_K // _MX_BLOCK
    offs, mask, soffs, smask = _tile_offsets(M, K, BLOCK_M, BLOCK_K)
    if IN_BF16:
        x = _bf16_bits_to_fp32(tl.load(x_ptr + offs, mask=mask, other=0))
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    e4m3, byte = _quantize_groups(tl.reshape(x, (BLOCK_M, GROUPS, _MX_BLOCK)), ROUNDING)
    data = tl.reshape(e4m3, (BLOCK_M, BLOCK_K))
    tl.store(data_ptr + offs, data.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + soffs, byte.to(tl.uint8), mask=smask)


@triton.jit
def _dequantize_kernel(
    data_ptr, scale_ptr, out_ptr, M, K,
    OUT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    GROUPS: tl.constexpr = BLOCK_K // _MX_BLOCK
    offs, mask, soffs, smask = _tile_offsets(M, K, BLOCK_M, BLOCK_K)
    data = tl.reshape(tl.load(data_ptr + offs, mask=mask, other=0).to(tl.int32), (BLOCK_M, GROUPS, _MX_BLOCK))
    byte = tl.load(scale_ptr + soffs, mask=smask, other=127).to(tl.int32)
    out = tl.reshape(_dequantize_groups(data, byte), (BLOCK_M, BLOCK_K))
    if OUT_BF16:
        tl.store(out_ptr + offs, _bf16_bits(out).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, tl.where(out != out, float("nan"), out), mask=mask)


def rounding_code(rounding: str) -> int:
    """The kernels' ``ROUNDING`` for an MXFP8 scale rounding (``rceil`` or ``floor``)."""
    return _RCEIL if rounding == "rceil" else _FLOOR


def _grid_blocks(K: int) -> tuple[int, int]:
    block_k = min(256, triton.next_power_of_2(K))
    return 16, max(block_k, BLOCK_SIZE)


def quantize_triton(x: torch.Tensor, rounding: str = "rceil") -> MXFP8Tensor:
    check_quantizable(x)
    check_rounding(rounding)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    M, K = x2.shape
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, K // BLOCK_SIZE), dtype=torch.uint8, device=x.device)
    if M > 0:
        block_m, block_k = _grid_blocks(K)
        grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k))
        _quantize_kernel[grid](
            x2.view(torch.int16) if x.dtype == torch.bfloat16 else x2,
            data.view(torch.uint8), scale, M, K,
            IN_BF16=x.dtype == torch.bfloat16,
            ROUNDING=rounding_code(rounding), BLOCK_M=block_m, BLOCK_K=block_k,
        )
    return MXFP8Tensor(data.reshape(shape), scale.reshape(*shape[:-1], K // BLOCK_SIZE))


def dequantize_triton(q: MXFP8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"MXFP8 dequantize writes bfloat16 or float32, got {dtype}")
    shape = q.data.shape
    K = shape[-1]
    data = q.data.reshape(-1, K).contiguous()
    scale = q.scale.reshape(-1, K // BLOCK_SIZE).contiguous()
    M = data.shape[0]
    out = torch.empty((M, K), dtype=dtype, device=data.device)
    if M > 0:
        block_m, block_k = _grid_blocks(K)
        grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k))
        out_bits = out.view(torch.int16) if dtype == torch.bfloat16 else out
        _dequantize_kernel[grid](
            data.view(torch.uint8), scale, out_bits, M, K,
            OUT_BF16=dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_K=block_k,
        )
    return out.reshape(shape)
