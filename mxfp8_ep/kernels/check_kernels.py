"""Triton kernels of the dispatcher's device checks (``dispatcher.checks.check_routing`` is
their torch twin: same arguments, same results). Two launches and a memset per dispatch
instead of ~16 small torch ops, no host sync:

* ``_routing_histogram_kernel`` (one program per block of ids): each id outside ``[0, E)``
  becomes 0 in the ids the dispatcher routes by; the block's histogram of those ids
  (``tl.histogram``) and its count of replaced ids go into a zeroed int64 buffer with one
  atomic add per bin.
* ``_routing_faults_kernel`` (one program): compares the caller's counts with the histogram
  of the ids in range and their sum with ``T x top_k``, and writes the fault word.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ID_BLOCK = 1024


@triton.jit
def _routing_histogram_kernel(ids_ptr, safe_ptr, hist_ptr, N, E, EP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    valid = (ids >= 0) & (ids < E)
    safe = tl.where(valid, ids, 0)
    tl.store(safe_ptr + offs, safe, mask=ok)
    counts = tl.histogram(safe.to(tl.int32), EP, mask=ok)
    bins = tl.arange(0, EP)
    tl.atomic_add(hist_ptr + bins, counts.to(tl.int64), mask=(bins < E) & (counts > 0))
    replaced = tl.sum((ok & ~valid).to(tl.int64), axis=0)
    if replaced > 0:
        tl.atomic_add(hist_ptr + EP, replaced)


@triton.jit
def _routing_faults_kernel(hist_ptr, counts_ptr, fault_ptr, N, E, EP: tl.constexpr,
                           EXPERT_ID: tl.constexpr, COUNTS: tl.constexpr, COUNTS_SUM: tl.constexpr):
    bins = tl.arange(0, EP)
    in_bins = bins < E
    routed = tl.load(hist_ptr + bins, mask=in_bins, other=0)
    replaced = tl.load(hist_ptr + EP)
    in_range = routed - tl.where(bins == 0, replaced, 0)
    counts = tl.load(counts_ptr + bins, mask=in_bins, other=0)
    differs = tl.sum((counts != in_range).to(tl.int32), axis=0)
    fault = (tl.where(replaced > 0, EXPERT_ID, 0) | tl.where(differs > 0, COUNTS, 0)
             | tl.where(tl.sum(counts, axis=0) != N, COUNTS_SUM, 0))
    tl.store(fault_ptr, fault.to(tl.int64))


def check_routing(ids: torch.Tensor, counts: torch.Tensor, num_experts: int, fault_bits: dict[str, int]):
    """``(ids outside [0, E) replaced by 0, their histogram, the fault word)`` of flat int64
    ``ids`` and int64 ``counts`` (``dispatcher.checks.check_routing``'s twin: the same values).
    ``fault_bits``: the ``Fault`` values of EXPERT_ID, COUNTS and COUNTS_SUM."""
    num, ep = ids.numel(), triton.next_power_of_2(max(num_experts, 1))
    safe = torch.empty_like(ids)
    hist = torch.zeros(ep + 1, dtype=torch.int64, device=ids.device)  # bins, then the replaced ids
    fault = torch.empty((), dtype=torch.int64, device=ids.device)
    if num:
        _routing_histogram_kernel[(triton.cdiv(num, ID_BLOCK),)](ids, safe, hist, num, num_experts, EP=ep,
                                                                 BLOCK=ID_BLOCK)
    _routing_faults_kernel[(1,)](hist, counts, fault, num, num_experts, EP=ep, EXPERT_ID=fault_bits["EXPERT_ID"],
                                 COUNTS=fault_bits["COUNTS"], COUNTS_SUM=fault_bits["COUNTS_SUM"])
    return safe, hist[:num_experts], fault
