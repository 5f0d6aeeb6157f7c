"""The symm transport's elastic capacity (``mxfp8_ep.elastic``, ``dispatcher.symm``), on gloo
process groups of 2-4 CPU ranks (shared-memory peers), torch twins and the Triton kernels under
the interpreter:

* balanced, Zipf and all-to-one routings at the default ``capacity_factor`` give, bit for bit,
  what the worst-case capacity gives; a routing that overflows replays exactly once, one that
  fits never; past the ceiling a step spills (reruns at exactly its rows) and still matches;
* an overflow on one EP group replays every rank of the world, and grows that group alone;
* without a replay guard nothing overflows: a dispatch reads its rows on the host and grows
  (or spills) before any row moves, says so once, and matches the worst case;
* the edges: an evaluation pass, buffers shared by dispatchers of different token counts,
  nested and closed guards, a token count that is None, an attempt abandoned by an exception,
  a huge factor, gradients zeroed before the attempts, the attempt cap;
* a training loop with a forced overflow (a capacity below the balanced case, DeepSeek-V3's
  load-balancing expert bias updated every step) replays, then matches the worst-case run's
  losses and gradients bit for bit over several steps; a trainer replays from the same
  batches, RNG, counters and token counts (torchtitan 0.2.2's and 0.3.0's ways of counting).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep import elastic, routing
from mxfp8_ep.capacity import (
    GROWTH_HEADROOM,
    CapacityStep,
    expert_major_capacity,
    grown_capacity,
    next_capacity,
    worst_case_capacity,
)
from mxfp8_ep.config import DEFAULT_CAPACITY_FACTOR, A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher, release_peer_buffers
from mxfp8_ep.dispatcher import symm
from tests.distributed import SHARED_GPU, rank_device, run_on_ranks
from tests.moe_harness import bits, preload, run_forked, setup_rank
from tests.round_trips import replayed, round_trip

TOKENS = 64  # per rank: every token to one rank then overflows 1.25x the balanced case and its padding
DIM = 64
ALIGN = 8


def test_capacity_is_the_factor_times_the_balanced_case_and_grows_to_the_worst_case_at_most():
    T, K, W, L = 1000, 6, 8, 8
    worst = worst_case_capacity(T, K, W, L, ALIGN)
    assert worst == W * T * K + L * ALIGN
    assert expert_major_capacity(T, K, W, L, ALIGN) == worst  # factor None: the worst case
    balanced = expert_major_capacity(T, K, W, L, ALIGN, 1.0)
    assert balanced == T * K + L * ALIGN
    default = expert_major_capacity(T, K, W, L, ALIGN, DEFAULT_CAPACITY_FACTOR)
    assert default == -(-int(DEFAULT_CAPACITY_FACTOR * T * K) // ALIGN) * ALIGN + L * ALIGN
    assert expert_major_capacity(T, K, W, L, ALIGN, 100.0) == worst
    for huge in (1e308, float(2**70)):  # a float past any int the rows could be: the worst case, no OverflowError
        assert expert_major_capacity(T, K, W, L, ALIGN, huge) == worst
    grown = grown_capacity(balanced + 1, worst, ALIGN)
    assert grown % ALIGN == 0 and grown >= (balanced + 1) * (1 + GROWTH_HEADROOM)
    assert grown_capacity(worst, worst, ALIGN) == worst


def test_the_rule_fits_grows_up_to_the_ceiling_and_spills_past_it():
    worst, ceiling, capacity = 4000, 2000, 1000
    assert next_capacity(1000, capacity, ceiling, worst, ALIGN) == CapacityStep("fits", 1000, 0)
    step = next_capacity(1200, capacity, ceiling, worst, ALIGN)
    assert step.kind == "grow" and step.capacity == step.step_rows == grown_capacity(1200, worst, ALIGN)
    step = next_capacity(1900, capacity, ceiling, worst, ALIGN)  # grown past the ceiling: held at it
    assert step.kind == "grow" and step.capacity == step.step_rows == ceiling
    step = next_capacity(2001, capacity, ceiling, worst, ALIGN)
    assert step == CapacityStep("spill", ceiling, 2008)  # exactly the rows, aligned
    assert next_capacity(2001, ceiling, ceiling, worst, ALIGN).capacity == ceiling  # never past it


@pytest.mark.parametrize("factor, ceiling, why", [
    (0, 2.0, "capacity_factor=0: expected a finite number > 0"),
    (float("inf"), None, "capacity_factor=inf: expected a finite number > 0"),
    (1.25, float("nan"), "capacity_ceiling=nan: expected a finite number > 0"),
])
def test_a_factor_or_ceiling_that_cannot_be_is_refused(factor, ceiling, why):
    with pytest.raises(ValueError, match=why):
        A2AConfig(capacity_factor=factor, capacity_ceiling=ceiling).check()
    A2AConfig(capacity_factor=8, capacity_ceiling=2.0).check()  # grows to the larger: no growth past 8


def _routing(kind: str, rank: int, world: int, num_experts: int, top_k: int, g: torch.Generator, tokens=TOKENS):
    """(tokens, top_k) expert ids of this rank: distinct experts per token, drawn uniformly
    (``balanced``), with Zipf weights over the experts (``zipf``: expert e weighs 1/(e+1)), or
    every pick one of rank 0's experts (``all_to_one``; a token may repeat one)."""
    if kind == "all_to_one":
        return torch.randint(0, num_experts // world, (tokens, top_k), generator=g)
    weights = torch.ones(num_experts) if kind == "balanced" else 1.0 / torch.arange(1, num_experts + 1)
    return torch.stack([torch.multinomial(weights, top_k, replacement=False, generator=g) for _ in range(tokens)])


def _config(world, preset, factor, kernel, top_k, num_experts, score_before=False, ceiling=None,
            max_tokens=TOKENS):
    return TokenDispatcher.Config(
        num_experts=num_experts, top_k=top_k, pad_multiple=ALIGN, max_tokens_per_rank=max_tokens,
        score_before_experts=score_before,
        a2a=A2AConfig.preset(preset, transport="symm", kernel=kernel, capacity_factor=factor,
                             capacity_ceiling=ceiling),
    )


def _inputs(kind, rank, world, num_experts, top_k, seed, tokens=TOKENS):
    """On the rank's device (the CPU, or the GPU its ranks share)."""
    g = torch.Generator().manual_seed(seed)
    ids = _routing(kind, rank, world, num_experts, top_k, g, tokens)
    x = torch.randn(tokens, DIM, generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, top_k, generator=g)
    inputs = x, scores, ids, torch.bincount(ids.reshape(-1), minlength=num_experts)
    return tuple(t.to(rank_device()) for t in inputs)


def _needed(ids: torch.Tensor, num_experts: int, group=None) -> int:
    """The rows the largest expert-major tensor of the group needs for every rank's ``ids``."""
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts)  # gloo's all_gather on the host
    table = [torch.zeros_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, counts, group=group)
    return int(routing.rows_needed(torch.stack(table), ALIGN))


