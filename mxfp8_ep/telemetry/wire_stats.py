"""Count of the bytes the expert-parallel exchanges put on the wire, per leg.

The nccl transport counts from the host split lists it already has. The symm transport knows
its row counts only on the device: it adds them to device counters, without a sync; a
``snapshot`` reads those (one device-to-host copy, at logging time). Rows a rank sends to
itself are not counted: they never cross a wire.

Each leg's count is every byte it sent; the part that crossed between nodes (the two_hop
transport's node hop) is also counted under ``inter_node_key(leg)``, so a leg's bytes inside
a node are its count minus that part.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch

from mxfp8_ep.format.wire_format import WireFormat

_lock = threading.Lock()
_bytes: Counter[str] = Counter()
_device_bytes: dict[str, torch.Tensor] = {}


def row_bytes(dim: int, itemsize: int, fmt: str) -> int:
    """Bytes one row of ``dim`` elements takes on the wire in format ``fmt``
    (``WireFormat.row_bytes``; ``itemsize``: the activation dtype's)."""
    return WireFormat(fmt).row_bytes(dim, itemsize)


# Under torch.compile this host-side counter runs eagerly (a deliberate graph break): a
# compiled graph cannot mutate Python state on every call, and counts must stay exact.
INTER_NODE = "inter_node"


def inter_node_key(leg: str) -> str:
    """The ``snapshot`` key of ``leg``'s bytes that crossed between nodes."""
    return f"{leg}.{INTER_NODE}"


def _keys(leg: str, inter_node: bool) -> tuple[str, ...]:
    return (leg, inter_node_key(leg)) if inter_node else (leg,)


@torch.compiler.disable
def record(leg: str, num_bytes: int, inter_node: bool = False) -> None:
    """Add ``num_bytes`` to ``leg`` (``inter_node``: bytes that crossed between nodes)."""
    with _lock:
        for key in _keys(leg, inter_node):
            _bytes[key] += int(num_bytes)


@torch.compiler.disable
def record_rows(leg: str, rows: torch.Tensor, bytes_per_row: int, inter_node: bool = False) -> None:
    """Add ``rows`` (a device scalar) rows of ``bytes_per_row`` bytes to ``leg``, on the device
    (``inter_node``: rows that crossed between nodes)."""
    with _lock:
        added = rows.to(torch.int64) * bytes_per_row
        for key in _keys(leg, inter_node):
            previous = _device_bytes.get(key)
            _device_bytes[key] = added if previous is None else previous + added


def snapshot(reset: bool = False) -> dict[str, int]:
    """Bytes sent by this rank per leg since the last reset, plus ``total`` (their sum), each
    leg's inter-node part under ``inter_node_key`` where it sent any, and their sum under
    ``inter_node_key("total")``."""
    with _lock:
        out = Counter(_bytes)
        for leg, counted in _device_bytes.items():
            out[leg] += int(counted.item())
        out = dict(out)
        if reset:
            _bytes.clear()
            _device_bytes.clear()
    inter = {k: v for k, v in out.items() if k.endswith(f".{INTER_NODE}")}
    out["total"] = sum(v for k, v in out.items() if k not in inter)
    if inter:
        out[inter_node_key("total")] = sum(inter.values())
    return out


def reset() -> None:
    with _lock:
        _bytes.clear()
        _device_bytes.clear()
