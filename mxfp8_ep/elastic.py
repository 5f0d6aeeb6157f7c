"""The elastic capacity's step contract: the symm transport stays sync-free and drop-free with
expert-side memory bounded by ``A2AConfig.capacity_factor`` times the balanced case.

A symm dispatch hands the experts a tensor of a capacity fixed on the host (so no host sync
waits for the token counts). A dispatch whose routing needs more rows than that does not drop
them quietly: it stays in bounds, its results are wrong, and it raises its buffer set's
overflow counter on the device (``dispatcher.symm``). Once per step, after the last backward
and before the optimizer, every rank reads the counters: one device-to-host copy, plus one
all-reduce of one integer over the training group so that every rank decides alike. On an
overflow each rank discards the step's gradients, every capacity that overflowed grows to what
the step needed plus headroom (``capacity.grown_capacity``; it stays grown), and the step runs
again on the same batch, with the random number generators and the MoE load-balancing counters
as they were before it: the replayed step computes exactly what the worst-case capacity
(``capacity_factor=None``) computes on that batch. A replay costs one more forward and
backward; it comes once per growth, and growth is bounded by the worst case.

A training loop::

    guard = ReplayGuard(model.modules(), group=None)   # None: the default (world) group
    for batch in batches:
        for _ in guard.attempts():          # again only after an overflow
            optimizer.zero_grad()
            loss_fn(model(batch)).backward()
        optimizer.step()

torchtitan's ``Trainer`` (0.2.2 and 0.3.0) gets the same from the mixin
``ReplayOverflowedSteps``: ``class MyTrainer(ReplayOverflowedSteps, Trainer)``.

Without a ``ReplayGuard`` (or ``expect_replays``), an overflow is an error instead
(``dispatcher.symm.CapacityOverflowError``; a device assert on CUDA).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from mxfp8_ep.dispatcher import symm
from mxfp8_ep.dispatcher.symm import CapacityOverflowError, expect_replays

__all__ = ["CapacityOverflowError", "LOAD_BALANCE_BUFFERS", "Overflow", "ReplayGuard", "ReplayOverflowedSteps",
           "StepState", "capacity_rows", "check_overflow", "expect_replays", "install_replays"]

_log = logging.getLogger(__name__)

# Module buffers a forward pass adds to and an optimizer step consumes: torchtitan's MoE counts
# the tokens routed to each expert for its load-balancing expert bias (DeepSeek-V3), as
# ``tokens_per_expert`` (0.2.2) or ``tokens_per_expert_E`` (0.3.0).
LOAD_BALANCE_BUFFERS = ("tokens_per_expert", "tokens_per_expert_E")


@dataclass
class Overflow:
    """What one step boundary's check found."""

    replay: bool  # some rank of the group overflowed: every rank runs the step again
    grown: list[tuple[int, int]] = field(default_factory=list)  # (old, new) capacity of this rank's grown sets


def check_overflow(group: dist.ProcessGroup | None = None) -> Overflow:
    """The step boundary's check (module docstring): whether any symm dispatch since the last
    check, on any rank of ``group`` (None: the default group; every rank calls it), needed more
    rows than its capacity; this rank's overflowed capacities grow. One device-to-host copy and
    one all-reduce of one integer; a process without the default group and without ``group``
    checks alone."""
    counters = symm.overflow_counters()
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    flag_device = _flag_device(group, counters)
    if counters is None:
        needed = torch.zeros(0, dtype=torch.int64, device=flag_device)
        flag = torch.zeros(1, dtype=torch.int64, device=flag_device)
    else:
        needed, capacity = counters
        flag = (needed > capacity).any().to(torch.int64).view(1).to(flag_device)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    values = torch.cat([flag, needed.to(flag_device)]).tolist()  # the one device-to-host copy
    replay = bool(values[0])
    return Overflow(replay=replay, grown=symm.grow_overflowed(values[1:]) if replay else [])


