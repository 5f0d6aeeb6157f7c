"""The symm transport's Triton kernels (``mxfp8_ep/exchange/symm_kernels.py``) against their torch twins
(``mxfp8_ep/exchange/symm_reference.py``), through the dispatcher on 2 and 3 gloo ranks whose peer
memory is the CPU emulation (shared-memory files). On CPU the kernels run under the Triton
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU). On a GPU machine
the same tests run the compiled kernels on CUDA tensors, the dispatcher's ranks sharing GPU 0
(``tests.shared_gpu``: CUDA IPC peers, a barrier over interprocess events), and tests/test_dispatcher_gpu.py runs
the comparison again at real shapes on NCCL and symmetric memory on 2 GPUs.

One routing per case, run twice on every rank (``kernel="torch"``, then ``kernel="triton"``):
dispatch -> a stand-in expert (each expert-major row times its own constant) -> combine ->
backward. Equal bit for bit: the tokens per local expert, the routed input (the rows the
grouped GEMM reads), the combine output, the gradient combine's backward hands the experts and
the x gradient. Not bit for bit: the score gradients. They are fp32 dot products over the model
dim, which the kernels sum with ``tl.sum`` (a tree) and the twins with ``torch.sum`` (another
order); they must agree to ``SCORE_RTOL`` of the largest dot product such rows can give
(|a| |b|, the size of their rounding error; a dot product itself can cancel to ~0).

Cases cover bf16 and fp32 activations, every preset, both scale roundings, scores before and
after the experts, top_k 1-3, a rank without tokens, everything to one rank, and NaN / inf
tokens (compared NaN-aware: the kernels' NaN bits need not be torch's). Dims stay small
(D = 64 or 96, T <= 6 per rank, E <= 6): the interpreter runs each program in Python.

The nccl transport with MXFP8 legs (``FusedNcclTokenDispatcher``) runs the same kernels around
an all-to-all: pushes into a local send buffer, receiving passes that read each row where its
``stage_row`` index says (empty send / receive buffers included). A few MXFP8 cases run it
too: every routing kind on 2 ranks, two on 3.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep.config import LEG_FORMATS, PRESETS, SCALE_ROUNDINGS, A2AConfig
from mxfp8_ep.kernels.launch_shapes import KernelShapes, LaunchShape
from mxfp8_ep.exchange.peer_memory import OneProcessPeers
from mxfp8_ep.exchange.staging import StagedLeg
from tests.distributed import SHARED_GPU, rank_device, run_on_ranks
from tests.moe_harness import bits, preload, run_forked
from tests.round_trips import replayed

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Where the kernels run: CPU tensors under the interpreter, else compiled on the GPU.
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
pytestmark = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(),
    reason="the Triton kernels run on CPU tensors only under the interpreter (TRITON_INTERPRET=1, which "
    "tests/conftest.py sets when there is no GPU), else on a GPU",
)

MAX_TOKENS = 6  # per rank: small buffers, few interpreter programs
PAD_MULTIPLE = 4
SCORE_RTOL = 1e-5
DTYPES = (torch.bfloat16, torch.float32)
KINDS = ("random", "one rank empty", "all to rank 0", "non-finite")


def _cases(world: int) -> list[dict]:
    """A covering set. 2 ranks: every (preset, dtype, score placement), with both roundings
    per preset. 3 ranks: every preset, dtype, score placement and (on an MXFP8 preset)
    rounding at least once. Routing kinds, top_k and dim cycle through the cases."""
    presets, (f32, b16) = sorted(PRESETS), (torch.float32, torch.bfloat16)
    if world == 2:
        grid = [(p, dtype, sbe, SCALE_ROUNDINGS[(i + i // 2) % 2])  # roundings 0, 1, 1, 0 per preset
                for i, (p, dtype, sbe) in enumerate(itertools.product(presets, DTYPES, (False, True)))]
    else:
        rceil, floor = SCALE_ROUNDINGS
        grid = [(presets[0], b16, False, rceil), (presets[1], f32, True, floor),
                (presets[2], b16, True, rceil), (presets[2], f32, False, floor)]
    symm = [
        dict(preset=preset, dtype=dtype, score_before_experts=sbe, rounding=rounding, num_experts=2 * world,
             top_k=1 + i % 3, dim=(64, 96)[i // 3 % 2], kind=KINDS[(i + i // 4) % len(KINDS)], seed=i,
             transport="symm")
        for i, (preset, dtype, sbe, rounding) in enumerate(grid)
    ]
    # The fused nccl transport: MXFP8 cases (both dtypes, presets and roundings on 2 ranks),
    # routing kind and score placement cycling.
    quantized = [c for c in symm if A2AConfig.preset(c["preset"]).any_quantized]
    picked = quantized[::2] if world == 2 else quantized[:2]
    nccl = [dict(c, transport="nccl", kind=KINDS[j % len(KINDS)], score_before_experts=bool(j % 2))
            for j, c in enumerate(picked)]
    # push_rows visits its row blocks in interleaved stripes: one row per block and 3 stripes
    # (top_k 3: >= 6 rows, so every stripe holds >= 2 blocks) must still push every row once,
    # quantizing (an MXFP8 preset) on both transports. The shape reaches the kernels through
    # the dispatcher's config (``TokenDispatcher.Config.launch_shapes``).
    striped = [dict(quantized[0], top_k=3, kind="random", transport=t, push_launch=(1, 3), seed=50 + j)
               for j, t in enumerate(("symm", "nccl"))] if world == 2 else []
    # A2AConfig.quantize_local_rows: the rows that stay quantized in push_rows (nccl), push_tokens
    # (symm: weighted, and carrying scores for partial sums) and reduce_slots.
    local = [dict(quantized[k], transport=t, quantize_local_rows=True, dim=64, seed=70 + k)
             for k, t in ((3, "symm"), (4, "symm"), (5, "nccl"))] if world == 2 else []
    return symm + nccl + striped + local


def _routing(case: dict, rank: int, world: int):
    g = torch.Generator().manual_seed(100 * case["seed"] + rank)
    E, K, D = case["num_experts"], case["top_k"], case["dim"]
    tokens = int(torch.randint(2, MAX_TOKENS + 1, (1,), generator=g))
    if case["kind"] == "one rank empty" and rank == world - 1:
        tokens = 0
    experts = E // world if case["kind"] == "all to rank 0" else E  # rank 0 owns the first E / W
    ids = (torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(tokens)]) if tokens
           else torch.zeros(0, K, dtype=torch.int64))
    if ids.shape[1] < K:  # all to rank 0 with top_k > local experts: fill with rank 1's
        ids = torch.cat([ids, ids[:, : K - ids.shape[1]] + E // world], dim=1)
    x = (torch.randn(tokens, D, generator=g) * torch.exp2(torch.randint(-4, 5, (tokens, 1), generator=g).float()))
    if case["kind"] == "non-finite":
        x[0, 3], x[1, D - 1] = float("nan"), float("-inf")
    scores = torch.rand(tokens, K, generator=g)
    grad_out = torch.randn(tokens, D, generator=g)
    row_scale = torch.rand(1024, generator=g) + 0.5  # the stand-in expert's row constants
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    return x.to(case["dtype"]), scores, ids, counts, grad_out.to(case["dtype"]), row_scale


def _run(case: dict, kernel: str, rank: int, world: int):
    from mxfp8_ep.dispatcher import FusedNcclTokenDispatcher, SymmTokenDispatcher, TokenDispatcher

    device = rank_device()
    x, scores, ids, counts, grad_out, row_scale = (t.to(device) for t in _routing(case, rank, world))
    config = TokenDispatcher.Config(
        num_experts=case["num_experts"], top_k=case["top_k"], score_before_experts=case["score_before_experts"],
        pad_multiple=PAD_MULTIPLE, max_tokens_per_rank=MAX_TOKENS,
        a2a=A2AConfig.preset(case["preset"], scale_rounding=case["rounding"], kernel=kernel,
                             transport=case["transport"], quantize_local_rows=case.get("quantize_local_rows", False)),
        launch_shapes=_launch_shapes(case),
    )
    dispatcher = config.build(dist.group.WORLD, device)
    assert type(dispatcher) is {"symm": SymmTokenDispatcher, "nccl": FusedNcclTokenDispatcher}[case["transport"]]
    x = x.clone().requires_grad_(True)
    scores = scores.clone().requires_grad_(True)
    seen = {}
    routed, per_expert, meta = dispatcher.dispatch(x, scores, ids, counts)
    routed.register_hook(lambda g: seen.__setitem__("routed_grad", g))
    valid = int(per_expert.sum())  # rows past the padded experts are never read
    scale = row_scale[: routed.shape[0]]
    y = (routed.float() * scale.unsqueeze(1)).to(routed.dtype)
    y.register_hook(lambda g: seen.__setitem__("expert_out_grad", g))
    out = dispatcher.combine(y, meta)
    out.backward(grad_out)
    return dict(
        per_expert=per_expert, routed=routed.detach()[:valid], out=out.detach(), x_grad=x.grad,
        expert_out_grad=seen["expert_out_grad"][:valid], routed_grad=seen["routed_grad"][:valid],
        score_grad=scores.grad, x=x.detach(), grad_out=grad_out,
    )


def _launch_shapes(case: dict):
    """The case's push_rows launch (rows per program, stripes) for every leg format, or None."""
    if "push_launch" not in case:
        return None
    block, stripes = case["push_launch"]
    return {fmt: replace(KernelShapes.default(fmt), push_rows=LaunchShape(block=block, warps=4, stripes=stripes))
            for fmt in LEG_FORMATS}


