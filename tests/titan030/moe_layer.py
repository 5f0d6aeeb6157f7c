"""torchtitan 0.3.0's MoE layer under expert parallelism on forked gloo ranks, one dispatcher
config per arm, everything else equal: the same full weights on every rank (each rank keeps its
experts' slice, as EP shards them), the same tokens and output gradient per rank.

``run_arm`` trains the layer a few SGD steps and returns, per step, the output, the input
gradient and every parameter gradient, plus what crossed the EP boundary as the experts saw it:
their input rows and tokens per local expert (dispatch) and the gradient of their output rows
(the combine backward).

CPU stand-ins, both test-only and both outside the code under test:
* 0.3.0's reference ``AllToAllTokenDispatcher`` runs under the ``partial_dtensor`` SPMD backend
  (functional all-to-all): under the default ``spmd_types`` backend it sends uneven chunks
  through ``dist.all_to_all``, which gloo rejects ("ProcessGroupGloo::alltoall: invalid tensor
  size"). Our dispatchers run under ``spmd_types``, the trainer's default.
* ``TorchAOTokenDispatcher``'s ``permute_and_pad`` runs torchao's Triton index kernel, which
  fails in Triton's CPU interpreter; ``cpu_permute_indices`` routes CPU tensors to torchao's own
  CPU twin (``use_cpu=True``) for the reference and our padded nccl arm alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint
from torchtitan.distributed.spmd_types import set_spmd_meshes
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.config_utils import (
    make_ffn_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, TorchAOTokenDispatcher

from mxfp8_ep.elastic import ReplayGuard

EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


@dataclass(frozen=True)
class MoESpec:
    dim: int = 64  # a multiple of 32: MXFP8 legs
    hidden: int = 32
    num_experts: int = 6  # divisible by 2 and 3 ranks
    top_k: int = 3
    batch: int = 2
    seq: int = 24
    steps: int = 3
    lr: float = 0.5
    # Routing never picks the last expert (its router bias): one rank owns an expert with no
    # tokens, whose segment is empty (AllToAll) or padding only (ours).
    starved_expert_bias: float = -100.0


def setup_rank(world: int):
    """One intra-op thread per rank, the EP mesh registered as 0.3.0's trainer does for the
    ``spmd_types`` backend, torchao's CPU index twin."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
    cpu_permute_indices()
    return mesh


def cpu_permute_indices() -> None:
    from torchao.prototype.moe_training.ep import permute

    original = permute.generate_permute_indices
    if getattr(original, "cpu_twin", False):
        return

    def generate_permute_indices(tokens_per_expert_group, *args, **kwargs):
        kwargs["use_cpu"] = kwargs.get("use_cpu", False) or tokens_per_expert_group.device.type == "cpu"
        return original(tokens_per_expert_group, *args, **kwargs)

    generate_permute_indices.cpu_twin = True
    permute.generate_permute_indices = generate_permute_indices


def reference_config(spec: MoESpec, pad_multiple: int | None):
    if pad_multiple is None:
        return AllToAllTokenDispatcher.Config(num_experts=spec.num_experts, top_k=spec.top_k)
    return TorchAOTokenDispatcher.Config(num_experts=spec.num_experts, top_k=spec.top_k, pad_multiple=pad_multiple)


def moe_config(spec: MoESpec, dispatcher_config):
    init = {"weight": partial(nn.init.normal_, std=0.02)}
    routed = make_routed_experts_config(
        dim=spec.dim, hidden_dim=spec.hidden, num_experts=spec.num_experts, top_k=spec.top_k,
        param_init={}, comm_backend="standard",
    )
    routed.token_dispatcher = dispatcher_config
    if type(dispatcher_config).__module__.startswith("mxfp8_ep"):
        # Our arms run with the experts the override installs; the references with 0.3.0's.
        from mxfp8_ep.titan030 import valid_row_experts_config

        routed.inner_experts = valid_row_experts_config(routed.inner_experts)
    return make_moe_config(
        num_experts=spec.num_experts,
        router=make_router_config(dim=spec.dim, num_experts=spec.num_experts, gate_param_init=init,
                                  top_k=spec.top_k, score_func="softmax"),
        routed_experts=routed,
        shared_experts=make_ffn_config(dim=spec.dim, hidden_dim=spec.hidden, w1_param_init=init, w2w3_param_init=init),
    )


