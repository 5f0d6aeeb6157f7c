"""Transport ``nccl`` with every leg in bf16: torchtitan 0.2.2's ExpertParallel and MoE math
around ``all_to_all_v``, bit for bit (multi-node NCCL, and gloo). Its one host wait per layer
(the splits NCCL takes on the host) is ``HostCopy``'s, which the fused nccl transport shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol

from mxfp8_ep.exchange import routing
from mxfp8_ep.exchange.all_to_all import all_to_all_v
from mxfp8_ep.dispatcher import checks
from mxfp8_ep.dispatcher.base import TokenDispatcher, register_transport
from mxfp8_ep.transport import Transport


@dataclass(frozen=True)
class NcclDispatchMetadata:
    slot: torch.Tensor  # (N,) token * K + k of each expert-sorted row
    permuted: torch.Tensor  # (R,) row of the all-to-all output (or the zero row) per expert-major row
    input_splits: list[int]
    output_splits: list[int]
    topk_scores_TK: torch.Tensor  # noqa: N815


@register_transport(Transport.NCCL)
class NcclTokenDispatcher(TokenDispatcher):
    """All-to-all-v transport (multi-node NCCL, and gloo) for all-bf16 legs: torchtitan 0.2.2's
    ExpertParallel and MoE math around ``all_to_all_v``, bit for bit. A config with a
    quantized leg takes ``FusedNcclTokenDispatcher``."""

    @classmethod
    def serves(cls, config) -> bool:
        return not config.a2a.any_quantized

    def __init__(self, config, group):
        if not self.serves(config):
            raise ValueError(
                f"NcclTokenDispatcher carries unquantized legs; {config.a2a} has a quantized one: "
                f"FusedNcclTokenDispatcher carries it (TokenDispatcher.Config.build picks it)"
            )
        super().__init__(config, group)

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E):  # noqa: N803
        checked, fault = self._checked_routing(x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E)
        cfg, W, L = self.config, self.ep, self.num_local_experts
        counts = checked.counts
        with torch.no_grad():
            # Each rank's counts for a peer's experts go there with its fault word (checks).
            sent = torch.cat([counts.view(W, L), checked.fault.expand(W, 1)], dim=1)
            received = funcol.wait_tensor(funcol.all_to_all_single(sent.reshape(-1), None, None, self.group))
            received = received.view(W, L + 1)
            counts_recv, faults = received[:, :L].reshape(-1), received[:, L]
            # The one host wait of this transport (torchtitan makes the same one, as two syncs):
            # NCCL takes the splits on the host. One copy of both and of every rank's fault
            # word, waited for here: a rank whose input failed its checks fails every rank.
            splits = torch.stack([counts.view(W, L).sum(dim=1), counts_recv.view(W, L).sum(dim=1), faults])
            input_splits, output_splits, faults = HostCopy(splits).tolist()
            checks.raise_on_faults(faults, cfg.num_experts, own=fault and fault.error)
            slot = torch.argsort(checked.expert_ids, stable=True)
        routed_input = x_TD[slot // cfg.top_k]
        if cfg.score_before_experts:
            scores = topk_scores_TK.reshape(-1)[slot]
            routed_input = (routed_input.to(torch.float32) * scores.reshape(-1, 1)).to(x_TD.dtype)
        received = all_to_all_v(routed_input, output_splits, input_splits, self.group,
                                legs=("dispatch_fwd", "dispatch_bwd"))
        with torch.no_grad():
            counts_SL = counts_recv.view(W, L)  # noqa: N806
            align = cfg.pad_multiple
            num_rows = (received.shape[0] + L * align + align - 1) // align * align
            rows = routing.expert_major_rows(counts_SL, align, num_rows)
            permuted = routing.rank_major_index(rows, counts_SL)
            permuted = torch.where(permuted < 0, received.shape[0], permuted)
        # Padding rows read an appended zero row (torchtitan's _permute).
        routed_input = torch.vstack((received, received.new_zeros((1, received.shape[1]))))[permuted]
        meta = NcclDispatchMetadata(
            slot=slot, permuted=permuted, input_splits=input_splits,
            output_splits=output_splits, topk_scores_TK=topk_scores_TK,
        )
        return routed_input, rows.tokens_per_local_expert, meta

    def combine(self, routed_output, metadata: NcclDispatchMetadata):
        cfg = self.config
        num_received = sum(metadata.output_splits)
        unpermuted = routed_output.new_empty((num_received + 1, routed_output.shape[1]))
        unpermuted[metadata.permuted] = routed_output
        returned = all_to_all_v(
            unpermuted[:-1], metadata.input_splits, metadata.output_splits, self.group,
            legs=("combine_fwd", "combine_bwd"),
        )
        scores = metadata.topk_scores_TK
        num_tokens, dim = scores.shape[0], routed_output.shape[1]
        by_slot = returned.new_zeros((num_tokens * cfg.top_k, dim))
        by_slot[metadata.slot] = returned
        by_slot = by_slot.reshape(num_tokens, cfg.top_k, dim)
        if cfg.score_before_experts:
            return by_slot.sum(dim=1)
        return torch.bmm(scores.reshape(-1, 1, cfg.top_k), by_slot.float()).to(routed_output.dtype).squeeze(1)




class HostCopy:
    """A small device tensor's values on the host: the copy is queued at construction (CUDA:
    into pinned memory, on the current stream, with an event behind it) and ``tolist`` waits
    for that copy alone, not for the work queued after it. The nccl transports' one host wait
    per layer; ``torch.cuda.set_sync_debug_mode`` does not flag an event wait, so the GPU tests
    count these waits (tests/test_dispatcher_gpu.py)."""

    def __init__(self, value: torch.Tensor):
        if value.is_cuda:
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = value, None

    def tolist(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
