"""Patches that let torchtitan 0.2.2 train its MoE models on CPU processes (gloo).

torchtitan 0.2.2 assumes an accelerator. On a machine without CUDA six things break (measured
on torchtitan 0.2.2 + torch 2.13 CPU); each patch below fixes exactly one of them:

1. ``patch_device``: ``torchtitan.tools.utils`` picks ``device_type`` once at import time and
   falls back to ``"cuda"``; the modules that copied the name then build CUDA devices and ask
   ``torch.cuda`` for memory statistics. We point them at ``"cpu"`` and a small device module
   that answers the memory/device calls torchtitan makes (peak RSS stands in for peak memory).
2. ``_patch_fsdp_force_sum``: FSDP2 reduces gradients with ``ReduceOp.AVG`` or
   ``ReduceOp.PREMUL_SUM`` (the MoE experts use a custom divide factor); gloo supports neither.
   ``FSDPModule.set_force_sum_reduction_for_comms(True)`` is FSDP2's public knob to reduce with
   SUM and scale separately; we set it on every FSDP module right after torchtitan's
   parallelize function for Llama4 / DeepSeek-V3 has applied ``fully_shard``.
3. ``_patch_histc``: the router counts tokens per expert with ``torch.histc`` on int64 indices;
   CPU has no integer ``histc`` kernel. We compute it in float32 (exact for the counts MoE sees)
   and cast back, so the result has the dtype CUDA would return.
4. ``_patch_permute_indices``: EP's ``_permute`` calls ``generate_permute_indices``, which
   launches a Triton kernel; its ``use_cpu=True`` path is a pure-torch twin. We route CPU
   tensors there.
5. ``_patch_dsv3_moe_impl``: DeepSeek-V3 model args only get ``moe_impl`` inside
   ``update_from_config``; a model built from flavor args alone (unit tests, validation) fails
   with AttributeError. We give the args class the default torchtitan's config uses,
   ``"standard"``.
6. ``_patch_profiler_activities``: torchtitan's profiler (``training.profile_freq``) lists
   the accelerator's activity, which is None without one; ``torch.profiler.profile`` rejects
   None. We drop None from the list: the traces then hold the CPU ops.

All patches are applied by :func:`apply_cpu_compat` only when CUDA is unavailable, once per
process. On a CUDA machine the function is a no-op, so GPU runs see stock torchtitan.
Part of the recipe (launch/), not the library: only the recipe and its tests train on CPU.
"""

from __future__ import annotations

import functools
import importlib
import os
import resource
import sys
import threading
from types import SimpleNamespace
from typing import Any, Callable

import torch

__all__ = ["apply_cpu_compat", "is_applied", "CpuDeviceModule", "force_sum_reduction"]

_lock = threading.Lock()
_applied = False

# Modules of torchtitan 0.2.2 that copied ``device_type`` / ``device_module`` at import time.
_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiling",
    "torchtitan.distributed.dual_pipe_v",
)


def is_applied() -> bool:
    """Whether :func:`apply_cpu_compat` has patched torchtitan in this process."""
    return _applied


def apply_cpu_compat(force: bool = False) -> bool:
    """Patch torchtitan 0.2.2 so it trains on CPU with gloo. Idempotent.

    Args:
        force: apply even though CUDA is available (tests only; never on a GPU run).

    Returns:
        True if the patches are active in this process after the call.
    """
    global _applied
    if torch.cuda.is_available() and not force:
        return False
    with _lock:
        if _applied:
            return True
        patch_device(_DEVICE_MODULES)
        _patch_fsdp_force_sum()
        _patch_histc()
        _patch_permute_indices()
        _patch_dsv3_moe_impl()
        _patch_profiler_activities()
        _applied = True
    return True


# --------------------------------------------------------------------------------------------
# 1. device type / device module
# --------------------------------------------------------------------------------------------