def _difference(got: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None when ``got`` equals ``ref`` bit for bit (any NaN equals any NaN), else what differs:
    shape or dtype, or how many elements and the first of them."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"{tuple(got.shape)} {got.dtype} vs {tuple(ref.shape)} {ref.dtype}"
    differ = (bits(got) != bits(ref)) & ~(got.isnan() & ref.isnan()) if got.is_floating_point() else got != ref
    if not differ.any():
        return None
    first = tuple(int(i) for i in differ.nonzero()[0])
    return (f"{int(differ.sum())} of {got.numel()} elements, first at {first}: "
            f"{got[first].item()} vs {ref[first].item()}")


def _assert_same_pushes(bufs, ref_bufs, sent: int, ref_sent: int, where) -> None:
    """A push kernel's staging buffers (one per rank) and sent count equal its twin's."""
    assert len(bufs) == len(ref_bufs), where
    for r, (buf, ref_buf) in enumerate(zip(bufs, ref_bufs)):
        diff = _difference(buf, ref_buf)
        assert diff is None, f"rank {r}'s staging buffer differs from the twin's: {diff}: {where}"
    assert sent == ref_sent, f"sent {sent}, the twin {ref_sent}: {where}"


def _check(rank, world, cases):
    torch.set_num_threads(1)
    for case in cases:
        # "all to rank 0" overflows the default capacity: the first run replays at a grown one.
        ref, _ = replayed(lambda: _run(case, "torch", rank, world))
        got, _ = replayed(lambda: _run(case, "triton", rank, world))
        where = f"rank {rank}/{world}: {case}"
        for name in ("per_expert", "routed", "out", "expert_out_grad", "routed_grad", "x_grad"):
            diff = _difference(got[name], ref[name])
            assert diff is None, f"{name} differs: {diff}: {where}"
        # Score gradients: <expert-side row, token-side row> in fp32 (module docstring). Both
        # rows are at most 2.5 |x_t| |grad_out_t| apart from the expert's row constant (< 1.5)
        # and MXFP8 rounding: that bounds each dot product and its rounding error.
        size = 2.5 * ref["x"].float().norm(dim=1, keepdim=True) * ref["grad_out"].float().norm(dim=1, keepdim=True)
        a, b = got["score_grad"], ref["score_grad"]
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), f"non-finite score gradients differ: {where}"
        close = (a - b).abs() <= SCORE_RTOL * (b.abs() + size)
        assert close[finite].all(), f"score gradients differ by {(a - b).abs()[finite].max():.3g}: {where}"


