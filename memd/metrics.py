"""Prometheus exposition: one custom Collector over the latest Snapshot and the sessions.

A scrape never samples: it builds fresh metric families from values the daemon already holds
(prometheus/client_python's pattern for exporters that mirror another system). Base units only
(bytes, seconds, ratios 0-1), ``_total`` counters, ``_info`` for metadata, and bounded labels:
no pid labels, and no per-run label: a session's series are named by its training job, rank and
pool, so the next run of a job continues them. GPU labels are dcgm-exporter's where they mean the
same thing, so the two join without ``label_replace``. docs/metrics.md lists every metric.
"""
from __future__ import annotations

import errno
import platform
import re
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from memd.config import ConfigError, parse_address
from memd.core import VERSION, Core
from memd.policy.pressure import rank
from memd.sampling.snapshot import UNIFIED, Gpu, Snapshot
from memd.sessions import SessionRecord

# dcgm-exporter's names where they mean the same thing (gpu, UUID, modelName, pci_bus_id and, on
# a MIG instance, GPU_I_ID and GPU_I_PROFILE; UUID and modelName are then the physical GPU's, as
# there), plus memd's own mig_uuid: the MIG instance's uuid, what CUDA and a session's pool name.
GPU_LABELS = ["gpu", "UUID", "modelName", "pci_bus_id", "GPU_I_ID", "GPU_I_PROFILE", "mig_uuid"]
# A session's series: its training job (never `job`, which Prometheus owns), rank and pool. No
# per-run label: a job's next run continues the same series (a pod's or a Slurm job's runs are
# told apart by pod_uid and slurm_job_id, empty elsewhere; their series end with the session).
# session_labels() fills them in order.
SESSION_LABELS = ["training_job", "rank", "pool", "pod_uid", "slurm_job_id"]
MIG_PROFILE = re.compile(r"\bMIG (\S+)$")  # "NVIDIA A100-SXM4-80GB MIG 1g.10gb" -> "1g.10gb"
PSI_WINDOWS = (("10", "avg10"), ("60", "avg60"), ("300", "avg300"))
# Every source a sampling error can come from, exported at 0 from the start so that rate() and
# alerts see the series before its first error (Prometheus' advice: initialise known labels).
SAMPLE_SOURCES = ("cgroup", "nvml", "pressure", "procs", "sampler", "system", "vmstat")


class MemdCollector:
    def __init__(self, core: Core):
        self.core = core

    def collect(self) -> Iterator[Metric]:
        core = self.core
        info = InfoMetricFamily("memd_build", "memd version and Python it runs on")
        info.add_metric([], {"version": VERSION, "python": platform.python_version()})
        yield info
        snap = core.snapshot
        if snap is not None:
            yield from _host(snap)
            yield from _gpus(snap)
        yield _gauge("memd_pressure_level", "Memory pressure level: 0 ok, 1 elevated, 2 high, 3 critical",
                     rank(core.pressure.level))
        yield from self._sessions()
        yield from self._health()

    def _sessions(self) -> Iterator[Metric]:
        core = self.core
        sessions = list(core.sessions)
        yield _gauge("memd_sessions", "Training sessions registered now", len(sessions))
        shown = newest_per_series(sessions)

        def gauge(name: str, help_text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, help_text, labels=SESSION_LABELS)

        def counter(name: str, help_text: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, help_text, labels=SESSION_LABELS)

        families: Dict[str, Union[GaugeMetricFamily, CounterMetricFamily]] = {
            "batch": gauge("memd_session_recommended_batch_size", "Batch size the plan recommends"),
            "accum": gauge("memd_session_grad_accum_steps", "Gradient-accumulation steps the plan recommends"),
            "effective": gauge("memd_session_effective_batch_size", "Batch size x accumulation steps of the plan"),
            "workers": gauge("memd_session_recommended_workers", "Dataloader workers the plan recommends"),
            "throttle": gauge("memd_session_throttle", "1 while the plan asks data loading to pause"),
            "cgroup_pressure": gauge("memd_session_cgroup_pressure_level",
                                     "Memory pressure in the job's own cgroup: 0 ok, 1 elevated, 2 high, 3 critical"),
            "used": gauge("memd_session_batch_size", "Batch size of the session's last report"),
            "peak": gauge("memd_session_peak_bytes", "Peak memory of the session's last report"),
            "budget": gauge("memd_session_budget_bytes", "Largest peak the session's pool allows now"),
            "predicted": gauge("memd_session_predicted_peak_bytes", "Peak the learned curve predicts for the plan"),
            "unrecovered": gauge("memd_session_ooms_unrecovered",
                                 "Out-of-memory errors since the session's last completed step"),
            "ooms": counter("memd_session_ooms", "Out-of-memory errors the session reported"),
            "reports": counter("memd_session_reports", "Step reports the session sent"),
        }
        for labels, s in shown:
            plan = s.plan
            if plan is not None:
                families["batch"].add_metric(labels, plan.batch_size)
                families["accum"].add_metric(labels, plan.grad_accum_steps)
                families["effective"].add_metric(labels, plan.effective_batch_size)
                families["workers"].add_metric(labels, plan.num_workers)
                families["throttle"].add_metric(labels, int(plan.throttle))
            if s.latest_batch is not None:
                families["used"].add_metric(labels, s.latest_batch)
            if s.latest_peak is not None:
                families["peak"].add_metric(labels, s.latest_peak)
            if s.budget_bytes is not None:
                families["budget"].add_metric(labels, s.budget_bytes)
            if s.predicted_peak_bytes is not None:
                families["predicted"].add_metric(labels, s.predicted_peak_bytes)
            families["cgroup_pressure"].add_metric(labels, rank(s.planner.group_pressure.level))
            families["unrecovered"].add_metric(labels, s.ooms_unrecovered)
            families["ooms"].add_metric(labels, s.ooms)
            families["reports"].add_metric(labels, s.reports)
        yield from families.values()

    def _health(self) -> Iterator[Metric]:
        core = self.core
        requests = CounterMetricFamily("memd_requests", "Requests answered, by op and outcome",
                                       labels=["op", "outcome"])
        for (op, outcome), count in sorted(core.requests.items()):
            requests.add_metric([op, outcome], count)
        yield requests
        latency = HistogramMetricFamily("memd_request_duration_seconds", "Time to handle one request")
        buckets = [(repr(bound), count) for bound, count in core.latency.cumulative()] + [("+Inf", core.latency.count)]
        latency.add_metric([], buckets, core.latency.sum)
        yield latency
        errors = CounterMetricFamily("memd_sample_errors", "Failed reads while sampling, by source", labels=["source"])
        counts = dict.fromkeys(SAMPLE_SOURCES, 0)
        counts.update(core.sample_errors)
        for source, count in sorted(counts.items()):
            errors.add_metric([source], count)
        yield errors
        yield CounterMetricFamily("memd_sessions_expired", "Sessions dropped for silence or a vanished process",
                                  value=core.sessions_expired)
        yield CounterMetricFamily("memd_training_ooms", "Out-of-memory errors reported by all sessions",
                                  value=core.ooms_reported)
        yield CounterMetricFamily("memd_training_oom_kills", "Advised jobs the kernel's OOM killer ended, each "
                                  "learned as an out-of-memory at its batch", value=core.kills_learned)
        if core.snapshot is not None:
            yield _gauge("memd_sample_duration_seconds", "Time the last sample took", core.snapshot.duration_seconds)
            yield _gauge("memd_last_sample_timestamp_seconds", "Wall-clock time of the last sample",
                         core.snapshot.taken_at)
        yield _gauge("memd_remembered_jobs", "Job curves kept in the state directory", len(core.store))
        yield _gauge("memd_start_time_seconds", "Wall-clock time the daemon started", core.started)


