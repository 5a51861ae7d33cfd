"""GPUs as NVML sees them: the one module in memd that imports pynvml (nvidia-ml-py).

One forgiving layer: NVML is initialised lazily, every error becomes a value (a Gpu with
``healthy=False``, ``None`` for a reading the driver cannot give, an entry in the errors list),
and versioned functions are probed once and the answer remembered. No NVML (no driver, driver not
loaded) means no GPUs, said once in the log and in ``status()``; after driver errors NVML is
re-initialised with an exponential back-off on the injected clock. docs/nvml.md has the details.
"""
from __future__ import annotations

import ctypes
import dataclasses
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pynvml
import structlog

from .snapshot import Gpu, GpuProcess

log = structlog.get_logger(__name__)

Errors = List[Tuple[str, str]]  # (source, message) for Snapshot.errors
# total, used, free, reserved bytes
Memory = Tuple[Optional[int], Optional[int], Optional[int], Optional[int]]

BACKOFF_FIRST_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 60.0
# Integrated NVIDIA GPUs, whose memory is the host's: DGX Spark's GB10 and the Jetson/Tegra SoCs
# (names as nvidia-smi prints them: "NVIDIA GB10", "NVIDIA Thor", "Orin (nvgpu)").
INTEGRATED_NAME = re.compile(r"\b(GB10|Spark|Thor|Orin|Xavier|Tegra|Jetson)\b", re.IGNORECASE)
# Such a device's total may be the physical DRAM, a little above MemTotal (which leaves out
# firmware and kernel reservations); a total larger than this cannot be the host's pool.
HOST_MATCH_TOLERANCE = 0.05
NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF  # NVML_VALUE_NOT_AVAILABLE for unsigned long long readings
_NO_MEMORY: Memory = (None, None, None, None)

# The driver (not one device) is gone: drop the session and re-initialise later.
_DRIVER_GONE = (pynvml.NVMLError_Uninitialized, pynvml.NVMLError_DriverNotLoaded)
# A reading this device or driver cannot give: None, logged once, never an error entry.
_CANNOT = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_NoPermission,
           pynvml.NVMLError_FunctionNotFound)

_MEMORY_V2 = "nvmlDeviceGetMemoryInfo_v2"


class _ProcessInfoV1(ctypes.Structure):  # nvmlProcessInfo_v1_t (R450 and older drivers)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def _running_processes_v1(symbol: str) -> Callable[[Any], List[Any]]:
    """The unversioned (v1) process query, which nvidia-ml-py 13 no longer binds, through the
    bindings' own symbol lookup (so a missing symbol is its FunctionNotFound)."""
    def query(handle: Any) -> List[Any]:
        lookup = getattr(pynvml, "_nvmlGetFunctionPointer", None)
        if lookup is None:  # bindings reorganised: treat as a driver without the function
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        fn = lookup(symbol)
        count = ctypes.c_uint(0)
        ret = fn(handle, ctypes.byref(count), None)  # how many?
        if ret == pynvml.NVML_SUCCESS:
            return []
        if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise pynvml.NVMLError(ret)
        count.value = count.value * 2 + 5  # room for processes started meanwhile
        infos = (_ProcessInfoV1 * count.value)()
        ret = fn(handle, ctypes.byref(count), infos)
        if ret != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(ret)
        return list(infos[:count.value])
    return query


_PROCESS_QUERIES = {  # (symbol, call), newest first
    "compute": (
        ("nvmlDeviceGetComputeRunningProcesses_v3",
         pynvml.nvmlDeviceGetComputeRunningProcesses_v3),
        ("nvmlDeviceGetComputeRunningProcesses_v2",
         pynvml.nvmlDeviceGetComputeRunningProcesses_v2),
        ("nvmlDeviceGetComputeRunningProcesses",
         _running_processes_v1("nvmlDeviceGetComputeRunningProcesses")),
    ),
    "graphics": (
        ("nvmlDeviceGetGraphicsRunningProcesses_v3",
         pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3),
        ("nvmlDeviceGetGraphicsRunningProcesses_v2",
         pynvml.nvmlDeviceGetGraphicsRunningProcesses_v2),
        ("nvmlDeviceGetGraphicsRunningProcesses",
         _running_processes_v1("nvmlDeviceGetGraphicsRunningProcesses")),
    ),
}


@dataclass(frozen=True)
class NvmlStatus:
    """What `memd doctor` says about NVML."""
    available: bool
    reason: Optional[str] = None  # why not, with a hint; None when available
    driver_version: Optional[str] = None  # e.g. "550.54.15"
    nvml_version: Optional[str] = None  # e.g. "12.550.54.15"
    device_count: Optional[int] = None  # physical GPUs (MIG devices not counted)


