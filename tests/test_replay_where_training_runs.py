"""The replay scope and the activation pool where real training runs them, on gloo groups of CPU
ranks (``tests.pool_stack``: torchtitan 0.2.2 DeepSeek-V3-like MoE layers through the library,
the symm transport's CPU twins), each result compared bit for bit with the worst case
(``capacity_factor=None``, no pool):

* the backward on another thread (CUDA runs it on its device thread): a recompute under
  activation checkpointing (full, selective, op-level selective, reentrant) counts in the scope
  of the forward it recomputes, takes its capacity and is exact, with the pool and without it;
  a reentrant recompute between two microbatches' backwards moves no layer into the pool;
* which scopes a dispatch counts in, thread by thread: its own thread's, a backward's the
  forward's while open, never another training thread's;
* nested scopes: a guard inside a caller's scope (one per step, or one around the run) sees
  its pool's overflows, grows it and replays;
* a pipeline stage's 1F1B schedule with ``forward_done`` after each forward: no
  ``ReplayLimitError``, and the pool holds the layers the schedule keeps at once, whatever the
  number of microbatches;
* memory and telemetry: a graph kept for another backward holds one layer's capacity copies;
  an overflowed attempt's last layer never moves into the pool; a cut layer's pool demand is
  its own routed rows (no spill below the ceiling); the first step's replay reports the pool's
  growth.
"""

from __future__ import annotations

import threading
import weakref

import pytest
import torch

from mxfp8_ep import elastic
from mxfp8_ep.pool import activation_pool
from mxfp8_ep.pool.activation_pool_size import pool_rows
from mxfp8_ep.config import A2AConfig
from mxfp8_ep.dispatcher import release_peer_buffers, symm
from tests.moe_harness import preload, run_forked, setup_rank
from tests.pool_stack import (
    ALIGN,
    DIM,
    LAYERS,
    TOKENS,
    TOP_K,
    assert_same,
    backward,
    forward,
    run_step,
    stack,
    steps,
)

WORST = dict(transport="symm", capacity_factor=None)
POOLED = dict(transport="symm", capacity_ceiling=None, activation_pool_factor=1.0, activation_pool_ceiling=None)
UNPOOLED = dict(transport="symm", capacity_ceiling=None, activation_pool_factor=None)
ROUTINGS = ("balanced", "skewed")


def test_a_dispatch_counts_in_its_threads_scopes_and_a_recompute_in_its_forwards():
    """``symm.dispatch_scopes``: a dispatcher's dispatch on a thread with open scopes counts in
    them; inside a backward on a thread without any (autograd's device thread) it counts in the
    scopes its forward counted in while they are open; two training threads never share one,
    and a plain forward on another thread counts in none."""

    class Dispatcher:
        pass

    first, second = Dispatcher(), Dispatcher()
    opened = {name: threading.Event() for name in ("first", "second")}
    close = threading.Event()
    scopes = {}

    def train(name, owner):
        with symm.replay_scope() as scope:
            scopes[name] = scope
            assert symm.dispatch_scopes(owner) == [scope]
            opened[name].set()
            close.wait(30)

    threads = [threading.Thread(target=train, args=(n, d)) for n, d in (("first", first), ("second", second))]
    for thread in threads:
        thread.start()
    for event in opened.values():
        assert event.wait(30)
    seen = {}

    def in_backward(grad):
        seen["first"] = symm.dispatch_scopes(first)
        seen["second"] = symm.dispatch_scopes(second)
        return grad

    def recompute():
        t = torch.ones(2, requires_grad=True)
        t.register_hook(in_backward)
        t.sum().backward()
        seen["forward"] = symm.dispatch_scopes(first)

    try:
        worker = threading.Thread(target=recompute)
        worker.start()
        worker.join()
    finally:
        close.set()
        for thread in threads:
            thread.join()
    assert seen == {"first": [scopes["first"]], "second": [scopes["second"]], "forward": []}, seen
    worker = threading.Thread(target=recompute)
    worker.start()
    worker.join()
    assert seen == {"first": [], "second": [], "forward": []}, seen  # the scopes closed


