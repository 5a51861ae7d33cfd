"""Who is asking: the job's name, process, ranks, device and CPUs, as a hello tells the daemon.
Each read is of this process only (its argv, /proc/self, its environment, torch when the caller
has imported it), and a field that cannot be read is left out.
"""
from __future__ import annotations

import hashlib
import os
import sys
from typing import Any, Dict, List, Mapping, Optional

from . import protocol
from .procstat import parse_stat


def usable_cpus() -> Optional[int]:
    """CPUs this process may run on (its affinity), shared among the job's ranks on this node."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 0
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, cpus // int(ranks)) if ranks.isdigit() and int(ranks) > 0 and cpus else (cpus or None)


def default_job(argv: Optional[List[str]] = None, main: Any = None, orig_argv: Optional[List[str]] = None) -> str:
    """The name a job's curves are kept under when it gives none: its script's file name
    (``train.py``); under ``python -m`` the module's name (``pkg.train``, a package's
    ``__main__`` named by its package: argv[0] is then the module's full path, not a name);
    under ``python -c`` "python-c:" and a hash of the command, so that one command run again
    finds what it learned and two different ones do not share a curve ("python-c" where Python
    keeps no copy of the command, before 3.10); "python" at the interactive prompt. Never "-c":
    every one-liner on a machine would share one curve under it."""
    argv = sys.argv if argv is None else argv
    main = sys.modules.get("__main__") if main is None else main
    first = argv[0] if argv else ""
    spec = getattr(main, "__spec__", None)
    module = getattr(spec, "name", None)
    if isinstance(module, str) and module and module != "__main__":  # python -m
        if module.endswith(".__main__"):
            module = module[:-len(".__main__")]
        return module
    if first == "-c":
        orig = getattr(sys, "orig_argv", None) if orig_argv is None else orig_argv
        command = orig[orig.index("-c") + 1] if orig and "-c" in orig[:-1] else None
        if command is None:
            return "python-c"
        return "python-c:%s" % hashlib.sha256(command.encode("utf-8", "replace")).hexdigest()[:12]
    name = os.path.basename(first) if first not in ("", "-") else ""
    return name or "python"


def scheduler_identity(proc_root: str = "/proc", environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The Slurm job (SLURM_JOB_ID) and Kubernetes pod (its UID, from this process's cgroup or
    mounts) this process runs in, for `memd status` and the session metrics. The daemon reads
    them itself from a process it can watch; these count for one it cannot (another pid
    namespace, another host), shown there as told by the client."""
    env = os.environ if environ is None else environ
    fields: Dict[str, Any] = {}
    slurm = env.get("SLURM_JOB_ID", "")
    if protocol.SLURM_JOB_ID.match(slurm):
        fields["slurm_job_id"] = slurm
    pod = None
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as f:
            pod = protocol.pod_uid_in(f.read(1 << 16))  # cgroup v1, or v2 without a cgroup namespace
        if pod is None:  # kubelet bind-mounts the pod's /etc/hosts from /var/lib/kubelet/pods/<UID>/
            with open(os.path.join(proc_root, "self", "mountinfo")) as f:
                for line in f:
                    parts = line.split(" ", 5)
                    if len(parts) > 4 and parts[4] == "/etc/hosts":
                        pod = protocol.pod_uid_in(parts[3])
                        break
    except (OSError, UnicodeDecodeError):
        pass
    if pod is not None:
        fields["pod_uid"] = pod
    return fields


def process_identity(proc_root: str = "/proc") -> Dict[str, Any]:
    """This process's pid namespace (the inode of /proc/self/ns/pid) and start time (clock
    ticks since boot, field 22 of /proc/self/stat), each left out when unreadable (not Linux).
    The daemon watches the hello's pid only when both match what it reads for that pid: in a
    container sharing the host's name, the pid names an unrelated process in the daemon's view."""
    fields: Dict[str, Any] = {}
    try:
        fields["pid_ns"] = os.stat(os.path.join(proc_root, "self", "ns", "pid")).st_ino
    except OSError:
        pass
    try:
        with open(os.path.join(proc_root, "self", "stat")) as f:
            start = parse_stat(f.read()).start_time
        if start is not None:
            fields["start_time"] = start
    except (OSError, ValueError):
        pass
    return {name: value for name, value in fields.items()
            if protocol.FIELD_RANGES[name][0] <= value <= protocol.FIELD_RANGES[name][1]}


def distributed_identity() -> Dict[str, Any]:
    fields: Dict[str, Any] = {}
    for name, env in (("rank", "RANK"), ("local_rank", "LOCAL_RANK"), ("world_size", "WORLD_SIZE"),
                      ("local_world_size", "LOCAL_WORLD_SIZE")):
        value = os.environ.get(env)
        if value is not None and value.isdigit():
            fields[name] = int(value)
    return fields


def device_identity(device: Any) -> Dict[str, Any]:
    """The device as given, plus its UUID when torch (already imported by the caller) knows it.

    NVML and CUDA number devices differently (CUDA_VISIBLE_DEVICES, MIG), so the daemon maps a
    device by UUID and only falls back to the index when no UUID is known.
    """
    fields: Dict[str, Any] = {}
    if device is not None:
        fields["device"] = str(device)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        fields["cuda_visible_devices"] = visible[:256]
    torch = sys.modules.get("torch")
    if torch is None:
        return fields
    try:
        if not torch.cuda.is_initialized():
            return fields
        if device is None:
            index = torch.cuda.current_device()
        else:
            dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
            if dev.type != "cuda":
                return fields
            index = dev.index if dev.index is not None else torch.cuda.current_device()
        fields.setdefault("device", "cuda:%d" % index)
        fields["device_uuid"] = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        pass
    return fields
