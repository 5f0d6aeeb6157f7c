"""The two_hop transport's node hop: token rows between the ranks of one local index on every
node (a *rail*), one row per (token, other node that holds one of its experts), at a fixed
capacity of rows per node pair, so that one all-to-all of fixed size moves them and no host
reads a count.

Layout of a rank's send (and receive) buffer: one block per other node, in node order; a block
holds ``capacity`` rows in the leg's wire format (``WireFormat.row_bytes``, padded to
``capacity.NODE_HOP_ROW_ALIGN`` bytes), then per row ``side`` int32 columns
(``capacity.NODE_HOP_SIDE_COLUMNS``: the dispatch's expert ids on that node and router scores as
fp32 bits; the score gradients on the way back). Token ``t``'s row for node ``n`` is row
``position[t, n]`` of block ``n`` (``NodeRows``), where ``position`` counts the tokens before
``t`` bound for ``n``; a token past the capacity is not sent (the dispatch counts that as an
overflow, and its step runs again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mxfp8_ep.exchange.capacity import NODE_HOP_ROW_ALIGN
from mxfp8_ep.exchange.staging import decode_rows, encode_rows, staged_row_nbytes
from mxfp8_ep.format.wire_format import WireFormat
from mxfp8_ep.telemetry import wire_stats



@dataclass(frozen=True)
class NodeRows:
    """Where a rank's tokens go on the node hop: ``bound[t, n]`` token ``t`` has an expert on
    node ``n`` (never this rank's node), ``position[t, n]`` its row in block ``n``, ``sent``
    those of them within ``capacity``; ``needed`` ((1,) int64) the most tokens bound for one
    node."""

    nodes: int
    node: int
    capacity: int
    bound: torch.Tensor  # (T, N) bool
    position: torch.Tensor  # (T, N) int64
    sent: torch.Tensor  # (T, N) bool

    @property
    def blocks(self) -> list[int]:
        """The other nodes, in block order."""
        return [n for n in range(self.nodes) if n != self.node]

    def block_of(self, n: int) -> int:
        return n - (n > self.node)


def node_bound(node_of_TK: torch.Tensor, nodes: int, node: int) -> torch.Tensor:  # noqa: N803
    """(T, N) bool: which other nodes hold at least one of each token's experts (``node_of_TK``:
    the node of each pick)."""
    hits = (node_of_TK.unsqueeze(2) == torch.arange(nodes, device=node_of_TK.device)).any(dim=1)
    hits[:, node] = False
    return hits


def node_rows(bound: torch.Tensor, node: int, capacity: int) -> NodeRows:
    """``NodeRows`` of ``bound`` (``node_bound``) at ``capacity`` rows per node. Device ops."""
    position = torch.cumsum(bound.to(torch.int64), dim=0) - 1
    return NodeRows(nodes=bound.shape[1], node=node, capacity=capacity, bound=bound, position=position,
                    sent=bound & (position < capacity))


@dataclass(frozen=True)
class _Layout:
    """Byte layout of one block (module docstring)."""

    capacity: int
    dim: int
    dtype: torch.dtype
    fmt: WireFormat
    side: int

    @property
    def wire(self) -> int:
        return staged_row_nbytes(self.dim, self.dtype, self.fmt)

    @property
    def stride(self) -> int:
        return -(-self.wire // NODE_HOP_ROW_ALIGN) * NODE_HOP_ROW_ALIGN

    @property
    def block(self) -> int:
        return self.capacity * (self.stride + 4 * self.side)

    def row_views(self, packed: torch.Tensor):
        """Views of ``packed`` ((rows, stride) uint8) as ``staging.staging_views`` gives a
        staging buffer's: values, or element and scale bytes."""
        wire = packed[:, : self.wire]
        if self.fmt.quantized:
            elements = self.fmt.element_bytes(self.dim, 1)
            return wire[:, :elements], wire[:, elements:]
        return (wire.view(self.dtype),)

    def unblocked(self, buf: torch.Tensor, count: int):
        """``row_views`` of the ``count`` rows of a received buffer ((blocks, block) uint8)."""
        return self.row_views(buf[:, : self.capacity * self.stride].reshape(count, self.stride))

    def side_columns(self, buf: torch.Tensor) -> torch.Tensor:
        """(blocks, capacity, side) int32 view of ``buf``'s side columns."""
        blocks = buf.shape[0]
        return buf[:, self.capacity * self.stride :].view(torch.int32).view(blocks, self.capacity, self.side)


def _exchange(send: torch.Tensor, rows: NodeRows, group: dist.ProcessGroup) -> torch.Tensor:
    """One all-to-all over the rail ``group`` (rank ``n`` is node ``n``): block ``b`` of
    ``send`` to its node, the block from each other node into ``b`` of the result."""
    recv = torch.empty_like(send)
    splits = [0 if n == rows.node else 1 for n in range(rows.nodes)]
    dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=splits, group=group)
    return recv


