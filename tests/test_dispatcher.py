"""The token dispatcher (``mxfp8_ep.dispatcher``) against torchtitan 0.2.2's MoE layer without
expert parallelism, on gloo process groups of 2, 3 and 4 ranks, both transports (``nccl``:
all-to-all, torchtitan's math for all-bf16 legs, the fused kernels of ``FusedNcclTokenDispatcher``
when a leg is MXFP8; ``symm``: peer-memory pushes over the CPU shared-memory emulation; both
run the torch twins of the kernels here, tests/test_symm_kernels.py proves the Triton kernels
equal the twins).

Routings: >= 200 drawn by hypothesis in the parent and run inside ONE process group per world
size (both transports per routing), plus hand-picked extremes. Kinds: torchtitan's router on
its own, the router with a per-expert load-balancing bias, and choices forced per token through
the router's own choice bias (tests/moe_harness.py): all tokens to one rank's experts, empty
experts, ranks with zero tokens (also every rank empty), top_k up to min(4, E), pad multiples
1 and 8, softmax / sigmoid, route_norm, scores before (Llama4) or after (DeepSeek-V3) the
experts, one shared expert, bf16 and fp32 activations, every preset and scale rounding.

References (the reference's expert gradients are summed over ranks and sliced):

* *wire reference*: torchtitan's layer where the rows that would cross a rank boundary pass
  each leg's format (quantize + dequantize with the format reference; rows that stay never
  do); for bf16 legs it is torchtitan's layer unchanged. EP must equal it:
  - shared expert gradients: bit for bit, always (they see only x and the output gradient);
  - transport nccl with all-bf16 legs and row-wise experts: output, input gradient, score
    gradients and router gradient bit for bit (the transport is torchtitan's gather / bmm /
    index-add math, and a row-wise expert's rows do not depend on their batch on the CPU;
    on CUDA they do, and the GPU run of this fuzz, tests/test_dispatcher_gpu.py, bounds them
    by ``ORDER_TOL``); expert weight gradients within ``ORDER_TOL``: EP sums every rank's rows
    in one pass, the reference per rank, then across ranks;
  - otherwise within ``ORDER_TOL``: the symm transport and the nccl transport with an MXFP8
    leg reduce a token's K rows in fp32 in slot order and round once, where torchtitan runs a
    bmm (combine) and an index-add in expert order, rounding each add in bf16 (dispatch
    backward), and their score gradients are fp32 dot products summed in another order;
    torchtitan's matmul experts (``grouped``) multiply other batches under EP than without
    it (moe_harness says why that matters).
* *symm*, for transport nccl with an MXFP8 leg: every output and gradient bit for bit, every
  expert kind; within ``ORDER_TOL`` where symm sends a token-bound leg as partial sums
  (``SymmTokenDispatcher.Config.dispatch_bwd_partial_sums``, ``combine_fwd_partial_sums``: each rank adds its rows of a
  token first; the x gradient, and with combine's partial sums the output and the score and
  router gradients, which symm then takes on the experts' rank), not compared where those
  partial sums or the score gradients' output gradient are MXFP8 (half the drawn routings
  turn combine's partial sums off: ``A2AConfig.symm_combine_partial_sums``). Both
  run the same kernels on the same expert-major layout: the same rows are quantized (those
  that cross ranks) with the same arithmetic, each token's rows reduced in the same fp32
  order, and the experts see the same per-expert batches (the layouts differ only in unused
  rows past the last expert, which no expert reads). This is the precise check of the fused
  nccl path; the two above bound it like symm. Where symm sends a weighted MXFP8 leg as
  tokens and multiplies the scores after dequantizing (``SymmTokenDispatcher.Config.scores_after_dequantize``:
  top-k > 1 with combine's backward, or with dispatch's forward when the scores come first,
  in MXFP8), only what does not depend on that leg is compared, and likewise the x gradient
  where symm quantizes partial sums of dispatch's backward instead of rows (MXFP8); symm then
  meets its own wire reference (``WireLegs(scores_after_dequantize=..., partial_sums=...,
  combine_partial_sums=...)``:
  that leg's crossing rows are ``score * dequant(quant(token))``; each token's crossing rows
  of a token-bound leg on one rank are one quantized (weighted, in combine's forward) sum; a
  crossing row's score gradient is its expert output against the output gradient as combine's
  backward sent it), to the same bounds.
  Score gradients are compared relative to their Cauchy-Schwarz size (|a| |b| of the dot
  product), since a dot product can cancel to ~0 while its rounding error does not; the
  router's gradient must then equal torchtitan's router backward of EP's score gradients.
* *torchtitan unquantized*, for MXFP8 presets: relative Frobenius error above zero where rows
  crossed (the output of a rank that sent rows away, the expert gradients of a rank that
  received rows: the legs really quantize) and below ``QUANT_TOL``: 2**-2 with RCEIL scales,
  2**-1 with floor. Not 2**-4: an e4m3 element moves by at most 2**-4 of its magnitude
  (RCEIL; floor can also clip a block's largest element, by up to 2**-3), but at these token
  counts a SwiGLU expert carries its input's error into its output about twice (it is
  ~quadratic in its input) and into its weight gradients up to four times (h1, h3, the outer
  product with x, and the quantized output gradient) -- the exact wire reference above is the
  precise check; this one says the error is the format's and not a wrong row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mxfp8_ep.config import PRESETS, SCALE_ROUNDINGS, A2AConfig
from mxfp8_ep.dispatcher import FusedNcclTokenDispatcher, NcclTokenDispatcher, SymmTokenDispatcher, TokenDispatcher
from tests.distributed import rank_device
from tests.moe_harness import (
    DTYPES,
    EXPERT_KINDS,
    LayerSpec,
    WireLegs,
    build_ep_layer,
    build_reference,
    check_rowwise_is_batch_independent,
    choice_bias,
    ep_forward,
    preload,
    reference_expert_grads,
    reference_forward,
    rel_err,
    run_forked,
    run_layer,
    setup_rank,
    symm_quantizes_partial_sums,
)
from tests.round_trips import MAX_TOKENS, rank_transports


# (transport, any leg MXFP8) -> the class Config.build must pick.
DISPATCHER_CLASS = {
    ("nccl", False): NcclTokenDispatcher, ("nccl", True): FusedNcclTokenDispatcher,
    ("symm", False): SymmTokenDispatcher, ("symm", True): SymmTokenDispatcher,
}
EXAMPLES = {2: 80, 3: 70, 4: 50}
# Host waits of one EP layer's forward + backward per transport (CUDA; module docstring of
# tests/test_dispatcher_gpu.py): nccl waits once for the splits NCCL takes on the host.
HOST_WAITS = {"symm": 0, "nccl": 1}
PAD_MULTIPLES = (1, 8)  # 8 = torchtitan's TOKEN_GROUP_ALIGN_SIZE_M for bf16
ROUTINGS = ("router", "bias", "forced", "one_rank")
# Relative Frobenius bounds (module docstring) for reordered sums and roundings of the same
# values: a few fp32 ulps, one bf16 rounding.
ORDER_TOL = {"float32": 1e-5, "bfloat16": 2.0**-7}
QUANT_TOL = {"rceil": 2.0**-2, "floor": 2.0**-1}  # per scale rounding (module docstring)
SHARED = ("shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight")
EXPERTS = ("experts.w1", "experts.w2", "experts.w3")
ROUTER = "router.gate.weight"


@dataclass(frozen=True)
class Example:
    spec: LayerSpec
    tokens: tuple[int, ...]  # per rank
    routing: str  # one of ROUTINGS
    choice: tuple | None = None  # forced routings: per rank, per token, its experts
    bias: tuple | None = None  # routing "bias": the router's per-expert expert_bias
    preset: str = "bf16"
    rounding: str = "rceil"
    pad_multiple: int = 8
    combine_partial_sums: bool = True  # A2AConfig.symm_combine_partial_sums
    name: str = ""
    max_tokens: int = MAX_TOKENS  # TokenDispatcher.Config.max_tokens_per_rank


@st.composite
def _example(draw, world: int) -> Example:
    num_experts = draw(st.sampled_from(range(world, 9, world)))
    local = num_experts // world
    routing = draw(st.sampled_from(ROUTINGS))
    top_k = draw(st.sampled_from(range(1, 1 + min(4, local if routing == "one_rank" else num_experts))))
    tokens = tuple(draw(st.lists(st.integers(0, MAX_TOKENS), min_size=world, max_size=world)))
    choice = bias = None
    if routing in ("forced", "one_rank"):
        if routing == "one_rank":  # every token of every rank to experts of one rank
            owner = draw(st.integers(0, world - 1))
            allowed = list(range(owner * local, (owner + 1) * local))
        else:  # experts outside `allowed` stay empty
            allowed = sorted(draw(st.sets(st.integers(0, num_experts - 1), min_size=top_k)))
        pick = st.permutations(allowed).map(lambda p: tuple(p[:top_k]))
        choice = tuple(tuple(draw(st.lists(pick, min_size=t, max_size=t))) for t in tokens)
    elif routing == "bias":
        bias = tuple(draw(st.lists(st.sampled_from([0.0, 0.25, 10.0]), min_size=num_experts, max_size=num_experts)))
    spec = LayerSpec(
        dim=draw(st.sampled_from([64, 96])),
        num_experts=num_experts,
        top_k=top_k,
        score_before_experts=draw(st.booleans()),
        score_func=draw(st.sampled_from(["softmax", "sigmoid"])),
        route_norm=draw(st.booleans()),
        experts=draw(st.sampled_from(EXPERT_KINDS)),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        seed=draw(st.integers(0, 2**16)),
    )
    return Example(
        spec=spec, tokens=tokens, routing=routing, choice=choice, bias=bias,
        preset=draw(st.sampled_from(sorted(PRESETS))), rounding=draw(st.sampled_from(SCALE_ROUNDINGS)),
        pad_multiple=draw(st.sampled_from(PAD_MULTIPLES)), combine_partial_sums=draw(st.booleans()),
    )


def hypothesis_examples(world: int, n: int) -> list[Example]:
    """The first ``n`` distinct examples hypothesis draws (it may draw one twice)."""
    found: list[Example] = []

    @settings(max_examples=2 * n, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(_example(world))
    def collect(example):
        if len(found) < n and example not in found:
            found.append(example)

    collect()
    return found


def extreme_examples(world: int) -> list[Example]:
    """Hand-picked, DeepSeek-V3 / Llama4 styles: every token to rank 0's experts (forced, and
    by the router's load-balancing bias), a rank without tokens, every rank without tokens,
    full buffers with top_k = E, top_k = 4."""
    E = 2 * world
    dsv3 = LayerSpec(num_experts=E, top_k=2, score_func="sigmoid", route_norm=True, score_before_experts=False)
    llama4 = LayerSpec(num_experts=E, top_k=1, score_func="sigmoid", score_before_experts=True)
    full = (MAX_TOKENS,) * world
    to_zero = tuple(((0, 1),) * MAX_TOKENS for _ in range(world))
    first_empty = (0,) + (MAX_TOKENS,) * (world - 1)
    out = []
    for preset in sorted(PRESETS):
        out += [
            Example(dsv3, full, "forced", choice=to_zero, preset=preset, name="all-to-one"),
            Example(llama4, first_empty, "router", preset=preset, name="rank 0 empty"),
        ]
    out += [
        Example(dsv3, full, "one_rank", choice=to_zero, preset="mxfp8_all", combine_partial_sums=False,
                name="all-to-one, combine's forward row by row"),
        Example(dsv3, (0,) * world, "router", name="every rank empty"),
        Example(replace(dsv3, num_experts=world, top_k=min(4, world), dtype="bfloat16"), full, "router",
                preset="mxfp8_all", name="top_k = E, full buffers"),
        Example(replace(dsv3, num_experts=max(e for e in range(4, 9) if e % world == 0), top_k=4), full,
                "router", preset="mxfp8", name="top_k = 4"),
        Example(replace(llama4, experts="grouped", dtype="bfloat16"), full, "bias",
                bias=(10.0,) * 2 + (0.0,) * (E - 2), preset="mxfp8", rounding="floor", name="bias to rank 0"),
    ]
    return out


# --------------------------------------------------------------------------------------------
# per-rank check


def _inputs(ex: Example, rank: int, device):
    """x, the output gradient and the router's choice bias of ``ex`` on ``rank`` (the same
    values on every device)."""
    spec, T = ex.spec, ex.tokens[rank]
    g = torch.Generator().manual_seed(spec.seed * 7919 + rank)
    dtype = DTYPES[spec.dtype]
    # Rows over a few binades, so MXFP8 blocks get different scales.
    x = (torch.randn(T, spec.dim, generator=g)
         * torch.exp2(torch.randint(-3, 4, (T, 1), generator=g).float())).to(dtype)
    grad_out = torch.randn(T, spec.dim, generator=g).to(dtype)
    if ex.routing in ("forced", "one_rank"):
        bias = choice_bias(ex.choice[rank], spec.num_experts)
    elif ex.routing == "bias":
        bias = torch.tensor(ex.bias)
    else:
        bias = None
    return x.to(device), grad_out.to(device), None if bias is None else bias.to(device)


def _rows_between_ranks(ids: torch.Tensor, rank: int, world: int, local: int) -> torch.Tensor:
    """(W, W): rows rank s sends rank d, from every rank's routing."""
    sent = torch.zeros(world, world, dtype=torch.int64, device=ids.device)
    sent[rank] = torch.bincount(ids.reshape(-1) // local, minlength=world)
    dist.all_reduce(sent)
    return sent


def _expectation(ex: Example, dispatcher, name: str, device: torch.device):
    """How EP must match the reference that applies the legs' formats: 'exact', or a
    relative bound (module docstring). On CUDA a row-wise expert's rows depend on their batch
    (its reductions are split by the batch's shape), so there only the shared experts'
    gradients are exact."""
    if name in SHARED:
        return "exact"
    if (type(dispatcher) is NcclTokenDispatcher and ex.spec.experts == "rowwise" and name not in EXPERTS
            and device.type == "cpu"):
        return "exact"
    return ORDER_TOL[ex.spec.dtype]


def _score_grad_scale(ex: Example, ids, x, grad_out, seen) -> torch.Tensor:
    """(T, K) Cauchy-Schwarz size of each score gradient, a dot product of two D-vectors:
    |output grad| * |expert output| (scores after the experts) or |x| * |expert input grad|
    (scores before), from the reference. Rounding and quantization errors of a dot product
    scale with it, not with the dot product itself, which can cancel to ~0 (e.g. top_k = 1
    with route_norm: the score is s / s, its gradient mathematically zero)."""
    T, K = ids.shape
    slot = torch.argsort(ids.reshape(-1), stable=True)  # torchtitan's sorted order
    per_slot = torch.zeros(T * K, device=ids.device)
    if T * K:
        rows = seen["rows_grad"] if ex.spec.score_before_experts else seen["rows_out"]
        per_slot[slot] = rows[: T * K].float().norm(dim=1)
    other = x if ex.spec.score_before_experts else grad_out
    return per_slot.view(T, K) * other.float().norm(dim=1, keepdim=True)


def _compare(name, got, ref, expect, where, scale=None) -> float:
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{name}: {where}"
    if expect == "exact":
        assert torch.equal(got, ref), (
            f"{name} differs (max abs {(got.float() - ref.float()).abs().max():.3g}): {where}"
        )
        return 0.0
    err = rel_err(got, ref, scale=scale if name == "scores" else None)
    assert err < expect, f"{name}: rel err {err:.3g} >= {expect:.3g}: {where}"
    return err


def _check_example(ex: Example, rank: int, world: int, stats: dict) -> None:
    """Every transport against the references (module docstring), on this rank's device. On
    CUDA the EP layer's forward and backward also run under ``host_sync_check``: no
    synchronizing CUDA operation, and host waits only where a transport makes its one by
    design (nccl: the splits NCCL takes on the host, once per layer; symm: none)."""
    spec = ex.spec
    local = spec.num_experts // world
    device = rank_device()
    x, grad_out, bias = _inputs(ex, rank, device)
    reference = build_reference(spec, device)
    with torch.no_grad():
        _, ids, _ = reference.router(x, bias)
    if ex.routing in ("forced", "one_rank"):
        assert [sorted(r) for r in ids.tolist()] == [sorted(c) for c in ex.choice[rank]], "forcing failed"
    sent = _rows_between_ranks(ids, rank, world, local)
    sends_away = (sent[rank].sum() - sent[rank, rank]).item() > 0
    receives = (sent[:, rank].sum() - sent[rank, rank]).item() > 0

    def reference_run(legs=None):
        out, grads, seen = run_layer(reference, reference_forward, x, grad_out, bias, legs=legs)
        reference_expert_grads(grads, rank, local)
        results = {"out": out, "scores": seen.get("scores", torch.zeros(ids.shape, dtype=torch.float32))}
        results.update({n: g for n, g in grads.items() if n != ROUTER})
        return results, seen

    plain, plain_seen = reference_run()
    scale = _score_grad_scale(ex, ids, x, grad_out, plain_seen)
    a2a_legs = A2AConfig.preset(ex.preset, scale_rounding=ex.rounding,
                                symm_combine_partial_sums=ex.combine_partial_sums)
    quantized = a2a_legs.any_quantized
    # torchtitan's layer with each leg's format applied to the rows that would cross ranks.
    wire = reference_run(WireLegs(a2a_legs, rank, local))[0] if quantized else plain

    results = {}
    for transport in rank_transports():
        config = TokenDispatcher.Config(
            num_experts=spec.num_experts, top_k=spec.top_k, a2a=replace(a2a_legs, transport=transport),
            score_before_experts=spec.score_before_experts, pad_multiple=ex.pad_multiple,
            max_tokens_per_rank=ex.max_tokens,
        )
        dispatcher = config.build(dist.group.WORLD, device)
        where = f"{transport} rank {rank}/{world}: {ex}"
        assert type(dispatcher) is DISPATCHER_CLASS[transport, quantized], where
        ep = build_ep_layer(reference, spec, dispatcher, rank)
        out, grads, seen = run_layer(ep, ep_forward, x, grad_out, bias, sync_check=device.type == "cuda", replay=True)
        stats["replays", transport] = stats.get(("replays", transport), 0) + seen["replays"]
        if device.type == "cuda":
            waits = [w for w in seen["host_waits"] if "mxfp8_ep/dispatcher/" in w]
            assert len(waits) == HOST_WAITS[transport] == len(seen["host_waits"]), f"{seen['host_waits']}: {where}"
        got = {"out": out, "scores": seen.get("scores", torch.zeros(ids.shape, dtype=torch.float32))}
        got.update({n: g for n, g in grads.items() if n != ROUTER})
        results[transport] = {**got, ROUTER: grads[ROUTER]}
        if type(dispatcher) is FusedNcclTokenDispatcher:
            for name, ref in results["symm"].items():
                expect = _symm_vs_fused_nccl(config, spec, name)
                if expect is not None:  # else symm quantized other values: each met its own wire reference
                    _compare(name, results[transport][name], ref, expect, f"{where} vs symm", scale)
        expected = wire
        symm = SymmTokenDispatcher.Config.of(config)  # which way symm sends each leg
        if transport == "symm" and (symm.scores_after_dequantize or symm_quantizes_partial_sums(config)):
            # symm quantizes other values than a row per leg (module docstring): its own wire reference.
            expected = reference_run(WireLegs(
                a2a_legs, rank, local, scores_after_dequantize=symm.scores_after_dequantize,
                partial_sums=symm.dispatch_bwd_partial_sums, combine_partial_sums=symm.combine_fwd_partial_sums,
            ))[0]
        assert set(got) == set(expected), where
        for name, ref in expected.items():
            expect = _expectation(ex, dispatcher, name, device)
            err = _compare(name, got[name], ref, expect, where, scale)
            key = (transport, spec.experts, spec.dtype, "q" if quantized else "-", name.split(".")[0])
            stats[key] = max(stats.get(key, 0.0), err)
        # The router's gradient is torchtitan's router backward of those score gradients.
        top_scores, _, _ = ep.router(x, bias)
        (gate_grad,) = torch.autograd.grad(top_scores, ep.router.gate.weight, got["scores"])
        assert torch.equal(grads[ROUTER], gate_grad), f"router gradient: {where}"
        if quantized:
            # Against torchtitan without quantization: the legs really were quantized (a row
            # that stays on its rank never is), and no more than the format allows.
            for name, ref in plain.items():
                err = rel_err(got[name], ref, scale=scale if name == "scores" else None)
                bound = QUANT_TOL[ex.rounding]
                assert err < bound, f"{name} vs unquantized: rel err {err:.3g} >= {bound:.3g}: {where}"
                key = ("vs unquantized", ex.rounding, name.split(".")[0])
                stats[key] = max(stats.get(key, 0.0), err)
            if sends_away:
                assert rel_err(out, plain["out"]) > 0, f"output unchanged though rows left the rank: {where}"
            if receives:
                assert max(rel_err(got[n], plain[n]) for n in EXPERTS) > 0, (
                    f"expert grads unchanged though rows arrived: {where}"
                )


def _symm_vs_fused_nccl(config, spec: LayerSpec, name: str):
    """How symm's result ``name`` must match the fused nccl transport's (module docstring):
    'exact', ``ORDER_TOL`` where symm only regroups additions, None where it quantizes other
    values (then each transport met its own wire reference)."""
    config = SymmTokenDispatcher.Config.of(config)
    if config.scores_after_dequantize and name not in _same_when_scores_after_dequantize(spec):
        return None  # symm quantized other rows on the weighted leg
    if not config.dispatch_bwd_partial_sums:
        return "exact"
    # Partial sums (scores after the experts): the x gradient adds a token's rows in another
    # grouping; with combine's partial sums the output does too, and the score gradients (and
    # the router's) meet the output gradient on the experts' rank, in combine's backward format.
    a2a = config.a2a
    quantized = {"x": a2a.dispatch_bwd == "mxfp8"}
    if config.combine_fwd_partial_sums:
        quantized.update(out=a2a.combine_fwd == "mxfp8", scores="mxfp8" in (a2a.combine_fwd, a2a.combine_bwd))
        quantized[ROUTER] = quantized["scores"]
    if name not in quantized:
        return "exact"
    return None if quantized[name] else ORDER_TOL[spec.dtype]


def _same_when_scores_after_dequantize(spec: LayerSpec) -> set[str]:
    """What symm and the fused nccl transport still compute alike where symm multiplies a
    weighted leg's scores after dequantizing (``SymmTokenDispatcher.Config.scores_after_dequantize``): what
    does not depend on that leg. Scores after the experts (combine's backward): the output,
    the score and router gradients and the shared experts' gradients; scores first
    (dispatch's forward): only the shared experts' gradients."""
    if spec.score_before_experts:
        return set(SHARED)
    return set(SHARED) | {"out", "scores", ROUTER}


def _fuzz(rank, world, examples):
    setup_rank()
    if rank_device().type == "cpu":  # the premise of the exact comparisons (_expectation)
        for dtype in DTYPES.values():
            check_rowwise_is_batch_independent(dtype)
    stats: dict = {}
    for ex in examples:
        _check_example(ex, rank, world, stats)
    if "symm" in rank_transports():  # the extreme routings overflow the default capacity
        assert stats.get(("replays", "symm"), 0) > 0, "no routing of the fuzz overflowed the symm capacity"
    if rank == 0:
        for key in sorted(stats):
            print(f"world {world} max rel err {key}: {stats[key]:.3g}")


@pytest.mark.parametrize("world", sorted(EXAMPLES))
def test_dispatcher_matches_torchtitan_moe(world):
    examples = hypothesis_examples(world, EXAMPLES[world]) + extreme_examples(world)
    preload()
    run_forked(world, _fuzz, examples)


def test_fuzz_covers_200_routings_and_the_edges():
    draws = {world: hypothesis_examples(world, n) for world, n in EXAMPLES.items()}
    assert sum(len(set(drawn)) for drawn in draws.values()) >= 200, "fewer than 200 distinct routings"
    for world, drawn in sorted(draws.items()):
        assert len(drawn) == EXAMPLES[world]
        assert {ex.routing for ex in drawn} == set(ROUTINGS), world
        assert any(0 in ex.tokens for ex in drawn), world
        assert max(ex.spec.top_k for ex in drawn) == min(4, max(ex.spec.num_experts for ex in drawn)), world
        assert {ex.preset for ex in drawn} == set(PRESETS), world
        # Both ways of combine's forward where symm can send partial sums.
        partial = [ex for ex in drawn if ex.spec.top_k > 1 and not ex.spec.score_before_experts]
        assert {ex.combine_partial_sums for ex in partial} == {True, False}, world
        # The nccl transport's fused path (any MXFP8 leg) meets the edges too: everything to one
        # rank, empty experts (forced routings), ranks without tokens.
        fused = [ex for ex in drawn + extreme_examples(world) if A2AConfig.preset(ex.preset).any_quantized]
        assert {"one_rank", "forced"} <= {ex.routing for ex in fused}, world
        assert any(0 in ex.tokens for ex in fused) and any(ex.name == "all-to-one" for ex in fused), world


# --------------------------------------------------------------------------------------------
# torchtitan 0.2.2 models, transport symm


def _titan_models_symm(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp

    from mxfp8_ep.titan022 import install_expert_parallel, uninstall_expert_parallel
    from launch.titan.cpu_compat import apply_cpu_compat
    from tests.test_titan022 import TOLERANCE, _build

    apply_cpu_compat(force=True)
    torch.set_num_threads(1)
    ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1000 + rank))

    def run(family, a2a):
        model, _ = _build(family, seed=0)
        if a2a is not None:
            install_expert_parallel(a2a)
        try:
            apply_moe_ep_tp(model, tp_mesh=None, ep_mesh=ep_mesh, etp_mesh=None, ep_etp_mesh=None)
        finally:
            uninstall_expert_parallel()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
        loss.backward()
        grads = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in model.named_parameters()}
        dispatchers = [m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher")]
        return logits.detach(), grads, dispatchers

    for family in ("llama4", "deepseek_v3"):
        ref_logits, ref_grads, none = run(family, None)  # torchtitan's own ExpertParallel
        assert not none
        for preset in sorted(PRESETS):
            a2a = A2AConfig.preset(preset, transport="symm")
            logits, grads, dispatchers = run(family, a2a)
            where = f"{family} {preset} rank {rank}"
            assert dispatchers and all(type(d) is SymmTokenDispatcher for d in dispatchers), where
            errs = {n: rel_err(grads[n], g) for n, g in ref_grads.items()}
            logits_err = rel_err(logits, ref_logits)
            if a2a.any_quantized:
                # tests/test_titan022.py's bound for these models (64 tokens per rank).
                assert 0 < logits_err < TOLERANCE, f"{where}: logits rel err {logits_err:.3g}"
                assert max(errs.values()) < TOLERANCE, f"{where}: {max(errs.items(), key=lambda e: e[1])}"
                assert max(e for n, e in errs.items() if ".experts." in n) > 0, f"{where}: nothing quantized"
            else:
                # Same math as torchtitan up to the order of fp32 sums (module docstring).
                assert logits_err < ORDER_TOL["float32"], f"{where}: logits rel err {logits_err:.3g}"
                worst = max(errs.items(), key=lambda e: e[1])
                assert worst[1] < ORDER_TOL["float32"], f"{where}: {worst}"
            if rank == 0:
                print(f"{where}: logits {logits_err:.2e}, worst grad {max(errs.values()):.2e}")


def test_torchtitan_models_with_symm_transport():
    """tests/test_titan022.py with a2a transport=symm forced: torchtitan 0.2.2's tiny
    Llama4 and DeepSeek-V3 parallelized by its own apply_moe_ep_tp (EP=2), every MoE layer
    through a SymmTokenDispatcher (all layers share one set of peer buffers), against
    torchtitan's ExpertParallel: bf16 legs within ORDER_TOL, MXFP8 presets above zero and
    within that test's bound."""
    import importlib

    from launch.titan.cpu_compat import _DEVICE_MODULES

    preload()
    for name in (*_DEVICE_MODULES, "torchtitan.models.llama4.infra.parallelize", "torchtitan.protocols.train_spec",
                 "launch.titan.models", "tests.test_titan022"):
        importlib.import_module(name)
    run_forked(2, _titan_models_symm)
