"""Inputs at the edge of the dispatcher's contract, on gloo process groups of 2-4 ranks, every
transport: each gives the right answer, or a clear error on EVERY rank within seconds (the
process-group timeout is cut to ``TIMEOUT_S``, so a rank left waiting for a peer fails the test
quickly instead of hanging it).

* Repeated expert ids in one token, with top-k above the experts per rank (custom routers,
  capacity-dropping schemes): with identity experts and dyadic values every sum is exact, so
  bf16 legs give the exact answer on every transport, bit for bit the same as the nccl
  transport; MXFP8 legs stay within ``QUANT_BOUND`` of it.
* Expert ids out of range, token counts that disagree with the ids, and bad input on one rank
  only (fp16 tokens, an id = E): every rank raises, the peers with an error that names the
  rank whose input failed; afterwards the group is still in step (a valid batch goes through).
* Tokens whose dim or dtype differs across ranks, and a config that differs in any field (the
  fields read from the config dataclasses): a ``ValueError`` on every rank that names the field
  and each rank's value. A config that fails its checks on one rank alone: that rank's own
  error, its peers' naming it and the problem.
"""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass, replace

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep.config import FIELD_CHOICES, A2AConfig
from mxfp8_ep.dispatcher import TokenDispatcher, checks
from mxfp8_ep.dispatcher.base import UNAGREED_FIELDS
from mxfp8_ep.kernels.launch_shapes import KernelShapes, LaunchShape
from tests.moe_harness import bits, preload, rel_err, run_forked, setup_rank
from tests.round_trips import (ERROR_WITHIN_S, MAX_TOKENS, TIMEOUT_S, TRANSPORTS, fails_everywhere, replayed,
                               round_trip, timed_dispatch, to_next_rank)

PRESETS = ("bf16", "mxfp8", "mxfp8_all")
# Relative Frobenius error of an MXFP8 round trip against the exact answer (e4m3: 3 mantissa
# bits, a half-ulp of 2**-4 at most per element).
QUANT_BOUND = 2.0**-4


def _config(transport, preset="bf16", num_experts=None, top_k=1, score_before_experts=False, partial_sums=True,
            max_tokens=MAX_TOKENS, kernel="auto", **kwargs):
    return TokenDispatcher.Config(
        num_experts=num_experts or 2 * dist.get_world_size(), top_k=top_k, max_tokens_per_rank=max_tokens,
        score_before_experts=score_before_experts,
        a2a=A2AConfig.preset(preset, transport=transport, symm_combine_partial_sums=partial_sums, kernel=kernel),
        **kwargs,
    )


def _build(transport, preset="bf16", **kwargs):
    return _config(transport, preset, **kwargs).build(dist.group.WORLD, "cpu")


