"""The elastic capacity's step contract: the symm transport stays sync-free and drop-free with
expert-side memory bounded by ``A2AConfig.capacity_factor`` times the balanced case, growing
up to ``A2AConfig.capacity_ceiling``.

A symm dispatch inside a replay scope (``dispatcher.symm.replay_scope``: each attempt of a
``ReplayGuard``, each step of ``ReplayOverflowedSteps``) hands the experts a tensor of a
capacity fixed on the host, so no host sync waits for the token counts. A dispatch whose
routing needs more rows than that stays in bounds, its results are wrong, and it raises its
scope's overflow count on the device. The dispatches after it route from activations the cut
rows made wrong, so growth and the spill decision use only the rows of the dispatches up to
and including the first that overflowed (in forward order).

The check (``check_overflow``) reads every overflow source (``OVERFLOW_SOURCES``: the symm
capacity's) once: one device-to-host copy, plus one all-reduce over the training group so that
every rank decides alike. It runs after the step's forward, before its backward, so an
overflowed attempt costs a forward: the trainer mixin checks after each microbatch's loss (with
gradient accumulation, after each microbatch's forward), and a ``ReplayGuard`` loop calls
``ReplayGuard.forward_done`` between forward and backward. Where dispatches ran after that
check (a recompute under activation checkpointing, a pipeline schedule that computes the loss
itself), the end of the attempt checks again. On an overflow each rank drops the step's
gradients, every capacity that overflowed grows to what the step needed plus headroom, up to
the ceiling (``capacity.next_capacity``; it stays grown), and the step runs again on the same
batch, with the random number generators, the MoE load-balancing counters, the numerics
probe's samples and the trainer's token count as they were before it. A step that needs more
than the ceiling spills: it runs again in an ``exact`` scope, where each dispatch reads its rows
on the host and takes exactly those, a size that lasts that dispatch only, and the capacity
stops at the ceiling. No symmetric memory is allocated for either (the peer buffers hold the
worst case's maps; ``dispatcher.symm``). Either way the rerun computes exactly what the
worst-case capacity (``capacity_factor=None``) computes on that batch.

A deterministic step reruns until its first overflowing dispatch fits: each rerun moves the
first overflow later, or ends the overflows. Only reruns whose first overflow did not move
later count towards ``MAX_REPLAYS`` (``ReplayLimitError``): the routing changed between runs.

A training loop::

    guard = ReplayGuard(model.modules(), group=None)   # None: the default (world) group
    for batch in batches:
        for _ in guard.attempts():          # again only after an overflow
            loss = loss_fn(model(batch))
            if guard.forward_done():        # optional: an overflowed attempt skips its backward
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()

The guard owns the gradients of its attempts: a rerun starts from none, wherever the loop
zeroes them (an attempt holds one whole optimizer step: all its microbatches; with several,
``forward_done`` after each microbatch's forward). An evaluation pass wraps each batch the same
way with ``owns_gradients=False``.

torchtitan's ``Trainer`` (0.2.2 and 0.3.0) gets the same from the mixin
``ReplayOverflowedSteps``: ``class MyTrainer(ReplayOverflowedSteps, Trainer)``.

A dispatch outside any replay scope is never wrong either: it reads the rows it needs on the
host (one sync per dispatch, announced once) and takes exactly those before any row moves, so
a recompute under activation checkpointing sees its forward's size (``dispatcher.symm``).
Replay scopes belong to the thread that opened them and reach its backward: a recompute under
activation checkpointing on autograd's device thread counts in the scopes of the forward it
recomputes (``dispatcher.symm.dispatch_scopes``). Scopes nest: each sees the overflows of the
dispatches and activation-pool pushes inside it, so a guard inside an outer scope replays on
its own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from mxfp8_ep.pool import activation_pool
from mxfp8_ep.telemetry import numerics
from mxfp8_ep.dispatcher import symm
from mxfp8_ep.dispatcher.symm import replay_scope

__all__ = ["LOAD_BALANCE_BUFFERS", "MAX_REPLAYS", "OVERFLOW_SOURCES", "Overflow", "OverflowSource", "ReplayGuard",
           "ReplayLimitError", "ReplayOverflowedSteps", "StepState", "SymmCapacity", "capacity_ceiling_rows",
           "capacity_rows", "check_overflow", "install_replays", "replay_scope"]

_log = logging.getLogger(__name__)

# Module buffers a forward pass adds to and an optimizer step consumes: torchtitan's MoE counts
# the tokens routed to each expert for its load-balancing expert bias (DeepSeek-V3), as
# ``tokens_per_expert`` (0.2.2) or ``tokens_per_expert_E`` (0.3.0).
LOAD_BALANCE_BUFFERS = ("tokens_per_expert", "tokens_per_expert_E")
# Reruns of one step in a row that made no progress (the first overflowing dispatch did not
# move later) before it is an error: a deterministic step makes progress on every rerun.
MAX_REPLAYS = 3


class ReplayLimitError(RuntimeError):
    """A step overflowed on ``MAX_REPLAYS`` reruns in a row that made no progress."""


@dataclass
class Overflow:
    """What one check found."""

    replay: bool  # some rank of the group overflowed: every rank runs the step again
    grown: list[tuple[int, int]] = field(default_factory=list)  # (old, new) capacity of this rank's grown sets
    # (ceiling, rows needed) of this rank's sets that needed more than their ceiling
    spilled: list[tuple[int, int]] = field(default_factory=list)
    # some rank's set needed more than its ceiling: every rank reruns the step in an exact
    # scope, each dispatch at exactly the rows it needs
    spill: bool = False
    # the index (in forward order, over the group) of the step's first dispatch that overflowed
    first: int = 0
    # as ``grown`` and ``spilled``, for this rank's activation pools (``ActivationPoolRows``)
    pool_grown: list[tuple[int, int]] = field(default_factory=list)
    pool_spilled: list[tuple[int, int]] = field(default_factory=list)

    @property
    def pool_only(self) -> bool:
        """Whether only activation pools overflowed, on any rank: no dispatch of the step
        passed its capacity."""
        return self.replay and self.first >= symm.NO_OVERFLOW


# The flags every overflow source gives, all-reduced with MAX over the group: overflowed (0/1),
# needs a spill (0/1), minus the index of the first dispatch that overflowed.
_FLAGS = 3


class OverflowSource:
    """One thing a step can overflow (the symm capacity: ``SymmCapacity``). ``values`` gives,
    on the device and without a host sync, ``_FLAGS`` flags (overflowed, needs a spill, minus
    the first overflowing dispatch's index) then values of its own; after the one read, where
    the step runs again, ``plan`` gets its own values back (as ints) and returns what it
    changed: ``(grown, spilled)`` lists as ``Overflow`` holds them (``pool``: in its
    ``pool_grown`` and ``pool_spilled``)."""

    pool = False

    def __init__(self):
        self._rows = 0  # how many values of its own the last ``values`` gave

    def values(self, scope: symm.ReplayScope | None, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def plan(self, own: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        if not self._rows:
            return [], []
        planned = self._plan(own)
        return planned.grown, planned.spilled

    def _plan(self, own: list[int]):
        """Grow (or spill) from ``own``: an object with ``grown`` and ``spilled``."""
        raise NotImplementedError

    @staticmethod
    def _flags(device: torch.device) -> torch.Tensor:
        """The flags of a step that did not overflow."""
        flags = torch.zeros(_FLAGS, dtype=torch.int64, device=device)
        flags[2] = -symm.NO_OVERFLOW
        return flags

    def _with_rows(self, flags: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """``flags``, then the rows needed of ``rows`` (needed, ceilings; None: none), a spill
        flagged where one needs more than its ceiling."""
        if rows is None:
            self._rows = 0
            return flags
        needed, ceilings = rows
        flags[1] = (needed > ceilings).any()
        self._rows = needed.numel()
        return torch.cat([flags, needed])


class SymmCapacity(OverflowSource):
    """The symm transport's elastic capacity: its flags, then each buffer set's rows needed by
    the scope's trustworthy dispatches (``dispatcher.symm.needed_rows``); ``plan`` grows the
    capacities (``dispatcher.symm.plan_overflowed``)."""

    def values(self, scope, device):
        flags = self._flags(device)
        if scope is None:
            return self._with_rows(flags, None)
        flags[0] = scope.overflows(device).clamp(max=1)[0]
        flags[2] = -scope.first_overflow(device)[0]
        return self._with_rows(flags, symm.needed_rows(scope, device))

    def _plan(self, own):
        return symm.plan_overflowed(own)


class ActivationPoolRows(OverflowSource):
    """The activation pools (``mxfp8_ep.pool.activation_pool``): a pool that overflowed raised its
    scope's overflow count (``SymmCapacity``'s flag), so its own flags say only whether one
    needs more than its ceiling (a spill); then each pool's peak rows in the attempt
    (``activation_pool.needed_rows``); ``plan`` grows them (``activation_pool.plan_overflowed``)."""

    pool = True

    def values(self, scope, device):
        pools = activation_pool.needed_rows(scope) if scope is not None else None
        return self._with_rows(self._flags(device), None if pools is None else tuple(t.to(device) for t in pools))

    def _plan(self, own):
        return activation_pool.plan_overflowed(own)


# What ``check_overflow`` reads, in order: each source's overflow replays the step.
OVERFLOW_SOURCES: list[OverflowSource] = [SymmCapacity(), ActivationPoolRows()]


def check_overflow(group: dist.ProcessGroup | None = None, scope: symm.ReplayScope | None = None) -> Overflow:
    """The check (module docstring): whether any dispatch inside ``scope`` (None: this thread's
    innermost open replay scope), on any rank of ``group`` (None: the default group; every rank
    calls it), overflowed any source (``OVERFLOW_SOURCES``), and whether one needs a spill
    (then every rank reruns the step in an exact scope); this rank's overflowed capacities
    grow. One device-to-host copy and one all-reduce of ``_FLAGS`` integers; a process without
    the default group and without ``group`` checks alone. Outside every scope nothing is
    counted (such dispatches fit themselves): no replay."""
    scope = scope if scope is not None else symm.innermost_scope()
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    flag_device = _flag_device(group)
    device = (scope.device if scope is not None else None) or flag_device
    parts = [source.values(scope, device) for source in OVERFLOW_SOURCES]
    flags = torch.stack([part[:_FLAGS] for part in parts]).amax(dim=0)
    values = torch.cat([flags, *(part[_FLAGS:] for part in parts)]).to(flag_device)
    if group is not None:
        dist.all_reduce(values[:_FLAGS], op=dist.ReduceOp.MAX, group=group)
    values = values.tolist()  # the one device-to-host copy
    if not values[0]:
        return Overflow(replay=False)
    overflow = Overflow(replay=True, spill=bool(values[1]), first=-values[2])
    at = _FLAGS
    for source, part in zip(OVERFLOW_SOURCES, parts, strict=True):
        own = values[at : at + part.numel() - _FLAGS]
        at += part.numel() - _FLAGS
        grown, spilled = source.plan(own)
        (overflow.pool_grown if source.pool else overflow.grown).extend(grown)
        (overflow.pool_spilled if source.pool else overflow.spilled).extend(spilled)
    return overflow


def _flag_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the flags are all-reduced: on the GPU for NCCL, on the CPU for gloo."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Reruns:
    """The reruns of one step: each overflow of a dispatch's capacity that did not move the
    first overflowing dispatch later made no progress (a deterministic step always moves it:
    the dispatch that overflowed fits at the grown or exact size, and the ones before it route
    as they did). An overflow of activation pools alone always does: the pool that overflowed
    grows past what the step needed, or the step spills, where no pool is used. ``MAX_REPLAYS``
    reruns in a row without progress raise ``ReplayLimitError``, saying what was observed."""

    def __init__(self, where: str, limit: int):
        self.where, self.limit = where, limit
        self.stalled = 0
        self.first = -1

    def admit(self, overflow: Overflow) -> None:
        if overflow.first > self.first or overflow.pool_only:
            self.stalled = 0
        elif self.stalled == self.limit:
            raise ReplayLimitError(
                f"{self.where}: a symm dispatch overflowed its expert capacity on {self.limit + 1} runs in a row "
                f"whose first overflowing dispatch did not move later (now dispatch {overflow.first} of the step, "
                f"in forward order; before, {self.first}), although each rerun fitted what the run before it "
                f"needed: the routing differs between runs of the same step (a router that is not deterministic, "
                f"or inputs that change between attempts). Run the step's forward deterministically, or set "
                f"A2AConfig.capacity_factor=None (the worst case, never rerun)")
        else:
            self.stalled += 1
        self.first = overflow.first


def capacity_rows() -> int | None:
    """The largest expert-major capacity (rows) of this process's symm buffer sets, or None."""
    return max(symm.capacities(), default=None)


