"""The recipe's routing telemetry: how many rows the busiest rank would receive, over the
balanced count, at EP 2, 4, 8 and the run's own EP (``mxfp8_ep.telemetry.routing_stats``), per training
step and MoE layer, from the per-expert counts torchtitan's MoE layers already keep on the
device (``tokens_per_expert`` on torchtitan 0.2.2, ``tokens_per_expert_E`` on 0.3.0:
``mxfp8_ep.elastic.LOAD_BALANCE_BUFFERS``). What a user reads to choose ``a2a.capacity_factor``
and ``a2a.capacity_ceiling`` for an EP degree before renting its GPUs; measurable at EP=1.

Per step (``launch.titan.recipe_trainer.RecipeTrainerMixin``, the trainer of either stack): the
counters are copied at the step's start; after the step's last forward-backward, once the
elastic capacity's check has let the step count (a replayed step's counters go back to the start
and its overflowed attempt is not recorded), the step's own counts (the difference: torchtitan
zeroes them in the optimizer's pre-hook when ``load_balance_coeff`` is set, and otherwise they
add up over the run) are kept on the device. Nothing is read on the host and nothing is
exchanged per step.

At the logging cadence (``RecipeMetricsProcessor.log``, every rank) the window's counts are
summed over all ranks in one all-reduce, turned into loads per step, layer and degree, and read
once: wandb gets ``moe/imbalance_ep<e>`` (the window's largest over steps and layers), rank 0
appends each step's per-layer loads to ``<run dir>/routing.jsonl``, and the run's summary keeps
per degree the largest of the launch and the last window's (``RunSummary.moe_imbalance``).

Counts over a step sum its microbatches (with gradient accumulation one dispatch can be more
uneven than its step). Under full activation checkpointing torchtitan counts a layer's tokens
twice, which leaves the loads unchanged. Without load balancing the float32 counters grow for
the whole run; past 2^24 tokens per expert their differences lose precision.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from launch.run.run_dir import ROUTING_LOG
from launch.run.run_summary import imbalance_metric
from mxfp8_ep.elastic import LOAD_BALANCE_BUFFERS
from mxfp8_ep.telemetry.routing_stats import busiest_rank_load, imbalance_degrees

__all__ = ["RoutingTelemetry"]

_log = logging.getLogger(__name__)


def _counter_name(moe: nn.Module) -> Optional[str]:
    """The name of the per-expert token counter ``moe`` keeps (its torchtitan release's), or None."""
    return next((name for name in LOAD_BALANCE_BUFFERS if isinstance(getattr(moe, name, None), torch.Tensor)), None)


def _moe_layers(model_parts: Iterable[nn.Module]) -> list[tuple[int, nn.Module]]:
    """(transformer block index, its MoE module) of every MoE layer of ``model.layers``."""
    found = []
    for part in model_parts:
        layers = getattr(part, "layers", None)
        for name, block in (layers.items() if isinstance(layers, nn.ModuleDict) else ()):
            moe = getattr(block, "moe", None) if getattr(block, "moe_enabled", False) else None
            if moe is not None and _counter_name(moe) is not None:
                found.append((int(name), moe))
    return found


class RoutingTelemetry:
    """The counts of one run's MoE layers (module docstring). ``path``: where rank 0 appends
    the per-step loads (None on other ranks)."""

    def __init__(self, layers: list[tuple[int, nn.Module]], degrees: tuple[int, ...], path: Optional[str]):
        self.layers = [index for index, _ in layers]
        self._moes = [moe for _, moe in layers]
        # Read by name at each step: torchtitan 0.3.0 may put a new tensor there (its buffers' init).
        self._counter = _counter_name(self._moes[0]) if self._moes else LOAD_BALANCE_BUFFERS[0]
        self.degrees = degrees
        self.path = path
        self._start: Optional[torch.Tensor] = None
        self._microbatches = 0
        self._window: list[tuple[int, torch.Tensor]] = []  # (step, its (layers, E) counts)
        self.run_max: dict[int, float] = {}
        self.run_max_step: dict[int, int] = {}
        self.last_window: dict[int, float] = {}

    @classmethod
    def of(cls, model_parts: Iterable[nn.Module], ep: int, run_dir: str) -> Optional["RoutingTelemetry"]:
        """The telemetry of a model's MoE layers at EP ``ep``, or None where there is nothing to
        report (no MoE layer, or no degree > 1 that divides its experts)."""
        layers = _moe_layers(model_parts)
        experts = {getattr(moe, _counter_name(moe)).numel() for _, moe in layers}
        if len(experts) != 1:
            if experts:
                _log.warning("routing telemetry off: the MoE layers have different expert counts %s", sorted(experts))
            return None
        degrees = imbalance_degrees(experts.pop(), ep)
        if not degrees:
            return None
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        return cls(layers, degrees, os.path.join(run_dir, ROUTING_LOG) if rank0 else None)

    def _counts(self) -> torch.Tensor:
        counts = [getattr(moe, self._counter).detach() for moe in self._moes]
        return torch.stack([c.to_local() if hasattr(c, "to_local") else c for c in counts]).float()

    def begin_step(self) -> None:
        """Before the step's first attempt."""
        self._start = self._counts()  # a new tensor (stacked)
        self._microbatches = 0

    def restart_step(self) -> None:
        """Before a replay of the step: its counters are back at the step's start."""
        self._microbatches = 0

    def microbatch_done(self, step: int, microbatches: int) -> None:
        """After a forward-backward that returned (the elastic check let it count); the step's
        counts are kept after its last one (of ``microbatches``)."""
        self._microbatches += 1
        if self._microbatches == microbatches and self._start is not None:
            self._window.append((step, self._counts() - self._start))

    def collect(self) -> dict[str, float]:
        """The window's metrics (a collective when the default group exists: every rank calls it
        at the same log step); rank 0 appends the window's steps to ``routing.jsonl``."""
        if not self._window:
            return {}
        steps = [step for step, _ in self._window]
        counts = torch.stack([c for _, c in self._window])  # (steps, layers, E)
        self._window.clear()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        n_steps, n_layers, experts = counts.shape
        loads = busiest_rank_load(counts.view(-1, experts), self.degrees).view(n_steps, n_layers, -1)
        picks = counts.sum(dim=2)
        # the one host read of the window
        loads_list, picks_list, counts_list = loads.tolist(), picks.tolist(), counts.round().long().tolist()
        metrics = {}
        for d, e in enumerate(self.degrees):
            per_step = [max(layer[d] for layer in step) for step in loads_list]
            window = max(per_step)
            metrics[imbalance_metric(e)] = window
            self.last_window[e] = window
            if window > self.run_max.get(e, float("-inf")):
                self.run_max[e] = window
                self.run_max_step[e] = steps[per_step.index(window)]
        if self.path is not None:
            self._append(steps, loads_list, picks_list, counts_list)
        return metrics

    def _append(self, steps: list[int], loads: list, picks: list, counts: list) -> None:
        with open(self.path, "a") as f:
            for step, step_loads, step_picks, step_counts in zip(steps, loads, picks, counts):
                f.write(json.dumps({
                    "step": step, "layers": self.layers, "picks": [int(p) for p in step_picks],
                    "load": {str(e): [round(layer[d], 5) for layer in step_loads] for d, e in enumerate(self.degrees)},
                    # per layer, the tokens routed to each expert over every rank: any EP degree's
                    # per-rank rows, per layer and summed over layers (benchmarks/capacity_study.py)
                    "counts": step_counts,
                }) + "\n")

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per degree (``"ep<e>"``): the largest load of this launch, its step, and the last
        window's largest."""
        return {f"ep{e}": {"max": self.run_max[e], "max_step": self.run_max_step[e], "last": self.last_window[e]}
                for e in self.degrees if e in self.run_max}
