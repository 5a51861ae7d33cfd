"""The metrics Collector over a fixture Snapshot and sessions, in a fresh registry (no daemon)."""
from prometheus_client import CollectorRegistry, generate_latest

from memd.client.plan import Plan
from memd.config import Config
from memd.core import Core
from memd.metrics import SAMPLE_SOURCES, MemdCollector
from memd.policy.controller import Limits
from memd.sampling.snapshot import Cgroup, Gpu, Pressure, Snapshot, SystemMemory
from memd.sessions import Sessions
from memd.state import StateStore

GiB = 2 ** 30


def snapshot(**overrides):
    fields = dict(
        taken_at=1_800_000_000.0, monotonic=5.0, host="node1", memory_model="discrete",
        system=SystemMemory(64 * GiB, 40 * GiB, 24 * GiB, 8 * GiB, GiB),
        pressure=Pressure(0.1, 0.05, 0.01, 0.02, 0.01, 0.0, 12.5, 3.25),
        cgroup=Cgroup(2, "/system.slice/memd.service", 32 * GiB, 20 * GiB, working_set_bytes=18 * GiB,
                      oom_events=2, oom_kill_events=1),
        gpus=(Gpu(0, "GPU-aaaa", "NVIDIA H100", 80 * GiB, 10 * GiB, 69 * GiB, GiB, False, utilization=0.5),
              Gpu(1, "GPU-bbbb", "NVIDIA A100", None, None, None, None, False, healthy=False, error="lost"),
              Gpu(1, "MIG-cccc", "MIG 1g.10gb", 10 * GiB, GiB, 9 * GiB, 0, False, mig_parent_uuid="GPU-bbbb")),
        oom_kills=7, duration_seconds=0.002)
    fields.update(overrides)
    return Snapshot(**fields)


def core_with(tmp_path, snap):
    sessions = Sessions(8, 600.0, lambda: 0.0, lambda s: True)
    core = Core(Config(), sessions, StateStore(str(tmp_path)), clock=lambda: 0.0)
    core.snapshot = snap
    return core


def scrape(core):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MemdCollector(core))
    return registry


def value(registry, metric, **labels):
    return registry.get_sample_value(metric, labels)


def test_host_pressure_cgroup_and_gpus_in_base_units(tmp_path):
    reg = scrape(core_with(tmp_path, snapshot()))
    assert value(reg, "memd_host_memory_total_bytes") == 64 * GiB
    assert value(reg, "memd_host_memory_available_bytes") == 40 * GiB
    assert value(reg, "memd_host_swap_used_bytes") == GiB
    assert value(reg, "memd_memory_pressure_ratio", kind="some", window="10") == 0.1
    assert value(reg, "memd_memory_pressure_stall_seconds_total", kind="full") == 3.25
    assert value(reg, "memd_host_oom_kills_total") == 7
    cg = {"version": "2", "path": "/system.slice/memd.service"}
    assert value(reg, "memd_cgroup_memory_limit_bytes", **cg) == 32 * GiB
    assert value(reg, "memd_cgroup_memory_working_set_bytes", **cg) == 18 * GiB
    assert value(reg, "memd_cgroup_oom_kill_events_total", **cg) == 1
    h100 = {"gpu": "0", "uuid": "GPU-aaaa", "name": "NVIDIA H100", "parent_uuid": ""}
    assert value(reg, "memd_gpu_memory_used_bytes", **h100) == 10 * GiB
    assert value(reg, "memd_gpu_utilization_ratio", **h100) == 0.5
    assert value(reg, "memd_gpu_healthy", **h100) == 1
    lost = {"gpu": "1", "uuid": "GPU-bbbb", "name": "NVIDIA A100", "parent_uuid": ""}
    assert value(reg, "memd_gpu_healthy", **lost) == 0
    assert value(reg, "memd_gpu_memory_total_bytes", **lost) is None  # unknown is absent, never 0
    never = snapshot(gpus=(Gpu(2, None, None, None, None, None, None, False, healthy=False, error="lost"),))
    unnamed = scrape(core_with(tmp_path, never))  # a GPU lost before it ever answered: no uuid, no name
    assert value(unnamed, "memd_gpu_healthy", gpu="2", uuid="", name="", parent_uuid="") == 0
    mig = {"gpu": "1", "uuid": "MIG-cccc", "name": "MIG 1g.10gb", "parent_uuid": "GPU-bbbb"}
    assert value(reg, "memd_gpu_memory_total_bytes", **mig) == 10 * GiB
    assert value(reg, "memd_unified_memory") == 0
    assert value(reg, "memd_build_info", version="0.1.0", python=__import__("platform").python_version()) == 1


