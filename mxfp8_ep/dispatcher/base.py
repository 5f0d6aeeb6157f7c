"""The token dispatcher's base: its config (``TokenDispatcher.Config``, whose ``build`` picks the
transport), the input checks every transport makes before it exchanges anything, which transport
``a2a.transport=auto`` means on this group (``resolve_transport``), and the registry of
transports: a transport is a ``TokenDispatcher`` subclass in a module of its own that registers
itself (``register_transport``); ``Config.build`` looks the transport up there."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mxfp8_ep import numerics
from mxfp8_ep.config import A2AConfig
from mxfp8_ep.launch_shapes import KernelShapes, kernel_shapes
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


def resolve_transport(transport: str, device: torch.device, group: dist.ProcessGroup) -> str:
    """``auto`` -> ``symm`` on one node with CUDA and >= 2 ranks, ``nccl`` otherwise. An
    explicit ``symm`` across nodes is an error (peer memory does not span nodes)."""
    if transport == "nccl":
        return "nccl"
    world = dist.get_world_size(group)
    if transport == "auto" and (torch.device(device).type != "cuda" or world < 2):
        return "nccl"
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
            (``dispatcher_for``)."""
            return dispatcher_for(self, resolve_transport(self.a2a.transport, torch.device(device), group), group)

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

    def _check_inputs(self, x_TD, topk_scores_TK, topk_expert_ids_TK) -> None:  # noqa: N803
        """Fail on every rank, before any exchange, so no rank waits for a peer that raised."""
        a2a = self.config.a2a
        if x_TD.dim() != 2 or topk_expert_ids_TK.shape != (x_TD.shape[0], self.config.top_k):
            raise ValueError(
                f"dispatch takes x (T, D) and expert ids (T, top_k={self.config.top_k}), got "
                f"{tuple(x_TD.shape)} and {tuple(topk_expert_ids_TK.shape)}"
            )
        if topk_scores_TK.shape != topk_expert_ids_TK.shape:
            raise ValueError(f"scores {tuple(topk_scores_TK.shape)} != expert ids {tuple(topk_expert_ids_TK.shape)}")
        for leg in A2AConfig.legs():
            error = a2a.wire_format(leg).dim_error(x_TD.shape[1])
            if error is not None:
                raise ValueError(f"{leg}: {error} (the model dim); use a2a=bf16 for this model")
        if x_TD.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"dispatch takes bfloat16 or float32 tokens, got {x_TD.dtype}")

    def _observe(self, leg: str, rows: torch.Tensor, row_source: torch.Tensor | None = None) -> None:
        """Report an MXFP8 leg's rows to the numerics telemetry (``mxfp8_ep.numerics``; nothing
        happens unless it is armed). ``row_source`` (expert-major rows): the rows with data are
        those from a rank (>= 0), not padding or unused rows."""
        a2a = self.config.a2a
        if numerics.PROBE.armed and a2a.wire_format(leg) is WireFormat.MXFP8:
            valid = None if row_source is None else row_source >= 0
            numerics.PROBE.observe(self, leg, rows, a2a.scale_rounding, valid)
