"""The symm transport on real GPUs (one process per GPU, NCCL + CUDA symmetric memory): the
compiled Triton kernels against their torch twins, and no host sync in forward or backward.
The nccl transport with MXFP8 legs runs the same kernels around NCCL all-to-alls: against its
twins and against symm.

The CPU suite's fuzz (tests/test_dispatcher.py: torchtitan's MoE layer against the same layer
under EP, both transports, every preset) runs here too, with more routings (``GPU_EXAMPLES``
hypothesis routings plus the hand-picked extremes), and the two-layer stale-buffer check on
real symmetric memory. Each EP layer's forward and backward runs under
``torch.cuda.set_sync_debug_mode("error")`` (every synchronizing CUDA operation raises), and its
explicit host waits, which that mode cannot see (``Event`` / ``Stream`` / device
``synchronize``), are counted: symm makes none; nccl makes exactly one per layer, the event
wait for the splits that NCCL's all-to-all takes on the host
(``mxfp8_ep.dispatcher.nccl.HostCopy``). Only the test's expert stand-ins (torchtitan's
for-loop experts and the row-wise twin) read their counts on the host, in their forward,
outside the check.
The CPU suite (tests/test_dispatcher*.py, tests/test_symm_kernels.py) runs the same kernels
under the Triton interpreter over shared-memory peers; these need 2 GPUs, so CI (CPU) skips
them and the GPU machine runs them (``benchmarks/run.sh tests_2gpu``, ``tests_1gpu``, ``tests_1gpu_fuzz``).

On a machine with one GPU the symm checks run with ranks sharing it (``[sharing_one_gpu]`` and
``*_sharing_one_gpu``,
``tests.shared_gpu``: a gloo group, peer buffers over CUDA IPC, a barrier over interprocess
CUDA events in place of symmetric memory's): the same compiled kernels and staging logic across real processes, at 2,
3 and 4 ranks, without NVLink. The nccl transport needs a GPU per rank and stays out of them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import SHARED_GPU, rank_device, run_on_ranks
from tests.moe_harness import symm_quantizes_partial_sums
from tests.round_trips import replayed

WORLD = 2
GPU_EXAMPLES = 200  # hypothesis routings of the fuzz on WORLD GPUs (CPU: 80 at 2 ranks, 200 over 2-4)
needs_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < WORLD,
    reason=f"needs {WORLD} CUDA GPUs (symmetric memory); CPU runs use tests/test_dispatcher*.py",
)
needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU; CPU runs use tests/test_dispatcher*.py")
# The symm checks that run both ways: NCCL and symmetric memory with a GPU per rank, or ranks
# sharing one GPU (module docstring).
GPU_BACKENDS = [pytest.param("nccl", marks=needs_gpus, id="nccl"),
                pytest.param(SHARED_GPU, marks=needs_a_gpu, id="sharing_one_gpu")]


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


def _check(rank, _world):
    from mxfp8_ep.config import A2AConfig
    from mxfp8_ep.dispatcher import SymmTokenDispatcher, TokenDispatcher
    from mxfp8_ep.elastic import check_overflow, replay_scope

    device = rank_device()
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
                # Allocates the peer buffers and, where the routing overflows the default
                # capacity (skew: every row to rank 0), grows it through a replay.
                replayed(lambda: _run(disp, x, scores, ids, counts, sync_check=False))
                # Sync-free inside a replay scope (outside one a dispatch reads its rows on
                # the host by design); the grown capacity holds, so nothing overflows.
                with replay_scope() as scope:
                    results[kernel] = _run(disp, x, scores, ids, counts, sync_check=(kernel == "triton"))
                assert not check_overflow(scope=scope).replay, kernel
            ref, got = results["torch"], results["triton"]
            case = f"{preset} top_k={top_k} score_before={sbe} skew={skew}"
            valid = int(ref[1].sum())  # rows past the padded experts are never read
            assert torch.equal(got[0][:valid].view(torch.int16), ref[0][:valid].view(torch.int16)), case
            assert torch.equal(got[2].view(torch.int16), ref[2].view(torch.int16)), case
            assert torch.equal(got[3].view(torch.int16), ref[3].view(torch.int16)), case
            # Score gradients are fp32 dot products: tl.sum and torch.sum add in different orders.
            torch.testing.assert_close(got[4], ref[4], rtol=1e-5, atol=1e-5, msg=case)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_symm_triton_equals_torch_twin_and_never_syncs(backend):
    run_on_ranks(WORLD, _check, backend=backend)


def _moe_with_side_stream(rank, world):
    """torchtitan's MoE (one shared expert) under our dispatcher: the shared experts on a side
    stream give the same output and parameter gradients, bit for bit, as on the main stream."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from mxfp8_ep.config import A2AConfig
    from mxfp8_ep.titan022 import DispatcherExpertParallel, install_expert_parallel

    install_expert_parallel(A2AConfig())
    device = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    tokens, dim = 1024, 512
    g = torch.Generator(device=device).manual_seed(3 + rank)
    x = torch.randn((1, tokens, dim), generator=g, device=device).bfloat16()
    dy = torch.randn((1, tokens, dim), generator=g, device=device).bfloat16()
    results = {}
    for overlap in (False, True):
        args = MoEArgs(num_experts=8, num_shared_experts=1, score_func="sigmoid", route_norm=True, top_k=2,
                       use_grouped_mm=True, load_balance_coeff=None)
        with torch.device("meta"):
            moe = MoE(args, dim=dim, hidden_dim=256)
        moe.to_empty(device=device)
        torch.manual_seed(0)
        with torch.no_grad():
            moe.init_weights(0.02, device)
        moe.bfloat16()
        style = DispatcherExpertParallel(A2AConfig.preset("mxfp8", transport="symm"), tokens,
                                         overlap_shared_experts=overlap)
        parallelize_module(moe.experts, mesh, style)
        xi = x.clone().requires_grad_()
        for _ in range(2):  # the second step reuses the cached side stream and buffers
            moe.zero_grad(set_to_none=True)
            xi.grad = None
            out = moe(xi)
            out.backward(dy)
        torch.cuda.synchronize()
        grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for n, p in moe.named_parameters()
                 if p.grad is not None}
        results[overlap] = (out.detach(), xi.grad, grads)
    (out0, dx0, g0), (out1, dx1, g1) = results[False], results[True]
    assert torch.equal(out0, out1)
    # x's three gradients (router, shared experts, dispatch) are added in another order when the
    # shared experts start first: within one bf16 rounding of the largest, not bit for bit.
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=2**-7 * float(dx0.abs().max()))
    assert g0.keys() == g1.keys() and any("shared" in n for n in g0)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


