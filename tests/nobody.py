"""Run a function as another user (nobody) in a forked child: how memd sees other users' jobs."""
import json
import os


def as_nobody(fn):
    """fn()'s JSON-able result, computed in a child that dropped root for uid/gid 65534."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, json.dumps(fn()).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        return json.loads(f.read())


class Flood:
    """nobody calling ``hello(i)`` for i in range(``count``) from one live process, which stays
    until closed: the sessions of a process that is gone are ended before any slot is refused.
    ``codes``: "ok" or the refusal's code, for each call."""

    def __init__(self, hello, count):
        from memd.client import Refused

        replies, self.hold = os.pipe(), os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(replies[0])
                os.close(self.hold[1])
                os.setgid(65534)
                os.setuid(65534)
                codes = []
                for i in range(count):
                    try:
                        hello(i)
                        codes.append("ok")
                    except Refused as exc:
                        codes.append(exc.code)
                os.write(replies[1], json.dumps(codes).encode() + b"\n")
                os.read(self.hold[0], 1)  # until the test closes it
            except BaseException as exc:
                os.write(replies[1], json.dumps(repr(exc)).encode() + b"\n")
            finally:
                os._exit(0)
        os.close(replies[1])
        os.close(self.hold[0])
        with os.fdopen(replies[0], "rb") as f:
            self.codes = json.loads(f.readline())

    def close(self):
        os.close(self.hold[1])
        os.waitpid(self.pid, 0)
