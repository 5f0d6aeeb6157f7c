"""Checks of a dispatch's input that keep the ranks of an EP group in step: a bad input on any
rank ends in a clear error on EVERY rank, naming the rank whose input failed, instead of a
peer waiting for the group timeout, garbage, or a crash deep in a kernel.

Three kinds, by where they can be decided:

* **Group checks** (``agree``): the dispatcher's config, its tokens' dim and dtype and the symm
  buffers' size are the same on every rank. One exchange of host messages through the
  group's store (no device work, no host sync) when a dispatcher is built, meets a new token
  shape, or allocates peer buffers; never per dispatch. At build each rank's own check of its
  config travels in the same exchange: a rank whose config is wrong raises its error, its
  peers one that names it.
* **Host checks** (``host_fault``): shapes, dtypes, the counts' length, the format's row
  multiple. A rank whose input fails one does not raise at once (its peers would wait for it
  in the count exchange): it takes part in that exchange with its fault bits set, then raises
  its own error; the peers raise ``DispatchInputError`` naming it.
* **Device checks** (``check_routing``): expert ids in ``[0, E)``, counts equal to the ids'
  histogram (so they sum to ``T x top_k``). Two Triton launches on CUDA
  (``mxfp8_ep.kernels.check_kernels``), torch ops elsewhere, no host sync; the routing they return
  is safe to index with whatever the input was (the dispatcher routes by it), so no kernel
  reads or writes out of bounds. Their fault bits travel with the token
  counts each transport exchanges anyway, and every rank checks every rank's bits where it
  syncs already (nccl: the splits' host copy; CPU: at once), or, on the sync-free symm
  transport, with one ``torch._assert_async`` on the device (no host sync; the process stops
  at its next sync with a message that cannot name the rank) unless debug mode reads them on
  the host (one sync per dispatch) to name the rank and the check
  (``assert_no_faults``).

Debug mode: ``TokenDispatcher.Config.check_inputs=True``, or, when the config leaves it unset,
``set_debug(True)`` (the recipe, for its first steps) or ``MXFP8_EP_DEBUG=1`` (``debug_mode``).
"""

from __future__ import annotations

import enum
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEBUG_ENV = "MXFP8_EP_DEBUG"
TOKEN_DTYPES = (torch.bfloat16, torch.float32)


_debug: bool | None = None  # set_debug's setting


def set_debug(on: bool | None) -> None:
    """Debug mode for every dispatcher of this process whose config leaves ``check_inputs``
    unset (``None``: back to ``MXFP8_EP_DEBUG``). Every rank sets it alike: the recipe turns it
    on for its first steps."""
    global _debug
    _debug = on


def debug_mode(check_inputs: bool | None = None) -> bool:
    """Whether the checks that need a host sync run: ``check_inputs`` when set, else
    ``set_debug``'s setting, else whether ``MXFP8_EP_DEBUG`` is set to anything but ``0`` or
    nothing."""
    if check_inputs is not None:
        return bool(check_inputs)
    if _debug is not None:
        return _debug
    return os.environ.get(DEBUG_ENV, "0").strip() not in ("", "0")


class Fault(enum.IntFlag):
    """Why a rank's dispatch input failed. A rank's fault word is the OR of these; it travels
    with the rank's token counts, so every rank learns every rank's word."""

    SHAPE = 1
    """x is not ``(T, D)``, or the expert ids or the scores are not ``(T, top_k)`` (host)."""
    DTYPE = 2
    """Tokens of a dtype the dispatcher does not take, or expert ids that are not integers
    (host)."""
    ROW_MULTIPLE = 4
    """A model dim that a quantized leg's wire format cannot split into whole blocks (host)."""
    COUNTS_SHAPE = 8
    """``num_tokens_per_expert`` does not have ``num_experts`` entries (host)."""
    EXPERT_ID = 16
    """An expert id outside ``[0, num_experts)`` (device)."""
    COUNTS = 32
    """``num_tokens_per_expert`` is not the histogram of the expert ids (device)."""
    COUNTS_SUM = 64
    """``num_tokens_per_expert`` does not sum to ``tokens x top_k`` (device)."""
    TOKENS = 128
    """More tokens than the symm transport's buffers hold (host, on the rank that has them)."""
    CONFIG = 256
    """The dispatcher's config fails its checks on this rank (host, at ``build``)."""

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Fault.SHAPE: "x is not (tokens, dim) or the expert ids / scores are not (tokens, top_k)",
    Fault.DTYPE: "tokens not bfloat16/float32, or expert ids not integers",
    Fault.ROW_MULTIPLE: "a model dim that a quantized leg's wire format cannot split into whole blocks",
    Fault.COUNTS_SHAPE: "num_tokens_per_expert does not have num_experts entries",
    Fault.EXPERT_ID: "expert ids outside [0, num_experts)",
    Fault.COUNTS: "num_tokens_per_expert is not the histogram of the expert ids",
    Fault.COUNTS_SUM: "num_tokens_per_expert does not sum to tokens x top_k",
    Fault.TOKENS: "more tokens than the buffers hold (raise TokenDispatcher.Config.max_tokens_per_rank)",
    Fault.CONFIG: "the dispatcher's config fails its checks",
}


