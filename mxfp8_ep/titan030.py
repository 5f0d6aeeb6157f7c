"""torchtitan 0.3.0 adapter: our token dispatcher as 0.3.0 ``TokenDispatcher`` classes, and one
``@override`` that puts it on every MoE layer of a model:

    --override.imports 'mxfp8_ep.titan030.token_dispatcher={"preset": "mxfp8", "transport": "auto"}'

Two dispatcher classes, one per 0.3.0 parent whose expert-side layout they keep:

* ``A2ATokenDispatcher`` (an ``AllToAllTokenDispatcher``): unpadded expert segments;
* ``PaddedA2ATokenDispatcher`` (a ``TorchAOTokenDispatcher``, which 0.3.0's MXFP8 / FP8
  grouped-GEMM converters swap in): every local expert's segment padded to ``pad_multiple``.

Both take ``a2a`` (``mxfp8_ep.config.A2AConfig``: each leg's wire format, scale rounding,
kernel and transport). The transport is resolved once the EP mesh is known (``wire_meshes``),
and each transport takes the path it takes under torchtitan 0.2.2 (``mxfp8_ep.titan022``):

* ``nccl`` with every leg bf16: 0.3.0's own dispatch / combine (local reorder, permute, score +
  scatter-add), the parent class bit for bit; its two token exchanges go through
  ``mxfp8_ep.exchange.all_to_all.all_to_all_v``, which counts their bytes (``wire_stats``).
* ``nccl`` with a quantized leg: ``mxfp8_ep.dispatcher.FusedNcclTokenDispatcher`` (quantizing
  fused into the push of each leg's rows, payload and scales in one all-to-all, dequantizing
  fused into the receiving pass and the fp32 top-k reduction).
* ``symm``: ``mxfp8_ep.dispatcher.SymmTokenDispatcher`` (sync-free peer-memory push on one
  node). Like 0.3.0's MinimalAsyncEP it hands the experts a fixed-capacity buffer whose rows past
  the last expert segment are unused; it reduces each token's top-k outputs in fp32.
* ``auto``: symm on one node with CUDA and >= 2 EP ranks, nccl otherwise.

Where the transport may be symm at an elastic capacity (``A2AConfig.capacity_factor``), the
override also makes torchtitan's ``Trainer`` run a step again when a dispatch overflowed its
capacity (``mxfp8_ep.elastic.install_replays``): one device-to-host copy per step.

The override also swaps 0.3.0's ``GroupedExperts`` for ``ValidRowGroupedExperts``: the same
math (bf16-identical), but its elementwise work -- the SwiGLU and the sum of the two
input-gradient GEMMs -- covers only the rows inside the expert offsets
(``mxfp8_ep.kernels.expert_kernels``), not the whole static-capacity buffer symm hands over.
Reading only those rows, they let symm keep what the experts and combine save for the backward
at the routed rows, in the activation pool (``mxfp8_ep.pool.activation_pool``), as under 0.2.2.

Importing this module imports torchtitan 0.3.0; nothing else in ``mxfp8_ep`` does, so the
library and its torchtitan 0.2.2 integration work unchanged where 0.2.2 is installed.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field, fields
from importlib.metadata import PackageNotFoundError, version

import torch

from mxfp8_ep.pool import activation_pool
from mxfp8_ep.exchange.all_to_all import all_to_all_v
from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher, resolve_transport
from mxfp8_ep.elastic import install_replays
from mxfp8_ep.transport import Transport

try:
    from torchtitan.config.override import derive, override
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.common.token_dispatcher import (
        AllToAllTokenDispatcher,
        LocalTokenDispatcher,
        TorchAOTokenDispatcher,
    )
    from torchtitan.protocols.model import BaseModel
except ImportError as e:  # torchtitan 0.2.2 (or none): no token-dispatcher seam
    try:
        found = f"torchtitan {version('torchtitan')}"
    except PackageNotFoundError:
        found = "no torchtitan"
    raise ImportError(
        f"mxfp8_ep.titan030 adapts the dispatcher to torchtitan 0.3.0's token dispatchers, but "
        f"this environment has {found} ({e}). Install the 0.3.0 stack with "
        f"`bash scripts/install.sh --torchtitan 0.3.0` (beside 0.2.2, in the venv .venv-titan030: "
        f"`bash scripts/setup_titan030.sh`); with torchtitan 0.2.2 use "
        f"mxfp8_ep.install_expert_parallel instead."
    ) from e

NO_EP_MESSAGE = (
    "mxfp8_ep's token dispatcher runs the expert-parallel exchange and needs expert parallelism: "
    "set --parallelism.expert_parallel_degree > 1, or drop the mxfp8_ep.titan030.token_dispatcher override"
)


class _ExchangeLegs:
    """What both dispatcher classes add to their 0.3.0 parent: our dispatcher for the transport
    ``a2a`` resolves to, except nccl with every leg bf16, which stays the parent's own path
    (its exchanges counted in ``wire_stats``). Put before the parent in the bases."""

    # Our dispatcher pads each local expert's segment to this (PaddedA2A: pad_multiple).
    segment_pad_multiple = 1

    def __init__(self, config):
        super().__init__(config)
        self.a2a: A2AConfig = config.a2a
        self.max_tokens_per_rank: int | None = config.max_tokens_per_rank
        self.transport: Transport | None = None  # resolved in wire_meshes
        self._ours = None  # our dispatcher, unless the parent's path serves (nccl, bf16 legs)
        self._pooled = None  # (metadata, activation pool hooks) of the layer between its experts and combine

    @property
    def library_dispatcher(self):
        """The ``mxfp8_ep.dispatcher.TokenDispatcher`` this layer's exchange runs on (it reports
        the numerics telemetry); None on the parent's path (nccl, every leg bf16) or before
        ``wire_meshes``."""
        return self._ours

    def wire_meshes(self, *, ep_mesh) -> None:
        if ep_mesh is None:
            raise ValueError(NO_EP_MESSAGE)
        super().wire_meshes(ep_mesh=ep_mesh)
        group = ep_mesh.get_group()
        device = torch.device(ep_mesh.device_type)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self.transport = resolve_transport(self.a2a.transport, device, group)
        if self.transport is not Transport.NCCL or self.a2a.any_quantized:
            config = TokenDispatcher.Config(
                num_experts=self.num_experts, top_k=self.top_k, a2a=self.a2a,
                pad_multiple=self.segment_pad_multiple, max_tokens_per_rank=self.max_tokens_per_rank,
            )
            self._ours = config.build(group, device)  # with build's check that every rank agrees

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):  # noqa: N803
        if self.ep_mesh is None:  # EP=1 without TP: 0.3.0 never calls wire_meshes
            raise ValueError(NO_EP_MESSAGE)
        if self._ours is None:
            return super().dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
        activation_pool.compact_pending()  # the last MoE layer's kept tensors into the pool first
        routed, counts, metadata = self._ours.dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK,
                                                       num_local_tokens_per_expert_E)
        _LAST_DISPATCH.value = (self, weakref.ref(routed), counts, metadata)
        self._pooled = None
        return routed, counts, metadata

    def combine(self, routed_output_RD, metadata, x_TD):  # noqa: N803
        if self._ours is None:
            return super().combine(routed_output_RD, metadata, x_TD)
        pooled, self._pooled = self._pooled, None
        if pooled is None or pooled[0] is not metadata:
            return self._ours.combine(routed_output_RD, metadata)
        with pooled[1].saving(activation_pool.combine_keeps_expert_rows(metadata)):
            return self._ours.combine(routed_output_RD, metadata)

    # The parent's path (nccl, every leg bf16): its exchanges, with their bytes counted.

    def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):  # noqa: N803
        return all_to_all_v(routed_input_ND, output_splits, input_splits, pg, legs=("dispatch_fwd", "dispatch_bwd"))

    def _combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):  # noqa: N803
        return all_to_all_v(routed_output_RD, input_splits, output_splits, pg, legs=("combine_fwd", "combine_bwd"))


# This thread's last dispatch of ours: (its ``_ExchangeLegs``, the rows it handed the experts
# (weak), their counts, its metadata), until the experts that run on those rows take it.
_LAST_DISPATCH = threading.local()


def _pooled_experts(x_RD: torch.Tensor, experts):  # noqa: N803
    """The activation pool of the layer whose ``experts`` run on ``x_RD`` now
    (``activation_pool.pooled_layer``), when ``x_RD`` is what this thread's last dispatch of ours
    handed them (its ``_ExchangeLegs.combine`` then keeps its expert rows in it too); else hooks
    that do nothing."""
    last, _LAST_DISPATCH.value = getattr(_LAST_DISPATCH, "value", None), None
    if last is None or last[1]() is not x_RD:
        return activation_pool.NOT_POOLED
    legs, _, counts, metadata = last
    pooled = activation_pool.pooled_layer(legs._ours, metadata, counts, experts)
    legs._pooled = (metadata, pooled)
    return pooled


class A2ATokenDispatcher(_ExchangeLegs, AllToAllTokenDispatcher):
    """``AllToAllTokenDispatcher`` whose legs travel as ``a2a`` says (transport nccl or symm)."""

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        a2a: A2AConfig = field(default_factory=A2AConfig)
        # symm: receive buffers hold this many tokens per rank (None: the largest token count of
        # the first dispatch over the EP group).
        max_tokens_per_rank: int | None = None


class PaddedA2ATokenDispatcher(_ExchangeLegs, TorchAOTokenDispatcher):
    """``TorchAOTokenDispatcher`` (segments padded to ``pad_multiple`` for quantized grouped
    GEMMs) whose legs travel as ``a2a`` says (transport nccl or symm)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TorchAOTokenDispatcher.Config):
        a2a: A2AConfig = field(default_factory=A2AConfig)
        max_tokens_per_rank: int | None = None

    def __init__(self, config: Config):
        super().__init__(config)
        self.segment_pad_multiple = config.pad_multiple


