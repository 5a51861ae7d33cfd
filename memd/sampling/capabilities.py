"""What memd can and cannot see on this machine, and why: the substance of `memd doctor`.

Each check tries the real read the sampler would do and turns the outcome into one line a
person can act on. Checks never raise: a failure is an answer ("unavailable: ..."), not a crash.
"""
from __future__ import annotations

import errno
import os
import platform as _platform
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

from memd.units import GiB

from . import cgroup as cgroup_module
from . import platform, system
from .nvml import Nvml

PROC_ACCESS_PROBES = 256  # /proc entries looked at, at most: doctor stays quick on a busy host


@dataclass(frozen=True)
class Capability:
    name: str
    available: bool
    detail: str  # what was found, or why not and what to do

    def as_json(self) -> Dict[str, object]:
        return asdict(self)


def check_all(nvml: Optional[Nvml] = None, proc_root: str = "/proc", etc_root: str = "/etc",
              socket_path: Optional[str] = None) -> List[Capability]:
    checks: List[Callable[[], Capability]] = [
        lambda: check_nvml(nvml or Nvml(), host_total_bytes(proc_root)),
        lambda: check_platform(etc_root),
        lambda: check_psi(proc_root),
        lambda: check_cgroup(proc_root),
        lambda: check_proc_access(proc_root),
    ]
    if socket_path is not None:
        checks.append(lambda: check_socket_dir(socket_path))
    out = []
    for check in checks:
        try:
            out.append(check())
        except Exception as exc:  # a check with a bug still gives an answer
            out.append(Capability(getattr(check, "__name__", "check"), False, "check failed: %r" % (exc,)))
    return out


def host_total_bytes(proc_root: str = "/proc") -> Optional[int]:
    """The host's RAM as the Sampler reads it (meminfo on Linux, else psutil); None if unreadable."""
    try:
        return system.read_host_memory(proc_root).total_bytes
    except (OSError, ValueError, KeyError):
        return None


def check_nvml(nvml: Nvml, host_total: Optional[int] = None) -> Capability:
    """host_total: the host's RAM, which the daemon gives NVML too, so that doctor classifies a
    device (unified or not) exactly as the daemon does."""
    status = nvml.status()
    if not status.available:
        return Capability("nvml", False, status.reason or "NVML is not available")
    gpus, errors = nvml.sample(host_total)
    unified = sum(1 for g in gpus if g.unified)
    unhealthy = [g for g in gpus if not g.healthy]
    detail = "%d GPU%s, driver %s, NVML %s" % (status.device_count or 0, "" if status.device_count == 1 else "s",
                                             status.driver_version, status.nvml_version)
    if unified:
        detail += "; %d with unified memory (budgeted from host RAM)" % unified
    if unhealthy:
        detail += "; unhealthy: " + ", ".join("%d (%s)" % (g.index, g.error) for g in unhealthy)
    elif errors:
        detail += "; %d read error%s: %s" % (len(errors), "" if len(errors) == 1 else "s", errors[0][1])
    return Capability("nvml", True, detail)


def check_platform(etc_root: str = "/etc") -> Capability:
    machine = "%s %s" % (_platform.system(), _platform.machine())
    if platform.is_apple_silicon():
        level = platform.apple_pressure_level()
        shown = level if level is not None else "unreadable (sysctl kern.memorystatus_vm_pressure_level)"
        return Capability("platform", level is not None,
                          "%s: Apple Silicon, unified memory; pressure level %s" % (machine, shown))
    if platform.is_tegra(etc_root):
        return Capability("platform", True, "%s: NVIDIA Tegra/Jetson (/etc/nv_tegra_release), unified memory" % machine)
    return Capability("platform", True, machine)