def init_failure_reason(error: Exception) -> str:
    """Why nvmlInit failed, with what to do about it."""
    if isinstance(error, pynvml.NVMLError_LibraryNotFound):
        return ("NVML library libnvidia-ml.so.1 not found: no NVIDIA driver here (host memory "
                "only); install the NVIDIA driver, or run the container with the NVIDIA "
                "Container Toolkit (--gpus)")
    if isinstance(error, pynvml.NVMLError_DriverNotLoaded):
        return ("NVIDIA kernel driver not loaded: check `nvidia-smi` and `lsmod | grep nvidia`")
    if isinstance(error, pynvml.NVMLError_NoPermission):
        return ("no permission to open /dev/nvidia*: run memd as a user that may use the GPUs "
                "(often the video group) or map the device nodes into the container")
    if isinstance(error, pynvml.NVMLError_LibRmVersionMismatch):
        return ("NVML library and kernel driver versions differ (usually after a driver "
                "upgrade): reboot or reload the nvidia kernel modules")
    if isinstance(error, pynvml.NVMLError_FunctionNotFound):
        return ("libnvidia-ml.so.1 lacks nvmlInitWithFlags: the driver is too old for "
                "nvidia-ml-py; upgrade the NVIDIA driver")
    return f"NVML initialisation failed: {error}"


