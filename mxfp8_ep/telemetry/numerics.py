"""Quantization telemetry of the MXFP8 legs: what quantizing a leg's rows does to them.

The dispatchers report each MXFP8 leg's rows to the process's probe (``PROBE``) with one call
per leg (``NumericsProbe.observe``). Unarmed, that call returns at once: no device work, no
host sync. Armed (a training loop arms it for the steps it samples), it takes a fixed number
of rows (``SAMPLE_ROWS``, spread evenly over the leg's rows), quantizes them with the format's
torch reference (``mxfp8_ep.format.mxfp8``, the run's scale rounding: the same bits as the kernels)
and adds their statistics to device tensors (``LegStats``), still without a host sync. The
loop then takes them (``collect``), sums them over ranks (``reduce_over_ranks``) and reads
them on the host (``LegStats.summary``): the one sync, once per sampled step.

Statistics of one (layer, leg), over its sampled elements (``mxfp8_ep.config.NUMERICS_STATS``):

* ``rel_l2_err``: ``||dequant(quant(x)) - x|| / ||x||`` (L2 over all sampled elements, the
  round trip in the activation dtype, as the receiving pass writes it);
* ``saturated_block_frac``: the fraction of 32-element blocks with an e4m3 element at the
  format's largest magnitude, ``|q| == 448`` (under floor rounding this includes the elements
  the quantizer clamped from above 448: the blocks that lost their largest value);
* ``flushed_frac``: of the nonzero elements, the fraction that the round trip makes zero;
* ``scale_exp_min`` / ``scale_exp_max``: the range of the blocks' e8m0 scale exponents
  (``byte - 127``: an element's value is ``e4m3 * 2**exp``), over blocks that are not all zero.

The rows a leg reports are the rows its quantizer encodes, as the transport sends them
(``PushTokenDispatcher._wire_rows_to_experts`` / ``_wire_rows_to_tokens``), of which only those
that leave the rank count (with ``A2AConfig.quantize_local_rows`` also those that stay, which
take the same round trip):

* expert-bound legs (dispatch's forward, combine's backward): on symm with top-k > 1 each token
  a peer needs, once and unweighted (its owner applies the router score after decoding); on
  symm with top-1 and on the nccl transport each routed row, times its router score where the
  leg carries the scores (dispatch's forward when they come before the experts, combine's
  backward when after);
* token-bound legs (combine's forward, dispatch's backward): on symm with the scores after the
  experts and top-k > 1, the partial sums it sends, one per token of another rank
  (``symm_reference.partial_sums``; combine's forward weighted by the scores, with
  ``A2AConfig.symm_combine_partial_sums``); otherwise each expert-major row that goes back,
  unweighted (the token's rank weighs it as it adds it up).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mxfp8_ep.config import NUMERICS_STATS
from mxfp8_ep.format.mxfp8 import dequantize_reference, quantize_reference
from mxfp8_ep.format.wire_format import WireFormat

# The format the statistics describe (its torch reference quantizes the samples); its block
# size, largest element and scale encoding come from it.
FORMAT = WireFormat.MXFP8

# Rows sampled per leg call: at a 7168-wide model, 64 rows are 14,336 blocks.
SAMPLE_ROWS = 64

# LegStats.values: sums over ranks and calls, then maxima (the smallest exponent is kept negated).
_SUMS = ("sq_err", "sq_ref", "blocks", "saturated_blocks", "nonzero", "flushed")
_MAXIMA = ("neg_scale_exp_min", "scale_exp_max")


def sample_rows(num_rows: int, sample: int, device: torch.device) -> torch.Tensor:
    """Indices of ``min(sample, num_rows)`` rows of ``num_rows``, spread evenly from row 0."""
    count = min(sample, num_rows)
    return torch.arange(count, device=device) * num_rows // max(count, 1)


@dataclass
class LegStats:
    """Sums of one (layer, leg) over the rows sampled so far: a float64 device tensor holding
    ``_SUMS`` then ``_MAXIMA`` (no host sync until ``summary``)."""

    values: torch.Tensor

    @classmethod
    def of_rows(cls, rows: torch.Tensor, rounding: str, valid: torch.Tensor | None = None) -> "LegStats":
        """The statistics of quantizing ``rows`` (``(N, D)``, ``D`` a multiple of 32) to MXFP8
        with ``rounding``; rows where ``valid`` (``(N,)`` bool) is False take no part."""
        rows = rows.detach()
        num, dim = rows.shape
        if valid is not None:
            rows = torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        q = quantize_reference(rows, rounding)
        x = rows.float()
        round_trip = dequantize_reference(q, rows.dtype).float()
        err = round_trip - x
        block = FORMAT.block_size
        groups = dim // block
        blocks = x.view(num, groups, block)
        q_blocks = q.data.float().view(num, groups, block)
        count = torch.full((), num, dtype=torch.float64, device=rows.device) if valid is None else valid.sum()
        nonzero = x != 0
        # Blocks with a value: an all-zero block (and a NaN block, scale byte 0xFF) has no exponent.
        exponent = q.scale.to(torch.float64) - FORMAT.scale_bias
        has_scale = (blocks.abs().amax(dim=2) > 0) & (q.scale != FORMAT.scale_nan)
        inf = torch.tensor([math.inf], dtype=torch.float64, device=rows.device)
        values = torch.stack([
            (err.double() ** 2).sum(),
            (x.double() ** 2).sum(),
            count.double() * groups,
            (q_blocks.abs() == FORMAT.element_max).any(dim=2).sum().double(),
            nonzero.sum().double(),
            (nonzero & (round_trip == 0)).sum().double(),
            torch.cat([torch.where(has_scale, -exponent, -math.inf).reshape(-1), -inf]).max(),
            torch.cat([torch.where(has_scale, exponent, -math.inf).reshape(-1), -inf]).max(),
        ])
        return cls(values)

    def add(self, other: "LegStats") -> None:
        """Fold ``other`` in (device ops)."""
        n = len(_SUMS)
        self.values = torch.cat([self.values[:n] + other.values[:n], torch.maximum(self.values[n:], other.values[n:])])

    def summary(self) -> dict[str, float | int | None]:
        """``NUMERICS_STATS`` on the host (a device-to-host copy): None where nothing was sampled (no
        rows; no block with a value for the exponents)."""
        sq_err, sq_ref, blocks, saturated, nonzero, flushed, neg_min, exp_max = self.values.tolist()
        if blocks == 0:
            return dict.fromkeys(NUMERICS_STATS)
        return {
            "rel_l2_err": math.sqrt(sq_err / sq_ref) if sq_ref > 0 else 0.0 if sq_err == 0 else math.inf,
            "saturated_block_frac": saturated / blocks,
            "flushed_frac": flushed / nonzero if nonzero else 0.0,
            "scale_exp_min": int(-neg_min) if math.isfinite(neg_min) else None,
            "scale_exp_max": int(exp_max) if math.isfinite(exp_max) else None,
        }


def reduce_over_ranks(stats: Sequence[LegStats], group: dist.ProcessGroup | None = None) -> list[LegStats]:
    """Each entry summed (the exponent range widened) over the ranks of ``group``: two
    all-reduces. Every rank passes its entries in the same order."""
    if not stats:
        return []
    table = torch.stack([s.values for s in stats])
    n = len(_SUMS)
    sums, maxima = table[:, :n].contiguous(), table[:, n:].contiguous()
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    return [LegStats(row) for row in torch.cat([sums, maxima], dim=1)]


class NumericsProbe:
    """Collects ``LegStats`` per (reporter, leg) while armed; does nothing otherwise."""

    def __init__(self, sample: int = SAMPLE_ROWS):
        self.sample = sample
        self.armed = False
        self._stats: dict[tuple[Hashable, str], LegStats] = {}

    @torch.compiler.disable
    def observe(self, reporter: Hashable, leg: str, rows: torch.Tensor, rounding: str,
                valid: torch.Tensor | None = None) -> None:
        """A leg's rows (``(N, D)``) from ``reporter`` (a dispatcher: one per MoE layer), to be
        quantized with ``rounding``; ``valid`` (``(N,)`` bool): the rows that carry data."""
        if not self.armed:
            return
        with torch.no_grad():
            index = sample_rows(rows.shape[0], self.sample, rows.device)
            stats = LegStats.of_rows(rows[index], rounding, None if valid is None else valid[index])
        key = (reporter, leg)
        if key in self._stats:
            self._stats[key].add(stats)
        else:
            self._stats[key] = stats

    @property
    def pending(self) -> bool:
        """Whether statistics wait to be collected (host state: no sync)."""
        return bool(self._stats)

    def collect(self) -> dict[tuple[Hashable, str], LegStats]:
        """The statistics gathered since the last collect, and forget them."""
        stats, self._stats = self._stats, {}
        return stats

    def mark(self) -> dict[tuple[Hashable, str], torch.Tensor]:
        """The statistics pending now (device copies, no host sync; nothing when none are), for
        ``rollback``: a replayed attempt's samples go, earlier steps' stay."""
        return {key: stats.values.clone() for key, stats in self._stats.items()}

    def rollback(self, mark: dict[tuple[Hashable, str], torch.Tensor]) -> None:
        """Forget what was observed since ``mark`` was taken (``mark``'s statistics pending again)."""
        self._stats = {key: LegStats(values.clone()) for key, values in mark.items()}


# The process's probe: the dispatchers report to it, a training loop arms and collects it.
PROBE = NumericsProbe()