def capacity_ceiling_rows() -> int | None:
    """The largest ceiling (rows) of this process's symm buffer sets, or None."""
    return max(symm.ceilings(), default=None)


class StepState:
    """What a replayed step must start from: the random number generators (CPU, and the current
    CUDA device's), the module buffers a forward pass adds to (``LOAD_BALANCE_BUFFERS``) and the
    numerics probe's samples (``numerics.PROBE``: a rerun drops the replayed attempt's, and
    keeps those earlier steps left for their log window)."""

    def __init__(self, modules: Iterable[nn.Module], buffer_names: tuple[str, ...] = LOAD_BALANCE_BUFFERS):
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = (torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized()
                          else None)
        self._buffers = [(buf, buf.detach().clone()) for module in modules
                         for name, buf in module.named_buffers(recurse=False) if name in buffer_names]
        self._numerics = numerics.PROBE.mark()

    def restore(self) -> None:
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state(self._cuda_rng)
        with torch.no_grad():
            for buf, saved in self._buffers:
                buf.copy_(saved)
        numerics.PROBE.rollback(self._numerics)


class _Attempt:
    """The checks of one attempt in ``scope``: after a forward (``check``) and at the end
    (``end``: again only where dispatches or activation-pool pushes were recorded since the
    last check, or none ran)."""

    def __init__(self, group: dist.ProcessGroup | None, scope: symm.ReplayScope):
        self.group, self.scope = group, scope
        self.overflow: Overflow | None = None  # what a check found that replays the attempt
        self._checked_at: int | None = None  # the scope's events (dispatches, pool pushes) at the last check

    def check(self) -> Overflow:
        if self.overflow is not None:  # every rank saw it: no need to read again
            return self.overflow
        overflow = check_overflow(self.group, self.scope)
        self._checked_at = self.scope.events
        if overflow.replay:
            self.overflow = overflow
        return overflow

    def end(self) -> Overflow:
        if self.overflow is None and self._checked_at == self.scope.events:
            return Overflow(replay=False)
        return self.check()