def _host(snap: Snapshot) -> Iterator[Metric]:
    m = snap.system
    yield _gauge("memd_host_memory_total_bytes", "Host RAM", m.total_bytes)
    yield _gauge("memd_host_memory_available_bytes", "Host RAM available without swapping (MemAvailable)",
                 m.available_bytes)
    yield _gauge("memd_host_memory_used_bytes", "Host RAM not available (total minus available)", m.used_bytes)
    yield _gauge("memd_host_swap_total_bytes", "Swap space", m.swap_total_bytes)
    yield _gauge("memd_host_swap_used_bytes", "Swap in use", m.swap_used_bytes)
    model = InfoMetricFamily("memd_memory_model", "Memory model: discrete, unified or cpu")
    model.add_metric([], {"model": snap.memory_model})
    yield model
    yield _gauge("memd_unified_memory", "1 when GPU and CPU share one memory pool", int(snap.memory_model == UNIFIED))
    if snap.pressure is not None:
        ratio = GaugeMetricFamily("memd_memory_pressure_ratio",
                                  "Share of time tasks stalled on memory (PSI), by kind and window in seconds",
                                  labels=["kind", "window"])
        for kind in ("some", "full"):
            for window, attr in PSI_WINDOWS:
                ratio.add_metric([kind, window], getattr(snap.pressure, "%s_%s" % (kind, attr)))
        yield ratio
        stall = CounterMetricFamily("memd_memory_pressure_stall_seconds", "Cumulative memory stall time (PSI)",
                                    labels=["kind"])
        stall.add_metric(["some"], snap.pressure.some_total_seconds)
        stall.add_metric(["full"], snap.pressure.full_total_seconds)
        yield stall
    if snap.oom_kills is not None:
        yield CounterMetricFamily("memd_host_oom_kills", "Processes the kernel OOM killer ended since boot",
                                  value=snap.oom_kills)
    cg = snap.cgroup
    if cg is not None:
        labels = ["version", "path"]
        values = [str(cg.version), cg.path]
        for name, help_text, value in (
            ("memd_cgroup_memory_limit_bytes", "memd's cgroup memory limit (absent when unlimited)", cg.limit_bytes),
            ("memd_cgroup_memory_high_bytes", "memd's cgroup memory.high throttle point (v2)", cg.high_bytes),
            ("memd_cgroup_memory_usage_bytes", "memd's cgroup memory usage", cg.usage_bytes),
            ("memd_cgroup_memory_working_set_bytes", "Usage minus inactive file pages", cg.working_set_bytes),
        ):
            if value is not None:
                family = GaugeMetricFamily(name, help_text, labels=labels)
                family.add_metric(values, value)
                yield family
        for name, help_text, value in (
            ("memd_cgroup_oom_events", "Times the cgroup hit its limit and reclaim failed", cg.oom_events),
            ("memd_cgroup_oom_kill_events", "Processes killed by the OOM killer in the cgroup", cg.oom_kill_events),
        ):
            if value is not None:
                counter = CounterMetricFamily(name, help_text, labels=labels)
                counter.add_metric(values, value)
                yield counter


