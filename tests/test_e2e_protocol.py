"""Hostile and malformed traffic against the real daemon: every message gets an error reply
(when it can be routed), nothing changes, and the daemon keeps answering ping."""
import os
import socket
import time

import msgpack
import pytest
import zmq

from memd.client import protocol
from realdaemon import raw_socket


@pytest.fixture
def raw(memd):
    """A raw DEALER socket to the daemon, and a helper sending frames and reading one reply."""
    with raw_socket(memd.endpoint) as exchange:
        yield exchange


def request(op, **fields):
    return protocol.encode(protocol.request(op, 7, **fields))


def assert_alive(exchange):
    reply = exchange(request("ping"))
    assert reply["ok"] is True and reply["result"]["pong"] is True


@pytest.mark.parametrize("payload, code", [
    (b"\xc1garbage", protocol.BAD_REQUEST),  # 0xc1 is never valid msgpack
    (msgpack.packb({"v": 1, "op": "ping", "id": 7})[:-3], protocol.BAD_REQUEST),  # truncated
    (msgpack.packb([1, "ping", 7]), protocol.BAD_REQUEST),  # not a map
    (msgpack.packb({"v": 1, "op": "ping"}), protocol.BAD_REQUEST),  # no id
    (msgpack.packb({"v": 1, "op": "ping", "id": "7"}), protocol.BAD_REQUEST),  # id of the wrong type
    (msgpack.packb({"v": 2, "op": "ping", "id": 7}), protocol.UNSUPPORTED_VERSION),
    (msgpack.packb({"op": "ping", "id": 7}), protocol.UNSUPPORTED_VERSION),
    (msgpack.packb({"v": True, "op": "ping", "id": 7}), protocol.UNSUPPORTED_VERSION),  # was taken as 1
    (msgpack.packb({"v": 1.0, "op": "ping", "id": 7}), protocol.UNSUPPORTED_VERSION),
    (msgpack.packb({"v": 1, "op": "shutdown", "id": 7}), protocol.UNKNOWN_OP),
    (msgpack.packb({"v": 1, "op": 5, "id": 7}), protocol.INVALID),  # op of the wrong type
    (msgpack.packb({"v": 1, "op": [1], "id": 7}), protocol.INVALID),  # was internal, with a traceback logged each time
    (msgpack.packb({"v": 1, "id": 7}), protocol.INVALID),  # no op
    (msgpack.packb({"v": 1, "op": "hello", "id": 7}), protocol.INVALID),  # no job, pid, host
    (msgpack.packb({"v": 1, "op": "hello", "id": 7, "job": "j", "pid": "1", "host": "h"}), protocol.INVALID),
    (msgpack.packb({"v": 1, "op": "hello", "id": 7, "job": "j", "pid": 1, "host": "h", "min_batch": 0}),
     protocol.INVALID),
    (msgpack.packb({"v": 1, "op": "hello", "id": 7, "job": "j", "pid": 1, "host": "h", "hints": [1]}),
     protocol.INVALID),
    (msgpack.packb({"v": 1, "op": "hello", "id": 7, "job": "j", "pid": 1, "host": "h", "min_batch": 8,
                    "target_effective_batch": 4}), protocol.INVALID),
    (msgpack.packb({"v": 1, "op": "plan", "id": 7, "token": "forged"}), protocol.UNKNOWN_SESSION),
    (msgpack.packb({"v": 1, "op": "report", "id": 7, "token": 12}), protocol.UNKNOWN_SESSION),
    (msgpack.packb({"v": 1, "op": "bye", "id": 7, "token": 12}), protocol.INVALID),  # was "ok"
    (msgpack.packb({"v": 1, "op": "bye", "id": 7}), protocol.INVALID),
])
def test_malformed_requests_get_error_replies(raw, payload, code):
    reply = raw(payload)
    assert reply["ok"] is False
    assert reply["error"]["code"] == code
    assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
    assert_alive(raw)


def test_oversized_message_is_refused(raw):
    payload = protocol.encode(protocol.request("ping", 7, padding="x" * (protocol.MAX_MESSAGE_BYTES + 10)))
    reply = raw(payload)
    assert reply["error"]["code"] == protocol.TOO_LARGE
    assert_alive(raw)


