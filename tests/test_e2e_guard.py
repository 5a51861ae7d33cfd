"""Memory held for hostile peers, against the real daemon over real sockets (memd/guard.py):
a peer that sends frames of a message it never ends is cut off while a client beside it is
served, and connections beyond max_connections are shut down as they come. What the daemon
holds at the peak depends on timing (how far libzmq reads between two looks): measured by
bench/fuzz.py, not asserted here; what is asserted is that the stream is cut long before its
end and the daemon gives the memory back."""
import os
import threading
import time

import pytest
import zmq

import rawzmtp as zmtp
from memd.client import Session
from memd.guard import HEADROOM
from realdaemon import free_port, raw_socket, wait_for

FRAME = 200 * 1024  # under the daemon's frame cap (ZMQ_MAXMSGSIZE, 256 KiB)


def status_bytes(pid: int, key: str) -> int:
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(key)


def stream_forever(endpoint: str, limit_bytes: int) -> int:
    """Frames of one message that never ends, until the daemon hangs up (the bytes sent) or
    ``limit_bytes`` are sent (the daemon never did: AssertionError)."""
    sock = zmtp.connect(endpoint)
    chunk = zmtp.frame(b"x" * FRAME, more=True)
    sent = 0
    try:
        while sent < limit_bytes:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:  # EPIPE, ECONNRESET: cut off
        return sent
    finally:
        sock.close()
    raise AssertionError("the daemon took %d bytes of one unfinished message and never hung up" % sent)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_peer_streaming_an_endless_message_is_cut_off_and_a_client_beside_it_is_served(start_memd, transport):
    memd = start_memd(endpoint="tcp://127.0.0.1:%d" % free_port() if transport == "tcp" else None)
    pid = memd.proc.pid
    with Session("beside", endpoint=memd.endpoint, timeout=2.0, default_batch=8) as session:
        assert session.plan().source == "daemon"
        ready = status_bytes(pid, "VmRSS")
        served, stop = [], threading.Event()

        def client():  # a well-behaved client asking all along
            with raw_socket(memd.endpoint) as exchange:
                while not stop.is_set():
                    served.append(exchange(b'\x83\xa1v\x01\xa2op\xa4ping\xa2id\x07', timeout=5.0)["ok"])
                    time.sleep(0.005)

        thread = threading.Thread(target=client)
        thread.start()
        try:
            stream_forever(memd.endpoint, 1024 ** 3)  # cut long before 1 GiB (at ~50 MB here)
            stream_forever(memd.endpoint, 1024 ** 3)  # a peer may connect again: cut again
        finally:
            stop.set()
            thread.join()
        assert served and all(served)
        assert session.plan().source == "daemon"
        # libzmq dropped the unfinished messages and the heap gave them back
        assert wait_for(lambda: status_bytes(pid, "VmRSS") < ready + HEADROOM, timeout=5.0), \
            (status_bytes(pid, "VmRSS"), ready)
    assert memd.call("ping")["pong"] is True
    assert "connections_cut" in memd.log()


def test_a_message_of_many_frames_under_the_memory_limit_is_answered(memd):
    """The guard cuts only what holds memory past the limit: a small message of too many frames
    gets its error reply as before."""
    with raw_socket(memd.endpoint) as exchange:
        reply = exchange(b"a", *[b"b" * 1000] * 50)
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"


def socket_count(pid: int) -> int:
    """Sockets the process holds open (one each, however many descriptors name it)."""
    links = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            links.add(os.readlink("/proc/%d/fd/%s" % (pid, fd)))
        except FileNotFoundError:
            pass
    return sum(link.startswith("socket:") for link in links)


def test_connections_beyond_max_connections_are_shut_down_as_they_come(start_memd):
    memd = start_memd(env={"MEMD_MAX_CONNECTIONS": "4"})
    pid = memd.proc.pid
    assert wait_for(lambda: socket_count(pid) == 1)  # the listening socket: the ping that found it ready is gone
    ctx = zmq.Context()
    try:
        kept = []
        for _ in range(4):  # each served before the next connects: these are the oldest
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(memd.endpoint)
            sock.send(b'\x83\xa1v\x01\xa2op\xa4ping\xa2id\x07')
            assert sock.poll(5000)
            sock.recv()
            kept.append(sock)
        beyond = []
        for _ in range(6):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 60_000)  # cut once, it stays away: the count is exact
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(memd.endpoint)
            beyond.append((sock, monitor))
        for _, monitor in beyond:
            assert monitor.poll(5000), "a connection beyond max_connections was kept"
        assert wait_for(lambda: socket_count(pid) == 1 + 4), socket_count(pid)
        for sock in kept:  # the oldest are served still
            sock.send(b'\x83\xa1v\x01\xa2op\xa4ping\xa2id\x07')
            assert sock.poll(5000)
            sock.recv()
        for sock, monitor in beyond:
            sock.disable_monitor()
            monitor.close(0)
    finally:
        ctx.destroy(0)
    refused = [line for line in memd.log().splitlines() if "connection_refused" in line]
    assert len(refused) == 1, refused  # at most once a minute