@pytest.mark.parametrize("world", [2, 3])
def test_triton_kernels_equal_torch_twins(world):
    import mxfp8_ep.exchange.symm_kernels  # noqa: F401  (Triton and the kernels, once, before the ranks fork)

    preload(titan=False)
    cases = _cases(world)
    assert {c["preset"] for c in cases} == set(PRESETS) and {c["dtype"] for c in cases} == set(DTYPES)
    assert {c["rounding"] for c in cases if A2AConfig.preset(c["preset"]).any_quantized} == set(SCALE_ROUNDINGS)
    assert {c["score_before_experts"] for c in cases} == {False, True}
    nccl = [c for c in cases if c["transport"] == "nccl"]
    assert nccl, "no case runs the nccl transport"
    plain = [c for c in nccl if not A2AConfig.preset(c["preset"]).any_quantized]
    assert not plain, f"nccl cases without an MXFP8 leg: {plain}"
    if world == 2:
        assert {c["kind"] for c in nccl} == set(KINDS) and {c["rounding"] for c in nccl} == set(SCALE_ROUNDINGS)
        assert {c["dtype"] for c in nccl} == set(DTYPES) and {c["score_before_experts"] for c in nccl} == {False, True}
    if world == 2:
        assert {c["transport"] for c in cases if "push_launch" in c} == {"symm", "nccl"}
        local = {(c["transport"], c["top_k"] > 1, c["score_before_experts"])
                 for c in cases if c.get("quantize_local_rows")}
        assert local == {("symm", True, False), ("symm", True, True), ("nccl", False, True)}
    if INTERPRETED:
        run_forked(world, _check, cases)
    else:  # ranks sharing the GPU: a gloo group, no NCCL for the nccl transport's all-to-all
        run_on_ranks(world, _check, [c for c in cases if c["transport"] == "symm"], backend=SHARED_GPU)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_push_rows_only_pushes_the_rows_it_names(fmt):
    """``push_rows(pushed=...)``: ``local`` stores only the rows that stay, ``remote`` only those
    that leave, ``all`` both; kernel and twin give the same bytes; anything else is an error."""
    from mxfp8_ep.exchange import symm_kernels, symm_reference
    from mxfp8_ep.exchange.peer_memory import LocalBuffer
    from mxfp8_ep.exchange.staging import staging_nbytes

    g = torch.Generator().manual_seed(3)
    src = torch.randn(6, 64, generator=g).bfloat16().to(DEVICE)
    dst_rank = torch.tensor([0, 1, 0, -1, 1, 0], device=DEVICE)  # this is rank 0; -1: pushed nowhere
    dst_row = torch.tensor([0, 0, 1, 0, 1, 2], device=DEVICE)
    results = {}
    for pushed in ("all", "local", "remote"):
        for name, kernels in (("triton", symm_kernels), ("torch", symm_reference)):
            out = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEVICE)
            stage = LocalBuffer(torch.zeros(staging_nbytes(2, 64, torch.bfloat16), dtype=torch.uint8, device=DEVICE), 2)
            leg = StagedLeg(staging=stage, rows=2, rank=0, fmt=fmt)
            kernels.push_rows(leg, src, dst_rank=dst_rank, dst_row=dst_row, local_out=out, pushed=pushed)
            results[pushed, name] = (out, stage.local.clone())
        (out, staged), (ref_out, ref_staged) = results[pushed, "triton"], results[pushed, "torch"]
        assert torch.equal(bits(out), bits(ref_out)) and torch.equal(staged, ref_staged), pushed
        assert bool(out.any()) == (pushed != "remote") and bool(staged.any()) == (pushed != "local"), pushed
        if pushed == "local":
            assert torch.equal(bits(out), bits(src[[0, 2, 5]]))
    assert torch.equal(results["all", "torch"][0], results["local", "torch"][0])
    assert torch.equal(results["all", "torch"][1], results["remote", "torch"][1])
    for kernels in (symm_kernels, symm_reference):
        with pytest.raises(ValueError, match="pushed="):
            kernels.push_rows(leg, src, dst_rank=dst_rank, dst_row=dst_row, local_out=out, pushed="stay")


