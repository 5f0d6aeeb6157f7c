"""Points every rank must reach together (the stop agreement at each step boundary, the end of
a run), with a deadline: a rank that waits past it fails with the ranks that did not arrive and
where each of them is, instead of hanging.

Each rank posts where it is (``mxfp8ep/at/<rank>``) in the process group's store (the
rendezvous' key-value store, reachable from every rank) as it enters a meeting; the ranks whose
post names another meeting are the ones that did not arrive.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist


class RanksMissing(RuntimeError):
    """Ranks did not reach a meeting in time; the message names them and where they are."""


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _at(rank: int) -> str:
    return f"mxfp8ep/at/{rank}"


def arrive(meeting: str) -> None:
    """This rank is at ``meeting`` (a name no other meeting of the run has)."""
    _store().set(_at(dist.get_rank()), meeting)


def missing(meeting: str, timeout_s: float) -> RanksMissing:
    """The error of a rank that waited ``timeout_s`` at ``meeting``: the ranks not there, and
    where each last said it was."""
    store = _store()
    where = {}
    for rank in range(dist.get_world_size()):
        posted = store.get(_at(rank)).decode() if store.check([_at(rank)]) else None
        if posted != meeting:
            where[rank] = posted
    absent = ", ".join(map(str, where)) or "none"
    places = "; ".join(f"rank {r}: {'at ' + w if w else 'at no meeting yet'}" for r, w in where.items())
    return RanksMissing(f"{meeting}: rank(s) {absent} did not arrive within {timeout_s:g} s"
                        + (f" ({places})" if places else "")
                        + "; their logs say why (a rank that failed, hung or trains another launch)")


def meet(meeting: str, timeout_s: float) -> None:
    """Wait until every rank has arrived at ``meeting`` (a name used once per run); raise
    :class:`RanksMissing` after ``timeout_s``."""
    store = _store()
    arrive(meeting)
    store.set(f"mxfp8ep/{meeting}/{dist.get_rank()}", "1")
    keys = [f"mxfp8ep/{meeting}/{r}" for r in range(dist.get_world_size())]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        raise missing(meeting, timeout_s) from e
