"""The metrics Collector over a fixture Snapshot and sessions, in a fresh registry (no daemon)."""
import os
import re

from prometheus_client import generate_latest

from memd import ops
from memd.client.plan import Plan
from memd.config import Config
from memd.core import Core
from memd.metrics import SAMPLE_SOURCES, build_registry
from memd.policy.controller import Limits
from memd.policy.pressure import PressureState
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
        gpus=(Gpu(0, "GPU-aaaa", "NVIDIA H100", 80 * GiB, 10 * GiB, 69 * GiB, GiB, False, utilization=0.5,
                  pci_bus_id="00000000:10:00.0"),
              Gpu(1, "GPU-bbbb", "NVIDIA A100", None, None, None, None, False, healthy=False, error="lost",
                  pci_bus_id="00000000:3F:00.0"),
              Gpu(1, "MIG-cccc", "NVIDIA A100 MIG 1g.10gb", 10 * GiB, GiB, 9 * GiB, 0, False,
                  mig_parent_uuid="GPU-bbbb", gpu_instance_id=7)),
        oom_kills=7, duration_seconds=0.002)
    fields.update(overrides)
    return Snapshot(**fields)


def core_with(tmp_path, snap):
    sessions = Sessions(8, 600.0, lambda: 0.0, lambda s: True)
    core = Core(Config(), sessions, StateStore(str(tmp_path)), clock=lambda: 0.0)
    core.snapshot = snap
    return core


def scrape(core):
    return build_registry(core)


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
    # dcgm-exporter's label names and values, so that its series join memd's on UUID
    h100 = {"gpu": "0", "UUID": "GPU-aaaa", "modelName": "NVIDIA H100", "pci_bus_id": "00000000:10:00.0",
            "GPU_I_ID": "", "GPU_I_PROFILE": "", "mig_uuid": ""}
    assert value(reg, "memd_gpu_memory_used_bytes", **h100) == 10 * GiB
    assert value(reg, "memd_gpu_utilization_ratio", **h100) == 0.5
    assert value(reg, "memd_gpu_healthy", **h100) == 1
    lost = dict(h100, gpu="1", UUID="GPU-bbbb", modelName="NVIDIA A100", pci_bus_id="00000000:3F:00.0")
    assert value(reg, "memd_gpu_healthy", **lost) == 0
    assert value(reg, "memd_gpu_memory_total_bytes", **lost) is None  # unknown is absent, never 0
    never = snapshot(gpus=(Gpu(2, None, None, None, None, None, None, False, healthy=False, error="lost"),))
    unnamed = scrape(core_with(tmp_path, never))  # a GPU lost before it ever answered: no uuid, no name
    assert value(unnamed, "memd_gpu_healthy", **dict(h100, gpu="2", UUID="", modelName="", pci_bus_id="")) == 0
    # a MIG instance: its GPU's UUID, model and bus, its instance id and profile, as dcgm-exporter
    mig = dict(lost, GPU_I_ID="7", GPU_I_PROFILE="1g.10gb", mig_uuid="MIG-cccc")
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
    labels = {"training_job": "llama", "rank": "0", "pool": "", "pod_uid": "", "slurm_job_id": "42"}
    assert value(reg, "memd_session_recommended_batch_size", **labels) == 16
    assert value(reg, "memd_session_grad_accum_steps", **labels) == 4
    assert value(reg, "memd_session_recommended_workers", **labels) == 2
    assert value(reg, "memd_session_throttle", **labels) == 1
    assert value(reg, "memd_session_cgroup_pressure_level", **labels) == 0  # its job's cgroup: not read
    s.planner.group_pressure = PressureState("critical", 1.0)
    assert value(scrape(core), "memd_session_cgroup_pressure_level", **labels) == 3
    assert value(reg, "memd_session_batch_size", **labels) == 32
    assert value(reg, "memd_session_peak_bytes", **labels) == 30 * GiB
    assert value(reg, "memd_session_ooms_total", **labels) == 1
    assert value(reg, "memd_sessions") == 1
    assert value(reg, "memd_requests_total", op="plan", outcome="ok") == 1
    assert value(reg, "memd_request_duration_seconds_bucket", le="0.0005") == 1
    assert value(reg, "memd_request_duration_seconds_count") == 1
    text = generate_latest(reg).decode()
    assert "pid" not in text.replace("rapid", "")  # no pid labels: bounded label sets
    assert not re.search(r'[{,](job|session)="', text)  # Prometheus owns `job`; no per-run label


