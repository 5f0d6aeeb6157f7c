"""torchtitan 0.2.2 integration: every EP MoE layer of Llama4 / DeepSeek-V3 (and Qwen3) runs
through our ``TokenDispatcher``.

torchtitan 0.2.2 has no dispatcher seam: ``MoE.forward`` gathers the routed rows itself and
``ExpertParallel`` hooks the all-to-alls around ``GroupedExperts`` (built by module-global name
in ``torchtitan.models.llama4.infra.parallelize.apply_moe_ep_tp``, which DeepSeek-V3 and Qwen3
call too). ``install_expert_parallel`` therefore makes two swaps, both undone by
``uninstall_expert_parallel``:

* ``ExpertParallel`` -> ``DispatcherExpertParallel``: shards the expert weights over the EP
  mesh exactly as torchtitan does, installs no hooks, and records the EP group and the
  ``A2AConfig`` on the experts module;
* ``MoE.forward``: a MoE whose experts carry that record runs router -> ``dispatch`` ->
  experts -> ``combine`` (the DeepEP MoE of 0.2.2 has the same shape); every other MoE runs
  torchtitan's forward unchanged. ``overlap_shared_experts`` (off by default) runs the shared
  experts on a CUDA side stream launched before ``dispatch``, so that their GEMMs could overlap
  the exchange kernels (autograd runs their backward on that stream too); off because the push
  kernels occupy every SM while they run, leaving the GEMMs nothing to overlap.

Without EP torchtitan parallelizes no experts, and its own MoE path never quantizes a row. For
``A2AConfig.quantize_local_rows`` (every row quantized, as if it crossed), a recipe calls
``dispatch_without_expert_parallel`` after torchtitan's parallelize: every MoE layer then runs
the dispatcher over a one-rank group (transport nccl).

The symm transport's elastic capacity: ``mxfp8_ep.elastic.ReplayOverflowedSteps`` is a mixin
for torchtitan's ``Trainer`` that runs a step again when a dispatch overflowed its capacity.

``uninstall_expert_parallel`` restores ``ExpertParallel``; ``MoE.forward`` stays patched, so
models parallelized while the dispatcher was installed keep using it (for any other MoE the
patched forward is torchtitan's).

Expert-tensor-parallel (EP with ETP > 1), DeepEP and DualPipe keep torchtitan's own classes.

torch.compile: torchtitan 0.2.2 compiles the router and shared experts but not the routed
experts with their dispatch/combine (torchtitan issue #1940); the dispatcher runs eager there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_module
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.moe import moe as titan_moe

from mxfp8_ep.pool import activation_pool
from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher, resolve_transport
from mxfp8_ep.transport import Transport
from mxfp8_ep.kernels.expert_kernels import grouped_swiglu_experts
from mxfp8_ep.kernels.launch_shapes import KernelShapes

_ORIGINAL: dict = {}


@dataclass(frozen=True)
class ExpertParallelPlan:
    """What ``DispatcherExpertParallel`` leaves on an experts module for ``MoE.forward``."""

    group: dist.ProcessGroup
    a2a: A2AConfig
    max_tokens_per_rank: int | None
    overlap_shared_experts: bool = False
    launch_shapes: dict[str, KernelShapes] | None = None  # TokenDispatcher.Config.launch_shapes


class CapacityGroupedExperts(titan_moe.GroupedExperts):
    """torchtitan's GroupedExperts for the symm transport's static-capacity input: on the
    grouped-GEMM path the elementwise work covers only the rows inside the expert offsets
    (``mxfp8_ep.kernels.expert_kernels``). Same math as torchtitan's; bf16 results are identical."""

    @property
    def reads_valid_rows_only(self) -> bool:
        """The grouped-GEMM path reads only the rows inside the expert offsets (the activation
        pool's premise: ``mxfp8_ep.pool.activation_pool.reads_valid_rows_only``)."""
        return bool(self.use_grouped_mm)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if not self.use_grouped_mm:
            return super().forward(x, num_tokens_per_expert)
        return grouped_swiglu_experts(x, self.w1, self.w2, self.w3, num_tokens_per_expert)


