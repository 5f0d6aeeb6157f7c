"""The wire formats: how the rows of one all-to-all leg travel between EP ranks.

Each ``WireFormat`` member says, for the code that moves rows:

* its bytes per row (``row_bytes``): a staged row is its wire size. A quantized row is packed:
  its ``D`` element bytes, then its scales (``D / block_size`` of ``scale_bytes`` each), so
  payload and scales travel in one exchange;
* its kernel constants (``kernel_constants``: ``ELEMENT``, ``SCALE``, ``GROUP``), the
  ``tl.constexpr`` arguments with which the push transports' Triton kernels encode and decode
  rows in registers (``triton_kernels``);
* its torch reference (``codec``: a module with ``encode_rows`` / ``decode_rows``), which the
  kernels' torch twins use and which defines the arithmetic the kernels match bit for bit.

This module is the one place that tells formats apart by name; it imports no torch, so the
recipe's validation (``launch/``) reads it before anything heavy starts.

Adding a format: a member here (with its element and scale facts below, for a new ``ELEMENT``
/ ``SCALE``), its reference module (``codec``), its in-register encode / decode in
``triton_kernels``, its default launch shapes (``launch_shapes``), and its name in the recipe's
``a2a`` config. The quantization telemetry (``numerics``) and the unfused all-to-all
(``all_to_all``, through ``quantize``) measure and quantize MXFP8: a format of other elements or
scales needs theirs too.
"""

from __future__ import annotations

import importlib
import inspect
from enum import StrEnum
from types import ModuleType

# Kernel constants. ELEMENT: how each element travels.
ELEMENT_ACTIVATION = 0  # as the activation's own dtype (bf16 or fp32)
ELEMENT_E4M3 = 1  # one float8 e4m3 byte
# SCALE: how the scale of each block of ``block_size`` elements travels.
SCALE_NONE = 0
SCALE_E8M0 = 1  # one byte: a biased power-of-two exponent (OCP MX)
_ELEMENT_BYTES = {ELEMENT_E4M3: 1}
_ELEMENT_MAX = {ELEMENT_E4M3: 448.0}  # the largest finite magnitude an element encodes
_SCALE_BYTES = {SCALE_NONE: 0, SCALE_E8M0: 1}
# A scale byte's exponent bias (the block's scale is 2 ** (byte - bias)) and the byte that marks
# a NaN block.
_SCALE_BIAS = {SCALE_E8M0: 127}
_SCALE_NAN = {SCALE_E8M0: 0xFF}
# Columns the kernels group in the innermost axis of a tile when a format has no scale blocks.
UNSCALED_GROUP = 32


class WireFormat(StrEnum):
    """A leg's wire format. A string enum: each member equals its name as the config spells it
    (``WireFormat("mxfp8") is WireFormat.MXFP8``, ``WireFormat.MXFP8 == "mxfp8"``)."""

    def __new__(cls, value: str, element: int, scale: int, block_size: int, codec: str | None, doc: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.element, member.scale, member.block_size, member._codec = element, scale, block_size, codec
        member.__doc__ = inspect.cleandoc(doc)
        return member

    BF16 = ("bf16", ELEMENT_ACTIVATION, SCALE_NONE, 0, None,
            """Rows travel in the activation's own dtype (bf16 or fp32), unquantized: what torchtitan
            sends.""")
    MXFP8 = ("mxfp8", ELEMENT_E4M3, SCALE_E8M0, 32, "mxfp8_ep.format.mxfp8",
             """OCP microscaling FP8: e4m3 elements with one e8m0 scale byte per 32 consecutive
             elements of a row (``mxfp8_ep.format.mxfp8``: the arithmetic, scale rounding ``rceil`` or
             ``floor``). A row of ``D`` elements takes ``D + D / 32`` bytes, about half of bf16's.
             The row width must be a multiple of 32.""")

    @property
    def quantized(self) -> bool:
        """Whether rows are encoded for the wire (else they travel as they are)."""
        return self.element != ELEMENT_ACTIVATION

    @property
    def scale_bytes(self) -> int:
        """Bytes of one block's scale (0: no scales)."""
        return _SCALE_BYTES[self.scale]

    @property
    def element_max(self) -> float:
        """The largest finite magnitude of an encoded element (a quantized format's)."""
        return _ELEMENT_MAX[self._encoded().element]

    @property
    def scale_bias(self) -> int:
        """The exponent bias of a scale byte: a block's scale is ``2 ** (byte - scale_bias)``."""
        return _SCALE_BIAS[self._encoded().scale]

    @property
    def scale_nan(self) -> int:
        """The scale byte that marks a block as NaN."""
        return _SCALE_NAN[self._encoded().scale]

    def _encoded(self) -> WireFormat:
        if not self.quantized:
            raise ValueError(f"wire format {self.value} is not quantized: its elements and scales are not encoded")
        return self

    def element_bytes(self, dim: int, itemsize: int) -> int:
        """Bytes of a row's ``dim`` elements (``itemsize``: the activation dtype's)."""
        return dim * (_ELEMENT_BYTES[self.element] if self.quantized else itemsize)

    def row_bytes(self, dim: int, itemsize: int) -> int:
        """Bytes one row of ``dim`` elements takes on the wire (and in a staging buffer): its
        elements, then (quantized) its scales; ``itemsize``: the activation dtype's."""
        scales = dim // self.block_size * self.scale_bytes if self.quantized else 0
        return self.element_bytes(dim, itemsize) + scales

    def dim_error(self, dim: int) -> str | None:
        """Why rows of ``dim`` elements cannot travel in this format, or None."""
        if self.quantized and dim % self.block_size:
            return f"{self.value} needs a row width that is a multiple of {self.block_size}, got dim {dim}"
        return None

    def kernel_constants(self) -> dict[str, int]:
        """The Triton kernels' ``tl.constexpr`` arguments for a leg in this format: ``ELEMENT``,
        ``SCALE`` and ``GROUP`` (columns per block: the innermost axis of a kernel's tile)."""
        return {"ELEMENT": self.element, "SCALE": self.scale, "GROUP": self.block_size or UNSCALED_GROUP}

    def codec(self) -> ModuleType:
        """The torch reference of a quantized format: a module with ``encode_rows(x, rounding)
        -> (element bytes, scale bytes)`` (uint8, ``(rows, D)`` and ``(rows, D / block_size *
        scale_bytes)``) and ``decode_rows(elements, scales, dtype)``. Imported when first asked
        for, so that this module needs no torch."""
        if self._codec is None:
            raise ValueError(f"wire format {self.value} is not quantized: it has no codec")
        return importlib.import_module(self._codec)


def wire_format(name: str | WireFormat) -> WireFormat:
    """The format named ``name``; a clear error for an unknown name."""
    try:
        return WireFormat(name)
    except ValueError:
        raise ValueError(f"unknown wire format {name!r}; known: {[f.value for f in WireFormat]}") from None


WIRE_FORMATS: tuple[str, ...] = tuple(f.value for f in WireFormat)


def quantized_formats(names) -> list[WireFormat]:
    """The quantized formats among ``names`` (e.g. a config's legs), in order, each once; names
    that are no wire format are left out."""
    found = [WireFormat(n) for n in names if isinstance(n, str) and n in WIRE_FORMATS]
    return list(dict.fromkeys(f for f in found if f.quantized))
