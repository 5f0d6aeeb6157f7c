"""The token dispatcher's base: its config (``TokenDispatcher.Config``, whose ``build`` picks the
transport), the input checks every transport makes as it exchanges its token counts
(``checks``), which transport ``a2a.transport=auto`` means on this group
(``resolve_transport``), and the registry of transports: a transport is a ``TokenDispatcher``
subclass in a module of its own that registers itself (``register_transport``);
``Config.build`` looks the transport up there."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mxfp8_ep import numerics
from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import checks
from mxfp8_ep.launch_shapes import KernelShapes, kernel_shapes
from mxfp8_ep.quantize import resolve_kernel
from mxfp8_ep.wire_format import WireFormat


_TRANSPORTS: dict[str, list[type[TokenDispatcher]]] = {}


def register_transport(name: str):
    """Class decorator: ``TokenDispatcher.Config.build`` gives transport ``name`` (the value of
    ``a2a.transport`` it resolves to) to the decorated class, when the class ``serves`` the
    config; several classes may share a name (``nccl``: one per kind of legs)."""

    def register(cls: type[TokenDispatcher]) -> type[TokenDispatcher]:
        _TRANSPORTS.setdefault(name, []).append(cls)
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


def registered_transports() -> dict[str, list[type[TokenDispatcher]]]:
    """Transport name -> the classes registered for it."""
    return {name: list(classes) for name, classes in _TRANSPORTS.items()}


def resolve_transport(transport: str, device: torch.device, group: dist.ProcessGroup,
                      hosts: list[str] | None = None) -> str:
    """``auto`` -> ``symm`` on one node with CUDA and >= 2 ranks, ``nccl`` otherwise. An
    explicit ``symm`` across nodes is an error (peer memory does not span nodes). ``hosts``:
    every rank's host name, when the caller has gathered them (else gathered here)."""
    if transport == "nccl":
        return "nccl"
    world = dist.get_world_size(group)
    if transport == "auto" and (torch.device(device).type != "cuda" or world < 2):
        return "nccl"
    if hosts is None:
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        if transport == "symm":
            raise ValueError(
                f"a2a.transport=symm needs every EP rank on one node, but the EP group spans "
                f"{len(set(hosts))} hosts; use transport=nccl (or auto) for multi-node EP"
            )
        return "nccl"
    return "symm"


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

        def agreed_facts(self) -> dict:
            """What every rank of an EP group must build alike (``checks.agree`` at ``build``)."""
            a2a = self.a2a
            return {
                "num_experts": self.num_experts, "top_k": self.top_k, "transport": a2a.transport,
                **{leg: getattr(a2a, leg) for leg in A2AConfig.legs()}, "scale_rounding": a2a.scale_rounding,
                "symm_combine_partial_sums": a2a.symm_combine_partial_sums, "capacity_factor": a2a.capacity_factor,
                "score_before_experts": self.score_before_experts, "pad_multiple": self.pad_multiple,
                "max_tokens_per_rank": self.max_tokens_per_rank,
            }

        @property
        def symm_partial_sums(self) -> bool:
            """Whether the symm transport sends dispatch's backward as one partial sum per
            token and rank (``SymmTokenDispatcher._push_to_tokens``): with top-k > 1 and the
            scores after the experts, the plain sum of a token's rows on each rank. The x
            gradient then adds a token's rows in another grouping than the fused nccl
            transport, and rounds (bf16) or quantizes (MXFP8) each partial sum once instead of
            each row: equal to that rounding, not bits."""
            return self.top_k > 1 and not self.score_before_experts

        @property
        def symm_combine_partial_sums(self) -> bool:
            """Whether combine's forward goes the same way (``symm_partial_sums`` and
            ``A2AConfig.symm_combine_partial_sums``): the weighted sum of a token's rows on each
            rank (the scores ride along with dispatch's forward). The output then differs from
            the fused nccl transport's as the x gradient does, and the score gradients are taken
            where the expert outputs stayed, against the output gradient as it arrived there
            (MXFP8: dequantized), and go back to the tokens' ranks
            (``SymmTokenDispatcher.to_experts``)."""
            return self.symm_partial_sums and self.a2a.symm_combine_partial_sums

        @property
        def symm_scores_after_dequantize(self) -> bool:
            """Whether the symm transport quantizes a token before its router score multiplies
            it: with top-k > 1 the weighted expert-bound leg (combine's backward when the
            scores come after the experts, dispatch's forward when they come first) sends each
            token once per rank and the experts' rank multiplies each row by its score as it
            receives it (``SymmTokenDispatcher._push_to_experts``). On a bf16 leg that is the
            same product, the same bits; on an MXFP8 leg the row is ``score * dequant(quant(token))``
            where the fused nccl transport sends ``quant(score * token)``: equal to the format's
            rounding, not bits (every gradient downstream of combine's backward, or every value
            downstream of dispatch's forward)."""
            weighted = "dispatch_fwd" if self.score_before_experts else "combine_bwd"
            return self.top_k > 1 and self.a2a.wire_format(weighted).quantized

        def build(self, group: dist.ProcessGroup, device: torch.device | str) -> TokenDispatcher:
            """The dispatcher of the transport ``a2a.transport`` resolves to on ``group``
            (``dispatcher_for``), after one exchange that checks this config against every
            rank's (``checks.agree``: a mismatch fails every rank, naming the fields) and
            gathers the host names."""
            facts = {**self.agreed_facts(), "device": torch.device(device).type}
            gathered = checks.agree(group, "build", facts, local={"host": socket.gethostname()})
            hosts = [g["host"] for g in gathered]
            return dispatcher_for(self, resolve_transport(self.a2a.transport, torch.device(device), group, hosts), group)

    @classmethod
    def serves(cls, config: Config) -> bool:  # noqa: ARG003 (every config, unless a transport says otherwise)
        """Whether this transport takes ``config`` (``Config.build``)."""
        return True

    def __init__(self, config: Config, group: dist.ProcessGroup):
        self.config = config
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if config.num_experts % self.ep != 0:
            raise ValueError(
                f"expert parallelism {self.ep} must divide the number of experts {config.num_experts}"
            )
        self.num_local_experts = config.num_experts // self.ep
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
        """Whether the numerics telemetry (``mxfp8_ep.numerics``) takes ``leg`` now: it is armed
        and the leg is MXFP8. Host state only."""
        return numerics.PROBE.armed and self.config.a2a.wire_format(leg) is WireFormat.MXFP8

    def _observe(self, leg: str, rows: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Report what an MXFP8 leg quantizes to the numerics telemetry (nothing happens unless
        ``_observing``): ``rows``, of which those where ``valid`` (``(N,)`` bool) is set."""
        if self._observing(leg):
            numerics.PROBE.observe(self, leg, rows, self.config.a2a.scale_rounding, valid)
