"""``grouped_swiglu`` (the experts over the symm dispatcher's static-capacity buffer) against
torchtitan 0.2.2's own grouped-GEMM experts: same outputs and gradients on the rows inside the
expert offsets (bit for bit in bf16), and the unused tail rows, whatever they hold, change
nothing. Triton kernels run under the interpreter on CPU (conftest), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from torchtitan.models.moe.moe import _run_experts_grouped_mm

from mxfp8_ep.kernels import expert_kernels as grouped_experts
from mxfp8_ep.kernels.expert_kernels import grouped_swiglu

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _grads(fn, x, ws, dy):
    leaves = [t.clone().requires_grad_() for t in (x, *ws)]
    y = fn(*leaves)
    y.backward(dy)
    return y, [t.grad for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens_per_expert", [[8, 0, 16, 8], [0, 0, 0, 8], [24, 8, 0, 0]])
# 4-row blocks: the persistent programs (3 under the interpreter) each take several blocks
@pytest.mark.parametrize("block_m", [None, 4])
def test_grouped_swiglu_equals_torchtitan_on_rows_inside_offsets(device, tokens_per_expert, block_m, monkeypatch):
    if block_m is not None:
        monkeypatch.setattr(grouped_experts, "_INTERPRETER_BLOCK_M", block_m)
    torch.manual_seed(sum(tokens_per_expert))
    experts, dim, hidden, tail = 4, 64, 96, 24
    tpe = torch.tensor(tokens_per_expert, device=device)
    valid = int(tpe.sum())
    x = torch.randn(valid + tail, dim, device=device).bfloat16()
    ws = [(torch.randn(shape, device=device) * 0.1).bfloat16()
          for shape in ((experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim))]
    dy = torch.randn(valid + tail, dim, device=device).bfloat16()
    # What the tail holds must not matter: torchtitan's input has zeros there, ours NaN.
    x_ours = x.clone()
    x_ours[valid:] = float("nan")
    dy_ours = dy.clone()
    dy_ours[valid:] = float("nan")

    ref_y, ref_g = _grads(lambda x, w1, w2, w3: _run_experts_grouped_mm(w1, w2, w3, x, tpe),
                          torch.cat([x[:valid], torch.zeros_like(x[valid:])]), ws, dy)
    y, g = _grads(lambda x, w1, w2, w3: grouped_swiglu(x, w1, w2, w3, tpe), x_ours, ws, dy_ours)

    assert torch.equal(y[:valid], ref_y[:valid])
    assert torch.equal(g[0][:valid], ref_g[0][:valid]), "input gradient"
    for name, got, ref in zip(("w1", "w2", "w3"), g[1:], ref_g[1:]):
        assert torch.equal(got, ref), f"{name} gradient"
        assert torch.isfinite(got).all(), f"{name} gradient read a tail row"