class ValidRowGroupedExperts(GroupedExperts):
    """0.3.0's ``GroupedExperts`` with the SwiGLU and the input-gradient sum over the rows inside
    the expert offsets only (``mxfp8_ep.kernels.expert_kernels.grouped_swiglu_experts``), so that symm's
    activation pool may keep what they save at their routed rows (``mxfp8_ep.pool.activation_pool``),
    with combine's. A subclass that swaps the ``_grouped_mm`` seam (0.3.0's MXFP8 / FP8
    grouped-GEMM converters subclass the experts' class) runs the parent's forward, unpooled."""

    reads_valid_rows_only = True

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:  # noqa: N803
        if type(self)._grouped_mm is not GroupedExperts._grouped_mm:
            return super().forward(x_RD, num_tokens_per_expert_E)
        from mxfp8_ep.kernels.expert_kernels import grouped_swiglu_experts

        with _pooled_experts(x_RD, self).saving():
            return grouped_swiglu_experts(x_RD, self.w1_EFD, self.w2_EDF, self.w3_EFD, num_tokens_per_expert_E)


def valid_row_experts_config(cfg: GroupedExperts.Config) -> GroupedExperts.Config:
    """``ValidRowGroupedExperts``' config for 0.3.0's plain ``GroupedExperts`` config; any other
    experts config (a converter's subclass, another model's experts) unchanged."""
    if type(cfg) is not GroupedExperts.Config:
        return cfg
    return derive(cfg, ValidRowGroupedExperts.Config)


