"""Routed experts (torchtitan's SwiGLU ``GroupedExperts`` math) over an expert-major buffer with
a static row capacity, as the symm dispatcher returns it.

The dispatcher cannot size its output to the rows it received without a host sync, so the
buffer holds the drop-free worst case and its tail rows are unused. ``torch._grouped_mm`` only
touches rows inside its group offsets, but torch's elementwise ops would touch every row: twice
the work at EP=2 under even routing, more at larger EP. Here the activation ``silu(x w1) * x w3``,
and its backward run as Triton kernels over the rows inside the offsets only (the count is
read on the device); rows past the offsets are left unwritten, and nothing downstream reads
them. The same holds for the sum of the two input-gradient GEMMs (``x`` feeds both ``w1`` and
``w3``): ``_ForkRows`` hands ``x`` to them as two outputs and adds their gradients over the
valid rows only, where autograd's own accumulation would add every row.

Numerics are torch's: silu and the product are each rounded to the activation dtype, as the
two eager ops round; backward follows torch's ``silu_backward`` and ``mul`` formulas.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfp8_ep.kernels.launch_shapes import column_tile
from mxfp8_ep.kernels.triton_kernels import _load_fp32, _round_to_activation, _store_fp32


def grouped_swiglu(x, w1, w2, w3, tokens_per_expert):
    """``y = (silu(x @ w1_e^T) * (x @ w3_e^T)) @ w2_e^T`` for each expert ``e``'s rows of ``x``
    (``tokens_per_expert`` rows each, in order); rows past their sum are ignored. The grouped
    GEMMs and their gradients are torch's (autograd of ``torch._grouped_mm``)."""
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    x1, x3 = _ForkRows.apply(x, offsets)
    h1 = torch._grouped_mm(x1, w1.transpose(-2, -1), offs=offsets)
    h3 = torch._grouped_mm(x3, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(_SiluMul.apply(h1, h3, offsets), w2.transpose(-2, -1), offs=offsets)


def grouped_swiglu_experts(x, w1, w2, w3, tokens_per_expert):
    """``grouped_swiglu`` as an experts module runs it on its parameters: DTensor weights as
    their local shards, inputs and weights in bf16, the result in ``x``'s dtype (torchtitan's
    grouped-GEMM experts, 0.2.2 and 0.3.0 alike)."""
    w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (w1, w2, w3))
    return grouped_swiglu(x.bfloat16(), w1.bfloat16(), w2.bfloat16(), w3.bfloat16(), tokens_per_expert).type_as(x)


class _SiluMul(torch.autograd.Function):
    """``silu(h1) * h3`` on the rows inside the offsets."""

    @staticmethod
    def forward(ctx, h1, h3, offsets):
        ctx.save_for_backward(h1, h3, offsets)
        return _silu_mul(h1, h3, offsets)

    @staticmethod
    def backward(ctx, dh):
        h1, h3, offsets = ctx.saved_tensors
        dh1, dh3 = _silu_mul_backward(dh.contiguous(), h1, h3, offsets)
        return dh1, dh3, None


class _ForkRows(torch.autograd.Function):
    """``x`` as two outputs (views) for the two GEMMs that read it; backward adds their
    gradients on the rows inside the offsets (bf16: one fp32 add and one rounding, as torch's
    ``add``)."""

    @staticmethod
    def forward(ctx, x, offsets):
        ctx.save_for_backward(offsets)
        return x.view_as(x), x.view_as(x)

    @staticmethod
    def backward(ctx, dx1, dx3):
        (offsets,) = ctx.saved_tensors
        if dx1 is None or dx3 is None:
            return (dx3 if dx1 is None else dx1), None
        return _add_rows(dx1.contiguous(), dx3.contiguous(), offsets), None


# --------------------------------------------------------------------------------------------
# Elementwise work over the rows inside the offsets. Triton on CUDA (or under the interpreter),
# torch over all rows elsewhere (identical values on the rows that matter).

