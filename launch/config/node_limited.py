"""Node-limited routing (DeepSeek-V3's group-limited routing) against the EP layout.

torchtitan's router takes ``num_expert_groups`` (G) and ``num_limited_groups`` (M): the routed
experts split into G groups of consecutive ids, each token scores each group by its two best
experts there, keeps the M best groups and picks its top-k among their experts only. Under
expert parallelism consecutive experts live on consecutive EP ranks, and an EP group's ranks
are consecutive ranks (torchtitan's mesh puts ``ep`` innermost, ``etp`` 1), so when G is the
number of nodes the EP group spans, group g is node g's experts: a token's experts sit on at
most M nodes, and its rows cross the inter-node network to at most M - 1 other nodes (or M).
The recipe's ``model.num_expert_groups`` / ``model.num_limited_groups`` set them (null: off);
this module checks them before launch. Imports no torch.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["ep_nodes", "node_limited_problems"]

OFF = "model.num_expert_groups=null model.num_limited_groups=null"


def ep_nodes(ep: int, procs_per_node: int) -> Optional[int]:
    """How many nodes one EP group of ``ep`` consecutive ranks spans on nodes of
    ``procs_per_node`` processes, or None when the groups straddle node boundaries unevenly
    (neither divides the other)."""
    if ep % procs_per_node == 0:
        return ep // procs_per_node
    if procs_per_node % ep == 0:
        return 1
    return None


def node_limited_problems(groups: Optional[int], limited: Optional[int], *, num_experts: int, top_k: int,
                          ep: int, procs_per_node: int, model: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) of ``model.num_expert_groups=groups`` and
    ``model.num_limited_groups=limited`` for a model of ``num_experts`` routed experts and
    ``top_k`` on an EP group of ``ep`` ranks, ``procs_per_node`` per node. Each error says what
    to set instead."""
    if groups is None and limited is None:
        return [], []
    if groups is None or limited is None:
        given = "model.num_expert_groups" if groups is not None else "model.num_limited_groups"
        return [f"{given} is set alone: node-limited routing takes both model.num_expert_groups (the nodes the EP "
                f"group spans) and model.num_limited_groups (the most nodes a token's experts sit on); set both, "
                f"or neither ({OFF}: off)"], []
    if groups < 1 or limited < 1:
        return [f"model.num_expert_groups={groups} model.num_limited_groups={limited}: both must be >= 1, or "
                f"both null ({OFF}: off)"], []
    errors, warnings = [], []
    if limited > groups:
        errors.append(f"model.num_limited_groups={limited} > model.num_expert_groups={groups}: a token picks its "
                      f"experts on at most all {groups} groups; use model.num_limited_groups <= {groups}")
    elif limited == groups:
        warnings.append(f"model.num_limited_groups={limited} = model.num_expert_groups: every group stays open, so "
                        f"routing is not limited (use fewer limited groups, or {OFF})")
    if num_experts % groups:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        errors.append(f"model.num_expert_groups={groups} must divide the {num_experts} routed experts of "
                      f"model={model}; choose it from {divisors}")
    elif num_experts // groups < 2:
        errors.append(f"model.num_expert_groups={groups}: {num_experts} experts make groups of "
                      f"{num_experts // groups}, and torchtitan's router scores a group by its two best experts "
                      f"(groups of >= 2); use model.num_expert_groups <= {num_experts // 2}")
    elif limited <= groups and top_k > limited * (num_experts // groups):
        errors.append(f"model.num_limited_groups={limited}: {limited} group(s) of {num_experts // groups} experts "
                      f"hold fewer than the top_k={top_k} experts a token picks; use model.num_limited_groups >= "
                      f"{-(-top_k // (num_experts // groups))}")
    span = ep_nodes(ep, procs_per_node)
    where = f"parallelism.ep={ep} on parallelism.procs_per_node={procs_per_node}"
    if span is None:
        errors.append(f"model.num_expert_groups={groups}: node-limited routing puts one expert group on each node "
                      f"of the EP group, but {where} straddles node boundaries unevenly; use parallelism.ep a "
                      f"multiple or a divisor of parallelism.procs_per_node, or {OFF} (off)")
    elif span == 1:
        errors.append(f"model.num_expert_groups={groups}: node-limited routing limits the nodes a token's experts "
                      f"span, but {where} keeps every expert on one node, so nothing crosses between nodes; use "
                      f"parallelism.ep={2 * procs_per_node} (or another multiple of procs_per_node) with "
                      f"model.num_expert_groups=<its nodes>, or {OFF} (off)")
    elif groups != span:
        errors.append(f"model.num_expert_groups={groups}: the groups are the nodes the EP group spans, and {where} "
                      f"spans {span} nodes; use model.num_expert_groups={span} (with model.num_limited_groups < "
                      f"{span}), or {OFF} (off)")
    return errors, warnings
