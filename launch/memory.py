"""How much memory one training process needs: an estimate from the model's facts and the
parallel layout, for the check before launch (``launch/validate.py``).

Per process (rank):

* parameters, gradients, optimizer state: fp32 master weights (4 bytes), fp32 gradients (4)
  and AdamW's two moments (8), sharded over all ranks (FSDP x TP for dense weights, EP x
  FSDP for the experts: either way over the world size);
* working copies: FSDP gathers one block (and prefetches the next) as bf16 weights with fp32
  gradients before the reduce-scatter;
* activations at the configured batch, kept for the backward pass (bf16): per token per
  layer, attention and norms (~15 x dim bytes: Korthikanti et al. 2022 without the attention
  matrix, which sdpa/flex never store) plus the FFN (MoE: input, w1/w3 outputs and their
  product for every routed and shared expert a token visits, and the dispatch / combine
  buffers); the logits in bf16 and fp32 with their gradient. Full activation checkpointing
  keeps only each layer's input (plus one layer being recomputed); selective keeps about half;
  TP splits what is left;
* the runtime: CUDA context and communication buffers on a GPU, the imported libraries of a
  CPU process.

It is an estimate (allocator fragmentation, temporary buffers and compile are not in it);
``validate.memory=warn`` launches anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from launch.model_facts import ModelFacts

BF16, FP32 = 2, 4
ADAM_STATE = 2 * FP32
# Measured: a CPU worker of this recipe holds ~0.55 GiB before its model; CUDA context + NCCL.
RUNTIME_BYTES = {"cpu": int(0.6 * 1024**3), "cuda": int(1.5 * 1024**3)}
_KEPT = {"none": 1.0, "selective": 0.5}


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    working_copies: int
    activations: int
    runtime: int

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.working_copies
                + self.activations + self.runtime)


def activation_bytes_per_token(m: ModelFacts) -> tuple[float, float]:
    """Bytes kept for the backward per token: (all layers, one layer at most)."""
    def ffn(hidden: int, copies: int) -> int:
        return copies * (m.dim + 4 * hidden) * BF16  # input, w1 and w3 outputs, act, product

    attention = 15 * m.dim
    moe_layer = attention + ffn(m.moe_hidden_dim, m.top_k + m.num_shared_experts) + 2 * m.top_k * m.dim * BF16
    dense_layer = attention + ffn(m.dense_hidden_dim, 1)
    layers = m.n_moe_layers * moe_layer + (m.n_layers - m.n_moe_layers) * dense_layer
    return layers, max(moe_layer, dense_layer if m.n_layers > m.n_moe_layers else 0)


def estimate(m: ModelFacts, *, world: int, ep: int, tp: int, local_batch_size: int, seq_len: int,
             activation_checkpoint: str, device: str) -> MemoryEstimate:
    """Bytes one process of a ``world``-process run needs (``device``: "cpu" or "cuda")."""
    shard = max(1, world)
    dense_params = m.params - m.expert_params
    block = (dense_params - 2 * m.vocab_size * m.dim) / m.n_layers / tp
    if m.n_moe_layers:
        block += m.expert_params / m.n_moe_layers / ep

    tokens = local_batch_size * seq_len
    all_layers, one_layer = activation_bytes_per_token(m)
    if activation_checkpoint == "full":
        kept = m.n_layers * m.dim * BF16 + one_layer
    else:
        kept = all_layers * _KEPT.get(activation_checkpoint, 1.0)
    logits = m.vocab_size * (BF16 + 2 * FP32)
    return MemoryEstimate(
        parameters=int(m.params * FP32 / shard),
        gradients=int(m.params * FP32 / shard),
        optimizer=int(m.params * ADAM_STATE / shard),
        working_copies=int(2 * block * (BF16 + FP32)),
        activations=int(tokens * (kept + logits) / tp),
        runtime=RUNTIME_BYTES.get(device, RUNTIME_BYTES["cuda"]),
    )
