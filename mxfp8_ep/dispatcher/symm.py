"""Transport ``symm`` (one node): Triton kernels push each leg's rows straight into their
owner's staging buffer through peer memory (``peer_memory.PeerBuffer``), quantizing in that
push and dequantizing in the receiving pass; token counts travel the same way, so forward and
backward never wait for the host. The peer buffers are allocated once per (group, device, dim,
dtype, layout) and shared by every layer of that shape (``release_peer_buffers`` drops them).

The expert-major tensors hold an elastic capacity (``A2AConfig.capacity_factor`` times the
balanced case, growing up to ``A2AConfig.capacity_ceiling``: ``capacity.next_capacity``). The
peer buffers never depend on it: their capacity-sized areas (the token map and row weights, the
returned score gradients; with top-1 the rows) hold the worst case
(``capacity.symm_staging_rows``), so a grown capacity or a spill's exact size takes no new
symmetric memory, only a larger expert-major tensor (the caching allocator's). A dispatch learns
the rows its routing needs on the device, once every rank's token counts have arrived and
before any row moves (the same count on every rank of the group). What it does when they pass
the capacity depends on where it runs:

* inside a replay scope (``replay_scope``: a ``mxfp8_ep.elastic.ReplayGuard`` attempt, or a
  step of ``ReplayOverflowedSteps``) it reads nothing on the host: it stays in bounds
  (``routing.routing_tables``' ``row_limit``), its results are wrong, and it raises the
  scope's overflow count on the device (``ReplayScope``). Only the rows of trustworthy
  dispatches count towards growth: in forward order, those up to and including the first that
  overflowed (the later ones route from cut activations). The caller reads the scope once
  (``mxfp8_ep.elastic.check_overflow``), ``plan_overflowed`` grows each capacity that
  overflowed, up to its ceiling, and the caller runs the step again: in a scope again, or,
  where the step needs more than a ceiling (a spill), in an ``exact`` scope;
* outside one (a forward of a loop without a guard, torchtitan's own ``Trainer``, an eval
  pass) and in an ``exact`` scope it reads that row count on the host (one sync per dispatch,
  announced once per process) and returns exactly the rows it needs. Nothing is cut, nothing
  fails, and a recompute of the same routing (activation checkpointing) gets the same size.

Replay scopes belong to the thread that opened them, and reach the backward of its step: a
dispatch on a thread without a scope of its own that runs inside an autograd backward (a
recompute under activation checkpointing, which CUDA runs on its device thread) counts in the
scopes its dispatcher's forward counted in while they are open (``dispatch_scopes``), so it
takes the forward's capacity. Any other dispatch on another thread runs as outside one.

Every leg of a dispatch uses the buffer set the dispatch took (``ExpertRowRouting.buffers``)
and its capacity (``ExpertRowRouting.capacity``), so a set re-allocated between a layer's
forward and its backward (more tokens per rank) changes nothing for it."""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

import torch

from mxfp8_ep.telemetry import wire_stats
from mxfp8_ep.exchange.capacity import expert_major_capacity, next_capacity, staging_rows, worst_case_capacity
from mxfp8_ep.dispatcher import checks
from mxfp8_ep.dispatcher.base import TokenDispatcher, register_transport
from mxfp8_ep.dispatcher.push import ExpertRowRouting, PushTokenDispatcher
from mxfp8_ep.exchange.peer_memory import PeerBuffer, int64_tensor
from mxfp8_ep.exchange.routing import to_peer
from mxfp8_ep.exchange.staging import staging_buffer_nbytes, staging_nbytes, token_map_offset
from mxfp8_ep.exchange.symm_reference import partial_slots, partial_stage_rows, partial_sums
from mxfp8_ep.transport import Transport

_log = logging.getLogger(__name__)


@dataclass
class _SymmBuffers:
    """Peer buffers of one (group, device, dim, dtype): a count buffer and two staging buffers
    that consecutive legs alternate between. Each staging buffer holds ``staging_rows`` rows,
    then (at ``map_offset``) a token map and row weights of ``map_rows`` entries each
    (``staging.token_map``, ``row_weights``): the worst case's expert-major rows, so that any
    capacity a dispatch takes fits. A re-allocation (more tokens per rank) makes new staging
    buffers and keeps the count buffer."""

    key: tuple  # ``SymmTokenDispatcher._buffer_key``
    counts: PeerBuffer
    staging: tuple[PeerBuffer, PeerBuffer]
    staging_rows: int
    max_tokens: int
    map_rows: int  # the worst case's expert-major rows (``capacity.worst_case_capacity``)
    map_offset: int
    next_staging: int = 0

    def take_staging(self) -> PeerBuffer:
        # Leg j writes into staging j % 2. A peer writes into a buffer again only after the
        # barrier of leg j + 1, which this rank enters after it has read leg j's rows: every
        # rank runs the same sequence of legs on one stream, so no live data is overwritten.
        buf = self.staging[self.next_staging]
        self.next_staging ^= 1
        return buf


