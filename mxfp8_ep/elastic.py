"""The elastic capacity's step contract: the symm transport stays sync-free and drop-free with
expert-side memory bounded by ``A2AConfig.capacity_factor`` times the balanced case, growing
up to ``A2AConfig.capacity_ceiling``.

A symm dispatch inside a replay scope (``dispatcher.symm.replay_scope``: each attempt of a
``ReplayGuard``, each step of ``ReplayOverflowedSteps``) hands the experts a tensor of a
capacity fixed on the host, so no host sync waits for the token counts. A dispatch whose
routing needs more rows than that stays in bounds, its results are wrong, and it raises its
buffer set's overflow counter on the device. Once per step, after the last backward and before
the optimizer, every rank reads the counters: one device-to-host copy, plus one all-reduce of
one integer over the training group so that every rank decides alike. On an overflow each rank
drops the step's gradients, every capacity that overflowed grows to what the step needed plus
headroom, up to the ceiling (``capacity.next_capacity``; it stays grown), and the step runs
again on the same batch, with the random number generators, the MoE load-balancing counters
and the trainer's token count as they were before it. A step that needs more than the ceiling
spills: it runs again at exactly the rows it needs, a size that lasts that step only, and the
capacity stops at the ceiling. Either way the rerun computes exactly what the worst-case
capacity (``capacity_factor=None``) computes on that batch, and costs one more forward and
backward.

A training loop::

    guard = ReplayGuard(model.modules(), group=None)   # None: the default (world) group
    for batch in batches:
        for _ in guard.attempts():          # again only after an overflow
            loss_fn(model(batch)).backward()
        optimizer.step()
        optimizer.zero_grad()

The guard owns the gradients of its attempts: a rerun starts from none, wherever the loop
zeroes them (an attempt holds one whole optimizer step: all its microbatches). An evaluation
pass wraps each batch the same way with ``owns_gradients=False``.

torchtitan's ``Trainer`` (0.2.2 and 0.3.0) gets the same from the mixin
``ReplayOverflowedSteps``: ``class MyTrainer(ReplayOverflowedSteps, Trainer)``.

A dispatch outside any replay scope is never wrong either: it reads the rows it needs on the
host (one sync per dispatch, announced once) and grows its buffers, or spills, before any row
moves (``dispatcher.symm``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from mxfp8_ep import activation_pool
from mxfp8_ep.dispatcher import symm
from mxfp8_ep.dispatcher.symm import replay_scope

__all__ = ["LOAD_BALANCE_BUFFERS", "MAX_REPLAYS", "Overflow", "ReplayGuard", "ReplayLimitError",
           "ReplayOverflowedSteps", "StepState", "capacity_ceiling_rows", "capacity_rows", "check_overflow",
           "install_replays", "replay_scope"]

_log = logging.getLogger(__name__)

# Module buffers a forward pass adds to and an optimizer step consumes: torchtitan's MoE counts
# the tokens routed to each expert for its load-balancing expert bias (DeepSeek-V3), as
# ``tokens_per_expert`` (0.2.2) or ``tokens_per_expert_E`` (0.3.0).
LOAD_BALANCE_BUFFERS = ("tokens_per_expert", "tokens_per_expert_E")
# Reruns of one step before it is an error: a rerun at the grown (or spilled) size fits the
# same routing, so a step overflows again only where its routing changes between runs.
MAX_REPLAYS = 3


class ReplayLimitError(RuntimeError):
    """A step overflowed its symm capacity on ``MAX_REPLAYS`` reruns in a row."""


def _replay_limit_error(where: str, replays: int) -> ReplayLimitError:
    return ReplayLimitError(
        f"{where}: a symm dispatch overflowed its expert capacity again after {replays} reruns at a grown or "
        f"exact size: the routing differs between runs of the same step (a router that is not deterministic, "
        f"or inputs that change between attempts). Run the step's forward deterministically, or set "
        f"A2AConfig.capacity_factor=None (the worst case, never rerun)")


@dataclass
class Overflow:
    """What one step boundary's check found."""

    replay: bool  # some rank of the group overflowed: every rank runs the step again
    grown: list[tuple[int, int]] = field(default_factory=list)  # (old, new) capacity of this rank's grown sets
    # (ceiling, rows needed) of this rank's sets that needed more than their ceiling
    spilled: list[tuple[int, int]] = field(default_factory=list)
    # some rank's set needed more than its ceiling: every rank reruns the step outside a replay
    # scope, each dispatch at exactly the rows it needs
    spill: bool = False


