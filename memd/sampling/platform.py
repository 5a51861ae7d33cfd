"""Which memory model this machine has: discrete, unified, or cpu.

discrete: GPUs with memory of their own (NVML reports it; Grace Hopper's HBM counts as its own).
unified:  GPU and CPU draw on one pool: NVML says memory is Not Supported or reports the host's
          RAM (DGX Spark GB10), Tegra/Jetson (/etc/nv_tegra_release), Apple Silicon.
cpu:      no accelerator; training draws on system memory and dies by the OOM killer, so it is
          budgeted like a unified machine.
docs/platforms.md records each rule and its evidence.
"""
from __future__ import annotations

import os
import platform as _platform
import subprocess
from typing import Optional, Sequence

from .snapshot import CPU, DISCRETE, UNIFIED, Gpu


def memory_model(gpus: Sequence[Gpu], tegra: bool = False, apple_silicon: bool = False) -> str:
    if tegra or apple_silicon:
        return UNIFIED
    healthy = [g for g in gpus if g.healthy]
    if not healthy:
        return CPU
    if any(g.unified for g in healthy):
        return UNIFIED
    return DISCRETE


def is_tegra(etc_root: str = "/etc") -> bool:
    return os.path.exists(os.path.join(etc_root, "nv_tegra_release"))


def is_apple_silicon() -> bool:
    return _platform.system() == "Darwin" and _platform.machine() == "arm64"


def apple_pressure_level() -> Optional[int]:
    """macOS kern.memorystatus_vm_pressure_level: 1 normal, 2 warning, 4 critical."""
    try:
        out = subprocess.run(["sysctl", "-n", "kern.memorystatus_vm_pressure_level"],
                             capture_output=True, text=True, timeout=1.0)
        return int(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
