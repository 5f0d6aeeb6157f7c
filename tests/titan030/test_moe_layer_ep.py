"""Our dispatchers in torchtitan 0.3.0's MoE layer (router, grouped-GEMM experts, shared
expert) under EP on 2 and 3 gloo ranks, against 0.3.0's own ``AllToAllTokenDispatcher`` and
``TorchAOTokenDispatcher`` (bf16): three SGD steps per arm, same weights and tokens.

* bf16 over nccl is the parent class bit for bit: output, input gradient and every parameter
  gradient, at every step.
* bf16 over symm hands the experts the same rows (its padding rows are zero), so the expert
  gradients are bit-identical; its combine reduces in fp32 once where 0.3.0 rounds each scaled
  row and sums in bf16, so the output differs by bf16 rounding only.
* MXFP8 legs: every row the experts receive, and every row of the gradient they get back, is the
  bf16 row or that row through the MXFP8 format (one quantize / dequantize, rceil scales).
* nccl with a quantized leg runs the fused nccl dispatcher, on the symm transport's kernels: it
  hands the experts symm's rows bit for bit, and where symm regroups no sum and quantizes no
  other rows (combine row by row, combine's backward in bf16) the layer's output and every
  parameter gradient are symm's bit for bit too (the input gradient: symm adds a token's rows
  as partial sums per rank, a bf16 regrouping), as tests/test_dispatcher.py checks for
  torchtitan 0.2.2.
* Under activation checkpointing (the backward recomputes dispatch and combine between its own
  exchanges) every transport gives what it gives without, bit for bit.

Each world size runs once (module fixture); the ranks write what they measured and the tests
below check it rank by rank.
"""

from __future__ import annotations

import json

import pytest

titan030 = pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

import torch  # noqa: E402

from mxfp8_ep.config import A2AConfig  # noqa: E402
from mxfp8_ep.format.mxfp8 import BLOCK_SIZE, dequantize_reference, quantize_reference, scale_to_fp32  # noqa: E402
from tests.moe_harness import rel_err, run_forked  # noqa: E402
from tests.titan030.moe_layer import MoESpec, reference_config, run_arm, segments, setup_rank  # noqa: E402

SPEC = MoESpec()
PAD = 8  # the padded family: TorchAOTokenDispatcher's pad multiple
# arm -> (reference pad multiple or None, preset, transport)
ARMS = {
    "bf16/nccl": (None, "bf16", "nccl"),
    "bf16/symm": (None, "bf16", "symm"),
    "padded bf16/nccl": (PAD, "bf16", "nccl"),
    "padded bf16/symm": (PAD, "bf16", "symm"),
    "mxfp8/nccl": (None, "mxfp8", "nccl"),
    "mxfp8/symm": (None, "mxfp8", "symm"),
    "mxfp8_all/nccl": (None, "mxfp8_all", "nccl"),
    "mxfp8_all/symm": (None, "mxfp8_all", "symm"),
    "dispatch_fwd mxfp8, rows/nccl": (None, "dispatch_fwd mxfp8, rows", "nccl"),
    "dispatch_fwd mxfp8, rows/symm": (None, "dispatch_fwd mxfp8, rows", "symm"),
}
# a2a configs beyond the presets: only dispatch's forward quantized, combine's forward row by row.
CONFIGS = {"dispatch_fwd mxfp8, rows": dict(dispatch_fwd="mxfp8", symm_combine_partial_sums=False)}
# The fused nccl transport against symm: same preset, nccl then symm.
FUSED_VS_SYMM = ["mxfp8", "mxfp8_all", "dispatch_fwd mxfp8, rows"]
# Checkpointed arms, compared with the same arm without checkpointing.
CHECKPOINTED = ["bf16/nccl", "mxfp8_all/nccl", "bf16/symm", "mxfp8_all/symm"]
LEG_ROWS = {"expert_input": "dispatch_fwd", "expert_output_grad": "combine_bwd"}


