"""The symm transport on real GPUs (one process per GPU, NCCL + CUDA symmetric memory): the
compiled Triton kernels against their torch twins, and no host sync in forward or backward.
The nccl transport with MXFP8 legs runs the same kernels around NCCL all-to-alls: against its
twins and against symm.
The CPU suite (tests/test_dispatcher.py, tests/test_symm_kernels.py) runs the same kernels
under the Triton interpreter over shared-memory peers; these need 2 GPUs, so CI (CPU) skips
them and the GPU machine runs them (benchmarks/gpu_evidence.sh)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks

WORLD = 2
needs_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs (symmetric memory); CPU runs use tests/test_dispatcher.py"
)


def _routing(rank, tokens, experts, top_k, dim, device, skew: bool):
    g = torch.Generator(device=device).manual_seed(10 + rank)
    x = torch.randn((tokens, dim), generator=g, device=device).bfloat16()
    if skew:  # everything to rank 0's experts
        logits = torch.randn((tokens, experts // WORLD), generator=g, device=device)
        scores, ids = logits.sigmoid().topk(top_k, dim=-1)
    else:
        scores, ids = torch.randn((tokens, experts), generator=g, device=device).sigmoid().topk(top_k, dim=-1)
    counts = torch.zeros(experts, dtype=torch.int64, device=device).scatter_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.int64, device=device))
    return x, scores, ids, counts


def _run(dispatcher, x, scores, ids, counts, sync_check: bool):
    x = x.clone().requires_grad_()
    scores = scores.clone().requires_grad_()
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        routed, per_expert, meta = dispatcher.dispatch(x, scores, ids, counts)
        # A stand-in expert: scale each row (keeps the routed layout visible in the output).
        y = routed * 1.5
        out = dispatcher.combine(y, meta)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return routed.detach(), per_expert, out.detach(), x.grad, scores.grad


def _check(rank, world):
    from mxfp8_ep.config import A2AConfig
    from mxfp8_ep.dispatcher import SymmTokenDispatcher, TokenDispatcher

    device = torch.device("cuda", rank)
    tokens, experts, dim = 512, 16, 512
    for preset in ("bf16", "mxfp8", "mxfp8_all"):
        for top_k, sbe, skew in ((4, False, False), (1, True, False), (2, False, True)):
            x, scores, ids, counts = _routing(rank, tokens, experts, top_k, dim, device, skew)
            results = {}
            for kernel in ("torch", "triton"):
                cfg = TokenDispatcher.Config(
                    num_experts=experts, top_k=top_k, score_before_experts=sbe, max_tokens_per_rank=tokens,
                    a2a=A2AConfig.preset(preset, kernel=kernel, transport="symm"),
                )
                disp = cfg.build(dist.group.WORLD, device)
                assert isinstance(disp, SymmTokenDispatcher)
                _run(disp, x, scores, ids, counts, sync_check=False)  # allocates the peer buffers
                results[kernel] = _run(disp, x, scores, ids, counts, sync_check=(kernel == "triton"))
            ref, got = results["torch"], results["triton"]
            case = f"{preset} top_k={top_k} score_before={sbe} skew={skew}"
            valid = int(ref[1].sum())  # rows past the padded experts are never read
            assert torch.equal(got[0][:valid].view(torch.int16), ref[0][:valid].view(torch.int16)), case
            assert torch.equal(got[2].view(torch.int16), ref[2].view(torch.int16)), case
            assert torch.equal(got[3].view(torch.int16), ref[3].view(torch.int16)), case
            # Score gradients are fp32 dot products: tl.sum and torch.sum add in different orders.
            torch.testing.assert_close(got[4], ref[4], rtol=1e-5, atol=1e-5, msg=case)


@needs_gpus
def test_symm_triton_equals_torch_twin_and_never_syncs():
    run_on_ranks(WORLD, _check, backend="nccl")


def _check_fused_nccl(rank, world):
    from mxfp8_ep.config import A2AConfig
    from mxfp8_ep.dispatcher import FusedNcclTokenDispatcher, SymmTokenDispatcher, TokenDispatcher

    device = torch.device("cuda", rank)
    tokens, experts, dim = 512, 16, 512
    for preset in ("mxfp8", "mxfp8_all"):
        for top_k, sbe, skew in ((4, False, False), (1, True, False), (2, False, True)):
            x, scores, ids, counts = _routing(rank, tokens, experts, top_k, dim, device, skew)
            results = {}
            for transport, kernel, cls in (("nccl", "torch", FusedNcclTokenDispatcher),
                                           ("nccl", "triton", FusedNcclTokenDispatcher),
                                           ("symm", "triton", SymmTokenDispatcher)):
                cfg = TokenDispatcher.Config(
                    num_experts=experts, top_k=top_k, score_before_experts=sbe, max_tokens_per_rank=tokens,
                    a2a=A2AConfig.preset(preset, kernel=kernel, transport=transport),
                )
                disp = cfg.build(dist.group.WORLD, device)
                assert type(disp) is cls
                # nccl makes its one device-to-host sync per layer (the splits): no sync check.
                results[transport, kernel] = _run(disp, x, scores, ids, counts, sync_check=False)
            got = results["nccl", "triton"]
            case = f"{preset} top_k={top_k} score_before={sbe} skew={skew}"
            valid = int(got[1].sum())
            for other in (results["nccl", "torch"], results["symm", "triton"]):
                assert torch.equal(got[1], other[1]), case
                assert torch.equal(got[0][:valid].view(torch.int16), other[0][:valid].view(torch.int16)), case
                assert torch.equal(got[2].view(torch.int16), other[2].view(torch.int16)), case
                assert torch.equal(got[3].view(torch.int16), other[3].view(torch.int16)), case
            # Same kernels as symm: the score gradients too; against the twin, up to sum order.
            assert torch.equal(got[4], results["symm", "triton"][4]), case
            torch.testing.assert_close(got[4], results["nccl", "torch"][4], rtol=1e-5, atol=1e-5, msg=case)


@needs_gpus
def test_fused_nccl_equals_its_twin_and_symm():
    """The nccl transport with MXFP8 legs (FusedNcclTokenDispatcher) on NCCL: compiled Triton
    kernels equal the torch twins, and equal the symm transport bit for bit (same kernels, same
    layout; only the exchange differs)."""
    run_on_ranks(WORLD, _check_fused_nccl, backend="nccl")
