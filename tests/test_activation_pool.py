"""The symm transport's activation pool (``mxfp8_ep.pool.activation_pool``), on gloo process groups of
2-4 CPU ranks: stacks of torchtitan 0.2.2 DeepSeek-V3-like MoE layers (grouped SwiGLU experts in
bf16, scores after the experts, so combine keeps its expert rows) under EP through
``install_expert_parallel``, each step through a ``ReplayGuard``:

* pooled, unpooled and worst-case runs (``capacity_factor=None``) give the same losses and
  gradients bit for bit on balanced and skewed routings; a pool too small replays, grows and
  still matches; a step past the pool's ceiling spills (keeps exactly its rows) and matches;
* rows past a layer's count are never read: the pool's planes start as NaN;
* the pool adds no host read; of the capacity-row tensors a step keeps after its forward only
  the last layer's are left (the pool's planes hold the others' routed rows, sized by
  ``activation_pool_size``);
* activation checkpointing (non-reentrant and reentrant), two microbatches per step (the first's
  backward gives its rows back: no replay) and a loop without a guard compute the same;
* the sizing arithmetic and the config's checks.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep import elastic
from mxfp8_ep.pool import activation_pool
from mxfp8_ep.pool.activation_pool_size import pool_bytes, pool_rows, pooled_row_bytes
from mxfp8_ep.exchange.capacity import expert_major_capacity, worst_case_capacity
from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import release_peer_buffers, symm
from tests.moe_harness import preload, run_forked, setup_rank
from tests.pool_stack import ALIGN, DIM, HIDDEN, LAYERS, TOKENS, TOP_K, assert_same, forward, skew, stack, steps

def test_the_pool_is_the_factor_times_the_balanced_case_summed_over_the_layers():
    shape = (TOKENS, TOP_K, 4, 2, ALIGN)
    assert pool_rows(*shape, LAYERS, 1.0) == LAYERS * expert_major_capacity(*shape, 1.0)
    assert pool_rows(*shape, LAYERS, 0.5) < pool_rows(*shape, LAYERS, 1.0) < pool_rows(*shape, LAYERS, None)
    assert pool_rows(*shape, LAYERS, None) == LAYERS * worst_case_capacity(*shape)
    # DeepSeek-V3 16B: dim 2048, MoE hidden 1408, bf16, scores after the experts.
    assert pooled_row_bytes(2048, 1408) == 2 * (2 * 2048 + 3 * 1408)
    assert pooled_row_bytes(2048, 1408, combine_keeps_expert_rows=False) == 2 * (2048 + 3 * 1408)
    assert pool_bytes(*shape, LAYERS, 1.0, 100) == 100 * pool_rows(*shape, LAYERS, 1.0)


@pytest.mark.parametrize("name", ["activation_pool_factor", "activation_pool_ceiling"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "1", True])
def test_a_pool_factor_or_ceiling_that_cannot_be_is_refused(name, value):
    with pytest.raises(ValueError, match=f"A2AConfig.{name}="):
        A2AConfig(**{name: value}).check()
    A2AConfig(**{name: None}).check()
    A2AConfig(**{name: 1.5}).check()


def test_a_pool_ceiling_below_where_the_pool_starts_is_refused():
    with pytest.raises(ValueError, match="A2AConfig.activation_pool_ceiling=2.0: below activation_pool_factor=3.0"):
        A2AConfig(activation_pool_factor=3.0, activation_pool_ceiling=2.0).check()
    A2AConfig(activation_pool_factor=3.0, activation_pool_ceiling=3.0).check()
    A2AConfig(activation_pool_factor=3.0, activation_pool_ceiling=None).check()
    A2AConfig(activation_pool_factor=None, activation_pool_ceiling=0.5).check()


ROUTINGS = ("balanced", "skewed", "balanced")
POOLED = dict(transport="symm", capacity_ceiling=None, activation_pool_factor=1.0, activation_pool_ceiling=None)


def _pooled_matches_the_worst_case(rank, world):
    setup_rank()
    activation_pool._FILL = float("nan")  # a backward that read a row past a layer's count shows
    worst = steps(world, rank, A2AConfig(transport="symm", capacity_factor=None), ROUTINGS)
    unpooled = steps(world, rank, A2AConfig(transport="symm", capacity_ceiling=None, activation_pool_factor=None),
                      ROUTINGS)
    pooled = steps(world, rank, A2AConfig(**POOLED), ROUTINGS)
    assert all(torch.isfinite(loss) for loss, _, _ in worst)
    assert_same(unpooled, worst, f"unpooled rank {rank}/{world}")
    assert_same(pooled, worst, f"pooled rank {rank}/{world}")
    # the first step learns how many layers pool (it starts from one layer's rows: one rerun);
    # the skewed step overflows the capacity (and the pool at once): one rerun, then it holds
    assert [r for *_, r in pooled] == [1, 1, 0], [r for *_, r in pooled]
    # A pool of a tenth of the balanced case: the first step overflows it alone, replays once,
    # and the grown pool holds; the result is the same.
    small = steps(world, rank, A2AConfig(**{**POOLED, "activation_pool_factor": 0.1}), ROUTINGS)
    assert_same(small, worst, f"small pool rank {rank}/{world}")
    assert small[0][2] == 1 and small[2][2] == 0, [r for *_, r in small]
    # A pool whose ceiling is its start: the skewed step spills (its rerun keeps exactly its
    # routed rows, read on the host) and matches.
    capped = steps(world, rank, A2AConfig(**{**POOLED, "activation_pool_ceiling": 1.0}), ROUTINGS)
    assert_same(capped, worst, f"pool at its ceiling rank {rank}/{world}")
    activation_pool.release_pools()


@pytest.mark.parametrize("world", [2, 4])
def test_pooled_unpooled_and_worst_case_steps_match_bit_for_bit(world):
    preload()
    run_forked(world, _pooled_matches_the_worst_case, timeout_s=300)


def _spill_counts(rank, world):
    """The pool's spill is the guard's: a capped pool on a skewed step spills once."""
    setup_rank()
    a2a = A2AConfig(**{**POOLED, "activation_pool_ceiling": 1.0})
    release_peer_buffers()
    activation_pool.release_pools()
    moes = stack(world, a2a)
    guard = elastic.ReplayGuard([m for moe in moes for m in moe.modules()])
    skew(moes, True)
    x = torch.randn(1, TOKENS, DIM, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    for _ in guard.attempts():
        (forward(moes, x, None).float() ** 2).mean().backward()
    assert guard.spills == 1, guard.__dict__
    # the pool holds every layer but the last (its backward reads its tensors as they are)
    pool_ceiling = (LAYERS - 1) * expert_major_capacity(TOKENS, TOP_K, world, 4, ALIGN, 1.0)
    # rank 0 holds every routed row: its pool spilled; rank 1's did not, and reran with it
    assert any(ceiling == pool_ceiling for ceiling, _ in guard.pool_spilled) == (rank == 0), guard.pool_spilled
    assert not guard.spilled, guard.spilled  # the capacity (at the worst case) never spills
    release_peer_buffers()
    activation_pool.release_pools()


def test_a_step_past_the_pools_ceiling_spills():
    preload()
    run_forked(2, _spill_counts, timeout_s=300)


def _no_host_read_and_memory(rank, world):
    setup_rank()
    reads = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__int__", "__bool__", "__float__")}

    def counted(original):
        def read(self, *args, **kwargs):
            reads["n"] += 1
            return original(self, *args, **kwargs)
        return read

    kept = []
    grouped_mm = torch._grouped_mm

    def watched(a, b, *args, **kwargs):
        out = grouped_mm(a, b, *args, **kwargs)
        kept.extend(weakref.ref(t) for t in (a, out) if t.dim() == 2)
        return out

    capacity = expert_major_capacity(TOKENS, TOP_K, world, 4, ALIGN, 1.25)
    held = {}

    made = []  # every packed tensor (``_Packed``): one still held as it is keeps its capacity rows
    packed_init = activation_pool._Packed.__init__

    def tracked_init(self, *args, **kwargs):
        packed_init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    def after_forward(moes):
        tensors = [r() for r in kept] + [p.tensor for p in (r() for r in made) if p is not None]
        alive = {t.data_ptr(): t for t in tensors if t is not None and t.shape[0] == capacity}
        made.clear()
        held.setdefault("capacity_bytes", []).append(sum(t.nbytes for t in alive.values()))  # views once
        kept.clear()

    def one_run(a2a, fresh_pools=True):
        reads["n"] = 0
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(original))
        torch._grouped_mm = watched
        activation_pool._Packed.__init__ = tracked_init
        try:
            steps(world, rank, a2a, ("balanced",), after_forward=after_forward, fresh_pools=fresh_pools)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            torch._grouped_mm = grouped_mm
            activation_pool._Packed.__init__ = packed_init
        return reads["n"]

    a2a = A2AConfig(transport="symm", capacity_ceiling=None, activation_pool_factor=1.5, activation_pool_ceiling=None)
    unpooled_reads = one_run(A2AConfig(transport="symm", capacity_ceiling=None, activation_pool_factor=None))
    one_run(a2a)  # the pool learns how many layers pool (the first step's one rerun)
    held["capacity_bytes"] = held["capacity_bytes"][:1]  # the unpooled run's
    pooled_reads = one_run(a2a, fresh_pools=False)
    assert pooled_reads == unpooled_reads, (pooled_reads, unpooled_reads)
    unpooled_bytes, pooled_bytes = held["capacity_bytes"]
    # Unpooled each layer keeps its routed input, h1, h3, their product and its expert outputs
    # at the capacity; pooled only the last layer does (its backward runs first and reads them
    # as they are), and the pool holds the others' routed rows.
    row = pooled_row_bytes(DIM, HIDDEN, 2, combine_keeps_expert_rows=True)
    assert unpooled_bytes == LAYERS * capacity * row, (unpooled_bytes, LAYERS * capacity * row)
    assert pooled_bytes == capacity * row, (pooled_bytes, capacity * row)
    (pool,) = [p for p in activation_pool.pools() if p.factor == 1.5]
    rows = pool_rows(TOKENS, TOP_K, world, 4, ALIGN, LAYERS - 1, 1.5)
    assert pool.rows == rows and pool.nbytes() == (rows + 1) * row, (pool.rows, rows, pool.nbytes())
    activation_pool.release_pools()


def test_the_pool_reads_nothing_on_the_host_and_only_the_last_layer_keeps_capacity_rows():
    preload()
    run_forked(2, _no_host_read_and_memory, timeout_s=300)


def _checkpointed_accumulated_and_unguarded(rank, world):
    setup_rank()
    activation_pool._FILL = float("nan")
    worst = A2AConfig(transport="symm", capacity_factor=None)
    want = steps(world, rank, worst, ROUTINGS)
    for how in ("full", "reentrant"):
        got = steps(world, rank, A2AConfig(**POOLED), ROUTINGS, checkpoint=how)
        assert_same(got, want, f"checkpoint {how} rank {rank}")
    # Without a guard nothing is pooled (the dispatches fit themselves): the worst case's result.
    assert_same(steps(world, rank, A2AConfig(**POOLED), ROUTINGS, guarded=False), want, f"unguarded rank {rank}")
    # Two microbatches per step: the first's backward gives its rows back, so a pool of one
    # microbatch's layers holds both and nothing replays.
    got = steps(world, rank, A2AConfig(**POOLED), ("balanced", "balanced"), microbatches=2)
    assert_same(got, steps(world, rank, worst, ("balanced", "balanced"), microbatches=2),
                 f"2 microbatches rank {rank}")
    assert [r for *_, r in got] == [1, 0], [r for *_, r in got]  # the first step learns the depth
    activation_pool.release_pools()


def test_checkpointing_microbatches_and_no_guard_with_the_pool_match_the_worst_case():
    preload()
    run_forked(2, _checkpointed_accumulated_and_unguarded, timeout_s=400)


def _harness_stack(world, rank, a2a):
    """``LAYERS`` MoE layers as ``tests.moe_harness`` builds them (no DTensor: each rank's
    expert slice, on the rank's device), with the library's grouped SwiGLU experts."""
    from mxfp8_ep.dispatcher import TokenDispatcher
    from mxfp8_ep.titan022 import CapacityGroupedExperts
    from tests.distributed import rank_device
    from tests.moe_harness import LayerSpec, build_ep_layer, build_reference

    layers = []
    for i in range(LAYERS):
        spec = LayerSpec(dim=DIM, hidden=HIDDEN, num_experts=4 * world, top_k=TOP_K, score_func="sigmoid",
                         experts="grouped", dtype="bfloat16", seed=i)
        config = TokenDispatcher.Config(num_experts=4 * world, top_k=TOP_K, pad_multiple=ALIGN,
                                        max_tokens_per_rank=TOKENS, a2a=a2a)
        moe = build_ep_layer(build_reference(spec, rank_device()), spec,
                             config.build(dist.group.WORLD, rank_device()), rank)
        moe.experts.__class__ = CapacityGroupedExperts
        moe.experts.use_grouped_mm = True
        layers.append(moe)
    return layers


def _harness_steps(world, rank, a2a, routings, checkpoint=None):
    """``pool_stack.steps`` for ``_harness_stack``'s layers (on the rank's device), each step
    through a ``ReplayGuard``; ``checkpoint``: as ``pool_stack.CHECKPOINTS``."""
    import functools

    from tests.distributed import rank_device
    from mxfp8_ep.titan022 import dispatcher_moe_forward

    release_peer_buffers()
    activation_pool.release_pools()
    moes = _harness_stack(world, rank, a2a)
    params = [p for moe in moes for p in moe.parameters() if p.requires_grad]
    guard = elastic.ReplayGuard([m for moe in moes for m in moe.modules()])
    out = []
    try:
        for step, routing in enumerate(routings):
            g = torch.Generator().manual_seed(100 * step + rank)
            x_in = torch.randn(1, TOKENS, DIM, generator=g).to(torch.bfloat16).to(rank_device())
            bias = torch.zeros(4 * world, device=rank_device())
            if routing == "skewed":
                bias[:TOP_K] = 1e4
            before = guard.replays
            for _ in guard.attempts():
                for p in params:
                    p.grad = None
                x = x_in.clone().requires_grad_(True)
                for moe in moes:
                    moe.expert_bias = bias
                layers = [functools.partial(dispatcher_moe_forward, moe) for moe in moes]
                loss = (forward(layers, x, checkpoint).float() ** 2).mean()
                loss.backward()
            out.append((loss.detach(), [x.grad, *[p.grad for p in params]], guard.replays - before))
    finally:
        release_peer_buffers()
    return out


def _pooled_matches_on_the_device(rank, world):
    setup_rank()
    activation_pool._FILL = float("nan")
    want = _harness_steps(world, rank, A2AConfig(transport="symm", capacity_factor=None), ROUTINGS)
    for factor in (1.0, 0.1):
        got = _harness_steps(world, rank, A2AConfig(**{**POOLED, "activation_pool_factor": factor}), ROUTINGS)
        assert_same(got, want, f"pool {factor} rank {rank}/{world}")
        assert got[1][2] >= 1, [r for *_, r in got]
    activation_pool.release_pools()


def test_pooled_harness_layers_match_the_worst_case():
    preload()
    run_forked(2, _pooled_matches_on_the_device, timeout_s=300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the ranks share it)")
def test_pooled_layers_match_the_worst_case_sharing_one_gpu():
    """The CPU check above on real GPU processes: compiled kernels, CUDA copies into the pool and
    the backward's releases from autograd's device thread."""
    from tests.distributed import SHARED_GPU, run_on_ranks

    run_on_ranks(2, _pooled_matches_on_the_device, backend=SHARED_GPU, timeout_s=300)


def test_a_layer_whose_backward_began_stays_out_of_the_pool():
    """A compaction (the next layer's forward, e.g. a reentrant recompute's or another
    microbatch's) that comes once the pending layer's backward has read one of its tensors leaves
    that layer as it is: its other nodes still read every row, and nothing is pushed."""

    capacity = expert_major_capacity(TOKENS, TOP_K, 2, 4, ALIGN, 1.25)
    pool = activation_pool.ActivationPool(torch.device("cpu"), 1.0, None, (TOKENS, TOP_K, 2, 4, ALIGN))
    with symm.replay_scope() as scope:
        pool.begin_attempt(scope)
        count = torch.tensor([10])
        layer = activation_pool._Layer(scopes=(scope,), count=count, demand=count)
        pack = activation_pool._LayerPack(pool, layer, capacity)
        _backward_reads_a_pending_layer_mid_compaction(pool, pack, capacity)
        overflows = int(scope.overflows("cpu"))
    assert overflows == 0 and int(pool.head) == 0 and not pool.live and pool.depth_seen == 0


def _backward_reads_a_pending_layer_mid_compaction(pool, pack, capacity):
    t = torch.randn(capacity, 8, dtype=torch.float32, requires_grad=True)
    with pack.saving():
        u = t.sin()  # keeps t; reads every row in its backward
        v = u * t  # keeps u and t
    u.register_hook(lambda grad: pool.compact())  # between the two nodes that read t
    v.sum().backward()
    x = t.detach()
    want = x.sin() + x * x.cos()
    assert torch.equal(t.grad, want), (t.grad - want).abs().max()
