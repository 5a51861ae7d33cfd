"""memd.sampling.nvml against the fake driver (tests/fakenvml) under the real nvidia-ml-py.

Scenarios with the full build run in this process (the fake is preloaded once); the "driver too
old" build, a machine without NVML and the LD_LIBRARY_PATH route each run in a child process
(pynvml binds one library per process), which prints JSON for the test to check.
"""
from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys

import pytest

from memd.sampling.nvml import Nvml
from memd.sampling.sampler import Sampler
from memd.sampling.snapshot import GpuProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30
MiB = 1 << 20
HOST_RAM = 64 * GiB

TWO_DISCRETE = """\
driver 550.54.15
gpu GPU-0000 total=80GiB used=10GiB reserved=512MiB util=42 name=NVIDIA H100 80GB HBM3
gpu GPU-1111 total=24GiB used=1000 reserved=2000 util=0 name=NVIDIA L4
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def nvml(fake_nvml_inprocess, clock):
    n = Nvml(clock=clock)
    yield n
    n.shutdown()


def by_uuid(gpus):
    return {g.uuid: g for g in gpus}


def run_nvml(fake, steps, *, variant_dir=None, hide_nvml=False):
    """Run tests/fakenvml/run_nvml.py in a child process; return (results, stderr)."""
    env = fake.env()
    if variant_dir is not None:
        env["LD_LIBRARY_PATH"] = variant_dir
    env["PYTHONPATH"] = ROOT
    args = [sys.executable, "-m", "tests.fakenvml.run_nvml"]
    args += ["--hide-nvml"] if hide_nvml else []
    proc = subprocess.run(args + [json.dumps(steps)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


# ---- the full driver, in this process ----

def test_scenario_two_discrete_gpus(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write(TWO_DISCRETE)
    gpus, errors = nvml.sample(HOST_RAM)
    assert errors == []
    assert [g.index for g in gpus] == [0, 1]
    h100, l4 = gpus
    assert (h100.uuid, h100.name) == ("GPU-0000", "NVIDIA H100 80GB HBM3")
    assert h100.total_bytes == 80 * GiB
    assert h100.used_bytes == 10 * GiB  # v2: excludes the reservation
    assert h100.reserved_bytes == 512 * MiB
    assert h100.free_bytes == 80 * GiB - 10 * GiB - 512 * MiB
    assert h100.utilization == pytest.approx(0.42)
    assert not h100.unified and h100.healthy
    assert h100.error is None and h100.mig_parent_uuid is None
    assert (h100.pci_bus_id, l4.pci_bus_id) == ("00000000:10:00.0", "00000000:11:00.0")  # as dcgm-exporter's
    assert (l4.total_bytes, l4.used_bytes, l4.reserved_bytes) == (24 * GiB, 1000, 2000)
    assert l4.free_bytes == 24 * GiB - 3000
    assert l4.utilization == 0.0
    status = nvml.status()
    assert status.available and status.reason is None
    assert (status.driver_version, status.nvml_version, status.device_count) == (
        "550.54.15", "12.550.54.15", 2)


def test_construction_touches_no_driver(fake_nvml_inprocess, clock):
    before = fake_nvml_inprocess.init_calls()
    n = Nvml(clock=clock)
    assert fake_nvml_inprocess.init_calls() == before
    n.sample()
    assert fake_nvml_inprocess.init_calls() == before + 1
    n.sample()
    assert fake_nvml_inprocess.init_calls() == before + 1  # initialised once
    n.shutdown()


def test_scenario_unified_not_supported(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write("gpu GPU-gb10 memory=not_supported util=7 name=NVIDIA GB10\n")
    (gb10,), errors = nvml.sample(HOST_RAM)
    assert errors == []
    assert gb10.unified and gb10.healthy
    assert (gb10.total_bytes, gb10.used_bytes, gb10.free_bytes, gb10.reserved_bytes) == (
        None, None, None, None)
    assert gb10.utilization == pytest.approx(0.07)


def test_scenario_memory_total_zero_is_unified(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write("gpu GPU-tegra total=0 name=Orin\n")
    (gpu,), _ = nvml.sample(HOST_RAM)
    assert gpu.unified and gpu.total_bytes is None and gpu.used_bytes is None


@pytest.mark.parametrize("name", ["NVIDIA GB10", "NVIDIA Thor", "Orin (nvgpu)"])
def test_scenario_integrated_part_reporting_memory_is_unified(fake_nvml_inprocess, nvml, name):
    fake_nvml_inprocess.write(
        f"gpu GPU-igpu total=62GiB used=5GiB name={name}\n"  # a driver that answers the query
        "gpu GPU-gh200 total=96GiB used=5GiB name=NVIDIA GH200 480GB\n")
    igpu, gh200 = nvml.sample(HOST_RAM)[0]
    assert igpu.unified and igpu.total_bytes == 62 * GiB  # the numbers are the host's pool
    assert not gh200.unified  # its own HBM, next to 480 GB of LPDDR
    gpus, _ = nvml.sample(None)  # host size unknown: only NVML's own word counts
    assert not any(g.unified for g in gpus)
    (igpu, _), _ = nvml.sample(32 * GiB)  # larger than the host: not the host's pool
    assert not igpu.unified


def test_scenario_host_sized_discrete_gpu_stays_discrete(fake_nvml_inprocess, nvml, tmp_path):
    """A 24 GiB RTX 4090 in a host with 23.5 GiB of RAM: the same size, its own memory."""
    fake_nvml_inprocess.write("gpu GPU-4090 total=24GiB used=2GiB name=NVIDIA GeForce RTX 4090\n")
    host = int(23.5 * GiB)
    for host_total in (host, 24 * GiB, 25 * GiB):
        (gpu,), errors = nvml.sample(host_total)
        assert not gpu.unified and gpu.total_bytes == 24 * GiB and errors == [], host_total
    # and the machine as the daemon sees it (the Sampler passes meminfo's MemTotal)
    (tmp_path / "meminfo").write_text("MemTotal: %d kB\nMemAvailable: %d kB\n" % (host // 1024, host // 2048))
    snap = Sampler(gpus=nvml, proc_root=str(tmp_path), etc_root=str(tmp_path), apple_silicon=False).sample()
    assert snap.memory_model == "discrete"


def test_scenario_failing_one_gpu(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write(TWO_DISCRETE)
    nvml.sample(HOST_RAM)  # learns both uuids
    fake_nvml_inprocess.write(TWO_DISCRETE.replace("util=0", "util=0 fail=lost"))
    (h100, lost), errors = nvml.sample(HOST_RAM)
    assert h100.healthy and h100.used_bytes == 10 * GiB
    assert not lost.healthy
    assert lost.error == "GPU is lost"
    assert (lost.index, lost.uuid, lost.name) == (1, "GPU-1111", "NVIDIA L4")  # from before
    assert lost.total_bytes is None and lost.used_bytes is None and lost.processes == ()
    assert errors == [("nvml", "GPU-1111: GPU is lost")]


def test_scenario_gpu_lost_before_first_seen(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write(TWO_DISCRETE.replace("util=42", "util=42 fail=unknown"))
    (broken, l4), errors = nvml.sample(HOST_RAM)
    assert not broken.healthy and broken.error == "Unknown Error"
    assert broken.uuid is None and broken.name is None  # never read: unknown, not ""
    assert l4.healthy and l4.uuid == "GPU-1111"
    assert errors == [("nvml", "GPU 0: Unknown Error")]


def test_scenario_processes_attributed_to_the_right_gpu(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write(TWO_DISCRETE + """\
proc GPU-0000 4242 3GiB
proc GPU-0000 17 na
proc GPU-0000 4242 3GiB graphics
proc GPU-0000 99 1MiB graphics
proc GPU-0000 31 5MiB
proc GPU-0000 31 na graphics
proc GPU-1111 555 123456789
""")
    gpus, errors = nvml.sample(HOST_RAM)
    assert errors == []
    procs = by_uuid(gpus)
    assert procs["GPU-0000"].processes == (
        GpuProcess(pid=17, used_bytes=None),  # NVML_VALUE_NOT_AVAILABLE: unknown, not 0
        GpuProcess(pid=31, used_bytes=5 * MiB),  # a known figure beats "not available"
        GpuProcess(pid=99, used_bytes=MiB),
        GpuProcess(pid=4242, used_bytes=3 * GiB),  # compute and graphics: listed once
    )
    assert procs["GPU-1111"].processes == (GpuProcess(pid=555, used_bytes=123456789),)


def test_failed_secondary_reading_keeps_the_device(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write("gpu GPU-0000 total=8GiB used=1GiB util=na procs=unknown name=T4\n")
    (gpu,), errors = nvml.sample(HOST_RAM)
    assert gpu.healthy and gpu.used_bytes == GiB
    assert gpu.utilization is None  # Not Supported: unknown, quietly
    assert gpu.processes == ()
    assert errors == [("nvml", "GPU-0000: compute processes: Unknown Error"),
                      ("nvml", "GPU-0000: graphics processes: Unknown Error")]


def test_scenario_mig_instances(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write("""\
gpu GPU-a100 total=40GiB used=6GiB reserved=300MiB name=NVIDIA A100-SXM4-40GB
mig GPU-a100 MIG-aaaa total=20GiB used=5GiB reserved=0 name=NVIDIA A100-SXM4-40GB MIG 3g.20gb
mig GPU-a100 MIG-bbbb total=10GiB used=1GiB reserved=1MiB name=NVIDIA A100-SXM4-40GB MIG 2g.10gb
gpu GPU-plain total=16GiB used=0 pci=00000000:3F:00.0 name=Tesla V100
proc MIG-aaaa 321 4GiB
proc MIG-bbbb 654 na
proc GPU-a100 321 4GiB
proc GPU-plain 987 1GiB
""")
    gpus, errors = nvml.sample(HOST_RAM)
    assert errors == []
    assert [(g.index, g.uuid, g.mig_parent_uuid) for g in gpus] == [
        (0, "GPU-a100", None), (0, "MIG-aaaa", "GPU-a100"), (0, "MIG-bbbb", "GPU-a100"),
        (1, "GPU-plain", None)]
    assert gpus[0].processes == ()  # NVML's parent list repeats its MIG devices' processes
    assert gpus[3].processes == (GpuProcess(987, GiB),)
    a, b = gpus[1], gpus[2]
    assert (a.total_bytes, a.used_bytes, a.reserved_bytes) == (20 * GiB, 5 * GiB, 0)
    assert (b.total_bytes, b.used_bytes, b.free_bytes) == (10 * GiB, GiB, 9 * GiB - MiB)
    assert a.utilization is None  # not supported on MIG devices
    assert a.processes == (GpuProcess(321, 4 * GiB),)
    assert b.processes == (GpuProcess(654, None),)
    assert b.name == "NVIDIA A100-SXM4-40GB MIG 2g.10gb"
    assert [(g.pci_bus_id, g.gpu_instance_id) for g in gpus] == [
        ("00000000:10:00.0", None), (None, 1), (None, 2), ("00000000:3F:00.0", None)]


def test_gpu_lost_while_listing_mig_devices(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write(TWO_DISCRETE.replace("util=42", "util=42 mig=lost"))
    (lost, l4), errors = nvml.sample(HOST_RAM)
    assert not lost.healthy and lost.uuid == "GPU-0000" and lost.error == "GPU is lost"
    assert l4.healthy
    assert errors == [("nvml", "GPU-0000: GPU is lost")]
    assert nvml.status().available  # one lost GPU is not a lost driver


def test_mig_mode_off_lists_no_instances(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write("gpu GPU-a100 total=40GiB mig=off name=A100\n")
    gpus, errors = nvml.sample(HOST_RAM)
    assert [g.uuid for g in gpus] == ["GPU-a100"] and errors == []


def test_file_rewritten_between_samples(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write(TWO_DISCRETE)
    gpus, _ = nvml.sample(HOST_RAM)
    assert gpus[0].used_bytes == 10 * GiB
    fake_nvml_inprocess.write(
        TWO_DISCRETE.replace("used=10GiB", "used=70GiB").replace("util=42", "util=99"))
    gpus, _ = nvml.sample(HOST_RAM)
    assert gpus[0].used_bytes == 70 * GiB and gpus[0].utilization == pytest.approx(0.99)
    fake_nvml_inprocess.write("gpu GPU-only total=1GiB\n")
    gpus, _ = nvml.sample(HOST_RAM)
    assert [g.uuid for g in gpus] == ["GPU-only"]


def test_reinit_backoff_with_injected_clock(fake_nvml_inprocess, nvml, clock):
    fake = fake_nvml_inprocess
    fake.write("init driver_not_loaded\n" + TWO_DISCRETE)
    calls = fake.init_calls()

    def attempts():
        return fake.init_calls() - calls

    assert nvml.sample(HOST_RAM) == ((), [])  # no driver: no GPUs, and not an error
    status = nvml.status()
    assert not status.available and "driver not loaded" in status.reason
    assert status.device_count is None
    assert attempts() == 1
    for now, expected in [(100.9, 1), (101.0, 2), (102.9, 2), (103.0, 3), (106.9, 3), (107.0, 4)]:
        clock.now = now
        nvml.sample(HOST_RAM)
        assert attempts() == expected, now
    clock.now = 1000.0
    for _ in range(3):  # the delay doubles to 60 s, no further
        nvml.sample(HOST_RAM)
        clock.now += 60.0
    fake.write(TWO_DISCRETE)  # the driver is loaded
    clock.now -= 0.5
    assert nvml.sample(HOST_RAM) == ((), [])  # still waiting
    clock.now += 0.5
    gpus, errors = nvml.sample(HOST_RAM)
    assert len(gpus) == 2 and errors == []
    assert nvml.status().available

    # the driver goes away under a running daemon: an error, then back-off from 1 s again
    fake.write("init unknown\n" + TWO_DISCRETE)
    gpus, errors = nvml.sample(HOST_RAM)
    assert gpus == () and errors == [("nvml", "NVML driver error: Uninitialized")]
    before = attempts()
    clock.now += 0.9
    assert nvml.sample(HOST_RAM)[1] == [("nvml", "NVML driver error: Uninitialized")]
    assert attempts() == before
    fake.write(TWO_DISCRETE)
    clock.now += 0.1
    gpus, errors = nvml.sample(HOST_RAM)
    assert attempts() == before + 1 and len(gpus) == 2 and errors == []


def test_shutdown_then_sample_initialises_again(fake_nvml_inprocess, nvml):
    fake_nvml_inprocess.write(TWO_DISCRETE)
    assert len(nvml.sample(HOST_RAM)[0]) == 2
    nvml.shutdown()
    assert len(nvml.sample(HOST_RAM)[0]) == 2


# ---- other builds and no driver, each in its own process ----

def test_scenario_driver_too_old_for_v2(fake_nvml, fake_nvml_lib):
    fake_nvml.write(TWO_DISCRETE + "proc GPU-0000 4242 3GiB\nproc GPU-0000 17 na\n")
    (first, second), stderr = run_nvml(fake_nvml, [{"sample": HOST_RAM}, {"sample": HOST_RAM}],
                                       variant_dir=fake_nvml_lib("no_v2"))
    assert first == second and first["errors"] == []
    h100 = first["gpus"][0]
    assert h100["total_bytes"] == 80 * GiB
    assert h100["used_bytes"] == 10 * GiB + 512 * MiB  # v1: used includes the reservation
    assert h100["reserved_bytes"] is None
    assert h100["free_bytes"] == 80 * GiB - 10 * GiB - 512 * MiB
    assert h100["processes"] == [{"pid": 17, "used_bytes": None},
                                 {"pid": 4242, "used_bytes": 3 * GiB}]  # through the v2 query
    assert stderr.count("nvml_memory_v1_fallback") == 1  # probed once, said once
    assert stderr.count("nvmlDeviceGetComputeRunningProcesses_v3") == 1


def test_scenario_driver_without_v2_process_queries(fake_nvml, fake_nvml_lib):
    fake_nvml.write(TWO_DISCRETE + """\