def _flag_device(group: dist.ProcessGroup | None, counters) -> torch.device:
    """Where the flag is all-reduced: on the GPU for NCCL, on the CPU for gloo."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if group is None and counters is not None:
        return counters[0].device
    return torch.device("cpu")


def capacity_rows() -> int | None:
    """The largest expert-major capacity (rows) of this process's symm buffer sets, or None."""
    return max(symm.capacities(), default=None)


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
    their load-balancing buffers are restored before a replay. ``group``: the ranks that step
    together (the default group when None); every rank of it runs the same steps through a
    guard. ``replays`` counts the steps run again, ``grown`` the capacities that grew."""

    def __init__(self, modules: Iterable[nn.Module], group: dist.ProcessGroup | None = None,
                 buffer_names: tuple[str, ...] = LOAD_BALANCE_BUFFERS):
        self.modules = list(modules)
        self.group = group
        self.buffer_names = buffer_names
        self.replays = 0
        self.grown: list[tuple[int, int]] = []
        expect_replays(True)

    def attempts(self) -> Iterator[int]:
        """Yields once per run of the step (the attempt's number, 0 first): the body runs the
        forward and backward passes of one step; after it the check decides whether to run it
        again."""
        state = StepState(self.modules, self.buffer_names)
        attempt = 0
        while True:
            yield attempt
            overflow = check_overflow(self.group)
            if not overflow.replay:
                return
            self.replays += 1
            self.grown.extend(overflow.grown)
            state.restore()
            attempt += 1

    def close(self) -> None:
        """Overflows are errors again (``dispatcher.symm.expect_replays``)."""
        expect_replays(False)


class _OverflowedStep(Exception):
    """Raised after a step's last backward when a dispatch overflowed: the step runs again."""


class _RecordedBatches:
    """A step's microbatches, drawn from the data iterator once and handed out again on a
    replay (the data loader, and the token counts torchtitan takes as it draws, move once)."""

    def __init__(self, data_iterator):
        self._source = data_iterator
        self._drawn: list = []
        self._next = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self._next == len(self._drawn):
            self._drawn.append(next(self._source))
        self._next += 1
        return self._drawn[self._next - 1]

    def rewind(self) -> None:
        self._next = 0


def replaying_train_step(trainer, data_iterator, train_step):
    """``train_step(batches)`` (torchtitan's ``Trainer.train_step`` of ``trainer``) until no
    dispatch of the step overflowed (``ReplayOverflowedSteps``)."""
    if not hasattr(trainer, "capacity_grown"):
        expect_replays(True)
        trainer.capacity_grown = []
        trainer.capacity_replays = getattr(trainer, "capacity_replays", 0)
    batches = _RecordedBatches(data_iterator)
    state = StepState(m for part in trainer.model_parts for m in part.modules())
    while True:
        trainer._backwards_left = trainer.gradient_accumulation_steps
        try:
            return train_step(batches)
        except _OverflowedStep as overflow:
            trainer.capacity_replays += 1
            trainer.capacity_grown.extend(overflow.args[0].grown)
            on_replay = getattr(trainer, "on_capacity_replay", None)
            if on_replay is not None:
                on_replay(overflow.args[0])
            else:
                _log.warning("step %s: a symm dispatch overflowed its expert capacity; grown %s, step run again "
                             "(replay %d)", getattr(trainer, "step", "?"), overflow.args[0].grown,
                             trainer.capacity_replays)
            state.restore()
            batches.rewind()


def checked_forward_backward(trainer, forward_backward_step, *args, **kwargs):
    """``forward_backward_step`` of ``trainer``; after the step's last one, the overflow check
    (``ReplayOverflowedSteps``)."""
    loss = forward_backward_step(*args, **kwargs)
    trainer._backwards_left -= 1
    if trainer._backwards_left == 0 and getattr(trainer, "checks_capacity", True):
        overflow = check_overflow()
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
    generators and the MoE load-balancing counters go back to where the step started, and the
    same microbatches run again at the grown capacity. ``capacity_replays`` counts the steps run
    again, ``capacity_grown`` the (old, new) capacities; ``on_capacity_replay(overflow)``, where
    defined, is called before each replay. A trainer whose every rank knows that no symm
    dispatch runs at an elastic capacity sets ``checks_capacity = False``: no check, no read.
    ``install_replays`` gives an existing trainer class the same behaviour."""

    capacity_replays: int = 0

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