def test_huge_message_is_dropped_and_daemon_survives(memd):
    """Beyond 4x the cap libzmq disconnects the sender: no reply, no memory held, daemon fine."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(memd.endpoint)
    sock.send(b"\x00" * (protocol.MAX_MESSAGE_BYTES * 8))
    assert not sock.poll(300, zmq.POLLIN)
    sock.close(0)
    ctx.term()
    assert memd.call("ping")["pong"] is True


def test_extra_frames_are_refused(raw):
    reply = raw(b"frame-one", request("ping"))
    assert reply["error"]["code"] == protocol.BAD_REQUEST
    assert_alive(raw)


def test_req_socket_envelope_is_supported(memd):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(memd.endpoint)
    sock.send(request("ping"))
    assert sock.poll(2000, zmq.POLLIN)
    assert msgpack.unpackb(sock.recv(), raw=False)["result"]["pong"] is True
    sock.close(0)
    ctx.term()


def test_bad_report_changes_nothing(raw, memd):
    hello = raw(request("hello", job="careful", pid=1, host="elsewhere", min_batch=2, max_batch=64))
    token = hello["result"]["token"]
    before = raw(request("plan", token=token))["result"]["plan"]
    for fields in ({"batch_size": "8"}, {"batch_size": 0}, {"batch_size": 8, "peak_bytes": -1},
                   {"batch_size": 8, "peak_bytes": 1.5}, {"batch_size": 8, "step_seconds": "fast"}):
        reply = raw(request("report", token=token, **fields))
        assert reply["error"]["code"] == protocol.INVALID, fields
    view = next(s for s in memd.call("status")["sessions"] if s["job"] == "careful")
    assert view["reports"] == 0 and view["latest_peak_bytes"] is None
    assert raw(request("plan", token=token))["result"]["plan"] == before
    # Only the token's holder can change the session; bye with a wrong token is a no-op.
    assert raw(request("bye", token="not-" + token))["ok"] is True
    assert any(s["job"] == "careful" for s in memd.call("status")["sessions"])
    assert raw(request("bye", token=token))["ok"] is True
    assert not any(s["job"] == "careful" for s in memd.call("status")["sessions"])


def test_status_never_reveals_tokens(raw, memd):
    token = raw(request("hello", job="secret", pid=1, host="elsewhere"))["result"]["token"]
    assert token not in repr(memd.call("status"))


def test_sessions_are_bounded(start_memd):
    memd = start_memd(env={"MEMD_MAX_SESSIONS": "3"})
    here = dict(pid=os.getpid(), host=socket.gethostname())  # sessions of this process: it lives on
    tokens = [memd.call("hello", job="j%d" % i, **here)["token"] for i in range(3)]
    assert len(set(tokens)) == 3
    from memd.client import DaemonUnavailable

    with pytest.raises(DaemonUnavailable, match="sessions"):
        memd.call("hello", job="one-too-many", **here)
    memd.call("bye", token=tokens[0])
    assert memd.call("hello", job="fits-again", **here)["token"]


def test_session_of_a_vanished_process_expires(memd):
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    import socket
    memd.call("hello", job="short-lived", pid=child.pid, host=socket.gethostname())
    assert any(s["job"] == "short-lived" for s in memd.call("status")["sessions"])
    child.kill()
    child.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(s["job"] == "short-lived" for s in memd.call("status")["sessions"]):
        time.sleep(0.05)
    assert not any(s["job"] == "short-lived" for s in memd.call("status")["sessions"])


HUGE = 2 ** 62  # accepted before fields had ranges: a hello with this target (and max_batch 64) took minutes


@pytest.mark.parametrize("fields, name", [
    ({"target_effective_batch": HUGE, "max_batch": 64}, "target_effective_batch"),
    ({"max_batch": HUGE}, "max_batch"),
    ({"default_batch": HUGE}, "default_batch"),
    ({"min_batch": HUGE, "target_effective_batch": HUGE}, "min_batch"),
    ({"pid": 2 ** 40}, "pid"),
    ({"rank": 2 ** 40}, "rank"),
    ({"rank": 4, "world_size": 4}, "rank"),
    ({"world_size": 2 ** 40}, "world_size"),
    ({"local_world_size": 0}, "local_world_size"),
    ({"cpus": float("nan")}, "cpus"),
    ({"cpus": float("inf")}, "cpus"),
])
def test_out_of_range_hello_fields_are_refused_at_once(raw, fields, name):
    hello = dict({"job": "j", "pid": 1, "host": "elsewhere"}, **fields)
    started = time.monotonic()
    reply = raw(request("hello", **hello), timeout=2.0)  # the daemon used to stall here for minutes
    assert time.monotonic() - started < 2.0
    assert reply["error"]["code"] == protocol.INVALID and reply["error"]["message"].startswith(name), reply
    assert_alive(raw)


def test_out_of_range_report_fields_are_refused(raw):
    hello = raw(request("hello", job="ranges", pid=1, host="elsewhere", target_effective_batch=2 ** 31 - 1))
    token = hello["result"]["token"]
    for fields, name in (({"batch_size": HUGE}, "batch_size"), ({"batch_size": 8, "peak_bytes": HUGE}, "peak_bytes"),
                         ({"batch_size": 8, "batch_bytes": 2 ** 51}, "batch_bytes"),
                         ({"batch_size": 8, "step": HUGE}, "step"),
                         ({"batch_size": 8, "step_seconds": float("nan")}, "step_seconds"),
                         ({"batch_size": 8, "step_seconds": float("inf")}, "step_seconds"),
                         ({"batch_size": 8, "peak_bytes": float("nan")}, "peak_bytes")):
        reply = raw(request("report", token=token, **fields))
        assert reply["error"]["code"] == protocol.INVALID and reply["error"]["message"].startswith(name), reply
    reply = raw(request("oom", token=token, batch_size=HUGE))
    assert reply["error"]["code"] == protocol.INVALID and reply["error"]["message"].startswith("batch_size")
    # The largest target accepted is still planned at once (a prime: only 1 and itself divide it).
    started = time.monotonic()
    plan = raw(request("report", token=token, batch_size=1, peak_bytes=10 ** 9))["result"]["plan"]
    assert time.monotonic() - started < 2.0 and plan["batch_size"] * plan["grad_accum_steps"] == 2 ** 31 - 1


def test_hints_beyond_any_model_are_ignored_at_once(raw, memd):
    """layers 10**7: 15 s and 1.2 GB of the daemon (measured) before hints had ranges."""
    hints = {"layers": 10 ** 7, "d_model": 768, "heads": 12, "vocab": 50257, "seq_len": 1024, "note": float("inf")}
    started = time.monotonic()
    reply = raw(request("hello", job="deep", pid=1, host="elsewhere", hints=hints), timeout=2.0)
    assert time.monotonic() - started < 2.0
    assert reply["ok"] is True and "prior" not in reply["result"]["plan"]["reason"]
    assert_alive(raw)
    deadline = time.monotonic() + 2
    while "hints_ignored" not in memd.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "hint layers must be in [1, 4096], not 10000000" in memd.log()


def test_a_non_string_op_is_invalid_and_logs_nothing(raw, memd):
    for _ in range(20):
        reply = raw(msgpack.packb({"v": 1, "op": [1], "id": 7}))
        assert reply["error"] == {"code": protocol.INVALID, "message": "op must be a string, not list"}
    assert_alive(raw)
    assert "Traceback" not in memd.log() and "handler_failed" not in memd.log()


def test_a_message_of_many_frames_is_dropped_not_echoed_nor_kept(memd):
    """ZMQ_MAXMSGSIZE caps a frame, not a message: 400 frames of 200 KiB were copied whole and
    echoed back (80 MB each way; the daemon peaked at 255 MiB and kept 64 MiB). Frames beyond
    the protocol's are dropped uncopied, the sender is told so in one frame, its heap is trimmed."""
    import psutil

    daemon = psutil.Process(memd.proc.pid)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(memd.endpoint)
    before = daemon.memory_info().rss
    junk = [b"\x00" * (64 * 1024)] * 49
    for _ in range(4):
        sock.send_multipart(junk + [request("ping")])
        assert sock.poll(2000, zmq.POLLIN)
        reply = sock.recv_multipart()
        assert len(reply) == 1  # the error alone, none of the 3 MiB sent
        error = msgpack.unpackb(reply[0], raw=False)["error"]
        assert error["code"] == protocol.BAD_REQUEST and "got 50 frames" in error["message"]
    sock.send(request("ping"))
    assert sock.poll(2000, zmq.POLLIN) and msgpack.unpackb(sock.recv(), raw=False)["result"]["pong"] is True
    assert daemon.memory_info().rss - before < 8 * 2 ** 20
    sock.close(0)
    ctx.term()