class ReplayGuard:
    """Runs each step until no symm dispatch of it overflowed (module docstring). ``modules``:
    every module of the model (``model.modules()``, each model part's for pipeline stages):
    their load-balancing buffers are restored before a rerun and, with ``owns_gradients``, their
    parameters' gradients dropped (an evaluation pass, which computes none, passes False).
    ``group``: the ranks that step together (the default group when None); every rank of it
    runs the same steps (and the same dispatches) through a guard. ``replays`` counts the
    reruns, ``spills`` those of a step that needed more than a ceiling (rerun in an exact
    scope, each dispatch at exactly its rows); ``grown`` and ``spilled`` list what changed of
    the capacities, ``pool_grown`` and ``pool_spilled`` of the activation pools;
    ``on_replay(overflow)``, where given, is called before each rerun. ``max_replays`` reruns
    in a row that made no progress (``_Reruns``) raise ``ReplayLimitError`` at the next."""

    def __init__(self, modules: Iterable[nn.Module], group: dist.ProcessGroup | None = None,
                 buffer_names: tuple[str, ...] = LOAD_BALANCE_BUFFERS, owns_gradients: bool = True,
                 max_replays: int = MAX_REPLAYS, on_replay: Callable[[Overflow], None] | None = None):
        self.modules = list(modules)
        self.group = group
        self.buffer_names = buffer_names
        self.owns_gradients = owns_gradients
        self.max_replays = max_replays
        self.on_replay = on_replay
        self.replays = 0
        self.spills = 0
        self.grown: list[tuple[int, int]] = []
        self.spilled: list[tuple[int, int]] = []
        self.pool_grown: list[tuple[int, int]] = []
        self.pool_spilled: list[tuple[int, int]] = []
        self._attempt: _Attempt | None = None

    def attempts(self) -> Iterator[int]:
        """Yields once per run of the step (the attempt's number, 0 first), inside a replay
        scope: the body runs the forward (and backward) passes of one step; after it the check
        decides whether to run it again (unless ``forward_done`` checked already and no
        dispatch ran since)."""
        state = StepState(self.modules, self.buffer_names)
        reruns = _Reruns("ReplayGuard", self.max_replays)
        attempt, spill = 0, False
        while True:
            with replay_scope(exact=spill) as scope:
                self._attempt = _Attempt(self.group, scope)
                try:
                    yield attempt
                    overflow = self._attempt.end()
                finally:
                    self._attempt = None
            if not overflow.replay:
                return
            reruns.admit(overflow)
            self.replays += 1
            spill = overflow.spill
            self.spills += spill
            self.grown.extend(overflow.grown)
            self.spilled.extend(overflow.spilled)
            self.pool_grown.extend(overflow.pool_grown)
            self.pool_spilled.extend(overflow.pool_spilled)
            if self.on_replay is not None:
                self.on_replay(overflow)
            state.restore()
            if self.owns_gradients:
                self._drop_gradients()
            attempt += 1

    def forward_done(self) -> bool:
        """Between a forward and its backward, inside ``attempts``: the check, now (one read,
        one all-reduce; none once an earlier microbatch of the attempt overflowed). False: the
        attempt runs again, so its backward (and any further microbatch) can be skipped; every
        rank of the group gets the same answer."""
        if self._attempt is None:
            raise RuntimeError("ReplayGuard.forward_done: call it inside a `for _ in guard.attempts()` loop")
        return not self._attempt.check().replay

    def _drop_gradients(self) -> None:
        for module in self.modules:
            for param in module.parameters(recurse=False):
                param.grad = None


