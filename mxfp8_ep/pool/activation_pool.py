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

The pool is a stack: a layer's rows start at the device-side top, the top moves past them, and
it moves back once every saved tensor of the layer is released (its backward ran, or its graph
was dropped) and every layer above it is too; microbatches of one step reuse the rows. Its
size (``A2AConfig.activation_pool_factor``): that multiple of one layer's balanced rows, summed
over the pooled MoE layers (``activation_pool_size.pool_rows``): the deepest stack of layers
moved into the pool a step has shown (layers under activation checkpointing keep nothing and
never push; the last pooled layer stays out). A run's first step knows no depth yet and starts
from one layer's rows: past two pooled layers it overflows the pool and runs its forward once
more at the rows it showed it needs (plus headroom), so the pool is never sized for layers that
keep nothing. A layer that would pass the pool's end copies nothing past
it (its backward reads wrong rows, never out of bounds) and raises the scope's overflow count;
at the step boundary ``elastic.check_overflow`` reads the peak rows with the capacities'
(``needed_rows``), the pool grows to them plus headroom up to its ceiling
(``A2AConfig.activation_pool_ceiling``, ``plan_overflowed``), and the step runs again. A step
that needs more than the ceiling spills: its rerun (an ``exact`` scope) keeps each layer's
tensors at exactly their routed rows, read on the host. Either way the result is bit for bit
what a run without the pool computes.