def qdq(rows: torch.Tensor) -> torch.Tensor:
    return dequantize_reference(quantize_reference(rows, "rceil"), rows.dtype)


def format_bound(ref: torch.Tensor) -> torch.Tensor:
    """What one MXFP8 round trip may move each element (tests/test_mxfp8.py): 2**-4 of it in
    e4m3's normal range, 2**-10 of its block scale below it."""
    scale = scale_to_fp32(quantize_reference(ref, "rceil").scale).repeat_interleave(BLOCK_SIZE, dim=-1)
    return torch.maximum(ref.float().abs() * 2.0**-4, scale * 2.0**-10)


def leg_report(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Rows that crossed the EP boundary as the experts saw them, against the bf16 reference."""
    same = (got == ref).all(dim=1)
    wire = (got == qdq(ref)).all(dim=1)
    excess = ((got.float() - ref.float()).abs() / format_bound(ref).clamp(min=1e-30)).max() if got.numel() else 0
    return {"rows": int(got.shape[0]), "same": int(same.sum()), "same_or_wire": int((same | wire).sum()),
            "max_err_over_bound": float(excess)}


def step_report(got: dict, ref: dict) -> dict:
    counts = ref["tokens_per_expert"]
    names = [n for n in ref if n == "out" or n.endswith(".grad")]
    report = {
        "differ": [n for n in names if not torch.equal(got[n], ref[n])],
        "rel_err": {n: rel_err(got[n], ref[n]) for n in names},
        "finite": all(bool(torch.isfinite(got[n]).all()) for n in names),
        "tokens_per_expert": got["tokens_per_expert"].tolist(),
        "ref_tokens_per_expert": counts.tolist(),
    }
    if bool((got["tokens_per_expert"] >= counts).all()):
        for name in LEG_ROWS:
            kept, padding = segments(got[name], got["tokens_per_expert"], counts)
            report[name] = leg_report(kept, ref[name][: int(counts.sum())])
            report[name]["padding_rows"] = int(padding.shape[0])
            report[name]["padding_zero"] = bool((padding == 0).all())
    return report


def pair_report(fused: dict, symm: dict) -> dict:
    """Step 0 of the fused nccl arm against the symm arm: the experts' rows (each transport's
    segments, padding included) and which results differ."""
    rows = int(symm["tokens_per_expert"].sum())
    names = [n for n in symm if n == "out" or n.endswith(".grad")]
    return {
        "same_tokens_per_expert": torch.equal(fused["tokens_per_expert"], symm["tokens_per_expert"]),
        **{f"same_{leg}": torch.equal(fused[leg][:rows].view(torch.int16), symm[leg][:rows].view(torch.int16))
           for leg in LEG_ROWS},
        "differ": [n for n in names if not torch.equal(fused[n], symm[n])],
        "rel_err": {n: rel_err(fused[n], symm[n]) for n in names},
    }


def compare_arms(rank: int, world: int, out_dir) -> None:
    mesh = setup_rank(world)
    refs = {pad: run_arm(SPEC, reference_config(SPEC, pad), mesh, backend="partial_dtensor") for pad in (None, PAD)}
    report, runs = {}, {}
    for arm, (pad, preset, transport) in ARMS.items():
        a2a = A2AConfig(**CONFIGS[preset], transport=transport) if preset in CONFIGS else A2AConfig.preset(
            preset, transport=transport)
        config = titan030.replacement_config(reference_config(SPEC, pad), a2a)
        runs[arm] = run_arm(SPEC, config, mesh, dispatchers=(seen := []))
        report[f"{arm} dispatcher"] = sorted({type(d).__name__ for d in seen})
        report[arm] = [step_report(g, r) for g, r in zip(runs[arm], refs[pad])]
        if arm in CHECKPOINTED:
            got = run_arm(SPEC, config, mesh, checkpointed=True)
            report[f"{arm} checkpointed"] = [step_report(g, r) for g, r in zip(got, runs[arm])]
    for preset in FUSED_VS_SYMM:
        report[f"{preset} fused vs symm"] = pair_report(runs[f"{preset}/nccl"][0], runs[f"{preset}/symm"][0])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"moe_ep_{world}")
    run_forked(world, compare_arms, out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def each_rank_step(ranks, arm, steps=None):
    for rank, report in enumerate(ranks):
        for step, s in enumerate(report[arm][:steps]):
            yield f"rank {rank} step {step}", s


@pytest.mark.parametrize("arm", ["bf16/nccl", "padded bf16/nccl"])
def test_bf16_nccl_is_the_parent_dispatcher_bit_for_bit(ranks, arm):
    for where, s in each_rank_step(ranks, arm):
        assert s["differ"] == [], f"{arm} {where}: not bit-identical to 0.3.0's dispatcher: {s['rel_err']}"
        assert s["tokens_per_expert"] == s["ref_tokens_per_expert"], where


@pytest.mark.parametrize("arm", ["bf16/symm", "padded bf16/symm"])
def test_bf16_symm_gives_the_experts_the_same_rows(ranks, arm):
    """Step 0 (later steps start from weights that differ by the combine's rounding)."""
    for where, s in each_rank_step(ranks, arm, steps=1):
        for leg in LEG_ROWS:
            assert leg in s, f"{arm} {where}: tokens per expert {s['tokens_per_expert']} < {s['ref_tokens_per_expert']}"
            r = s[leg]
            assert r["same"] == r["rows"], f"{arm} {where} {leg}: {r['rows'] - r['same']} rows differ"
            assert r["padding_zero"], f"{arm} {where} {leg}: nonzero padding rows"
        experts = {n: e for n, e in s["rel_err"].items() if "inner_experts" in n}
        assert all(e == 0 for e in experts.values()), f"{arm} {where}: expert gradients differ {experts}"
        # fp32 reduce of top_k rows vs bf16 rounding of each scaled row and a bf16 scatter-add.
        bound = (SPEC.top_k + 1) * 2.0**-9
        worst = max(s["rel_err"].values())
        assert s["finite"] and worst <= bound, f"{arm} {where}: rel err {s['rel_err']} > {bound}"


def test_an_empty_expert_gets_zero_padding_rows(ranks):
    """The starved expert: no tokens; the symm arm hands it padding rows, all zero."""
    owner = ranks[-1]
    s = owner["bf16/symm"][0]
    assert s["ref_tokens_per_expert"][-1] == 0 and s["tokens_per_expert"][-1] >= 1, s
    assert s["expert_input"]["padding_zero"] and s["expert_output_grad"]["padding_zero"]


@pytest.mark.parametrize("transport", ["nccl", "symm"])
def test_mxfp8_legs_carry_rows_in_the_mxfp8_format(ranks, transport):
    """Preset mxfp8 quantizes the dispatch forward and the combine backward: each row the
    experts get (input, output gradient) is the bf16 row (it stayed on its rank) or exactly that
    row through one MXFP8 round trip, so within the format's bound; some rows did cross.
    Except symm's combine backward at top-k > 1 (``SymmTokenDispatcher.Config.scores_after_dequantize``): the
    output gradient crosses once per token and the experts' rank multiplies it by each row's
    score, ``score * dequant(quant(g))``, not a round trip of ``score * g``
    (tests/test_dispatcher.py checks those bits against a wire reference of exactly that). Its
    error is then the format's on ``g``, times the score: within 2**-4 of the row in e4m3's
    normal range as before, but below it a block scale of ``g``'s block, which can be twice
    ``score *`` the scale of the scaled row's block (both are powers of two rounded up), plus
    the final bf16 rounding: within twice the bound."""
    arm = f"mxfp8/{transport}"
    crossed = 0
    for where, s in each_rank_step(ranks, arm, steps=1):
        for leg in LEG_ROWS:
            r = s[leg]
            scored = transport == "symm" and LEG_ROWS[leg] == "combine_bwd" and SPEC.top_k > 1
            if not scored:
                assert r["same_or_wire"] == r["rows"], f"{arm} {where} {leg}: rows off the MXFP8 format: {r}"
            assert r["max_err_over_bound"] <= (2 if scored else 1), f"{arm} {where} {leg}: {r}"
            crossed += r["rows"] - r["same"]
    assert crossed > 0, f"{arm}: no row was quantized"


@pytest.mark.parametrize("arm", ["mxfp8/nccl", "mxfp8/symm", "mxfp8_all/nccl", "mxfp8_all/symm"])
def test_mxfp8_layer_error_is_that_of_the_format(ranks, arm):
    """End to end (step 0): the layer's output and gradients move by what the format's
    per-element error (2**-4 at most) allows, not more; and they do move."""
    for where, s in each_rank_step(ranks, arm, steps=1):
        assert s["finite"], f"{arm} {where}: non-finite values"
        errs = {n: e for n, e in s["rel_err"].items() if "shared_experts" not in n}
        assert max(errs.values()) <= 2.0**-4, f"{arm} {where}: {errs}"
        assert min(errs.values()) > 0, f"{arm} {where}: a quantized leg left {errs} unchanged"


@pytest.mark.parametrize("arm", CHECKPOINTED)
def test_activation_checkpointing_changes_nothing(ranks, arm):
    for where, s in each_rank_step(ranks, f"{arm} checkpointed"):
        assert s["differ"] == [], f"{arm} {where}: checkpointed run differs: {s['rel_err']}"


@pytest.mark.parametrize("arm, runs", [
    ("bf16/nccl", ["A2ATokenDispatcher"]),
    ("padded bf16/nccl", ["PaddedA2ATokenDispatcher"]),
    ("bf16/symm", ["A2ATokenDispatcher", "SymmTokenDispatcher"]),
    ("mxfp8/nccl", ["A2ATokenDispatcher", "FusedNcclTokenDispatcher"]),
    ("mxfp8_all/nccl", ["A2ATokenDispatcher", "FusedNcclTokenDispatcher"]),
    ("mxfp8/symm", ["A2ATokenDispatcher", "SymmTokenDispatcher"]),
])
def test_each_transport_takes_one_path(ranks, arm, runs):
    """As under torchtitan 0.2.2: nccl with bf16 legs is the parent's own path, nccl with a
    quantized leg the fused nccl dispatcher, symm the symm dispatcher."""
    for rank, report in enumerate(ranks):
        assert report[f"{arm} dispatcher"] == runs, f"rank {rank}"


@pytest.mark.parametrize("preset", FUSED_VS_SYMM)
def test_fused_nccl_gives_the_experts_symms_rows(ranks, preset):
    for rank, report in enumerate(ranks):
        r = report[f"{preset} fused vs symm"]
        assert r["same_tokens_per_expert"] and r["same_expert_input"], f"rank {rank}: {r}"


def test_fused_nccl_is_symm_bit_for_bit_where_symm_regroups_nothing(ranks):
    """Combine row by row, combine's backward in bf16: the experts' output gradient, the output
    and every parameter gradient are symm's bits; the input gradient is symm's up to the bf16
    regrouping of dispatch's backward (partial sums per rank)."""
    for rank, report in enumerate(ranks):
        r = report["dispatch_fwd mxfp8, rows fused vs symm"]
        assert r["same_expert_output_grad"], f"rank {rank}: {r}"
        assert set(r["differ"]) <= {"x.grad"}, f"rank {rank}: {r['differ']} {r['rel_err']}"
        assert r["rel_err"]["x.grad"] <= 2.0**-7, f"rank {rank}: {r['rel_err']}"
