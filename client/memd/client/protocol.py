"""The memd wire protocol v1: the schema both ends agree on, and nothing else.

One msgpack map per ZeroMQ message. A request is ``{"v": 1, "op": str, "id": int, ...}``;
a reply is ``{"v": 1, "id": <the request's id>, "ok": True, "result": {...}}`` or
``{"v": 1, "id": ..., "ok": False, "error": {"code": str, "message": str}}``.
docs/protocol.md is the readable specification; this module is the executable one, shared by
the daemon (which depends on this distribution) so the two ends cannot drift apart.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional

import msgpack

# The endpoints both ends pick with no configuration, and whom to trust on a socket: in a module
# of their own, which the daemon's configuration imports without loading msgpack.
from .endpoint import SYSTEM_SOCKET as SYSTEM_SOCKET
from .endpoint import default_endpoint as default_endpoint
from .endpoint import stranger as stranger
from .endpoint import user_socket_path as user_socket_path

VERSION = 1

#: Requests larger than this get a ``too_large`` error reply. Generous for a few hints,
#: small enough that one session cannot make the daemon hold much.
MAX_MESSAGE_BYTES = 64 * 1024

OPS = ("hello", "plan", "report", "oom", "bye", "status", "ping", "curves", "forget")

MAX_BATCH = 2 ** 31 - 1  # samples in a batch or an effective batch: torch's int32 indices
MAX_BYTES = 2 ** 50  # 1 PiB: more memory than any one machine has
MAX_RANKS = 2 ** 20  # processes of one distributed job

#: The inclusive range of every numeric request field (docs/protocol.md, "Field ranges"): far
#: beyond any real job, and small enough that nothing either end computes from them costs much
#: (a target of 2**62 once kept the daemon busy for minutes). A daemon refuses a value outside
#: with ``invalid`` naming the field; floats must be finite.
FIELD_RANGES = {
    "pid": (1, 2 ** 32 - 1),  # a pid_t, or a Windows process id
    # hello's: the inode of /proc/self/ns/pid (an ino_t) and the start in clock ticks since boot
    # (an unsigned long long). Only compared, never computed with: the types' own ranges, so
    # that no real value is ever refused (a refused hello leaves the job without a plan).
    "pid_ns": (1, 2 ** 64 - 1), "start_time": (0, 2 ** 64 - 1),
    "min_batch": (1, MAX_BATCH), "max_batch": (1, MAX_BATCH), "default_batch": (1, MAX_BATCH),
    "target_effective_batch": (1, MAX_BATCH), "batch_size": (1, MAX_BATCH),
    "rank": (0, MAX_RANKS - 1), "local_rank": (0, MAX_RANKS - 1),
    "world_size": (1, MAX_RANKS), "local_world_size": (1, MAX_RANKS),
    "cpus": (0, 65536),  # a number; 0 means unknown
    "peak_bytes": (0, MAX_BYTES), "base_bytes": (0, MAX_BYTES), "batch_bytes": (0, MAX_BYTES),
    "step": (0, 2 ** 53),  # exact as a float
    "loader_workers": (0, 1024),  # a report's: the DataLoader workers its batch came from
    "step_seconds": (0, 10 ** 9),  # a number
    "limit": (1, 4096),  # `curves` and `status`: the most entries a page holds (a page is also bounded in bytes)
}

#: A Kubernetes pod's UID where kubelet names a cgroup (.../kubepods/burstable/pod<UID>/...,
#: .../kubepods-burstable-pod<UID with _ for ->.slice/..., cgroupfs and systemd drivers) or the
#: source of a mount (/var/lib/kubelet/pods/<UID>/etc-hosts, the root of the pod's /etc/hosts).
_POD_UID = re.compile(r"(?:kubepods\S*?[/-]pod|/pods/)"
                      r"([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
POD_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")  # hello's pod_uid
SLURM_JOB_ID = re.compile(r"^[0-9]{1,20}$")  # hello's slurm_job_id


def pod_uid_in(text: str) -> Optional[str]:
    """The pod UID in a /proc/PID/cgroup or /proc/PID/mountinfo text, or None outside Kubernetes."""
    found = _POD_UID.search(text)
    return found.group(1).replace("_", "-") if found else None


#: The inclusive range of every numeric hint the daemon reads (docs/protocol.md, "Hints"): a
#: model description feeds estimators whose work grows with it (10**7 layers once cost the daemon
#: 15 s and 1.2 GB). A hint outside its range, or any NaN or infinite hint, is dropped: the client
#: does not send it and a daemon ignores it, and says so once in its log.
HINT_RANGES = {
    "num_workers": (0, 1024), "prefetch_factor": (1, 1024),
    "fixed_bytes": (0, MAX_BYTES), "per_sample_bytes": (1, MAX_BYTES),
    "layers": (1, 4096), "d_model": (1, 2 ** 17), "heads": (1, 4096), "vocab": (1, 2 ** 24),
    "seq_len": (1, 2 ** 24), "positions": (1, 2 ** 24),
    "params": (1, 10 ** 15), "trainable_params": (1, 10 ** 15), "zero_stage": (0, 3), "gpus": (1, MAX_RANKS),
}


def hint_problem(name: str, value: Any) -> Optional[str]:
    """Why a hint must be dropped (its range, or not finite), or None to keep it. A value of the
    wrong type is kept: the estimators refuse it themselves, and it costs them nothing."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if name in HINT_RANGES:
        low, high = HINT_RANGES[name]
        if not low <= value <= high:
            return "hint %s must be in [%d, %d], not %r" % (name, low, high, value)
    elif value != value or not -2 ** 63 <= value < 2 ** 63:  # NaN, an infinity, or beyond msgpack
        return "hint %s must be a finite number within 2**63, not %r" % (name, value)
    return None

# Error codes (docs/protocol.md has a sentence on each).
BAD_REQUEST = "bad_request"  # not a msgpack map, or framing we cannot read
TOO_LARGE = "too_large"
UNSUPPORTED_VERSION = "unsupported_version"
UNKNOWN_OP = "unknown_op"
INVALID = "invalid"  # a field is missing, of the wrong type or out of range
UNKNOWN_SESSION = "unknown_session"  # no session holds that token (expired, or daemon restarted)
TOO_MANY_SESSIONS = "too_many_sessions"
INTERNAL = "internal"

def encode(message: Dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


def decode(data: bytes) -> Any:
    """Decode one message; raises ValueError on anything that is not a single msgpack object.

    Limits keep a hostile message from making the decoder allocate much.
    """
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_MESSAGE_BYTES,
            max_bin_len=MAX_MESSAGE_BYTES,
            max_array_len=4096,
            max_map_len=4096,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ValueError("not a msgpack message: %s" % exc) from None


def request(op: str, request_id: int, **fields: Any) -> Dict[str, Any]:
    message = {"v": VERSION, "op": op, "id": request_id}
    message.update(fields)
    return message
