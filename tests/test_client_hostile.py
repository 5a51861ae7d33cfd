"""The real client against a hostile peer: a ROUTER that answers garbage. No memd answers like
this, so the peer is a few lines of pyzmq written here; the client under test is the real one."""
import threading
import time

import msgpack
import pytest
import zmq

from memd import client


def reply_with(make_reply):
    """A peer on a loopback port that answers every request with make_reply(request)."""
    ctx = zmq.Context()
    stop = threading.Event()
    ready = threading.Event()
    holder = {}

    def run():  # the socket lives and dies in this thread: zmq sockets are not thread-safe
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        holder["endpoint"] = "tcp://127.0.0.1:%d" % sock.bind_to_random_port("tcp://127.0.0.1")
        ready.set()
        while not stop.is_set():
            if sock.poll(20, zmq.POLLIN):
                frames = sock.recv_multipart()
                try:
                    request = msgpack.unpackb(frames[-1], raw=False)
                except Exception:
                    request = {}
                for payload in make_reply(request if isinstance(request, dict) else {}):
                    sock.send_multipart(frames[:-1] + [payload], zmq.NOBLOCK)
        sock.close(0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(5)

    def close():
        stop.set()
        thread.join(5)
        ctx.term()

    return holder["endpoint"], close


def ok(request, result):
    return msgpack.packb({"v": 1, "id": request.get("id"), "ok": True, "result": result})


GOOD_PLAN = {"batch_size": 8, "grad_accum_steps": 1, "effective_batch_size": 8, "num_workers": 0,
             "prefetch_factor": None, "throttle": False, "pressure": "ok", "reason": "r", "fresh_for": 1.0}

HOSTILE = {
    "not msgpack": lambda r: [b"\xc1\xc1\xc1"],
    "not a map": lambda r: [msgpack.packb([1, 2, 3])],
    "wrong id": lambda r: [msgpack.packb({"v": 1, "id": 999999, "ok": True,
                                          "result": {"token": "t", "plan": GOOD_PLAN}})],
    "ok without result": lambda r: [msgpack.packb({"v": 1, "id": r.get("id"), "ok": True})],
    "token of the wrong type": lambda r: [ok(r, {"token": 5, "plan": GOOD_PLAN})],
    "plan with a negative batch": lambda r: [ok(r, {"token": "t", "plan": dict(GOOD_PLAN, batch_size=-3)})],
    "plan with a string batch": lambda r: [ok(r, {"token": "t", "plan": dict(GOOD_PLAN, batch_size="8")})],
    "plan of unknown pressure": lambda r: [ok(r, {"token": "t", "plan": dict(GOOD_PLAN, pressure="doom")})],
    "error without a code": lambda r: [msgpack.packb({"v": 1, "id": r.get("id"), "ok": False, "error": "x"})],
    "a flood of junk": lambda r: [b"junk"] * 300,
    "silence": lambda r: [],
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_garbage_replies_give_a_fallback_within_the_timeout(name):
    endpoint, close = reply_with(HOSTILE[name])
    s = client.Session("hostile", endpoint=endpoint, timeout=0.1, default_batch=8, max_batch=32)
    try:
        expected = 8
        for _ in range(3):  # again and again: no exception, no hang, the caller's default
            started = time.monotonic()
            plan = s.plan()
            assert time.monotonic() - started < 0.5
            assert plan.source == "fallback" and plan.batch_size == expected, plan
            s.report(batch_size=expected, peak_bytes=10 ** 9)  # never raises either
            started = time.monotonic()
            s.report_oom(batch_size=expected)
            assert time.monotonic() - started < 0.5
            expected = expected * 3 // 4  # backed off locally, as the daemon would have
    finally:
        s.close()
        close()


def test_a_reply_that_carries_no_plan_gives_a_fallback():
    """A token but never a plan: plan() returned None here, and the training loop's plan.batch_size died."""
    endpoint, close = reply_with(lambda r: [ok(r, {"token": "t"})])
    s = client.Session("planless", endpoint=endpoint, timeout=0.1, default_batch=8)
    try:
        for _ in range(2):
            plan = s.plan()
            assert isinstance(plan, client.Plan) and plan.source == "fallback" and plan.batch_size == 8, plan
    finally:
        s.close()
        close()


def test_a_wellformed_reply_after_garbage_is_taken():
    replies = iter([[b"\xc1"], [b"junk"]])

    def answer(request):
        junk = next(replies, None)
        return junk if junk is not None else [ok(request, {"token": "t", "plan": GOOD_PLAN})]

    endpoint, close = reply_with(answer)
    try:
        with client.Session("recovering", endpoint=endpoint, timeout=0.2, default_batch=6) as s:
            plans = []
            for _ in range(40):
                plans.append(s.plan())
                if plans[-1].source == "daemon":
                    break
                time.sleep(0.05)
            assert plans[-1].source == "daemon" and plans[-1].batch_size == 8
    finally:
        close()


def test_a_stranger_on_the_socket_cannot_push_a_job_past_its_own_limits():
    """Whoever answers where the daemon should be steers the job's memory (another user can bind
    /tmp/memd-$UID first when XDG_RUNTIME_DIR is unset). The plan it hands out is kept to the
    job's own limits: batch within min/max (the effective batch kept), no more workers than the
    job asked for, served from cache for seconds, not the hour it claimed."""
    greedy = dict(GOOD_PLAN, batch_size=100000, effective_batch_size=100000, num_workers=64, prefetch_factor=8,
                  fresh_for=3600.0)
    endpoint, close = reply_with(lambda r: [ok(r, {"token": "t", "plan": greedy})])
    try:
        with client.Session("victim", endpoint=endpoint, timeout=0.2, max_batch=64, target_effective_batch=256,
                            num_workers=2) as s:
            plan = s.plan()
            assert plan.source == "daemon"
            assert (plan.batch_size, plan.grad_accum_steps, plan.effective_batch_size) == (64, 4, 256)
            assert (plan.num_workers, plan.prefetch_factor) == (2, 8) and plan.fresh_for == 10.0
            assert "the daemon's batch 100000 and 64 workers kept to this job's limits" in plan.reason
        with client.Session("tiny", endpoint=endpoint, timeout=0.2, min_batch=4, max_batch=100000) as s:
            assert s.plan().batch_size == 100000  # within its limits: taken as it came
    finally:
        close()


def test_a_socket_another_user_made_where_anyone_may_is_not_trusted(tmp_path):
    """With XDG_RUNTIME_DIR unset the per-user socket lives in /tmp/memd-$UID, and another user
    can make that directory first and answer as memd. Such a socket is refused with a clear
    reason (a fallback plan, an error from call()); one this user owns, or one made where only
    privilege could make it, is used. (The other user is uid 65534, nobody; the test runs as root.)"""
    import os

    if os.getuid() != 0:
        pytest.skip("making a directory another user owns needs root")
    public = tmp_path / "tmp"
    public.mkdir()
    public.chmod(0o1777)  # like /tmp
    squatted = public / "memd-0"
    squatted.mkdir()
    os.chown(squatted, 65534, 65534)
    endpoint = "ipc://%s/memd.sock" % squatted
    with client.Session("careful", endpoint=endpoint, timeout=0.1, default_batch=8) as s:
        plan = s.plan()
        assert plan.source == "fallback" and plan.batch_size == 8
        assert ("socket directory %s belongs to uid 65534, not to this user or root: not trusted" % squatted
                in plan.reason)
    with pytest.raises(client.DaemonUnavailable, match="not trusted"):
        client.call("ping", endpoint=endpoint)
    private = tmp_path / "run"
    private.mkdir(mode=0o755)  # like /run: only privilege makes a directory here
    service = private / "memd"
    service.mkdir()
    os.chown(service, 65534, 65534)
    with pytest.raises(client.DaemonUnavailable, match="no daemon socket"):  # trusted: looked for, not there
        client.call("ping", endpoint="ipc://%s/memd.sock" % service)
    assert client.protocol.stranger("ipc://%s/memd.sock" % public) is None  # nothing there yet