class _OverflowedStep(Exception):
    """Raised after a step's last backward when a dispatch overflowed: the step runs again."""


# Token counts a torchtitan ``Trainer`` keeps (dotted paths from the trainer): 0.2.2 adds to
# them as it draws a microbatch, 0.3.0 adds to ``ntokens_seen`` as each forward-backward
# prepares its microbatch. A rerun puts each back to where the step started plus what the
# draws added, so that the step's tokens count once either way.
TRAINER_TOKEN_COUNTS = ("ntokens_seen", "metrics_processor.ntokens_since_last_log")


class _TokenCounts:
    """The values of ``TRAINER_TOKEN_COUNTS`` a trainer has, read and written by path."""

    def __init__(self, trainer):
        self._trainer = trainer
        self.paths = [p for p in TRAINER_TOKEN_COUNTS if self._owner(p) is not None]

    def _owner(self, path: str):
        *parents, name = path.split(".")
        owner = self._trainer
        for parent in parents:
            owner = getattr(owner, parent, None)
        return owner if owner is not None and isinstance(getattr(owner, name, None), int) else None

    def read(self) -> list[int]:
        return [getattr(self._owner(p), p.rsplit(".", 1)[-1]) for p in self.paths]

    def write(self, values: list[int]) -> None:
        for path, value in zip(self.paths, values, strict=True):
            setattr(self._owner(path), path.rsplit(".", 1)[-1], value)


