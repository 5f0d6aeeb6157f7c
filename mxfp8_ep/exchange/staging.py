"""The staging buffer: where the push transports' rows wait for their reader, and its layout.

A *staging* buffer is a byte buffer of rows, indexed by row: the one a rank receives pushed
rows in (symm: peers write into it), or the send / receive buffer of an all-to-all (nccl: a
``peer_memory.LocalBuffer``, whose every peer is itself). A row takes its wire format's
``row_bytes``: unquantized, ``D`` elements of the activation dtype; quantized, packed: its
``D`` element bytes, then its scale bytes (payload and scales of a row travel together, so one
exchange carries both). The Triton kernels (``symm_kernels``) and their torch twins
(``symm_reference``) read and write this layout; the twins encode and decode rows with the
format's reference (``WireFormat.codec``): ``encode_rows``, ``store_rows``, ``decode_rows``.

Where a receiving pass reads a row: by default the staged row with the index of the row it
fills (symm: peers push each row to the index its reader uses); with ``stage_row``, the
staged row ``stage_row[i]`` (nccl: the row's place in the rank-major receive buffer; symm after
``push_tokens``: the token map, each expert row's token at row ``source * max_tokens + token``).
A symm staging buffer holds its rows, then the token map (``token_map_offset``), then the row
weights (``row_weights``: a weighted token-once push leaves each row's routing weight there).

A leg's kernels take what they share about its staging as one ``StagedLeg``: the buffer, its
rows and layout, this rank, and how rows are encoded there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from mxfp8_ep.exchange.capacity import staging_buffer_bytes, token_map_byte_offset
from mxfp8_ep.kernels.launch_shapes import KernelShapes, LaunchShape
from mxfp8_ep.format.wire_format import WireFormat, wire_format

if TYPE_CHECKING:
    from mxfp8_ep.exchange.peer_memory import LocalBuffer, PeerBuffer


@dataclass(frozen=True)
class StagedLeg:
    """What the push and receiving kernels of one leg share (``symm_kernels`` and their twins
    ``symm_reference``): the staging buffer its rows wait in and its layout, this rank, the
    wire format and how rows are encoded in it, and the kernels' launch shapes."""

    staging: PeerBuffer | LocalBuffer  # this rank's view: its own buffer (``local``) and its peers'
    rows: int  # staged rows the buffer holds
    rank: int
    fmt: WireFormat  # a format or its name
    rounding: str = "rceil"  # a quantized format's scale rounding
    # Rows that stay on this rank go through the wire format as a peer decodes them
    # (``A2AConfig.quantize_local_rows``; the kernels that store such rows).
    quantize_local: bool = False
    shapes: KernelShapes | None = None  # the kernels' launch shapes (None: the format's defaults)
    # symm's token-major rows (``push_tokens``, ``push_partials``): rank r's token t at staged
    # row ``r * tokens_per_rank + t``; the token map and row weights of ``map_rows`` expert rows
    # at byte ``map_offset`` (``token_map``, ``row_weights``).
    tokens_per_rank: int = 0
    map_offset: int = 0
    map_rows: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", wire_format(self.fmt))

    def launch(self, kernel: str) -> LaunchShape:
        """The launch shape of ``kernel`` (a ``KernelShapes`` field) for this leg."""
        return getattr(self.shapes or KernelShapes.default(self.fmt), kernel)

    def launched_at(self, kernel: str, shape: LaunchShape | None) -> StagedLeg:
        """This leg with ``kernel`` launched at ``shape`` (None: as it is), for a launch sweep."""
        if shape is None:
            return self
        return replace(self, shapes=replace(self.shapes or KernelShapes.default(self.fmt), **{kernel: shape}))

    def views(self, buf: torch.Tensor, dim: int, dtype: torch.dtype):
        """``staging_views`` of ``buf`` (this leg's buffer or a peer's) in this leg's layout."""
        return staging_views(buf, self.rows, dim, dtype, self.fmt)

    def token_map(self, buf: torch.Tensor) -> torch.Tensor:
        """The token map of ``buf`` (this leg's buffer or a peer's)."""
        return token_map(buf, self.map_offset, self.map_rows)

    def row_weights(self, buf: torch.Tensor) -> torch.Tensor:
        """The row weights of ``buf`` (this leg's buffer or a peer's)."""
        return row_weights(buf, self.map_offset, self.map_rows)


