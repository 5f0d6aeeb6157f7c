"""Host-side count of the bytes the expert-parallel all-to-alls put on the wire.

Counted from the host split lists the exchanges already have, so counting never syncs the
device. Rows a rank sends to itself are not counted: they never cross a wire.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch

_lock = threading.Lock()
_bytes: Counter[str] = Counter()


# Under torch.compile this host-side counter runs eagerly (a deliberate graph break): a
# compiled graph cannot mutate Python state on every call, and counts must stay exact.
@torch.compiler.disable
def record(leg: str, num_bytes: int) -> None:
    with _lock:
        _bytes[leg] += int(num_bytes)


def snapshot(reset: bool = False) -> dict[str, int]:
    """Bytes sent by this rank per leg since the last reset, plus ``total``."""
    with _lock:
        out = dict(_bytes)
        if reset:
            _bytes.clear()
    out["total"] = sum(out.values())
    return out


def reset() -> None:
    with _lock:
        _bytes.clear()