def _total_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 34


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class CpuDeviceModule:
    """Stands in for ``torch.cuda`` in torchtitan's device-agnostic calls.

    ``torch.cpu`` lacks the memory API torchtitan's ``DeviceMemoryMonitor`` uses. Peak memory
    here is the process's peak resident set size (it cannot be reset, so "peak since the last
    reset" reads as "peak since start"). Anything not defined here falls through to
    ``torch.cpu``.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    # device selection -------------------------------------------------------------------------
    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def set_device(device: Any) -> None:  # CPU processes have one "device"
        return None

    @staticmethod
    def current_device() -> int:
        # An int: torch.distributed.barrier(device_ids=[...]) builds torch.device(type, id).
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    # memory -----------------------------------------------------------------------------------
    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"

    @staticmethod
    def get_device_properties(device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(name="CPU", total_memory=_total_memory_bytes())

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


def patch_device(modules) -> None:
    """Every module of ``modules`` that picked CUDA at import gets the CPU (either torchtitan
    release's list of them)."""
    device_module = CpuDeviceModule()
    for name in modules:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = device_module
    # DeviceMemoryMonitor's default argument was evaluated at import ("cuda:0").
    from torchtitan.components import metrics

    defaults = metrics.DeviceMemoryMonitor.__init__.__defaults__
    if defaults:
        metrics.DeviceMemoryMonitor.__init__.__defaults__ = ("cpu:0",) + defaults[1:]


# --------------------------------------------------------------------------------------------
# 2. FSDP2 gradient reduction on gloo
# --------------------------------------------------------------------------------------------


def force_sum_reduction(model: torch.nn.Module) -> int:
    """Make every FSDP2 module of ``model`` reduce gradients with SUM (gloo has no AVG /
    PREMUL_SUM). Returns how many FSDP modules were switched."""
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            count += 1
    return count


def _with_force_sum(parallelize_fn: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    if getattr(parallelize_fn, "_mxfp8ep_force_sum", False):
        return parallelize_fn

    @functools.wraps(parallelize_fn)
    def wrapper(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = parallelize_fn(*args, **kwargs)
        force_sum_reduction(model)
        return model

    wrapper._mxfp8ep_force_sum = True  # type: ignore[attr-defined]
    return wrapper


def _patch_fsdp_force_sum() -> None:
    # ``get_train_spec()`` reads the parallelize function from the model package's namespace
    # each time it is called, so wrapping the package attribute is enough.
    for package, attr in (
        ("torchtitan.models.llama4", "parallelize_llama"),
        ("torchtitan.models.deepseek_v3", "parallelize_deepseekv3"),
    ):
        module = importlib.import_module(package)
        setattr(module, attr, _with_force_sum(getattr(module, attr)))


# --------------------------------------------------------------------------------------------
# 3. torch.histc on integer CPU tensors
# --------------------------------------------------------------------------------------------


def _patch_histc() -> None:
    original = torch.histc
    if getattr(original, "_mxfp8ep_int_cpu", False):
        return

    @functools.wraps(original)
    def histc(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if (
            isinstance(input, torch.Tensor)
            and input.device.type == "cpu"
            and not input.is_floating_point()
            and not input.is_complex()
            and "out" not in kwargs
        ):
            # float32 is exact for integers below 2**24: far above any token count.
            return original(input.float(), *args, **kwargs).to(input.dtype)
        return original(input, *args, **kwargs)

    histc._mxfp8ep_int_cpu = True  # type: ignore[attr-defined]
    torch.histc = histc


# --------------------------------------------------------------------------------------------
# 4. generate_permute_indices: Triton kernel -> its CPU twin
# --------------------------------------------------------------------------------------------


def _patch_permute_indices() -> None:
    kernels = importlib.import_module("torchtitan.models.moe.kernels")
    moe_utils = importlib.import_module("torchtitan.models.moe.utils")
    original = kernels.generate_permute_indices
    if getattr(original, "_mxfp8ep_cpu", False):
        return

    @functools.wraps(original)
    def generate_permute_indices(
        tokens_per_expert_group: torch.Tensor, *args: Any, use_cpu: bool = False, **kwargs: Any
    ):
        use_cpu = use_cpu or tokens_per_expert_group.device.type == "cpu"
        return original(tokens_per_expert_group, *args, use_cpu=use_cpu, **kwargs)

    generate_permute_indices._mxfp8ep_cpu = True  # type: ignore[attr-defined]
    kernels.generate_permute_indices = generate_permute_indices
    # ``_permute`` (used by ExpertParallel) calls the name it imported into moe.utils.
    moe_utils.generate_permute_indices = generate_permute_indices


# --------------------------------------------------------------------------------------------
# 5. DeepSeek-V3 moe_impl default
# --------------------------------------------------------------------------------------------


def _patch_dsv3_moe_impl() -> None:
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs

    if not hasattr(DeepSeekV3ModelArgs, "moe_impl"):
        # A class attribute, not a dataclass field: instances (and asdict) are unchanged and
        # update_from_config still overrides it per instance.
        DeepSeekV3ModelArgs.moe_impl = "standard"  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# 6. profiler activities without an accelerator
# --------------------------------------------------------------------------------------------


def _patch_profiler_activities() -> None:
    profile = torch.profiler.profile
    original = profile.__init__
    if getattr(original, "_drops_none_activities", False):
        return

    @functools.wraps(original)
    def __init__(self, *args: Any, activities: Any = None, **kwargs: Any) -> None:
        if activities is not None:
            activities = [a for a in activities if a is not None]
        original(self, *args, activities=activities, **kwargs)

    __init__._drops_none_activities = True  # type: ignore[attr-defined]
    profile.__init__ = __init__