proc GPU-0000 4242 3GiB
proc GPU-0000 17 na
proc GPU-1111 8 5 graphics
""")
    (first, second), stderr = run_nvml(fake_nvml, [{"sample": HOST_RAM}, {"sample": HOST_RAM}],
                                       variant_dir=fake_nvml_lib("v1_only"))
    assert first == second and first["errors"] == []
    h100, l4 = first["gpus"]
    assert h100["processes"] == [{"pid": 17, "used_bytes": None},  # not 2**64-1
                                 {"pid": 4242, "used_bytes": 3 * GiB}]
    assert l4["processes"] == [{"pid": 8, "used_bytes": 5}]
    assert l4["used_bytes"] == 3000 and l4["reserved_bytes"] is None
    for missing in ("nvmlDeviceGetComputeRunningProcesses_v3",
                    "nvmlDeviceGetComputeRunningProcesses_v2",
                    "nvmlDeviceGetGraphicsRunningProcesses_v2"):
        assert stderr.count(missing) == 1, missing


def test_scenario_nvml_absent(fake_nvml):
    (sample, status), stderr = run_nvml(fake_nvml, [{"sample": HOST_RAM}, {"status": None}],
                                        hide_nvml=True)
    assert sample == {"gpus": [], "errors": []}
    assert status["available"] is False
    assert "libnvidia-ml.so.1 not found" in status["reason"]
    assert "install the NVIDIA driver" in status["reason"]
    assert stderr.count("nvml_unavailable") == 1  # said once
    assert "Traceback" not in stderr


def test_child_process_finds_the_fake_through_ld_library_path(fake_nvml):
    fake_nvml.write("init ok\n" + TWO_DISCRETE)
    (status, sample), _ = run_nvml(fake_nvml, [{"status": None}, {"sample": HOST_RAM}])
    assert status["available"] and status["device_count"] == 2
    assert [g["uuid"] for g in sample["gpus"]] == ["GPU-0000", "GPU-1111"]


# ---- a real GPU, where there is one ----

@pytest.mark.gpu
@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is None, reason="no NVIDIA driver here")
def test_real_gpu():
    # ROOT first, the caller's path kept (where memd's dependencies were installed out of the way)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("MEMD_FAKE_NVML_CONFIG", None)
    code = ("import json, dataclasses; from memd.sampling.nvml import Nvml; "
            "g, e = Nvml().sample(); print(json.dumps([dataclasses.asdict(x) for x in g]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    gpus = json.loads(proc.stdout.splitlines()[-1])
    assert gpus and all(g["healthy"] for g in gpus)
    assert all(g["unified"] or g["total_bytes"] > 0 for g in gpus)