Not pooled: a layer whose experts do not read only the rows inside the expert offsets
(``reads_valid_rows_only``: the library's grouped SwiGLU experts do; others may read every row),
a layer outside a replay scope, under ``no_grad``, or under saved-tensor hooks of
someone else (activation checkpointing: its forward keeps nothing and its recompute's tensors
are the checkpoint's; CPU offloading), which keep their tensors as they are; tensors that are
not 2-D contiguous float rows of the capacity (MXFP8 data and scales stay as they are).
"""

from __future__ import annotations

import contextlib
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
    """One layer's rows: the scope (attempt) that packed them, its count and demand
    (``ActivationPool.push``), its packed tensors (weak: autograd's handles hold them), and once
    on the stack where its rows start (device) and where the stack's demand stood; whether it
    was released."""

    scope: object
    count: torch.Tensor | int
    demand: torch.Tensor | None = None
    packed: list = field(default_factory=list)  # weakrefs to its ``_Packed``, in packing order
    start: torch.Tensor | None = None  # None: not on the stack (pending, or an exact scope's)
    demand_start: torch.Tensor | None = None
    released: bool = False
    stale: bool = False


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
    unpacked: torch.Tensor | None = None


@dataclass
class _LayerHandle:
    """What a layer's saved tensors hold: its ``_Layer`` (released when the last handle goes)."""

    layer: _Layer
    capacity: int
    packed: dict = field(default_factory=dict)  # the block's packed tensors, by storage and view


class ActivationPool:
    """One pool per (device, shape of the routing): planes of rows, one per saved tensor of a
    layer (its position in the layer's order, width and dtype), each ``rows + 1`` rows (the last
    takes the masked rows of a copy); the stack's top and the attempt's peak rows on the
    device."""

    def __init__(self, device: torch.device, factor: float, ceiling: float | None, geometry: tuple):
        self.device = device
        self.factor, self.ceiling_factor = factor, ceiling
        self.geometry = geometry  # (max_tokens, top_k, ep, num_local_experts, align)
        self.grown = 0  # rows the pool grew to (``plan_overflowed``)
        self.depth_seen = 0  # the deepest stack of layers so far
        self.rows = 0  # rows of the planes
        self.planes: dict[tuple, torch.Tensor] = {}
        self.top = torch.zeros(1, dtype=torch.int64, device=device)
        self.demand = torch.zeros(1, dtype=torch.int64, device=device)
        self.needed = torch.zeros(1, dtype=torch.int64, device=device)
        self.stack: list[_Layer] = []
        self.pending: _Layer | None = None  # the layer packed last, not yet moved in (``compact``)
        self.scope: object | None = None  # the attempt ``needed`` belongs to

    @property
    def layers(self) -> int:
        """The layers the pool is sized for: the deepest stack of layers moved in a step has
        shown (layers under activation checkpointing keep nothing and never push, and the last
        pooled layer stays out); one before the first step (module docstring)."""
        return max(self.depth_seen, 1)

    def budget(self) -> tuple[int, int, int]:
        """(rows, ceiling, worst) for the layers known now."""
        worst = pool_rows(*self.geometry, self.layers, None)
        ceiling = max(pool_rows(*self.geometry, self.layers, self.ceiling_factor),
                      pool_rows(*self.geometry, self.layers, self.factor))
        return min(worst, max(pool_rows(*self.geometry, self.layers, self.factor), self.grown)), ceiling, worst

    def begin_attempt(self, scope) -> None:
        """A new attempt (outermost replay scope): the peak rows start over, and rows still held
        by an earlier attempt's graph are given up (its backward then raises)."""
        self.scope = scope
        self.needed.zero_()
        self.top.zero_()
        self.demand.zero_()
        for layer in self.stack:
            layer.stale = True
        self.stack.clear()
        self.pending = None  # an earlier attempt's layer keeps its tensors as they are
        rows = self.budget()[0]
        if rows != self.rows:
            self.rows, self.planes = rows, {}

    def hold(self, layer: _Layer) -> None:
        """``layer`` is the one packed last: the one before it moves into the pool."""
        self.compact()
        self.pending = layer

    def compact(self) -> None:
        """The pending layer (``hold``), unless its tensors are gone or being read, onto the
        stack and its tensors into the planes: the next layer's forward has begun, so its
        backward is not the next to run."""
        layer, self.pending = self.pending, None
        if layer is None or layer.released or layer.stale:
            return
        packed = [p for p in (ref() for ref in layer.packed) if p is not None]
        if not packed or any(p.tensor is None or p.unpacked is not None for p in packed):
            return
        self.push(layer)
        for slot, p in enumerate(packed):
            p.plane = self.plane(slot, p.shape[1], p.dtype)
            _copy_in(p.plane, p.tensor, layer.start, layer.count, self.rows)
            p.tensor = None

    def push(self, layer: _Layer) -> None:
        """``layer``'s ``count`` rows ((1,) int64, device) onto the stack; raises its scope's
        overflow count where they pass the pool's end. Its ``demand``: the rows it would hold
        had its dispatch not overflowed its capacity (at least ``count``); the peak of their sum
        is the rows the step needs. Device ops only."""
        layer.start, layer.demand_start = self.top.clone(), self.demand.clone()
        end = self.top + layer.count
        layer.scope.count_overflow(end > self.rows)
        self.top.copy_(end)
        self.demand.add_(layer.demand)
        torch.maximum(self.needed, self.demand, out=self.needed)
        self.stack.append(layer)
        self.depth_seen = max(self.depth_seen, len(self.stack))

    def release(self, layer: _Layer) -> None:
        """Every saved tensor of ``layer`` is gone: the top moves back below each released layer
        on top of the stack (a layer never moved in leaves it as it is)."""
        layer.released = True
        if self.pending is layer:
            self.pending = None
        if layer.stale or layer.start is None:
            return
        moved = None
        while self.stack and self.stack[-1].released:
            moved = self.stack.pop()
        if moved is not None:
            self.top.copy_(moved.start)
            self.demand.copy_(moved.demand_start)

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
    (``ActivationPool.compact``), before this layer's tensors take their room."""
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
                                            geometry)
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
            # are held by their saved-tensor handles alone, so each unpacked tensor lives only
            # until the last node that saved it has run its backward.
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
        packed.unpacked = packed.tensor
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
        packed.unpacked = out
    return packed.unpacked


def _copy_in(plane: torch.Tensor, t: torch.Tensor, start: torch.Tensor, count: torch.Tensor, rows: int) -> None:
    """Rows ``[0, count)`` of ``t`` into ``plane`` from row ``start`` (device tensors), none
    past row ``rows`` (the masked ones land in the spare last row). Fixed shapes: no host
    sync."""
    i = torch.arange(t.shape[0], device=t.device)
    dst = start + i
    dst = torch.where((i < count) & (dst < rows), dst, rows)
    plane.index_copy_(0, dst, t)


def _copy_out(plane: torch.Tensor, start: torch.Tensor, capacity: int) -> torch.Tensor:
    """A fresh ``(capacity, width)`` tensor whose rows below the layer's count are its rows in
    ``plane`` (the rest: whatever the plane holds there)."""
    i = torch.arange(capacity, device=plane.device)
    return plane.index_select(0, (start + i).clamp(max=plane.shape[0] - 1))


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
    bufs = getattr(getattr(metadata, "pending_expert_rows", None), "buffers", None)
    if (a2a.activation_pool_factor is None or bufs is None or not torch.is_grad_enabled() or _others_hooks()
            or not symm.innermost_scope() or not reads_valid_rows_only(experts)):
        return NOT_POOLED
    capacity = metadata.capacity
    count = tokens_per_local_expert.sum(dtype=torch.int64).clamp(max=capacity).reshape(1)
    device = count.device
    outermost = symm.outermost_scope()
    if symm.innermost_scope().exact:  # a spill's rerun: reads its rows on the host, as its dispatches do
        return _LayerPack(None, _Layer(scope=outermost, count=int(count[0])), capacity)
    pool = _pool_for(dispatcher, bufs, device)
    if pool.scope is not outermost:
        pool.begin_attempt(outermost)
    # A dispatch that overflowed its capacity cut its segments at the last full ``align`` rows:
    # its own rows are then unknown here, at most the most any dispatch of the group needed
    # (the scope's trustworthy rows of its buffer set), which the pool's growth takes instead.
    align = dispatcher.config.pad_multiple
    cut = count >= capacity // align * align
    demand = torch.where(cut, torch.maximum(outermost.needed(bufs.key, device), count), count)
    return _LayerPack(pool, _Layer(scope=outermost, count=count, demand=demand), capacity)


def combine_keeps_expert_rows(metadata) -> bool:
    """Whether combine keeps the expert-major outputs for its backward (partial sums)."""
    return getattr(metadata, "row_score", None) is not None


def needed_rows() -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each pool's peak rows in the open attempt and its ceiling, as two int64 tensors on the
    first pool's device (no host sync), or None without a pool."""
    if not _POOLS:
        return None
    pool_list = list(_POOLS.values())
    device = pool_list[0].device
    outermost = symm.outermost_scope()
    needed = [p.needed.to(device) if p.scope is outermost else torch.zeros(1, dtype=torch.int64, device=device)
              for p in pool_list]
    ceilings = torch.tensor([p.budget()[1] for p in pool_list], dtype=torch.int64, device=device)
    return torch.cat(needed), ceilings


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
        pool.needed.zero_()
        if rows <= pool.rows:
            continue
        current, ceiling, worst = pool.budget()
        step = next_capacity(rows, current, ceiling, worst, pool.geometry[4], POOL_GROWTH_HEADROOM)
        if step.capacity != current:
            plan.grown.append((current, step.capacity))
        if step.kind == "spill":
            plan.spilled.append((ceiling, rows))
        pool.grown = step.capacity
    return plan