def _assert_same(got, want, where):
    for a, b, what in zip(got, want, ("routed", "out", "x grad", "score grad"), strict=True):
        assert a.shape == b.shape and torch.equal(bits(a), bits(b)), f"{what} differs: {where}"


def _worst_case(world, inputs, preset, kernel, top_k, num_experts, score_before=False):
    release_peer_buffers()
    dispatcher = _config(world, preset, None, kernel, top_k, num_experts, score_before).build(
        dist.group.WORLD, rank_device())
    want, replays = replayed(lambda: round_trip(dispatcher, *inputs))
    assert replays == 0
    return want


# (preset, top-k, router scores before the experts): a weighted expert-bound leg each way, both
# partial-sum legs (DeepSeek-V3: top-k > 1, scores after), and top-1 row by row (Llama4).
CASES = (("bf16", 2, False), ("mxfp8_all", 4, False), ("mxfp8", 1, True))


def _match_the_worst_case(rank, world, kernel, combos):
    setup_rank()
    for kind, (preset, top_k, score_before) in combos:
        num_experts = 4 * world
        inputs = _inputs(kind, rank, world, num_experts, top_k, 7 * rank + len(kind) + top_k)
        where = f"rank {rank}/{world} {kernel} {kind} {preset} top-{top_k}"
        want = _worst_case(world, inputs, preset, kernel, top_k, num_experts, score_before)
        release_peer_buffers()
        dispatcher = _config(world, preset, DEFAULT_CAPACITY_FACTOR, kernel, top_k, num_experts, score_before).build(
            dist.group.WORLD, rank_device())
        got, replays = replayed(lambda: round_trip(dispatcher, *inputs))
        capacity = expert_major_capacity(TOKENS, top_k, world, num_experts // world, ALIGN, DEFAULT_CAPACITY_FACTOR)
        overflows = _needed(inputs[2], num_experts) > capacity
        assert replays == int(overflows), f"{replays} replays, overflow: {overflows}: {where}"
        if kind == "all_to_one":
            assert overflows, where
        _assert_same(got, want, where)
    release_peer_buffers()


ALL_COMBOS = [(kind, case) for kind in ("balanced", "zipf", "all_to_one") for case in CASES]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_routings_at_the_default_capacity_match_the_worst_case(world):
    preload(titan=False)
    run_forked(world, _match_the_worst_case, "torch", ALL_COMBOS)


def test_the_triton_kernels_at_the_default_capacity_match_the_worst_case():
    """The Triton kernels (under the interpreter) on a routing that overflows: the push and
    receiving kernels of both MXFP8 cases (token-once pushes with partial sums; row by row)
    run at a cut capacity, then at the grown one. (tests/test_symm_kernels.py holds every
    kernel to its torch twin, bf16 included.)"""
    import mxfp8_ep.symm_kernels  # noqa: F401  (Triton and the kernels, once, before the ranks fork)

    preload(titan=False)
    run_forked(2, _match_the_worst_case, "triton", [("all_to_one", case) for case in CASES[1:]], timeout_s=300)


needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the ranks share it)")


