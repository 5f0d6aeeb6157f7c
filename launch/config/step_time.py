"""How long one training step takes at best on CPU processes: an estimate from the model's
facts, for the check before launch (``launch/preflight/validate.py``, ``validate.max_step_s``).

A step of one process computes, per token, 6 FLOPs per weight it uses (forward 2, backward 4;
of the routed experts only the top-k a token visits, the embedding lookup none), and attention
over every earlier token of its sequence: 4 x dim FLOPs per token pair and layer forward (the
scores and their weighted sum), half of all pairs under the causal mask, three times that with
the backward: 6 x n_layers x seq_len^2 x dim per sequence. Attention grows with seq_len^2: on
CPU, where torch's flash kernel keeps the memory linear in seq_len, it is what makes a long
sequence hopeless. TP splits both.

:data:`CPU_FLOPS_PER_CORE` is faster than any step measured here, so the estimate is a lower
bound: a run refused by it would take longer still.
"""

from __future__ import annotations

from dataclasses import dataclass

from launch.config.model_facts import ModelFacts

# Measured: tiny_llama4, 2 gloo processes on 2 cores, 4 x 16,384 tokens: 1.8e12 FLOPs per
# process in 25.7 s (7e10 FLOP/s per core); 4 x 32,768: 3.9e10. Rounded up to stay a bound.
CPU_FLOPS_PER_CORE = 1e11


@dataclass(frozen=True)
class StepFlops:
    total: float
    attention: float


def step_flops(m: ModelFacts, *, local_batch_size: int, seq_len: int, tp: int = 1) -> StepFlops:
    """FLOPs one process computes in one training step (forward and backward)."""
    tokens = local_batch_size * seq_len
    used = (m.params - m.expert_params - m.vocab_size * m.dim) + m.expert_params * m.top_k / m.num_experts
    attention = 6.0 * m.n_layers * local_batch_size * seq_len**2 * m.dim
    return StepFlops((6.0 * used * tokens + attention) / tp, attention / tp)


def cpu_step_seconds(flops: StepFlops, cores_per_process: int) -> float:
    """The least time a step takes on ``cores_per_process`` CPU cores."""
    return flops.total / (CPU_FLOPS_PER_CORE * max(cores_per_process, 1))
