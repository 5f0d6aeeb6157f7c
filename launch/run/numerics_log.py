"""The recipe's side of the quantization telemetry (``mxfp8_ep.telemetry.numerics``): which steps it
samples, its wandb metrics, and its console line.

``logging.numerics_every=N`` (0: off) arms the library's probe for every N-th training step
(``RecipeTrainer.train_step``). The dispatchers then report each MXFP8 leg's rows, and the
metrics processor, at the log step that follows, sums the statistics over all ranks and logs
(names: ``launch.run.run_summary.numerics_metric``):

* ``numerics/layer<i>/<leg>/<stat>``: one MoE layer (torchtitan's transformer block ``i``), one
  MXFP8 leg (``mxfp8_ep.config.LEGS``), one statistic (``mxfp8_ep.config.NUMERICS_STATS``);
* ``numerics/<leg>/<stat>``: the model: the mean over layers of ``rel_l2_err``,
  ``saturated_block_frac`` and ``flushed_frac``; the smallest ``scale_exp_min`` and the
  largest ``scale_exp_max`` of any layer.

Steps it does not sample do no telemetry work at all (no device work, no host sync).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Mapping
from typing import Any, Optional

import torch.distributed as dist
import torch.nn as nn

from launch.run.run_summary import numerics_metric
from mxfp8_ep.config import LEGS, NUMERICS_STATS
from mxfp8_ep.telemetry.numerics import PROBE, reduce_over_ranks

# Statistics whose model-wide value is the mean over layers (the others: the range's ends).
MEAN_STATS = ("rel_l2_err", "saturated_block_frac", "flushed_frac")
_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def arm_for_step(step: int, every: int) -> None:
    """Arm the probe for ``step`` when it is one ``logging.numerics_every=every`` samples."""
    PROBE.armed = every > 0 and step % every == 0


def layer_indices(model_parts: Iterable[nn.Module]) -> dict[Hashable, int]:
    """Each MoE layer's dispatcher -> its transformer block's index (``model.layers["<i>"]``):
    on torchtitan 0.2.2 the EP module's ``token_dispatcher``; on 0.3.0 the library dispatcher
    its ``token_dispatcher`` runs on (``mxfp8_ep.titan030``'s ``library_dispatcher``)."""
    indices = {}
    for part in model_parts:
        for name, module in part.named_modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            block = _BLOCK.search(name)
            if dispatcher is not None and block:
                indices[getattr(dispatcher, "library_dispatcher", None) or dispatcher] = int(block.group(1))
    return indices


def collect_metrics(model_parts: Iterable[nn.Module]) -> dict[str, float]:
    """The probe's statistics since the last call, summed over all ranks, as wandb metrics
    (empty when nothing was sampled), for the MoE layers of ``model.layers``. A collective when
    something was sampled: every rank calls it at the same step (they all sample the same steps
    and run the same layers)."""
    collected = PROBE.collect()
    if not collected:
        return {}
    indices = layer_indices(model_parts)
    named = {(indices[reporter], leg): stats for (reporter, leg), stats in collected.items() if reporter in indices}
    keys = sorted(named, key=lambda k: (k[0], LEGS.index(k[1])))
    reduced = [named[k] for k in keys]
    if dist.is_available() and dist.is_initialized():
        reduced = reduce_over_ranks(reduced)
    return metrics_of({k: stats.summary() for k, stats in zip(keys, reduced)})


def metrics_of(per_layer: Mapping[tuple[int, str], Mapping[str, Any]]) -> dict[str, float]:
    """wandb metrics of ``{(layer, leg): LegStats.summary()}``: per layer and model-wide."""
    metrics: dict[str, float] = {}
    for leg in LEGS:
        layers = {layer: s for (layer, leg_), s in per_layer.items() if leg_ == leg}
        for layer, summary in layers.items():
            metrics.update({numerics_metric(leg, stat, layer): v for stat, v in summary.items() if v is not None})
        for stat in NUMERICS_STATS:
            values = [s[stat] for s in layers.values() if s[stat] is not None]
            if not values:
                continue
            if stat in MEAN_STATS:
                metrics[numerics_metric(leg, stat)] = sum(values) / len(values)
            else:
                metrics[numerics_metric(leg, stat)] = (min if stat == "scale_exp_min" else max)(values)
    return metrics


def console_line(step: int, metrics: Mapping[str, float]) -> Optional[str]:
    """One line of the model-wide statistics per MXFP8 leg, or None when there are none."""
    parts = []
    for leg in LEGS:
        m = {stat: metrics.get(numerics_metric(leg, stat)) for stat in NUMERICS_STATS}
        if m["rel_l2_err"] is None:
            continue
        exponents = ("n/a" if m["scale_exp_min"] is None
                     else f"[{m['scale_exp_min']:.0f}, {m['scale_exp_max']:.0f}]")
        parts.append(f"{leg} rel_l2 {m['rel_l2_err']:.2e} saturated {100 * m['saturated_block_frac']:.2f}% "
                     f"flushed {100 * m['flushed_frac']:.3f}% scale_exp {exponents}")
    return f"numerics step {step}: " + "; ".join(parts) if parts else None
