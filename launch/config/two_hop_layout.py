"""The two_hop transport's nodes against the recipe's parallel layout, before launch.

two_hop (``mxfp8_ep.transport.Transport.TWO_HOP``) splits an EP group of consecutive ranks into
nodes of equal size, sends each token once to each other node that holds one of its experts and
fans it out inside the node through shared memory. A node is ``a2a.ranks_per_node`` consecutive
EP ranks where that is set (nodes emulated on one host, or smaller than a host), else the ranks
of one host: ``parallelism.procs_per_node`` of them. Its dispatcher refuses any other layout
when it starts; this module says so before anything starts. Imports no torch.
"""

from __future__ import annotations

from typing import Optional

from launch.config.node_limited import ep_nodes
from mxfp8_ep.transport import Transport

__all__ = ["two_hop_nodes", "two_hop_problems"]

# What else to run, after a refused layout: for two_hop asked for, and for auto that picked it.
OTHER_TRANSPORTS = {
    Transport.TWO_HOP: (f"or another transport: a2a.transport={Transport.NCCL.value} (the flat all-to-all) or "
                        f"{Transport.AUTO.value} ({Transport.SYMM.value} inside one host with CUDA)"),
    Transport.AUTO: f"or a2a.transport={Transport.NCCL.value} (the flat all-to-all)",
}


def two_hop_nodes(*, ep: int, nodes: int, procs_per_node: int, ranks_per_node: Optional[int]) -> Optional[int]:
    """How many nodes two_hop splits an EP group of ``ep`` ranks into on ``nodes`` hosts of
    ``procs_per_node`` processes, or None where it cannot (``two_hop_problems`` says why)."""
    if ranks_per_node is not None:
        ok = ranks_per_node >= 1 and ep % ranks_per_node == 0 and (nodes == 1 or procs_per_node % ranks_per_node == 0)
        return ep // ranks_per_node if ok and ep // ranks_per_node >= 2 else None
    span = ep_nodes(ep, procs_per_node) if nodes > 1 else 1
    return span if span is not None and span >= 2 else None


def _rank_choices(ep: int, nodes: int, procs_per_node: int) -> list[int]:
    """The ``a2a.ranks_per_node`` values that make a two_hop layout of ``ep`` ranks."""
    return [r for r in range(1, ep // 2 + 1)
            if two_hop_nodes(ep=ep, nodes=nodes, procs_per_node=procs_per_node, ranks_per_node=r) is not None]


def two_hop_problems(*, ep: int, nodes: int, procs_per_node: int, ranks_per_node: Optional[int],
                     requested: str = "two_hop") -> list[str]:
    """Why the EP layers cannot run two_hop on this layout (empty: they can), each line saying
    what to set instead (``requested``: the ``a2a.transport`` that runs it, two_hop or auto)."""
    if two_hop_nodes(ep=ep, nodes=nodes, procs_per_node=procs_per_node, ranks_per_node=ranks_per_node) is not None:
        return []
    others = OTHER_TRANSPORTS[Transport(str(requested))]
    head = "a2a.transport=two_hop splits the EP group into >= 2 nodes of equal size"
    if ep < 2:
        return [f"{head}, but parallelism.ep={ep} has no EP exchange; use parallelism.ep >= 2, {others}"]
    choices = _rank_choices(ep, nodes, procs_per_node)
    pick = f"a2a.ranks_per_node from {choices}" if choices else None
    if ranks_per_node is not None:
        if ranks_per_node < 1:
            why = "a node holds >= 1 rank"
        elif ep % ranks_per_node:
            why = f"it does not divide parallelism.ep={ep}"
        elif ep // ranks_per_node < 2:
            why = f"that makes parallelism.ep={ep} one node"
        else:
            why = (f"a node must lie on one host (the hop inside it goes through shared memory), and "
                   f"parallelism.procs_per_node={procs_per_node} is no multiple of it")
        fix = f"use {pick}" if pick else "use a larger parallelism.ep"
        return [f"a2a.transport=two_hop splits the EP group into >= 2 nodes of a2a.ranks_per_node consecutive EP "
                f"ranks each, but a2a.ranks_per_node={ranks_per_node}: {why}; {fix}, {others}"]
    if nodes == 1:
        example = f" (e.g. a2a.ranks_per_node={choices[-1]})" if choices else ""
        return [f"{head}, but parallelism.nodes=1 puts the whole EP group of parallelism.ep={ep} on one host: set "
                f"a2a.ranks_per_node=<ranks> to split it into nodes on this host{example}, {others}"]
    where = f"parallelism.ep={ep} on parallelism.procs_per_node={procs_per_node}"
    if ep_nodes(ep, procs_per_node) is None:
        why = "straddles the hosts unevenly"
    else:
        why = "keeps the EP group inside one host"
    hosts = min(m for m in range(2, nodes + 1) if nodes % m == 0)
    fix = f"use parallelism.ep={hosts * procs_per_node} (the EP group over {hosts} hosts)"
    return [f"{head} (the hosts it spans, parallelism.procs_per_node ranks each; or a2a.ranks_per_node), but "
            f"{where} {why}; {fix}, "
            + (f"{pick}, " if pick else "") + others]