@needs_a_gpu
@pytest.mark.parametrize("world", [2, 4])
def test_the_compiled_kernels_at_the_default_capacity_match_the_worst_case_sharing_one_gpu(world):
    """The CPU checks above on real GPU processes (``tests.shared_gpu``): compiled Triton
    kernels, CUDA counters and the replay's one device-to-host read, every routing and preset."""
    run_on_ranks(world, _match_the_worst_case, "triton", ALL_COMBOS, backend=SHARED_GPU, timeout_s=300)


@needs_a_gpu
def test_a_step_past_the_ceiling_spills_and_matches_the_worst_case_sharing_one_gpu():
    run_on_ranks(2, _spill_past_the_ceiling, backend=SHARED_GPU, timeout_s=300)


def _spill_past_the_ceiling(rank, world):
    """A ceiling at the starting factor: an all-to-one routing needs more, so the step spills:
    it reruns with each dispatch reading its rows and taking exactly those, and matches the
    worst case; the capacity stays at the ceiling and the next step, balanced, runs there
    without a rerun. Without a guard the same routing spills inside the dispatch. The kernels
    are the device's (torch twins on the CPU, compiled Triton on a GPU)."""
    setup_rank()
    num_experts, (preset, top_k, score_before) = 4 * world, CASES[1]
    skewed = _inputs("all_to_one", rank, world, num_experts, top_k, rank)
    balanced = _inputs("balanced", rank, world, num_experts, top_k, 10 + rank)
    want = _worst_case(world, skewed, preset, "auto", top_k, num_experts, score_before)
    for guarded in (True, False):
        release_peer_buffers()
        dispatcher = _config(world, preset, 1.25, "auto", top_k, num_experts, score_before, ceiling=1.25).build(
            dist.group.WORLD, rank_device())
        ceiling = expert_major_capacity(TOKENS, top_k, world, num_experts // world, ALIGN, 1.25)
        guard = elastic.ReplayGuard(())
        if guarded:
            for _ in guard.attempts():
                got = round_trip(dispatcher, *skewed)
            assert (guard.replays, guard.spills) == (1, 1), guard.__dict__
            assert guard.spilled == [(ceiling, _needed(skewed[2], num_experts))]
        else:
            got = round_trip(dispatcher, *skewed)
        _assert_same(got, want, f"rank {rank} guarded={guarded}")
        assert elastic.capacity_rows() == ceiling  # the spill's size lasted one step
        for _ in guard.attempts():
            round_trip(dispatcher, *balanced)
        assert guard.replays == int(guarded) and symm.capacities() == [ceiling]
        assert [b.capacity for b in symm._BUFFERS.values()] == [ceiling]
    release_peer_buffers()


def test_a_step_past_the_ceiling_spills_and_matches_the_worst_case():
    preload(titan=False)
    run_forked(2, _spill_past_the_ceiling)


def _one_group_overflows(rank, world):
    """Two EP groups of 2: the first routes every token to one rank, the second evenly."""
    setup_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    num_experts, top_k = 8, 2
    g = torch.Generator().manual_seed(rank)
    kind = "all_to_one" if rank < 2 else "balanced"
    ids = _routing(kind, rank % 2, 2, num_experts, top_k, g)
    x = torch.randn(TOKENS, DIM, generator=g)
    scores = torch.rand(TOKENS, top_k, generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    config = _config(2, "bf16", DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts, ceiling=4.0)
    dispatcher = config.build(group, "cpu")
    before = elastic.capacity_rows() or 0
    guard = elastic.ReplayGuard(())
    for attempt in guard.attempts():
        round_trip(dispatcher, x, scores, ids, counts)
        if attempt == 0:
            before = elastic.capacity_rows()
    assert guard.replays == 1, (rank, guard.replays)  # every rank of the world replays
    if rank < 2:
        (old, new), = guard.grown
        assert old == before < _needed(ids, num_experts, group) <= new == elastic.capacity_rows(), (rank, guard.grown)
    else:
        assert guard.grown == [] and elastic.capacity_rows() == before, (rank, guard.grown)
    release_peer_buffers()


def test_an_overflow_in_one_ep_group_replays_every_rank_and_grows_that_group():
    preload(titan=False)
    run_forked(4, _one_group_overflows)


class _HostReads:
    """Counts the host reads of the row count a dispatch outside a replay scope makes
    (``SymmTokenDispatcher._fit``)."""

    def __init__(self, monkeypatch):
        self.rows: list[int] = []
        fit = symm.SymmTokenDispatcher._fit

        def counted(disp, bufs, needed):
            self.rows.append(needed)
            return fit(disp, bufs, needed)

        monkeypatch.setattr(symm.SymmTokenDispatcher, "_fit", counted)


def _without_a_guard(rank, world, caplog):
    """No guard, the library's defaults (torchtitan's own Trainer, or a loop of one's own): an
    all-to-one routing runs, grows before any row moves and matches the worst case; the host
    read is announced once per process; a step inside a guard afterwards reads nothing."""
    import _pytest.monkeypatch

    setup_rank()
    mp = _pytest.monkeypatch.MonkeyPatch()
    reads = _HostReads(mp)
    num_experts, (preset, top_k, score_before) = 4 * world, CASES[0]
    skewed = _inputs("all_to_one", rank, world, num_experts, top_k, rank)
    want = _worst_case(world, skewed, preset, "torch", top_k, num_experts, score_before)
    reads.rows.clear()  # the worst case never reads
    release_peer_buffers()
    config = TokenDispatcher.Config(num_experts=num_experts, top_k=top_k, pad_multiple=ALIGN,
                                    max_tokens_per_rank=TOKENS,
                                    a2a=A2AConfig.preset(preset, transport="symm", kernel="torch"))
    dispatcher = config.build(dist.group.WORLD, rank_device())
    symm._ANNOUNCED.clear()
    balanced = _inputs("balanced", rank, world, num_experts, top_k, 10 + rank)
    with caplog.at_level(logging.WARNING, logger="mxfp8_ep.dispatcher.symm"):
        round_trip(dispatcher, *balanced)
        _assert_same(round_trip(dispatcher, *skewed), want, f"rank {rank}")
        _assert_same(round_trip(dispatcher, *skewed), want, f"rank {rank}")
    worst = worst_case_capacity(TOKENS, top_k, world, num_experts // world, ALIGN)
    grown = min(worst, grown_capacity(_needed(skewed[2], num_experts), worst, ALIGN))
    assert elastic.capacity_rows() == grown
    # One read per dispatch (here one per round trip), none once the capacity is the worst case.
    assert reads.rows == [_needed(balanced[2], num_experts)] + [_needed(skewed[2], num_experts)] * (
        1 + (grown < worst)), reads.rows
    announced = [r for r in caplog.records if "outside a replay scope" in r.getMessage()]
    assert len(announced) == 1, caplog.text
    reads.rows.clear()
    replayed(lambda: round_trip(dispatcher, *skewed))
    assert reads.rows == []
    mp.undo()
    release_peer_buffers()


def test_without_a_guard_an_imbalanced_routing_grows_before_it_moves_a_row(caplog):
    preload(titan=False)
    run_forked(2, _without_a_guard, caplog)


def _eval_pass(rank, world):
    """An evaluation pass at the default capacity (no backward, under no_grad): outside a
    guard, or with each batch through ``ReplayGuard(owns_gradients=False)``, a routing that
    overflows gives the worst case's output; the guard leaves the training gradients alone."""
    setup_rank()
    num_experts, (preset, top_k, _) = 4 * world, CASES[1]
    skewed = _inputs("all_to_one", rank, world, num_experts, top_k, rank)
    x, scores, ids, counts = skewed

    def forward(dispatcher):
        with torch.no_grad():
            routed, _, meta = dispatcher.dispatch(x, scores, ids, counts)
            return dispatcher.combine(routed.clone(), meta)

    release_peer_buffers()
    want = forward(_config(world, preset, None, "torch", top_k, num_experts).build(dist.group.WORLD, rank_device()))
    weight = torch.nn.Linear(2, 2)
    weight.weight.grad = torch.ones(2, 2)
    for guarded in (False, True):
        release_peer_buffers()
        dispatcher = _config(world, preset, DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts).build(
            dist.group.WORLD, rank_device())
        if guarded:
            guard = elastic.ReplayGuard([weight], owns_gradients=False)
            for _ in guard.attempts():
                got = forward(dispatcher)
            assert guard.replays == 1
        else:
            got = forward(dispatcher)
        assert torch.equal(bits(got), bits(want)), (rank, guarded)
    assert torch.equal(weight.weight.grad, torch.ones(2, 2))
    release_peer_buffers()


def test_an_evaluation_pass_that_overflows_gives_the_worst_cases_output():
    preload(titan=False)
    run_forked(2, _eval_pass)


def _edges(rank, world):
    """The edges of the contract, one world:

    * two dispatchers sharing a buffer set with different token counts: the second's
      re-allocation keeps the first's overflow, which replays;
    * ``max_tokens_per_rank=None``: 16 tokens, then 8 that overflow, then 16 again run as the
      worst case runs them (the buffers never shrink to 8 tokens);
    * an inner guard that finishes leaves the outer attempt sync-free, and its overflow replays;
    * an attempt abandoned by an exception after an overflow: the next guarded step that fits
      does not replay;
    * gradients zeroed once before the attempts: a rerun does not add the first attempt's again;
    * a factor of 1e308 is the worst case.
    """
    setup_rank()
    num_experts, (preset, top_k, _) = 4 * world, CASES[1]
    group = dist.group.WORLD

    # Shared buffers, different token counts.
    skewed = _inputs("all_to_one", rank, world, num_experts, top_k, rank)
    balanced = _inputs("balanced", rank, world, num_experts, top_k, 20 + rank)
    want = _worst_case(world, skewed, preset, "torch", top_k, num_experts)
    release_peer_buffers()
    small = _config(world, preset, DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts).build(group, "cpu")
    large = _config(world, preset, DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts,
                    max_tokens=2 * TOKENS).build(group, "cpu")
    guard = elastic.ReplayGuard(())
    for _ in guard.attempts():
        got = round_trip(small, *skewed)  # overflows ...
        round_trip(large, *balanced)  # ... then re-allocates the set for twice the tokens
    assert guard.replays == 1, "the re-allocation lost the overflow"
    _assert_same(got, want, f"rank {rank} shared buffers")

    # max_tokens_per_rank=None: the buffers keep the largest token count.
    release_peer_buffers()
    auto = _config(world, preset, DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts, max_tokens=None).build(
        group, "cpu")
    few = _inputs("all_to_one", rank, world, num_experts, top_k, 30 + rank, tokens=TOKENS * 3 // 4)
    for inputs in (balanced, few, balanced):
        replayed(lambda: round_trip(auto, *inputs))  # noqa: B023
    assert [b.max_tokens for b in symm._BUFFERS.values()] == [TOKENS]

    # A guard inside an attempt of another.
    release_peer_buffers()
    dispatcher = _config(world, preset, DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts).build(group, "cpu")
    outer = elastic.ReplayGuard(())
    for attempt in outer.attempts():
        replayed(lambda: round_trip(dispatcher, *balanced))
        assert symm.in_replay_scope()
        if attempt == 0:
            got = round_trip(dispatcher, *skewed)
    assert outer.replays == 1

    # An attempt abandoned after an overflow.
    release_peer_buffers()
    dispatcher = _config(world, preset, DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts).build(group, "cpu")
    try:
        for _ in elastic.ReplayGuard(()).attempts():
            round_trip(dispatcher, *skewed)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert not symm.in_replay_scope()
    _, replays = replayed(lambda: round_trip(dispatcher, *balanced))
    assert replays == 0

    # Gradients zeroed before the attempts.
    release_peer_buffers()
    dispatcher = _config(world, preset, DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts).build(group, "cpu")
    x, scores, ids, counts = skewed
    weight = torch.nn.Linear(DIM, DIM, bias=False).to(torch.bfloat16)
    weight.weight.grad = None
    grads = {}
    for guarded in (False, True):
        weight.zero_grad()
        guard = elastic.ReplayGuard([weight])
        for _ in (guard.attempts() if guarded else [0]):
            routed, per_expert, meta = dispatcher.dispatch(x, scores, ids, counts)
            n = int(per_expert.sum())  # the rows past the expert segments hold nothing
            experts_out = torch.cat([weight(routed[:n]), routed[n:].detach()])
            dispatcher.combine(experts_out, meta).float().sum().backward()
        grads[guarded] = weight.weight.grad.clone()
        assert guard.replays == 0 or guarded
    assert torch.equal(bits(grads[True]), bits(grads[False])), "a rerun added to the first attempt's gradients"

    # A huge factor.
    release_peer_buffers()
    dispatcher = _config(world, preset, 1e308, "torch", top_k, num_experts, ceiling=1e308).build(group, "cpu")
    got, replays = replayed(lambda: round_trip(dispatcher, *skewed))
    assert replays == 0 and elastic.capacity_rows() == worst_case_capacity(TOKENS, top_k, world, 4, ALIGN)
    _assert_same(got, want, f"rank {rank} factor 1e308")
    release_peer_buffers()


def test_the_edges_of_the_replay_contract():
    preload(titan=False)
    run_forked(2, _edges)


def _attempt_cap(rank, world):
    """A routing that overflows every attempt (it changes between attempts): after
    ``MAX_REPLAYS`` reruns an error naming why, on every rank, and no scope left open."""
    setup_rank()
    num_experts, top_k = 4 * world, 2
    release_peer_buffers()
    config = _config(world, "bf16", 0.0625, "torch", top_k, num_experts, ceiling=None)
    dispatcher = config.build(dist.group.WORLD, rank_device())
    guard = elastic.ReplayGuard(())
    tokens = [4]
    with pytest.raises(elastic.ReplayLimitError, match="routing differs between runs"):
        for _ in guard.attempts():
            tokens[0] *= 2
            round_trip(dispatcher, *_inputs("all_to_one", rank, world, num_experts, top_k, rank, tokens=tokens[0]))
    assert guard.replays == elastic.MAX_REPLAYS and not symm.in_replay_scope()
    release_peer_buffers()


def test_a_step_that_overflows_every_rerun_stops_with_a_clear_error():
    preload(titan=False)
    run_forked(2, _attempt_cap)


def _train(rank, world, factor, steps, g_seed):
    """A DeepSeek-V3-like torchtitan MoE layer (sigmoid scores after the experts, expert bias
    updated from the tokens each expert got, as torchtitan's load balancing does before the
    optimizer) under EP over the group, trained with SGD through a ``ReplayGuard``: per step its
    loss, its gradients with the tokens each expert got (what the bias update reads: a replay
    must not count a step's tokens twice), and the replays."""
    from torchtitan.models.moe import MoE, MoEArgs
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp

    from mxfp8_ep.titan022 import install_expert_parallel, uninstall_expert_parallel

    torch.manual_seed(0)
    args = MoEArgs(num_experts=4 * world, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True,
                   score_before_experts=False, use_grouped_mm=False, load_balance_coeff=1e-2)
    moe = MoE(args, dim=DIM, hidden_dim=32)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device("cpu"))
    install_expert_parallel(A2AConfig.preset("mxfp8_all", transport="symm", capacity_factor=factor),
                            max_tokens_per_rank=TOKENS)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        block = torch.nn.Module()
        block.moe, block.moe_enabled = moe, True
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleDict({"0": block})  # what torchtitan's parallelize walks
        apply_moe_ep_tp(model, tp_mesh=None, ep_mesh=mesh, etp_mesh=None, ep_etp_mesh=None)
    finally:
        uninstall_expert_parallel()
    params = [p for p in moe.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    guard = elastic.ReplayGuard(moe.modules())
    g = torch.Generator().manual_seed(g_seed + rank)
    history = []
    try:
        for _ in range(steps):
            x = torch.randn(1, TOKENS, DIM, generator=g)
            for _ in guard.attempts():
                opt.zero_grad()
                loss = (moe(x).float() ** 2).mean()
                loss.backward()
            with torch.no_grad():  # torchtitan's load-balancing update of the expert bias
                tokens = moe.tokens_per_expert.clone()
                dist.all_reduce(tokens)
                moe.expert_bias.add_(args.load_balance_coeff * torch.sign(tokens.mean() - tokens))
                moe.tokens_per_expert.zero_()
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad.clone() for p in params]
            history.append((loss.detach(), [*grads, tokens], guard.replays))
            opt.step()
    finally:
        release_peer_buffers()
    return history


def _replayed_training(rank, world):
    setup_rank()
    from launch.titan.cpu_compat import apply_cpu_compat

    apply_cpu_compat(force=True)
    worst = _train(rank, world, None, steps=4, g_seed=5)
    # Half the balanced case: the first step overflows, replays once, and the grown capacity holds.
    elastic_run = _train(rank, world, 0.5, steps=4, g_seed=5)
    assert [r for *_, r in worst] == [0, 0, 0, 0]
    assert elastic_run[0][2] == 1, [r for *_, r in elastic_run]
    for step, ((loss, grads, _), (want_loss, want_grads, _)) in enumerate(zip(elastic_run, worst, strict=True)):
        assert torch.equal(bits(loss), bits(want_loss)), (rank, step, loss, want_loss)
        for got, want in zip(grads, want_grads, strict=True):
            assert torch.equal(bits(got), bits(want)), (rank, step)


def test_a_replayed_training_matches_the_worst_case_bit_for_bit():
    preload()
    run_forked(2, _replayed_training, timeout_s=120)


class _StubTrainer:
    """torchtitan's ``Trainer`` as far as the replay touches it: ``train_step`` zeroes the
    gradients, draws its microbatches, runs ``forward_backward_step`` on each, then steps the
    optimizer; here every forward-backward records what it saw and adds to a load-balancing
    counter, and a scripted overflow counter stands in for the dispatches. Token counts as
    torchtitan keeps them: 0.2.2 adds each microbatch's tokens as it is drawn, 0.3.0 adds to
    ``ntokens_seen`` in each forward-backward (``post_dataloading_process``)."""

    gradient_accumulation_steps = 2

    def __init__(self, overflows: list[bool], counts_in: str = "draw"):
        layer = torch.nn.Module()
        layer.register_buffer("tokens_per_expert", torch.zeros(2))
        self.model_parts = [layer]
        self.overflows, self.seen, self.optimizer_steps, self.step = overflows, [], 0, 1
        self.counts_in, self.ntokens_seen = counts_in, 0

    def _draw(self, data_iterator):
        batch = next(data_iterator)
        if self.counts_in == "draw":
            self.ntokens_seen += 10
        return batch

    def train_step(self, data_iterator):
        batches = [self._draw(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        for batch in batches:
            self.forward_backward_step(batch)
        self.optimizer_steps += 1

    def forward_backward_step(self, batch):
        if self.counts_in == "forward":
            self.ntokens_seen += 10
        self.seen.append((batch, torch.rand(()).item()))
        self.model_parts[0].tokens_per_expert += 1
        return batch


def _scripted_overflow(trainer):
    def check(group=None, scope=None):
        return elastic.Overflow(replay=trainer.overflows.pop(0) if trainer.overflows else False)
    return check


@pytest.mark.parametrize("counts_in", ["draw", "forward"])
@pytest.mark.parametrize("how", ["mixin", "installed"])
def test_a_trainer_replays_an_overflowed_step_from_the_same_batches_rng_and_counters(how, counts_in, monkeypatch):
    cls = type("Trainer", (_StubTrainer,), {})
    if how == "mixin":
        cls = type("ReplayingTrainer", (elastic.ReplayOverflowedSteps, cls), {})
    else:
        elastic.install_replays(cls)
        elastic.install_replays(cls)  # idempotent
    trainer = cls([True, False], counts_in)
    monkeypatch.setattr(elastic, "check_overflow", _scripted_overflow(trainer))
    torch.manual_seed(0)
    trainer.train_step(iter(range(10)))
    first, second = trainer.seen[:2], trainer.seen[2:]
    assert first == second and [b for b, _ in first] == [0, 1], trainer.seen  # same batches, same RNG draws
    assert trainer.optimizer_steps == 1 and trainer.capacity_replays == 1
    assert trainer.model_parts[0].tokens_per_expert.tolist() == [2.0, 2.0]  # counted once
    assert trainer.ntokens_seen == 20, counts_in  # each microbatch's tokens once, however the trainer counts
    assert not symm.in_replay_scope()


def test_a_trainer_step_that_overflows_every_rerun_stops_with_a_clear_error(monkeypatch):
    cls = type("ReplayingTrainer", (elastic.ReplayOverflowedSteps, _StubTrainer), {})
    trainer = cls([True] * 10)
    monkeypatch.setattr(elastic, "check_overflow", _scripted_overflow(trainer))
    with pytest.raises(elastic.ReplayLimitError, match="step 1: .*routing differs between runs"):
        trainer.train_step(iter(range(100)))
    assert trainer.capacity_replays == elastic.MAX_REPLAYS and not symm.in_replay_scope()


def test_a_trainer_that_checks_no_capacity_saves_and_reads_nothing(monkeypatch):
    """``checks_capacity = False`` (every rank knows no symm dispatch runs at an elastic
    capacity: the recipe with nccl, or symm at the worst case): no overflow check, no read, no
    step state saved."""
    cls = type("ReplayingTrainer", (elastic.ReplayOverflowedSteps, _StubTrainer), {"checks_capacity": False})
    trainer = cls([True])

    def trap(*_args, **_kwargs):
        raise AssertionError("checked or saved")

    monkeypatch.setattr(elastic, "check_overflow", trap)
    monkeypatch.setattr(elastic, "StepState", trap)
    trainer.train_step(iter(range(10)))
    assert trainer.optimizer_steps == 1 and trainer.capacity_replays == 0 and len(trainer.seen) == 2
