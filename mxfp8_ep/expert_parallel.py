"""torchtitan 0.2.2 integration (stub: being written; bf16 = torchtitan's own ExpertParallel)."""

from __future__ import annotations

from mxfp8_ep.config import A2AConfig


def install_expert_parallel(a2a: A2AConfig) -> None:
    # TEMPORARY stub so the recipe can be wired; replaced by the real MXFP8ExpertParallel.
    return None
