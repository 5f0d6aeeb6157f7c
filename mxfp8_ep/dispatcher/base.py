"""The token dispatcher's base: its config (``TokenDispatcher.Config``, whose ``build`` picks the
transport), the input checks every transport makes as it exchanges its token counts
(``checks``), which transport ``a2a.transport=auto`` means on this group
(``resolve_transport``), and the registry of transports: a transport is a ``TokenDispatcher``
subclass in a module of its own that registers itself (``register_transport``);
``Config.build`` looks the transport up there."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Self

import torch
import torch.distributed as dist

from mxfp8_ep.telemetry import numerics
from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import checks
from mxfp8_ep.kernels.launch_shapes import KernelShapes, kernel_shapes
from mxfp8_ep.kernels.quantize import resolve_kernel
from mxfp8_ep.transport import Transport, resolve
from mxfp8_ep.format.wire_format import WIRE_FORMATS

_TRANSPORTS: dict[Transport, list[type[TokenDispatcher]]] = {}


def register_transport(name: str):
    """Class decorator: ``TokenDispatcher.Config.build`` gives transport ``name`` (a
    ``Transport`` that ``a2a.transport`` resolves to) to the decorated class, when the class
    ``serves`` the config; several classes may share a name (``nccl``: one per kind of legs)."""
    transport = Transport(name)
    if transport not in Transport.named():
        raise ValueError(f"register_transport({name!r}): a class serves one of {Transport.named()}")

    def register(cls: type[TokenDispatcher]) -> type[TokenDispatcher]:
        _TRANSPORTS.setdefault(transport, []).append(cls)
        return cls

    return register


def dispatcher_for(config: TokenDispatcher.Config, transport: str, group: dist.ProcessGroup) -> TokenDispatcher:
    """The dispatcher of ``transport`` (a name ``resolve_transport`` returns) for ``config`` on
    ``group``: the first class registered for it that serves the config."""
    for cls in _TRANSPORTS.get(transport, ()):
        if cls.serves(config):
            return cls(config, group)
    registered = {name: [c.__name__ for c in classes] for name, classes in _TRANSPORTS.items()}
    raise ValueError(f"no token dispatcher serves transport {transport!r} with {config.a2a}; registered: {registered}")


def registered_transports() -> dict[Transport, list[type[TokenDispatcher]]]:
    """Transport name -> the classes registered for it."""
    return {name: list(classes) for name, classes in _TRANSPORTS.items()}


def resolve_transport(transport: str, device: torch.device, group: dist.ProcessGroup,
                      hosts: list[str] | None = None) -> Transport:
    """The transport ``transport`` (an ``A2AConfig.transport``) means on ``group``
    (``mxfp8_ep.transport.resolve``: ``auto`` is symm on one node with CUDA and >= 2 ranks,
    nccl otherwise; an explicit symm across nodes is an error). ``hosts``: every rank's host
    name, when the caller has gathered them (else gathered here, where they decide)."""

    def spanned() -> int:
        names = hosts
        if names is None:
            names = [None] * dist.get_world_size(group)
            dist.all_gather_object(names, socket.gethostname(), group=group)
        return len(set(names))

    return resolve(transport, cuda=torch.device(device).type == "cuda", ranks=dist.get_world_size(group),
                   hosts=spanned)


# Config fields the ranks of an EP group may set differently, each with why; every other field
# of ``TokenDispatcher.Config`` and of its ``a2a`` must agree (``Config.agreed_facts``).
UNAGREED_FIELDS = {
    "check_inputs": "it decides only how this rank reports a failed input check (read on the host, naming "
                    "the rank, or a device assert); every rank fails either way, and the MXFP8_EP_DEBUG "
                    "setting it falls back to is per process too",
}


def _field_facts(config, prefix: str = "") -> dict:
    """Every field of the dataclass ``config`` by its path (``a2a.dispatch_fwd`` for a field of a
    dataclass field), ``UNAGREED_FIELDS`` left out."""
    facts = {}
    for f in fields(config):
        name, value = prefix + f.name, getattr(config, f.name)
        if name in UNAGREED_FIELDS:
            continue
        if is_dataclass(value) and not isinstance(value, type):
            facts.update(_field_facts(value, f"{name}."))
        else:
            facts[name] = value
    return facts


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class TokenDispatcher:
    """Base of the EP dispatchers: the config, the EP degree and the input checks every transport
    makes; a transport subclass adds ``dispatch`` and ``combine``."""

    @dataclass(kw_only=True)
    class Config:
        num_experts: int
        top_k: int
        a2a: A2AConfig = field(default_factory=A2AConfig)
        # Router scores multiply the expert inputs (Llama4) instead of the outputs (DeepSeek-V3).
        score_before_experts: bool = False
        # Each local expert's segment is padded to a multiple of this (grouped GEMM alignment).
        pad_multiple: int = 8
        # symm: receive buffers are sized for this many tokens per rank (None: the largest
        # token count of the first dispatch, over the EP group).
        max_tokens_per_rank: int | None = None
        # Push transports (symm, nccl with an MXFP8 leg): the Triton kernels' launch shapes per
        # leg format (None, or a format left out: ``KernelShapes.default(fmt)``).
        launch_shapes: dict[str, KernelShapes] | None = None

        def kernel_shapes(self, fmt: str) -> KernelShapes:
            """The launch shapes of the kernels that move a leg in format ``fmt``."""
            return kernel_shapes(self.launch_shapes, fmt)

        # The input checks that need a host sync per dispatch (``checks``: on the symm
        # transport on CUDA, every rank's check results read on the host, so the error names
        # the rank and the check; otherwise a device-side assert). None: ``checks.set_debug``,
        # else the MXFP8_EP_DEBUG environment variable, decides.
        check_inputs: bool | None = None

        @classmethod
        def of(cls, config: TokenDispatcher.Config) -> Self:
            """``config`` as this class (a transport's own ``Config``): itself when it is one,
            else a copy of its fields."""
            if type(config) is cls:
                return config
            return cls(**{f.name: getattr(config, f.name) for f in fields(TokenDispatcher.Config)})

        def problems(self) -> list[str]:
            """What is wrong with this config, its ``a2a`` included, one line each (empty:
            nothing). ``build`` checks it on every rank at once."""
            found = [f"TokenDispatcher.Config.{name}={getattr(self, name)!r}: expected an integer >= 1"
                     for name in ("num_experts", "top_k", "pad_multiple") if not _positive_int(getattr(self, name))]
            if self.max_tokens_per_rank is not None and not _positive_int(self.max_tokens_per_rank):
                found.append(f"TokenDispatcher.Config.max_tokens_per_rank={self.max_tokens_per_rank!r}: expected "
                             f"an integer >= 1 or None (the largest token count of the first dispatch)")
            for name, allowed in (("score_before_experts", (bool,)), ("check_inputs", (bool, type(None)))):
                if not isinstance(getattr(self, name), allowed):
                    found.append(f"TokenDispatcher.Config.{name}={getattr(self, name)!r}: expected "
                                 f"{'true, false or None' if type(None) in allowed else 'true or false'}")
            shapes = self.launch_shapes
            if shapes is not None and not (isinstance(shapes, Mapping) and all(
                    fmt in WIRE_FORMATS and isinstance(s, KernelShapes) for fmt, s in shapes.items())):
                found.append(f"TokenDispatcher.Config.launch_shapes={shapes!r}: expected None or a mapping "
                             f"from wire formats {WIRE_FORMATS} to KernelShapes")
            if not isinstance(self.a2a, A2AConfig):
                return [*found, f"TokenDispatcher.Config.a2a={self.a2a!r}: expected an A2AConfig"]
            return found + self.a2a.problems()

        def agreed_facts(self) -> dict:
            """What every rank of an EP group must build alike (``checks.agree`` at ``build``):
            every field of this config and of its ``a2a``, by its path (``a2a.dispatch_fwd``),
            but ``UNAGREED_FIELDS``."""
            return _field_facts(self)

        def build(self, group: dist.ProcessGroup, device: torch.device | str) -> TokenDispatcher:
            """The dispatcher of the transport ``a2a.transport`` resolves to on ``group``
            (``dispatcher_for``), after one exchange in which every rank's check of its own
            config travels (``problems``: a rank whose config is wrong raises its error, its
            peers one that names it and the problem), the configs are compared
            (``agreed_facts``: a mismatch fails every rank, naming the fields) and the host names
            are gathered (``checks.agree``)."""
            found = self.problems()
            try:
                device_type = torch.device(device).type
            except (RuntimeError, TypeError) as e:
                found.append(f"device {device!r}: {e}")
            fault = None
            if found:
                error = ValueError(f"TokenDispatcher.Config on rank {dist.get_rank(group)}: " + "; ".join(found))
                fault = checks.HostFault(checks.Fault.CONFIG, error)
            facts = {} if found else {**self.agreed_facts(), "device": device_type}
            gathered = checks.agree(group, "build", facts, fault, local={"host": socket.gethostname()})
            hosts = [g["host"] for g in gathered]
            return dispatcher_for(self, resolve_transport(self.a2a.transport, torch.device(device), group, hosts),
                                  group)

    @classmethod
    def serves(cls, config: Config) -> bool:  # noqa: ARG003 (every config, unless a transport says otherwise)
        """Whether this transport takes ``config`` (``Config.build``)."""
        return True

    def __init__(self, config: Config, group: dist.ProcessGroup):
        self.config = type(self).Config.of(config)
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.config.num_experts % self.ep != 0:
            raise ValueError(
                f"expert parallelism {self.ep} must divide the number of experts {config.num_experts}"
            )
        self.num_local_experts = self.config.num_experts // self.ep
        self._shape: tuple[int, torch.dtype] | None = None  # (dim, dtype) the group agreed on

    @property
    def debug(self) -> bool:
        """Whether the input checks that need a host sync run (``checks.debug_mode``)."""
        return checks.debug_mode(self.config.check_inputs)

    def _dim_error(self, dim: int) -> str | None:
        """Why tokens of ``dim`` elements cannot travel on one of this config's legs, or None."""
        for leg in A2AConfig.legs():
            error = self.config.a2a.wire_format(leg).dim_error(dim)
            if error is not None:
                return f"{leg}: {error}"
        return None

    def _checked_routing(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E):  # noqa: N803
        """The routing this rank dispatches by (``checks.CheckedRouting``: device-checked, safe
        to index with) and its host fault, if any. A rank whose input fails a host check does
        not raise here: it takes part in the count exchange with its fault bits set (its
        routing is then empty) and raises after it, so no peer waits for it. A dispatcher
        agrees with its group on its tokens' dim and dtype at its first dispatch and whenever
        they change (``checks.agree``: a host fault there fails every rank at once)."""
        cfg = self.config
        fault = checks.host_fault(
            x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E,
            num_experts=cfg.num_experts, top_k=cfg.top_k, rank=self.rank, dim_error=self._dim_error,
        )
        if fault is None:
            shape = (x_TD.shape[1], x_TD.dtype)
            if shape != self._shape:
                checks.agree(self.group, "dispatch", {"dim": shape[0], "dtype": str(shape[1])})
                self._shape = shape
            kernel = resolve_kernel(cfg.a2a.kernel, x_TD.device)
            return checks.check_routing(topk_expert_ids_TK, num_tokens_per_expert_E, cfg.num_experts, kernel), None
        if self._shape is None:  # nothing agreed yet: the agreement carries the fault
            checks.agree(self.group, "dispatch", {}, fault)
        return checks.host_fault_routing(cfg.num_experts, fault.fault, x_TD.device), fault

    def _observing(self, leg: str) -> bool:
        """Whether the numerics telemetry (``mxfp8_ep.telemetry.numerics``) takes ``leg`` now: it is armed
        and the leg is MXFP8. Host state only."""
        return numerics.PROBE.armed and self.config.a2a.wire_format(leg).quantized

    def _observe(self, leg: str, rows: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Report what an MXFP8 leg quantizes to the numerics telemetry (nothing happens unless
        ``_observing``): ``rows``, of which those where ``valid`` (``(N,)`` bool) is set."""
        if self._observing(leg):
            numerics.PROBE.observe(self, leg, rows, self.config.a2a.scale_rounding, valid)