@needs_gpus
def test_shared_experts_on_a_side_stream_change_no_parameter_bit():
    run_on_ranks(WORLD, _moe_with_side_stream, backend="nccl")


def _check_fused_nccl(rank, _world):
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
                # symm grows its capacity through a replay where the routing overflows it (skew).
                results[transport, kernel], _ = replayed(lambda: _run(disp, x, scores, ids, counts, sync_check=False))
            symm_cfg = SymmTokenDispatcher.Config.of(cfg)  # which way symm sends each leg
            got = results["nccl", "triton"]
            case = f"{preset} top_k={top_k} score_before={sbe} skew={skew}"
            valid = int(got[1].sum())
            symm = results["symm", "triton"]

            def rel(a, b):
                return float((a.float() - b.float()).norm() / b.float().norm())

            for other in (results["nccl", "torch"], symm):
                assert torch.equal(got[1], other[1]), case
                assert torch.equal(got[0][:valid].view(torch.int16), other[0][:valid].view(torch.int16)), case
                if other is symm and symm_cfg.combine_fwd_partial_sums and cfg.a2a.combine_fwd == "mxfp8":
                    # symm quantizes each rank's weighted partial sum of a token, not each row.
                    assert rel(got[2], other[2]) < 2**-4, case
                elif other is symm and symm_cfg.combine_fwd_partial_sums:
                    # symm adds each rank's weighted rows of a token first (Config.combine_fwd_partial_sums).
                    torch.testing.assert_close(got[2], other[2], rtol=2**-7, atol=2**-7, msg=case)
                else:
                    assert torch.equal(got[2].view(torch.int16), other[2].view(torch.int16)), case
                if other is results["symm", "triton"] and (
                        symm_cfg.scores_after_dequantize or symm_quantizes_partial_sums(symm_cfg)):
                    # symm multiplies combine's backward by the scores after dequantizing the
                    # token (Config.scores_after_dequantize) and quantizes partial sums of
                    # dispatch's backward (mxfp8_all): equal to MXFP8 rounding.
                    assert rel(got[3], other[3]) < 2**-4, case
                elif other is results["symm", "triton"] and symm_cfg.dispatch_bwd_partial_sums:
                    # symm adds each rank's rows of a token first (Config.dispatch_bwd_partial_sums).
                    torch.testing.assert_close(got[3], other[3], rtol=2**-7, atol=2**-7, msg=case)
                else:
                    assert torch.equal(got[3].view(torch.int16), other[3].view(torch.int16)), case
            # Score gradients: fp32 dot products, in symm's token-once push and receive when top_k > 1
            # (other kernels: another sum order; with partial sums against the expert outputs
            # before combine's forward quantized them), else in the same kernel as symm; against
            # the twin, up to sum order.
            if top_k > 1 and symm_cfg.combine_fwd_partial_sums and cfg.a2a.combine_fwd == "mxfp8":
                assert rel(got[4], symm[4]) < 2**-4, case
            elif top_k > 1:
                torch.testing.assert_close(got[4], symm[4], rtol=1e-5, atol=1e-5, msg=case)
            else:
                assert torch.equal(got[4], symm[4]), case
            torch.testing.assert_close(got[4], results["nccl", "torch"][4], rtol=1e-5, atol=1e-5, msg=case)


