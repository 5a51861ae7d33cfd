"""A fake NVIDIA driver for tests: fakenvml.c (its file format is at the top of that file).

Two ways to put it under the real nvidia-ml-py bindings:
- a child process: ``subprocess.run(..., env=env(lib_dir, config_path))`` (LD_LIBRARY_PATH is
  read when a process starts, so it must be set for the child, not in os.environ of this one);
- this process: ``preload(lib_dir)`` before anything loads pynvml's library; then
  MEMD_FAKE_NVML_CONFIG in os.environ names the file (the fake reads it with getenv each call).
"""
from __future__ import annotations

import ctypes
import os
import tempfile
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from .build import SONAME, VARIANTS, build

CONFIG_ENV = "MEMD_FAKE_NVML_CONFIG"

__all__ = ["CONFIG_ENV", "SONAME", "VARIANTS", "FakeNvml", "build", "env", "preload",
           "write_config"]


def write_config(path: str, text: str) -> None:
    """Replace the configuration atomically, so a process sampling meanwhile never reads half."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".fakenvml-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def env(lib_dir: str, config_path: str, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment for a child process that should see the fake driver."""
    out = dict(os.environ if base is None else base)
    out["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib_dir, out.get("LD_LIBRARY_PATH")) if p)
    out[CONFIG_ENV] = config_path
    return out


def preload(lib_dir: str) -> ctypes.CDLL:
    """Load the fake into this process so that pynvml's CDLL("libnvidia-ml.so.1") resolves to it.

    Raises RuntimeError when pynvml has already loaded another library in this process.
    """
    lib = ctypes.CDLL(os.path.join(lib_dir, SONAME), mode=ctypes.RTLD_GLOBAL)
    import pynvml

    loaded = pynvml.nvmlLib
    if loaded is not None and not hasattr(loaded, "fakenvml_init_calls"):
        raise RuntimeError(f"pynvml already loaded {loaded._name} in this process")
    return lib


@dataclass
class FakeNvml:
    """One fake driver set-up: a build and its configuration file (what the conftest fixtures
    ``fake_nvml`` and ``fake_nvml_inprocess`` give)."""
    lib_dir: str  # holds libnvidia-ml.so.1
    config_path: str
    lib: Optional[ctypes.CDLL] = None  # set when preloaded into this process

    def write(self, text: str) -> None:
        """Replace the configuration (the fake's file format); takes effect on the next call."""
        write_config(self.config_path, text)

    def env(self, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """Environment for a child process (a daemon, a CLI) that should see these GPUs."""
        return env(self.lib_dir, self.config_path, base)

    def init_calls(self) -> int:
        """nvmlInit attempts so far in this process (needs the preloaded library)."""
        if self.lib is None:
            raise RuntimeError("init_calls() needs the fake preloaded into this process")
        return int(self.lib.fakenvml_init_calls())
