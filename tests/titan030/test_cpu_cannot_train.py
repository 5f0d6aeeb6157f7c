"""Why the recipe's own models on torchtitan 0.3.0 attend with sdpa, built into their configs
directly (``launch.titan.titan030.models``), and torchtitan's flavors are refused on CPU before
launch: none of the attention backends 0.3.0 offers a language model can run a backward pass on
CPU with this torch, and ``get_attention_config`` refuses sdpa. If one of these starts to work,
torchtitan's flavors can train on CPU too (test_recipe_e2e.py refuses ``dsv3_debugmodel``)."""

from __future__ import annotations

import pytest

pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

import torch  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402
from torch.nn.attention.varlen import varlen_attn  # noqa: E402
from torchtitan.models.common.config_utils import get_attention_config  # noqa: E402


def test_flex_attention_has_no_cpu_backward():
    """"flex" (the default of every 0.3.0 language model, DeepSeek-V3 included)."""
    q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
    mask = create_block_mask(lambda _b, _h, qi, ki: qi >= ki, 1, 2, 128, 128, device="cpu")
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, k, v, block_mask=mask)


def test_varlen_attention_has_no_cpu_kernel():
    """"varlen": flash attention only (``aten::_flash_attention_forward`` has no CPU kernel)."""
    q, k, v = (torch.randn(64, 2, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="_flash_attention_forward"):
        varlen_attn(q, k, v, cu, cu, 32, 32)


def test_sdpa_is_refused_for_language_models():
    with pytest.raises(ValueError, match="sdpa is no longer supported for language models"):
        get_attention_config("sdpa")