class DispatchInputError(ValueError):
    """A dispatcher's input (a dispatch's tokens and routing, or its config at build) failed its
    checks on one or more ranks; raised on every rank of the group. ``faults``: rank -> its
    ``Fault`` bits."""

    def __init__(self, message: str, faults: dict[int, Fault]):
        super().__init__(message)
        self.faults = faults


def fault_message(faults: Sequence[int], num_experts: int | None = None) -> str | None:
    """What failed on which rank, from every rank's fault word (``None``: nothing failed)."""
    lines = []
    for rank, word in enumerate(faults):
        if word:
            what = "; ".join(f.description for f in Fault if f & int(word))
            if num_experts is not None:
                what = what.replace("num_experts)", f"num_experts = {num_experts})")
            lines.append(f"rank {rank}: {what}")
    if not lines:
        return None
    return "dispatch input failed its checks on " + ", ".join(lines)


def raise_on_faults(faults: Sequence[int], num_experts: int | None = None,
                    own: BaseException | None = None) -> None:
    """Raise when any rank's fault word is nonzero: this rank's own host error (``own``) if it
    has one, else ``DispatchInputError`` naming every rank that failed and why."""
    if own is not None:
        raise own
    message = fault_message(faults, num_experts)
    if message is not None:
        raise DispatchInputError(message, {r: Fault(int(w)) for r, w in enumerate(faults) if w})


# CUDA device asserts (torch._assert_async) take messages shorter than this.
DEVICE_ASSERT_MESSAGE_LIMIT = 255


def device_assert_message(where: str) -> str:
    """What a failed device check says: the checks it covers are listed in debug mode, which
    names the rank and the check (``raise_on_faults``)."""
    return (f"{where}: a rank's input failed the dispatcher's checks; set {DEBUG_ENV}=1 or "
            f"TokenDispatcher.Config.check_inputs=True to name the rank and the check")


def assert_no_faults(faults_W: torch.Tensor, debug: bool, num_experts: int | None = None,  # noqa: N803
                     where: str = "dispatch", ok: torch.Tensor | None = None) -> None:
    """Check every rank's fault word (``faults_W``, a device tensor) after an exchange that
    gives each rank all of them. On CUDA without ``debug``: ``torch._assert_async`` on ``ok``
    (a flag a kernel computed already) or on ``faults_W == 0``, no host sync (the process
    stops at its next sync; the message cannot name the rank). Otherwise (CPU, where reading
    is free, or debug mode: one host sync): ``raise_on_faults``."""
    if faults_W.is_cuda and not debug:
        torch._assert_async((faults_W == 0).all() if ok is None else ok, device_assert_message(where))
        return
    raise_on_faults(faults_W.tolist(), num_experts)


# --------------------------------------------------------------------------------------------
# host checks


@dataclass(frozen=True)
class HostFault:
    """A host check that failed on this rank: its bits (for the peers) and its error (raised
    here once the peers have them)."""

    fault: Fault
    error: BaseException