def test_a_jobs_next_run_continues_its_series_and_one_series_per_label_set(tmp_path):
    core = core_with(tmp_path, snapshot())
    first = core.sessions.open(job="llama", pid=1, host="h", local=False, start_time=None, limits=Limits(), rank=0)
    first.latest_batch = 8
    series = {"training_job": "llama", "rank": "0", "pool": "", "pod_uid": "", "slurm_job_id": ""}
    assert value(scrape(core), "memd_session_batch_size", **series) == 8
    second = core.sessions.open(job="llama", pid=2, host="h", local=False, start_time=None, limits=Limits(), rank=0)
    second.latest_batch = 12
    text = generate_latest(scrape(core)).decode()
    assert text.count("memd_session_batch_size{") == 1  # never two samples of one series
    assert value(scrape(core), "memd_session_batch_size", **series) == 12  # the newer run
    core.sessions.close(second.token)
    core.sessions.close(first.token)
    third = core.sessions.open(job="llama", pid=3, host="h", local=False, start_time=None, limits=Limits(), rank=0)
    third.latest_batch = 16
    assert value(scrape(core), "memd_session_batch_size", **series) == 16  # the same series again


def test_an_oom_counts_as_unrecovered_until_the_job_steps_again(tmp_path):
    core = core_with(tmp_path, snapshot())
    token = ops.hello(core, dict(job="cnn", pid=1, host="elsewhere", min_batch=1, default_batch=8))["token"]
    series = {"training_job": "cnn", "rank": "", "pod_uid": "", "slurm_job_id": ""}
    pool = next(s.pool or "" for s in core.sessions)

    def unrecovered():
        return value(scrape(core), "memd_session_ooms_unrecovered", pool=pool, **series)

    assert unrecovered() == 0
    ops.oom(core, {"token": token, "batch_size": 8})
    ops.oom(core, {"token": token, "batch_size": 6})
    assert unrecovered() == 2  # memd's first cut was not enough
    assert value(scrape(core), "memd_session_ooms_total", pool=pool, **series) == 2
    ops.report(core, {"token": token, "batch_size": 4, "peak_bytes": GiB})
    assert unrecovered() == 0  # a completed step on memd's new plan: handled
    assert value(scrape(core), "memd_session_ooms_total", pool=pool, **series) == 2


def test_process_and_platform_self_metrics(tmp_path):
    reg = scrape(core_with(tmp_path, snapshot()))
    assert "python_info{" in generate_latest(reg).decode()
    if os.path.exists("/proc/self/stat"):  # prometheus_client reads /proc: Linux only
        assert value(reg, "process_resident_memory_bytes") > 0
        assert value(reg, "process_open_fds") > 0


def test_a_scrape_never_samples(tmp_path):
    """A scrape builds its families from what the daemon holds: it opens no file (/proc, /sys,
    cgroupfs), lists no directory, loads no library (NVML) and starts no process. Python's audit
    hooks see every such call, from psutil and prometheus_client's own collectors too; a hook
    cannot be removed, so the scrape runs in a process of its own. The one exception is memd's
    own process (/proc/self: prometheus_client's process collector, memd's `process_*` metrics,
    as every exporter has them), never the machine's or a job's."""
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
own = [e for e in seen if e[1].startswith("/proc/self/")]
print(json.dumps([[e for e in seen if e not in own], core.snapshot is before, "memd_sessions 1.0" in text,
                  bool(own)]))
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=memd_env(), capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == [[], True, True, True]  # (its own /proc/self read: the hook sees reads)


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
