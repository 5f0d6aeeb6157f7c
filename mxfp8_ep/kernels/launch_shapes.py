"""Launch shapes of the push transports' Triton kernels (``symm_kernels``): how many rows per
program, how many warps, how wide a column tile. Each kernel wrapper takes its shape from the
leg it runs (``staging.StagedLeg.launch``: the leg's ``KernelShapes``, default
``KernelShapes.default(fmt)``); a dispatcher takes a mapping from leg format to ``KernelShapes``
in its config (``TokenDispatcher.Config.launch_shapes``), so a benchmark can run one dispatcher
at other shapes beside another at the defaults. The torch twins (``symm_reference``) take the
same legs and ignore the shapes.

The defaults are the fastest shapes of the kernel sweeps in ``benchmarks/``. Where a default stores
into a peer, it keeps those stores 16-byte vectors (``st.global.v4``, checked by
``tests/triton_compile_check.py``): 8 bf16 values per thread at 4 warps, 16 e4m3 bytes at 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from mxfp8_ep.format.wire_format import WireFormat, wire_format


def column_tile(dim: int, widest: int = 512, group: int = 32) -> int:
    """Columns per tile (a multiple of ``group``): the largest power of two <= ``widest`` that
    divides ``dim`` (unmasked, vector loads and stores), else a masked tile covering ``dim``."""
    block = widest
    while block >= group:
        if dim % block == 0:
            return block
        block //= 2
    return max(group, min(widest, 1 << max(dim - 1, 0).bit_length()))


def _power_of_two(value: int) -> bool:
    return isinstance(value, int) and value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class LaunchShape:
    """One kernel's launch: ``block`` rows (tokens, token slots) per program, ``warps`` per
    program, and the widest column tile ``block_d`` (the tile is the largest power of two
    <= ``block_d`` that divides the row width, so loads and stores need no column mask).
    ``stripes`` and ``stages`` apply to ``push_rows`` only: it visits its row blocks in that
    many interleaved stripes (programs running at once then hold rows bound for every rank, so
    HBM copies of the rows that stay overlap the stores of the rows that leave), and pipelines
    its column loop over that many stages (1: none)."""

    block: int
    warps: int
    block_d: int = 512
    stripes: int = 1
    stages: int = 1

    def __post_init__(self) -> None:
        for name in ("block", "warps"):
            if not _power_of_two(getattr(self, name)):
                raise ValueError(f"LaunchShape.{name}={getattr(self, name)!r}: expected a power of two")
        if not _power_of_two(self.block_d) or self.block_d < 32:
            raise ValueError(f"LaunchShape.block_d={self.block_d!r}: expected a power of two >= 32")
        for name in ("stripes", "stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LaunchShape.{name}={value!r}: expected an integer >= 1")

    def tile(self, dim: int, group: int) -> int:
        """Columns per tile for rows of ``dim`` elements (``column_tile``)."""
        return column_tile(dim, self.block_d, group)


@dataclass(frozen=True)
class KernelShapes:
    """A launch shape per kernel, for the legs of one format."""

    push_rows: LaunchShape
    push_tokens: LaunchShape
    push_partials: LaunchShape
    receive_rows: LaunchShape
    reduce_slots: LaunchShape

    def __post_init__(self) -> None:
        for f in fields(self):
            shape = getattr(self, f.name)
            if not isinstance(shape, LaunchShape):
                raise TypeError(f"KernelShapes.{f.name}: expected a LaunchShape, got {shape!r}")
            if f.name != "push_rows" and (shape.stripes, shape.stages) != (1, 1):
                raise ValueError(f"KernelShapes.{f.name}: stripes and stages apply to push_rows only, got {shape}")

    @staticmethod
    def default(fmt: str) -> KernelShapes:
        """The shapes the kernels run at for a leg in wire format ``fmt``."""
        return _DEFAULTS[wire_format(fmt)]


def kernel_shapes(overrides: Mapping[str, KernelShapes] | None, fmt: str) -> KernelShapes:
    """``overrides[fmt]`` when given, else the format's defaults."""
    if overrides is not None and fmt in overrides:
        return overrides[fmt]
    return KernelShapes.default(fmt)


# push_rows: 4 rows per program in 8 stripes. receive_rows: dequantizing reads half the bytes
# per row, so MXFP8 takes more rows per program. reduce_slots: MXFP8 takes wider column tiles
# (dequantizing wants more columns per load). push_tokens and push_partials: one token (slot)
# per program, at the warps that keep the stores into peers 16-byte vectors.
_PUSH_ROWS = LaunchShape(block=4, warps=4, stripes=8)
_DEFAULTS = {
    WireFormat.BF16: KernelShapes(
        push_rows=_PUSH_ROWS,
        push_tokens=LaunchShape(block=1, warps=4, block_d=1024),
        push_partials=LaunchShape(block=1, warps=4, block_d=1024),
        receive_rows=LaunchShape(block=4, warps=4),
        reduce_slots=LaunchShape(block=1, warps=4, block_d=512),
    ),
    WireFormat.MXFP8: KernelShapes(
        push_rows=_PUSH_ROWS,
        push_tokens=LaunchShape(block=1, warps=2, block_d=1024),
        push_partials=LaunchShape(block=1, warps=2, block_d=1024),
        receive_rows=LaunchShape(block=8, warps=8),
        reduce_slots=LaunchShape(block=1, warps=4, block_d=1024),
    ),
}
