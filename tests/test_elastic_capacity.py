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

from mxfp8_ep import elastic
from mxfp8_ep.exchange import routing
from mxfp8_ep.exchange.capacity import (
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
    allocations = _PeerAllocations()
    for kind, (preset, top_k, score_before) in combos:
        num_experts = 4 * world
        inputs = _inputs(kind, rank, world, num_experts, top_k, 7 * rank + len(kind) + top_k)
        where = f"rank {rank}/{world} {kernel} {kind} {preset} top-{top_k}"
        want = _worst_case(world, inputs, preset, kernel, top_k, num_experts, score_before)
        release_peer_buffers()
        allocations.count = 0
        dispatcher = _config(world, preset, DEFAULT_CAPACITY_FACTOR, kernel, top_k, num_experts, score_before).build(
            dist.group.WORLD, rank_device())
        got, replays = replayed(lambda: round_trip(dispatcher, *inputs))
        capacity = expert_major_capacity(TOKENS, top_k, world, num_experts // world, ALIGN, DEFAULT_CAPACITY_FACTOR)
        overflows = _needed(inputs[2], num_experts) > capacity
        assert replays == int(overflows), f"{replays} replays, overflow: {overflows}: {where}"
        if kind == "all_to_one":
            assert overflows, where
        _assert_same(got, want, where)
        # Growth took no symmetric memory: the first dispatch's count buffer and staging pair.
        assert allocations.count == 3, (allocations.count, where)
    allocations.undo()
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
    import mxfp8_ep.exchange.symm_kernels  # noqa: F401  (Triton and the kernels, once, before the ranks fork)

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
    allocations = _PeerAllocations()
    for guarded in (True, False):
        release_peer_buffers()
        allocations.count = 0
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
        # The spill took no symmetric memory: one count buffer and one pair of staging buffers,
        # all of them counted.
        assert allocations.count == 3, allocations.count
        assert symm.peer_buffer_nbytes() == allocations.nbytes
    allocations.undo()
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


class _PeerAllocations:
    """Counts the peer buffers the symm transport allocates (``count``) and the bytes of those
    it holds (``nbytes``: the live ones it allocated since the count was reset)."""

    def __init__(self):
        self.count, self.made = 0, []
        self._original = symm.PeerBuffer
        outer = self

        class Counted(symm.PeerBuffer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                outer.count += 1
                outer.made.append(self)

        symm.PeerBuffer = Counted

    @property
    def nbytes(self) -> int:
        held = {id(b.counts) for b in symm._BUFFERS.values()} | {
            id(s) for b in symm._BUFFERS.values() for s in b.staging}
        return sum(b.nbytes for b in self.made if id(b) in held)

    def undo(self) -> None:
        symm.PeerBuffer = self._original


class _HostReads:
    """Counts the host reads of the row count a dispatch outside a replay scope (or in an exact
    one) makes (``SymmTokenDispatcher._exact_rows``)."""

    def __init__(self, monkeypatch):
        self.rows: list[int] = []
        exact = symm.SymmTokenDispatcher._exact_rows

        def counted(disp, cap, needed, scopes):
            rows = exact(disp, cap, needed, scopes)
            self.rows.append(rows)
            return rows

        monkeypatch.setattr(symm.SymmTokenDispatcher, "_exact_rows", counted)


def _without_a_guard(rank, world, caplog):
    """No guard, the library's defaults (torchtitan's own Trainer, or a loop of one's own): an
    all-to-one routing runs at exactly the rows it needs, read before any row moves, and
    matches the worst case; the elastic capacity does not change; the host read is announced
    once per process; a step inside a guard afterwards reads nothing."""
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
    start = expert_major_capacity(TOKENS, top_k, world, num_experts // world, ALIGN, DEFAULT_CAPACITY_FACTOR)
    assert elastic.capacity_rows() == start
    # One read per dispatch (here one per round trip), each dispatch at exactly its rows.
    assert reads.rows == [_needed(balanced[2], num_experts)] + [_needed(skewed[2], num_experts)] * 2, reads.rows
    announced = [r for r in caplog.records if "outside a replay scope" in r.getMessage()]
    assert len(announced) == 1, caplog.text
    reads.rows.clear()
    replayed(lambda: round_trip(dispatcher, *skewed))
    assert reads.rows == []
    mp.undo()
    release_peer_buffers()


def test_without_a_guard_an_imbalanced_routing_takes_its_rows_before_it_moves_a_row(caplog):
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
    """A routing that overflows every attempt at its first dispatch (it needs more rows each
    attempt: the inputs change between attempts): the reruns make no progress, and after
    ``MAX_REPLAYS`` of them in a row an error saying what was observed, on every rank, and no
    scope left open."""
    setup_rank()
    num_experts, top_k = 4 * world, 2
    release_peer_buffers()
    config = _config(world, "bf16", 0.0625, "torch", top_k, num_experts, ceiling=None, max_tokens=512)
    dispatcher = config.build(dist.group.WORLD, rank_device())
    guard = elastic.ReplayGuard(())
    tokens = [16]  # 32 in the first attempt: it overflows
    with pytest.raises(elastic.ReplayLimitError, match="did not move later .*routing differs between runs"):
        for _ in guard.attempts():
            tokens[0] *= 2
            round_trip(dispatcher, *_inputs("all_to_one", rank, world, num_experts, top_k, rank, tokens=tokens[0]))
    # The first rerun made progress (there was no overflow before); the next MAX_REPLAYS did not.
    assert guard.replays == elastic.MAX_REPLAYS + 1 and not symm.in_replay_scope()
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
    assert trainer.capacity_replays == elastic.MAX_REPLAYS + 1 and not symm.in_replay_scope()


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


class _LossTrainer(_StubTrainer):
    """A stub whose forward-backward computes its loss with ``self.loss_fn`` between its forward
    and its backward, as torchtitan's (0.2.2 and 0.3.0) does; ``backwards`` counts backwards."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.backwards = 0

    def loss_fn(self, pred, labels):  # noqa: ARG002
        return pred

    def forward_backward_step(self, batch):
        self.seen.append((batch, torch.rand(()).item()))
        self.model_parts[0].tokens_per_expert += 1
        loss = self.loss_fn(batch, None)
        self.backwards += 1
        return loss


@pytest.mark.parametrize("how", ["mixin", "installed"])
def test_a_trainer_checks_after_each_forward_and_skips_an_overflowed_backward(how, monkeypatch):
    """The check runs as each microbatch's loss is computed: an overflow in the first
    microbatch's forward reruns the step before its backward and before the second microbatch;
    the rerun checks each microbatch's forward and, with no dispatch after them, reads nothing
    more at the step's end."""
    cls = type("Trainer", (_LossTrainer,), {})
    if how == "mixin":
        cls = type("ReplayingTrainer", (elastic.ReplayOverflowedSteps, cls), {})
    else:
        elastic.install_replays(cls)
    trainer = cls([True, False, False])
    checks = []
    scripted = _scripted_overflow(trainer)

    def check(group=None, scope=None):
        checks.append(trainer.backwards)
        return scripted(group, scope)

    monkeypatch.setattr(elastic, "check_overflow", check)
    trainer.train_step(iter(range(10)))
    assert checks == [0, 0, 1], checks  # after each forward, before its backward; none at the end
    assert trainer.backwards == 2 and trainer.capacity_replays == 1  # the overflowed attempt ran no backward
    assert [b for b, _ in trainer.seen] == [0, 0, 1] and trainer.optimizer_steps == 1
    assert trainer.model_parts[0].tokens_per_expert.tolist() == [2.0, 2.0]
    assert "loss_fn" not in vars(trainer)  # the check is unwrapped after each forward-backward


def _forward_done(rank, world):
    """``ReplayGuard.forward_done`` between forward and backward: an overflowed attempt runs no
    backward, the check is not repeated at the attempt's end, and the result is the worst
    case's."""
    setup_rank()
    num_experts, (preset, top_k, score_before) = 4 * world, CASES[0]
    skewed = _inputs("all_to_one", rank, world, num_experts, top_k, rank)
    want = _worst_case(world, skewed, preset, "torch", top_k, num_experts, score_before)
    release_peer_buffers()
    dispatcher = _config(world, preset, DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts).build(
        dist.group.WORLD, rank_device())
    checks = []
    check = elastic.check_overflow

    def counted(*args, **kwargs):
        checks.append(1)
        return check(*args, **kwargs)

    elastic.check_overflow = counted
    guard = elastic.ReplayGuard(())
    backwards = 0
    try:
        for _ in guard.attempts():
            x, scores, ids, counts = (t.clone() for t in skewed)
            x.requires_grad_(True)
            scores.requires_grad_(True)
            routed, per_expert, meta = dispatcher.dispatch(x, scores, ids, counts)
            out = dispatcher.combine(routed.clone(), meta)
            if guard.forward_done():
                out.backward(torch.ones_like(out))
                backwards += 1
    finally:
        elastic.check_overflow = check
    assert (guard.replays, backwards, len(checks)) == (1, 1, 2), (guard.replays, backwards, checks)
    got = routed.detach()[: int(per_expert.sum())], out.detach(), x.grad, scores.grad
    _assert_same(got, want, f"rank {rank}")
    with pytest.raises(RuntimeError, match="inside a `for _ in guard.attempts"):
        guard.forward_done()
    release_peer_buffers()


def test_a_guard_checks_between_forward_and_backward():
    preload(titan=False)
    run_forked(2, _forward_done)


def _layer_chain(rank, world, dims, route, factor):
    """Layers of identity experts (top-1, score 1: a layer gives each token back), one per
    entry of ``dims`` (their widths: one buffer set per width), each routed by
    ``route(damaged)``, where ``damaged`` marks the tokens an earlier layer gave back wrong (cut
    rows): later layers route from cut activations. Through a ``ReplayGuard``; returns each
    layer's round trip and the guard."""
    num_experts = 4 * world
    g = torch.Generator().manual_seed(40 + rank)
    xs = [torch.randn(TOKENS, dim, generator=g).to(torch.bfloat16) for dim in dims]
    dispatchers = [_config(world, "bf16", factor, "torch", 1, num_experts).build(dist.group.WORLD, "cpu")
                   for _ in dims]
    guard = elastic.ReplayGuard(())
    for _ in guard.attempts():
        damaged = torch.zeros(TOKENS, dtype=torch.bool)
        results = []
        for x, dispatcher in zip(xs, dispatchers, strict=True):
            ids = route(damaged).view(TOKENS, 1)
            counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
            results.append(round_trip(dispatcher, x, torch.ones(TOKENS, 1), ids, counts))
            damaged = damaged | (results[-1][1].float() != x.float()).any(dim=1)
    return results, guard


def _trusted_rows(rank, world):
    """Growth and spills from trustworthy rows only.

    * Four layers of one width whose routing needs the same rows each (every rank's tokens
      spread over every expert), while a token an earlier layer cut routes to rank 0's first
      expert (phantom rows: an all-to-one need). One rerun, and the capacity grows to what the
      step needs plus headroom, not to the worst case.
    * Five layers of their own widths, every token to rank 0's experts, and once a token was
      cut every token to its own rank's (damage spreads along a sequence): each layer
      overflows in turn, as the damage of the first hides the later needs.
      Deterministic, so each rerun moves the first overflow later: five reruns, no
      ``ReplayLimitError``.

    Both give, bit for bit, what the worst case gives."""
    setup_rank()
    num_experts, local = 4 * world, 4
    t = torch.arange(TOKENS)
    spread = (t + rank * TOKENS) % num_experts
    worst = worst_case_capacity(TOKENS, 1, world, local, ALIGN)
    cases = {
        "phantom": ([DIM] * 4, lambda damaged: torch.where(damaged, 0, spread)),
        "spreading": ([32, 64, 96, 128, 160],
                      lambda damaged: torch.where(damaged.any(), rank * local + t % local, t % local)),
    }
    for name, (dims, route) in cases.items():
        release_peer_buffers()
        want, reference = _layer_chain(rank, world, dims, route, None)
        assert reference.replays == 0
        release_peer_buffers()
        got, guard = _layer_chain(rank, world, dims, route, 0.25)
        for layer, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_same(a, b, f"rank {rank} {name} layer {layer}")
        if name == "phantom":
            needed = _needed(spread.view(-1, 1), num_experts)
            assert guard.replays == 1, guard.replays
            assert symm.capacities() == [grown_capacity(needed, worst, ALIGN)] < [worst], symm.capacities()
        else:
            assert guard.replays == len(dims), guard.replays
    release_peer_buffers()


def test_growth_and_spills_come_from_trustworthy_rows_only():
    preload(titan=False)
    run_forked(2, _trusted_rows)


def _more_edges(rank, world):
    """The edges a careful user meets:

    * a dispatch on another thread while this thread is in a guard attempt runs as outside a
      scope (it reads its rows and takes them all), not sync-free with cut rows;
    * buffers first made under ``torch.inference_mode`` serve a later guarded step that
      overflows and replays;
    * without a guard, under activation checkpointing (``torch.utils.checkpoint``), a later
      layer's larger routing does not change an earlier layer's recompute: the worst case's
      result;
    * a replay drops only the replayed attempt's numerics samples: an earlier step's pending
      samples stay, and the rerun's are those a run without a replay takes.
    """
    import threading

    from torch.utils.checkpoint import checkpoint

    from mxfp8_ep.telemetry.numerics import PROBE

    setup_rank()
    num_experts, (preset, top_k, score_before) = 4 * world, CASES[1]
    group = dist.group.WORLD
    skewed = _inputs("all_to_one", rank, world, num_experts, top_k, rank)
    balanced = _inputs("balanced", rank, world, num_experts, top_k, 20 + rank)
    want = _worst_case(world, skewed, preset, "torch", top_k, num_experts)
    want_balanced = _worst_case(world, balanced, preset, "torch", top_k, num_experts)

    def build(factor=DEFAULT_CAPACITY_FACTOR, kernel="torch", chosen=preset):
        return _config(world, chosen, factor, kernel, top_k, num_experts, score_before).build(group, "cpu")

    # Another thread's dispatch during an attempt.
    release_peer_buffers()
    dispatcher = build()
    guard = elastic.ReplayGuard(())
    for _ in guard.attempts():
        result = {}
        thread = threading.Thread(target=lambda: result.update(got=round_trip(dispatcher, *skewed)))
        thread.start()
        thread.join()
    assert guard.replays == 0 and "got" in result
    _assert_same(result["got"], want, f"rank {rank} another thread")

    # Buffers made under inference mode.
    release_peer_buffers()
    dispatcher = build()
    with torch.inference_mode():
        x, scores, ids, counts = balanced
        routed, _, meta = dispatcher.dispatch(x, scores, ids, counts)
        dispatcher.combine(routed.clone(), meta)
    got, replays = replayed(lambda: round_trip(dispatcher, *skewed))
    assert replays == 1
    _assert_same(got, want, f"rank {rank} after inference mode")

    # Activation checkpointing without a guard: a balanced layer, then a skewed one that needs
    # more rows, both recomputed in the backward.
    release_peer_buffers()
    layers = [build(), build()]
    results = []
    outs = []
    leaves = []
    for dispatcher, (x, scores, ids, counts) in zip(layers, (balanced, skewed), strict=True):
        x, scores = x.clone().requires_grad_(True), scores.clone().requires_grad_(True)

        def layer(x, scores, dispatcher=dispatcher, ids=ids, counts=counts):
            routed, per_expert, meta = dispatcher.dispatch(x, scores, ids, counts)
            return dispatcher.combine(routed.clone(), meta), routed, per_expert

        out, routed, per_expert = checkpoint(layer, x, scores, use_reentrant=False)
        outs.append(out)
        leaves.append((x, scores))
        results.append((routed.detach()[: int(per_expert.sum())], out.detach()))
    sum(out.float().sum() for out in outs).backward()
    for (routed, out), (x, scores), reference, name in zip(results, leaves, (want_balanced, want),
                                                            ("balanced", "skewed"), strict=True):
        # The worst case's backward is of sum(out) in out's dtype: compare the forward and the
        # routed rows bit for bit, and the gradients where both back-propagate ones.
        assert torch.equal(bits(routed), bits(reference[0])) and torch.equal(bits(out), bits(reference[1])), name
        assert torch.equal(bits(x.grad), bits(reference[2])), name

    # Numerics samples across a replay.
    release_peer_buffers()
    PROBE.collect()
    PROBE.armed = True
    try:
        reference = build(None, chosen="mxfp8_all")
        round_trip(reference, *skewed)
        once = {leg: stats.values for (_, leg), stats in PROBE.collect().items()}
        assert once, "the probe saw no MXFP8 leg"
        release_peer_buffers()
        dispatcher = build(chosen="mxfp8_all")
        earlier = torch.arange(len(next(iter(once.values()))), dtype=torch.float64)
        from mxfp8_ep.telemetry.numerics import LegStats

        PROBE._stats[("an earlier step", "dispatch_fwd")] = LegStats(earlier.clone())
        _, replays = replayed(lambda: round_trip(dispatcher, *skewed))
        assert replays == 1
        kept = PROBE.collect()
    finally:
        PROBE.armed = False
    assert torch.equal(kept.pop(("an earlier step", "dispatch_fwd")).values, earlier)
    assert {leg: stats.values for (_, leg), stats in kept.items()}.keys() == once.keys()
    for (_, leg), stats in kept.items():
        assert torch.equal(stats.values, once[leg]), leg
    release_peer_buffers()


def test_more_edges_threads_inference_mode_checkpointing_and_numerics():
    preload(titan=False)
    run_forked(2, _more_edges)
