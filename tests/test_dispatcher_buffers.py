"""The symm transport's peer buffers, on gloo process groups (CPU shared-memory peers; the
same checks run on GPUs from tests/test_dispatcher_gpu.py): no tensor that dispatch or combine
hands out aliases them (torchtitan 0.3.0 MinimalAsyncEP's bug, planted here and caught), they
hold what the legs store there, a rank with more tokens than they hold fails on every rank
instead of hanging, and a dispatcher configured for more tokens gets larger ones."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mxfp8_ep.config import PRESETS, A2AConfig
from mxfp8_ep.dispatcher import SymmTokenDispatcher, TokenDispatcher
from tests.distributed import rank_device
from tests.moe_harness import (
    LayerSpec,
    build_ep_layer,
    build_reference,
    ep_forward,
    preload,
    reference_expert_grads,
    reference_forward,
    rel_err,
    run_forked,
    run_stack,
    setup_rank,
)
from tests.round_trips import MAX_TOKENS, build_dispatcher, rank_transports, round_trip, timed_dispatch, to_next_rank
from tests.test_dispatcher import ORDER_TOL, QUANT_TOL


class _StagingViewDispatcher(SymmTokenDispatcher):
    """The bug of torchtitan 0.3.0's MinimalAsyncEP, planted: dispatch hands the experts its
    receive (staging) buffer itself instead of a fresh tensor. The next leg that uses that
    staging buffer (the next layer's dispatch) overwrites the rows the grouped GEMM saved for
    its weight gradient. Its staging buffers hold the whole expert-major tensor (buffers of
    their own: the transport's size only what the legs store there)."""

    def _buffer_key(self, device, dim, dtype):
        return (*super()._buffer_key(device, dim, dtype), "planted")

    def _staging_rows(self, max_tokens, capacity, dim, dtype):
        return max(super()._staging_rows(max_tokens, capacity, dim, dtype), capacity)

    def to_experts(self, src, meta, leg, **kwargs):
        out = super().to_experts(src, meta, leg, **kwargs)
        bufs = self._buffers_for(meta)
        used = bufs.staging[bufs.next_staging ^ 1]  # the staging buffer this leg just took
        assert used.local.storage_offset() == 0
        # A tensor over the buffer's memory with its own version counter: like the kernels'
        # and the peers' writes, later writes there go unnoticed by autograd.
        alias = torch.empty(0, dtype=out.dtype, device=out.device).set_(used.local.untyped_storage(), 0, out.shape)
        with torch.no_grad():
            alias.copy_(out)
        return alias


def _peer_memory() -> list[tuple[int, int]]:
    """Address ranges of every peer buffer the symm transport holds (each rank's mapping of
    every rank's count and staging buffers)."""
    from mxfp8_ep.dispatcher.symm import _BUFFERS

    ranges = []
    for bufs in _BUFFERS.values():
        for buf in (bufs.counts, *bufs.staging):
            for r in range(buf.world_size):
                t = buf.peer(r)
                ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    return ranges


class _AliasProbe:
    """A dispatcher seen through dispatcher_moe_forward: records each tensor that dispatch or
    combine hands out (forward outputs, and the gradients their backwards return) whose
    storage overlaps peer memory."""

    def __init__(self, inner, problems: list[str]):
        self.inner, self.problems = inner, problems

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _check(self, what: str, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        if any(lo < b and a < hi for a, b in _peer_memory()):
            self.problems.append(f"{what} aliases peer memory")

    def dispatch(self, x, scores, ids, counts):
        x = x.view_as(x)
        x.register_hook(lambda g: self._check("dispatch backward (x grad)", g))
        routed, per_expert, meta = self.inner.dispatch(x, scores, ids, counts)
        self._check("dispatch forward (routed input)", routed)
        return routed, per_expert, meta

    def combine(self, routed_output, meta):
        routed_output = routed_output.view_as(routed_output)
        routed_output.register_hook(lambda g: self._check("combine backward (routed output grad)", g))
        out = self.inner.combine(routed_output, meta)
        self._check("combine forward (output)", out)
        return out


def _two_layer_problems(rank, world, transport, preset, planted=False) -> list[str]:
    """Two EP layers with the same dims (so the symm transport gives them the same peer
    buffers), forward 1, forward 2, one backward; against the same two layers without EP.
    Returns what went wrong (every rank runs every collective whatever it finds)."""
    local = 2
    specs = [LayerSpec(experts="grouped", num_experts=local * world, top_k=2, seed=s) for s in (11, 12)]
    device = rank_device()
    g = torch.Generator().manual_seed(300 + rank)
    tokens = 12 + rank
    x = torch.randn(tokens, specs[0].dim, generator=g).to(device)
    grad_out = torch.randn(tokens, specs[0].dim, generator=g).to(device)
    references = [build_reference(spec, device) for spec in specs]
    ref_out, ref_grads = run_stack(references, reference_forward, x, grad_out)
    reference_expert_grads(ref_grads, rank, local)
    problems: list[str] = []
    layers = []
    for spec in specs:
        config = TokenDispatcher.Config(
            num_experts=spec.num_experts, top_k=spec.top_k, a2a=A2AConfig.preset(preset, transport=transport),
            max_tokens_per_rank=MAX_TOKENS,
        )
        inner = _StagingViewDispatcher(config, dist.group.WORLD) if planted else config.build(dist.group.WORLD, device)
        layers.append(build_ep_layer(references[len(layers)], spec, _AliasProbe(inner, problems), rank))
    out, grads = run_stack(layers, ep_forward, x, grad_out)
    bound = QUANT_TOL["rceil"] if A2AConfig.preset(preset).any_quantized else ORDER_TOL["float32"]
    for name, ref in {"out": ref_out, **ref_grads}.items():
        err = rel_err(out if name == "out" else grads[name], ref)
        if not err < bound:
            problems.append(f"{name}: rel err {err:.3g} >= {bound:.3g}")
    return problems


def _stale_buffers(rank, world):
    setup_rank()
    for transport in rank_transports():
        for preset in sorted(PRESETS):
            problems = _two_layer_problems(rank, world, transport, preset)
            assert not problems, f"{transport} {preset} rank {rank}: {problems}"
    # The planted bug must be caught twice over: the routed input lives in a staging buffer,
    # and the first layer's expert weight gradients come from overwritten rows.
    problems = _two_layer_problems(rank, world, "symm", "bf16", planted=True)
    assert "dispatch forward (routed input) aliases peer memory" in problems, problems
    assert any(p.startswith("0.experts.w1: rel err") for p in problems), problems


def test_two_layers_sharing_peer_buffers_get_the_right_expert_gradients():
    """torchtitan 0.3.0's MinimalAsyncEP returned its symmetric receive buffer from dispatch;
    the next layer's legs overwrote it while the grouped GEMM still held it for the weight
    gradient (expert w1 gradients off by a relative 1.4). Here: two layers with one set of
    peer buffers, forward both, then backward; expert w1/w2/w3 gradients of both layers,
    output and input gradient against torchtitan without EP, every preset, both transports
    (the nccl transport has no peer buffers: its tensors are fresh by construction). The same
    check run on a dispatcher with that bug planted (``_StagingViewDispatcher``) must fail,
    both on the aliasing (no tensor dispatch / combine hands out, forward or backward, may
    overlap a peer buffer) and on the first layer's w1 gradient."""
    preload()
    run_forked(2, _stale_buffers)


def _staging_sizes(rank, world):
    """Every token to both experts of the next rank (top-2, all rows cross), dim 32 and 256-row
    expert padding: the score gradients combine's backward returns then need more bytes than
    the token rows. Identity experts: out = x (s0 + s1), x grad = s0 + s1, score grads = sum(x).
    And the DeepSeek-V3-like layer's staging rows: its tokens on every rank, nothing more."""
    from mxfp8_ep.dispatcher.symm import _BUFFERS
    from mxfp8_ep.exchange.capacity import expert_major_capacity

    setup_rank()
    tokens, dim = MAX_TOKENS - rank, 32
    g = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(tokens, dim, generator=g)
    scores = torch.rand(tokens, 2, generator=g) + 0.5
    first = (rank + 1) % world * 2
    ids = torch.tensor([[first, first + 1]] * tokens)
    counts = torch.bincount(ids.reshape(-1), minlength=2 * world)
    for score_before in (False, True):
        _BUFFERS.clear()
        config = TokenDispatcher.Config(
            num_experts=2 * world, top_k=2, score_before_experts=score_before, pad_multiple=256,
            max_tokens_per_rank=MAX_TOKENS, a2a=A2AConfig.preset("bf16", transport="symm"),
        )
        _, out, x_grad, score_grad = round_trip(config.build(dist.group.WORLD, "cpu"), x, scores, ids, counts)
        (bufs,) = _BUFFERS.values()
        assert bufs.staging_rows < bufs.map_rows, (bufs.staging_rows, bufs.map_rows)
        total = scores.sum(dim=1, keepdim=True)
        torch.testing.assert_close(out, x * total, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x_grad, total.expand_as(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(score_grad, x.sum(dim=1, keepdim=True).expand_as(scores), rtol=1e-5, atol=1e-5)
    # What is allocated is the rule the recipe's memory estimate reads (``capacity.symm_staging_bytes``):
    # the worst case's capacity-sized areas, whatever the elastic capacity.
    from launch.config.memory import EXPERT_ALIGN
    from mxfp8_ep.exchange.capacity import symm_staging_bytes

    for flag in (True, False):
        _BUFFERS.clear()
        config = TokenDispatcher.Config(
            num_experts=2 * world, top_k=2, pad_multiple=EXPERT_ALIGN, max_tokens_per_rank=MAX_TOKENS,
            a2a=A2AConfig.preset("bf16", transport="symm", symm_combine_partial_sums=flag),
        )
        round_trip(config.build(dist.group.WORLD, "cpu"), x.bfloat16(), scores, ids, counts)
        (bufs,) = _BUFFERS.values()
        rule = symm_staging_bytes(world, MAX_TOKENS, 2, 2, EXPERT_ALIGN, flag, dim * 2)
        assert sum(b.nbytes for b in bufs.staging) == rule, flag
    _BUFFERS.clear()
    # 8192 tokens of dim 7168 per rank, top-8, 128 experts per rank (DeepSeek-V3-like at EP=2):
    # staging for W x 8192 token rows (rank * max_tokens + token), where the expert-major
    # capacity is W x 8192 x 8 rows + padding.
    experts, tokens = 128 * world, 8192
    dsv3 = TokenDispatcher.Config(num_experts=experts, top_k=8, a2a=A2AConfig.preset("mxfp8", transport="symm"))
    capacity = expert_major_capacity(tokens, 8, world, experts // world, dsv3.pad_multiple)
    rows = dsv3.build(dist.group.WORLD, "cpu")._staging_rows(tokens, capacity, 7168, torch.bfloat16)
    assert rows == world * tokens and 8 * rows < capacity, (rows, capacity)


def test_symm_staging_buffers_hold_what_the_legs_store():
    """With top-k > 1 the symm transport's staging buffers hold token rows, not the drop-free
    expert-major capacity (``mxfp8_ep.exchange.capacity.staging_rows``); at a small dim with large
    expert padding the score gradients combine's backward returns through them still fit; the
    rule the recipe's memory estimate reads (``capacity.symm_staging_bytes``) counts the bytes
    they take."""
    preload()
    for world in (2, 3):
        run_forked(world, _staging_sizes)


OVERFLOW_TIMEOUT_S = 5
OVERFLOW_CUDA_LIMIT_S = 30  # on CUDA the peer's first dispatch also compiles its kernels before it traps


def _too_many_tokens(rank, world, debug=False):
    """Rank 0 gets more tokens than the symm buffers hold and raises ValueError after the count
    exchange. Its peers raise one too on CPU, and on CUDA in debug mode (``Config.check_inputs``:
    they read the exchanged fault words on the host); on CUDA otherwise (tests/test_dispatcher_gpu.py)
    their check is a device-side assert (no host sync): they fail at their next synchronization
    with "device-side assert" and exit at once, their CUDA context lost."""
    import os
    import time

    setup_rank()
    device = rank_device()
    dispatcher = build_dispatcher("symm", check_inputs=debug)  # buffers for MAX_TOKENS per rank
    tokens = MAX_TOKENS + 1 if rank == 0 else 1  # rank 0 alone is over capacity
    x, scores, ids, counts = (t.to(device) for t in to_next_rank(rank, world, tokens, 64))
    raised, took = timed_dispatch(dispatcher, x, scores, ids, counts)
    if rank == 0:  # stay out of collectives while the peers find out (or time out)
        time.sleep(OVERFLOW_TIMEOUT_S + 2)
    if device.type == "cuda" and rank != 0 and not debug:
        expected = isinstance(raised, RuntimeError) and "device-side assert" in str(raised)
    else:
        expected = isinstance(raised, ValueError) and "max_tokens_per_rank" in str(raised)
    assert expected, f"rank {rank}: {type(raised).__name__} after {took:.1f}s: {raised}"
    limit = OVERFLOW_CUDA_LIMIT_S if device.type == "cuda" else OVERFLOW_TIMEOUT_S / 2
    assert took < limit, f"rank {rank} waited {took:.1f}s for a peer that raised"
    if device.type == "cuda":
        os._exit(0)  # a rank that trapped has lost its CUDA context: nothing left to tear down


def test_too_many_tokens_on_one_rank_fails_on_every_rank():
    """One rank gets more tokens than the symm buffers hold (max_tokens_per_rank): like the
    other bad inputs, every rank raises the ValueError at once, none waits for a peer that
    raised: the token counts travel with the expert counts, the offending rank raises after that
    exchange and its peers fail the check of the exchanged counts (on CUDA a device-side assert,
    which needs no host sync). The process-group timeout is cut to OVERFLOW_TIMEOUT_S so that a
    regression fails quickly instead of hanging."""
    preload()
    run_forked(2, _too_many_tokens, timeout_s=OVERFLOW_TIMEOUT_S)  # CPU reads the fault words in both modes


def _larger_config_after_smaller(rank, world):
    setup_rank()
    small = TokenDispatcher.Config(num_experts=2 * world, top_k=1, max_tokens_per_rank=4,
                                   a2a=A2AConfig(transport="symm")).build(dist.group.WORLD, "cpu")
    x, scores, ids, counts = to_next_rank(rank, world, 4, 64)
    round_trip(small, x, scores, ids, counts)
    large = TokenDispatcher.Config(num_experts=2 * world, top_k=1, max_tokens_per_rank=12,
                                   a2a=A2AConfig(transport="symm")).build(dist.group.WORLD, "cpu")
    x, scores, ids, counts = to_next_rank(rank, world, 12, 64)
    _, out, _, _ = round_trip(large, x, scores, ids, counts)  # within its configured capacity
    assert torch.equal(out, x)


def test_each_dispatcher_gets_the_capacity_it_is_configured_for():
    """Two layers with the same dims, the second configured for more tokens per rank (e.g. a
    model whose layers get different max_tokens_per_rank, or a second model in one process):
    the second must carry its configured token count."""
    preload()
    try:
        run_forked(2, _larger_config_after_smaller)
    except Exception as e:  # the rank's ValueError arrives wrapped by torch.multiprocessing
        if "ValueError: symm dispatch got 12 tokens" in str(e):
            raise ValueError(str(e)) from e
        raise