def replacement_config(cfg: LocalTokenDispatcher.Config, a2a: A2AConfig, max_tokens_per_rank: int | None = None):
    """Our dispatcher config for the 0.3.0 dispatcher config ``cfg``: padded where ``cfg`` pads
    (TorchAO, HybridEP with ``pad_multiple``), keeping its pad multiple and, unless given, its
    per-rank token capacity."""
    if max_tokens_per_rank is None:
        max_tokens_per_rank = getattr(cfg, "num_max_tokens_per_rank", None) or getattr(cfg, "max_tokens_per_rank", None)
    target = PaddedA2ATokenDispatcher if getattr(cfg, "pad_multiple", None) else A2ATokenDispatcher
    return derive(cfg, target.Config, a2a=a2a, max_tokens_per_rank=max_tokens_per_rank)


def a2a_from_kwargs(preset: str, **legs) -> A2AConfig:
    known = {f.name for f in fields(A2AConfig)}
    unknown = sorted(set(legs) - known)
    if unknown:
        raise ValueError(
            f"mxfp8_ep.titan030.token_dispatcher got unknown keys {unknown}; it takes preset, "
            f"max_tokens_per_rank and the A2AConfig fields {sorted(known)}"
        )
    return A2AConfig.preset(preset, **legs).check()


@override(
    target=BaseModel.Config,
    description="mxfp8_ep token dispatcher (bf16/MXFP8 legs, nccl/symm transport) on every MoE layer",
)
def token_dispatcher(model_cfg, *, preset: str = "mxfp8", max_tokens_per_rank: int | None = None, **a2a_fields):
    """Replace the token dispatcher config of every MoE layer of the model (MTP layers
    included) with ours, and its plain ``GroupedExperts`` with ``ValidRowGroupedExperts``.
    kwargs: ``preset`` (bf16 | mxfp8 | mxfp8_all), any ``A2AConfig`` field (``transport``,
    ``dispatch_fwd``, ..., ``scale_rounding``, ``kernel``) and ``max_tokens_per_rank``. Raises if
    the model has no MoE layer."""
    a2a = a2a_from_kwargs(preset, **a2a_fields)
    claims = list(model_cfg.traverse(LocalTokenDispatcher.Config))
    if not claims:
        raise ValueError(
            f"the mxfp8_ep.titan030.token_dispatcher override found no MoE layer (no token "
            f"dispatcher config) in {type(model_cfg).__qualname__}; use it with a MoE model "
            f"such as deepseek_v3"
        )
    for _fqn, cfg, parent, attr in claims:
        _replace(parent, attr, replacement_config(cfg, a2a, max_tokens_per_rank))
    for _fqn, cfg, parent, attr in list(model_cfg.traverse(GroupedExperts.Config)):
        _replace(parent, attr, valid_row_experts_config(cfg))
    if Transport(a2a.transport) is not Transport.NCCL and a2a.capacity_factor is not None:
        # symm's elastic capacity: torchtitan's Trainer runs an overflowed step again.
        from torchtitan.trainer import Trainer

        install_replays(Trainer)
    return model_cfg


def _replace(parent, attr, new) -> None:
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