def host_fault(x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E, *,  # noqa: N803
               num_experts: int, top_k: int, rank: int,
               dim_error: Callable[[int], str | None] | None = None) -> HostFault | None:
    """The first host check the inputs fail, or ``None``. No device value is read.
    ``dim_error``: why tokens of a dim cannot travel on the dispatcher's legs (their wire
    formats' blocks), or None."""
    here = f"dispatch on rank {rank}"

    def fail(fault, error_type, message):
        return HostFault(fault, error_type(f"{here}: {message}"))

    x, ids, scores, counts = x_TD, topk_expert_ids_TK, topk_scores_TK, num_tokens_per_expert_E
    if x.dim() != 2 or ids.dim() != 2 or ids.shape != (x.shape[0], top_k):
        return fail(Fault.SHAPE, ValueError, f"takes x (T, D) and expert ids (T, top_k={top_k}), got "
                                             f"{tuple(x.shape)} and {tuple(ids.shape)}")
    if scores.shape != ids.shape:
        return fail(Fault.SHAPE, ValueError, f"scores {tuple(scores.shape)} != expert ids {tuple(ids.shape)}")
    if x.dtype not in TOKEN_DTYPES:
        return fail(Fault.DTYPE, TypeError, f"takes bfloat16 or float32 tokens, got {x.dtype}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        return fail(Fault.DTYPE, TypeError, f"takes integer expert ids, got {ids.dtype}")
    error = dim_error(x.shape[1]) if dim_error is not None else None
    if error is not None:
        return fail(Fault.ROW_MULTIPLE, ValueError, f"{error} (the model dim); use a2a=bf16 for this model")
    if counts.dim() != 1 or counts.numel() != num_experts:
        return fail(Fault.COUNTS_SHAPE, ValueError,
                    f"num_tokens_per_expert has shape {tuple(counts.shape)}, expected ({num_experts},): "
                    f"one count per expert")
    return None


# --------------------------------------------------------------------------------------------
# device checks


@dataclass(frozen=True)
class CheckedRouting:
    """A rank's routing after the device checks: safe to route by whatever the input was."""

    expert_ids: torch.Tensor  # (T * top_k,) int64: the ids, each one outside [0, E) replaced by 0
    counts: torch.Tensor  # (E,) int64: the histogram of ``expert_ids`` (what the rank routes by)
    fault: torch.Tensor  # () int64: this rank's ``Fault`` bits of the device checks


def check_routing(topk_expert_ids_TK: torch.Tensor, num_tokens_per_expert_E: torch.Tensor,  # noqa: N803
                  num_experts: int, kernel: str = "torch") -> CheckedRouting:
    """Expert ids in ``[0, num_experts)``, counts equal to the histogram of the ids and summing to
    ``T x top_k``: the fault bits, on the device (no host sync). The counts are compared with
    the histogram of the ids in range (what torchtitan's ``histc`` counts); the returned
    counts, the histogram of the returned ids, agree with those ids by construction, so
    routing by them keeps every kernel in bounds. ``kernel="triton"``: the same in two Triton
    launches (``mxfp8_ep.kernels.check_kernels``), of which this torch code is the twin."""
    ids = topk_expert_ids_TK.reshape(-1).to(torch.int64)
    counts = num_tokens_per_expert_E.to(device=ids.device, dtype=torch.int64)
    if kernel == "triton":
        from mxfp8_ep.kernels import check_kernels

        bits = {f.name: int(f) for f in (Fault.EXPERT_ID, Fault.COUNTS, Fault.COUNTS_SUM)}
        safe, routed, fault = check_kernels.check_routing(ids.contiguous(), counts.contiguous(), num_experts, bits)
        return CheckedRouting(expert_ids=safe, counts=routed, fault=fault)
    device = ids.device
    valid = (ids >= 0) & (ids < num_experts)
    safe = torch.where(valid, ids, 0)
    in_range = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, safe, valid.to(torch.int64))
    missing = ids.numel() - valid.sum()
    fault = (
        torch.where(missing > 0, int(Fault.EXPERT_ID), 0)
        | torch.where((counts != in_range).any(), int(Fault.COUNTS), 0)
        | torch.where(counts.sum() != ids.numel(), int(Fault.COUNTS_SUM), 0)
    )
    # The ids replaced by 0 are routed to expert 0: their counts go there too.
    routed = in_range.index_add(0, torch.zeros(1, dtype=torch.int64, device=device), missing.view(1))
    return CheckedRouting(expert_ids=safe, counts=routed, fault=fault.to(torch.int64))


