"""Memory of the symm transport's elastic capacity against the all-to-all's and the worst case.

    python -m benchmarks.memory --out OUT                       # the recipe's estimate (CPU)

Estimate (bench ``memory_estimate``): ``launch/memory.py``'s bytes per GPU, the check the
recipe makes before launch, for DeepSeek-V3 16B at EP=8 on 8 GPUs (seq 4096, local batch 2) and
every activation checkpointing, per arm: ``nccl`` (all-to-all: the rows received), ``symm`` at
the default ``a2a.capacity_factor``, ``symm:worst`` (``capacity_factor=None``, EP x tokens x
top_k rows). ``vs_nccl``: the arm's bytes over nccl's.
"""

from __future__ import annotations

import argparse

from benchmarks.harness import Results
from launch.memory import estimate
from launch.model_facts import MODELS
from mxfp8_ep.config import DEFAULT_CAPACITY_FACTOR

# (model family, flavor, GPUs, EP, seq_len, local batch): what the EP=8 recipes train.
ESTIMATED = (("deepseek_v3", "16B", 8, 8, 4096, 2),)
CHECKPOINTING = ("none", "selective", "full")
# arm -> (symm, capacity_factor)
ESTIMATE_ARMS = {"nccl": (False, None), "symm": (True, DEFAULT_CAPACITY_FACTOR), "symm:worst": (True, None)}
GIB = 2**30


def estimate_rows() -> list[dict]:
    rows = []
    for family, flavor, world, ep, seq_len, batch in ESTIMATED:
        facts = MODELS[family, flavor]
        for checkpointing in CHECKPOINTING:
            gib = {}
            for arm, (symm, factor) in ESTIMATE_ARMS.items():
                est = estimate(facts, world=world, ep=ep, tp=1, local_batch_size=batch, seq_len=seq_len,
                               activation_checkpoint=checkpointing, device="cuda", symm=symm, capacity_factor=factor)
                gib[arm] = est.total / GIB
                rows.append({"model": f"{family}/{flavor}", "gpus": world, "ep": ep, "seq_len": seq_len,
                             "local_batch_size": batch, "activation_checkpoint": checkpointing, "arm": arm,
                             "capacity_factor": factor if symm else None, "gib": round(gib[arm], 2),
                             "activations_gib": round(est.activations / GIB, 2),
                             "peer_buffers_gib": round(est.peer_buffers / GIB, 2)})
            for row in rows[-len(ESTIMATE_ARMS):]:
                row["vs_nccl"] = round(gib[row["arm"]] / gib["nccl"], 4)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the rows")
    args = parser.parse_args(argv)
    Results("memory_estimate", args.out, count=1).write(
        estimate_rows(), ("model", "activation_checkpoint", "arm", "capacity_factor", "gib", "vs_nccl"))


if __name__ == "__main__":
    main()