def build_ep_moe(spec: MoESpec, dispatcher_config, mesh, seed: int = 1234):
    moe = moe_config(spec, dispatcher_config).build()
    g = torch.Generator().manual_seed(seed)  # the same full weights on every rank, in every arm
    with torch.no_grad():
        for _, p in sorted(moe.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        moe.expert_bias_E.zero_()[-1] = spec.starved_expert_bias
    moe = moe.to(torch.bfloat16)
    experts = moe.routed_experts.inner_experts
    local = spec.num_experts // mesh.size()
    lo = mesh.get_local_rank() * local
    for name in EXPERT_WEIGHTS:
        setattr(experts, name, nn.Parameter(getattr(experts, name).detach()[lo : lo + local].clone()))
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return moe


def rank_inputs(spec: MoESpec, rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    shape = (spec.batch, spec.seq, spec.dim)
    return torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()


def run_arm(spec: MoESpec, dispatcher_config, mesh, backend: str = "spmd_types", checkpointed: bool = False,
            dispatchers: list | None = None, replay: bool = False, layers: int = 1) -> list[dict]:
    """``spec.steps`` SGD steps of the EP MoE layer; per step its tensors by name.
    ``checkpointed``: under activation checkpointing (non-reentrant; the backward recomputes
    the forward, exchanges included). ``dispatchers``: gets the layer's token dispatcher and,
    for ours, the library dispatcher it delegates to (``_ours``), once the layer has run.
    ``replay``: each step's forward and backward run through ``mxfp8_ep.elastic.ReplayGuard``
    (again after a symm capacity overflow); the step's tensors then include the replays so far
    (``replays``) and the layer's load-balancing counts (``tokens_per_expert_E``). ``layers``:
    that many such layers one after the other (each its own weights), the first one's tensors
    and counts seen."""
    set_spmd_backend(backend)
    moes = [build_ep_moe(spec, dispatcher_config, mesh, seed=1234 + i) for i in range(layers)]
    # Between stacked layers an RMS norm keeps the activations of order one (bf16, SGD steps).
    moe = moes[0] if layers == 1 else nn.Sequential(*[m for layer in moes for m in (
        layer, nn.RMSNorm(spec.dim, elementwise_affine=False))][:-1])
    seen: dict = {}

    def on_experts(_module, args, output):
        seen["expert_input"], seen["tokens_per_expert"] = args[0].detach().clone(), args[1].detach().clone()
        output.register_hook(lambda grad: seen.__setitem__("expert_output_grad", grad.detach().clone()))

    moes[0].routed_experts.inner_experts.register_forward_hook(on_experts)
    steps = []
    guard = ReplayGuard(moe.modules()) if replay else None
    for step in range(spec.steps):
        x_in, grad_out = rank_inputs(spec, mesh.get_local_rank(), step)
        for _ in guard.attempts() if guard is not None else (0,):
            moe.zero_grad(set_to_none=True)
            x = x_in.clone().requires_grad_(True)
            out = checkpoint(moe, x, use_reentrant=False) if checkpointed else moe(x)
            out.backward(grad_out)
        tensors = {"out": out.detach(), "x.grad": x.grad}
        tensors.update({f"{name}.grad": p.grad.clone() for name, p in moe.named_parameters()})
        if guard is not None:
            tensors.update(replays=guard.replays, tokens_per_expert_E=moes[0].tokens_per_expert_E.clone())
        steps.append({**tensors, **seen})
        with torch.no_grad():
            for p in moe.parameters():
                p -= spec.lr * p.grad
                p.grad = None
    if dispatchers is not None:
        token_dispatcher = moes[0].routed_experts.token_dispatcher
        dispatchers.extend(d for d in (token_dispatcher, getattr(token_dispatcher, "_ours", None)) if d is not None)
    return steps


def segments(rows: torch.Tensor, tokens_per_expert: torch.Tensor, counts: torch.Tensor):
    """Each local expert's first ``counts[e]`` rows of its segment (segments sized by
    ``tokens_per_expert``), and the rest of the segments (padding)."""
    ends = torch.cumsum(tokens_per_expert, 0).tolist()
    starts = [0, *ends[:-1]]
    kept = [rows[s : s + c] for s, c in zip(starts, counts.tolist())]
    padding = [rows[s + c : e] for s, c, e in zip(starts, counts.tolist(), ends)]
    return torch.cat(kept), torch.cat(padding)
