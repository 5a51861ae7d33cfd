"""The memory-model decision (memd/sampling/platform.py) and the platform signals it rests on:
Tegra's release file, Apple Silicon's pressure sysctl, read through the Sampler's seams."""
import os

import pytest

from memd.sampling import platform
from memd.sampling.sampler import Sampler
from memd.sampling.snapshot import CPU, DISCRETE, UNIFIED, Gpu, as_json

GiB = 2 ** 30


def device(unified=False, healthy=True, total=80 * GiB):
    return Gpu(0, "GPU-0", "GPU", None if unified else total, None, None, None, unified, healthy=healthy)


@pytest.mark.parametrize("gpus, tegra, apple, expected", [
    ([], False, False, CPU),  # no accelerator
    ([device()], False, False, DISCRETE),
    ([device(), device(unified=True)], False, False, UNIFIED),  # one shared pool is enough
    ([device(healthy=False)], False, False, CPU),  # every GPU lost: budget from the host
    ([device(unified=True, healthy=False), device()], False, False, DISCRETE),  # lost ones do not vote
    ([], True, False, UNIFIED),  # Jetson without NVML
    ([device()], True, False, UNIFIED),  # Tegra's word beats a device that reports memory
    ([], False, True, UNIFIED),  # Apple Silicon
])
def test_memory_model_decision(gpus, tegra, apple, expected):
    assert platform.memory_model(gpus, tegra=tegra, apple_silicon=apple) == expected


def meminfo(root):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "meminfo"), "w") as f:
        f.write("MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n")


def test_tegra_release_file_makes_the_machine_unified(tmp_path):
    proc, etc = str(tmp_path / "proc"), str(tmp_path / "etc")
    meminfo(proc)
    os.makedirs(etc)
    assert Sampler(proc_root=proc, etc_root=etc, apple_silicon=False).sample().memory_model == CPU
    with open(os.path.join(etc, "nv_tegra_release"), "w") as f:
        f.write("# R36 (release), REVISION: 3.0, GCID: 36106755, BOARD: generic, EABI: aarch64\n")
    sampler = Sampler(proc_root=proc, etc_root=etc, apple_silicon=False)
    assert sampler.tegra and sampler.sample().memory_model == UNIFIED


@pytest.mark.parametrize("text, level", [
    ("1\n", 1), ("2\n", 2), ("4", 4),
    ("3\n", None),  # not a level XNU reports: unknown, never a guess
    ("", None), ("sysctl: unknown oid\n", None),
])
def test_parse_apple_pressure_level(text, level):
    assert platform.parse_pressure_level(text) == level


class Sysctl:
    """A fake `sysctl -n`: answers from a dict, remembers what was asked."""

    def __init__(self, values):
        self.values, self.asked = values, []

    def __call__(self, name):
        self.asked.append(name)
        return self.values.get(name)


def test_apple_pressure_level_reads_the_memorystatus_sysctl():
    critical = Sysctl({"kern.memorystatus_vm_pressure_level": "4\n"})
    assert platform.apple_pressure_level(critical) == 4
    assert critical.asked == ["kern.memorystatus_vm_pressure_level"]
    assert platform.apple_pressure_level(Sysctl({})) is None  # sysctl failed: unknown


def test_apple_silicon_sample_is_unified_with_its_pressure_level(tmp_path):
    proc = str(tmp_path)
    meminfo(proc)
    sysctl = Sysctl({"kern.memorystatus_vm_pressure_level": "2\n"})
    snap = Sampler(proc_root=proc, etc_root=proc, apple_silicon=True, sysctl=sysctl).sample()
    assert snap.memory_model == UNIFIED and snap.apple_pressure_level == 2
    assert as_json(snap)["apple_pressure_level"] == 2
    linux = Sampler(proc_root=proc, etc_root=proc, apple_silicon=False, sysctl=sysctl)
    sysctl.asked.clear()
    snap = linux.sample()
    assert snap.apple_pressure_level is None and "apple_pressure_level" not in as_json(snap)
    assert sysctl.asked == []  # not asked off Apple Silicon
