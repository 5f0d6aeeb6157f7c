"""The symm transport's elastic capacity (``mxfp8_ep.elastic``), on gloo process groups of 2-4
CPU ranks (shared-memory peers), torch twins and the Triton kernels under the interpreter:

* balanced, Zipf and all-to-one routings at the default ``capacity_factor`` give, bit for bit,
  what the worst-case capacity gives; a routing that overflows replays exactly once, one that
  fits never;
* an overflow on one EP group replays every rank of the world, and grows that group alone;
* without a replay guard an overflow is an error on every rank, naming the rows;
* a training loop with a forced overflow (a capacity below the balanced case, DeepSeek-V3's
  load-balancing expert bias updated every step) replays, then matches the worst-case run's
  losses and gradients bit for bit over several steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep import elastic, routing
from mxfp8_ep.capacity import (
    GROWTH_HEADROOM,
    expert_major_capacity,
    grown_capacity,
    worst_case_capacity,
)
from mxfp8_ep.config import DEFAULT_CAPACITY_FACTOR, A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher, release_peer_buffers
from mxfp8_ep.dispatcher.symm import CapacityOverflowError
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
    grown = grown_capacity(balanced + 1, worst, ALIGN)
    assert grown % ALIGN == 0 and grown >= (balanced + 1) * (1 + GROWTH_HEADROOM)
    assert grown_capacity(worst, worst, ALIGN) == worst


def _routing(kind: str, rank: int, world: int, num_experts: int, top_k: int, g: torch.Generator):
    """(tokens, top_k) expert ids of this rank: distinct experts per token, drawn uniformly
    (``balanced``), with Zipf weights over the experts (``zipf``: expert e weighs 1/(e+1)), or
    every pick one of rank 0's experts (``all_to_one``; a token may repeat one)."""
    if kind == "all_to_one":
        return torch.randint(0, num_experts // world, (TOKENS, top_k), generator=g)
    weights = torch.ones(num_experts) if kind == "balanced" else 1.0 / torch.arange(1, num_experts + 1)
    return torch.stack([torch.multinomial(weights, top_k, replacement=False, generator=g) for _ in range(TOKENS)])


def _config(world, preset, factor, kernel, top_k, num_experts, score_before=False):
    return TokenDispatcher.Config(
        num_experts=num_experts, top_k=top_k, pad_multiple=ALIGN, max_tokens_per_rank=TOKENS,
        score_before_experts=score_before,
        a2a=A2AConfig.preset(preset, transport="symm", kernel=kernel, capacity_factor=factor),
    )


def _needed(ids: torch.Tensor, num_experts: int, group=None) -> int:
    """The rows the largest expert-major tensor of the group needs for every rank's ``ids``."""
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    table = [torch.zeros_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, counts, group=group)
    return int(routing.rows_needed(torch.stack(table), ALIGN))


def _match_the_worst_case(rank, world, kernels):
    setup_rank()
    for kernel in kernels:
        for kind in ("balanced", "zipf", "all_to_one"):
            for preset, top_k, score_before in (("bf16", 2, False), ("mxfp8_all", 4, False), ("mxfp8", 1, True)):
                num_experts = 4 * world
                g = torch.Generator().manual_seed(7 * rank + len(kind) + top_k)
                ids = _routing(kind, rank, world, num_experts, top_k, g)
                x = torch.randn(TOKENS, DIM, generator=g).to(torch.bfloat16)
                scores = torch.rand(TOKENS, top_k, generator=g)
                counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
                where = f"rank {rank}/{world} {kernel} {kind} {preset} top-{top_k}"
                results = {}
                for factor in (None, DEFAULT_CAPACITY_FACTOR):
                    release_peer_buffers()
                    dispatcher = _config(world, preset, factor, kernel, top_k, num_experts, score_before).build(
                        dist.group.WORLD, "cpu")
                    results[factor] = replayed(lambda: round_trip(dispatcher, x, scores, ids, counts))
                (want, none), (got, replays) = results[None], results[DEFAULT_CAPACITY_FACTOR]
                assert none == 0, where
                capacity = expert_major_capacity(TOKENS, top_k, world, num_experts // world, ALIGN,
                                                 DEFAULT_CAPACITY_FACTOR)
                overflows = _needed(ids, num_experts) > capacity
                assert replays == int(overflows), f"{replays} replays, overflow: {overflows}: {where}"
                if kind == "all_to_one":
                    assert overflows, where
                for a, b, what in zip(got, want, ("routed", "out", "x grad", "score grad"), strict=True):
                    assert a.shape == b.shape and torch.equal(bits(a), bits(b)), f"{what} differs: {where}"
    release_peer_buffers()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_routings_at_the_default_capacity_match_the_worst_case(world):
    preload(titan=False)
    run_forked(world, _match_the_worst_case, ("torch",))


def test_the_triton_kernels_at_the_default_capacity_match_the_worst_case():
    import mxfp8_ep.symm_kernels  # noqa: F401  (Triton and the kernels, once, before the ranks fork)

    preload(titan=False)
    run_forked(2, _match_the_worst_case, ("triton",), timeout_s=300)


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
    config = _config(2, "bf16", DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts)
    dispatcher = config.build(group, "cpu")
    before = elastic.capacity_rows() or 0
    guard = elastic.ReplayGuard(())
    try:
        for attempt in guard.attempts():
            round_trip(dispatcher, x, scores, ids, counts)
            if attempt == 0:
                before = elastic.capacity_rows()
    finally:
        guard.close()
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


def _unguarded_overflow(rank, world):
    setup_rank()
    num_experts, top_k = 2 * world, 2
    g = torch.Generator().manual_seed(rank)
    ids = _routing("all_to_one", rank, world, num_experts, top_k, g)
    x, scores = torch.randn(TOKENS, DIM, generator=g), torch.rand(TOKENS, top_k, generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    dispatcher = _config(world, "bf16", DEFAULT_CAPACITY_FACTOR, "torch", top_k, num_experts).build(
        dist.group.WORLD, "cpu")
    with pytest.raises(CapacityOverflowError, match=r"needs \d+ rows, its capacity is \d+ .*ReplayGuard"):
        dispatcher.dispatch(x, scores, ids, counts)
    dist.barrier()  # every rank raised at the same point: none waits for a peer
    release_peer_buffers()


def test_an_overflow_without_a_replay_guard_is_an_error_on_every_rank():
    preload(titan=False)
    run_forked(2, _unguarded_overflow, timeout_s=20)


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
        guard.close()
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
    counter, and a scripted overflow counter stands in for the dispatches."""

    gradient_accumulation_steps = 2

    def __init__(self, overflows: list[bool]):
        layer = torch.nn.Module()
        layer.register_buffer("tokens_per_expert", torch.zeros(2))
        self.model_parts = [layer]
        self.overflows, self.seen, self.optimizer_steps, self.step = overflows, [], 0, 1

    def train_step(self, data_iterator):
        batches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        for batch in batches:
            self.forward_backward_step(batch)
        self.optimizer_steps += 1

    def forward_backward_step(self, batch):
        self.seen.append((batch, torch.rand(()).item()))
        self.model_parts[0].tokens_per_expert += 1
        return batch


def _scripted_overflow(trainer):
    def check():
        return elastic.Overflow(replay=trainer.overflows.pop(0) if trainer.overflows else False)
    return check


@pytest.mark.parametrize("how", ["mixin", "installed"])
def test_a_trainer_replays_an_overflowed_step_from_the_same_batches_rng_and_counters(how, monkeypatch):
    cls = type("Trainer", (_StubTrainer,), {})
    if how == "mixin":
        cls = type("ReplayingTrainer", (elastic.ReplayOverflowedSteps, cls), {})
    else:
        elastic.install_replays(cls)
        elastic.install_replays(cls)  # idempotent
    trainer = cls([True, False])
    monkeypatch.setattr(elastic, "check_overflow", _scripted_overflow(trainer))
    torch.manual_seed(0)
    try:
        trainer.train_step(iter(range(10)))
    finally:
        elastic.expect_replays(False)
    first, second = trainer.seen[:2], trainer.seen[2:]
    assert first == second and [b for b, _ in first] == [0, 1], trainer.seen  # same batches, same RNG draws
    assert trainer.optimizer_steps == 1 and trainer.capacity_replays == 1
    assert trainer.model_parts[0].tokens_per_expert.tolist() == [2.0, 2.0]  # counted once


def test_a_trainer_that_checks_no_capacity_reads_nothing(monkeypatch):
    """``checks_capacity = False`` (every rank knows no symm dispatch runs at an elastic
    capacity: the recipe with nccl, or symm at the worst case): no overflow check, no read."""
    cls = type("ReplayingTrainer", (elastic.ReplayOverflowedSteps, _StubTrainer), {"checks_capacity": False})
    trainer = cls([True])

    def no_check():
        raise AssertionError("checked")

    monkeypatch.setattr(elastic, "check_overflow", no_check)
    try:
        trainer.train_step(iter(range(10)))
    finally:
        elastic.expect_replays(False)
    assert trainer.optimizer_steps == 1 and trainer.capacity_replays == 0 and len(trainer.seen) == 2