def _checkpointed_on_a_backward_thread(rank, world):
    setup_rank()
    activation_pool._FILL = float("nan")  # a backward that read a row past a layer's count shows
    want = steps(world, rank, A2AConfig(**WORST), ROUTINGS)
    for how in ("full", "selective", "op_selective", "reentrant"):
        for a2a in (POOLED, UNPOOLED):
            got = steps(world, rank, A2AConfig(**a2a), ROUTINGS, checkpoint=how, backward_thread=True)
            assert_same(got, want, f"checkpoint {how} {a2a} rank {rank}")
            assert got[1][2] >= 1, [r for *_, r in got]  # the skewed step overflowed and replayed
    # Two microbatches' forwards, then their backwards, the middle layer checkpointed reentrantly:
    # the first backward's recompute leaves the second microbatch's pending layer out of the pool.
    want = steps(world, rank, A2AConfig(**WORST), ROUTINGS, microbatches=2)
    got = steps(world, rank, A2AConfig(**POOLED), ROUTINGS, microbatches=2, schedule="all_forwards_first",
                checkpoint="middle_reentrant", backward_thread=True)
    assert_same(got, want, f"two microbatches, middle layer reentrant, rank {rank}")
    activation_pool.release_pools()


def test_checkpointed_steps_with_the_backward_on_another_thread_match_the_worst_case():
    preload()
    run_forked(2, _checkpointed_on_a_backward_thread, timeout_s=600)


def _checkpointed_on_the_device(rank, world):
    from tests.test_activation_pool import _harness_steps

    setup_rank()
    activation_pool._FILL = float("nan")
    want = _harness_steps(world, rank, A2AConfig(**WORST), ROUTINGS)
    for how in ("full", "selective", "reentrant"):
        got = _harness_steps(world, rank, A2AConfig(**POOLED), ROUTINGS, checkpoint=how)
        assert_same(got, want, f"checkpoint {how} rank {rank}/{world}")
        assert got[1][2] >= 1, [r for *_, r in got]
    activation_pool.release_pools()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the ranks share it)")
@pytest.mark.parametrize("world", [2, 4])
def test_checkpointed_guarded_steps_match_the_worst_case_sharing_one_gpu(world):
    """The checks above on real GPU processes: autograd's device thread runs each backward and
    its recomputes, the kernels compiled."""
    from tests.distributed import SHARED_GPU, run_on_ranks

    run_on_ranks(world, _checkpointed_on_the_device, backend=SHARED_GPU, timeout_s=600)


def _nested_scopes(rank, world):
    setup_rank()
    activation_pool._FILL = float("nan")
    want = steps(world, rank, A2AConfig(**WORST), ROUTINGS)
    alone = steps(world, rank, A2AConfig(**POOLED), ROUTINGS)
    for outer in ("per_step", "run"):
        got = steps(world, rank, A2AConfig(**POOLED), ROUTINGS, outer_scope=outer)
        assert_same(got, want, f"outer scope {outer} rank {rank}")
        # the first step's pool overflow (it learns its depth) replays inside the outer scope too
        assert [r for *_, r in got] == [r for *_, r in alone] and got[0][2] == 1, ([r for *_, r in got], outer)
    activation_pool.release_pools()


def test_a_guard_inside_an_outer_scope_sees_its_pools_overflows():
    preload()
    run_forked(2, _nested_scopes, timeout_s=300)


def _one_f_one_b(rank, world):
    setup_rank()
    activation_pool._FILL = float("nan")
    for microbatches in (4, 8):
        want = steps(world, rank, A2AConfig(**WORST), ROUTINGS, microbatches=microbatches)
        held = []
        got = steps(world, rank, A2AConfig(**POOLED), ROUTINGS, microbatches=microbatches, schedule="1f1b",
                    after_forward=lambda _: held.append(elastic.capacity_rows()))
        assert_same(got, want, f"1F1B of {microbatches} rank {rank}")
        (pool,) = activation_pool.pools()
        # Two microbatches in flight keep 2 x LAYERS layers at once; the newest layer stays out.
        # Unpooled, each of them would keep its rows at the capacity (grown by the skewed step).
        assert pool.depth_seen == 2 * LAYERS - 1, (microbatches, pool.depth_seen)
        capacity = max(held)
        assert pool.rows <= pool.depth_seen * capacity, (pool.rows, pool.depth_seen, capacity)
    activation_pool.release_pools()


