"""The symm transport's activation pool: what a MoE layer keeps for its backward at expert-major
rows, kept at the rows its routing filled, in one pool shared by every MoE layer of a step.

The symm dispatcher hands the experts a tensor of a fixed capacity whose valid rows are a
prefix (each local expert's rows padded, from row 0; their count is on the device). Autograd
keeps the experts' input, ``h1``, ``h3`` and their SwiGLU product (``expert_kernels``), and
combine's expert outputs when it goes by partial sums, at that capacity. Inside a replay scope
(``dispatcher.symm.replay_scope``) a layer run through ``pooled_layer`` keeps each of them
(``torch.autograd.graph.saved_tensors_hooks``) as it is until the next MoE layer's forward
begins (``compact_pending``), and only then moves it into the pool: no host sync, the row
count and the pool offset stay on the device, and a fixed-shape masked copy moves only the
rows below the count (views of one tensor, as the two GEMMs' views of the experts' input, are
packed once). The last MoE layer of a forward is thus never copied: its backward, the first
to run, reads its tensors as they are, and the pool holds every layer but that one. The
backward unpacks each pooled tensor into a fresh capacity-row tensor whose rows past the
count are left as they come (every consumer reads the rows inside the expert offsets only:
``torch._grouped_mm``, the SwiGLU kernels, combine's score gradients by the dispatch's row
routing), so only one layer's tensors at a time live at the capacity.

The pool is a ring of rows holding its layers oldest first: a layer's rows start at the
device-side head, the head moves past them, and a layer's rows come free once every saved tensor
of it is released (its backward ran, or its graph was dropped): at the head when it is the newest
(a backward's order), at the tail when it is the oldest (a pipeline schedule's 1F1B, where the
oldest microbatch runs its backward first), a layer between them once its neighbours go. So
microbatches of one step reuse the rows, and a schedule's pool holds the layers it keeps at once
(plus the holes inside that span), whatever its number of microbatches. Its
size (``A2AConfig.activation_pool_factor``): that multiple of one layer's balanced rows, summed
over the pooled MoE layers (``activation_pool_size.pool_rows``): the most layers a step has
held in the pool at once (layers under activation checkpointing keep nothing and
never push; the last pooled layer stays out). A run's first step knows no depth yet and starts
from one layer's rows: past two pooled layers it overflows the pool and runs its forward once
more at the rows it showed it needs (plus headroom), so the pool is never sized for layers that
keep nothing. A layer that would pass the pool's free rows copies nothing past
them (its backward reads wrong rows, never out of bounds) and raises the overflow count of every
replay scope its dispatch counted in;
at the step boundary ``elastic.check_overflow`` reads the scope's peak rows with the capacities'
(``needed_rows``; a layer whose dispatch overflowed its capacity counts the rows its routing
gives this rank uncut), the pool grows to them plus headroom up to its ceiling
(``A2AConfig.activation_pool_ceiling``, ``plan_overflowed``), and the step runs again. A step
that needs more than the ceiling spills: its rerun (an ``exact`` scope) keeps each layer's
tensors at exactly their routed rows, read on the host. Either way the result is bit for bit
what a run without the pool computes.

A layer belongs to the replay scopes its dispatch counted in (``dispatcher.symm.dispatch_scopes``):
its attempt is the innermost. A pending layer of an attempt that ended (an overflowed attempt
whose backward was skipped) never moves in.

Not pooled: a layer whose experts do not read only the rows inside the expert offsets
(``reads_valid_rows_only``: the library's grouped SwiGLU experts do; others may read every row),
a layer outside a replay scope, under ``no_grad``, run inside a backward (a recompute under
reentrant activation checkpointing, whose backward follows at once), or under saved-tensor hooks of
someone else (activation checkpointing: its forward keeps nothing and its recompute's tensors
are the checkpoint's; CPU offloading), which keep their tensors as they are; tensors that are
not 2-D contiguous float rows of the capacity (MXFP8 data and scales stay as they are).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import torch

from mxfp8_ep.pool.activation_pool_size import pool_rows
from mxfp8_ep.exchange.capacity import POOL_GROWTH_HEADROOM, next_capacity
from mxfp8_ep.dispatcher import symm

__all__ = ["NOT_POOLED", "ActivationPool", "combine_keeps_expert_rows", "compact_pending", "needed_rows",
           "plan_overflowed", "pool_rows_held", "pooled_layer", "pools", "reads_valid_rows_only", "release_pools"]

_POOLED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# What a new plane holds before any row is packed into it (tests set NaN: a backward that read a
# row past a layer's count would then show).
_FILL = 0.0
@dataclass
class _Layer:
    """One layer's rows: the replay scopes its dispatch counted in (innermost last: its
    attempt), its count and demand (``ActivationPool.push``), its packed tensors (weak:
    autograd's handles hold them), and once in the pool where its rows start (a device-side
    row of the ring, counted from the attempt's first) and where the demand stood; whether it
    was released."""

    scopes: tuple
    count: torch.Tensor | int
    demand: torch.Tensor | None = None
    packed: list = field(default_factory=list)  # weakrefs to its ``_Packed``, in packing order
    start: torch.Tensor | None = None  # None: not in the pool (pending, or an exact scope's)
    demand_start: torch.Tensor | None = None
    released: bool = False
    stale: bool = False

    @property
    def attempt(self):
        return self.scopes[-1]


@dataclass
class _Packed:
    """One tensor of a layer, packed: as it is (``tensor``, a detached alias: the layer is still
    pending), in a ``plane`` of the pool, or as ``rows`` (an exact scope's host-sized copy); its
    shape, and the unpacked tensor while someone still unpacks it."""

    layer: _Layer
    shape: torch.Size
    dtype: torch.dtype
    tensor: torch.Tensor | None = None
    plane: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    unpacked: torch.Tensor | None = None  # a copy at the capacity (``_keep_unpacked``)
    read: bool = False  # a backward read ``tensor`` as it is


@dataclass
class _LayerHandle:
    """What a layer's saved tensors hold: its ``_Layer`` (released when the last handle goes)."""

    layer: _Layer
    capacity: int
    packed: dict = field(default_factory=dict)  # the block's packed tensors, by storage and view


class ActivationPool:
    """One pool per (device, shape of the routing): planes of rows, one per saved tensor of a
    layer (its position in the layer's order, width and dtype), each ``rows + 1`` rows (the last
    takes the masked rows of a copy). Rows are counted from the attempt's first (device-side
    ``head`` and ``tail``), a row ``v`` stored at ``v % rows``: the live rows are
    ``[tail, head)``."""

    def __init__(self, device: torch.device, factor: float, ceiling: float | None, geometry: tuple,
                 key: tuple = ()):
        self.device = device
        self.factor, self.ceiling_factor = factor, ceiling
        self.geometry = geometry  # (max_tokens, top_k, ep, num_local_experts, align)
        self.need_key = ("activation_pool", *key)  # its peak rows in a replay scope (``ReplayScope.need``)
        self.grown = 0  # rows the pool grew to (``plan_overflowed``)
        self.depth_seen = 0  # the most layers in the pool at once so far
        self.rows = 0  # rows of the planes
        self.planes: dict[tuple, torch.Tensor] = {}
        zero = functools.partial(torch.zeros, 1, dtype=torch.int64, device=device)
        self.head, self.tail = zero(), zero()
        self.demand_head, self.demand_tail = zero(), zero()  # the same, counting each layer's demand
        self.live: list[_Layer] = []  # the layers in the pool, oldest first (released ones until their neighbours go)
        self.pending: _Layer | None = None  # the layer packed last, not yet moved in (``compact``)
        self.scope: object | None = None  # the attempt its layers belong to

    @property
    def layers(self) -> int:
        """The layers the pool is sized for: the most a step has held in it at once (layers
        under activation checkpointing keep nothing and never push, and the last pooled layer
        stays out); one before the first step (module docstring)."""
        return max(self.depth_seen, 1)

    def budget(self) -> tuple[int, int, int]:
        """(rows, ceiling, worst) for the layers known now."""
        worst = pool_rows(*self.geometry, self.layers, None)
        ceiling = max(pool_rows(*self.geometry, self.layers, self.ceiling_factor),
                      pool_rows(*self.geometry, self.layers, self.factor))
        return min(worst, max(pool_rows(*self.geometry, self.layers, self.factor), self.grown)), ceiling, worst

    def begin_attempt(self, scope) -> None:
        """A new attempt (a layer's innermost replay scope): the rows start over, and rows still
        held by an earlier attempt's graph are given up (its backward then raises)."""
        self.scope = scope
        for t in (self.head, self.tail, self.demand_head, self.demand_tail):
            t.zero_()
        for layer in self.live:
            layer.stale = True
        self.live.clear()
        self.pending = None  # an earlier attempt's layer keeps its tensors as they are
        rows = self.budget()[0]
        if rows != self.rows:
            self.rows, self.planes = rows, {}

    def hold(self, layer: _Layer) -> None:
        """``layer`` is the one packed last: the one before it moves into the pool."""
        self.compact()
        self.pending = layer

    def compact(self) -> None:
        """The pending layer (``hold``), unless its tensors are gone or being read or its
        attempt ended, into the pool: the next layer's forward has begun, so its backward is
        not the next to run."""
        layer, self.pending = self.pending, None
        if layer is None or layer.released or layer.stale or not layer.attempt.open:
            return
        packed = [p for p in (ref() for ref in layer.packed) if p is not None]
        if not packed or any(p.tensor is None or p.read for p in packed):
            return
        limit = self.push(layer)
        for slot, p in enumerate(packed):
            p.plane = self.plane(slot, p.shape[1], p.dtype)
            _copy_in(p.plane, p.tensor, layer.start, layer.count, limit, self.rows)
            p.tensor = None

    def push(self, layer: _Layer) -> torch.Tensor:
        """``layer``'s ``count`` rows ((1,) int64, device) at the head; where they pass the
        free rows (``tail + rows``) it raises the overflow count of each scope the layer's
        dispatch counted in. Its ``demand``: the rows it would hold had its dispatch not
        overflowed its capacity (at least ``count``); the peak of the demand between tail and
        head is what each of those scopes needs of the pool (``ReplayScope.need``). Returns the
        row its copy stops before. Device ops only."""
        layer.start, layer.demand_start = self.head.clone(), self.demand_head.clone()
        limit = self.tail + self.rows
        end = self.head + layer.count
        self.head.copy_(end)
        self.demand_head.add_(layer.demand)
        over, span = end > limit, self.demand_head - self.demand_tail
        for scope in layer.scopes:
            scope.count_overflow(over)
            scope.need(self.need_key, span)
        self.live.append(layer)
        self.depth_seen = max(self.depth_seen, len(self.live))
        return limit

    def release(self, layer: _Layer) -> None:
        """Every saved tensor of ``layer`` is gone: its rows come free once no live layer is on
        either side of them (the head moves back over released newest layers, the tail forward
        over released oldest ones); a layer never moved in changes nothing."""
        layer.released = True
        if self.pending is layer:
            self.pending = None
        if layer.stale or layer.start is None:
            return
        while self.live and self.live[-1].released:
            newest = self.live.pop()
            self.head.copy_(newest.start)
            self.demand_head.copy_(newest.demand_start)
        while self.live and self.live[0].released:
            self.live.pop(0)
        oldest = self.live[0] if self.live else None
        self.tail.copy_(oldest.start if oldest else self.head)
        self.demand_tail.copy_(oldest.demand_start if oldest else self.demand_head)

    def plane(self, slot: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        key = (slot, width, dtype)
        if key not in self.planes:
            self.planes[key] = torch.full((self.rows + 1, width), _FILL, dtype=dtype, device=self.device)
        return self.planes[key]

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes.values())


_POOLS: dict[tuple, ActivationPool] = {}


def pools() -> list[ActivationPool]:
    return list(_POOLS.values())


def pool_rows_held() -> int | None:
    """The largest pool's rows (its planes'), or None without a pool."""
    return max((p.rows for p in _POOLS.values()), default=None)


def release_pools() -> None:
    """Drop every pool (the next pooled layer makes one again)."""
    _POOLS.clear()


def compact_pending() -> None:
    """A MoE layer's forward begins: the layer each pool holds pending moves into it
    (``ActivationPool.compact``), before this layer's tensors take their room. Not in a
    backward: a recompute's forward (activation checkpointing) is not the next layer's."""
    if symm.in_backward():
        return
    for pool in _POOLS.values():
        if pool.pending is not None:
            pool.compact()


def _pool_for(dispatcher, bufs, device: torch.device) -> ActivationPool:
    a2a = dispatcher.config.a2a
    geometry = (bufs.max_tokens, dispatcher.config.top_k, dispatcher.ep, dispatcher.num_local_experts,
                dispatcher.config.pad_multiple)
    key = (device, a2a.activation_pool_factor, a2a.activation_pool_ceiling, *geometry[1:])
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = ActivationPool(device, a2a.activation_pool_factor, a2a.activation_pool_ceiling,
                                            geometry, key)
    elif bufs.max_tokens > pool.geometry[0]:
        pool.geometry = geometry
    return pool


def _others_hooks() -> bool:
    """Whether saved-tensor hooks of someone else are active (activation checkpointing)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class _LayerPack:
    """The saved-tensor hooks of one pooled layer (``pooled_layer``)."""

    def __init__(self, pool: ActivationPool | None, layer: _Layer | None, capacity: int):
        self.pool = pool
        self.handle = _LayerHandle(layer, capacity) if layer is not None else None
        if pool is not None:
            weakref.finalize(self.handle, pool.release, layer)
            pool.hold(layer)

    @contextlib.contextmanager
    def saving(self, when: bool = True):
        """Inside, the layer's saved expert-major tensors go to the pool (``when`` false, or an
        unpooled layer: they stay as they are)."""
        if not when or self.handle is None or _others_hooks():
            yield
            return
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            # Views of one tensor are packed once within a block; past it the packed tensors
            # are held by their saved-tensor handles alone, so each unpacked copy lives until
            # the last node that saved it has run its backward or another layer unpacks
            # (``_keep_unpacked``).
            self.handle.packed = {}

    def _pack(self, t: torch.Tensor):
        handle = self.handle
        if not (t.dim() == 2 and t.shape[0] == handle.capacity and t.dtype in _POOLED_DTYPES and t.is_contiguous()
                and t.device.type != "meta"):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        packed = handle.packed.get(key)
        if packed is None:
            packed = handle.packed[key] = _Packed(handle.layer, t.shape, t.dtype)
            if self.pool is None:  # an exact scope: the routed rows, counted on the host
                packed.rows = t[: handle.layer.count].clone()
            else:  # kept as it is until the next layer's forward (``ActivationPool.compact``)
                packed.tensor = t.detach()
                handle.layer.packed.append(weakref.ref(packed))
        return handle, packed


def _unpack(saved):
    if isinstance(saved, torch.Tensor):
        return saved
    handle, packed = saved
    if packed.tensor is not None:  # still as it is: its layer stays out of the pool from now on (``compact``)
        packed.read = True
        return packed.tensor
    if packed.layer.stale:
        raise RuntimeError("activation pool: this graph's saved rows were given up when a later replay attempt "
                           "began (mxfp8_ep.pool.activation_pool); run each backward inside the attempt of its forward")
    if packed.unpacked is None:
        if packed.plane is None:
            out = packed.rows.new_empty(packed.shape)
            out[: packed.rows.shape[0]].copy_(packed.rows)
        else:
            out = _copy_out(packed.plane, handle.layer.start, handle.capacity)
        _keep_unpacked(packed, out)
    return packed.unpacked


class _Unpacked:
    """The capacity-row copies a backward unpacked, kept for the other nodes that saved the same
    tensor (a tensor and its views unpack once), for one layer at a time: a layer's first
    unpack drops the copies the layer before kept, so a graph kept for another backward
    (``retain_graph``) holds one layer's copies, not every layer's."""

    layer: _Layer | None = None
    packed: list = []  # weakrefs to the ``_Packed`` holding a copy of ``layer``


def _keep_unpacked(packed: _Packed, out: torch.Tensor) -> None:
    if _Unpacked.layer is not packed.layer:
        for ref in _Unpacked.packed:
            earlier = ref()
            if earlier is not None:
                earlier.unpacked = None
        _Unpacked.layer, _Unpacked.packed = packed.layer, []
    packed.unpacked = out
    _Unpacked.packed.append(weakref.ref(packed))


def _copy_in(plane: torch.Tensor, t: torch.Tensor, start: torch.Tensor, count: torch.Tensor, limit: torch.Tensor,
             rows: int) -> None:
    """Rows ``[0, count)`` of ``t`` into ``plane`` from ring row ``start`` (device tensors), none
    from ``limit`` on (the masked ones land in the spare last row, ``rows``). Fixed shapes: no
    host sync."""
    i = torch.arange(t.shape[0], device=t.device)
    v = start + i
    dst = torch.where((i < count) & (v < limit), torch.remainder(v, max(rows, 1)), rows)
    plane.index_copy_(0, dst, t)


def _copy_out(plane: torch.Tensor, start: torch.Tensor, capacity: int) -> torch.Tensor:
    """A fresh ``(capacity, width)`` tensor whose rows below the layer's count are its rows in
    ``plane`` from ring row ``start`` (the rest: whatever the plane holds there)."""
    i = torch.arange(capacity, device=plane.device)
    return plane.index_select(0, torch.remainder(start + i, max(plane.shape[0] - 1, 1)))


NOT_POOLED = _LayerPack(None, None, 0)  # hooks that do nothing: a layer that is not pooled


def reads_valid_rows_only(experts) -> bool:
    """Whether ``experts`` (a MoE layer's experts module) reads only the rows inside the expert
    offsets of its input, forward and backward (``reads_valid_rows_only``: the library's grouped
    SwiGLU experts say so): the premise under which its saved rows past the count may hold
    anything. Experts that touch every row are not pooled."""
    return bool(getattr(experts, "reads_valid_rows_only", False))


def pooled_layer(dispatcher, metadata, tokens_per_local_expert: torch.Tensor, experts) -> _LayerPack:
    """The activation pool of one MoE layer after its ``dispatch``: run its ``experts``, and
    its ``combine`` when that keeps expert rows (``combine_keeps_expert_rows``), inside
    ``saving()``. A layer that is not pooled (module docstring; experts that do not
    ``reads_valid_rows_only``) gets hooks that do nothing."""
    a2a = dispatcher.config.a2a
    rows = getattr(metadata, "pending_expert_rows", None)
    bufs, scopes = getattr(rows, "buffers", None), getattr(rows, "scopes", ())
    if (a2a.activation_pool_factor is None or bufs is None or not scopes or not torch.is_grad_enabled()
            or symm.in_backward() or _others_hooks() or not reads_valid_rows_only(experts)):
        return NOT_POOLED
    capacity = metadata.capacity
    count = tokens_per_local_expert.sum(dtype=torch.int64).clamp(max=capacity).reshape(1)
    attempt = scopes[-1]
    if attempt.exact:  # a spill's rerun: reads its rows on the host, as its dispatches do
        return _LayerPack(None, _Layer(scopes=scopes, count=int(count[0])), capacity)
    pool = _pool_for(dispatcher, bufs, count.device)
    if pool.scope is not attempt:
        if pool.scope is not None and pool.scope.open and pool.scope in scopes:
            pool.scope = attempt  # a scope inside the open one its layers belong to: they stay
        else:
            pool.begin_attempt(attempt)
    # A dispatch that overflowed its capacity cut its segments: the layer then holds fewer rows
    # than its routing gives it (``own_rows``), which is what it needs at a capacity that fits.
    return _LayerPack(pool, _Layer(scopes=scopes, count=count, demand=rows.own_rows), capacity)


def combine_keeps_expert_rows(metadata) -> bool:
    """Whether combine keeps the expert-major outputs for its backward (partial sums)."""
    return getattr(metadata, "row_score", None) is not None


def needed_rows(scope) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each pool's peak rows in replay scope ``scope`` and its ceiling, as two int64 tensors on
    the first pool's device (no host sync), or None without a pool."""
    if not _POOLS:
        return None
    pool_list = list(_POOLS.values())
    device = pool_list[0].device
    needed = torch.cat([scope.needed(p.need_key, device) for p in pool_list])
    ceilings = torch.tensor([p.budget()[1] for p in pool_list], dtype=torch.int64, device=device)
    return needed, ceilings


@dataclass
class PoolPlan:
    grown: list[tuple[int, int]] = field(default_factory=list)
    spilled: list[tuple[int, int]] = field(default_factory=list)


def plan_overflowed(needed: list[int]) -> PoolPlan:
    """At a step boundary where the step runs again (``needed``: ``needed_rows``' values read
    on the host): each pool that needed more than its rows grows (``capacity.next_capacity``,
    up to its ceiling; the next attempt's planes take the new size); past the ceiling the step
    spills."""
    plan = PoolPlan()
    for pool, rows in zip(list(_POOLS.values()), needed, strict=True):
        held = pool.rows  # what the attempt ran with
        if rows <= held:
            continue
        current, ceiling, worst = pool.budget()  # at the depth known now
        step = next_capacity(rows, current, ceiling, worst, pool.geometry[4], POOL_GROWTH_HEADROOM)
        if step.capacity != held:
            plan.grown.append((held, step.capacity))
        if step.kind == "spill":
            plan.spilled.append((ceiling, rows))
        pool.grown = step.capacity
    return plan