class _RecordedBatches:
    """A step's microbatches, drawn from the data iterator once and handed out again on a
    replay (the data loader moves once), with what the draws added to the trainer's token
    counts (``drawn``)."""

    def __init__(self, data_iterator, counts: _TokenCounts):
        self._source = data_iterator
        self._counts = counts
        self._drawn: list = []
        self._next = 0
        self.drawn = [0] * len(counts.paths)

    def __iter__(self):
        return self

    def __next__(self):
        if self._next == len(self._drawn):
            before = self._counts.read()
            self._drawn.append(next(self._source))
            self.drawn = [d + after - b for d, b, after in zip(self.drawn, before, self._counts.read(), strict=True)]
        self._next += 1
        return self._drawn[self._next - 1]

    def rewind(self) -> None:
        self._next = 0


def replaying_train_step(trainer, data_iterator, train_step):
    """``train_step(batches)`` (torchtitan's ``Trainer.train_step`` of ``trainer``) until no
    dispatch of the step overflowed (``ReplayOverflowedSteps``); a trainer that checks no
    capacity (``checks_capacity = False``) runs it once, as it is."""
    if not getattr(trainer, "checks_capacity", True):
        return train_step(data_iterator)
    for name, empty in (("capacity_replays", 0), ("capacity_spills", 0)):
        setattr(trainer, name, getattr(trainer, name, empty))
    for name in ("capacity_grown", "capacity_spilled"):
        if not hasattr(trainer, name):
            setattr(trainer, name, [])
    counts = _TokenCounts(trainer)
    at_start = counts.read()
    batches = _RecordedBatches(data_iterator, counts)
    state = StepState(m for part in trainer.model_parts for m in part.modules())
    reruns = _Reruns(f"step {getattr(trainer, 'step', '?')}", MAX_REPLAYS)
    spill = False
    while True:
        trainer._backwards_left = trainer.gradient_accumulation_steps
        try:
            with replay_scope(exact=spill) as scope:
                trainer._capacity_attempt = _Attempt(None, scope)
                return train_step(batches)
        except _OverflowedStep as overflowed:
            overflow = overflowed.args[0]
            reruns.admit(overflow)
            spill = overflow.spill
            trainer.capacity_replays += 1
            trainer.capacity_spills += spill
            trainer.capacity_grown.extend(overflow.grown)
            trainer.capacity_spilled.extend(overflow.spilled)
            on_replay = getattr(trainer, "on_capacity_replay", None)
            if on_replay is not None:
                on_replay(overflow)
            else:
                _log.warning("step %s: a symm dispatch overflowed its expert capacity; grown %s, spilled %s, step run "
                             "again (replay %d)", getattr(trainer, "step", "?"), overflow.grown, overflow.spilled,
                             trainer.capacity_replays)
            state.restore()
            counts.write([start + drawn for start, drawn in zip(at_start, batches.drawn, strict=True)])
            batches.rewind()