def staged_row_nbytes(dim: int, dtype: torch.dtype, fmt: str) -> int:
    """Bytes of one staged row of ``dim`` elements in wire format ``fmt`` (its wire size)."""
    return WireFormat(fmt).row_bytes(dim, torch.empty((), dtype=dtype).element_size())


def staging_nbytes(rows: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes of a staging buffer that holds ``rows`` rows in any format."""
    return rows * max(staged_row_nbytes(dim, dtype, fmt) for fmt in WireFormat)


def token_map_offset(rows: int, dim: int, dtype: torch.dtype) -> int:
    """Byte offset of the token map in a symm staging buffer of ``rows`` rows: after the rows,
    16-byte aligned. The map holds one int64 per expert-major row of the receiving rank: the
    staged row a token-major push (``push_tokens``) put that row's token in."""
    return token_map_byte_offset(rows, staging_nbytes(1, dim, dtype))


def token_map(buf: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    """The ``rows``-entry int64 token map at byte ``offset`` of a staging buffer."""
    return buf[offset : offset + rows * 8].view(torch.int64)


def row_weights(buf: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    """The ``rows``-entry fp32 row weights right after the token map at byte ``offset``: a
    weighted ``push_tokens`` leaves each expert row's routing weight there."""
    start = offset + rows * 8
    return buf[start : start + rows * 4].view(torch.float32)


def staging_buffer_nbytes(rows: int, dim: int, dtype: torch.dtype, map_rows: int) -> int:
    """Bytes of a symm staging buffer: ``rows`` staged rows, then the token map and the row
    weights of ``map_rows`` expert rows."""
    return staging_buffer_bytes(rows, staging_nbytes(1, dim, dtype), map_rows)


def staging_views(buf: torch.Tensor, rows: int, dim: int, dtype: torch.dtype, fmt: str):
    """Views of the first ``rows`` rows of a staging byte buffer: ``(values,)`` (``rows x
    dim`` in ``dtype``) for an unquantized format, ``(element bytes, scale bytes)`` (strided
    views of the packed rows) for a quantized one."""
    wire = WireFormat(fmt)
    nbytes = staged_row_nbytes(dim, dtype, wire)
    if wire.quantized:
        packed = buf[: rows * nbytes].view(rows, nbytes)
        elements = wire.element_bytes(dim, 1)
        return packed[:, :elements], packed[:, elements:]
    return (buf[: rows * nbytes].view(dtype).view(rows, dim),)


def encode_rows(values: torch.Tensor, rounding: str, fmt: str):
    """``values`` as a quantized format puts them on the wire (``codec.encode_rows``), or None
    for an unquantized one (the rows travel as they are)."""
    wire = WireFormat(fmt)
    return wire.codec().encode_rows(values, rounding) if wire.quantized else None


def store_rows(buf, staging_rows: int, at: torch.Tensor, values: torch.Tensor, encoded, sel: torch.Tensor, fmt: str):
    """Rows ``values[sel]`` (quantized: their ``encoded`` form, ``encode_rows``) into rows
    ``at[sel]`` of a staging byte buffer."""
    views = staging_views(buf, staging_rows, values.shape[1], values.dtype, fmt)
    parts = encoded if encoded is not None else (values,)
    for view, part in zip(views, parts, strict=True):
        view[at[sel]] = part[sel]


def decode_rows(views, rows: torch.Tensor, dtype: torch.dtype, fmt: str) -> torch.Tensor:
    """Rows ``rows`` of a staging buffer's ``views`` (``staging_views``) as ``dtype``."""
    wire = WireFormat(fmt)
    if wire.quantized:
        elements, scales = views
        return wire.codec().decode_rows(elements[rows], scales[rows], dtype)
    return views[0][rows]


def round_trip_rows(values: torch.Tensor, rounding: str, fmt: str) -> torch.Tensor:
    """``values`` as a receiving pass decodes them after the wire (``encode_rows`` then
    ``decode_rows``): the rows that stay on their rank under ``A2AConfig.quantize_local_rows``.
    An unencoded format returns them as they are."""
    wire = WireFormat(fmt)
    if not wire.quantized:
        return values
    codec = wire.codec()
    return codec.decode_rows(*codec.encode_rows(values, rounding), values.dtype)
