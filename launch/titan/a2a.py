"""A run's EP all-to-all from its ``cfg.a2a``: the library's ``A2AConfig`` with
``capacity_ceiling=auto`` resolved on the node where it was not before launch, and the console
line that states the elastic capacity of a sync-free transport (symm, two_hop). The two_hop transport
runs without the activation pool. The same on every torchtitan stack.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from launch.config.memory import (AUTO_CEILING, ep_transport, fitting_ceiling, run_estimate, runs_sync_free,
                                  symm_capacity)
from mxfp8_ep.transport import Transport
from launch.config.model_facts import facts

__all__ = ["a2a_config", "capacity_ceiling_here", "capacity_line"]


def a2a_config(cfg: DictConfig) -> Any:
    """The library's ``A2AConfig`` of ``cfg.a2a``; a ``capacity_ceiling`` still ``auto`` (the
    memory was not known before launch: a SLURM job) resolved here, on the node
    (``capacity_ceiling_here``); no activation pool where the EP layers run two_hop."""
    from mxfp8_ep.config import A2AConfig

    values = OmegaConf.to_container(cfg.a2a, resolve=True)
    if values["capacity_ceiling"] == AUTO_CEILING:  # type: ignore[index]
        values["capacity_ceiling"] = capacity_ceiling_here(cfg)  # type: ignore[index]
    if ep_transport(cfg, "cuda" if torch.cuda.is_available() else "cpu") is Transport.TWO_HOP:
        values["activation_pool_factor"] = None  # type: ignore[index]
    return A2AConfig.from_dict(values)  # type: ignore[arg-type]


def capacity_ceiling_here(cfg: DictConfig) -> float | None:
    """``a2a.capacity_ceiling=auto`` for this node: the library's ceiling, or the largest below
    it, whose estimate fits this GPU's memory (the node's RAM on CPU), shared by the processes
    that share it (``launch.config.memory.fitting_ceiling``); the library's default where no sync-free
    dispatch (symm, two_hop) runs at an elastic capacity (nothing grows, so no ceiling applies)."""
    from mxfp8_ep.config import DEFAULT_CAPACITY_CEILING

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not runs_sync_free(cfg, device) or cfg.a2a.capacity_factor is None:
        return DEFAULT_CAPACITY_CEILING
    if device == "cuda":
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    p = cfg.parallelism
    procs = p.procs_per_node if p.share_gpu or device == "cpu" else 1
    return fitting_ceiling(cfg, facts(cfg.model.family, cfg.model.flavor), device, memory, procs)


def capacity_line(cfg: DictConfig, a2a: Any) -> str | None:
    """What the elastic capacity of a sync-free transport (symm, two_hop) holds, as the
    console's header states it:
    the rows it starts at and the most it grows to, each as the multiple of the balanced case
    it is (a factor past the worst case is the worst case: that one is named, with its own
    multiple), and the memory estimate of one process there (``launch.config.memory``: at the
    ceiling with the activation pool at its own), in a unit that tells the two apart; None
    where no sync-free dispatch runs at an elastic capacity."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not runs_sync_free(cfg, device) or a2a.capacity_factor is None:
        return None
    m = facts(cfg.model.family, cfg.model.flavor)
    tokens = int(cfg.training.local_batch_size) * int(cfg.training.seq_len)
    ep = int(cfg.parallelism.ep)
    worst, balanced = symm_capacity(m, tokens, ep, None), tokens * m.top_k
    ceiling = a2a.capacity_ceiling
    points = ((a2a.capacity_factor, False), (ceiling, True))
    memory = distinct_sizes([run_estimate(cfg, m, device, True, factor, at_ceiling).total
                             for factor, at_ceiling in points])

    def at(factor: float | None, size: str) -> str:
        rows = symm_capacity(m, tokens, ep, factor)
        if rows < worst:
            times = f"{factor:g}x balanced"
        else:
            capped = "" if factor is None else f", which caps {factor:g}x"
            times = f"the worst case, {worst / balanced:.2f}x balanced{capped}"
        return f"{rows:,} expert rows ({times}; est. {size} per process)"

    return (f"a2a capacity  starts at {at(a2a.capacity_factor, memory[0])}, grows up to "
            f"{at(ceiling, memory[1])}; a step that needs more runs once at exactly its rows")


def distinct_sizes(sizes: list[int]) -> list[str]:
    """``sizes`` (bytes) as ``0.6 GiB``, or in the first of MiB and KiB that tells apart sizes
    that differ."""
    for unit, scale, decimals in (("GiB", 2**30, 1), ("MiB", 2**20, 0), ("KiB", 2**10, 0)):
        shown = [f"{n / scale:,.{decimals}f} {unit}" for n in sizes]
        if len(set(shown)) == len(set(sizes)):
            break
    return shown