def host_fault_routing(num_experts: int, fault: Fault, device) -> CheckedRouting:
    """The routing a rank whose input failed a host check exchanges: no tokens, its fault bits."""
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return CheckedRouting(
        expert_ids=empty, counts=torch.zeros(num_experts, dtype=torch.int64, device=device),
        fault=torch.full((), int(fault), dtype=torch.int64, device=device),
    )


# --------------------------------------------------------------------------------------------
# group checks

_AGREEMENTS: dict[str, int] = {}  # group name -> agreements made on it (every rank counts alike)


def _all_gather_on_host(group: dist.ProcessGroup, entry: dict) -> list:
    """Every rank's ``entry`` (picklable), through the group's key-value store: host messages
    only, so no device work and no host sync even on an NCCL group (``all_gather_object``
    would stage the objects on the GPU and wait for them). Each rank writes its entry under
    the agreement's number and waits for every rank's (up to the store's timeout); the
    entries stay (a few hundred bytes per rank and agreement, a handful of agreements per
    dispatcher). Without a store: ``all_gather_object``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    try:
        store = dist.distributed_c10d._get_process_group_store(group)
    except (AttributeError, KeyError):
        store = None
    if store is None:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, entry, group=group)
        return gathered
    number = _AGREEMENTS.get(group.group_name, 0)
    _AGREEMENTS[group.group_name] = number + 1
    prefix = f"mxfp8_ep/agree/{number}"
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.set(keys[rank], pickle.dumps(entry))
    store.wait(keys)
    gathered = [pickle.loads(store.get(key)) for key in keys]
    # No rank leaves before every rank has read every entry (the store may live in a rank's
    # process, which a rank that raises next may end).
    if store.add(f"{prefix}/read", 1) == world:
        store.set(f"{prefix}/done", b"")
    else:
        store.wait([f"{prefix}/done"])
    return gathered


def agree(group: dist.ProcessGroup, phase: str, facts: dict, fault: HostFault | None = None,
          local: dict | None = None) -> list[dict]:
    """One exchange on the host (``_all_gather_on_host``) of every rank's ``phase``, ``facts``
    (must be equal on every rank), host ``fault`` and ``local`` values (free to differ;
    returned, one dict per rank).
    Raises on every rank, the same way, when a rank had a fault (that rank: its own error; the
    others: ``DispatchInputError`` with that rank's message), when the ranks are in different
    phases (one builds a dispatcher while another dispatches), or when a fact differs (a
    ``ValueError`` naming each field and every rank's value)."""
    entry = {
        "phase": phase, "facts": facts, "local": local or {},
        "fault": None if fault is None else (int(fault.fault), f"{type(fault.error).__name__}: {fault.error}"),
    }
    gathered = _all_gather_on_host(group, entry)
    phases = [g["phase"] for g in gathered]
    if len(set(phases)) > 1:
        listed = ", ".join(f"rank {r} in {p}" for r, p in enumerate(phases))
        raise ValueError(f"token dispatcher: the EP ranks are at different points ({listed}); every rank must "
                         f"build the same dispatchers and dispatch through them in the same order")
    if fault is not None:
        raise fault.error
    failed = {r: g["fault"] for r, g in enumerate(gathered) if g["fault"] is not None}
    if failed:
        listed = "; ".join(f"rank {r}: {message}" for r, (_, message) in failed.items())
        raise DispatchInputError(f"{phase} input failed its checks on {listed}",
                                 {r: Fault(bits) for r, (bits, _) in failed.items()})
    differ = []
    for field in facts:
        values = [g["facts"].get(field) for g in gathered]
        if any(v != values[0] for v in values[1:]):
            differ.append(f"{field}: " + ", ".join(f"rank {r} = {v}" for r, v in enumerate(values)))
    if differ:
        raise ValueError(f"token dispatchers differ across the EP group in {phase} ({'; '.join(differ)}); "
                         f"every rank must build the same config and dispatch tokens of the same dim and dtype")
    return [g["local"] for g in gathered]
