"""torchtitan 0.2.2 integration: an ExpertParallel whose token dispatch / combine all-to-alls
send each leg as bf16 or MXFP8, and the one function that makes torchtitan use it.

torchtitan builds ``ExpertParallel()`` by module-global name inside
``torchtitan.models.llama4.infra.parallelize.apply_moe_ep_tp``, which DeepSeek-V3 (and Qwen3)
parallelization call too; there is no registry, so ``install_expert_parallel`` rebinds that
name. Expert-tensor-parallel (EP with ETP > 1) and DeepEP keep torchtitan's own classes.

torch.compile: torchtitan 0.2.2 compiles the MoE's router and shared experts but not the
routed experts with their dispatch/combine hooks (torchtitan issue #1940), so these hooks run
eager there; the quantize / dequantize inside are ``torch.library`` custom ops and the
exchanges use functional collectives, so a compiled caller traces through them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.moe.utils import _permute, _unpermute

from mxfp8_ep.all_to_all import all_to_all_v
from mxfp8_ep.config import A2AConfig

_ORIGINAL = {}


class MXFP8ExpertParallel(ExpertParallel):
    """torchtitan's ExpertParallel with per-leg wire formats (``A2AConfig``)."""

    default_a2a: A2AConfig = A2AConfig()

    def __init__(self, a2a: A2AConfig | None = None):
        super().__init__()
        self.a2a = a2a if a2a is not None else self.default_a2a

    def _exchange_splits(self, num_tokens_per_expert: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        """Swap per-expert token counts; keep host split lists. The one device-to-host sync of
        EP (the receive counts) is the same one torchtitan's bf16 path makes."""
        ep_degree = device_mesh.shape[0]
        with torch.no_grad():
            counts_received = wait_tensor(
                all_to_all_single(num_tokens_per_expert, None, None, group=device_mesh.get_group())
            )
            input_splits = num_tokens_per_expert.view(ep_degree, -1).sum(dim=1).to("cpu", non_blocking=True)
            output_splits = counts_received.view(ep_degree, -1).sum(dim=1).to("cpu", non_blocking=False)
            self.input_splits = input_splits.tolist()
            self.output_splits = output_splits.tolist()
        return counts_received

    def _token_dispatch(self, mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh):
        routed_input, num_tokens_per_expert = inputs
        ep_degree = device_mesh.shape[0]
        num_local_experts = num_tokens_per_expert.shape[0] // ep_degree
        counts_received = self._exchange_splits(num_tokens_per_expert, device_mesh)
        a2a = self.a2a
        routed_input = all_to_all_v(
            routed_input, self.output_splits, self.input_splits, device_mesh.get_group(),
            forward_format=a2a.dispatch_fwd, backward_format=a2a.dispatch_bwd,
            rounding=a2a.scale_rounding, kernel=a2a.kernel, legs=("dispatch_fwd", "dispatch_bwd"),
        )
        # Same local reorder (and padding) as torchtitan: rank-major -> expert-major.
        self.input_shape, routed_input, self.permuted_indices, counts_received = _permute(
            routed_input, counts_received, ep_degree, num_local_experts
        )
        return routed_input, counts_received

    def _token_combine(self, mod: nn.Module, routed_output: torch.Tensor, device_mesh: DeviceMesh):
        routed_output = _unpermute(routed_output, self.input_shape, self.permuted_indices)
        a2a = self.a2a
        return all_to_all_v(
            routed_output, self.input_splits, self.output_splits, device_mesh.get_group(),
            forward_format=a2a.combine_fwd, backward_format=a2a.combine_bwd,
            rounding=a2a.scale_rounding, kernel=a2a.kernel, legs=("combine_fwd", "combine_bwd"),
        )


def install_expert_parallel(a2a: A2AConfig) -> None:
    """Make torchtitan's Llama4 / DeepSeek-V3 parallelization build ``MXFP8ExpertParallel``
    with ``a2a`` for every MoE layer (call before the model is parallelized)."""
    import torchtitan.models.llama4.infra.parallelize as llama4_parallelize

    _ORIGINAL.setdefault("ExpertParallel", llama4_parallelize.ExpertParallel)
    bound = type("MXFP8ExpertParallel", (MXFP8ExpertParallel,), {"default_a2a": a2a})
    llama4_parallelize.ExpertParallel = bound


def uninstall_expert_parallel() -> None:
    """Restore torchtitan's own ExpertParallel."""
    import torchtitan.models.llama4.infra.parallelize as llama4_parallelize

    if "ExpertParallel" in _ORIGINAL:
        llama4_parallelize.ExpertParallel = _ORIGINAL.pop("ExpertParallel")
