"""How large the symm transport's activation pool is (``mxfp8_ep.pool.activation_pool``), as plain
arithmetic (no torch): the pool allocates these rows and the recipe's memory estimate before
launch (``launch/config/memory.py``) can read the same numbers.

A routed row is one row of a MoE layer's expert-major tensor that its routing filled (each
local expert's rows padded to ``align``). The pool holds, per routed row of every MoE layer
whose forward has not yet met its backward, what that layer keeps for its backward at
expert-major rows: the routed input, the two up projections ``h1`` and ``h3``, their SwiGLU
product, and, when combine goes by partial sums (router scores after the experts, top-k > 1,
``A2AConfig.symm_combine_partial_sums``), the expert outputs combine keeps for the score
gradients.
"""

from __future__ import annotations

from mxfp8_ep.exchange.capacity import expert_major_capacity, worst_case_capacity


def pooled_row_bytes(dim: int, moe_hidden_dim: int, activation_bytes: int = 2,
                     combine_keeps_expert_rows: bool = True) -> int:
    """Bytes the pool holds per routed row of one MoE layer (grouped SwiGLU experts,
    ``mxfp8_ep.kernels.expert_kernels``): the routed input (``dim``), ``h1``, ``h3`` and their product
    (``moe_hidden_dim`` each) and, with ``combine_keeps_expert_rows``, the expert outputs
    (``dim``), each in the activation dtype (``activation_bytes``: 2 for bf16)."""
    return activation_bytes * (dim * (2 if combine_keeps_expert_rows else 1) + 3 * moe_hidden_dim)


def pooled_layers(keeping_layers: float) -> float:
    """MoE layers whose rows the pool holds, of ``keeping_layers`` that keep their expert-side
    tensors for the backward: all but the last of the forward, whose backward runs first and
    reads its tensors as they are (``mxfp8_ep.pool.activation_pool``)."""
    return max(0.0, keeping_layers - 1)


def pool_rows(max_tokens: int, top_k: int, ep: int, num_local_experts: int, align: int, moe_layers: int,
              factor: float | None) -> int:
    """Rows of the pool: ``factor`` times the balanced case of one layer (its ``T x K`` rows
    plus each local expert's padding, ``capacity.expert_major_capacity``) summed over
    ``moe_layers`` layers; never more than every layer at its worst case, which ``factor=None``
    asks for."""
    if factor is None:
        return moe_layers * worst_case_capacity(max_tokens, top_k, ep, num_local_experts, align)
    return moe_layers * expert_major_capacity(max_tokens, top_k, ep, num_local_experts, align, factor)


def pool_bytes(max_tokens: int, top_k: int, ep: int, num_local_experts: int, align: int, moe_layers: int,
               factor: float | None, row_bytes: int) -> int:
    """Bytes of the pool (``pool_rows`` times ``pooled_row_bytes``) on one rank."""
    return pool_rows(max_tokens, top_k, ep, num_local_experts, align, moe_layers, factor) * row_bytes
