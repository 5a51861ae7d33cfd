"""Build the fake libnvidia-ml.so.1 (fakenvml.c) with gcc.

    python tests/fakenvml/build.py OUT_DIR [full|no_v2|v1_only]

prints the directory holding libnvidia-ml.so.1: put it on LD_LIBRARY_PATH of a process that
imports pynvml, and name the configuration file in MEMD_FAKE_NVML_CONFIG.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakenvml.c")
SONAME = "libnvidia-ml.so.1"
VARIANTS = {
    "full": [],
    "no_v2": ["-DFAKE_NO_V2"],  # a driver before R510: no memory v2, no v3 process queries
    "v1_only": ["-DFAKE_NO_V2", "-DFAKE_NO_PROCESS_V2"],  # R450 and older: process v1 only
}


def build(out_dir: str, variant: str = "full") -> str:
    """Compile the variant into OUT_DIR/VARIANT/libnvidia-ml.so.1; return that directory."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {sorted(VARIANTS)}")
    gcc = shutil.which("gcc")
    if gcc is None:
        raise FileNotFoundError("gcc not found: the fake NVML library cannot be built")
    lib_dir = os.path.join(out_dir, variant)
    os.makedirs(lib_dir, exist_ok=True)
    result = subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-Wall", "-pthread", f"-Wl,-soname,{SONAME}",
         *VARIANTS[variant], "-o", os.path.join(lib_dir, SONAME), SOURCE],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"building the fake NVML library failed:\n{result.stderr}")
    return lib_dir


if __name__ == "__main__":
    print(build(sys.argv[1], *sys.argv[2:3]))