@dataclass
class ElasticCapacity:
    """A buffer set's rows across its re-allocations (``capacity.next_capacity``): the elastic
    capacity it holds from step to step, its ceiling and the worst case, for ``max_tokens``
    tokens per rank (which never shrinks)."""

    rows: int
    ceiling: int
    worst: int
    align: int
    max_tokens: int


_BUFFERS: dict[tuple, _SymmBuffers] = {}
_CAPACITY: dict[tuple, ElasticCapacity] = {}
_THREAD = threading.local()  # ``scopes``: the replay scopes this thread opened, innermost last
_ANNOUNCED: set[str] = set()  # what ``_announce_once`` said
# A dispatch index past every real one: no dispatch of the scope overflowed.
NO_OVERFLOW = 2**62


def _scopes() -> list[ReplayScope]:
    if not hasattr(_THREAD, "scopes"):
        _THREAD.scopes = []
    return _THREAD.scopes


def in_backward() -> bool:
    """Whether this thread now runs an autograd backward (its device thread or the caller's):
    a forward here is a recompute (activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


def dispatch_scopes(owner) -> list[ReplayScope]:
    """The replay scopes a dispatch of ``owner`` (a dispatcher) counts in, innermost last:
    this thread's open ones (remembered on ``owner``); on a thread without any, inside an
    autograd backward, those ``owner``'s last forward counted in while all are still open (the
    recompute of that forward, on the device thread); else none."""
    own = _scopes()
    if own:
        owner._forward_scopes = tuple(own)
        return list(own)
    kept = getattr(owner, "_forward_scopes", ())
    if kept and in_backward() and all(scope.open for scope in kept):
        return list(kept)
    return []


class ReplayScope:
    """An open replay scope (``replay_scope``): what its dispatches found, on the device (no
    host sync): how many overflowed, the index (in forward order) of the first that did, and
    per buffer set the rows its trustworthy dispatches needed: those up to and including the
    first that overflowed, as a later one routes from activations the cut rows made wrong.
    ``exact``: its dispatches take exactly the rows they need (a spill's rerun)."""

    def __init__(self, exact: bool = False):
        self.exact = exact
        self.open = True  # until ``replay_scope`` closes it
        self.dispatches = 0  # dispatches recorded so far (host count: the next one's index)
        # what can raise the overflow count (dispatches and pool pushes) so far: a check that
        # saw them all need not read again
        self.events = 0
        # Per device: (3,) int64 [dispatches that overflowed, index of the first (NO_OVERFLOW: none),
        # whether one did (0/1: later dispatches are not trusted)].
        self._state: dict[torch.device, torch.Tensor] = {}
        self._needed: dict[tuple, torch.Tensor] = {}  # buffer key -> (1,) int64 rows needed

    def _state_on(self, device: torch.device) -> torch.Tensor:
        device = torch.device(device)
        if device not in self._state:
            with torch.inference_mode(False):
                self._state[device] = int64_tensor([0, NO_OVERFLOW, 0], device)
        return self._state[device]

    def record(self, key: tuple, needed: torch.Tensor, capacity: int) -> None:
        """A dispatch through buffer set ``key`` whose routing needs ``needed`` rows ((1,) int64,
        on the device) ran at ``capacity`` rows. Device ops only."""
        state = self._state_on(needed.device)
        over = (needed > capacity).to(torch.int64)
        trusted = state[2:3] == 0  # no earlier dispatch of this scope overflowed
        self.need(key, torch.where(trusted, needed, 0))
        first = torch.where(trusted & (over > 0), self.dispatches, state[1:2])
        state.copy_(torch.cat([state[0:1] + over, first, torch.maximum(state[2:3], over)]))
        self.dispatches += 1
        self.events += 1

    def need(self, key: tuple, rows: torch.Tensor) -> None:
        """``key`` (a buffer set, or an activation pool) needed ``rows`` ((1,) int64, on the
        device) in this scope: its peak rises to them. Device ops only."""
        if key not in self._needed:
            with torch.inference_mode(False):
                self._needed[key] = torch.zeros(1, dtype=torch.int64, device=rows.device)
        peak = self._needed[key]
        torch.maximum(peak, rows, out=peak)

    @property
    def device(self) -> torch.device | None:
        """The device of the scope's first recorded dispatch (None: none yet)."""
        return next(iter(self._state), None)

    def overflows(self, device: torch.device) -> torch.Tensor:
        """(1,) int64 on ``device``: the dispatches inside the scope that overflowed."""
        total = torch.zeros(1, dtype=torch.int64, device=device)
        for state in self._state.values():
            total += state[0:1].to(device)
        return total

    def first_overflow(self, device: torch.device) -> torch.Tensor:
        """(1,) int64 on ``device``: the index of the scope's first dispatch that overflowed
        (``NO_OVERFLOW``: none did)."""
        first = torch.full((1,), NO_OVERFLOW, dtype=torch.int64, device=device)
        for state in self._state.values():
            first = torch.minimum(first, state[1:2].to(device))
        return first

    def count_overflow(self, over: torch.Tensor) -> None:
        """Something other than a dispatch's capacity overflowed where ``over`` ((1,) bool or
        int, on the device) is set (the activation pool: ``mxfp8_ep.pool.activation_pool``): the
        scope's overflow count rises, its dispatches' rows stay trusted. Device ops only."""
        state = self._state_on(over.device)
        state[0:1].add_(over.to(torch.int64))
        self.events += 1

    def needed(self, key: tuple, device: torch.device) -> torch.Tensor:
        """(1,) int64 on ``device``: the rows ``key`` needed in the scope (a buffer set: its
        trustworthy dispatches'; an activation pool: its peak, ``need``)."""
        rows = self._needed.get(key)
        return rows.to(device) if rows is not None else torch.zeros(1, dtype=torch.int64, device=device)


@contextlib.contextmanager
def replay_scope(exact: bool = False):
    """Dispatches of this thread inside run sync-free: an overflow is only counted on the
    device (``ReplayScope``), and the caller checks at the step boundary
    (``mxfp8_ep.elastic.check_overflow`` with the scope this yields) and runs the step again
    (every rank of the group alike). Scopes nest: a dispatch counts in every scope of its
    thread that is open, so an inner scope's check and replay leave an outer scope's overflow
    to the outer check. ``exact``: the rerun of a step that needed more than a ceiling (a
    spill): each dispatch reads its rows on the host and takes exactly those, as outside a
    scope, and nothing overflows. A dispatch on another thread runs as outside every scope,
    unless it recomputes a forward of this one inside a backward (``dispatch_scopes``)."""
    scope = ReplayScope(exact)
    scopes = _scopes()
    scopes.append(scope)
    try:
        yield scope
    finally:
        scope.open = False
        scopes.remove(scope)


def in_replay_scope() -> bool:
    """Whether this thread's dispatches now count their overflows for a replay (an open scope,
    not ``exact``)."""
    scopes = _scopes()
    return bool(scopes) and not scopes[-1].exact


def innermost_scope() -> ReplayScope | None:
    """This thread's innermost open replay scope, or None."""
    scopes = _scopes()
    return scopes[-1] if scopes else None


def needed_rows(scope: ReplayScope, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per elastic capacity (``hold_capacity``, in ``plan_overflowed``'s order), the rows
    ``scope``'s trustworthy dispatches needed and its ceiling, as two int64 tensors on
    ``device`` (no host sync), or None when this process holds none."""
    if not _CAPACITY:
        return None
    keys = list(_CAPACITY)
    needed = torch.cat([scope.needed(key, device) for key in keys])
    return needed, int64_tensor([_CAPACITY[k].ceiling for k in keys], torch.device(device))


@dataclass
class CapacityPlan:
    """What ``plan_overflowed`` decided at a step boundary: per buffer set that overflowed,
    ``(old, new)`` capacity where it grew (``grown``), and ``(ceiling, rows needed)`` where the
    step needs more than the ceiling (``spilled``)."""

    grown: list[tuple[int, int]] = field(default_factory=list)
    spilled: list[tuple[int, int]] = field(default_factory=list)


def plan_overflowed(needed: list[int]) -> CapacityPlan:
    """At a step boundary where the step runs again, after the rows the sets needed were read
    (``needed``, in ``needed_rows``' order): each buffer set that needed more rows than it
    holds grows (``capacity.next_capacity``), up to its ceiling. Past the ceiling the step
    spills: the caller runs it again outside a replay scope, where each dispatch reads its own
    rows and takes exactly those (``SymmTokenDispatcher._routing``). The next dispatch in a
    scope takes the grown capacity; the peer buffers stay (they hold the worst case's map). The
    ranks of an EP group saw the same counts and decide alike."""
    plan = CapacityPlan()
    for key, rows in zip(list(_CAPACITY), needed, strict=True):
        cap = _CAPACITY[key]
        if rows <= cap.rows:
            continue
        step = next_capacity(rows, cap.rows, cap.ceiling, cap.worst, cap.align)
        if step.capacity != cap.rows:
            plan.grown.append((cap.rows, step.capacity))
        if step.kind == "spill":
            plan.spilled.append((cap.ceiling, rows))
        cap.rows = step.capacity
    return plan


def capacities() -> list[int]:
    """Each elastic capacity this process holds (rows; a spill's or an unscoped dispatch's
    exact size, which lasts one dispatch, is not one)."""
    return [cap.rows for cap in _CAPACITY.values()]


def ceilings() -> list[int]:
    """The ceiling of each elastic capacity this process holds (rows)."""
    return [cap.ceiling for cap in _CAPACITY.values()]


def hold_capacity(key: tuple, make) -> ElasticCapacity:
    """The elastic capacity held under ``key`` (a buffer set's, or another sync-free exchange's:
    the two_hop transport's node hop), made by ``make()`` the first time: every capacity held
    here counts in ``needed_rows``, grows in ``plan_overflowed`` and is dropped by
    ``release_peer_buffers``."""
    if key not in _CAPACITY:
        _CAPACITY[key] = make()
    return _CAPACITY[key]


def peer_buffer_nbytes() -> int:
    """Bytes of peer memory this process's symm dispatchers hold (its own count and staging
    buffers; symmetric memory is not the caching allocator's, so its statistics miss them).
    These are every symmetric allocation the transport makes: a grown capacity or a spill
    takes none."""
    return sum(b.counts.nbytes + sum(s.nbytes for s in b.staging) for b in _BUFFERS.values())


def release_peer_buffers() -> None:
    """Drop the cached peer buffers and the capacities they grew to; the next symm dispatch
    allocates them again (a collective). Every rank of the group calls it at the same point,
    when no rank is in a leg."""
    _BUFFERS.clear()
    _CAPACITY.clear()


def _announce_once(what: str, message: str) -> None:
    if what not in _ANNOUNCED:
        _ANNOUNCED.add(what)
        _log.warning(message)


def announce_unguarded() -> None:
    """Say once per process that sync-free dispatches run outside a replay scope
    (``UNGUARDED_MESSAGE``)."""
    _announce_once("unguarded", UNGUARDED_MESSAGE)


UNGUARDED_MESSAGE = (
    "symm dispatch outside a replay scope: each dispatch reads the rows its routing needs on the host (one sync "
    "per dispatch) and takes exactly those before any row moves. For the sync-free path run each training step "
    "through mxfp8_ep.elastic.ReplayGuard, or give torchtitan's Trainer mxfp8_ep.elastic.ReplayOverflowedSteps")


@register_transport(Transport.SYMM)
class SymmTokenDispatcher(PushTokenDispatcher):
    """Peer-memory push transport (one node): sync-free, quantizes inside the push. Each
    leg's rows go straight into the owner's staging buffer at the row the owner reads them
    from; a barrier makes them visible."""

    @dataclass(kw_only=True)
    class Config(TokenDispatcher.Config):
        """``TokenDispatcher.Config`` as this transport reads it (``Config.of``): the same
        fields, and which of its ways of sending a leg they select."""

        @property
        def dispatch_bwd_partial_sums(self) -> bool:
            """Whether dispatch's backward goes back as one partial sum per token and rank
            (``SymmTokenDispatcher._push_to_tokens``): with top-k > 1 and the scores after the
            experts, the plain sum of a token's rows on each rank. The x gradient then adds a
            token's rows in another grouping than the fused nccl transport, and rounds (bf16)
            or quantizes (MXFP8) each partial sum once instead of each row: equal to that
            rounding, not bits."""
            return self.top_k > 1 and not self.score_before_experts

        @property
        def combine_fwd_partial_sums(self) -> bool:
            """Whether combine's forward goes the same way (``dispatch_bwd_partial_sums`` and the
            flag ``A2AConfig.symm_combine_partial_sums``): the weighted sum of a token's rows on
            each rank (the scores ride along with dispatch's forward). The output then differs
            from the fused nccl transport's as the x gradient does, and the score gradients are
            taken where the expert outputs stayed, against the output gradient as it arrived
            there (MXFP8: dequantized), and go back to the tokens' ranks
            (``SymmTokenDispatcher.to_experts``)."""
            return self.dispatch_bwd_partial_sums and self.a2a.symm_combine_partial_sums

        @property
        def scores_after_dequantize(self) -> bool:
            """Whether a token is quantized before its router score multiplies it: with top-k >
            1 the weighted expert-bound leg (combine's backward when the scores come after the
            experts, dispatch's forward when they come first) sends each token once per rank and
            the experts' rank multiplies each row by its score as it receives it
            (``SymmTokenDispatcher._push_to_experts``). On a bf16 leg that is the same product,
            the same bits; on an MXFP8 leg the row is ``score * dequant(quant(token))`` where the
            fused nccl transport sends ``quant(score * token)``: equal to the format's rounding,
            not bits (every gradient downstream of combine's backward, or every value downstream
            of dispatch's forward)."""
            weighted = "dispatch_fwd" if self.score_before_experts else "combine_bwd"
            return self.top_k > 1 and self.a2a.wire_format(weighted).quantized

    def _buffer_key(self, device: torch.device, dim: int, dtype: torch.dtype) -> tuple:
        # The cached PeerBuffers hold the group, so its id cannot be reused while cached.
        cfg = self.config
        return (id(self.group), device, dim, dtype, cfg.top_k, self.num_local_experts, cfg.pad_multiple,
                cfg.combine_fwd_partial_sums, cfg.a2a.capacity_factor, cfg.a2a.capacity_ceiling)

    def _capacity(self, max_tokens: int, earlier: ElasticCapacity | None) -> ElasticCapacity:
        """The rows of a buffer set for ``max_tokens`` tokens per rank: its start
        (``capacity_factor``), ceiling (``capacity_ceiling``, at least the start) and worst
        case; a capacity the set grew to earlier is kept."""
        cfg = self.config
        shape = self._capacity_shape(max_tokens)
        start = expert_major_capacity(*shape, cfg.a2a.capacity_factor)
        ceiling = max(start, expert_major_capacity(*shape, cfg.a2a.capacity_ceiling))
        rows = min(ceiling, max(start, earlier.rows if earlier else 0))
        return ElasticCapacity(rows=rows, ceiling=ceiling, worst=worst_case_capacity(*shape), align=cfg.pad_multiple,
                               max_tokens=max_tokens)

    def _capacity_shape(self, max_tokens: int) -> tuple[int, int, int, int, int]:
        """The arguments of ``capacity.expert_major_capacity`` (and ``worst_case_capacity``) for
        ``max_tokens`` tokens per rank: tokens, top-k, ranks, local experts, alignment."""
        cfg = self.config
        return max_tokens, cfg.top_k, self.ep, self.num_local_experts, cfg.pad_multiple

    def _buffers(self, device: torch.device, dim: int, dtype: torch.dtype, tokens: int) -> _SymmBuffers:
        """The peer buffers for (group, device, ``dim``, ``dtype``), allocated at the first
        dispatch (a collective: every rank builds the same dispatchers in the same order) and
        again only when this dispatcher is configured for more tokens than they hold (never for
        fewer: tokens per rank never shrink); a grown capacity or a spill takes none. Each
        allocation first checks that every rank allocates the same (``checks.agree``), which
        also gives the group's largest token count (``tokens``: this rank's)."""
        cfg = self.config
        key = self._buffer_key(device, dim, dtype)
        bufs, cap = _BUFFERS.get(key), _CAPACITY.get(key)
        if bufs is not None and (cfg.max_tokens_per_rank or 0) <= bufs.max_tokens:
            return bufs
        facts = {"dim": dim, "dtype": str(dtype), "max_tokens_per_rank": cfg.max_tokens_per_rank,
                 "held_tokens": None if cap is None else cap.max_tokens, "rows": None if cap is None else cap.rows}
        gathered = checks.agree(self.group, "symm buffers", facts, local={"tokens": tokens})
        max_tokens = max(cfg.max_tokens_per_rank or max(g["tokens"] for g in gathered), cap.max_tokens if cap else 0)
        if cap is None or max_tokens > cap.max_tokens:
            cap = _CAPACITY[key] = self._capacity(max_tokens, cap)
        return self._allocate(key, bufs, cap.worst, cap.max_tokens)

    def _allocate(self, key: tuple, earlier: _SymmBuffers | None, map_rows: int, max_tokens: int) -> _SymmBuffers:
        """Staging buffers for ``max_tokens`` tokens per rank whose capacity-sized areas hold
        ``map_rows`` expert-major rows (the worst case), a collective of the group; the count
        buffer of ``earlier``, where there is one, carries over. Allocated outside inference
        mode: a buffer made during an evaluation under ``torch.inference_mode`` serves the
        training steps after it."""
        cfg = self.config
        _, device, dim, dtype = key[:4]
        rows = self._staging_rows(max_tokens, map_rows, dim, dtype)
        map_offset = token_map_offset(rows, dim, dtype)
        # The rows' bytes also hold the score gradients combine's backward returns
        # (``_return_row_dots``): fp32, one per expert-major row of every rank.
        assert not cfg.combine_fwd_partial_sums or map_offset >= self.ep * map_rows * 4
        nbytes = staging_buffer_nbytes(rows, dim, dtype, map_rows)
        with torch.inference_mode(False):
            bufs = _SymmBuffers(
                key=key,
                # Per rank: its counts per expert, its token count and its fault word
                # (``checks.Fault``), checked by every rank.
                counts=(earlier.counts if earlier
                        else PeerBuffer(self.ep * (cfg.num_experts + 2) * 8, self.group, device)),
                staging=(PeerBuffer(nbytes, self.group, device), PeerBuffer(nbytes, self.group, device)),
                staging_rows=rows,
                max_tokens=max_tokens,
                map_rows=map_rows,
                map_offset=map_offset,
            )
        _BUFFERS[key] = bufs
        return bufs

    def _staging_rows(self, max_tokens: int, map_rows: int, dim: int, dtype: torch.dtype) -> int:
        """Rows a staging buffer holds (``capacity.staging_rows`` at ``map_rows``, the worst
        case: ``capacity.symm_staging_rows``): ``EP x max_tokens`` with top-k > 1 (plus each
        token's K rows when combine's forward goes row by row), the worst case with top-1."""
        cfg = self.config
        return staging_rows(self.ep, max_tokens, cfg.top_k, map_rows, cfg.combine_fwd_partial_sums,
                            staging_nbytes(1, dim, dtype))

    def _routing(self, x_TD, checked, fault):  # noqa: ARG002, N803
        W, E, device = self.ep, self.config.num_experts, checked.counts.device
        dim, dtype = self._shape  # the tokens' shape the group agreed on (a faulty rank's x may have none)
        tokens = checked.expert_ids.numel() // self.config.top_k
        bufs = self._buffers(device, dim, dtype, tokens)
        cap = _CAPACITY[bufs.key]
        if fault is None and tokens > bufs.max_tokens:
            error = ValueError(f"symm dispatch: a rank got more tokens than the buffers hold ({bufs.max_tokens} per "
                               f"rank); raise TokenDispatcher.Config.max_tokens_per_rank (rank {self.rank} got "
                               f"{tokens})")
            fault = checks.HostFault(checks.Fault.TOKENS, error)
            checked = checks.host_fault_routing(E, fault.fault, device)
        # Every rank's counts, token count and fault word into every rank's count table: a
        # rank whose input failed a check fails every rank after this exchange instead of
        # leaving its peers waiting in the next barrier. It raises its own error here; they
        # fail the check of the exchanged table (on CUDA a device-side assert, no host sync,
        # unless debug mode reads the table to name the rank and the check).
        kernels = self.kernels(device)
        kernels.push_counts(checked.counts, 0 if fault else tokens, bufs.counts, self.rank, checked.fault)
        bufs.counts.barrier()
        if fault is not None:
            raise fault.error
        table = bufs.counts.local[: W * (E + 2) * 8].view(torch.int64).view(W, E + 2)
        # Read before the next dispatch rewrites the count buffer: a peer pushes its next counts
        # only after this leg's staging barrier, which this rank reaches after these reads.
        # Inside a replay scope the tables stop at the elastic capacity; else nothing is cut.
        scopes = dispatch_scopes(self)
        scoped = bool(scopes) and not scopes[-1].exact
        needed = torch.zeros(1, dtype=torch.int64, device=device)
        tables, ok = kernels.routing_tables(table, self.rank, self.config.pad_multiple, bufs.max_tokens,
                                            cap.rows if scoped else None, needed)
        checks.assert_no_faults(table[:, E + 1], self.debug, E, ok=ok, where="symm dispatch")
        if scoped:  # counted on the device, checked at the step boundary
            capacity = cap.rows
            for scope in scopes:
                scope.record(bufs.key, needed, capacity)
        elif cap.rows >= cap.worst:  # nothing can overflow: no read
            capacity = cap.worst
        else:
            capacity = self._exact_rows(cap, needed, scopes)
        rows = ExpertRowRouting(capacity, *kernels.expert_row_routing(tables, self.rank, W, capacity), buffers=bufs,
                                scopes=tuple(scopes), own_rows=tables.seg_end[-1:])
        return tables, rows

    def _exact_rows(self, cap: ElasticCapacity, needed: torch.Tensor, scopes: list[ReplayScope]) -> int:
        """The rows of a dispatch outside a replay scope, or in an ``exact`` one (a spill's
        rerun; ``scopes``: those it counts in): exactly those its routing needs (``needed``, the
        same on every rank of the group; already a multiple of the alignment), read on the
        host: the one host read of such a dispatch. A recompute of the same routing gets the
        same rows."""
        if not scopes:
            announce_unguarded()
        rows = min(cap.worst, int(needed[0]))
        if rows > cap.ceiling:
            _log.info("symm dispatch: %d rows needed, more than the capacity's ceiling (%d): this dispatch runs at "
                      "exactly those rows", rows, cap.ceiling)
        return rows

    def _push_to_experts(self, push, src, meta, leg, fmt, weight, dot_with, dot_out, dot_with_expert_rows=False):
        """With top-k > 1 each token goes once per rank that owns one of its experts
        (``push_tokens``), not once per expert: at top-8 on 2 ranks, a quarter of the rows.
        The owner copies it into each of its expert rows in the receiving pass, through the
        token map the push wrote; on a weighted leg it multiplies each row by the router score
        the push left beside the map (on an MXFP8 leg: after dequantizing,
        ``Config.scores_after_dequantize``). The score gradients' dot products are taken
        in the same pass, on the token's rank (``dot_with``), or, after combine's partial sums,
        for the rows that stay only (``dot_with_expert_rows``). Dispatch's forward carries the router
        scores along for combine's partial sums (``Config.combine_fwd_partial_sums``): the owner
        keeps each row's score in ``meta.row_score``. Top-1 pushes row by row."""
        bufs = self._buffers_for(meta)
        send = bufs.take_staging()
        staged = self._staged(send, bufs.staging_rows, fmt, tokens_per_rank=bufs.max_tokens,
                              map_offset=bufs.map_offset, map_rows=bufs.map_rows)
        out = src.new_empty((meta.capacity, src.shape[1]))
        row_bytes = wire_stats.row_bytes(src.shape[1], src.element_size(), fmt)
        stage_row = row_weight = None
        carried = None  # the router scores dispatch's forward takes along, unapplied
        if leg == "dispatch_fwd" and self.config.combine_fwd_partial_sums:
            carried = meta.topk_scores_TK.detach().reshape(-1)
        if self.config.top_k > 1:
            sent = torch.zeros(1, dtype=torch.int64, device=src.device)
            self.kernels(src.device).push_tokens(
                staged, src, sorted_row=meta.sorted_row, dst_rank=meta.dst_rank, dst_row=meta.dst_row, local_out=out,
                top_k=self.config.top_k, sent=sent, weight=weight if weight is not None else carried,
                weigh_local=weight is not None, dot_with=dot_with, dot_out=dot_out,
                dot_with_expert_rows=dot_with_expert_rows,
            )
            wire_stats.record_rows(leg, sent[0], row_bytes)
            stage_row = staged.token_map(send.local)[: meta.capacity]
            if weight is not None:
                row_weight = staged.row_weights(send.local)[: meta.capacity]
        else:
            wire_stats.record_rows(leg, to_peer(meta.dst_rank, self.rank).sum(), row_bytes)
            push(out, staged, "all")  # one pass: local HBM copies beside NVLink stores
        send.barrier()  # the peers' pushes (rows, token maps, row weights) into this rank's staging buffer are visible
        if stage_row is not None and leg == "dispatch_fwd" and self.config.dispatch_bwd_partial_sums:
            # Which token each row came from, for the partial sums of dispatch's backward: a
            # copy, since the staging buffer (and its map) serves the next legs.
            remote = (meta.row_source >= 0) & (meta.row_source != self.rank)
            meta.row_slot = torch.where(remote, stage_row, self.ep * bufs.max_tokens)
            meta.slot_tokens = bufs.max_tokens
            if carried is not None:
                carried_scores = staged.row_weights(send.local)[: meta.capacity]
                meta.row_score = self._row_scores(carried, meta, remote, carried_scores)
        return out, staged, stage_row, row_weight

    def _row_scores(self, scores, meta, remote, carried):
        """Per expert-major row, the router score of its slot (fp32): carried by the push for a
        row a peer sent, this rank's own score for a row that stayed, 0 elsewhere. Device ops."""
        capacity = meta.capacity
        stays = torch.where(meta.dst_rank == self.rank, meta.dst_row, capacity)  # capacity: no row here
        own = torch.zeros(capacity + 1, dtype=torch.float32, device=scores.device)
        own.scatter_(0, stays, scores[meta.slot].float())
        return torch.where(remote, carried, own[:capacity])

    def to_experts(self, src, meta, leg, weight=None, dot_with=None, dot_out=None, dot_with_expert_rows=False):
        """Combine's backward after its partial sums (``dot_with_expert_rows``: ``dot_with`` holds
        the expert outputs, which stayed on their rank): the score gradient of a row that stays is taken in the push;
        of a row that a peer's token sent, by the receiving pass, against the output gradient
        as it arrived (MXFP8: dequantized, before its score multiplies it), and then returned
        to the token's rank (``_return_row_dots``)."""
        if not dot_with_expert_rows:
            return super().to_experts(src, meta, leg, weight, dot_with, dot_out)
        kernels, fmt = self.kernels(src.device), getattr(self.config.a2a, leg)
        if self._observing(leg):
            self._observe(leg, *self._wire_rows_to_experts(src, meta, weight))
        out, received, stage_row, row_weight = self._push_to_experts(
            None, src, meta, leg, fmt, weight, dot_with, dot_out, dot_with_expert_rows=True,
        )
        row_dots = torch.zeros(meta.capacity, dtype=torch.float32, device=src.device)
        kernels.receive_rows(received, out, source=meta.row_source, stage_row=stage_row, weight=row_weight,
                             dot_with=dot_with, dot_out=row_dots)
        self._return_row_dots(row_dots, meta, dot_out)
        return out

    def _return_row_dots(self, row_dots, meta, dot_out):
        """Each rank's score gradients of its expert-major rows into every peer's next staging
        buffer (rank ``r``'s at ``[r * capacity, (r + 1) * capacity)``, fp32); after the barrier
        each slot whose row a peer holds takes its entry there (the slot's ``dst_rank`` /
        ``dst_row``). A leg of its own (a staging buffer and a barrier): the token's rank needs
        its score gradients before combine's backward returns."""
        bufs = self._buffers_for(meta)
        send = bufs.take_staging()
        W, capacity = self.ep, meta.capacity
        for peer in range(W):
            if peer != self.rank:
                send.peer(peer)[: W * capacity * 4].view(torch.float32)[
                    self.rank * capacity : (self.rank + 1) * capacity].copy_(row_dots)
        wire_stats.record("combine_bwd", (W - 1) * capacity * 4)
        send.barrier()  # the peers' score gradients are in this rank's staging buffer
        returned = send.local[: W * capacity * 4].view(torch.float32)
        n = meta.sorted_row[: dot_out.numel()]
        owner = meta.dst_rank[n]
        theirs = returned[owner.clamp(min=0) * capacity + meta.dst_row[n]]
        dot_out.copy_(torch.where(to_peer(owner, self.rank), theirs, dot_out))

    def _push_to_tokens(self, src, meta, leg, fmt):
        """A token-bound leg whose rows' tokens this rank knows (``meta.row_slot``: dispatch's
        forward sent tokens once) goes back as one partial sum per token and rank
        (``push_partials``), not row by row: at top-8 on 2 ranks a quarter of the rows. The
        token's rank adds it once, at the token's first slot on that rank. Those legs, when
        the scores follow the experts (DeepSeek-V3): dispatch's backward, a plain sum
        (``Config.dispatch_bwd_partial_sums``), and combine's forward, each row times its score
        (``meta.row_score``; the token's rank weights only the rows that stayed;
        ``Config.combine_fwd_partial_sums``). On an MXFP8 leg the partial sum is quantized,
        not each row."""
        if not self._sends_partials(meta, leg):
            return super()._push_to_tokens(src, meta, leg, fmt)
        weighted = leg == "combine_fwd"
        bufs = self._buffers_for(meta)
        staged = self._staged(bufs.take_staging(), bufs.staging_rows, fmt, tokens_per_rank=meta.slot_tokens)
        order, start = self._partial_order(meta)
        sent = torch.zeros(1, dtype=torch.int64, device=src.device)
        self.kernels(src.device).push_partials(
            staged, src, order=order, start=start, sent=sent,
            max_rows=self.config.top_k,  # a token lists an expert up to top_k times
            weight=meta.row_score if weighted else None,
        )
        wire_stats.record_rows(leg, sent[0], wire_stats.row_bytes(src.shape[1], src.element_size(), fmt))
        stage_row = partial_stage_rows(meta.sorted_row, meta.dst_rank, self.rank, self.config.top_k, meta.slot_tokens)
        staged.staging.barrier()  # the peers' partial sums into this rank's staging buffer are visible
        return staged, stage_row, weighted

    @staticmethod
    def _sends_partials(meta, leg) -> bool:
        """Whether token-bound ``leg`` goes as partial sums (``_push_to_tokens``)."""
        return meta.row_slot is not None and (leg != "combine_fwd" or meta.row_score is not None)

    def _partial_order(self, meta):
        """``partial_slots`` of the dispatch's rows: grouped once, for both token-bound legs."""
        if meta.partial_order is None:
            meta.partial_order = partial_slots(meta.row_slot, self.ep * meta.slot_tokens)
        return meta.partial_order

    def _wire_rows_to_experts(self, src, meta, weight):
        """With top-k > 1 (``push_tokens``) each token a peer needs goes once, unweighted: the
        owner multiplies each row by its score after decoding it. Top-1: row by row."""
        if self.config.top_k == 1:
            return super()._wire_rows_to_experts(src, meta, weight)
        n = meta.sorted_row[: src.shape[0] * self.config.top_k].view(src.shape[0], self.config.top_k)
        return src, self._crossing(to_peer(meta.dst_rank[n], self.rank).any(dim=1))

    def _wire_rows_to_tokens(self, src, meta, leg):
        """After partial sums (``_sends_partials``) the leg sends one per token of another rank
        and this rank (``symm_reference.partial_sums``; combine's forward weighted by the router
        scores); taken over the other ranks' token slots (this rank's own never go). With
        ``quantize_local_rows`` also the rows that stay, which take the round trip unweighted."""
        if not self._sends_partials(meta, leg):
            return super()._wire_rows_to_tokens(src, meta, leg)
        order, start = self._partial_order(meta)
        values, sent = partial_sums(src, order, start, self.rank, self.config.top_k, meta.slot_tokens,
                                    weight=meta.row_score if leg == "combine_fwd" else None)
        own = slice(self.rank * meta.slot_tokens, (self.rank + 1) * meta.slot_tokens)
        others = [torch.cat([t[: own.start], t[own.stop :]]) for t in (values, sent)]
        out = [(others[0], others[1])]
        if self.config.a2a.quantize_local_rows:
            out.append((src, meta.row_source == self.rank))
        return out

    def _send_buffer(self, src, meta, leg, fmt):
        wire_stats.record_rows(leg, (meta.return_rank >= 0).sum(),
                               wire_stats.row_bytes(src.shape[1], src.element_size(), fmt))
        bufs = self._buffers_for(meta)
        return self._staged(bufs.take_staging(), bufs.staging_rows, fmt)

    def _exchange(self, sent, src, meta):  # noqa: ARG002 (the peers pushed already)
        sent.staging.barrier()  # the peers' pushes into this rank's staging buffer are visible
        return sent, None

    @staticmethod
    def _buffers_for(meta) -> _SymmBuffers:
        """The buffer set the dispatch of ``meta`` took: every leg of it uses that one."""
        return meta.expert_rows.buffers

