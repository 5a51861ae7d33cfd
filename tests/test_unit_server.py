"""The ROUTER loop (memd/server.py) on its own: handlers are small functions, the sockets real
(ipc under a temporary directory); no daemon. Each malformed message gets its own error code
and reaches no handler; binding refuses to steal a live socket and clears a stale one."""
import os
import socket as pysocket

import pytest
import zmq

from memd.client import protocol
from memd.config import ConfigError
from memd.ops import Invalid
from memd.server import Server
from memd.sessions import TooManySessions, UnknownSession


@pytest.fixture
def served(tmp_path):
    """A bound Server whose handlers record what reached them, and a DEALER connected to it."""
    calls = []

    def handler(result=None, exc=None):
        def handle(request):
            calls.append(request["op"])
            if exc is not None:
                raise exc
            return result

        return handle

    observed = []
    srv = Server("ipc://%s/memd.sock" % tmp_path, {
        "ping": handler({"pong": True}), "bye": handler(exc=UnknownSession("no session holds this token")),
        "hello": handler(exc=TooManySessions("2 sessions are open (max_sessions)")),
        "report": handler(exc=Invalid("batch_size is required"))},
        observe=lambda op, outcome, seconds: observed.append((op, outcome, seconds >= 0)))
    srv.bind()
    peer = srv.context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(srv.endpoint)
    srv.calls, srv.observed, srv.client = calls, observed, peer
    yield srv
    peer.close(0)
    srv.close()


def exchange(srv, *frames):
    srv.client.send_multipart(list(frames))
    assert srv.poll(2.0) == 1
    assert srv.client.poll(2000)
    return srv.client.recv_multipart()


def answer(srv, message):
    data = message if isinstance(message, bytes) else protocol.encode(message)
    reply, = exchange(srv, data)
    return protocol.decode(reply)


@pytest.mark.parametrize("message, code", [
    (b"\xc1", protocol.BAD_REQUEST),  # not msgpack
    ([1, 2], protocol.BAD_REQUEST),  # not a map
    ({"v": 1, "op": "ping", "id": "7"}, protocol.BAD_REQUEST),
    ({"v": 1, "op": "ping", "id": True}, protocol.BAD_REQUEST),
    ({"v": 2, "op": "ping", "id": 7}, protocol.UNSUPPORTED_VERSION),
    ({"v": 1, "id": 7}, protocol.INVALID),  # no op
    ({"v": 1, "op": 5, "id": 7}, protocol.INVALID),
    ({"v": 1, "op": "shutdown", "id": 7}, protocol.UNKNOWN_OP),
    ({"v": 1, "op": "ping", "id": 7, "pad": "x" * protocol.MAX_MESSAGE_BYTES}, protocol.TOO_LARGE),
])
def test_a_malformed_message_gets_its_code_and_reaches_no_handler(served, message, code):
    reply = answer(served, message)
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    assert reply["v"] == protocol.VERSION and reply["id"] == (7 if code in (
        protocol.UNSUPPORTED_VERSION, protocol.INVALID, protocol.UNKNOWN_OP) else None)
    assert served.calls == []
    assert served.observed == [("invalid", code, True)]  # counted, under no op's name


def test_what_a_handler_raises_maps_to_the_protocols_codes(served):
    outcomes = {}
    for op in ("ping", "bye", "hello", "report"):
        reply = answer(served, protocol.request(op, 3))
        outcomes[op] = reply["result"] if reply["ok"] else (reply["error"]["code"], reply["error"]["message"])
        assert reply["id"] == 3
    assert outcomes == {"ping": {"pong": True},
                        "bye": (protocol.UNKNOWN_SESSION, "no session holds this token"),
                        "hello": (protocol.TOO_MANY_SESSIONS, "2 sessions are open (max_sessions)"),
                        "report": (protocol.INVALID, "batch_size is required")}
    assert [(op, outcome) for op, outcome, _ in served.observed] == [
        ("ping", "ok"), ("bye", "unknown_session"), ("hello", "too_many_sessions"), ("report", "invalid")]


def test_a_req_socket_gets_its_delimiter_back_and_extra_frames_are_never_echoed(served):
    delimiter, body = exchange(served, b"", protocol.encode(protocol.request("ping", 1)))
    assert delimiter == b"" and protocol.decode(body)["result"] == {"pong": True}
    frames = exchange(served, b"a" * 1000, b"b", b"c", protocol.encode(protocol.request("ping", 2)))
    assert len(frames) == 1 and protocol.decode(frames[0])["error"]["code"] == protocol.BAD_REQUEST
    assert served.calls == ["ping"]


def test_bind_refuses_a_live_daemons_socket_and_a_file_and_clears_a_stale_socket(tmp_path):
    import threading

    live = Server("ipc://%s/live.sock" % tmp_path, {"ping": lambda request: {"pong": True}})
    live.bind()
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [live.poll(0.05) for _ in iter(stop.is_set, True)])
    thread.start()
    try:
        with pytest.raises(ConfigError, match="another memd answers there \\(--endpoint\\)"):
            Server(live.endpoint, {}).bind()
        assert (tmp_path / "live.sock").exists()  # left to the daemon that answers on it
    finally:
        stop.set()
        thread.join()
        live.close()
    path = tmp_path / "file.sock"
    path.write_text("")
    with pytest.raises(ConfigError, match="exists and is not a socket \\(--endpoint\\)"):
        Server("ipc://%s" % path, {}).bind()
    stale = tmp_path / "stale.sock"
    left = pysocket.socket(pysocket.AF_UNIX)
    left.bind(str(stale))  # a socket file nobody listens on: a daemon that did not stop cleanly
    left.close()
    srv = Server("ipc://%s" % stale, {"ping": lambda request: {"pong": True}}, socket_mode=0o600)
    srv.bind()
    assert os.stat(stale).st_mode & 0o777 == 0o600
    srv.close()
    assert not stale.exists()  # close removes its socket
