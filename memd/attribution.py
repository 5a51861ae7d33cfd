"""Which Kubernetes pod and which Slurm job a training process belongs to.

Read by the daemon from the process itself wherever it can (what it reads, a client cannot
forge): the pod's UID and a Slurm job's id are both in the path of the process's cgroup
(/proc/PID/cgroup), which kubelet and slurmstepd name after them; a Slurm job without its
cgroup plugin still leaves SLURM_JOB_ID in the process's environment (/proc/PID/environ,
readable by the job's own user or with CAP_SYS_PTRACE, as smaps_rollup is). A session whose
process the daemon cannot read (another pid namespace, another host) is attributed from what
its client said in hello, and shown as such.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from memd.client.protocol import pod_uid_in

# slurmstepd's cgroups: .../slurm/uid_1000/job_42/step_0 (v1), .../job_42/step_batch/user/task_0 (v2)
_SLURM_CGROUP = re.compile(r"/job_(\d{1,20})(?:/|$)")
_SLURM_ENV = re.compile(rb"(?:^|\0)SLURM_JOB_ID=(\d{1,20})(?:\0|$)")

CGROUP, ENVIRON, CLIENT = "cgroup", "environ", "client"


@dataclass(frozen=True)
class Attribution:
    pod_uid: Optional[str] = None
    slurm_job_id: Optional[str] = None
    source: Optional[str] = None  # how it is known: cgroup or environ (read here), client (told)


def read(pid: int, proc_root: str = "/proc") -> Optional[Attribution]:
    """What the process's cgroup path, then its environment, say (an empty Attribution: in
    neither a pod nor a Slurm job); None when its environment cannot be read, so that what its
    client said stands in. Attribution is a label, never a reason to refuse a job."""
    base = os.path.join(proc_root, str(pid))
    try:
        with open(os.path.join(base, "cgroup")) as f:
            cgroup = f.read(65536)
    except OSError:
        cgroup = ""
    pod = pod_uid_in(cgroup)
    slurm = slurm_job_in_cgroup(cgroup)
    if pod is not None or slurm is not None:
        return Attribution(pod, slurm, CGROUP)
    try:
        with open(os.path.join(base, "environ"), "rb") as f:
            environ = f.read(1 << 20)
    except OSError:
        return None  # another user's process without CAP_SYS_PTRACE, or gone
    found = _SLURM_ENV.search(environ)
    return Attribution(None, found.group(1).decode(), ENVIRON) if found else Attribution()


def slurm_job_in_cgroup(text: str) -> Optional[str]:
    """The Slurm job id in /proc/PID/cgroup's paths, when slurmstepd's cgroup holds the process."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        if "slurm" in path:
            found = _SLURM_CGROUP.search(path)
            if found:
                return found.group(1)
    return None


def told(pod_uid: Optional[str], slurm_job_id: Optional[str]) -> Attribution:
    """What a client said of itself in hello."""
    if pod_uid is None and slurm_job_id is None:
        return Attribution()
    return Attribution(pod_uid, slurm_job_id, CLIENT)