# Rows per block and persistent programs per SM: the fastest of a sweep over DeepSeek-V3-like
# rows at EP 2 and 8 (benchmarks/).
_BLOCK_M = 2
_PROGRAMS_PER_SM = 32
# Under the Triton interpreter (CPU tests) each program runs in Python: fewer, larger ones.
_INTERPRETER_BLOCK_M = 64
_INTERPRETER_PROGRAMS = 3  # all programs, under the interpreter


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _use_triton(t: torch.Tensor) -> bool:
    import os

    return t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _silu(a):
    return a / (1.0 + tl.exp(-a))


@triton.jit
def _rows_kernel(
    a_ptr, b_ptr, c_ptr, out1_ptr, out2_ptr, valid_ptr,
    N: tl.constexpr, OP: tl.constexpr, IN_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """OP 0: out1 = silu(a) * b.  OP 1 (a = dh, b = h1, c = h3): out1 = dh1, out2 = dh3.
    OP 2: out1 = a + b.

    Persistent: the programs stride over the row blocks inside the offsets (``valid``, read on
    the device), so the grid does not grow with the buffer's capacity (at EP=8 eight times the
    rows an even routing fills: programs that found themselves past the offsets would cost more
    than the useful work)."""
    valid = tl.load(valid_ptr)
    block = tl.program_id(0)
    # A while loop: the Triton interpreter cannot take a range bound loaded from memory.
    while block * BLOCK_M < valid:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < valid
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            if N % BLOCK_N == 0:  # no column mask: 16-byte vector loads and stores
                mask = row_ok[:, None] & tl.full((1, BLOCK_N), 1, tl.int1)
            else:
                mask = row_ok[:, None] & (cols < N)[None, :]
            offs = rows[:, None].to(tl.int64) * N + cols[None, :]
            a = _load_fp32(a_ptr, offs, mask, IN_BF16)
            b = _load_fp32(b_ptr, offs, mask, IN_BF16)
            if OP == 0:
                _store_fp32(out1_ptr, offs, _round_to_activation(_silu(a), IN_BF16) * b, mask, IN_BF16)
            elif OP == 1:
                h3 = _load_fp32(c_ptr, offs, mask, IN_BF16)
                silu = _round_to_activation(_silu(b), IN_BF16)
                d_silu = _round_to_activation(a * h3, IN_BF16)
                _store_fp32(out2_ptr, offs, a * silu, mask, IN_BF16)
                sig = 1.0 / (1.0 + tl.exp(-b))
                _store_fp32(out1_ptr, offs, d_silu * sig * (1.0 + b * (1.0 - sig)), mask, IN_BF16)
            elif OP == 2:
                _store_fp32(out1_ptr, offs, a + b, mask, IN_BF16)
        block += tl.num_programs(0)


def _launch(op, a, b, c, out1, out2, offsets):
    rows, n = a.shape
    if rows == 0:
        return
    bits = (lambda t: t.view(torch.int16)) if a.dtype == torch.bfloat16 else (lambda t: t)
    block_n = column_tile(n)
    block_m = _BLOCK_M if a.is_cuda else _INTERPRETER_BLOCK_M
    grid = (min(triton.cdiv(rows, block_m), _programs(a.device)),)
    _rows_kernel[grid](
        bits(a), bits(b), bits(c), bits(out1), bits(out2), offsets[-1:],
        N=n, OP=op, IN_BF16=a.dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_N=block_n,
    )


def _silu_mul(h1, h3, offsets):
    if not _use_triton(h1):
        return torch.nn.functional.silu(h1) * h3
    out = torch.empty_like(h1)
    _launch(0, h1, h3, h3, out, out, offsets)
    return out


def _silu_mul_backward(dh, h1, h3, offsets):
    if not _use_triton(dh):
        silu = torch.nn.functional.silu(h1)
        return torch.ops.aten.silu_backward(dh * h3, h1), dh * silu
    dh1, dh3 = torch.empty_like(h1), torch.empty_like(h3)
    _launch(1, dh, h1, h3, dh1, dh3, offsets)
    return dh1, dh3


def _add_rows(a, b, offsets):
    """``a + b`` on the rows inside the offsets, written into ``a`` (a gradient autograd hands
    over and reads no more)."""
    if not _use_triton(a):
        return a + b
    _launch(2, a, b, b, a, a, offsets)
    return a