def checked_forward_backward(trainer, forward_backward_step, *args, **kwargs):
    """``forward_backward_step`` of ``trainer`` with the overflow check after its forward: as
    its loss is computed (``trainer.loss_fn``, which torchtitan calls between the model's
    forward and ``loss.backward()``), so that an overflowed microbatch runs no backward; after
    the step's last one, again where dispatches ran since (a recompute under activation
    checkpointing, or a pipeline schedule that calls the loss itself) (``ReplayOverflowedSteps``)."""
    if not getattr(trainer, "checks_capacity", True):
        return forward_backward_step(*args, **kwargs)
    attempt = trainer._capacity_attempt
    with _checked_loss(trainer, attempt):
        loss = forward_backward_step(*args, **kwargs)
    trainer._backwards_left -= 1
    if trainer._backwards_left == 0:
        overflow = attempt.end()
        if overflow.replay:
            raise _OverflowedStep(overflow)
    return loss


@contextlib.contextmanager
def _checked_loss(trainer, attempt: _Attempt):
    """``trainer.loss_fn`` followed by ``attempt``'s check while inside (raises
    ``_OverflowedStep`` on an overflow, before the backward)."""
    loss_fn = getattr(trainer, "loss_fn", None)
    if loss_fn is None:
        yield
        return
    own = "loss_fn" in vars(trainer)

    def checked(*args, **kwargs):
        loss = loss_fn(*args, **kwargs)
        overflow = attempt.check()
        if overflow.replay:
            raise _OverflowedStep(overflow)
        return loss

    trainer.loss_fn = checked
    try:
        yield
    finally:
        if own:
            trainer.loss_fn = loss_fn
        else:
            del trainer.loss_fn