def check_overflow(group: dist.ProcessGroup | None = None, scope: symm.ReplayScope | None = None) -> Overflow:
    """The step boundary's check (module docstring): whether any symm dispatch inside ``scope``
    (None: the innermost open replay scope), on any rank of ``group`` (None: the default group;
    every rank calls it), overflowed its capacity, and whether one needed more rows than its
    ceiling (then every rank reruns the step outside a replay scope: a spill); this rank's
    overflowed capacities grow. One device-to-host copy and one all-reduce of two integers; a
    process without the default group and without ``group`` checks alone. Outside every scope
    nothing is counted (such dispatches fit themselves): no replay."""
    scope = scope if scope is not None else symm.innermost_scope()
    sets = symm.needed_rows()
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    flag_device = _flag_device(group, sets)
    device = sets[0].device if sets is not None else flag_device
    # [overflowed, needs more than a ceiling, each set's rows needed], built where the counters
    # are and copied to where the flags are all-reduced once.
    values = torch.zeros(2, dtype=torch.int64, device=device)
    if scope is not None:
        values[0] = scope.overflows(device).clamp(max=1)[0]
    if sets is not None:
        values[1] = (sets[0] > sets[1]).any()
        values = torch.cat([values, sets[0]])
    # --- the activation pool (mxfp8_ep.activation_pool): its overflows count in the scope's,
    # its peak rows travel after the sets' and past its ceiling it spills as a set does ---
    pools = activation_pool.needed_rows()
    if pools is not None:
        values[1] |= (pools[0].to(device) > pools[1].to(device)).any()
        values = torch.cat([values, pools[0].to(device)])
    # --- end of the activation pool ---
    values = values.to(flag_device)
    if group is not None:
        dist.all_reduce(values[:2], op=dist.ReduceOp.MAX, group=group)
    values = values.tolist()  # the one device-to-host copy
    if not values[0]:
        return Overflow(replay=False)
    n_sets = len(values) - 2 - (len(pools[0]) if pools is not None else 0)
    plan = symm.plan_overflowed(values[2 : 2 + n_sets])
    pool_plan = activation_pool.plan_overflowed(values[2 + n_sets :]) if pools is not None else None  # pool hook
    return Overflow(replay=True, grown=plan.grown + (pool_plan.grown if pool_plan else []),
                    spilled=plan.spilled + (pool_plan.spilled if pool_plan else []), spill=bool(values[1]))


def _flag_device(group: dist.ProcessGroup | None, sets) -> torch.device:
    """Where the flags are all-reduced: on the GPU for NCCL, on the CPU for gloo."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if group is None and sets is not None:
        return sets[0].device
    return torch.device("cpu")


def capacity_rows() -> int | None:
    """The largest expert-major capacity (rows) of this process's symm buffer sets, or None."""
    return max(symm.capacities(), default=None)


def capacity_ceiling_rows() -> int | None:
    """The largest ceiling (rows) of this process's symm buffer sets, or None."""
    return max(symm.ceilings(), default=None)


class StepState:
    """What a replayed step must start from: the random number generators (CPU, and the current
    CUDA device's) and the module buffers a forward pass adds to (``LOAD_BALANCE_BUFFERS``)."""

    def __init__(self, modules: Iterable[nn.Module], buffer_names: tuple[str, ...] = LOAD_BALANCE_BUFFERS):
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = (torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized()
                          else None)
        self._buffers = [(buf, buf.detach().clone()) for module in modules
                         for name, buf in module.named_buffers(recurse=False) if name in buffer_names]

    def restore(self) -> None:
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state(self._cuda_rng)
        with torch.no_grad():
            for buf, saved in self._buffers:
                buf.copy_(saved)


class ReplayGuard:
    """Runs each step until no symm dispatch of it overflowed (module docstring). ``modules``:
    every module of the model (``model.modules()``, each model part's for pipeline stages):
    their load-balancing buffers are restored before a rerun and, with ``owns_gradients``, their
    parameters' gradients dropped (an evaluation pass, which computes none, passes False).
    ``group``: the ranks that step together (the default group when None); every rank of it
    runs the same steps through a guard. ``replays`` counts the reruns, ``spills`` those of a
    step that needed more than a ceiling (rerun outside a replay scope, each dispatch at
    exactly its rows); ``grown`` and ``spilled`` list what changed; ``on_replay(overflow)``, where
    given, is called before each rerun. More than ``max_replays`` reruns of one step raise
    ``ReplayLimitError``."""

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

    def attempts(self) -> Iterator[int]:
        """Yields once per run of the step (the attempt's number, 0 first), inside a replay
        scope: the body runs the forward (and backward) passes of one step; after it the check
        decides whether to run it again."""
        state = StepState(self.modules, self.buffer_names)
        attempt, spill = 0, False
        while True:
            with replay_scope(exact=spill) as scope:
                yield attempt
                overflow = check_overflow(self.group, scope)
            if not overflow.replay:
                return
            if attempt == self.max_replays:
                raise _replay_limit_error("ReplayGuard", attempt)
            self.replays += 1
            spill = overflow.spill
            self.spills += spill
            self.grown.extend(overflow.grown)
            self.spilled.extend(overflow.spilled)
            if self.on_replay is not None:
                self.on_replay(overflow)
            state.restore()
            if self.owns_gradients:
                self._drop_gradients()
            attempt += 1

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
    replays, spill = 0, False
    while True:
        trainer._backwards_left = trainer.gradient_accumulation_steps
        try:
            with replay_scope(exact=spill) as trainer._replay_scope:
                return train_step(batches)
        except _OverflowedStep as overflowed:
            overflow = overflowed.args[0]
            if replays == MAX_REPLAYS:
                raise _replay_limit_error(f"step {getattr(trainer, 'step', '?')}", replays) from None
            replays += 1
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
    """``forward_backward_step`` of ``trainer``; after the step's last one, the overflow check
    (``ReplayOverflowedSteps``)."""
    loss = forward_backward_step(*args, **kwargs)
    if not getattr(trainer, "checks_capacity", True):
        return loss
    trainer._backwards_left -= 1
    if trainer._backwards_left == 0:
        overflow = check_overflow(scope=trainer._replay_scope)
        if overflow.replay:
            raise _OverflowedStep(overflow)
    return loss


class ReplayOverflowedSteps:
    """Mixin for torchtitan's ``Trainer`` (``class MyTrainer(ReplayOverflowedSteps, Trainer)``;
    0.2.2 and 0.3.0, whose ``train_step`` draws the step's microbatches from the data iterator
    and calls ``forward_backward_step`` once per accumulation step): each step whose symm
    dispatches overflowed their capacity runs again. After a step's last forward-backward,
    before gradient clipping and the optimizer, every rank checks the overflow counters (one
    device-to-host copy, one all-reduce of one integer over the default group); on an overflow
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
