"""What torchtitan 0.3.0's trainer takes from torch that torch releases before 2.15 lack (it was
released against torch's development branch; torch 2.15 has all of it):

* ``torch.distributed.set_timeout(timeout, group)`` (the trainer shortens the process groups'
  timeouts after the first step): before 2.15 torch has it as ``distributed_c10d._set_pg_timeout``;
* FSDP2 over parameters that the ``spmd_types`` backend (0.3.0's default) left plain tensors:
  before 2.15 ``fully_shard`` wants DTensors there ("When dp_mesh_dims is provided, all
  parameters must be DTensors"), so the recipe runs 0.3.0's ``partial_dtensor`` backend
  (DTensors for the model-parallel axes only) on those releases (:data:`SPMD_BACKEND`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["SPMD_BACKEND", "apply_torch_compat"]

_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
SPMD_BACKEND = "spmd_types" if _TORCH >= (2, 15) else "partial_dtensor"


def apply_torch_compat() -> None:
    """Give torch < 2.15 the ``torch.distributed.set_timeout`` 0.3.0's trainer calls. Idempotent."""
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        def set_timeout(timeout, group=None) -> None:
            _set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout
