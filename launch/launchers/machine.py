"""This machine's GPUs, memory and cores, found without importing torch (validation must take
well under 2 s; ``import torch`` alone takes several).

GPUs come from ``nvidia-smi`` (what the driver sees) narrowed by ``CUDA_VISIBLE_DEVICES`` the
way CUDA narrows them; no ``nvidia-smi`` means no NVIDIA GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Optional

GIB = 1024**3


@dataclass(frozen=True)
class Machine:
    ram_bytes: int
    cpu_count: int
    # Memory of each GPU this process may use (CUDA_VISIBLE_DEVICES applied), in bytes.
    gpu_memory_bytes: tuple[int, ...] = field(default_factory=tuple)

    @property
    def gpus(self) -> int:
        return len(self.gpu_memory_bytes)

    @classmethod
    def with_gpus(cls, gpus: int, gpu_mem_gib: float) -> "Machine":
        """This machine's RAM and cores with ``gpus`` GPUs of ``gpu_mem_gib`` GiB each: the
        node a config is meant for (``validate.gpu_mem_gib``)."""
        return cls(ram_bytes=_ram_bytes(), cpu_count=os.cpu_count() or 1,
                   gpu_memory_bytes=(int(gpu_mem_gib * GIB),) * gpus)

    @classmethod
    def probe(cls) -> "Machine":
        return cls(ram_bytes=_ram_bytes(), cpu_count=os.cpu_count() or 1,
                   gpu_memory_bytes=_visible(_nvidia_smi_memory(), os.environ.get("CUDA_VISIBLE_DEVICES")))


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _nvidia_smi_memory() -> tuple[int, ...]:
    """Total memory of every GPU the driver lists, in bytes; () without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(int(float(line)) * 1024**2 for line in out.split() if line.strip())  # MiB


def _visible(gpus: tuple[int, ...], cuda_visible_devices: Optional[str]) -> tuple[int, ...]:
    """The GPUs CUDA shows under ``CUDA_VISIBLE_DEVICES`` (indices; CUDA stops at the first
    invalid entry; UUIDs count as valid entries)."""
    if cuda_visible_devices is None:
        return gpus
    picked = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < len(gpus):
            picked.append(gpus[int(entry)])
        elif entry.startswith(("GPU-", "MIG-")) and gpus:
            picked.append(min(gpus))
        else:
            break
    return tuple(picked)
