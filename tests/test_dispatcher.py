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
  (``Config.symm_partial_sums``, ``symm_combine_partial_sums``: each rank adds its rows of a
  token first; the x gradient, and with combine's partial sums the output and the score and
  router gradients, which symm then takes on the experts' rank), not compared where those
  partial sums or the score gradients' output gradient are MXFP8 (half the drawn routings
  turn combine's partial sums off: ``A2AConfig.symm_combine_partial_sums``). Both
  run the same kernels on the same expert-major layout: the same rows are quantized (those
  that cross ranks) with the same arithmetic, each token's rows reduced in the same fp32
  order, and the experts see the same per-expert batches (the layouts differ only in unused
  rows past the last expert, which no expert reads). This is the precise check of the fused
  nccl path; the two above bound it like symm. Where symm sends a weighted MXFP8 leg as
  tokens and multiplies the scores after dequantizing (``Config.symm_scores_after_dequantize``:
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
  received rows: the legs really quantize) and below ``QUANT_TOL`` = 2**-2. Not 2**-4: an
  e4m3 element moves by at most 2**-4 of its magnitude (RCEIL), but at these token counts a
  SwiGLU expert carries its input's error into its output about twice (it is ~quadratic in
  its input) and into its weight gradients up to four times (h1, h3, the outer product with
  x, and the quantized output gradient). Measured maxima: output 0.11, input gradient 0.084,
  expert weight gradients 0.11 (floor rounding, which can also clip a block's largest
  element by up to 2**-3), score gradients 0.02 -- the exact wire reference above is the
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
from mxfp8_ep.config import TRANSPORTS as CONFIG_TRANSPORTS
from mxfp8_ep.dispatcher import FusedNcclTokenDispatcher, NcclTokenDispatcher, SymmTokenDispatcher, TokenDispatcher
from tests import shared_gpu
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
    run_stack,
    setup_rank,
    symm_quantizes_partial_sums,
)

TRANSPORTS = tuple(t for t in CONFIG_TRANSPORTS if t != "auto")
assert TRANSPORTS == ("symm", "nccl")  # symm first: the fused nccl path is checked against it


def _rank_transports() -> tuple[str, ...]:
    """The transports this rank's group can run: both, but only symm where ranks share one GPU
    (``tests.shared_gpu``: a gloo group; the nccl transport's functional collectives over gloo
    with CUDA tensors crash in torch 2.11)."""
    return ("symm",) if shared_gpu.active() else TRANSPORTS