def _gpus(snap: Snapshot) -> Iterator[Metric]:
    if not snap.gpus:
        return
    fields = (
        ("total_bytes", "memd_gpu_memory_total_bytes", "GPU memory"),
        ("used_bytes", "memd_gpu_memory_used_bytes", "GPU memory in use (excluding reserved)"),
        ("free_bytes", "memd_gpu_memory_free_bytes", "GPU memory free"),
        ("reserved_bytes", "memd_gpu_memory_reserved_bytes", "GPU memory reserved by the driver"),
        ("utilization", "memd_gpu_utilization_ratio", "Share of time a kernel ran on the GPU"),
    )
    families = {attr: GaugeMetricFamily(name, help_text, labels=GPU_LABELS) for attr, name, help_text in fields}
    healthy = GaugeMetricFamily("memd_gpu_healthy", "1 while the GPU answers, 0 when lost or failing",
                                labels=GPU_LABELS)
    unified = GaugeMetricFamily("memd_gpu_unified_memory", "1 when the GPU uses host memory", labels=GPU_LABELS)
    physical = {gpu.uuid: gpu for gpu in snap.gpus if gpu.mig_parent_uuid is None and gpu.uuid}
    for gpu in snap.gpus:
        labels = gpu_labels(gpu, physical.get(gpu.mig_parent_uuid or ""))
        for attr, family in families.items():
            value = getattr(gpu, attr)
            if value is not None:
                family.add_metric(labels, value)
        healthy.add_metric(labels, int(gpu.healthy))
        unified.add_metric(labels, int(gpu.unified))
    yield from families.values()
    yield healthy
    yield unified


def gpu_labels(gpu: Gpu, parent: Optional[Gpu]) -> List[str]:
    """GPU_LABELS' values ("" for unknown: a device lost before it ever answered). A MIG instance
    is labelled by its physical GPU (``parent``, when in the same snapshot), as dcgm-exporter does."""
    if gpu.mig_parent_uuid is None:
        return [str(gpu.index), gpu.uuid or "", gpu.name or "", gpu.pci_bus_id or "", "", "", ""]
    profile = MIG_PROFILE.search(gpu.name or "")
    model = parent.name if parent is not None else MIG_PROFILE.sub("", gpu.name or "").strip()
    return [str(gpu.index), gpu.mig_parent_uuid, model or "", (parent.pci_bus_id if parent else None) or "",
            "" if gpu.gpu_instance_id is None else str(gpu.gpu_instance_id),
            profile.group(1) if profile else "", gpu.uuid or ""]


def session_labels(s: SessionRecord) -> List[str]:
    """SESSION_LABELS' values for one session."""
    return [s.job, "" if s.rank is None else str(s.rank), s.pool or "", s.pod_uid or "", s.slurm_job_id or ""]


def newest_per_series(sessions: Sequence[SessionRecord]) -> List[Tuple[List[str], SessionRecord]]:
    """(labels, session) with one session per label set: two runs of one job with the same rank
    on one pool (rare: two users' "train") would otherwise be duplicate series, which Prometheus
    drops. The newer run is shown; `memd status` lists both."""
    newest: Dict[Tuple[str, ...], SessionRecord] = {}
    for s in sessions:
        key = tuple(session_labels(s))
        if key not in newest or s.sid > newest[key].sid:
            newest[key] = s
    return [(list(key), s) for key, s in newest.items()]


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def build_registry(core: Core) -> CollectorRegistry:
    """memd's collector beside prometheus_client's process and platform collectors: every
    exporter's `process_*` self-metrics (memory, CPU, file descriptors, start time) and
    `python_info`, so memd's own cost is watched like any other exporter's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MemdCollector(core))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


class MetricsServer:
    def __init__(self, server, thread):
        self._server, self._thread = server, thread

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2.0)


def serve(core: Core, address: str, registry: Optional[CollectorRegistry] = None) -> MetricsServer:
    """Serve /metrics on ``address``; ConfigError (naming the flag) when the port is taken."""
    host, port = parse_address(address)
    registry = registry or build_registry(core)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError("metrics address %s is in use by another process (choose another with "
                              "--metrics-address HOST:PORT, or --metrics-address off)" % address) from None
        raise ConfigError("cannot serve metrics on %s: %s (--metrics-address)"
                          % (address, exc.strerror or exc)) from None
    return MetricsServer(server, thread)
