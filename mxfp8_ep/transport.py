"""The transports: how token rows travel between the ranks of an EP group, the values of
``A2AConfig.transport``, and which one ``auto`` means on a group (``resolve``).

This module is the one place that names transports; the rest of the code asks ``Transport``. It
imports no torch, so the recipe's validation (``launch/``) reads it before anything heavy
starts. A transport's dispatcher classes register under its member
(``mxfp8_ep.dispatcher.register_transport``).

Adding a transport: a member here, its dispatcher module under ``mxfp8_ep/dispatcher/`` that
registers under it, and, if ``auto`` should pick it, the rule in ``resolve``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from enum import StrEnum


class Transport(StrEnum):
    """A transport. A string enum: each member equals its name as the config spells it."""

    def __new__(cls, value: str, doc: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.__doc__ = inspect.cleandoc(doc)
        return member

    AUTO = ("auto", """symm on one node with CUDA and >= 2 ranks, two_hop across nodes of >= 2 CUDA ranks
            each, nccl otherwise (``resolve``).""")
    SYMM = ("symm", """One Triton kernel per leg pushes rows straight into peers' expert-major slots over
            CUDA symmetric memory (one node, >= 2 GPUs; no host sync).""")
    NCCL = ("nccl", """All-to-all through the process group: multi-node NCCL, and gloo (CPU).""")
    TWO_HOP = ("two_hop", """Across nodes: each token goes once to each node that holds one of its experts, between
               ranks of the same local index (NCCL; gloo on CPU), then fans out inside the node over
               symmetric memory with the symm transport's kernels (no host sync).""")

    def __repr__(self) -> str:  # as the config spells it, in the messages that quote one
        return repr(self.value)

    @classmethod
    def named(cls) -> tuple[Transport, ...]:
        """The transports a dispatcher class serves: every member but ``AUTO``, which only names a
        choice among them."""
        return tuple(t for t in cls if t is not cls.AUTO)


TRANSPORTS: tuple[str, ...] = tuple(t.value for t in Transport)


def resolve(requested: str, *, cuda: bool, ranks: int, hosts: Callable[[], int]) -> Transport:
    """The transport ``requested`` (an ``A2AConfig.transport``) means for an EP group of ``ranks``
    ranks (``cuda``: on CUDA devices): ``auto`` is symm on one host with CUDA and >= 2 ranks,
    two_hop across hosts with CUDA and >= 2 ranks on each, nccl otherwise; an explicit symm
    across hosts is an error (peer memory does not span nodes). An explicit two_hop stays
    (its dispatcher checks the node layout). ``hosts``: how many hosts the group spans, called
    only when that decides."""
    transport = Transport(requested)
    if transport in (Transport.NCCL, Transport.TWO_HOP):
        return transport
    if transport is Transport.AUTO and (not cuda or ranks < 2):
        return Transport.NCCL
    spanned = hosts()
    if spanned > 1:
        if transport is Transport.SYMM:
            raise ValueError(
                f"a2a.transport={Transport.SYMM} needs every EP rank on one node, but the EP group spans "
                f"{spanned} hosts; use transport={Transport.TWO_HOP} (or {Transport.AUTO}) for multi-node EP"
            )
        return Transport.TWO_HOP if ranks // spanned >= 2 else Transport.NCCL
    return Transport.SYMM