class ReplayOverflowedSteps:
    """Mixin for torchtitan's ``Trainer`` (``class MyTrainer(ReplayOverflowedSteps, Trainer)``;
    0.2.2 and 0.3.0, whose ``train_step`` draws the step's microbatches from the data iterator
    and calls ``forward_backward_step`` once per accumulation step): each step whose symm
    dispatches overflowed their capacity runs again. After each microbatch's forward, as its
    loss is computed (and after the step's last backward where dispatches ran since), every
    rank checks the overflow counters (one device-to-host copy, one all-reduce of a few
    integers over the default group); on an overflow
    the step's gradients are dropped (``train_step`` zeroes them first), the random number
    generators, the MoE load-balancing counters and the trainer's token counts
    (``TRAINER_TOKEN_COUNTS``) go back to where the step started, and the same microbatches run
    again at the grown capacity (or, past the ceiling, at a spill's size). ``capacity_replays``
    counts the steps run again, ``capacity_spills`` those at a spill's size, ``capacity_grown``
    and ``capacity_spilled`` what changed; ``on_capacity_replay(overflow)``, where defined, is
    called before each replay. A trainer whose every rank knows that no symm dispatch runs at
    an elastic capacity sets ``checks_capacity = False``: no check, no read, no state saved.
    ``install_replays`` gives an existing trainer class the same behaviour."""

    capacity_replays: int = 0
    capacity_spills: int = 0

    def train_step(self, data_iterator):
        return replaying_train_step(self, data_iterator, super().train_step)

    def forward_backward_step(self, *args, **kwargs):
        return checked_forward_backward(self, super().forward_backward_step, *args, **kwargs)


def install_replays(trainer_cls: type) -> None:
    """Give ``trainer_cls`` (torchtitan's ``Trainer``, whose construction a caller does not
    control: torchtitan 0.3.0's entry point builds it from its config) ``ReplayOverflowedSteps``'
    behaviour by wrapping its ``train_step`` and ``forward_backward_step``. Idempotent."""
    if getattr(trainer_cls, "replays_overflowed_steps", False):
        return
    train_step, forward_backward_step = trainer_cls.train_step, trainer_cls.forward_backward_step

    @functools.wraps(train_step)
    def replaying(self, data_iterator):
        return replaying_train_step(self, data_iterator, functools.partial(train_step, self))

    @functools.wraps(forward_backward_step)
    def checked(self, *args, **kwargs):
        return checked_forward_backward(self, functools.partial(forward_backward_step, self), *args, **kwargs)

    trainer_cls.train_step, trainer_cls.forward_backward_step = replaying, checked
    trainer_cls.replays_overflowed_steps = True