class DispatcherExpertParallel(ExpertParallel):
    """torchtitan's ExpertParallel weight sharding; dispatch and combine are the MoE's job."""

    default_a2a: A2AConfig = A2AConfig()
    default_max_tokens_per_rank: int | None = None
    default_overlap_shared_experts: bool = False

    def __init__(
        self,
        a2a: A2AConfig | None = None,
        max_tokens_per_rank: int | None = None,
        overlap_shared_experts: bool | None = None,
        launch_shapes: dict[str, KernelShapes] | None = None,
    ):
        super().__init__()
        self.a2a = (a2a if a2a is not None else self.default_a2a).check()
        self.max_tokens_per_rank = max_tokens_per_rank or self.default_max_tokens_per_rank
        self.overlap_shared_experts = (
            self.default_overlap_shared_experts if overlap_shared_experts is None else overlap_shared_experts
        )
        self.launch_shapes = launch_shapes

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        module.expert_parallel_plan = ExpertParallelPlan(
            group, self.a2a, self.max_tokens_per_rank, self.overlap_shared_experts, self.launch_shapes
        )
        transport = resolve_transport(self.a2a.transport, torch.device(device_mesh.device_type), group)
        if transport is Transport.SYMM and type(module) is titan_moe.GroupedExperts:
            module.__class__ = CapacityGroupedExperts
        return distribute_module(module, device_mesh, partition_fn=self._partition_fn)


def token_dispatcher_for(moe: nn.Module, device: torch.device) -> TokenDispatcher | None:
    """The dispatcher of a MoE whose experts ``DispatcherExpertParallel`` sharded (built at the
    first forward, when the device is known), or None."""
    plan = getattr(moe.experts, "expert_parallel_plan", None)
    if plan is None:
        return None
    dispatcher = getattr(moe, "token_dispatcher", None)
    if dispatcher is None:
        from torchtitan.models.moe.utils import TOKEN_GROUP_ALIGN_SIZE_M

        config = TokenDispatcher.Config(
            num_experts=moe.experts.num_experts,
            top_k=moe.router.top_k,
            a2a=plan.a2a,
            score_before_experts=moe.score_before_experts,
            pad_multiple=TOKEN_GROUP_ALIGN_SIZE_M,
            max_tokens_per_rank=plan.max_tokens_per_rank,
            launch_shapes=plan.launch_shapes,
        )
        dispatcher = config.build(plan.group, device)
        moe.token_dispatcher = dispatcher
    return dispatcher


def dispatcher_moe_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``MoE.forward`` for layers under ``DispatcherExpertParallel``; torchtitan's own forward for
    every other MoE."""
    dispatcher = token_dispatcher_for(self, x.device)
    if dispatcher is None:
        return _ORIGINAL["MoE.forward"](self, x)
    bs, slen, dim = x.shape
    x = x.view(-1, dim)
    activation_pool.compact_pending()  # the last MoE layer's kept tensors into the pool first
    top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
    with torch.no_grad():
        self.tokens_per_expert.add_(num_tokens_per_expert)
    overlap = self.shared_experts is not None and x.is_cuda and self.experts.expert_parallel_plan.overlap_shared_experts
    shared = _SharedExperts.start(self.shared_experts, x) if overlap else None
    routed_input, tokens_per_local_expert, metadata = dispatcher.dispatch(
        x, top_scores, selected_experts_indices, num_tokens_per_expert
    )
    pooled = activation_pool.pooled_layer(dispatcher, metadata, tokens_per_local_expert, self.experts)
    with pooled.saving():
        routed_output = self.experts(routed_input, tokens_per_local_expert)
    if shared is not None:
        out = shared.result()
    else:
        # torchtitan's order (its autograd then adds x's gradients in the same order: bit for bit)
        out = self.shared_experts(x) if self.shared_experts is not None else None
    with pooled.saving(activation_pool.combine_keeps_expert_rows(metadata)):
        out_experts = dispatcher.combine(routed_output, metadata)
    if out is None:
        return out_experts.reshape(bs, slen, dim)
    return (out + out_experts).reshape(bs, slen, dim)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@dataclass
class _SharedExperts:
    """The shared experts' output, computed on a CUDA side stream (``overlap_shared_experts``).
    Started before dispatch, so autograd adds ``x``'s gradients in another order than
    torchtitan's (bf16: the input gradient may differ in the last bit)."""

    out: torch.Tensor
    stream: torch.cuda.Stream

    @classmethod
    def start(cls, shared_experts: nn.Module, x: torch.Tensor) -> "_SharedExperts":
        main = torch.cuda.current_stream(x.device)
        side = _SIDE_STREAMS.get(x.device)
        if side is None:
            side = _SIDE_STREAMS[x.device] = torch.cuda.Stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = shared_experts(x)
        # x was made on the main stream and is read on the side one (now, and by autograd later).
        x.record_stream(side)
        return cls(out, side)

    def result(self) -> torch.Tensor:
        main = torch.cuda.current_stream(self.out.device)
        main.wait_stream(self.stream)
        self.out.record_stream(main)
        return self.out