def test_unknowns_are_absent_and_error_sources_start_at_zero(tmp_path):
    core = core_with(tmp_path, snapshot(pressure=None, cgroup=Cgroup(1, "/", None, GiB), gpus=(), oom_kills=None,
                                        memory_model="unified"))
    core.sample_errors["nvml"] += 3
    reg = scrape(core)
    assert value(reg, "memd_memory_pressure_ratio", kind="some", window="10") is None
    assert value(reg, "memd_cgroup_memory_limit_bytes", version="1", path="/") is None  # unlimited
    assert value(reg, "memd_host_oom_kills_total") is None
    assert value(reg, "memd_unified_memory") == 1
    assert value(reg, "memd_sample_errors_total", source="nvml") == 3
    for source in SAMPLE_SOURCES:
        assert value(reg, "memd_sample_errors_total", source=source) is not None


def test_sessions_and_requests(tmp_path):
    core = core_with(tmp_path, snapshot())
    s = core.sessions.open(job="llama", pid=123, host="node1", local=True, start_time=1, limits=Limits(), rank=0)
    s.plan = Plan(batch_size=16, grad_accum_steps=4, effective_batch_size=64, num_workers=2, prefetch_factor=2,
                  throttle=True, pressure="high", reason="test", source="daemon")
    s.latest_batch, s.latest_peak, s.ooms = 32, 30 * GiB, 1
    core.observe_request("plan", "ok", 0.0003)
    s.slurm_job_id = "42"  # attributed (memd.attribution): a label of each session series
    reg = scrape(core)
    labels = {"session": str(s.sid), "job": "llama", "rank": "0", "pool": "", "pod_uid": "", "slurm_job_id": "42"}
    assert value(reg, "memd_session_recommended_batch_size", **labels) == 16
    assert value(reg, "memd_session_grad_accum_steps", **labels) == 4
    assert value(reg, "memd_session_recommended_workers", **labels) == 2
    assert value(reg, "memd_session_throttle", **labels) == 1
    assert value(reg, "memd_session_batch_size", **labels) == 32
    assert value(reg, "memd_session_peak_bytes", **labels) == 30 * GiB
    assert value(reg, "memd_session_ooms_total", **labels) == 1
    assert value(reg, "memd_sessions") == 1
    assert value(reg, "memd_requests_total", op="plan", outcome="ok") == 1
    assert value(reg, "memd_request_duration_seconds_bucket", le="0.0005") == 1
    assert value(reg, "memd_request_duration_seconds_count") == 1
    text = generate_latest(reg).decode()
    assert "pid" not in text.replace("rapid", "")  # no pid labels: bounded label sets


def test_a_scrape_never_samples(tmp_path):
    """A scrape builds its families from what the daemon holds: it opens no file (/proc, /sys,
    cgroupfs), lists no directory, loads no library (NVML) and starts no process. Python's audit
    hooks see every such call, from psutil and prometheus_client's own collectors too; a hook
    cannot be removed, so the scrape runs in a process of its own."""
    import json
    import subprocess
    import sys

    from realdaemon import memd_env

    code = """
import json, sys
from prometheus_client import generate_latest
from memd.client.plan import Plan
from memd.policy.controller import Limits
from tests.test_metrics import core_with, scrape, snapshot
core = core_with(sys.argv[1], snapshot())
s = core.sessions.open(job="j", pid=1, host="h", local=True, start_time=1, limits=Limits())
s.plan = Plan(8, 1, 8, 0, None, False, "ok", "t", "daemon")
registry = scrape(core)
generate_latest(registry)  # the first scrape may import what it uses: imports open files
before, seen = core.snapshot, []
sys.addaudithook(lambda event, args: seen.append([event, str(args[0])[:80]]) if event in (
    "open", "os.listdir", "os.scandir", "ctypes.dlopen", "subprocess.Popen", "os.exec", "socket.connect") else None)
text = generate_latest(registry).decode()
print(json.dumps([seen, core.snapshot is before, "memd_sessions 1.0" in text]))
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=memd_env(), capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == [[], True, True]


def test_docs_list_exactly_the_families_the_collector_can_expose(tmp_path):
    from promtools import documented_families, families

    full = snapshot(cgroup=Cgroup(2, "/", 32 * GiB, 20 * GiB, high_bytes=30 * GiB, working_set_bytes=18 * GiB,
                                  oom_events=2, oom_kill_events=1))
    core = core_with(tmp_path, full)
    s = core.sessions.open(job="j", pid=1, host="h", local=True, start_time=1, limits=Limits())
    s.plan = Plan(8, 1, 8, 0, None, False, "ok", "t", "daemon")
    s.latest_batch, s.latest_peak, s.budget_bytes, s.predicted_peak_bytes = 8, GiB, 2 * GiB, GiB
    exposed = families(generate_latest(scrape(core)).decode())
    assert documented_families() == exposed
