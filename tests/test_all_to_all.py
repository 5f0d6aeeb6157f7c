"""Quantized all-to-all-v on real multi-process gloo groups (2, 3 and 4 ranks).

Split matrices come from hypothesis (>= 200 per run, plus hand-picked extremes): bf16 legs
must equal torch's all_to_all_single bit for bit, MXFP8 legs must equal "quantize -> exchange
-> dequantize" bit for bit, gradients are checked the same way, and rows a rank keeps for
itself come back bit-exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mxfp8_ep.telemetry import wire_stats
from mxfp8_ep.exchange.all_to_all import all_to_all_v
from mxfp8_ep.format.mxfp8 import dequantize_reference, quantize_reference
from tests.distributed import backends, rank_device, run_on_ranks

K = 64
EXAMPLES = {2: 90, 3: 70, 4: 60}


def hypothesis_split_matrices(world: int, n: int) -> list[list[list[int]]]:
    """Draw n split matrices S (S[i][j] = rows rank i sends rank j) with hypothesis, which
    favours boundaries: zeros, empty ranks, one large entry."""
    found: list[list[list[int]]] = []
    row = st.lists(st.integers(0, 24), min_size=world, max_size=world)

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(st.lists(row, min_size=world, max_size=world))
    def collect(matrix):
        found.append(matrix)

    collect()
    return found


def extreme_split_matrices(world: int) -> list[list[list[int]]]:
    zeros = [[0] * world for _ in range(world)]
    all_to_rank0 = [[17] + [0] * (world - 1) for _ in range(world)]
    only_self = [[9 if i == j else 0 for j in range(world)] for i in range(world)]
    one_sender = [[40] * world] + [[0] * world for _ in range(world - 1)]
    skewed = [[100 if j == world - 1 else 1 for j in range(world)] for _ in range(world)]
    return [zeros, all_to_rank0, only_self, one_sender, skewed]


def _reference_exchange(x, output_splits, input_splits, fmt):
    """The definition each leg must meet, built without any all-to-all: every rank's rows are
    gathered everywhere, and each rank takes the blocks addressed to it (quantized and
    dequantized with the reference when they come from another rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everything = [None] * world
    dist.all_gather_object(everything, (x.cpu(), input_splits))
    blocks = []
    for src, (x_src, splits_src) in enumerate(everything):
        start = sum(splits_src[:rank])
        block = x_src[start:start + splits_src[rank]]
        assert block.shape[0] == output_splits[src]
        if fmt == "mxfp8" and src != rank:  # self rows are never quantized
            block = dequantize_reference(quantize_reference(block), x.dtype)
        blocks.append(block)
    return torch.cat(blocks).to(x.device)  # computed on the CPU: the definition


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _check(rank, world, matrices):
    group = dist.group.WORLD
    device = rank_device()
    on_gpu = device.type == "cuda"
    for idx, matrix in enumerate(matrices):
        input_splits = matrix[rank]
        output_splits = [matrix[src][rank] for src in range(world)]
        dtype = torch.bfloat16 if idx % 2 == 0 else torch.float32
        g = torch.Generator().manual_seed(idx * 100 + rank)
        # Row magnitudes over many binades so scales differ block to block.
        x = (torch.randn(sum(input_splits), K, generator=g)
             * torch.exp2(torch.randint(-20, 20, (sum(input_splits), 1), generator=g).float())).to(device, dtype)
        grad_out = torch.randn(sum(output_splits), K, generator=g).to(device, dtype)
        send, recv, n = sum(input_splits[:rank]), sum(output_splits[:rank]), input_splits[rank]
        for fwd, bwd in (("mxfp8", "bf16"), ("bf16", "mxfp8")):
            xg = x.clone().requires_grad_(True)
            wire_stats.reset()
            # On the GPU, prove the op never syncs the device with the host (forward + backward).
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                y = all_to_all_v(xg, output_splits, input_splits, group, forward_format=fwd, backward_format=bwd)
                y.backward(grad_out)
            finally:
                if on_gpu:
                    torch.cuda.set_sync_debug_mode("default")
            where = f"matrix={matrix} rank={rank} dtype={dtype} fwd={fwd} bwd={bwd}"
            expected_y = _reference_exchange(x, output_splits, input_splits, fwd)
            expected_grad = _reference_exchange(grad_out, input_splits, output_splits, bwd)
            assert y.dtype == dtype and xg.grad.dtype == dtype, where
            assert torch.equal(_bits(y), _bits(expected_y)), f"forward differs: {where}"
            assert torch.equal(_bits(xg.grad), _bits(expected_grad)), f"gradient differs: {where}"
            assert torch.equal(_bits(y[recv:recv + n]), _bits(x[send:send + n])), f"self rows: {where}"
            assert torch.equal(_bits(xg.grad[send:send + n]), _bits(grad_out[recv:recv + n])), where
            # Only rows that cross the wire are counted, at the leg's wire size.
            fwd_row = K + K // 32 if fwd == "mxfp8" else K * x.element_size()
            bwd_row = K + K // 32 if bwd == "mxfp8" else K * x.element_size()
            stats = wire_stats.snapshot()
            assert stats.get("a2a_fwd", 0) == (sum(input_splits) - n) * fwd_row, where
            assert stats.get("a2a_bwd", 0) == (sum(output_splits) - n) * bwd_row, where


@pytest.mark.parametrize(
    "world,backend", [(w, b) for w in sorted(EXAMPLES) for b in backends(w)]
)
def test_all_to_all_v_fuzz(world, backend):
    matrices = hypothesis_split_matrices(world, EXAMPLES[world]) + extreme_split_matrices(world)
    assert len(matrices) >= EXAMPLES[world]
    run_on_ranks(world, _check, matrices, backend=backend)


def test_fuzz_draws_what_it_is_asked_for_and_meets_the_boundaries():
    """Each world's draw has the requested number of distinct well-formed matrices, and with the
    extremes the fuzz meets: a rank that sends nothing, a rank that receives nothing, a zero
    split beside nonzero ones, rows only to itself, and an all-zero exchange."""
    for world, n in EXAMPLES.items():
        drawn = hypothesis_split_matrices(world, n)
        assert len(drawn) == n and len({str(m) for m in drawn}) == n, world
        assert all(len(m) == world and all(len(r) == world and min(r) >= 0 for r in m) for m in drawn), world
        assert any(0 in r and max(r) > 0 for m in drawn for r in m), world
        every = drawn + extreme_split_matrices(world)
        assert any(any(sum(r) == 0 for r in m) and any(sum(r) for r in m) for m in every), world  # a silent sender
        assert any(any(sum(col) == 0 for col in zip(*m)) and any(sum(col) for col in zip(*m)) for m in every), world
        assert any(all(v == 0 for i, r in enumerate(m) for j, v in enumerate(r) if i != j) and sum(map(sum, m))
                   for m in every), world  # rows only to itself
        assert any(sum(map(sum, m)) == 0 for m in every), world


def _check_errors(rank, _world):
    group = dist.group.WORLD
    bad = torch.randn(4, 40)
    # Every rank raises before any collective starts, so nobody is left waiting.
    with pytest.raises(ValueError, match=r"multiple of 32.*\(4, 40\)"):
        all_to_all_v(bad, [2, 2], [2, 2], group, forward_format="mxfp8")
    with pytest.raises(ValueError, match="one split per rank"):
        all_to_all_v(torch.randn(4, 64), [4], [4], group)
    with pytest.raises(ValueError, match="sum to 3 rows but the input has 4"):
        all_to_all_v(torch.randn(4, 64), [2, 2], [1, 2], group)
    # A bf16 leg takes any width; the group is still healthy after the errors.
    out = all_to_all_v(bad, [2, 2], [2, 2], group)
    assert out.shape == (4, 40)
    # NaN / inf tokens travel as the format defines: NaN block stays NaN, inf stays inf.
    x = torch.ones(2, 64)
    x[1 - rank, 0] = float("nan") if rank == 0 else float("inf")  # the row sent away
    y = all_to_all_v(x, [1, 1], [1, 1], group, forward_format="mxfp8")
    other = 1 - rank
    received = y[other]
    if other == 0:
        assert received[:32].isnan().all() and not received[32:].isnan().any()
    else:
        assert received[0] == float("inf") and (received[1:32] == 0).all()


def test_all_to_all_v_errors_and_non_finite():
    run_on_ranks(2, _check_errors)


def _check_compiled(rank, _world):
    lin = torch.nn.Linear(K, K)

    def block(x, output_splits, input_splits):
        y = all_to_all_v(lin(x), output_splits, input_splits, dist.group.WORLD,
                         forward_format="mxfp8", backward_format="mxfp8")
        return torch.nn.functional.silu(y).square().sum()

    compiled = torch.compile(block, backend="aot_eager")
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    splits = ([4, 3], [4, 3]) if rank == 0 else ([3, 4], [3, 4])
    results = []
    for fn in (block, compiled):
        x.grad = None
        wire_stats.reset()
        loss = fn(x, *splits)
        loss.backward()
        results.append((loss.detach(), x.grad.clone(), wire_stats.snapshot()))
    (l_eager, g_eager, s_eager), (l_comp, g_comp, s_comp) = results
    assert torch.equal(l_eager, l_comp) and torch.equal(g_eager, g_comp)
    assert s_eager == s_comp and s_comp["total"] > 0


def test_all_to_all_v_under_torch_compile():
    """A compiled caller traces through the op (custom ops + functional collectives); results
    and byte counts equal eager."""
    run_on_ranks(2, _check_compiled)
