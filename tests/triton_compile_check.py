"""Compile every Triton kernel of the package for sm_90 (Hopper) without a GPU and print a JSON
report: cubin size, whether the PTX uses ``cvt ... ue8m0``, the hardware e4m3 conversion, and
16-byte vector stores. Pointer arguments are declared 16-byte aligned, as Triton specializes
them at launch. Used by tests/test_triton_kernels.py; must run without TRITON_INTERPRET."""

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mxfp8_ep.kernels import check_kernels as ck  # noqa: E402
from mxfp8_ep.kernels import expert_kernels as ge  # noqa: E402
from mxfp8_ep.exchange import symm_kernels as sk  # noqa: E402
from mxfp8_ep.kernels import triton_kernels as tk  # noqa: E402
from mxfp8_ep.kernels.launch_shapes import KernelShapes  # noqa: E402
from mxfp8_ep.format.wire_format import WireFormat  # noqa: E402

QUANT = {"x_ptr": None, "data_ptr": "*u8", "scale_ptr": "*u8", "M": "i32", "K": "i32",
         "IN_BF16": "constexpr", "ROUNDING": "constexpr", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr"}
DEQUANT = {"data_ptr": "*u8", "scale_ptr": "*u8", "out_ptr": None, "M": "i32", "K": "i32",
           "OUT_BF16": "constexpr", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr"}
PUSH = {"src_ptr": "*i16", "slot_ptr": "*i64", "weight_ptr": "*fp32", "dot_with_ptr": "*i16",
        "dot_out_ptr": "*fp32", "dst_rank_ptr": "*i64", "dst_row_ptr": "*i64", "local_out_ptr": "*i16",
        "stage_ptr": "*u8", "peer_delta_ptr": "*i64", "M": "i32", "rank": "i32"}
PUSH_TOKENS = {"src_ptr": "*i16", "sorted_row_ptr": "*i64", "dst_rank_ptr": "*i64", "dst_row_ptr": "*i64",
               "local_out_ptr": "*i16", "stage_ptr": "*u8", "stage_delta_ptr": "*i64", "map_ptr": "*i64",
               "map_delta_ptr": "*i64", "weight_map_ptr": "*fp32", "weight_delta_ptr": "*i64", "weight_ptr": "*fp32",
               "dot_with_ptr": "*i16", "dot_out_ptr": "*fp32", "sent_ptr": "*i64", "T": "i32", "rank": "i32",
               "max_tokens": "i32"}
PUSH_PARTIALS = {"src_ptr": "*i16", "order_ptr": "*i64", "start_ptr": "*i64", "weight_ptr": "*fp32",
                 "stage_ptr": "*i16", "peer_delta_ptr": "*i64", "sent_ptr": "*i64", "S": "i32", "rank": "i32",
                 "max_tokens": "i32"}
RECEIVE = {"out_ptr": "*i16", "source_ptr": "*i64", "stage_ptr": "*u8", "stage_row_ptr": "*i64",
           "weight_ptr": "*fp32", "dot_with_ptr": "*i16", "dot_out_ptr": "*fp32", "R": "i32", "rank": "i32"}
REDUCE = {"out_ptr": "*i16", "sorted_row_ptr": "*i64", "row_rank_ptr": "*i64", "local_row_ptr": "*i64",
          "local_src_ptr": "*i16", "stage_ptr": "*u8", "stage_row_ptr": "*i64", "weight_ptr": "*fp32",
          "save_ptr": "*i16", "dot_with_ptr": "*i16", "dot_out_ptr": "*fp32", "T": "i32", "rank": "i32"}
ROWS = {"a_ptr": "*i16", "b_ptr": "*i16", "c_ptr": "*i16", "out1_ptr": "*i16", "out2_ptr": "*i16",
        "valid_ptr": "*i32"}

# The flags a case leaves out are off (every kernel argument gets a type or a value: Triton 3.9
# rejects a kernel compiled with one missing).
FLAGS_OFF = {
    sk._push_rows_kernel: dict(QUANTIZE_LOCAL=False),
    sk._push_tokens_kernel: dict(QUANTIZE_LOCAL=False, WEIGH_LOCAL=False, DOT_EXPERT_ROWS=False),
    sk._push_partials_kernel: dict(HAS_WEIGHT=False),
    sk._receive_rows_kernel: dict(HAS_DOT=False),
    sk._reduce_slots_kernel: dict(WEIGH_STAGED=False, QUANTIZE_LOCAL=False, ROUNDING=0),
}


# The launch shapes the wrappers use (warps are a compile option: vector widths depend on them).
def launch(block: str, kernel: str, fmt: str, dim: int = 7168) -> dict:
    """A kernel's constants for a leg in ``fmt`` as its wrapper passes them: the format's
    (``ELEMENT``, ``SCALE``, ``GROUP``), ``block`` per program, the column tile for ``dim``, the
    warps (and push_rows' stripes and stages)."""
    shape = getattr(KernelShapes.default(fmt), kernel)
    constants = WireFormat(fmt).kernel_constants()
    launched = {**constants, block: shape.block, "BLOCK_D": shape.tile(dim, constants["GROUP"]),
                "num_warps": shape.warps}
    if kernel == "push_rows":
        launched.update(STRIPES=shape.stripes, STAGES=shape.stages)
    return launched


SYMM = {
    "push_mxfp8": (sk._push_rows_kernel, PUSH, dict(D=7168, TOP_K=8, HAS_SLOT=True, HAS_WEIGHT=True, HAS_DOT=True,
                                                    IN_BF16=True, ROUNDING=0, PUSHED=0,
                                                    **launch("BLOCK_M", "push_rows", "mxfp8"))),
    "push_bf16": (sk._push_rows_kernel, {**PUSH, "stage_ptr": "*i16"},
                  dict(D=5120, TOP_K=1, HAS_SLOT=False, HAS_WEIGHT=False, HAS_DOT=False, IN_BF16=True,
                       ROUNDING=0, PUSHED=0, **launch("BLOCK_M", "push_rows", "bf16", 5120))),
    # symm: expert-bound legs, each token once per rank (DeepSeek-V3-like at EP 2 and 8): dispatch's
    # forward (unweighted) and combine's backward (scores left for the receiver, dot products).
    **{f"push_tokens_{fmt}_w{w}{'_weighted' if weighted else ''}": (
        sk._push_tokens_kernel, {**PUSH_TOKENS, "stage_ptr": "*u8" if fmt == "mxfp8" else "*i16"},
        dict(D=7168, TOP_K=8, KP=8, W=w, IN_BF16=True, ROUNDING=0, HAS_WEIGHT=weighted,
             HAS_DOT=weighted, **launch("BLOCK_T", "push_tokens", fmt)))
       for fmt in ("mxfp8", "bf16") for w in (2, 8) for weighted in (False, True)},
    # symm: dispatch's backward as one partial sum per token and rank (DeepSeek-V3-like, EP 2).
    **{f"push_partials_{fmt}": (sk._push_partials_kernel,
                                {**PUSH_PARTIALS, "stage_ptr": "*u8" if fmt == "mxfp8" else "*i16"},
                                dict(D=7168, MAX_ROWS=8, IN_BF16=True, ROUNDING=0,
                                     **launch("BLOCK_S", "push_partials", fmt)))
       for fmt in ("bf16", "mxfp8")},
    # nccl: the rows that leave (before its host sync), then the rows that stay.
    **{f"push_mxfp8_only_{pushed}": (sk._push_rows_kernel, PUSH, dict(
        D=7168, TOP_K=8, HAS_SLOT=True, HAS_WEIGHT=False, HAS_DOT=False, IN_BF16=True, ROUNDING=0,
        PUSHED=sk.pushed_rows_index(pushed), **launch("BLOCK_M", "push_rows", "mxfp8")))
       for pushed in ("local", "remote")},
    # symm reads staged row i for row i; nccl reads the row its stage_row index names.
    # symm after a weighted token-once push: through the token map, times the row weights.
    **{f"receive_mxfp8{tag}": (sk._receive_rows_kernel, RECEIVE, dict(D=7168, IN_BF16=True,
                                                                      HAS_STAGE_ROW=staged, HAS_WEIGHT=weighted,
                                                                      **launch("BLOCK_M", "receive_rows", "mxfp8")))
       for tag, staged, weighted in (("", False, False), ("_stage_row", True, False), ("_weighted", True, True))},
    **{f"receive_bf16_stage_row{tag}": (sk._receive_rows_kernel, {**RECEIVE, "stage_ptr": "*i16"},
                                        dict(D=5120, IN_BF16=True, HAS_STAGE_ROW=True, HAS_WEIGHT=weighted,
                                             **launch("BLOCK_M", "receive_rows", "bf16", 5120)))
       for tag, weighted in (("", False), ("_weighted", True))},
    **{f"reduce_mxfp8{tag}": (sk._reduce_slots_kernel, REDUCE,
                              dict(D=7168, TOP_K=8, KP=8, IN_BF16=True, HAS_WEIGHT=True, HAS_SAVE=True,
                                   HAS_DOT=True, HAS_STAGE_ROW=staged, **launch("BLOCK_T", "reduce_slots", "mxfp8")))
       for tag, staged in (("", False), ("_stage_row", True))},
    "reduce_bf16": (sk._reduce_slots_kernel, {**REDUCE, "stage_ptr": "*i16"},
                    dict(D=7168, TOP_K=8, KP=8, IN_BF16=True, HAS_WEIGHT=True, HAS_SAVE=True,
                         HAS_DOT=False, HAS_STAGE_ROW=False, **launch("BLOCK_T", "reduce_slots", "bf16"))),
    # after push_partials: plain sum, partials read through stage_row (-1: nothing to add).
    **{f"reduce_{fmt}_partials": (sk._reduce_slots_kernel, {**REDUCE, "stage_ptr": "*u8" if fmt == "mxfp8" else "*i16"},
                                  dict(D=7168, TOP_K=8, KP=8, IN_BF16=True, HAS_WEIGHT=False,
                                       HAS_SAVE=False, HAS_DOT=False, HAS_STAGE_ROW=True,
                                       **launch("BLOCK_T", "reduce_slots", fmt)))
       for fmt in ("bf16", "mxfp8")},
    # A2AConfig.quantize_local_rows: the rows that stay encoded and decoded in registers.
    "push_mxfp8_quantize_local": (sk._push_rows_kernel, PUSH, dict(
        D=7168, TOP_K=8, HAS_SLOT=True, HAS_WEIGHT=True, HAS_DOT=True, IN_BF16=True, ROUNDING=0, QUANTIZE_LOCAL=True,
        PUSHED=0, **launch("BLOCK_M", "push_rows", "mxfp8"))),
    "push_tokens_mxfp8_w2_weighted_quantize_local": (sk._push_tokens_kernel, PUSH_TOKENS, dict(
        D=7168, TOP_K=8, KP=8, W=2, IN_BF16=True, ROUNDING=0, QUANTIZE_LOCAL=True, HAS_WEIGHT=True,
        WEIGH_LOCAL=True, HAS_DOT=True, DOT_EXPERT_ROWS=True, **launch("BLOCK_T", "push_tokens", "mxfp8"))),
    "reduce_mxfp8_quantize_local": (sk._reduce_slots_kernel, REDUCE, dict(
        D=7168, TOP_K=8, KP=8, IN_BF16=True, HAS_WEIGHT=True, HAS_SAVE=True, HAS_DOT=True, HAS_STAGE_ROW=True,
        QUANTIZE_LOCAL=True, ROUNDING=1, **launch("BLOCK_T", "reduce_slots", "mxfp8"))),
    "sorted_rows": (sk._sorted_rows_kernel, {"slot_ptr": "*i64", "ids_ptr": "*i64", "dst_base_ptr": "*i64",
                                             "first_row_ptr": "*i64", "dst_rank_ptr": "*i64", "dst_row_ptr": "*i64",
                                             "sorted_row_ptr": "*i64", "N": "i32", "last_row": "i64",
                                             "E": "i32"},
                   dict(L=128, BLOCK=1024)),
    "expert_rows": (sk._expert_rows_kernel, {"seg_end_ptr": "*i64", "seg_len_ptr": "*i64", "seg_origin_ptr": "*i64",
                                             "source_ptr": "*i64", "return_rank_ptr": "*i64", "return_row_ptr": "*i64",
                                             "R": "i32", "rank": "i32"}, dict(W=2, NUM_SEG=384, STEPS=9, BLOCK=1024)),
    # The DeepSeek-V3-like count tables at EP 2 and 8, and a world of 3 (no powers of two).
    **{f"routing_tables_w{w}": (sk._routing_tables_kernel, {"table_ptr": "*i64", "out_ptr": "*i64",
                                                           "needed_ptr": "*i64", "rank": "i32", "align": "i32",
                                                           "max_tokens": "i32", "row_limit": "i64"},
                                dict(W=w, L=local, WP=triton.next_power_of_2(w), LP=triton.next_power_of_2(local),
                                     HAS_NEEDED=True))
       for w, local in ((2, 128), (3, 5), (8, 32))},
    "push_counts": (sk._push_counts_kernel, {"counts_ptr": "*i64", "fault_ptr": "*i64", "peer_ptrs": "*i64",
                                             "rank": "i32", "tokens": "i32"}, dict(NUM=256, BLOCK=512)),
    # The dispatcher's device checks of a routing (DeepSeek-V3-like: 256 experts; 6: not a power of two).
    **{f"routing_histogram_e{e}": (ck._routing_histogram_kernel, {"ids_ptr": "*i64", "safe_ptr": "*i64",
                                                                  "hist_ptr": "*i64", "N": "i32", "E": "i32"},
                                   dict(EP=triton.next_power_of_2(e), BLOCK=ck.ID_BLOCK)) for e in (6, 256)},
    **{f"routing_faults_e{e}": (ck._routing_faults_kernel, {"hist_ptr": "*i64", "counts_ptr": "*i64",
                                                            "fault_ptr": "*i64", "N": "i32", "E": "i32"},
                                dict(EP=triton.next_power_of_2(e), EXPERT_ID=16, COUNTS=32, COUNTS_SUM=64))
       for e in (6, 256)},
    "swiglu_backward": (ge._rows_kernel, ROWS, dict(N=2048, OP=1, IN_BF16=True, BLOCK_M=ge._BLOCK_M, BLOCK_N=512)),
}
CASES = {
    "quantize_bf16_rceil": (tk._quantize_kernel, {**QUANT, "x_ptr": "*i16"}, {"IN_BF16": True, "ROUNDING": 0}),
    "quantize_fp32_floor": (tk._quantize_kernel, {**QUANT, "x_ptr": "*fp32"}, {"IN_BF16": False, "ROUNDING": 1}),
    "dequantize_bf16": (tk._dequantize_kernel, {**DEQUANT, "out_ptr": "*i16"}, {"OUT_BF16": True}),
    "dequantize_fp32": (tk._dequantize_kernel, {**DEQUANT, "out_ptr": "*fp32"}, {"OUT_BF16": False}),
}

def compile_for_hopper(fn, signature, consts):
    consts = {**FLAGS_OFF.get(fn, {}), **consts}
    missing = [a for a in fn.arg_names if a not in signature and a not in consts]
    assert not missing, f"{fn.__name__}: no type or value for {missing}"
    warps = consts.pop("num_warps", 4)  # a launch option, not a kernel argument
    signature = {**signature, **{k: "constexpr" for k in consts if k not in signature}}
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    src = ASTSource(fn=fn, signature=signature, attrs=aligned,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    return {
        "cubin_bytes": len(compiled.asm["cubin"]),
        "ue8m0_in_ptx": "ue8m0" in ptx,
        "hw_e4m3_cvt": "e4m3x2" in ptx,
        "vector_stores": len(re.findall(r"st\.global\.v4", ptx)),
        "scalar_b16_stores": len(re.findall(r"st\.global\.b16", ptx)),
    }


report = {}
for name, (fn, signature, consts) in CASES.items():
    report[name] = compile_for_hopper(fn, signature, {**consts, "BLOCK_M": 16, "BLOCK_K": 256})
for name, (fn, signature, consts) in SYMM.items():
    report[name] = compile_for_hopper(fn, signature, consts)
print(json.dumps(report))