class Nvml:
    """Samples every GPU NVML sees. Cheap to construct: NVML is loaded on first use.

    Thread-safe: sample(), status() and shutdown() take one lock.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ready = False  # nvmlInit succeeded and no driver error since
        self._ever_ready = False
        self._reason: Optional[str] = None  # why NVML is not available now
        self._retry_at: Optional[float] = None  # clock value before which init is not retried
        self._delay = BACKOFF_FIRST_SECONDS
        self._driver_version: Optional[str] = None
        self._nvml_version: Optional[str] = None
        self._device_count: Optional[int] = None
        self._missing: set[str] = set()  # versioned functions this driver lacks
        self._said: set[str] = set()  # keys of things logged once
        # (index, MIG slot or -1) -> uuid, name, PCI bus id, GPU instance id from the last sample
        # that could read them
        self._known: Dict[Tuple[int, int], Tuple[Optional[str], Optional[str], Optional[str], Optional[int]]] = {}
        self._where: Dict[str, Tuple[Optional[str], Optional[int]]] = {}  # uuid -> _location(), read once

    # ---- public ----

    def sample(self, host_total_bytes: Optional[int] = None) -> Tuple[Tuple[Gpu, ...], Errors]:
        """Every GPU (and MIG device, after its parent) now, and the errors met reading them.

        host_total_bytes (the host's RAM) lets an integrated device (GB10, Jetson) that does
        report memory be recognised as unified; without it only NVML's own word counts.
        """
        with self._lock:
            if not self._ensure_init():
                return (), self._down_errors()
            gpus: List[Gpu] = []
            errors: Errors = []
            try:
                count = pynvml.nvmlDeviceGetCount()
                for index in range(count):
                    gpus.extend(self._physical(index, host_total_bytes, errors))
            except pynvml.NVMLError as e:  # device errors are contained below; this is the driver
                self._driver_lost(e)
                return (), self._down_errors()
            self._device_count = count
            return tuple(gpus), errors

    def status(self) -> NvmlStatus:
        with self._lock:
            available = self._ensure_init()
            return NvmlStatus(available=available, reason=self._reason,
                              driver_version=self._driver_version, nvml_version=self._nvml_version,
                              device_count=self._device_count if available else None)

    def shutdown(self) -> None:
        with self._lock:
            if self._ready:
                self._quiet_shutdown()
            self._ready = False
            self._retry_at = None  # a later sample() initialises again

    # ---- initialisation and the driver ----

    def _ensure_init(self) -> bool:
        if self._ready:
            return True
        now = self._clock()
        if self._retry_at is not None and now < self._retry_at:
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            quiet = isinstance(e, pynvml.NVMLError_LibraryNotFound)  # no hardware, not broken
            self._fail(init_failure_reason(e), now, quiet=quiet)
            return False
        try:
            self._device_count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            self._quiet_shutdown()
            self._fail(f"NVML initialised but cannot count devices: {e}", now)
            return False
        self._driver_version = self._optional(pynvml.nvmlSystemGetDriverVersion)
        self._nvml_version = self._optional(pynvml.nvmlSystemGetNVMLVersion)
        self._ready = self._ever_ready = True
        self._reason, self._retry_at, self._delay = None, None, BACKOFF_FIRST_SECONDS
        log.info("nvml_ready", driver=self._driver_version, nvml=self._nvml_version,
                 devices=self._device_count)
        return True

    def _fail(self, reason: str, now: float, quiet: bool = False) -> None:
        if reason != self._reason:  # said once per distinct reason, not per retry
            (log.info if quiet else log.warning)("nvml_unavailable", reason=reason)
        self._reason = reason
        self._retry_at = now + self._delay
        self._delay = min(self._delay * 2, BACKOFF_MAX_SECONDS)

    def _driver_lost(self, error: Exception) -> None:
        self._quiet_shutdown()
        self._ready = False
        self._fail(f"NVML driver error: {error}", self._clock())

    def _down_errors(self) -> Errors:
        # Never having had NVML is "no GPUs here", not an error; losing it after is one.
        return [("nvml", self._reason)] if self._ever_ready and self._reason else []

    @staticmethod
    def _quiet_shutdown() -> None:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass

    @staticmethod
    def _optional(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except pynvml.NVMLError:
            return None

    def _once(self, key: str, event: str, **fields: Any) -> None:  # normal on many devices: debug
        if key not in self._said:
            self._said.add(key)
            log.debug(event, **fields)

    # ---- devices ----

    def _physical(self, index: int, host_total: Optional[int], errors: Errors) -> List[Gpu]:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except _DRIVER_GONE:
            raise
        except pynvml.NVMLError as e:
            return [self._broken((index, -1), None, e, errors)]
        gpu = self._device(handle, (index, -1), None, host_total, errors)
        if not gpu.healthy:
            return [gpu]
        try:
            migs = self._mig_devices(handle, gpu, host_total, errors)
        except _DRIVER_GONE:
            raise
        except pynvml.NVMLError as e:  # lost while listing its MIG devices
            return [self._broken((index, -1), None, e, errors)]
        if migs:  # the parent's list aggregates its MIG devices': count each process once
            gpu = dataclasses.replace(gpu, processes=())
        return [gpu, *migs]

    def _mig_devices(self, handle: Any, parent: Gpu, host_total: Optional[int],
                     errors: Errors) -> List[Gpu]:
        mode = self._reading("MIG mode", parent.uuid, errors, pynvml.nvmlDeviceGetMigMode, handle)
        if not mode or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return []
        slots = self._reading("MIG device count", parent.uuid, errors,
                              pynvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
        out = []
        for slot in range(slots):
            key = (parent.index, slot)
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError_NotFound:
                continue  # an empty slot
            except _DRIVER_GONE:
                raise
            except pynvml.NVMLError as e:
                out.append(self._broken(key, parent.uuid, e, errors))
                continue
            out.append(self._device(mig, key, parent.uuid, host_total, errors))
        return out

    def _device(self, handle: Any, key: Tuple[int, int], parent_uuid: Optional[str],
                host_total: Optional[int], errors: Errors) -> Gpu:
        try:
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            where = self._location(handle, uuid, parent_uuid, errors)
            self._known[key] = (uuid, name, *where)
            unified, (total, used, free, reserved) = _classify(self._memory(handle), name,
                                                                host_total)
            utilization = self._reading("utilization", uuid, errors,
                                        pynvml.nvmlDeviceGetUtilizationRates, handle)
            processes = self._processes(handle, uuid, errors)
        except _DRIVER_GONE:
            raise
        except pynvml.NVMLError as e:  # GPU lost, or a failed memory query: this device only
            return self._broken(key, parent_uuid, e, errors)
        return Gpu(index=key[0], uuid=uuid, name=name, total_bytes=total, used_bytes=used,
                   free_bytes=free, reserved_bytes=reserved, unified=unified,
                   utilization=None if utilization is None else utilization.gpu / 100.0,
                   processes=processes, mig_parent_uuid=parent_uuid, pci_bus_id=where[0],
                   gpu_instance_id=where[1])

    def _location(self, handle: Any, uuid: str, parent_uuid: Optional[str],
                  errors: Errors) -> Tuple[Optional[str], Optional[int]]:
        """(PCI bus id, GPU instance id): what dcgm-exporter labels a device by, so that memd's
        series join its. A GPU has a bus id, a MIG instance an instance id (and its GPU's bus)."""
        if parent_uuid is None:
            pci = self._reading("PCI info", uuid, errors, pynvml.nvmlDeviceGetPciInfo_v3, handle)
            bus = None if pci is None else pci.busId
            return (bus.decode() if isinstance(bus, bytes) else bus) or None, None
        return None, self._reading("GPU instance id", uuid, errors, pynvml.nvmlDeviceGetGpuInstanceId, handle)

    def _broken(self, key: Tuple[int, int], parent_uuid: Optional[str], error: Exception,
                errors: Errors) -> Gpu:
        index, slot = key
        # What an earlier sample learnt; None (unknown) when the device never answered.
        uuid, name, pci, instance = self._known.get(key, (None, None, None, None))
        label = uuid or (f"GPU {index}" if slot < 0 else f"GPU {index} MIG slot {slot}")
        errors.append(("nvml", f"{label}: {error}"))
        return Gpu(index=index, uuid=uuid, name=name, total_bytes=None, used_bytes=None,
                   free_bytes=None, reserved_bytes=None, unified=False, healthy=False,
                   error=str(error), mig_parent_uuid=parent_uuid, pci_bus_id=pci,
                   gpu_instance_id=instance)

    def _memory(self, handle: Any) -> Optional[Memory]:
        """Total, used, free, reserved bytes (reserved None from the v1 query); None when the
        device does not report memory (unified memory, as on GB10)."""
        if _MEMORY_V2 not in self._missing:
            try:
                m = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                return m.total, m.used, m.free, m.reserved
            except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_ArgumentVersionMismatch):
                self._missing.add(_MEMORY_V2)
                log.info("nvml_memory_v1_fallback", missing=_MEMORY_V2,
                         note="used includes the driver's reservation; reserved unknown")
            except pynvml.NVMLError_NotSupported:
                pass  # ask v1 before concluding that memory is unified
        try:
            m = pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError_NotSupported:
            return None
        return m.total, m.used, m.free, None

    def _processes(self, handle: Any, uuid: str, errors: Errors) -> Tuple[GpuProcess, ...]:
        used_by_pid: Dict[int, Optional[int]] = {}
        for kind, queries in _PROCESS_QUERIES.items():
            infos = self._reading(f"{kind} processes", uuid, errors, self._versioned, queries,
                                  handle)
            for info in infos or ():
                used = info.usedGpuMemory
                used = None if used is None or used == NOT_AVAILABLE else int(used)
                if used_by_pid.get(info.pid) is None:  # a process in both lists is listed twice
                    used_by_pid[info.pid] = used
        return tuple(GpuProcess(pid=pid, used_bytes=used)
                     for pid, used in sorted(used_by_pid.items()))

    def _versioned(self, queries: Sequence[Tuple[str, Callable[..., Any]]], *args: Any) -> Any:
        """Call the newest of the versioned functions this driver has."""
        for name, query in queries:
            if name in self._missing:
                continue
            try:
                return query(*args)
            except pynvml.NVMLError_FunctionNotFound:
                self._missing.add(name)
                log.info("nvml_function_missing", function=name)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _reading(self, what: str, uuid: Optional[str], errors: Errors, fn: Callable[..., Any],
                 *args: Any) -> Any:
        """A secondary reading: None when the device cannot give it (logged once) or it failed
        (an error entry); GPU lost and driver errors propagate to spoil the device."""
        try:
            return fn(*args)
        except (pynvml.NVMLError_GpuIsLost, *_DRIVER_GONE):
            raise
        except _CANNOT as e:
            self._once(f"{what}:{uuid}", "nvml_reading_unavailable", reading=what, uuid=uuid,
                       error=str(e))
        except pynvml.NVMLError as e:
            errors.append(("nvml", f"{uuid}: {what}: {e}"))
        return None


def _classify(memory: Optional[Memory], name: str,
              host_total: Optional[int]) -> Tuple[bool, Memory]:
    """(unified, memory). Unified when NVML does not report memory (Not Supported, or a total
    of 0: then all None), or when an integrated part (by name) reports a total no larger than
    the host's RAM plus 5 %: its numbers are the shared pool's and are kept.

    The size alone is no evidence: a 24 GiB RTX 4090 in a host with 23.5 GiB of RAM reports a
    host-sized total of its own memory. docs/platforms.md has the rule and its evidence.
    """
    if memory is None or not memory[0]:
        return True, _NO_MEMORY
    fits_host = bool(host_total and memory[0] <= host_total * (1 + HOST_MATCH_TOLERANCE))
    return fits_host and INTEGRATED_NAME.search(name) is not None, memory