def test_routing_tables_kernel_equals_its_twin():
    """The one-program ``routing_tables`` kernel against the twin (``routing.routing_tables`` of
    the counts, and the flag: token counts within the limit, no fault word set) on count
    tables of every shape the symm transport takes (W ranks up to 8, local experts up to 32,
    non-powers of two), with empty experts, empty ranks, all rows to one rank, a rank over the
    token limit, and a rank whose input failed its checks; without a capacity, at a capacity
    the routing fills exactly, and at one it overflows: the padded sizes cut there (whole
    ``align`` blocks, summing to at most the capacity), the rows needed raised alike."""
    from dataclasses import fields

    from mxfp8_ep.exchange import routing, symm_kernels, symm_reference

    g = torch.Generator().manual_seed(11)
    checked = 0
    for W, L, align in ((1, 3, 8), (2, 1, 1), (2, 5, 8), (3, 2, 4), (4, 3, 1), (8, 32, 8), (3, 7, 8)):
        E = W * L
        for kind in ("random", "sparse", "one rank", "over", "fault"):
            counts = torch.randint(0, 9, (W, E), generator=g)
            if kind == "sparse":
                counts *= torch.rand((W, E), generator=g) < 0.3
            elif kind == "one rank":
                counts[:, L:] = 0
            tokens = counts.sum(dim=1, keepdim=True) + 1
            max_tokens = int(tokens.max()) - (kind == "over")
            faults = torch.zeros(W, 1, dtype=torch.int64)
            faults[W // 2] = 16 * (kind == "fault")
            table = torch.cat([counts, tokens, faults], dim=1).contiguous().to(DEVICE)
            need = int(routing.rows_needed(counts, align))
            for rank in range(W):
                # No capacity (nccl), one that fits exactly, and one the routing overflows.
                for capacity in (None, need, max(align, need - 2 * align - 1)):
                    needed = {name: torch.full((1,), 3, dtype=torch.int64, device=DEVICE) for name in ("want", "got")}
                    want, want_ok = symm_reference.routing_tables(table, rank, align, max_tokens, capacity,
                                                                  needed["want"])
                    got, got_ok = symm_kernels.routing_tables(table, rank, align, max_tokens, capacity, needed["got"])
                    where = (W, L, align, kind, rank, capacity)
                    for f in fields(want):
                        assert _same_field(getattr(got, f.name), getattr(want, f.name)), (*where, f.name)
                    assert bool(got_ok) == bool(want_ok) == (kind not in ("over", "fault")), where
                    assert int(needed["got"]) == int(needed["want"]) == max(3, need), where
                    sizes = want.tokens_per_local_expert
                    assert int(sizes.sum()) <= (capacity or need) and not (sizes % align).any(), where
                    if capacity is None or capacity >= need:
                        unclipped = routing.routing_tables(counts.to(DEVICE), rank, align).tokens_per_local_expert
                        assert torch.equal(sizes, unclipped), where
                    checked += 1
    assert checked == 15 * sum(w for w in (1, 2, 2, 3, 4, 8, 3))


def _same_field(got, want) -> bool:
    return torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want


def test_push_counts_kernel_equals_its_twin():
    """Every rank's row of the count table: its counts, its token count, its fault word."""
    from mxfp8_ep.exchange import symm_kernels, symm_reference

    world, experts = 3, 6
    tables = {}
    for name, kernels in (("triton", symm_kernels), ("torch", symm_reference)):
        shared = OneProcessPeers(world * (experts + 2) * 8, world, 0, DEVICE)
        for r in range(world):
            counts = torch.arange(experts, dtype=torch.int64, device=DEVICE) + 10 * r
            view = shared.seen_from(r)
            view.ptrs = torch.tensor([shared.peer(p).data_ptr() for p in range(world)], device=DEVICE)  # as PeerBuffer
            kernels.push_counts(counts, 7 + r, view, r, torch.tensor(16 * r, device=DEVICE))
        tables[name] = [shared.peer(r).view(torch.int64).view(world, experts + 2).cpu() for r in range(world)]
    want = torch.stack([torch.cat([torch.arange(experts) + 10 * r, torch.tensor([7 + r, 16 * r])])
                        for r in range(world)])
    for r in range(world):
        assert torch.equal(tables["triton"][r], want) and torch.equal(tables["torch"][r], want), r


def check_push_tokens(device) -> int:
    """``push_tokens`` (Triton) against its twin, and against what it must do: each token
    stored once in every other rank's staging buffer that owns one of its experts (at row
    ``rank * max_tokens + token``, in the leg format), its rows that stay copied into the
    expert-major output, every row bound for a peer naming that staged row in the peer's token
    map, and ``sent`` counting the staged rows; a peer's ``receive_rows`` through its map then
    rebuilds each of its rows. The cases cycle through four modes:

    * ``plain`` (dispatch's forward);
    * ``rows`` (combine's backward): rows that stay are the token times its score, each score
      waits in the owner's row weights and multiplies the token as the owner receives it, and
      the score gradients' dot products (against a saved row per slot) agree with fp64 to
      their rounding;
    * ``carry`` (dispatch's forward ahead of combine's partial sums): the scores reach the
      owners' row weights, nothing is multiplied;
    * ``local`` (combine's backward after partial sums): weighted as ``rows``; the dot products
      of the slots whose row stays are taken against this rank's expert rows, the others are
      left as they were; the owner's ``receive_rows`` takes each received row's dot product
      against its own expert row, before the score multiplies it.

    Returns the cases checked."""
    from mxfp8_ep.exchange import symm_kernels, symm_reference
    from mxfp8_ep.format.mxfp8 import quantize_reference
    from mxfp8_ep.exchange.staging import (
        decode_rows,
        row_weights,
        staging_buffer_nbytes,
        staging_views,
        token_map,
        token_map_offset,
    )

    g = torch.Generator().manual_seed(17)
    checked = 0
    for world, local_experts, top_k, dim, tokens in ((2, 4, 3, 64, 7), (3, 2, 4, 96, 6), (2, 1, 2, 64, 5),
                                                     (3, 3, 1, 64, 4)):
        experts, max_tokens = world * local_experts, tokens + 1
        for fmt, dtype in (("bf16", torch.bfloat16), ("mxfp8", torch.bfloat16), ("mxfp8", torch.float32),
                           ("bf16", torch.float32)):
            # Every rank in MXFP8 bf16 (the DeepSeek-V3 leg); one rank, cycling, otherwise.
            for rank in range(world) if (fmt, dtype) == ("mxfp8", torch.bfloat16) else [checked % world]:
                ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
                if checked % 3 == 0:  # every token's experts on one peer
                    ids = (ids % local_experts) + ((rank + 1) % world) * local_experts
                x = torch.randn(tokens, dim, generator=g).to(dtype)
                owner = (ids // local_experts).reshape(-1)
                # Sorted row n = slot n; its row on its owner: the owner's rows in slot order.
                dst_row = torch.zeros_like(owner)
                for r in range(world):
                    dst_row[owner == r] = torch.arange(int((owner == r).sum()))
                sorted_row = torch.arange(owner.numel())
                capacity, rows = tokens * top_k, world * max_tokens
                offset = token_map_offset(rows, dim, dtype)
                mode = ("plain", "rows", "carry", "local")[checked % 4]
                weighted, scored = mode in ("rows", "local"), mode != "plain"
                # Scores in fp32 (torchtitan 0.2.2) or in the activation dtype (0.3.0's bf16 combine).
                score_dtype = dtype if checked // 4 % 2 else torch.float32
                factor = torch.rand(tokens * top_k, generator=g).to(score_dtype) if scored else None
                # The score gradients' other rows: one per sorted row (rows), or this rank's expert rows (local).
                saved = torch.randn(tokens * top_k, dim, generator=g).to(dtype) if weighted else None
                result = {}
                for name, kernels in (("triton", symm_kernels), ("torch", symm_reference)):
                    peers = OneProcessPeers(staging_buffer_nbytes(rows, dim, dtype, capacity), world, rank, device)
                    out = torch.zeros(capacity, dim, dtype=dtype, device=device)
                    sent = torch.zeros(1, dtype=torch.int64, device=device)
                    dots = torch.full((tokens * top_k,), float("nan"), device=device)
                    extra = {}
                    if mode == "rows":
                        extra = dict(weight=factor.to(device), dot_with=saved.to(device), dot_out=dots)
                    elif mode == "carry":
                        extra = dict(weight=factor.to(device), weigh_local=False)
                    elif mode == "local":
                        extra = dict(weight=factor.to(device), dot_with=saved.to(device), dot_out=dots,
                                     dot_with_expert_rows=True)
                    staged = StagedLeg(staging=peers, rows=rows, rank=rank, fmt=fmt, tokens_per_rank=max_tokens,
                                       map_offset=offset, map_rows=capacity)
                    kernels.push_tokens(staged, x.to(device), sorted_row=sorted_row.to(device),
                                        dst_rank=owner.to(device), dst_row=dst_row.to(device), local_out=out,
                                        top_k=top_k, sent=sent, **extra)
                    result[name] = ([peers.peer(r).cpu() for r in range(world)], out.cpu(), int(sent), peers,
                                    dots.cpu())
                (bufs, out, sent, peers, dots), (ref_bufs, ref_out, ref_sent, _, ref_dots) = \
                    result["triton"], result["torch"]
                where = (world, top_k, fmt, dtype, rank, mode)
                _assert_same_pushes(bufs, ref_bufs, sent, ref_sent, where)
                assert torch.equal(bits(out), bits(ref_out)), where
                if weighted:  # fp32 dot products: tl.sum and torch.sum add in other orders
                    # Sorted row n = slot n: the saved row per slot (rows), or the slot's expert row here (local).
                    other = saved if mode == "rows" else saved[torch.where(owner == rank, dst_row, 0)]
                    xs = x.double().repeat_interleave(top_k, 0)
                    exact = (other.double() * xs).sum(dim=1)
                    size = other.double().norm(dim=1) * xs.norm(dim=1)
                    taken = torch.ones_like(owner, dtype=torch.bool) if mode == "rows" else owner == rank
                    for got_dots in (dots, ref_dots):
                        assert ((got_dots.double() - exact).abs() <= SCORE_RTOL * size)[taken].all(), where
                        assert got_dots[~taken].isnan().all(), where  # left as they were
                ids_owner = owner.view(tokens, top_k)
                remote_pairs = [(t, d) for t in range(tokens) for d in range(world)
                                if d != rank and (ids_owner[t] == d).any()]
                assert sent == len(remote_pairs), where
                local = owner == rank
                rows_of = x.repeat_interleave(top_k, 0)
                if weighted:  # a row times its score, rounded once (carry: as it is)
                    rows_of = (rows_of.float() * factor.unsqueeze(1)).to(dtype)
                assert torch.equal(bits(out[dst_row[local]]), bits(rows_of[local])), where
                encoded = quantize_reference(x, "rceil") if fmt == "mxfp8" else None
                for t, d in remote_pairs:
                    views = staging_views(bufs[d], rows, dim, dtype, fmt)
                    u = rank * max_tokens + t
                    if fmt == "mxfp8":
                        assert torch.equal(views[0][u], encoded.data.view(torch.uint8)[t]), where
                        assert torch.equal(views[1][u], encoded.scale[t]), where
                    else:
                        assert torch.equal(bits(views[0][u]), bits(x[t])), where
                for d in range(world):
                    if d == rank:
                        continue
                    mine = owner == d
                    token_of = torch.arange(owner.numel()) // top_k
                    assert torch.equal(token_map(bufs[d], offset, capacity)[dst_row[mine]],
                                       rank * max_tokens + token_of[mine]), where
                    if scored:
                        assert torch.equal(row_weights(bufs[d], offset, capacity)[dst_row[mine]],
                                           factor[mine].float()), where
                    # The peer reads its rows through its token map (times their row weights; local:
                    # with dot products against its expert rows).
                    source = torch.full((capacity,), -2, dtype=torch.int64)
                    source[dst_row[mine]] = rank
                    expert_rows = torch.randn(capacity, dim, generator=g).to(dtype)
                    received_rows = {}
                    for name, kernels in (("triton", symm_kernels), ("torch", symm_reference)):
                        got = torch.zeros(capacity, dim, dtype=dtype, device=device)
                        row_dots = torch.full((capacity,), float("nan"), device=device)
                        received = peers.seen_from(d)
                        kernels.receive_rows(StagedLeg(staging=received, rows=rows, rank=d, fmt=fmt), got,
                                             source=source.to(device),
                                             stage_row=token_map(peers.peer(d), offset, capacity),
                                             weight=row_weights(peers.peer(d), offset, capacity) if weighted else None,
                                             **(dict(dot_with=expert_rows.to(device), dot_out=row_dots)
                                                if mode == "local" else {}))
                        received_rows[name] = got.cpu(), row_dots.cpu()
                    (got, row_dots), (ref_got, ref_row_dots) = received_rows["triton"], received_rows["torch"]
                    assert torch.equal(bits(got), bits(ref_got)), where
                    want = x[token_of[mine]]
                    if fmt == "mxfp8":
                        want = decode_rows(staging_views(bufs[d], rows, dim, dtype, fmt),
                                           rank * max_tokens + token_of[mine], dtype, fmt)
                    arrived = want
                    if weighted:  # the score multiplies the token as it arrived (dequantized)
                        want = (want.float() * factor[mine].unsqueeze(1)).to(dtype)
                    assert torch.equal(bits(got[dst_row[mine]]), bits(want)), where
                    if mode == "local":  # against the token as it arrived, before its score
                        other = expert_rows[dst_row[mine]].double()
                        exact = (other * arrived.double()).sum(dim=1)
                        size = other.norm(dim=1) * arrived.double().norm(dim=1)
                        for got_dots in (row_dots, ref_row_dots):
                            assert ((got_dots[dst_row[mine]].double() - exact).abs() <= SCORE_RTOL * size).all(), where
                            others = torch.ones(capacity, dtype=torch.bool)
                            others[dst_row[mine]] = False
                            assert got_dots[others].isnan().all(), where
                checked += 1
    return checked


def test_one_process_peers_seen_from_another_rank_share_their_buffers():
    peers = OneProcessPeers(64, 3, 0, "cpu")
    assert peers.element_offsets(8)[0] == 0
    seen = peers.seen_from(2)
    assert (seen.rank, peers.rank) == (2, 0) and seen.local.data_ptr() == peers.peer(2).data_ptr()
    seen.peer(1)[:4] = 7
    assert peers.peer(1)[:4].tolist() == [7] * 4, "a store through the view lands in the shared buffer"
    for itemsize in (1, 8):  # kernels address peers relative to the view's own buffer
        want = [(peers.peer(r).data_ptr() - peers.peer(2).data_ptr()) // itemsize for r in range(3)]
        assert seen.element_offsets(itemsize).tolist() == want


def test_push_tokens_sends_each_token_once_per_rank():
    assert check_push_tokens(DEVICE) == (2 + 3 + 2 + 3) + 3 * 4  # ranks per world + 3 formats x 4


def check_push_partials(device) -> int:
    """``push_partials`` (Triton) against its twin, and against what it must do: for each token
    of another rank with rows here, the fp32 sum of those rows in expert-major row order,
    rounded to the activation dtype (then quantized on an MXFP8 leg), in that rank's staging
    buffer at row ``rank * max_tokens + token``; ``sent`` counts them; rows that stay, padding
    and tokens without rows here send nothing. Every other case is weighted (combine's forward):
    each row times its fp32 weight. Returns the cases checked."""
    from mxfp8_ep.exchange import symm_kernels, symm_reference
    from mxfp8_ep.format.mxfp8 import quantize_reference
    from mxfp8_ep.exchange.staging import staging_nbytes, staging_views
    from mxfp8_ep.exchange.symm_reference import partial_slots

    g = torch.Generator().manual_seed(23)
    checked = 0
    for world, max_rows, dim, max_tokens in ((2, 3, 64, 6), (3, 2, 96, 5), (4, 4, 64, 3)):
        num_slots = world * max_tokens
        for fmt, dtype in (("bf16", torch.bfloat16), ("bf16", torch.float32), ("mxfp8", torch.bfloat16)):
            rank = checked % world
            # Each other rank's tokens: 0..max_rows rows here; then rows that stay and padding.
            keys = [s for s in range(num_slots) if s // max_tokens != rank
                    for _ in range(int(torch.randint(0, max_rows + 1, (1,), generator=g)))]
            keys += [num_slots] * 5
            row_slot = torch.tensor(keys)[torch.randperm(len(keys), generator=g)]
            src = (torch.randn(len(keys), dim, generator=g) * 4).to(dtype)
            weight = torch.rand(len(keys), generator=g) if checked % 2 else None
            order, start = partial_slots(row_slot.to(device), num_slots)
            result = {}
            for name, kernels in (("triton", symm_kernels), ("torch", symm_reference)):
                peers = OneProcessPeers(staging_nbytes(num_slots, dim, dtype), world, rank, device)
                sent = torch.zeros(1, dtype=torch.int64, device=device)
                leg = StagedLeg(staging=peers, rows=num_slots, rank=rank, fmt=fmt, tokens_per_rank=max_tokens)
                kernels.push_partials(leg, src.to(device), order=order, start=start, max_rows=max_rows, sent=sent,
                                      weight=None if weight is None else weight.to(device))
                result[name] = ([peers.peer(r).cpu() for r in range(world)], int(sent))
            (bufs, sent), (ref_bufs, ref_sent) = result["triton"], result["torch"]
            where = (world, fmt, dtype, rank, weight is not None)
            _assert_same_pushes(bufs, ref_bufs, sent, ref_sent, where)
            sums = [s for s in range(num_slots) if (row_slot == s).any()]
            assert sent == len(sums) > 0, where
            for s in sums:
                acc = torch.zeros(dim)
                for i in torch.nonzero(row_slot == s).squeeze(1).tolist():  # expert-major row order
                    acc = acc + (src[i].float() if weight is None else src[i].float() * weight[i])
                want = acc.to(dtype)
                views = staging_views(bufs[s // max_tokens], num_slots, dim, dtype, fmt)
                u = rank * max_tokens + s % max_tokens
                if fmt == "mxfp8":
                    encoded = quantize_reference(want.unsqueeze(0), "rceil")
                    assert torch.equal(views[0][u], encoded.data.view(torch.uint8)[0]), where
                    assert torch.equal(views[1][u], encoded.scale[0]), where
                else:
                    assert torch.equal(bits(views[0][u]), bits(want)), where
            # Nothing else was written: every other staged row of every rank is still zero.
            for r in range(world):
                written = {rank * max_tokens + s % max_tokens for s in sums if s // max_tokens == r}
                rows = staging_views(bufs[r], num_slots, dim, dtype, fmt)[0]
                for u in range(num_slots):
                    if u not in written:
                        assert not rows[u].view(torch.uint8).any(), (where, r, u)
            checked += 1
    return checked


def test_push_partials_sends_one_sum_per_token_and_rank():
    assert check_push_partials(DEVICE) == 9


def test_partial_stage_rows_name_each_owner_once_per_token():
    from mxfp8_ep.exchange.symm_reference import partial_stage_rows

    # 3 tokens x top-4 on rank 1 of 3; max_tokens 5. Sorted row n = slot n here (sorted_row = identity).
    owner = torch.tensor([[0, 2, 0, 1], [1, 1, 1, 1], [2, 2, 0, 2]])
    got = partial_stage_rows(torch.arange(12), owner.reshape(-1), rank=1, top_k=4, max_tokens=5).view(3, 4)
    assert got.tolist() == [[0 * 5 + 0, 2 * 5 + 0, -1, -1], [-1, -1, -1, -1], [2 * 5 + 2, -1, 0 * 5 + 2, -1]]


def check_partial_round_trip(device) -> int:
    """Dispatch's backward as partial sums, every rank of a world at once: each rank's
    ``push_partials`` of the rows it holds for other ranks' tokens, then each rank's
    ``reduce_slots`` through ``partial_stage_rows`` (Triton and twin, bit for bit), against
    the plain sum of every token's K rows (fp64, to the rounding of the partial sums; MXFP8
    legs: to the format's). Each case also runs weighted, as combine's forward: the experts'
    rank weights its rows (``push_partials(weight=...)``), the token's rank only the rows it
    kept (``reduce_slots(weigh_staged=False)``), against the fp64 sum of score times row.
    Returns the cases checked."""
    from mxfp8_ep.exchange import symm_kernels, symm_reference
    from mxfp8_ep.exchange.staging import staging_nbytes
    from mxfp8_ep.exchange.symm_reference import partial_slots, partial_stage_rows

    g = torch.Generator().manual_seed(29)
    checked = 0
    for (world, top_k, dim, tokens, dtype, fmt), weighted in itertools.product(
            ((2, 3, 64, 5, torch.bfloat16, "bf16"), (3, 4, 96, 4, torch.float32, "bf16"),
             (4, 2, 64, 3, torch.bfloat16, "bf16"), (2, 4, 64, 5, torch.bfloat16, "mxfp8"),
             (3, 3, 96, 4, torch.float32, "mxfp8")), (False, True)):
        max_tokens = tokens + 1
        num_slots = world * max_tokens
        owner = [torch.randint(0, world, (tokens, top_k), generator=g) for _ in range(world)]
        # Rank r's expert-major rows: every (source, token, k) it owns, in a shuffled order.
        held = []
        for r in range(world):
            pairs = [(s, t, k) for s in range(world) for t in range(tokens) for k in range(top_k)
                     if owner[s][t, k] == r]
            held.append([pairs[i] for i in torch.randperm(len(pairs), generator=g).tolist()])
        grads = [(torch.randn(len(held[r]), dim, generator=g) * 2).to(dtype) for r in range(world)]
        scores = [torch.rand(tokens, top_k, generator=g) if weighted else torch.ones(tokens, top_k)
                  for _ in range(world)]
        row_weight = [torch.tensor([float(scores[s][t, k]) for s, t, k in held[r]]) for r in range(world)]
        result = {}
        for name, kernels in (("triton", symm_kernels), ("torch", symm_reference)):
            shared = OneProcessPeers(staging_nbytes(num_slots, dim, dtype), world, 0, device)
            views = []
            for r in range(world):
                peers = shared.seen_from(r)
                views.append(peers)
                row_slot = torch.tensor([s * max_tokens + t if s != r else num_slots for s, t, _ in held[r]],
                                        dtype=torch.int64)
                order, start = partial_slots(row_slot.to(device), num_slots)
                leg = StagedLeg(staging=peers, rows=num_slots, rank=r, fmt=fmt, tokens_per_rank=max_tokens)
                kernels.push_partials(leg, grads[r].to(device), order=order, start=start, max_rows=top_k,
                                      sent=torch.zeros(1, dtype=torch.int64, device=device),
                                      weight=row_weight[r].to(device) if weighted else None)
            outs = []
            for d in range(world):
                # Token side d: sorted row n = slot n; local rows read from its own expert rows.
                dst_rank = owner[d].reshape(-1)
                dst_row = torch.tensor([held[d].index((d, n // top_k, n % top_k)) if dst_rank[n] == d else 0
                                        for n in range(tokens * top_k)], dtype=torch.int64)
                sorted_row = torch.arange(tokens * top_k)
                stage_row = partial_stage_rows(sorted_row.to(device), dst_rank.to(device), d, top_k, max_tokens)
                out = torch.empty(tokens, dim, dtype=dtype, device=device)
                kernels.reduce_slots(StagedLeg(staging=views[d], rows=num_slots, rank=d, fmt=fmt), out,
                                     sorted_row=sorted_row.to(device), row_rank=dst_rank.to(device),
                                     local_row=dst_row.to(device), local_src=grads[d].to(device), top_k=top_k,
                                     stage_row=stage_row,
                                     **(dict(weight=scores[d].reshape(-1).to(device), weigh_staged=False)
                                        if weighted else {}))
                outs.append(out.cpu())
            result[name] = outs
        for d in range(world):
            where = (world, top_k, dtype, fmt, d, weighted)
            assert torch.equal(bits(result["triton"][d]), bits(result["torch"][d])), where
            want = torch.zeros(tokens, dim, dtype=torch.float64)
            for r in range(world):
                for i, (s, t, k) in enumerate(held[r]):
                    if s == d:
                        want[t] += grads[r][i].double() * float(scores[s][t, k])
            # A quantized partial sum: e4m3 keeps 3 mantissa bits (RCEIL scales: within 2^-4 of each element).
            tol = 2.0**-3 if fmt == "mxfp8" else 2.0**-7 if dtype == torch.bfloat16 else 1e-5
            err = float((result["triton"][d].double() - want).norm() / want.norm())
            assert err < tol, (where, err)
            checked += 1
    return checked


def test_partial_sums_round_trip_to_each_tokens_sum():
    assert check_partial_round_trip(DEVICE) == 2 * (2 + 3 + 4 + 2 + 3)