# (transport, any leg MXFP8) -> the class Config.build must pick.
DISPATCHER_CLASS = {
    ("nccl", False): NcclTokenDispatcher, ("nccl", True): FusedNcclTokenDispatcher,
    ("symm", False): SymmTokenDispatcher, ("symm", True): SymmTokenDispatcher,
}
EXAMPLES = {2: 80, 3: 70, 4: 50}
MAX_TOKENS = 16  # per rank; TokenDispatcher.Config.max_tokens_per_rank of every example
# Host waits of one EP layer's forward + backward per transport (CUDA; module docstring of
# tests/test_dispatcher_gpu.py): nccl waits once for the splits NCCL takes on the host.
HOST_WAITS = {"symm": 0, "nccl": 1}
PAD_MULTIPLES = (1, 8)  # 8 = torchtitan's TOKEN_GROUP_ALIGN_SIZE_M for bf16
ROUTINGS = ("router", "bias", "forced", "one_rank")
# Relative Frobenius bounds (module docstring). Reordered sums and roundings of the same values:
# measured maxima 3.6e-7 (fp32) and 3.9e-3 (bf16, expert weight gradients at 4 ranks).
ORDER_TOL = {"float32": 1e-5, "bfloat16": 2.0**-7}
QUANT_TOL = 2.0**-2
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
    found: list[Example] = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(_example(world))
    def collect(example):
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
    x = (torch.randn(T, spec.dim, generator=g) * torch.exp2(torch.randint(-3, 4, (T, 1), generator=g).float())).to(dtype)
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
    a2a_legs = A2AConfig.preset(ex.preset, scale_rounding=ex.rounding, symm_combine_partial_sums=ex.combine_partial_sums)
    quantized = a2a_legs.any_quantized
    # torchtitan's layer with each leg's format applied to the rows that would cross ranks.
    wire = reference_run(WireLegs(a2a_legs, rank, local))[0] if quantized else plain

    results = {}
    for transport in _rank_transports():
        config = TokenDispatcher.Config(
            num_experts=spec.num_experts, top_k=spec.top_k, a2a=replace(a2a_legs, transport=transport),
            score_before_experts=spec.score_before_experts, pad_multiple=ex.pad_multiple,
            max_tokens_per_rank=ex.max_tokens,
        )
        dispatcher = config.build(dist.group.WORLD, device)
        where = f"{transport} rank {rank}/{world}: {ex}"
        assert type(dispatcher) is DISPATCHER_CLASS[transport, quantized], where
        ep = build_ep_layer(reference, spec, dispatcher, rank)
        out, grads, seen = run_layer(ep, ep_forward, x, grad_out, bias, sync_check=device.type == "cuda")
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
        if transport == "symm" and (config.symm_scores_after_dequantize or symm_quantizes_partial_sums(config)):
            # symm quantizes other values than a row per leg (module docstring): its own wire reference.
            expected = reference_run(WireLegs(
                a2a_legs, rank, local, scores_after_dequantize=config.symm_scores_after_dequantize,
                partial_sums=config.symm_partial_sums, combine_partial_sums=config.symm_combine_partial_sums,
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
                assert err < QUANT_TOL, f"{name} vs unquantized: rel err {err:.3g} >= {QUANT_TOL:.3g}: {where}"
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
    if config.symm_scores_after_dequantize and name not in _same_when_scores_after_dequantize(spec):
        return None  # symm quantized other rows on the weighted leg
    if not config.symm_partial_sums:
        return "exact"
    # Partial sums (scores after the experts): the x gradient adds a token's rows in another
    # grouping; with combine's partial sums the output does too, and the score gradients (and
    # the router's) meet the output gradient on the experts' rank, in combine's backward format.
    a2a = config.a2a
    quantized = {"x": a2a.dispatch_bwd == "mxfp8"}
    if config.symm_combine_partial_sums:
        quantized.update(out=a2a.combine_fwd == "mxfp8", scores="mxfp8" in (a2a.combine_fwd, a2a.combine_bwd))
        quantized[ROUTER] = quantized["scores"]
    if name not in quantized:
        return "exact"
    return None if quantized[name] else ORDER_TOL[spec.dtype]


def _same_when_scores_after_dequantize(spec: LayerSpec) -> set[str]:
    """What symm and the fused nccl transport still compute alike where symm multiplies a
    weighted leg's scores after dequantizing (``Config.symm_scores_after_dequantize``): what
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
    if rank == 0:
        for key in sorted(stats):
            print(f"world {world} max rel err {key}: {stats[key]:.3g}")


@pytest.mark.parametrize("world", sorted(EXAMPLES))
def test_dispatcher_matches_torchtitan_moe(world):
    examples = hypothesis_examples(world, EXAMPLES[world]) + extreme_examples(world)
    preload()
    run_forked(world, _fuzz, examples)


def test_fuzz_covers_200_routings_and_the_edges():
    assert sum(EXAMPLES.values()) >= 200
    for world in sorted(EXAMPLES):
        drawn = hypothesis_examples(world, EXAMPLES[world])
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
# stale buffers: two layers sharing the symm transport's peer buffers


class _StagingViewDispatcher(SymmTokenDispatcher):
    """The bug of torchtitan 0.3.0's MinimalAsyncEP, planted: dispatch hands the experts its
    receive (staging) buffer itself instead of a fresh tensor. The next leg that uses that
    staging buffer (the next layer's dispatch) overwrites the rows the grouped GEMM saved for
    its weight gradient. Its staging buffers hold the whole expert-major tensor (buffers of
    their own: the transport's size only what the legs store there)."""

    def _buffer_key(self, x_TD):  # noqa: N803
        return (*super()._buffer_key(x_TD), "planted")

    def _staging_rows(self, max_tokens, capacity, dim, dtype):
        return max(super()._staging_rows(max_tokens, capacity, dim, dtype), capacity)

    def to_experts(self, src, meta, leg, **kwargs):
        out = super().to_experts(src, meta, leg, **kwargs)
        bufs = self._buffers_for(src)
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
    bound = QUANT_TOL if A2AConfig.preset(preset).any_quantized else ORDER_TOL["float32"]
    for name, ref in {"out": ref_out, **ref_grads}.items():
        err = rel_err(out if name == "out" else grads[name], ref)
        if not err < bound:
            problems.append(f"{name}: rel err {err:.3g} >= {bound:.3g}")
    return problems


def _stale_buffers(rank, world):
    setup_rank()
    for transport in _rank_transports():
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


# --------------------------------------------------------------------------------------------
# bad input


def _dispatcher(transport, preset="bf16", num_experts=None, top_k=1, **a2a_overrides):
    num_experts = num_experts or 2 * dist.get_world_size()
    config = TokenDispatcher.Config(
        num_experts=num_experts, top_k=top_k, max_tokens_per_rank=MAX_TOKENS,
        a2a=A2AConfig.preset(preset, transport=transport, **a2a_overrides),
    )
    return config.build(dist.group.WORLD, rank_device())


def _to_next_rank(rank, world, tokens, dim, dtype=torch.float32, seed=0):
    """Top-1 routing of every token to the first expert of the next rank (2 experts per rank;
    every row crosses), score 1: a layer with identity experts gives each token back."""
    x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed + rank)).to(dtype)
    ids = torch.full((tokens, 1), (rank + 1) % world * 2, dtype=torch.int64)
    scores = torch.ones(tokens, 1)
    return x, scores, ids, torch.bincount(ids.reshape(-1), minlength=2 * world)


def _round_trip(dispatcher, x, scores, ids, counts):
    """dispatch -> identity experts -> combine -> backward of sum(out): routed input (valid
    rows), combine output, x grad, score grad."""
    x = x.clone().requires_grad_(True)
    scores = scores.clone().requires_grad_(True)
    routed, per_expert, meta = dispatcher.dispatch(x, scores, ids, counts)
    out = dispatcher.combine(routed.clone(), meta)
    out.backward(torch.ones_like(out))
    return routed.detach()[: int(per_expert.sum())], out.detach(), x.grad, scores.grad


def _staging_sizes(rank, world):
    """Every token to both experts of the next rank (top-2, all rows cross), dim 32 and 256-row
    expert padding: the score gradients combine's backward returns then need more bytes than
    the token rows. Identity experts: out = x (s0 + s1), x grad = s0 + s1, score grads = sum(x).
    And the DeepSeek-V3-like layer's staging rows: its tokens on every rank, nothing more."""
    from mxfp8_ep.dispatcher.symm import _BUFFERS
    from mxfp8_ep.capacity import expert_major_capacity

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
        _, out, x_grad, score_grad = _round_trip(config.build(dist.group.WORLD, "cpu"), x, scores, ids, counts)
        (bufs,) = _BUFFERS.values()
        assert bufs.staging_rows < bufs.capacity, (bufs.staging_rows, bufs.capacity)
        total = scores.sum(dim=1, keepdim=True)
        torch.testing.assert_close(out, x * total, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x_grad, total.expand_as(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(score_grad, x.sum(dim=1, keepdim=True).expand_as(scores), rtol=1e-5, atol=1e-5)
    # The recipe's memory estimate before launch (launch/memory.py) reads what is allocated.
    from launch.memory import EXPERT_ALIGN, symm_peer_buffer_bytes
    from launch.model_facts import MODELS

    facts = replace(MODELS["deepseek_v3", "tiny"], dim=dim, num_experts=2 * world, top_k=2)
    for flag in (True, False):
        _BUFFERS.clear()
        config = TokenDispatcher.Config(
            num_experts=2 * world, top_k=2, pad_multiple=EXPERT_ALIGN, max_tokens_per_rank=MAX_TOKENS,
            a2a=A2AConfig.preset("bf16", transport="symm", symm_combine_partial_sums=flag),
        )
        _round_trip(config.build(dist.group.WORLD, "cpu"), x.bfloat16(), scores, ids, counts)
        (bufs,) = _BUFFERS.values()
        assert sum(b.nbytes for b in bufs.staging) == symm_peer_buffer_bytes(facts, MAX_TOKENS, world, flag), flag
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
    expert-major capacity (``mxfp8_ep.capacity.staging_rows``); at a small dim with large
    expert padding the score gradients combine's backward returns through them still fit; the
    recipe's memory estimate (``launch/memory.py``) counts the bytes they take."""
    preload()
    for world in (2, 3):
        run_forked(world, _staging_sizes)


def _bad_input(rank, world):
    setup_rank()
    quantized = [name for name in sorted(PRESETS) if A2AConfig.preset(name).any_quantized]
    assert quantized
    for transport in TRANSPORTS:
        # A model dim that is not a multiple of 32 with any MXFP8 leg: ValueError before any
        # collective. First each rank alone (its peers wait in a barrier: had it entered a
        # collective it would hang or mismatch), then all ranks together.
        for preset in quantized:
            dispatcher = _dispatcher(transport, preset)
            x, scores, ids, counts = _to_next_rank(rank, world, 5, 40)
            for alone in (*range(world), None):
                if alone in (rank, None):
                    with pytest.raises(ValueError, match=r"multiple of 32.*dim 40"):
                        dispatcher.dispatch(x, scores, ids, counts)
                dist.barrier()
            # The group is still in step: the same dispatcher then carries a valid batch there
            # and back (through MXFP8: close, not equal).
            x, scores, ids, counts = _to_next_rank(rank, world, 5, 64)
            _, out, _, _ = _round_trip(dispatcher, x, scores, ids, counts)
            assert 0 < rel_err(out, x) < 2.0**-4, f"{transport} {preset}: tokens did not come back"
        # bf16 legs take any width.
        x, scores, ids, counts = _to_next_rank(rank, world, 5, 40)
        _, out, _, _ = _round_trip(_dispatcher(transport, "bf16"), x, scores, ids, counts)
        assert torch.equal(out, x), transport
        # EP that does not divide the experts: ValueError at build, on every rank.
        with pytest.raises(ValueError, match=rf"expert parallelism {world} must divide the number of experts {2 * world + 1}"):
            _dispatcher(transport, num_experts=2 * world + 1)


def _non_finite(rank, world):
    """Token 0 has a NaN (column 5), token 1 a +inf (column 40), tokens 2-3 are finite; every
    row goes to another rank. What mxfp8_ep/format.py says an MXFP8 leg does: a NaN makes its
    whole 32-block NaN; an inf comes back inf and flushes the finite elements of its block to
    zero (scale 2**127); other blocks and tokens stay finite. bf16 legs carry them as they are."""
    from mxfp8_ep.format import BLOCK_SIZE

    setup_rank()
    dim = 2 * BLOCK_SIZE
    for transport in TRANSPORTS:
        for preset in sorted(PRESETS):
            for rounding in SCALE_ROUNDINGS:
                a2a = A2AConfig.preset(preset, scale_rounding=rounding)
                x, scores, ids, counts = _to_next_rank(rank, world, 4, dim)
                x[0, 5], x[1, 40] = float("nan"), float("inf")
                sent = _to_next_rank((rank - 1) % world, world, 4, dim)[0]  # the rows we host
                sent[0, 5], sent[1, 40] = float("nan"), float("inf")
                routed, out, x_grad, score_grad = _round_trip(
                    _dispatcher(transport, preset, scale_rounding=rounding), x, scores, ids, counts)
                where = f"{transport} {preset} {rounding} rank {rank}"
                legs = [getattr(a2a, leg) == "mxfp8" for leg in ("dispatch_fwd", "combine_fwd")]
                # This rank's first expert got the previous rank's 4 tokens, in order; padding
                # rows follow.
                assert (routed[4:] == 0).all(), where
                routed = routed[:4]
                for value, quantized_legs in ((routed, legs[:1]), (out, legs)):
                    source = sent if value is routed else x
                    nan_mask = torch.zeros_like(source, dtype=torch.bool)
                    nan_mask[0, :BLOCK_SIZE] = True if any(quantized_legs) else False
                    nan_mask[0, 5] = True
                    assert torch.equal(value.isnan(), nan_mask), f"NaN pattern: {where}"
                    assert value[1, 40] == float("inf") and torch.isfinite(value[1, :BLOCK_SIZE]).all(), where
                    if any(quantized_legs):
                        assert (value[1, BLOCK_SIZE:].nan_to_num(posinf=0) == 0).all(), f"inf block: {where}"
                    else:
                        assert torch.equal(value[1:], source[1:]), where
                    assert torch.isfinite(value[2:]).all(), where
                assert torch.isfinite(x_grad).all(), f"x grad: {where}"
                assert torch.isfinite(score_grad[2:]).all() and not torch.isfinite(score_grad[:2]).any(), where


def test_bad_input_fails_on_every_rank_before_any_collective():
    """dim % 32 != 0 with an MXFP8 leg: ValueError on each rank alone and on all ranks, and
    the group stays usable; EP not dividing the experts: ValueError at build."""
    preload()
    run_forked(2, _bad_input)


def test_nan_and_inf_tokens_follow_the_mxfp8_format():
    preload()
    run_forked(2, _non_finite)


def _hosts(rank, world):
    from unittest import mock

    from mxfp8_ep.dispatcher import resolve_transport

    setup_rank()
    group, cpu, cuda = dist.group.WORLD, torch.device("cpu"), torch.device("cuda")  # only the type is read
    with mock.patch("socket.gethostname", return_value=f"node{rank}"):
        with pytest.raises(ValueError, match=rf"transport=symm needs every EP rank on one node.*spans {world} hosts"):
            resolve_transport("symm", cpu, group)
        with pytest.raises(ValueError, match=rf"spans {world} hosts.*use transport=nccl"):
            _dispatcher("symm")
        assert resolve_transport("auto", cuda, group) == "nccl"  # multi-node: all-to-all
        assert type(_dispatcher("nccl")) is NcclTokenDispatcher
    with mock.patch("socket.gethostname", return_value="node"):
        assert resolve_transport("auto", cuda, group) == "symm"
        assert resolve_transport("symm", cpu, group) == "symm"
        assert resolve_transport("auto", cpu, group) == "nccl"  # no CUDA: all-to-all


def test_symm_across_hosts_is_a_clear_error():
    """Each rank reports another host name: an explicit symm transport raises on every rank
    (peer memory does not span nodes); auto picks nccl there, symm on one CUDA node."""
    preload()
    run_forked(2, _hosts)


# --------------------------------------------------------------------------------------------
# torchtitan 0.2.2 models, transport symm


def _titan_models_symm(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp

    from mxfp8_ep.expert_parallel import install_expert_parallel, uninstall_expert_parallel
    from launch.titan_cpu_compat import apply_cpu_compat
    from tests.test_expert_parallel import TOLERANCE, _build

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
                # tests/test_expert_parallel.py's bound for these models (64 tokens per rank).
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
    """tests/test_expert_parallel.py with a2a transport=symm forced: torchtitan 0.2.2's tiny
    Llama4 and DeepSeek-V3 parallelized by its own apply_moe_ep_tp (EP=2), every MoE layer
    through a SymmTokenDispatcher (all layers share one set of peer buffers), against
    torchtitan's ExpertParallel: bf16 legs within ORDER_TOL, MXFP8 presets above zero and
    within that test's bound."""
    import importlib

    from launch.titan_cpu_compat import _DEVICE_MODULES

    preload()
    for name in (*_DEVICE_MODULES, "torchtitan.models.llama4.infra.parallelize", "torchtitan.protocols.train_spec",
                 "launch.titan_models", "tests.test_expert_parallel"):
        importlib.import_module(name)
    run_forked(2, _titan_models_symm)


OVERFLOW_TIMEOUT_S = 5
OVERFLOW_CUDA_LIMIT_S = 30  # on CUDA the peer's first dispatch also compiles its kernels before it traps


def _too_many_tokens(rank, world):
    """Rank 0 gets more tokens than the symm buffers hold and raises ValueError after the count
    exchange. Its peers raise it too on CPU; on CUDA (tests/test_dispatcher_gpu.py) their check
    is a device-side assert (no host sync): they fail at their next synchronization with
    "device-side assert" and exit at once, their CUDA context lost."""
    import os
    import time

    setup_rank()
    device = rank_device()
    dispatcher = _dispatcher("symm")  # buffers for MAX_TOKENS per rank
    tokens = MAX_TOKENS + 1 if rank == 0 else 1  # rank 0 alone is over capacity
    x, scores, ids, counts = (t.to(device) for t in _to_next_rank(rank, world, tokens, 64))
    start = time.monotonic()
    try:
        dispatcher.dispatch(x, scores, ids, counts)
        if device.type == "cuda":
            torch.cuda.synchronize()  # where a device-side assert surfaces
        raised = None
    except Exception as e:  # noqa: BLE001  (which error, and how fast, is the point)
        raised = e
    took = time.monotonic() - start
    if rank == 0:  # stay out of collectives while the peers find out (or time out)
        time.sleep(OVERFLOW_TIMEOUT_S + 2)
    if device.type == "cuda" and rank != 0:
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
    run_forked(2, _too_many_tokens, timeout_s=OVERFLOW_TIMEOUT_S)


def _larger_config_after_smaller(rank, world):
    setup_rank()
    small = TokenDispatcher.Config(num_experts=2 * world, top_k=1, max_tokens_per_rank=4,
                                   a2a=A2AConfig(transport="symm")).build(dist.group.WORLD, "cpu")
    x, scores, ids, counts = _to_next_rank(rank, world, 4, 64)
    _round_trip(small, x, scores, ids, counts)
    large = TokenDispatcher.Config(num_experts=2 * world, top_k=1, max_tokens_per_rank=12,
                                   a2a=A2AConfig(transport="symm")).build(dist.group.WORLD, "cpu")
    x, scores, ids, counts = _to_next_rank(rank, world, 12, 64)
    _, out, _, _ = _round_trip(large, x, scores, ids, counts)  # within its configured capacity
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