def install_expert_parallel(
    a2a: A2AConfig, max_tokens_per_rank: int | None = None, overlap_shared_experts: bool = False
) -> None:
    """Make torchtitan's Llama4 / DeepSeek-V3 parallelization run every EP MoE layer through
    our dispatcher with ``a2a`` (call before the model is parallelized)."""
    import torchtitan.models.llama4.infra.parallelize as llama4_parallelize

    _ORIGINAL.setdefault("ExpertParallel", llama4_parallelize.ExpertParallel)
    _ORIGINAL.setdefault("MoE.forward", titan_moe.MoE.forward)
    bound = type(
        "DispatcherExpertParallel",
        (DispatcherExpertParallel,),
        {
            "default_a2a": a2a.check(),
            "default_max_tokens_per_rank": max_tokens_per_rank,
            "default_overlap_shared_experts": overlap_shared_experts,
        },
    )
    llama4_parallelize.ExpertParallel = bound
    titan_moe.MoE.forward = dispatcher_moe_forward


_ONE_RANK_GROUP: list[tuple[dist.ProcessGroup, dist.ProcessGroup]] = []  # (default group, this rank's own)


def one_rank_group() -> dist.ProcessGroup:
    """A process group of this rank alone: the default group when it has one rank, else one of
    ``new_subgroups(1)``, made once per default group (a collective: every rank calls it at the
    same point)."""
    world = dist.group.WORLD
    if not _ONE_RANK_GROUP or _ONE_RANK_GROUP[0][0] is not world:
        own = world if dist.get_world_size() == 1 else dist.new_subgroups(group_size=1)[0]
        _ONE_RANK_GROUP[:] = [(world, own)]
    return _ONE_RANK_GROUP[0][1]


def dispatch_without_expert_parallel(model: nn.Module, a2a: A2AConfig, overlap_shared_experts: bool = False) -> int:
    """Run every MoE layer of a model that torchtitan parallelized without EP (and without TP)
    through the dispatcher over a one-rank group (transport nccl: every row stays on its rank),
    for ``a2a.quantize_local_rows``: each MXFP8 leg then quantizes every row, as if every row
    crossed. The experts stay whole. Call after torchtitan's parallelize (which leaves such a
    model's experts to torchtitan's own MoE path); returns how many layers it routed."""
    if not a2a.check().quantize_local_rows:
        raise ValueError("dispatch_without_expert_parallel is for a2a.quantize_local_rows=True: "
                         "without it no row of a one-rank exchange is quantized (torchtitan's own "
                         "MoE path computes that)")
    _ORIGINAL.setdefault("MoE.forward", titan_moe.MoE.forward)
    titan_moe.MoE.forward = dispatcher_moe_forward
    a2a = dataclasses.replace(a2a, transport=Transport.NCCL.value)  # peer memory has no peer to reach
    routed = 0
    for module in model.modules():
        if isinstance(module, titan_moe.MoE):
            if hasattr(module.experts, "expert_parallel_plan"):
                raise ValueError("dispatch_without_expert_parallel: the model's experts are expert-parallel already")
            module.experts.expert_parallel_plan = ExpertParallelPlan(one_rank_group(), a2a, None,
                                                                     overlap_shared_experts)
            routed += 1
    return routed


def uninstall_expert_parallel() -> None:
    """Models parallelized from now on get torchtitan's own ExpertParallel."""
    import torchtitan.models.llama4.infra.parallelize as llama4_parallelize

    if "ExpertParallel" in _ORIGINAL:
        llama4_parallelize.ExpertParallel = _ORIGINAL.pop("ExpertParallel")