def _packed(rows: NodeRows, layout: _Layout, device) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """A send buffer's rows before they are laid out in blocks: ``(N - 1) x capacity`` rows of
    ``layout.stride`` bytes and their side columns, each with one row more at the end that
    takes what no block does (index writes, no boolean selection: no host sync)."""
    count = (rows.nodes - 1) * rows.capacity + 1
    packed = torch.zeros((count, layout.stride), dtype=torch.uint8, device=device)
    side = torch.zeros((count, layout.side), dtype=torch.int32, device=device)
    return packed, layout.row_views(packed), side


def _blocks(packed: torch.Tensor, side: torch.Tensor, rows: NodeRows) -> torch.Tensor:
    """The send buffer ((N - 1, block) uint8) of ``_packed``'s rows and side columns."""
    blocks = rows.nodes - 1
    return torch.cat([packed[:-1].view(blocks, -1), side[:-1].view(torch.uint8).view(blocks, -1)], dim=1)


def _row_of(rows: NodeRows, n: int) -> torch.Tensor:
    """(T,) each token's row for node ``n`` among the ``(N - 1) x capacity`` rows, or the last
    row past them where it is not sent there."""
    spare = (rows.nodes - 1) * rows.capacity
    return torch.where(rows.sent[:, n], rows.block_of(n) * rows.capacity + rows.position[:, n], spare)


def to_nodes(src: torch.Tensor, rows: NodeRows, group: dist.ProcessGroup, fmt: WireFormat, rounding: str,
             leg: str, side: torch.Tensor | None = None,
             side_fill: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token of ``src`` (T, D) once to each node in ``rows.sent``, encoded in ``fmt`` once
    per token, with its ``side`` int32 columns for that node ((T, N, S), or None); returns the
    rows the other nodes sent this rank, ``(N - 1) x capacity`` of them decoded to ``src``'s
    dtype (block order; rows no token filled are zeros), and their side columns
    ((N - 1) x capacity, S; ``side_fill`` (S,) where no token filled a row, else zeros).
    Records the bytes it puts on the wire under ``leg``, inter-node: the whole buffer,
    ``(N - 1) x capacity`` rows, filled or not (its size is fixed, so that no host waits for a
    count)."""
    layout = _Layout(rows.capacity, src.shape[1], src.dtype, WireFormat(fmt), 0 if side is None else side.shape[2])
    packed, views, packed_side = _packed(rows, layout, src.device)
    if side_fill is not None:
        packed_side.copy_(side_fill.expand_as(packed_side))
    encoded = encode_rows(src, rounding, fmt)
    parts = encoded if encoded is not None else (src,)
    for n in rows.blocks:
        at = _row_of(rows, n)
        for view, part in zip(views, parts, strict=True):
            view.index_copy_(0, at, part)
        if side is not None:
            packed_side.index_copy_(0, at, side[:, n])
    send = _blocks(packed, packed_side, rows)
    wire_stats.record(leg, send.numel(), inter_node=True)
    recv = _exchange(send, rows, group)
    count = (rows.nodes - 1) * rows.capacity
    received = layout.unblocked(recv, count)
    values = decode_rows(received, torch.arange(count, device=src.device), src.dtype, fmt)
    return values, layout.side_columns(recv).reshape(count, layout.side) if side is not None else None


def to_sources(src: torch.Tensor, rows: NodeRows, group: dist.ProcessGroup, fmt: WireFormat, rounding: str,
               leg: str, side: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The way back: row ``b x capacity + p`` of ``src`` ((N - 1) x capacity, D: this rank's
    rows for the tokens node ``blocks[b]`` sent it) to that node, with its ``side`` columns
    (((N - 1) x capacity, S) int32, or None). Returns, per token and node, what came back for
    it: ((T, N, D) in ``src``'s dtype, decoded; zeros where ``rows.sent`` is not set, this
    rank's node included) and the side columns ((T, N, S), zeros there). Records the bytes it
    puts on the wire under ``leg``, inter-node."""
    layout = _Layout(rows.capacity, src.shape[1], src.dtype, WireFormat(fmt), 0 if side is None else side.shape[1])
    packed, views, packed_side = _packed(rows, layout, src.device)
    encoded = encode_rows(src, rounding, fmt)
    for view, part in zip(views, encoded if encoded is not None else (src,), strict=True):
        view[:-1].copy_(part)
    if side is not None:
        packed_side[:-1].copy_(side)
    send = _blocks(packed, packed_side, rows)
    wire_stats.record(leg, send.numel(), inter_node=True)
    recv = _exchange(send, rows, group)
    count = (rows.nodes - 1) * rows.capacity
    received = layout.unblocked(recv, count)
    received_side = layout.side_columns(recv).reshape(count, layout.side)
    T, N = rows.sent.shape
    out = torch.zeros((T, N, src.shape[1]), dtype=src.dtype, device=src.device)
    out_side = torch.zeros((T, N, layout.side), dtype=torch.int32, device=src.device)
    for n in rows.blocks:
        sent = rows.sent[:, n].unsqueeze(1)
        at = _row_of(rows, n).clamp(max=count - 1)
        out[:, n] = torch.where(sent, decode_rows(received, at, src.dtype, fmt), 0)
        out_side[:, n] = torch.where(sent, received_side[at], 0)
    return out, out_side if side is not None else None