def _histogram(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.bincount(ids.reshape(-1), minlength=num_experts)


# --------------------------------------------------------------------------------------------
# repeated expert ids


def _repeated_routings(rank: int, world: int, tokens: int, g: torch.Generator):
    """(name, num_experts, top_k, ids) of this rank: routings whose tokens list an expert more
    than once, with top_k above the experts per rank."""
    E = world  # one expert per rank
    out = []
    # The example: every token picks the next rank's expert twice.
    out.append(("next rank's expert twice", E, 2, torch.full((tokens, 2), (rank + 1) % world)))
    # Full buffers, every token of every rank picks expert 0 three times: rank 0 receives 3
    # rows per token, more than a drop-free layout sized for distinct ids holds.
    out.append(("expert 0 three times", E, 3, torch.zeros(MAX_TOKENS, 3, dtype=torch.int64)))
    # Its own expert and a peer's, each twice.
    own, peer = rank, (rank + 1) % world
    out.append(("own and next twice each", E, 4, torch.tensor([own, peer, own, peer]).repeat(tokens, 1)))
    # Drawn with replacement, two experts per rank (top-3 > 2 local experts).
    out.append(("drawn with replacement", 2 * E, 3, torch.randint(0, 2 * E, (tokens, 3), generator=g)))
    return out


def _exact_inputs(tokens, dim, top_k, g, dtype=torch.bfloat16):
    """Tokens of eighths in [-1, 1] and scores in {1/8, 1/4, 1/2, 3/4}: every product and sum
    the dispatcher forms is exact in bf16 and fp32, whatever the order."""
    x = (torch.randint(-8, 9, (tokens, dim), generator=g).float() / 8).to(dtype)
    scores = torch.tensor([0.125, 0.25, 0.5, 0.75])[torch.randint(0, 4, (tokens, top_k), generator=g)]
    return x, scores


def _expected(x, scores):
    """Identity experts, output gradient of ones: out = sum_k s_k x, dx = sum_k s_k,
    ds_k = sum_d x (in fp64, then the tokens' dtype)."""
    x64, s64 = x.double(), scores.double()
    out = (s64.sum(dim=1, keepdim=True) * x64).to(x.dtype)
    x_grad = s64.sum(dim=1, keepdim=True).expand_as(x64).to(x.dtype)
    score_grad = x64.sum(dim=1, keepdim=True).expand_as(s64).float()
    return out, x_grad, score_grad


def _scales(x, scores):
    """What an MXFP8 error of each of ``_expected``'s values is relative to: the value itself,
    but for a score gradient (a sum with cancellation) the sum of its terms' magnitudes."""
    out, x_grad, _ = _expected(x, scores)
    return out, x_grad, x.double().abs().sum(dim=1, keepdim=True).expand_as(scores).float()


def _repeated_ids(rank, world):
    setup_rank()
    g = torch.Generator().manual_seed(100 + rank)
    dim = 64
    for name, num_experts, top_k, ids in _repeated_routings(rank, world, 4 + rank, g):
        assert top_k > num_experts // world, name
        tokens = ids.shape[0]
        counts = _histogram(ids, num_experts)
        for score_before in (False, True):
            for preset in PRESETS:
                if preset == "bf16":
                    x, scores = _exact_inputs(tokens, dim, top_k, g)
                else:
                    x = torch.randn(tokens, dim, generator=g).to(torch.bfloat16)
                    scores = torch.rand(tokens, top_k, generator=g)
                want, scales = _expected(x, scores), _scales(x, scores)
                results = {}
                for transport in TRANSPORTS:
                    for partial in ((True, False) if transport == "symm" else (True,)):
                        where = (f"rank {rank} {name} {transport} {preset} score_before={score_before} "
                                 f"partial_sums={partial}")
                        dispatcher = _build(transport, preset, num_experts=num_experts, top_k=top_k,
                                            score_before_experts=score_before, partial_sums=partial)
                        (routed, *got), _ = replayed(lambda: round_trip(dispatcher, x, scores, ids, counts))
                        results[(transport, partial)] = (routed, *got)
                        for value, ref, scale, what in zip(got, want, scales, ("out", "x grad", "score grad")):
                            if preset == "bf16":
                                assert torch.equal(bits(value), bits(ref)), f"{what} not exact: {where}"
                            else:
                                err = rel_err(value, ref, scale)
                                assert err < QUANT_BOUND, f"{what} rel err {err:.3g}: {where}"
                if preset == "bf16":  # every transport bit for bit the same as nccl
                    nccl = results[("nccl", True)]
                    for key, result in results.items():
                        for a, b, what in zip(result, nccl, ("routed", "out", "x grad", "score grad")):
                            assert a.shape == b.shape and torch.equal(bits(a), bits(b)), \
                                f"{what} of {key} differs from nccl: rank {rank} {name} score_before={score_before}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_repeated_expert_ids_match_nccl(world):
    """A token that lists an expert twice (top_k above the experts per rank), every transport
    and preset: bf16 exact and bit for bit equal to nccl, MXFP8 within QUANT_BOUND."""
    preload(titan=False)
    run_forked(world, _repeated_ids, timeout_s=TIMEOUT_S)


def _repeated_ids_on_the_triton_kernels(rank, world):
    """The symm transport's Triton kernels (the interpreter on CPU) on routings that repeat
    ids, through the partial sums and row by row: bf16 legs exact (dyadic values), and every
    preset bit for bit equal to the torch twins."""
    setup_rank()
    g = torch.Generator().manual_seed(200 + rank)
    routings = [r for r in _repeated_routings(rank, world, 3, g) if r[0] != "expert 0 three times"]
    for name, num_experts, top_k, ids in routings:
        counts = _histogram(ids, num_experts)
        for preset, partial in (("bf16", True), ("mxfp8_all", True), ("bf16", False)):
            x, scores = _exact_inputs(ids.shape[0], 64, top_k, g)
            if preset != "bf16":
                x = torch.randn(ids.shape[0], 64, generator=g).to(torch.bfloat16)
            else:
                dispatcher = _build("symm", preset, num_experts=num_experts, top_k=top_k, partial_sums=partial,
                                    kernel="triton")
                for value, ref, what in zip(replayed(lambda: round_trip(dispatcher, x, scores, ids, counts))[0][1:],
                                            _expected(x, scores), ("out", "x grad", "score grad")):
                    assert torch.equal(bits(value), bits(ref)), \
                        f"{what} not exact: rank {rank} {name} partial={partial}"
            got = {}
            for kernel in ("torch", "triton"):
                dispatcher = _build("symm", preset, num_experts=num_experts, top_k=top_k, partial_sums=partial,
                                    kernel=kernel)
                got[kernel], _ = replayed(lambda: round_trip(dispatcher, x, scores, ids, counts))
            for a, b, what in zip(got["triton"], got["torch"], ("routed", "out", "x grad", "score grad")):
                if what == "score grad":  # fp32 dot products: tl.sum and torch.sum add in other orders
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
                else:
                    assert torch.equal(bits(a), bits(b)), f"{what}: rank {rank} {name} {preset} partial={partial}"


def test_repeated_expert_ids_on_the_triton_kernels():
    preload(titan=False)
    run_forked(2, _repeated_ids_on_the_triton_kernels, timeout_s=60)


# --------------------------------------------------------------------------------------------
# failing on every rank


def _still_in_step(dispatcher, rank, world) -> None:
    """A valid batch after a failed dispatch goes there and back (top-1, identity experts)."""
    top_k = dispatcher.config.top_k
    assert top_k <= 2 and dispatcher.num_local_experts >= top_k
    x, scores, ids, counts = to_next_rank(rank, world, 5, 64)
    # The next rank's first top_k experts, each once.
    first = (rank + 1) % world * dispatcher.num_local_experts
    ids = (first + torch.arange(top_k)).expand(5, top_k).contiguous()
    scores = torch.full((5, top_k), 1.0 / top_k)
    counts = _histogram(ids, dispatcher.config.num_experts)
    _, out, _, _ = round_trip(dispatcher, x, scores, ids, counts)
    assert rel_err(out, x) < QUANT_BOUND, "the group is out of step after a failed dispatch"


def _bad_ids(rank, world):
    """Rank 1's token 0 lists an id out of range, with counts from the valid ids (as
    torchtitan's histc makes them), or counting it on expert 0 (the sum then agrees)."""
    setup_rank()
    E, top_k, tokens = 2 * world, 2, 6
    for transport in TRANSPORTS:
        for preset in ("bf16", "mxfp8"):
            dispatcher = _build(transport, preset, num_experts=E, top_k=top_k)
            _still_in_step(dispatcher, rank, world)  # steady state: buffers exist, the config agreed
            for bad in (-1, E):
                for counted in ("valid ids", "on expert 0"):
                    x = torch.randn(tokens, 64)
                    scores = torch.rand(tokens, top_k)
                    ids = torch.stack([torch.arange(tokens) % E, (torch.arange(tokens) + 1) % E], dim=1)
                    counts = _histogram(ids, E)
                    if rank == 1:
                        counts[ids[0, 1]] -= 1
                        ids[0, 1] = bad
                        if counted == "on expert 0":
                            counts[0] += 1
                    fails_everywhere(lambda: dispatcher.dispatch(x, scores, ids, counts), ValueError,
                                      r"rank 1\b.*expert id", rank)
            _still_in_step(dispatcher, rank, world)


def test_out_of_range_expert_ids_fail_on_every_rank():
    """An id of -1 or num_experts on one rank, every transport: every rank raises, naming
    rank 1 and the expert ids; the group stays in step."""
    preload(titan=False)
    run_forked(2, _bad_ids, timeout_s=TIMEOUT_S)


def _bad_counts(rank, world):
    setup_rank()
    E, top_k, tokens = 2 * world, 2, 6
    for transport in TRANSPORTS:
        for preset in ("bf16", "mxfp8"):
            dispatcher = _build(transport, preset, num_experts=E, top_k=top_k)
            for first in (True, False):  # at the dispatcher's first dispatch, and after one
                if not first:
                    _still_in_step(dispatcher, rank, world)
                for case in ("sum above T*top_k", "same sum, other experts", "E + 1 entries", "E - 1 entries"):
                    x = torch.randn(tokens, 64)
                    scores = torch.rand(tokens, top_k)
                    ids = torch.stack([torch.arange(tokens) % E, (torch.arange(tokens) + 3) % E], dim=1)
                    counts = _histogram(ids, E)
                    if rank == 1:
                        if case == "sum above T*top_k":
                            counts[1] += tokens
                        elif case == "same sum, other experts":
                            counts = counts.roll(1)
                        elif case == "E + 1 entries":
                            counts = torch.cat([counts, counts.new_zeros(1)])
                        else:
                            counts = counts[:-1]
                    fails_everywhere(lambda: dispatcher.dispatch(x, scores, ids, counts), ValueError,
                                      r"rank 1\b.*(count|num_tokens_per_expert)", rank)
            _still_in_step(dispatcher, rank, world)


def test_counts_that_disagree_with_the_ids_fail_on_every_rank():
    """num_tokens_per_expert on one rank that sums past T*top_k, has the right sum but not the
    ids' histogram, or has the wrong length: every rank raises, naming rank 1; then the group
    is still in step."""
    preload(titan=False)
    run_forked(2, _bad_counts, timeout_s=TIMEOUT_S)


# The tokens a rank may get wrong: field -> (rank 0's, rank 1's) dims and dtypes.
TOKEN_MISMATCHES = {
    "dim": ((64, 96), (torch.float32, torch.float32)),
    "dtype": ((64, 64), (torch.float32, torch.bfloat16)),
}


def _mismatched_tokens(rank, world):
    setup_rank()
    assert world == 2
    for transport in TRANSPORTS:
        for field, (dims, dtypes) in TOKEN_MISMATCHES.items():

            def dispatch():
                dispatcher = _build(transport)
                x = torch.randn(4, dims[rank]).to(dtypes[rank])
                ids = torch.full((4, 1), 2 * ((rank + 1) % world))
                dispatcher.dispatch(x, torch.ones(4, 1), ids, _histogram(ids, dispatcher.config.num_experts))

            fails_everywhere(dispatch, ValueError, rf"{field}.*rank 0.*rank 1", rank)
    for transport in TRANSPORTS:  # agreeing dispatchers still work
        _still_in_step(_build(transport), rank, world)


def test_tokens_that_differ_across_ranks_fail_on_every_rank():
    """Rank 1's tokens differ from rank 0's in dim or dtype: every rank raises a ValueError naming
    the field and both ranks (no garbage, no mismatched collective)."""
    preload(titan=False)
    run_forked(2, _mismatched_tokens, timeout_s=TIMEOUT_S)


# --------------------------------------------------------------------------------------------
# configs that differ across ranks, or fail their checks on one

# A second value for the config fields whose type gives none, or whose doubled value is invalid
# (the pool's factor past its ceiling, the node size None) (``_second_value``).
SECOND_VALUES = {
    "launch_shapes": {"mxfp8": replace(KernelShapes.default("mxfp8"),
                                       push_rows=LaunchShape(block=8, warps=4, stripes=8))},
    "check_inputs": True,
    "a2a.activation_pool_factor": 1.5,
    "a2a.ranks_per_node": 1,
}


def _base_config() -> TokenDispatcher.Config:
    """A config every field of which has a valid second value (``_second_value``)."""
    return TokenDispatcher.Config(num_experts=4, top_k=2, max_tokens_per_rank=MAX_TOKENS,
                                  a2a=A2AConfig.preset("mxfp8", transport="nccl"))


def _field_paths(config, prefix: str = "") -> list[str]:
    """Every field of the config dataclasses, by its path (``a2a.dispatch_fwd``)."""
    paths = []
    for f in fields(config):
        value = getattr(config, f.name)
        paths += _field_paths(value, f"{prefix}{f.name}.") if is_dataclass(value) else [prefix + f.name]
    return paths


def _second_value(path: str, value):
    """A valid value of field ``path`` other than ``value``: ``SECOND_VALUES``' where it names
    one, else another of its choices, the other truth value or twice the number."""
    name = path.rsplit(".", 1)[-1]
    if path in SECOND_VALUES:
        return SECOND_VALUES[path]
    if path.startswith("a2a.") and name in FIELD_CHOICES:
        return next(c for c in FIELD_CHOICES[name] if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return 2 * value
    raise AssertionError(f"config field {path}: no second value to build a rank with; add one to SECOND_VALUES")


def _with(config, path: str, value):
    """``config`` with field ``path`` set to ``value``."""
    head, _, rest = path.partition(".")
    return replace(config, **{head: _with(getattr(config, head), rest, value) if rest else value})


def _configs_differing_in_each_field(rank, world):
    setup_rank()
    assert world == 2
    base = _base_config()
    paths = _field_paths(base)
    assert set(UNAGREED_FIELDS) <= set(paths), "an unagreed field that no config has"
    for path in paths:
        value = base
        for part in path.split("."):
            value = getattr(value, part)
        config = base if rank == 0 else _with(base, path, _second_value(path, value))
        assert config.problems() == [], (path, config.problems())
        if path in UNAGREED_FIELDS:  # free to differ: both ranks build
            config.build(dist.group.WORLD, "cpu")
            dist.barrier()
            continue
        fails_everywhere(lambda: config.build(dist.group.WORLD, "cpu"), ValueError,
                          rf"\b{re.escape(path)}: rank 0 = .*, rank 1 = ", rank)
    _still_in_step(_build("nccl"), rank, world)


def test_configs_that_differ_in_any_field_fail_on_every_rank():
    """Rank 1's config differs from rank 0's in one field, for every field of
    ``TokenDispatcher.Config`` and its ``A2AConfig`` (read from the dataclasses: a field added
    later is covered here too): every rank raises a ValueError naming the field and both ranks'
    values, except for the fields that may differ (``UNAGREED_FIELDS``), which build."""
    preload(titan=False)
    run_forked(2, _configs_differing_in_each_field, timeout_s=TIMEOUT_S)


# Configs that fail their checks, each on rank 1 alone: (config overrides, what the error says).
INVALID_ON_ONE_RANK = {
    "bf16 legs with quantize_local_rows": (dict(a2a=A2AConfig.preset("bf16", quantize_local_rows=True)),
                                           r"quantize_local_rows=True .* every leg is bf16"),
    "an unknown transport": (dict(a2a=A2AConfig.preset("mxfp8", transport="nvshmem")),
                             r"A2AConfig\.transport='nvshmem'"),
    "top_k 0": (dict(top_k=0), r"top_k=0"),
}


def _invalid_config_on_one_rank(rank, world):
    setup_rank()
    base = _base_config()
    for case, (overrides, reason) in INVALID_ON_ONE_RANK.items():
        config = replace(base, **overrides) if rank == 1 else base
        # Rank 1 raises its own error; its peers a DispatchInputError naming rank 1 and the reason.
        error = ValueError if rank == 1 else checks.DispatchInputError
        fails_everywhere(lambda: config.build(dist.group.WORLD, "cpu"), error, rf"rank 1\b.*{reason}", rank)
    _still_in_step(_build("nccl"), rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_a_config_invalid_on_one_rank_fails_every_rank_at_once(world):
    """A config that fails its checks on one rank alone (``Config.problems``): that rank enters
    the build's exchange with its error instead of raising before it, so every rank raises
    within seconds, its peers naming it and the problem, and the group stays in step."""
    preload(titan=False)
    run_forked(world, _invalid_config_on_one_rank, timeout_s=TIMEOUT_S)


def _one_rank_fails(rank, world):
    """Rank 1 alone gets fp16 tokens, or an expert id = E: it raises its own error, its peers
    an error naming rank 1, at a dispatcher's first dispatch and after one."""
    setup_rank()
    E = 2 * world
    own_error = {"fp16 tokens": (TypeError, "float16"), "id = E": (ValueError, r"rank 1\b.*expert id")}
    for transport in TRANSPORTS:
        for preset in ("bf16", "mxfp8"):
            for first in (True, False):
                for case, (error, match) in own_error.items():
                    dispatcher = _build(transport, preset, num_experts=E)
                    if not first:
                        _still_in_step(dispatcher, rank, world)
                    x, scores, ids, counts = to_next_rank(rank, world, 4, 64)
                    if rank == 1:
                        if case == "fp16 tokens":
                            x = x.half()
                        else:
                            ids[0, 0] = E
                    if rank != 1:
                        error, match = ValueError, r"rank 1\b"
                    fails_everywhere(lambda: dispatcher.dispatch(x, scores, ids, counts), error, match, rank)
                    _still_in_step(dispatcher, rank, world)


def _bad_id_on_one_rank(rank, world, debug=False):
    """Rank 1 dispatches an expert id = E through symm on this rank's device (CPU here; CUDA
    from tests/test_dispatcher_gpu.py). CPU, or CUDA in debug mode: every rank raises a
    ValueError naming rank 1 (debug mode reads the exchanged fault words on the host). CUDA by
    default: every rank, rank 1 too, fails its device-side assert on the exchanged fault words
    at its next synchronization (no host sync before) and exits at once."""
    import os

    from tests.distributed import rank_device

    setup_rank()
    device = rank_device()
    dispatcher = _config("symm", check_inputs=debug).build(dist.group.WORLD, device)
    x, scores, ids, counts = (t.to(device) for t in to_next_rank(rank, world, 4, 64))
    round_trip(dispatcher, x, scores, ids, counts)  # buffers allocated, shape agreed
    if rank == 1:
        ids = torch.full_like(ids, dispatcher.config.num_experts)
    raised, took = timed_dispatch(dispatcher, x, scores, ids, counts)
    if device.type == "cuda" and not debug:
        expected = isinstance(raised, RuntimeError) and "device-side assert" in str(raised)
    else:
        expected = isinstance(raised, ValueError) and re.search(r"rank 1\b.*expert id", str(raised))
    assert expected, f"rank {rank}: {type(raised).__name__} after {took:.1f}s: {raised}"
    assert took < (30 if device.type == "cuda" else ERROR_WITHIN_S), f"rank {rank} waited {took:.1f}s"
    if device.type == "cuda":
        os._exit(0)  # a rank that trapped has lost its CUDA context: nothing left to tear down


def test_bad_id_on_one_rank_fails_every_rank():
    """The symm transport's check of the exchanged fault words (on CPU read at once in both
    modes; tests/test_dispatcher_gpu.py runs this on CUDA, by default and in debug mode)."""
    preload(titan=False)
    run_forked(2, _bad_id_on_one_rank, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_on_one_rank_fails_on_every_rank(world):
    preload(titan=False)
    run_forked(world, _one_rank_fails, timeout_s=TIMEOUT_S)
