"""Fuzz the real daemon with malformed and hostile messages while a well-formed client is served.

    python bench/fuzz.py [--frames 1000000 | --seconds S] [--seed 1] [--transports ipc,tcp]
                         [--probe-timeout 0.05] [--json PATH] [--markdown PATH]

Starts `memd serve` once per transport (ipc:// in a throwaway directory, tcp://127.0.0.1) and
sends it messages of every shape over real sockets, three DEALERs and a REQ: random bytes,
truncated and oversized msgpack, a wrong type or an out-of-range number (huge, negative, NaN,
infinite) in every field of every op, hostile strings, nested and oversized structures, extra,
empty and many frames, frames over libzmq's cap, unknown ops and versions; and requests that are
well formed but hostile: hello floods that fill every session slot, claims on other processes,
reports and OOMs with tokens other sessions were given, forged tokens, forget and status floods,
status asked by two peers that never read the replies.
Messages are the frames counted. A final stage ("bulk") sends messages of many large frames,
which libzmq holds whole before the daemon sees them, each on a connection of its own, 32 at
once: each is answered, or its connection is shut down by the daemon's guard while libzmq holds
it past the daemon's memory limit (memd/guard.py; the sender's monitor sees the disconnection,
counted "cut off"). Its memory is reported apart.

Throughout, a probe in a process of its own (so the fuzzer never holds its GIL) pings the daemon
and asks a memd.client.Session for a plan every 20 ms: the ping's latency is the daemon's stall,
the Session must be served by the daemon (not its fallback) within its timeout. The daemon's own
request histogram (its metrics endpoint) says how many requests it took long over itself, apart
from the machine's scheduling of the probe. The daemon's RSS is read from /proc/PID/status.
Pass: the frames asked for sent, 0 crashes, every message answered (but those libzmq drops), no
`internal` error, RSS under 100 MB, no stall over 100 ms, no probe failure. Exits 1 when one
fails; the summary says which.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import math
import multiprocessing
import os
import random
import socket
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msgpack  # noqa: E402
import zmq  # noqa: E402
from memdproc import MemdProcess, commit, machine, percentiles, publish  # noqa: E402

from memd.client import DaemonUnavailable, Refused, call, protocol  # noqa: E402

MB = 10 ** 6
RSS_LIMIT, STALL_LIMIT = 100 * MB, 0.100  # the criteria: bytes, seconds
IN_FLIGHT = 32  # per DEALER: below the daemon's RCVHWM (64), so its queue never refuses us
REPLY_WAIT = 5.0  # seconds without a reply after which the messages in flight count as unanswered
FRAME_CAP = protocol.MAX_MESSAGE_BYTES * 4  # the daemon's ZMQ_MAXMSGSIZE

# Every op's fields and their kind: "int" and "number" take their range from FIELD_RANGES,
# strN is a string of at most N characters.
OP_FIELDS: Dict[str, Dict[str, str]] = {
    "hello": {"job": "str128", "pid": "int", "host": "str255", "pid_ns": "int", "start_time": "int",
              "min_batch": "int", "max_batch": "int", "default_batch": "int", "target_effective_batch": "int",
              "rank": "int", "local_rank": "int", "world_size": "int", "local_world_size": "int",
              "cpus": "number", "device": "str64", "device_uuid": "str96", "cuda_visible_devices": "str256",
              "nonce": "nonce", "hints": "hints"},
    "plan": {"token": "token"},
    "report": {"token": "token", "batch_size": "int", "peak_bytes": "int", "base_bytes": "int", "batch_bytes": "int",
               "step": "int", "step_seconds": "number", "loader_workers": "int"},
    "oom": {"token": "token", "batch_size": "int"},
    "bye": {"token": "token"},
    "status": {"after": "cursor", "limit": "int"}, "ping": {},
    "curves": {"after": "after", "limit": "int"},
    "forget": {"job": "str128", "pool": "str512"},
}
REQUIRED = {"hello": ("job", "pid", "host"), "plan": ("token",), "report": ("token", "batch_size"),
            "oom": ("token", "batch_size"), "bye": ("token",), "forget": ("job",)}
assert set(OP_FIELDS) == set(protocol.OPS)
assert {f for fields in OP_FIELDS.values() for f, k in fields.items() if k in ("int", "number")} \
    == set(protocol.FIELD_RANGES)

FAKE_UUIDS = ("GPU-11111111-aaaa", "GPU-22222222-bbbb")
FAKE_GPUS = """driver 550.54.15
gpu %s total=80GiB used=10GiB reserved=512MiB util=40 name=NVIDIA H100 80GB HBM3
gpu %s total=80GiB used=30GiB reserved=512MiB util=90 name=NVIDIA H100 80GB HBM3
proc %s {pid} 20GiB
""" % (FAKE_UUIDS + FAKE_UUIDS[1:])
JOBS = ("llama-ft", "train.py", "bench-victim", "a|b", "x" * 128, "ünïcödé-job", "job\nwith\nnewlines")
NOT_INTS = ("7", b"\x07", [7], {"n": 7}, 7.5, True, False, {"a": {"b": {"c": [1, [2, [3]]]}}}, "", [])
HOSTILE_NUMBERS = (-1, 0, -2 ** 63, 2 ** 64 - 1, 2 ** 63, 2 ** 53 + 1, 2 ** 31, 2 ** 32, 10 ** 18, 1e308, -1e308,
                   float("nan"), float("inf"), float("-inf"))  # those in a field's range are left out
HOSTILE_STRINGS = ("", "cuda:²", "cuda:-1", "cuda:99999999999999999999", "cuda:", "cpu:0", "GPU-", "MIG-",
                   ",,,", "²,¹", "0," * 100, "\x00" * 10, "|", "a|b|c", "\u202e" * 10, "😀" * 64, "../" * 30,
                   "%s%n%x" * 10, "\\" * 100)


class Forge:
    """Builds the messages: ``next()`` gives (kind, frames). Holds what the hostile hellos got back
    (tokens, which any peer may then use) and the seeded random source: a seed repeats the same
    kinds and shapes in the same order; the tokens in them are those the daemon handed out."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.tokens: List[str] = []  # handed to hostile hellos; used by others (stolen_token)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.padding = b"x" * FRAME_CAP  # sliced, not rebuilt, for the large kinds
        self.kinds = {  # name: (weight, builder)
            "random_bytes": (6, self.random_bytes), "truncated": (6, self.truncated),
            "too_large": (1, self.too_large), "wrong_type": (10, self.wrong_type),
            "out_of_range": (10, self.out_of_range), "hostile_strings": (5, self.hostile_strings),
            "nested": (5, self.nested), "hostile_hints": (4, self.hostile_hints),
            "bad_envelope": (6, self.bad_envelope), "extra_frames": (4, self.extra_frames),
            "empty_frames": (2, self.empty_frames), "many_frames": (1, self.many_frames),
            "hello_flood": (8, self.hello_flood), "stolen_token": (8, self.stolen_token),
            "forged_token": (4, self.forged_token), "valid_ops": (4, self.valid_ops),
        }
        self._names = list(self.kinds)
        self._weights = list(itertools.accumulate(w for w, _ in self.kinds.values()))

    def next(self) -> Tuple[str, List[bytes]]:
        kind = self.rng.choices(self._names, cum_weights=self._weights)[0]
        return kind, self.kinds[kind][1]()

    def took(self, reply: Dict[str, Any]) -> None:
        """Keep the token a hostile hello was given (at most 512, the newest)."""
        result = reply.get("result")
        if reply.get("ok") and isinstance(result, dict) and isinstance(result.get("token"), str):
            self.tokens.append(result["token"])
            del self.tokens[:-512]

    # -- well-formed requests ---------------------------------------------------------------

    def valid(self, op: str) -> Dict[str, Any]:
        """A well-formed request of ``op``: its required fields and a random half of the others."""
        fields = {name: self.value(op, name) for name in OP_FIELDS[op]
                  if name in REQUIRED.get(op, ()) or self.rng.random() < 0.5}
        return protocol.request(op, self.rng.randrange(2 ** 31), **fields)

    def value(self, op: str, name: str) -> Any:
        kind, rng = OP_FIELDS[op][name], self.rng
        if name == "pid":  # itself, init (whose peak a root daemon would reset), or none there is
            return rng.choice((self.pid, 1, rng.randrange(2 ** 22 + 1, 2 ** 32)))
        if name == "host":
            return rng.choice((self.host, "fuzz-%d" % rng.randrange(1000)))
        if name in ("min_batch", "rank", "local_rank"):  # the lowest, so that max_batch and world_size fit
            return protocol.FIELD_RANGES[name][0]
        if name == "token":
            held, forged = self.held(), self.forged()
            return held if held and rng.random() < 0.8 else forged
        if name == "job":
            return rng.choice(JOBS)
        if kind in ("int", "number"):
            low, high = protocol.FIELD_RANGES[name]
            return rng.choice((low, high, rng.randint(low, min(high, 10 ** 6))))
        if name == "device":
            return rng.choice(("cuda:0", "cuda:1", "cuda", "cpu", "mps", "cuda:7"))
        if name == "device_uuid":  # the fake driver's (--fake-gpus), a prefix of one, or none there is
            return rng.choice(FAKE_UUIDS + ("GPU-1111", "MIG-%08x" % rng.getrandbits(32)))
        if name == "cuda_visible_devices":
            return rng.choice(("0", "1", "1,0", "GPU-2222", "MIG-1", "0,1,2,3"))
        if kind == "nonce":
            return "%016x" % rng.getrandbits(64)
        if kind == "hints":
            return {"num_workers": rng.randrange(9), "fixed_bytes": rng.randrange(2 ** 40)}
        if kind == "after":
            return [rng.choice(JOBS), "cpu:%d" % rng.randrange(64)]
        if kind == "cursor":  # status's: a session number
            return rng.randrange(2 ** 20)
        return "%s-%d" % (name, rng.randrange(100))  # a plain string within its limit

    def held(self) -> Optional[str]:
        """One of the tokens hostile hellos got, or None. Draws from the random source the same
        whatever their number (which depends on timing), so a seed repeats the same messages."""
        at = self.rng.random()
        return self.tokens[int(at * len(self.tokens))] if self.tokens else None

    def forged(self) -> str:
        return "".join(self.rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
                       for _ in range(24))

    # -- malformed -------------------------------------------------------------------------

    def random_bytes(self) -> List[bytes]:
        return [self.rng.randbytes(self.rng.randrange(300))]

    def truncated(self) -> List[bytes]:
        data = _pack(self.valid(self.rng.choice(protocol.OPS)))
        return [data[:self.rng.randrange(1, len(data))]]

    def too_large(self) -> List[bytes]:
        """Over MAX_MESSAGE_BYTES, within the frame cap: valid msgpack the daemon must not decode."""
        size = self.rng.randrange(protocol.MAX_MESSAGE_BYTES + 1, FRAME_CAP - 64)
        return [_pack(dict(self.valid("ping"), pad=self.padding[:size]))]

    def wrong_type(self) -> List[bytes]:
        op = self.rng.choice(protocol.OPS)
        message = self.valid(op)
        name = self.rng.choice(list(OP_FIELDS[op]) + ["v", "op", "id"])
        message[name] = self.rng.choice([v for v in NOT_INTS if type(v) is not type(message.get(name))])
        return [_pack(message)]

    def out_of_range(self) -> List[bytes]:
        """A number outside its field's range (or not finite): always refused."""
        op = self.rng.choice([op for op, fields in OP_FIELDS.items() if "int" in fields.values()])
        message = self.valid(op)
        name = self.rng.choice([n for n, k in OP_FIELDS[op].items() if k in ("int", "number")])
        low, high = protocol.FIELD_RANGES[name]
        message[name] = self.rng.choice([v for v in HOSTILE_NUMBERS + (low - 1, high + 1)
                                         if not low <= v <= high and (isinstance(v, float) or -2 ** 63 <= v < 2 ** 64)])
        return [_pack(message)]

    def hostile_strings(self) -> List[bytes]:
        op = self.rng.choice(("hello", "forget", "curves", "plan", "bye"))
        message = self.valid(op)
        name = self.rng.choice([n for n, k in OP_FIELDS[op].items() if k.startswith("str") or k in ("token", "nonce")]
                               or ["after"])
        value = self.rng.choice(HOSTILE_STRINGS + ("y" * self.rng.choice((129, 256, 513, 5000)),))
        message[name] = [value, value] if name == "after" else value
        return [_pack(message)]

    def nested(self) -> List[bytes]:
        depth = self.rng.choice((10, 100, 1000, 5000, 20000))
        shapes = (
            b"\x91" * depth + b"\xc0",  # arrays in arrays
            b"\x81\xa1a" * depth + b"\xc0",  # maps in maps
            _pack({"v": 1, "op": "ping", "id": 1, "x": _deep(min(depth, 100))}),  # an extra field, deep
            _pack(dict(self.valid("hello"), hints=_deep(5))),
            _pack({1: "int key", "v": 1}),  # strict_map_key refuses
            _pack({"k%d" % i: i for i in range(4097)}),  # beyond max_map_len
            _pack(list(range(5000))),  # beyond max_array_len, and not a map
            msgpack.packb(msgpack.ExtType(1, b"x" * 8)),  # ext types are refused
            _pack(self.rng.choice((1, "ping", None, [], 1.5, b"bin"))),  # not a map
            _pack({"v": 1, "op": "report", "id": 1, "token": {"$ne": None}, "batch_size": [1] * 4000}),
        )
        return [self.rng.choice(shapes)]

    def hostile_hints(self) -> List[bytes]:
        rng = self.rng
        hints = rng.choice((
            {"layers": 10 ** 7, "d_model": 2 ** 40, "heads": 0, "vocab": -1, "seq_len": float("nan")},
            {"num_workers": 10 ** 12, "prefetch_factor": 0, "zero_stage": 99, "gpus": 2 ** 40},
            {"params": 10 ** 18, "trainable_params": float("inf"), "per_sample_bytes": 0, "fixed_bytes": 2 ** 62},
            {"h%d" % i: i for i in range(65)},  # over 64 hints
            {"nested": {"a": 1}}, {"list": [1, 2]}, {"bin": b"\x00" * 100},
            {"custom": 2 ** 64 - 1}, {"custom": -2 ** 63}, {"custom": 1e308},
            {"num_workers": True, "prefetch_factor": "2", "layers": 2.5},
        ))
        return [_pack(dict(self.valid("hello"), hints=hints))]

    def bad_envelope(self) -> List[bytes]:
        rng = self.rng
        message = self.valid(rng.choice(protocol.OPS))
        what = rng.randrange(4)
        if what == 0:
            message["op"] = rng.choice(("", "HELLO", "hello ", "__init__", "eval", "x" * 10000, "\x00", "status\x00"))
        elif what == 1:
            message["v"] = rng.choice((0, 2, -1, 2 ** 64 - 1, "1", None, 1.5, [1]))
        elif what == 2:
            message["id"] = rng.choice((None, "1", 1.5, True, [1], 2 ** 64 - 1, -2 ** 63))
        else:
            del message[rng.choice(("v", "op", "id"))]
        return [_pack(message)]

    # -- framing -----------------------------------------------------------------------------

    def extra_frames(self) -> List[bytes]:
        body = _pack(self.valid(self.rng.choice(protocol.OPS)))
        return [self.rng.choice((body, b"", b"junk")) for _ in range(self.rng.randrange(2, 5))]

    def empty_frames(self) -> List[bytes]:
        return self.rng.choice(([b""], [b"", b""], [b"", _pack(self.valid("ping"))], [b""] * 3))

    def many_frames(self) -> List[bytes]:
        return [self.rng.randbytes(self.rng.randrange(64)) for _ in range(self.rng.randrange(5, 200))]

    def overframe(self) -> List[bytes]:
        """A frame over ZMQ_MAXMSGSIZE: libzmq closes the connection, no reply."""
        return [self.padding[:FRAME_CAP] + b"!!"]

    def bulk(self) -> List[bytes]:
        """Many frames just under the cap: libzmq holds the whole message before memd sees it."""
        size = self.rng.randrange(64 * 1024, 200 * 1024)
        return [_pack(self.valid("ping"))] + [self.padding[:size]] * self.rng.randrange(10, 400)

    # -- well formed, hostile ------------------------------------------------------------------

    def hello_flood(self) -> List[bytes]:
        return [_pack(self.valid("hello"))]

    def stolen_token(self) -> List[bytes]:
        """A token another peer was given: any peer holding it may act as that session."""
        message = self.valid(self.rng.choice(("report", "report", "oom", "plan", "bye")))
        message["token"] = self.held() or message["token"]
        return [_pack(message)]

    def forged_token(self) -> List[bytes]:
        return [_pack(dict(self.valid(self.rng.choice(("plan", "report", "oom", "bye"))), token=self.forged()))]

    def valid_ops(self) -> List[bytes]:
        return [_pack(self.valid(self.rng.choice(("status", "ping", "curves", "forget"))))]


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _deep(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = {"k": value} if i % 2 else [value]
    return value


# -- the sockets ------------------------------------------------------------------------------


class Peer:
    """One hostile socket. A DEALER keeps up to IN_FLIGHT messages in flight and matches replies
    to them in order (the daemon answers every message it reads, a peer's in the order sent); a
    REQ waits for each reply, and sends one frame (its delimiter added): the daemon answers a
    REQ's message of several frames to its identity alone, and libzmq's REQ neither takes that
    answer nor, once it gave up on it, reliably the next."""

    def __init__(self, ctx: zmq.Context, endpoint: str, kind: int):
        self.ctx, self.endpoint, self.kind = ctx, endpoint, kind
        self.sock: Optional[zmq.Socket] = None
        self.pending: collections.deque = collections.deque()
        self.waiting_since = 0.0
        self.reopen()

    def reopen(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self.ctx.socket(self.kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        self.pending.clear()

    def send(self, kind: str, frames: List[bytes], stats: "Stats", forge: Forge) -> None:
        if self.kind == zmq.DEALER and len(self.pending) >= IN_FLIGHT:
            self.collect(stats, forge, wait=True)
        self.sock.send_multipart(frames, copy=len(frames[0]) < 4096)
        stats.sent[kind] += 1
        stats.frames += len(frames)
        if not self.pending:
            self.waiting_since = time.monotonic()
        self.pending.append((kind, frames))
        if self.kind == zmq.REQ:
            self.collect(stats, forge, wait=True)

    def collect(self, stats: "Stats", forge: Forge, wait: bool = False) -> None:
        """Take the replies waiting; with ``wait``, at least one (or give up after REPLY_WAIT)."""
        while self.pending:
            if not self.sock.poll(REPLY_WAIT * 1000 if wait else 0, zmq.POLLIN):
                if wait or time.monotonic() - self.waiting_since > REPLY_WAIT:
                    stats.unanswered.update(kind for kind, _ in self.pending)
                    self.reopen()  # replies that come late would be matched to the wrong message
                return
            wait = False
            stats.answer(*self.pending.popleft(), self.sock.recv_multipart()[-1], forge)
            self.waiting_since = time.monotonic()


class Stats:
    def __init__(self):
        self.sent: collections.Counter = collections.Counter()
        self.frames = 0
        self.replies: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.unanswered: collections.Counter = collections.Counter()
        self.silent: collections.Counter = collections.Counter()  # no reply by design (libzmq drops, REQ)
        self.bad_replies = 0
        self.accepted: Dict[str, List[str]] = collections.defaultdict(list)  # malformed, answered ok
        self.rss: Dict[str, int] = {}  # stage: the largest VmRSS read
        self.hwm: Dict[str, int] = {}  # stage: VmHWM at its end (the largest RSS ever, so far)
        self.kept: Dict[str, int] = {}  # stage: VmRSS 1.5 s after its end
        self.crashes: List[Dict[str, Any]] = []
        self.probe: Dict[str, List] = {"ping": [], "plan": [], "failures": []}  # ping: (when, seconds)
        self.windows: List[Tuple[str, float, float]] = []  # (stage, from, to): the probe's pings by stage
        self.exit_codes: List[Optional[int]] = []
        self.tracebacks = 0
        self.late_hello: List[str] = []  # per transport: a new job's hello after the fuzzing
        self.slow: collections.Counter = collections.Counter()  # the daemon's own: requests over 10/50/250 ms

    def answer(self, kind: str, frames: List[bytes], data: bytes, forge: Forge) -> None:
        try:
            reply = msgpack.unpackb(data, raw=False)
            code = "ok" if reply["ok"] is True else reply["error"]["code"]
        except Exception:
            self.bad_replies += 1
            return
        self.replies[kind][code] += 1
        if kind == "hello_flood":
            forge.took(reply)
        elif code == "ok" and kind in MALFORMED and len(self.accepted[kind]) < 5:
            self.accepted[kind].append(_show(frames))  # for the reader to judge: lenient or wrong?


MALFORMED = ("wrong_type", "out_of_range", "hostile_strings", "nested", "hostile_hints", "bad_envelope")


def _show(frames: List[bytes], limit: int = 600) -> str:
    try:
        return repr([msgpack.unpackb(f, raw=False) if f else f for f in frames])[:limit]
    except Exception:
        return repr(frames)[:limit]


# -- the probe ------------------------------------------------------------------------------


def probe(endpoint: str, timeout: float, interval: float, stop) -> None:
    """The well-formed client, in its own process: every ``interval`` a ping on its own DEALER
    (waited for however long it takes: the stall) and a Session.plan() that must come from the
    daemon within ``timeout`` (the daemon's plans go stale at once, so each is a round trip),
    then a report. Sends {ping, plan, failures} back through ``stop`` when told to stop."""
    from memd.client import Session

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    session = Session("fuzz-probe", endpoint=endpoint, timeout=timeout, default_batch=32, max_batch=4096)
    while session.plan().source != "daemon":
        time.sleep(interval)
    stop.send("ready")
    out: Dict[str, List] = {"ping": [], "plan": [], "failures": []}
    n = 0
    while not stop.poll(interval):
        n += 1
        start = time.perf_counter()
        sock.send(protocol.encode(protocol.request("ping", n)))
        while sock.poll(30_000, zmq.POLLIN) and protocol.decode(sock.recv()).get("id") != n:
            pass
        out["ping"].append((time.time(), time.perf_counter() - start))
        start = time.perf_counter()
        plan = session.plan()
        took = time.perf_counter() - start
        out["plan"].append(took)
        if plan.source != "daemon" or took > timeout:
            out["failures"].append({"at": time.time(), "seconds": round(took, 4), "reason": plan.reason})
        session.report(batch_size=plan.batch_size, peak_bytes=2 ** 30 + plan.batch_size * 2 ** 20)
    session.close()
    sock.close(0)
    stop.send(out)


# -- a run ---------------------------------------------------------------------------------


def fake_gpus(directory: str) -> Dict[str, str]:
    """The environment under which the daemon sees two H100s through tests/fakenvml's driver
    (built with gcc), this process on the second: the GPU paths of hello and plan get fuzzed."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.fakenvml import build, env, write_config

    config = os.path.join(directory, "fakenvml.conf")
    write_config(config, FAKE_GPUS.format(pid=os.getpid()))
    return env(build(directory), config, {})


class Attack:
    """One daemon on one transport, the probe beside it, and the hostile sockets."""

    def __init__(self, transport: str, env: Dict[str, str], forge: Forge, stats: Stats, probe_timeout: float):
        self.forge, self.stats = forge, stats
        fresh = dict(env, MEMD_POLICY_PLAN_FRESH_SECONDS="0.001")  # each plan() of the probe a round trip
        self.daemon = MemdProcess(transport, env=fresh, metrics=True).start()
        endpoint = self.daemon.endpoint
        self.probe, there = multiprocessing.get_context("spawn").Pipe()
        self.prober = multiprocessing.get_context("spawn").Process(
            target=probe, args=(endpoint, probe_timeout, 0.02, there), daemon=True)
        self.prober.start()
        self.ctx = zmq.Context()
        self.peers = [Peer(self.ctx, endpoint, zmq.DEALER) for _ in range(3)] + [Peer(self.ctx, endpoint, zmq.REQ)]
        self.doomed = self.ctx.socket(zmq.DEALER)  # sends frames over the cap; its connection is closed each time
        self.doomed.setsockopt(zmq.LINGER, 0)
        self.doomed.connect(endpoint)
        self.deaf = []  # ask for status and never read the replies: the daemon queues them, up to its SNDHWM
        for _ in range(2):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(endpoint)
            self.deaf.append(sock)

    def wait_for_probe(self) -> None:
        """Until the probe's Session is open: the hello floods fill the table at once."""
        if not self.probe.poll(30) or self.probe.recv() != "ready":
            raise RuntimeError("the probe did not start")

    def stage(self, name: str, count: int, seconds: float, make) -> None:
        """``count`` messages from ``make()`` (or ``seconds``), then every reply, then the RSS."""
        deadline, sent, checked, began = time.monotonic() + seconds, 0, 0.0, time.time()
        while sent < count and time.monotonic() < deadline:
            kind, message = make()
            odds = self.forge.rng.random() if name == "mixed" else 1.0
            if odds < 0.0005:
                self.overframe()
            elif odds < 0.005:
                self.unread_status(sent)
            else:
                peer = self.peers[3] if sent % 8 == 7 and len(message) == 1 else self.peers[sent % 3]  # a REQ every 8th
                peer.send(kind, message, self.stats, self.forge)
                peer.collect(self.stats, self.forge)
            sent += 1
            if time.monotonic() - checked > 0.01:
                checked = time.monotonic()
                self.watch(name)
        for peer in self.peers:
            while peer.pending:
                peer.collect(self.stats, self.forge, wait=True)
        self.watch(name)
        self.stats.windows.append((name, began, time.time()))
        self.stats.hwm[name] = max(self.stats.hwm.get(name, 0), self.daemon.hwm_bytes() or 0)
        time.sleep(1.5)  # what the daemon keeps: it trims its heap at most once a second
        self.stats.kept[name] = max(self.stats.kept.get(name, 0), self.daemon.rss_bytes() or 0)

    def bulk(self, count: int) -> None:
        """``count`` messages of many large frames, each on a DEALER of its own, IN_FLIGHT at once;
        each ends answered or cut off (its connection shut down by the daemon), else unanswered."""
        began, sent, checked = time.time(), 0, 0.0
        open_: List[Tuple[zmq.Socket, zmq.Socket, List[bytes], float]] = []  # (sock, its monitor, frames, sent at)
        while sent < count or open_:
            while sent < count and len(open_) < IN_FLIGHT:
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                sock.connect(self.daemon.endpoint)
                frames = self.forge.bulk()
                sock.send_multipart(frames, copy=False)
                open_.append((sock, monitor, frames, time.monotonic()))
                self.stats.sent["bulk"] += 1
                self.stats.frames += len(frames)
                sent += 1
            poller = zmq.Poller()
            for sock, monitor, _, _ in open_:
                poller.register(sock, zmq.POLLIN)
                poller.register(monitor, zmq.POLLIN)
            ready = dict(poller.poll(100))
            for entry in list(open_):
                sock, monitor, frames, at = entry
                if sock in ready:
                    self.stats.answer("bulk", frames, sock.recv_multipart()[-1], self.forge)
                elif monitor in ready:
                    self.stats.silent["bulk"] += 1  # cut off: the daemon shut its connection down
                elif time.monotonic() - at > REPLY_WAIT:
                    self.stats.unanswered["bulk"] += 1
                else:
                    continue
                sock.disable_monitor()
                monitor.close(0)
                sock.close(0)
                open_.remove(entry)
            if time.monotonic() - checked > 0.01:
                checked = time.monotonic()
                self.watch("bulk")
        self.watch("bulk")
        self.stats.windows.append(("bulk", began, time.time()))
        self.stats.hwm["bulk"] = max(self.stats.hwm.get("bulk", 0), self.daemon.hwm_bytes() or 0)
        time.sleep(1.5)
        self.stats.kept["bulk"] = max(self.stats.kept.get("bulk", 0), self.daemon.rss_bytes() or 0)

    def overframe(self) -> None:
        try:
            self.doomed.send_multipart(self.forge.overframe(), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return  # still reconnecting after the last one
        self.stats.sent["overframe"] += 1
        self.stats.frames += 1
        self.stats.silent["overframe"] += 1

    def unread_status(self, n: int) -> None:
        try:
            self.deaf[n % 2].send(_pack(self.forge.valid("status")), zmq.NOBLOCK)
        except zmq.Again:
            return
        self.stats.sent["unread_status"] += 1
        self.stats.frames += 1
        self.stats.silent["unread_status"] += 1

    def watch(self, stage: str) -> None:
        """Read the daemon's RSS; if it died, count the crash (with the messages in flight, the
        culprit among them) and start it again."""
        stats, daemon = self.stats, self.daemon
        rss = daemon.rss_bytes()
        if rss is not None:
            stats.rss[stage] = max(stats.rss.get(stage, 0), rss)
        if not daemon.alive():
            stats.crashes.append({"stage": stage, "exit": daemon.proc.returncode, "log": daemon.log_tail(2000),
                                  "in_flight": [_show(f) for peer in self.peers for _, f in peer.pending]})
            for peer in self.peers:
                stats.unanswered.update(kind for kind, _ in peer.pending)
                peer.reopen()
            daemon.start()

    def late_hello(self) -> str:
        """What a job that starts after the fuzzing is told: the hello floods took every session
        slot for session_ttl (docs/security.md)."""
        try:
            call("hello", endpoint=self.daemon.endpoint, timeout=2.0, job="late-arrival", pid=os.getpid(),
                 host=socket.gethostname())
            return "ok"
        except Refused as exc:
            return exc.code
        except DaemonUnavailable:
            return "no reply"

    def close(self) -> None:
        self.probe.send("stop")
        if self.probe.poll(60):
            for name, values in self.probe.recv().items():
                self.stats.probe[name].extend(values)
        self.prober.join(5)
        for peer in self.peers:
            peer.sock.close(0)
        for sock in [self.doomed] + self.deaf:
            sock.close(0)
        self.ctx.term()
        self.stats.tracebacks += self.daemon.tracebacks()
        self.stats.slow.update(self.daemon.slow_requests() or {})
        self.stats.exit_codes.append(self.daemon.stop(remove=True))


def fuzz_transport(transport: str, frames: int, seconds: float, forge: Forge, stats: Stats,
                   probe_timeout: float, bulk: int, env: Dict[str, str]) -> None:
    """``frames`` mixed messages (or ``seconds``), then ``bulk`` messages of many large frames,
    the probe running throughout; then a new job's hello."""
    attack = Attack(transport, env, forge, stats, probe_timeout)
    try:
        attack.wait_for_probe()
        attack.stage("mixed", frames, seconds, forge.next)
        if bulk:
            attack.bulk(bulk)
        stats.late_hello.append(attack.late_hello())
    finally:
        attack.close()


def summary(stats: Stats, args, wall: float) -> Dict[str, Any]:
    codes = sum(stats.replies.values(), collections.Counter())
    sent = sum(stats.sent.values())
    mixed = sent - stats.sent["bulk"]
    stall, plan = percentiles([s for _, s in stats.probe["ping"]]), percentiles(stats.probe["plan"])
    stall_by_stage = {stage: percentiles([s for at, s in stats.probe["ping"] if any(
        name == stage and begin <= at <= end for name, begin, end in stats.windows)])
        for stage in sorted({name for name, _, _ in stats.windows})}
    checks = {
        "frames sent": mixed >= args.frames if args.seconds is None else True,
        "no crash": not stats.crashes and all(c == 0 for c in stats.exit_codes),
        "every message answered": not stats.unanswered and not stats.bad_replies,
        "no internal error": not codes["internal"] and not stats.tracebacks,
        "out-of-range numbers refused": not stats.replies["out_of_range"]["ok"],
        "RSS under 100 MB (mixed)": stats.hwm.get("mixed", 0) < RSS_LIMIT,
        "RSS under 100 MB (bulk)": stats.hwm.get("bulk", 0) < RSS_LIMIT,
        "no stall over 100 ms": stall["max"] is not None and stall["max"] <= STALL_LIMIT * 1e3,
        "probe always served": not stats.probe["failures"] and bool(stats.probe["plan"]),
    }
    return {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": machine(),
        "commit": commit(), "seed": args.seed, "transports": args.transports, "fake_gpus": args.fake_gpus,
        "wall_seconds": round(wall, 1), "messages_sent": sent, "mixed_messages_sent": mixed,
        "zmq_frames_sent": stats.frames, "messages_per_second": round(sent / wall),
        "sent_by_kind": dict(sorted(stats.sent.items())), "replies_by_code": dict(sorted(codes.items())),
        "replies_by_kind": {k: dict(sorted(v.items())) for k, v in sorted(stats.replies.items())},
        "no_reply_by_design": dict(stats.silent), "unanswered": dict(stats.unanswered),
        "bad_replies": stats.bad_replies, "malformed_accepted_examples": dict(stats.accepted),
        "crashes": stats.crashes, "exit_codes": stats.exit_codes, "tracebacks_logged": stats.tracebacks,
        "rss_max_bytes_sampled": dict(stats.rss), "rss_hwm_bytes": dict(stats.hwm),
        "rss_kept_bytes": dict(stats.kept), "stall_ms": stall, "stall_ms_by_stage": stall_by_stage,
        "daemon_requests_slower_than": dict(stats.slow),
        "probe_plan_ms": plan,
        "probe_timeout_ms": args.probe_timeout * 1e3, "probe_failures": len(stats.probe["failures"]),
        "probe_failure_examples": stats.probe["failures"][:5], "late_hello": stats.late_hello,
        "checks": checks, "passed": all(checks.values()),
    }


def markdown(s: Dict[str, Any]) -> str:
    def ms(p):
        return "p50 %s, p99 %s, max %s ms (n %d)" % (p["p50"], p["p99"], p["max"], p["n"])

    def mb(by_stage):  # the criterion's unit
        return ", ".join("%s %.1f MB" % (stage, b / MB) for stage, b in by_stage.items())

    def counts(counter):
        return ", ".join("%s %d" % kv for kv in counter.items())

    lines = ["# memd fuzz: %s" % ("passed" if s["passed"] else "FAILED"), "",
             "`%s` at %s on %s, %.0f s." % (s["command"], s["commit"], s["machine"], s["wall_seconds"]), "",
             "| check | |", "|---|---|"]
    lines += ["| %s | %s |" % (k, "pass" if v else "**fail**") for k, v in s["checks"].items()]
    lines += [
        "", "- messages: %d (%d mixed, %d bulk), %d ZeroMQ frames, %s/s" % (
            s["messages_sent"], s["mixed_messages_sent"], s["sent_by_kind"].get("bulk", 0), s["zmq_frames_sent"],
            s["messages_per_second"]),
        "- crashes: %d; exit codes %s; tracebacks logged: %d" % (
            len(s["crashes"]), s["exit_codes"], s["tracebacks_logged"]),
        "- RSS: sampled max %s; VmHWM after %s; 1.5 s later %s" % (
            mb(s["rss_max_bytes_sampled"]), mb(s["rss_hwm_bytes"]), mb(s["rss_kept_bytes"])),
        "- stall (the probe's ping): %s; %s" % (ms(s["stall_ms"]), "; ".join(
            "%s: %s" % (stage, ms(p)) for stage, p in s["stall_ms_by_stage"].items())),
        "- requests the daemon itself took longer over (its metrics): %s" % (
            counts(s["daemon_requests_slower_than"]) or "none"),
        "- probe Session.plan(): %s; failures %d (timeout %.0f ms)" % (
            ms(s["probe_plan_ms"]), s["probe_failures"], s["probe_timeout_ms"]),
        "- unanswered: %s; bad replies: %d" % (counts(s["unanswered"]) or 0, s["bad_replies"]),
        "- a new job's hello after the fuzzing: %s" % ", ".join(s["late_hello"]),
        "- replies by code: %s" % counts(s["replies_by_code"]),
        "", "| kind | sent | replies by code |", "|---|---|---|"]
    silent = {"bulk": "cut off", "overframe": "libzmq closes the connection", "unread_status": "never read"}
    lines += ["| %s | %d | %s |" % (kind, n, "; ".join(filter(None, (
        counts(s["replies_by_kind"].get(kind, {})),
        "no reply by design (%s) %d" % (silent.get(kind, "none"), s["no_reply_by_design"][kind])
        if s["no_reply_by_design"].get(kind) else ""))))
              for kind, n in s["sent_by_kind"].items()]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=1_000_000,
                        help="malformed messages in all, split over the transports")
    parser.add_argument("--seconds", type=float, help="stop after this long instead (split over transports)")
    parser.add_argument("--bulk", type=int, default=100, help="messages of many large frames, per transport")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--transports", default="ipc,tcp")
    parser.add_argument("--probe-timeout", type=float, default=0.05, help="the probe Session's timeout, seconds")
    parser.add_argument("--fake-gpus", action="store_true", help="the daemon sees two fake H100s (needs gcc)")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--markdown", help="write the markdown summary here (else stdout)")
    args = parser.parse_args(argv)
    transports = args.transports.split(",")
    forge, stats, start = Forge(args.seed), Stats(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="memd-fuzz-") as tmp:
        env = fake_gpus(tmp) if args.fake_gpus else {}
        for transport in transports:
            frames = args.frames // len(transports) if args.seconds is None else 1 << 62
            seconds = args.seconds / len(transports) if args.seconds is not None else math.inf
            fuzz_transport(transport, frames, seconds, forge, stats, args.probe_timeout, args.bulk, env)
    result = summary(stats, args, time.monotonic() - start)
    return publish(result, markdown(result), args.json, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
