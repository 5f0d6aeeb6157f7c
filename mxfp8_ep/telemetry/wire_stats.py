"""Count of the bytes the expert-parallel exchanges put on the wire, per leg.

The nccl transport counts from the host split lists it already has. The symm transport knows
its row counts only on the device: it adds them to device counters, without a sync; a
``snapshot`` reads those (one device-to-host copy, at logging time). Rows a rank sends to
itself are not counted: they never cross a wire.
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
@torch.compiler.disable
def record(leg: str, num_bytes: int) -> None:
    with _lock:
        _bytes[leg] += int(num_bytes)


@torch.compiler.disable
def record_rows(leg: str, rows: torch.Tensor, bytes_per_row: int) -> None:
    """Add ``rows`` (a device scalar) rows of ``bytes_per_row`` bytes to ``leg``, on the device."""
    with _lock:
        added = rows.to(torch.int64) * bytes_per_row
        previous = _device_bytes.get(leg)
        _device_bytes[leg] = added if previous is None else previous + added


def snapshot(reset: bool = False) -> dict[str, int]:
    """Bytes sent by this rank per leg since the last reset, plus ``total``."""
    with _lock:
        out = Counter(_bytes)
        for leg, counted in _device_bytes.items():
            out[leg] += int(counted.item())
        out = dict(out)
        if reset:
            _bytes.clear()
            _device_bytes.clear()
    out["total"] = sum(out.values())
    return out


def reset() -> None:
    with _lock:
        _bytes.clear()
        _device_bytes.clear()
