"""How unevenly a routing loads the ranks of an expert-parallel group, from per-expert token
counts alone: the numbers that size the symm transport's capacity (``capacity.expert_major_capacity``
takes a factor of the balanced case) for any EP degree, measurable on a run of another degree
(EP=1 included).

At EP degree ``e`` with ``E`` experts, rank ``r`` owns the contiguous block of experts
``[r E/e, (r+1) E/e)`` (torchtitan's and this library's layout), so it receives the rows every
rank routes to that block. Balanced, each rank receives ``1/e`` of all rows; the busiest rank
receives ``e x`` (the largest block's share) times that. That ratio is the smallest
``capacity_factor`` under which the routing fits (before each local expert's padding).
"""

from __future__ import annotations

import torch

__all__ = ["EP_DEGREES", "busiest_rank_load", "imbalance_degrees"]

# The EP degrees the imbalance is reported at besides a run's own: one GPU node's common sizes.
EP_DEGREES = (2, 4, 8)


def imbalance_degrees(num_experts: int, ep: int = 1) -> tuple[int, ...]:
    """The degrees of ``EP_DEGREES`` and ``ep`` (a run's own) that spread ``num_experts``
    evenly over their ranks, ascending; EP=1 (one rank: always balanced) is left out."""
    return tuple(sorted(e for e in {*EP_DEGREES, ep} if e > 1 and num_experts % e == 0))


def busiest_rank_load(tokens_per_expert: torch.Tensor, degrees: tuple[int, ...]) -> torch.Tensor:
    """Rows the busiest rank would receive over the balanced count, per MoE layer and EP degree.

    Args:
        tokens_per_expert: ``(layers, E)`` token counts per expert of each MoE layer (any real
            dtype, any device; summed over the ranks whose routing is to be judged).
        degrees: EP degrees, each dividing ``E`` (``imbalance_degrees``).

    Returns:
        ``(layers, len(degrees))`` float32 on the counts' device: ``e x`` the largest share of
        the rows held by one rank's block of ``E/e`` experts; 1.0 is a balanced routing, ``e``
        every row on one rank, 0.0 a layer that counted nothing. Computed on the device, with no
        host sync.

    For a degree other than the one the counts were taken at, this is the load that degree
    would see if every one of its ranks routed like the counted tokens do (the counts' shares,
    not their sizes, carry over): counts summed over more tokens than one step of that degree
    routes average out some of the per-step noise a real run of it sees.
    """
    if tokens_per_expert.dim() != 2:
        raise ValueError(f"tokens_per_expert: expected (layers, experts), got shape {tuple(tokens_per_expert.shape)}")
    layers, experts = tokens_per_expert.shape
    uneven = [e for e in degrees if e < 1 or experts % e]
    if uneven:
        raise ValueError(f"EP degrees {uneven} do not spread {experts} experts evenly over their ranks")
    counts = tokens_per_expert.float()
    total = counts.sum(dim=1, keepdim=True)
    busiest = [e * counts.view(layers, e, experts // e).sum(dim=2).amax(dim=1) for e in degrees]
    busiest = torch.stack(busiest, dim=1) if busiest else counts.new_zeros(layers, 0)
    return torch.where(total > 0, busiest / total.clamp_min(1), 0.0)
