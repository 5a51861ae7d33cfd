"""Which memory model this machine has: discrete, unified, or cpu.

discrete: GPUs with memory of their own (NVML reports it; Grace Hopper's HBM counts as its own).
unified:  GPU and CPU draw on one pool: NVML says memory is Not Supported (DGX Spark GB10) or an
          integrated part reports the host's RAM, Tegra/Jetson (/etc/nv_tegra_release), Apple
          Silicon.
cpu:      no accelerator; training draws on system memory and dies by the OOM killer, so it is
          budgeted like a unified machine.
docs/platforms.md records each rule and its evidence.
"""
from __future__ import annotations

import os
import platform as _platform
import subprocess
from typing import Callable, Optional, Sequence

from .snapshot import CPU, DISCRETE, UNIFIED, Gpu


def memory_model(gpus: Sequence[Gpu], tegra: bool = False, apple_silicon: bool = False) -> str:
    """The platform's word first (Tegra, Apple have no discrete memory whatever NVML says), then
    the healthy GPUs': any unified device makes the machine unified; none at all makes it cpu."""
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


PRESSURE_SYSCTL = "kern.memorystatus_vm_pressure_level"
APPLE_LEVELS = (1, 2, 4)  # normal, warning, critical (XNU's NOTE_MEMORYSTATUS_PRESSURE_*)


def sysctl(name: str) -> Optional[str]:
    """``sysctl -n NAME`` as text; None when it cannot be run or fails (not macOS, no such key)."""
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=1.0)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def apple_pressure_level(read: Callable[[str], Optional[str]] = sysctl) -> Optional[int]:
    """macOS kern.memorystatus_vm_pressure_level: 1 normal, 2 warning, 4 critical; None when
    unreadable. ``read`` runs sysctl (a seam for tests)."""
    text = read(PRESSURE_SYSCTL)
    return None if text is None else parse_pressure_level(text)


def parse_pressure_level(text: str) -> Optional[int]:
    """The sysctl's value; None for anything but a known level (unknown, never a guess)."""
    try:
        level = int(text.strip())
    except ValueError:
        return None
    return level if level in APPLE_LEVELS else None
