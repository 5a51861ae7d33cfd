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