def test_a_1f1b_schedule_replays_without_error_and_its_pool_holds_the_layers_in_flight():
    preload()
    run_forked(2, _one_f_one_b, timeout_s=600)


def _retained_graph_holds_one_layers_copies(rank, world):
    setup_rank()
    release_peer_buffers()
    activation_pool.release_pools()
    made = []
    packed_init = activation_pool._Packed.__init__

    def tracked_init(self, *args, **kwargs):
        packed_init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    moes = stack(world, A2AConfig(**POOLED))
    guard = elastic.ReplayGuard([m for moe in moes for m in moe.modules()])
    activation_pool._Packed.__init__ = tracked_init
    try:
        for n in range(2):  # the first step learns the pool's depth
            x = torch.randn(1, TOKENS, DIM, generator=torch.Generator().manual_seed(n + rank)).to(torch.bfloat16)
            for _ in guard.attempts():
                made.clear()
                loss = (forward(moes, x.clone().requires_grad_(True)).float() ** 2).mean()
                backward(loss, on_thread=False, retain_graph=True)
                copies = {id(p.layer) for p in (r() for r in made) if p is not None and p.unpacked is not None}
                pooled = {id(p.layer) for p in (r() for r in made) if p is not None and p.plane is not None}
        assert len(pooled) == LAYERS - 1, pooled
        assert len(copies) <= 1, f"capacity copies of {len(copies)} layers kept with the graph"
        backward(loss, on_thread=False)  # the kept graph still runs its backward
    finally:
        activation_pool._Packed.__init__ = packed_init
        release_peer_buffers()
        activation_pool.release_pools()


def test_a_graph_kept_for_another_backward_holds_one_layers_capacity_copies():
    preload()
    run_forked(2, _retained_graph_holds_one_layers_copies, timeout_s=300)