def check_psi(proc_root: str = "/proc") -> Capability:
    try:
        psi = system.read_pressure(proc_root)
    except OSError as exc:
        return Capability("psi", False, "%s/pressure/memory unreadable: %s" % (proc_root, exc.strerror))
    if psi is None:
        return Capability("psi", False, "no memory pressure stall information: kernel older than 4.20, booted "
                          "with psi=0, or not Linux; pressure then comes from available memory alone")
    return Capability("psi", True, "some %.1f%% full %.1f%% (avg10)" % (psi.some_avg10 * 100, psi.full_avg10 * 100))


def check_cgroup(proc_root: str = "/proc") -> Capability:
    try:
        cg = cgroup_module.read_cgroup(None, proc_root)
    except (OSError, ValueError) as exc:
        return Capability("cgroup", False, "memory cgroup unreadable: %s" % (exc,))
    if cg is None:
        return Capability("cgroup", False, "no memory cgroup controller mounted: host limits only")
    limit = "unlimited" if cg.limit_bytes is None else "limit %.2f GiB" % (cg.limit_bytes / GiB)
    return Capability("cgroup", True, "v%d %s, %s" % (cg.version, cg.path, limit))


def check_proc_access(proc_root: str = "/proc", limit: int = PROC_ACCESS_PROBES) -> Capability:
    """Can memd read other users' /proc/PID/smaps_rollup (PSS/USS of their training jobs)?

    Looks at no more than ``limit`` processes, lowest pids first (system daemons, usually
    another user's), so the answer is quick and the same each time on a host with 100k pids.
    """
    me = os.getuid()
    pids = sorted(int(name) for name in os.listdir(proc_root) if name.isdigit())
    examined = 0
    for pid in pids:
        if pid == os.getpid():
            continue
        if examined >= limit:
            break
        examined += 1
        name = str(pid)
        base = os.path.join(proc_root, name)
        try:
            owner = os.stat(base).st_uid
        except OSError:
            continue
        if owner == me:
            continue
        try:
            with open(os.path.join(base, "smaps_rollup"), "rb") as f:
                f.read(1)
            return Capability("proc_access", True, "can read other users' smaps_rollup (e.g. pid %s of uid %d)"
                              % (name, owner))
        except FileNotFoundError:
            if os.path.exists(os.path.join(base, "statm")):  # alive: the kernel has no smaps_rollup
                return Capability("proc_access", False, "no smaps_rollup on this kernel (older than 4.14): every "
                                  "process's PSS/USS is unknown, RSS only")
            continue  # gone
        except PermissionError:
            return Capability("proc_access", False, "cannot read pid %s's smaps_rollup (uid %d): other users' jobs get "
                              "RSS only; run as the memd service (CAP_SYS_PTRACE) or as root" % (name, owner))
        except OSError as exc:
            if exc.errno in (errno.ESRCH, errno.EINVAL):
                continue
            return Capability("proc_access", False, "reading pid %s's smaps_rollup failed: %s" % (name, exc.strerror))
    if os.geteuid() == 0:
        return Capability("proc_access", True, "running as root: every process's smaps_rollup is readable")
    return Capability("proc_access", True, "no other user's process with memory maps among the %d looked at; own "
                      "processes readable" % examined)


def check_socket_dir(socket_path: str) -> Capability:
    directory = os.path.dirname(socket_path) or "."
    if os.path.exists(socket_path):
        return Capability("socket", True, "%s exists (a daemon is or was serving there)" % socket_path)
    if not os.path.isdir(directory):
        parent = os.path.dirname(directory) or "."
        if os.access(parent, os.W_OK | os.X_OK):
            return Capability("socket", True, "%s does not exist yet; `memd serve` will create it" % directory)
        return Capability("socket", False,
                          "%s does not exist and %s is not writable: choose --endpoint" % (directory, parent))
    if os.access(directory, os.W_OK | os.X_OK):
        return Capability("socket", True, "%s is writable; no daemon socket there now" % directory)
    return Capability("socket", False, "%s is not writable by uid %d: join the group that owns it, or choose --endpoint"
                      % (directory, os.getuid()))
