"""What torchtitan 0.3.0 needs to train in CPU processes (gloo); each patch fixes one gap:

1. the device: ``torchtitan.tools.utils`` picks ``device_type`` once at import and falls back to
   ``"cuda"``; the modules that copied it build CUDA devices and ask ``torch.cuda`` for memory
   statistics. They get ``"cpu"`` and ``launch.titan.cpu_compat.CpuDeviceModule`` (the same
   stand-in as on torchtitan 0.2.2).
2. FSDP2 reduces gradients with ``ReduceOp.AVG`` / ``PREMUL_SUM``, which gloo lacks:
   :func:`with_sum_reduction` wraps a model's parallelize function to switch FSDP to SUM
   (``launch.titan.cpu_compat.force_sum_reduction``) on a gloo process group.

Attention is not patched: the recipe's own models attend with sdpa, which has a CPU backward
(``launch.titan.titan030.models``); torchtitan's flavors (flex) are refused on CPU before launch.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

__all__ = ["apply_cpu_compat", "with_sum_reduction"]

# Modules of torchtitan 0.3.0 that copied ``device_type`` / ``device_module`` at import time.
DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiler",
)

_lock = threading.Lock()
_applied = False


def apply_cpu_compat() -> bool:
    """Point torchtitan 0.3.0 at the CPU (1.) where CUDA is unavailable. Idempotent; returns
    whether the patch is active."""
    global _applied
    if torch.cuda.is_available():
        return False
    with _lock:
        if not _applied:
            from launch.titan.cpu_compat import patch_device

            patch_device(DEVICE_MODULES)
            _applied = True
    return True


def with_sum_reduction(parallelize_fn: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """``parallelize_fn`` (a 0.3.0 ``ModelSpec.parallelize_fn``), then, on a gloo process group
    (CPU, or ranks sharing a GPU), FSDP switched to reduce with SUM (2.)."""

    @functools.wraps(parallelize_fn)
    def parallelize(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        import torch.distributed as dist

        from launch.titan.cpu_compat import force_sum_reduction

        model = parallelize_fn(model, **kwargs)
        if dist.get_backend() == "gloo":
            force_sum_reduction(model)
        return model

    return parallelize