def _pool_telemetry(rank, world):
    setup_rank()
    # An overflowed attempt whose backward is skipped (forward_done) leaves its last layer
    # pending: the rerun never moves it in, so the pool is sized for the layers that pool.
    steps(world, rank, A2AConfig(**POOLED), ("balanced", "balanced"), schedule="all_forwards_first")
    (pool,) = activation_pool.pools()
    assert pool.depth_seen == LAYERS - 1, pool.depth_seen
    # The first step's replay is the pool's growth, and says so.
    release_peer_buffers()
    activation_pool.release_pools()
    moes = stack(world, A2AConfig(**POOLED))
    guard = elastic.ReplayGuard([m for moe in moes for m in moe.modules()])
    overflows = []
    guard.on_replay = overflows.append
    x = torch.randn(1, TOKENS, DIM, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    for _ in guard.attempts():
        run_step(moes, x.clone().requires_grad_(True), guard)
    one_layer = pool_rows(TOKENS, TOP_K, world, 4, ALIGN, 1, 1.0)
    assert guard.replays == 1 and not guard.grown, guard.__dict__
    assert guard.pool_grown and guard.pool_grown[0][0] == one_layer, guard.pool_grown
    assert overflows[0].pool_only and overflows[0].pool_grown == guard.pool_grown
    release_peer_buffers()
    activation_pool.release_pools()


def test_an_overflowed_attempts_layer_stays_out_and_the_first_replay_reports_the_pools_growth():
    preload()
    run_forked(2, _pool_telemetry, timeout_s=300)


# Per layer, the two experts each rank's tokens all pick (rank 0 holds experts 0-3). Rank 0's
# rows: layer 0, 64 + 64 and two empty experts padded to 8 (144, the most any dispatch needs);
# layer 1, 32 on each of its experts (128); the last layer, never pooled, as layer 0. The
# capacity (112 rows) cuts both.
CUT_LAYERS = (((0, 1), (0, 1)), ((0, 1), (2, 3)), ((0, 1), (0, 1)))


def _own_rows(layer, rank, world):
    per_expert = [0] * (4 * world)
    for choice in layer:
        for e in choice:
            per_expert[e] += TOKENS
    mine = per_expert[rank * 4 : (rank + 1) * 4]
    return sum(-(-max(n, ALIGN) // ALIGN) * ALIGN for n in mine)


def _cut_layers_demand(rank, world):
    setup_rank()
    need = [sum(_own_rows(layer, r, world) for layer in CUT_LAYERS[:-1]) for r in range(world)]
    # the largest trustworthy rows of the step (layer 0's): a demand for every cut layer at
    # them would pass the ceiling chosen below
    largest = max(_own_rows(CUT_LAYERS[0], r, world) for r in range(world))
    padded_guess = (LAYERS - 1) * largest
    factors = [f / 100 for f in range(100, 1000)]
    ceiling = next(f for f in factors if pool_rows(TOKENS, TOP_K, world, 4, ALIGN, LAYERS - 1, f) >= max(need))
    assert pool_rows(TOKENS, TOP_K, world, 4, ALIGN, LAYERS - 1, ceiling) < padded_guess, "not a telling ceiling"
    a2a = A2AConfig(**{**POOLED, "activation_pool_ceiling": ceiling})
    results = {}
    for name, config in (("worst", A2AConfig(**WORST)), ("pooled", a2a)):
        release_peer_buffers()
        activation_pool.release_pools()
        moes = stack(world, config)
        guard = elastic.ReplayGuard([m for moe in moes for m in moe.modules()])
        for n, cut in enumerate((False, True)):
            for moe, layer in zip(moes, CUT_LAYERS, strict=True):
                with torch.no_grad():
                    moe.expert_bias.zero_()
                    if cut:
                        moe.expert_bias[list(layer[rank])] = 1e4
            x = torch.randn(1, TOKENS, DIM, generator=torch.Generator().manual_seed(10 * n + rank))
            x = x.to(torch.bfloat16).requires_grad_(True)
            spills = guard.spills
            for _ in guard.attempts():
                x.grad = None
                loss = run_step(moes, x, guard)
        results[name] = (loss.detach(), x.grad, guard.spills - spills, guard.pool_spilled)
    (loss, grad, _, _), (got_loss, got_grad, spills, pool_spilled) = results["worst"], results["pooled"]
    assert torch.equal(loss, got_loss) and torch.equal(grad, got_grad)
    assert spills == 0 and not pool_spilled, (spills, pool_spilled, need, ceiling)
    release_peer_buffers()
    activation_pool.release_pools()


def test_a_cut_layers_pool_demand_is_its_own_routed_rows():
    preload()
    run_forked(2, _cut_layers_demand, timeout_s=300)


@pytest.mark.parametrize("first", [0, symm.NO_OVERFLOW])
def test_only_a_pool_overflow_is_pool_only(first):
    assert elastic.Overflow(replay=True, first=first).pool_only == (first == symm.NO_OVERFLOW)
    assert not elastic.Overflow(replay=False, first=first).pool_only


def test_overflows_of_the_pool_alone_always_make_progress():
    """A pipeline schedule's microbatches may overflow only the pool several reruns in a row
    (each grows it, up to its ceiling, then the step spills): never a ``ReplayLimitError``. A
    dispatch whose first overflow does not move later still is one, naming the capacity."""
    reruns = elastic._Reruns("step 7", elastic.MAX_REPLAYS)
    for rows in range(2 * elastic.MAX_REPLAYS):
        reruns.admit(elastic.Overflow(replay=True, first=symm.NO_OVERFLOW, pool_grown=[(rows, rows + 1)]))
    for _ in range(elastic.MAX_REPLAYS):  # no dispatch overflowed before: none of these moved it later
        reruns.admit(elastic.Overflow(replay=True, first=3))
    with pytest.raises(elastic.ReplayLimitError, match=r"step 7: a symm dispatch overflowed its expert capacity .* "
                                                       r"\(now dispatch 3 of the step"):
        reruns.admit(elastic.Overflow(replay=True, first=3))