@needs_gpus
def test_fused_nccl_equals_its_twin_and_symm():
    """The nccl transport with MXFP8 legs (FusedNcclTokenDispatcher) on NCCL: compiled Triton
    kernels equal the torch twins, and equal the symm transport bit for bit (same kernels, same
    layout; only the exchange differs), but for the x gradient where symm sends partial sums
    or multiplies combine's backward by the scores after dequantizing, and the score gradients
    where symm takes their dot products in its token-once push."""
    run_on_ranks(WORLD, _check_fused_nccl, backend="nccl")


@needs_gpus
def test_fuzz_against_torchtitan_without_host_sync():
    from tests.test_dispatcher import _fuzz, extreme_examples, hypothesis_examples

    run_on_ranks(WORLD, _fuzz, hypothesis_examples(WORLD, GPU_EXAMPLES) + extreme_examples(WORLD), backend="nccl")


@needs_a_gpu
@pytest.mark.parametrize("world", [2, 3, 4])
def test_fuzz_against_torchtitan_without_host_sync_sharing_one_gpu(world):
    """The CPU suite's routings (as many per world size), symm only, compiled kernels."""
    from tests.test_dispatcher import EXAMPLES, _fuzz, extreme_examples, hypothesis_examples

    run_on_ranks(world, _fuzz, hypothesis_examples(world, EXAMPLES[world]) + extreme_examples(world),
                 backend=SHARED_GPU)


def real_width_examples(world: int) -> list:
    """The fuzz's check at the widths of the issue's layers, where every kernel runs many column
    tiles and thousands of rows: DeepSeek-V3-like (dim 7168, top-8 of 8 experts per rank,
    scores after the experts; combine's forward as partial sums and row by row) and
    Llama4-like (dim 5120, top-1, scores first), every preset, uneven token counts, and
    everything to rank 0's experts. The expert hidden dim stays small (the dispatcher never
    sees it)."""
    from tests.test_dispatcher import Example
    from tests.moe_harness import LayerSpec

    tokens = tuple(2048 - 512 * (r % 2) for r in range(world))
    dsv3 = LayerSpec(dim=7168, hidden=256, num_experts=8 * world, top_k=8, score_func="sigmoid", route_norm=True,
                     experts="grouped", dtype="bfloat16", seed=7)
    llama4 = LayerSpec(dim=5120, hidden=256, num_experts=8 * world, top_k=1, score_func="sigmoid",
                       score_before_experts=True, experts="grouped", dtype="bfloat16", seed=8)
    out = []
    for preset in ("bf16", "mxfp8", "mxfp8_all"):
        for partial in (True, False):
            out.append(Example(dsv3, tokens, "router", preset=preset, combine_partial_sums=partial,
                               max_tokens=max(tokens), name=f"dsv3-like {preset} partial sums {partial}"))
        out.append(Example(llama4, tokens, "router", preset=preset, max_tokens=max(tokens),
                           name=f"llama4-like {preset}"))
    to_rank0 = (10.0,) * 8 + (0.0,) * (8 * (world - 1))
    out.append(Example(dsv3, tokens, "bias", bias=to_rank0, preset="mxfp8_all", max_tokens=max(tokens),
                       name="dsv3-like, all to rank 0"))
    return out


@needs_a_gpu
def test_fuzz_at_real_widths_sharing_one_gpu():
    from tests.test_dispatcher import _fuzz

    run_on_ranks(WORLD, _fuzz, real_width_examples(WORLD), backend=SHARED_GPU)


@pytest.mark.parametrize("debug", [False, True], ids=["sync_free", "debug"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_too_many_tokens_on_one_rank_fails_on_every_rank(backend, debug):
    """tests/test_dispatcher_buffers.py's overflow check on CUDA: the rank over ``max_tokens_per_rank``
    raises ValueError, its peer traps on the device instead of waiting in a barrier (debug
    mode: raises a ValueError naming the rank)."""
    from tests.test_dispatcher_buffers import _too_many_tokens

    run_on_ranks(WORLD, _too_many_tokens, debug, backend=backend)


@pytest.mark.parametrize("debug", [False, True], ids=["sync_free", "debug"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_bad_expert_id_on_one_rank_fails_on_every_rank(backend, debug):
    """tests/test_dispatcher_hardening.py's bad-id check on CUDA: every rank traps on the device
    (the fault words travel with the counts; no host sync), or, in debug mode, raises a
    ValueError naming the rank."""
    from tests.test_dispatcher_hardening import _bad_id_on_one_rank

    run_on_ranks(WORLD, _bad_id_on_one_rank, debug, backend=backend)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_two_layers_sharing_peer_buffers_on_gpus(backend):
    """The stale-buffer check (tests/test_dispatcher_buffers.py) on GPU peer buffers, with the planted
    MinimalAsyncEP bug caught."""
    from tests.test_dispatcher_buffers import _stale_buffers

    run_on_ranks(WORLD, _stale_buffers, backend=backend)
