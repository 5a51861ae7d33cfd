"""`status` in pages, as `curves` is, against the real daemon: each reply within the protocol's
message cap however many sessions are open, every session shown once, and `memd status` follows
the pages."""
import json
import os
import socket

import pytest

from memd.client import Refused, call, protocol
from realdaemon import run_memd

SESSIONS = 200


def hello(memd, i):
    job = ("job-%03d-" % i).ljust(128, "x")  # the longest name a hello may carry
    return call("hello", endpoint=memd.endpoint, timeout=2.0, job=job, pid=os.getpid(), host=socket.gethostname(),
                min_batch=1, default_batch=4, hints={"layers": 12})["token"]


def test_status_pages_fit_a_message_and_show_every_session_once(memd):
    for i in range(SESSIONS):
        hello(memd, i)
    seen, entries, after, sizes = [], [], None, []
    while True:
        reply = memd.call("status", **({} if after is None else {"after": after}))
        sizes.append(len(protocol.encode({"v": 1, "id": 2 ** 63 - 1, "ok": True, "result": reply})))
        assert reply["total"] == SESSIONS and reply["sessions"] and reply["snapshot"]
        seen += [s["session"] for s in reply["sessions"]]
        entries += reply["sessions"]
        after = reply["next"]
        if after is None:
            break
    assert len(sizes) > 1 and max(sizes) <= protocol.MAX_MESSAGE_BYTES, sizes
    assert len(protocol.encode(entries)) > protocol.MAX_MESSAGE_BYTES  # all in one reply would not fit
    assert seen == sorted(seen) and len(set(seen)) == SESSIONS
    limited = memd.call("status", limit=7, after=seen[2])
    assert [s["session"] for s in limited["sessions"]] == seen[3:10] and limited["next"] == seen[9]
    out = run_memd(["status", "--json", "--endpoint", memd.endpoint])
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert [s["session"] for s in shown["sessions"]] == seen and shown["next"] is None
    human = run_memd(["status", "--endpoint", memd.endpoint])
    assert human.returncode == 0 and "sessions: %d" % SESSIONS in human.stdout, human.stderr


@pytest.mark.parametrize("fields, needle", [
    ({"after": "7"}, "after must be a session number"),
    ({"after": -1}, "after must be a session number"),
    ({"limit": 0}, "limit must be an integer in [1, 4096]"),
    ({"limit": 10 ** 6}, "limit must be an integer in [1, 4096]"),
])
def test_a_bad_cursor_or_limit_is_refused_naming_it(memd, fields, needle):
    with pytest.raises(Refused, match=needle.replace("[", r"\[").replace("]", r"\]")) as refused:
        memd.call("status", **fields)
    assert refused.value.code == protocol.INVALID
    assert memd.call("curves", limit=1)["next"] is None  # the same limit on `curves`
