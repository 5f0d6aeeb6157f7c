"""The recipe's side of the quantization telemetry (``mxfp8_ep.numerics``): which steps it
samples, its wandb metric names, and its console line.

``logging.numerics_every=N`` (0: off) arms the library's probe for every N-th training step
(``RecipeTrainer.train_step``). The dispatchers then report each MXFP8 leg's rows, and the
metrics processor, at the log step that follows, sums the statistics over all ranks and logs:

* ``numerics/<layer>/<leg>/<stat>``: one MoE layer (``layer<i>``: torchtitan's transformer
  block ``i``), one MXFP8 leg (``mxfp8_ep.config.LEGS``), one of ``mxfp8_ep.numerics.STATS``;
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

from mxfp8_ep.config import LEGS
from mxfp8_ep.numerics import PROBE, STATS, reduce_over_ranks

PREFIX = "numerics"
# Statistics whose model-wide value is the mean over layers (the others: the range's ends).
MEAN_STATS = ("rel_l2_err", "saturated_block_frac", "flushed_frac")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def arm_for_step(step: int, every: int) -> None:
    """Arm the probe for ``step`` when it is one ``logging.numerics_every=every`` samples."""
    PROBE.armed = every > 0 and step % every == 0


def numerics_metric(leg: str, stat: str, layer: Optional[str] = None) -> str:
    """wandb name of one statistic: of one layer's leg, or (``layer`` None) model-wide."""
    return f"{PREFIX}/{layer}/{leg}/{stat}" if layer else f"{PREFIX}/{leg}/{stat}"


def parse_numerics_metric(key: str) -> Optional[tuple[Optional[str], str, str]]:
    """``(layer or None, leg, stat)`` of a ``numerics_metric`` name; None for other keys."""
    parts = key.split("/")
    if parts[0] != PREFIX or len(parts) not in (3, 4) or parts[-1] not in STATS or parts[-2] not in LEGS:
        return None
    return (parts[1] if len(parts) == 4 else None, parts[-2], parts[-1])


def layer_labels(model_parts: Iterable[nn.Module]) -> dict[Hashable, str]:
    """Each MoE layer's dispatcher -> ``layer<i>`` (its transformer block's index)."""
    labels = {}
    for part in model_parts:
        for name, module in part.named_modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is not None:
                block = _LAYER.search(name)
                labels[dispatcher] = f"layer{block.group(1)}" if block else name.replace(".", "_")
    return labels


def _order(label: str) -> tuple:
    """Layers in block order (layer2 before layer10)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label))


def collect_metrics(model_parts: Iterable[nn.Module]) -> dict[str, float]:
    """The probe's statistics since the last call, summed over all ranks, as wandb metrics
    (empty when nothing was sampled). A collective when something was: every rank calls it
    at the same step (they all sample the same steps and run the same layers)."""
    collected = PROBE.collect()
    if not collected:
        return {}
    labels = layer_labels(model_parts)
    named = {(labels.get(reporter, f"moe{i}"), leg): stats
             for i, ((reporter, leg), stats) in enumerate(collected.items())}
    keys = sorted(named, key=lambda k: (_order(k[0]), LEGS.index(k[1])))
    reduced = [named[k] for k in keys]
    if dist.is_available() and dist.is_initialized():
        reduced = reduce_over_ranks(reduced)
    return metrics_of({k: stats.summary() for k, stats in zip(keys, reduced)})


def metrics_of(per_layer: Mapping[tuple[str, str], Mapping[str, Any]]) -> dict[str, float]:
    """wandb metrics of ``{(layer, leg): LegStats.summary()}``: per layer and model-wide."""
    metrics: dict[str, float] = {}
    for leg in LEGS:
        layers = {layer: s for (layer, leg_), s in per_layer.items() if leg_ == leg}
        for layer, summary in layers.items():
            metrics.update({numerics_metric(leg, stat, layer): v for stat, v in summary.items() if v is not None})
        for stat in STATS:
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
        m = {stat: metrics.get(numerics_metric(leg, stat)) for stat in STATS}
        if m["rel_l2_err"] is None:
            continue
        exponents = ("n/a" if m["scale_exp_min"] is None
                     else f"[{m['scale_exp_min']:.0f}, {m['scale_exp_max']:.0f}]")
        parts.append(f"{leg} rel_l2 {m['rel_l2_err']:.2e} saturated {100 * m['saturated_block_frac']:.2f}% "
                     f"flushed {100 * m['flushed_frac']:.3f}% scale_exp {exponents}")
    return f"numerics step {step}: " + "; ".join(parts) if parts else None
