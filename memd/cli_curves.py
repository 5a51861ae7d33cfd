"""`memd curves` and `memd forget`: what the daemon remembers for the jobs' next runs, and
how to make it forget some of it. Both talk to the running daemon (cli_call.py's flags).

Exit codes as every memd command: 1 when no daemon answers, 2 for a request it refused as bad
input; `memd forget` also exits 1 when nothing matched (grep's "not found"), and when the
daemon could not write its state file.
"""
from __future__ import annotations

import argparse
import json
import pwd
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from memd import cli_call
from memd.client import DaemonUnavailable, Refused, protocol
from memd.sessions import CLEAN_RUNS
from memd.units import GiB

WIDTH = 80  # `memd curves` fits a terminal of this many columns (a long job name aside)
LABEL = 12  # the field names' column


def add_parsers(sub, endpoint_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("curves", help="what the daemon remembers for each job and pool (curves, OOM ceilings)")
    endpoint_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_curves)

    p = sub.add_parser("forget", help="make the daemon forget what it learned for JOB")
    p.add_argument("job", metavar="JOB", help="the job name, as `memd curves` shows it")
    p.add_argument("--pool", metavar="P", help="only this pool key, as `memd curves` shows it")
    endpoint_args(p)
    p.set_defaults(run=_forget)


def fetch(ask: Callable[[Optional[List[str]]], Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every remembered curve, page after page: ``ask(after)`` is one `curves` request (a reply
    is bounded, see memd.curves). Raises DaemonUnavailable on a reply that does not advance."""
    return cli_call.follow(ask, "curves", _curve_cursor)["curves"]


def _curve_cursor(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)


def render(curves: List[Dict[str, Any]]) -> str:
    """`memd curves` for people: one block per job and pool, peaks in GiB by batch size (the
    points at one batch as their range and count), within WIDTH columns."""
    if not curves:
        return "memd remembers no curves yet\n"
    lines = ["memd remembers %d curve%s (`memd forget JOB` drops a job's)"
             % (len(curves), "" if len(curves) == 1 else "s")]
    for c in curves:
        ceiling = c.get("ceiling")
        lines += ["", c["job"],
                  _field("pool", c["pool"]),
                  _field("owner", _owner(c.get("owner"))),
                  _field("updated", time.strftime("%Y-%m-%d %H:%M", time.localtime(c["updated"]))),
                  _field("ceiling", "none" if ceiling is None else _ceiling(ceiling, c.get("clean_runs") or 0,
                                                                             c.get("ceiling_cause")))]
        lines += _wrapped("peak GiB", "at batch", _by_batch(c.get("points") or [])) or [_field("peak GiB", "no points")]
    return "\n".join(lines) + "\n"


def _owner(owner: Optional[str]) -> str:
    """"uid:1000" as the user's name where this machine knows it."""
    if owner is None:
        return "unknown (kept before curves had owners)"
    if owner.startswith("key:"):
        return "the client whose CURVE public key is %s" % owner[len("key:"):]
    uid = owner.partition(":")[2]
    try:
        return "%s (%s)" % (pwd.getpwuid(int(uid)).pw_name, owner)
    except (KeyError, ValueError):
        return owner


def _ceiling(ceiling: int, clean_runs: int, cause: Optional[str] = None) -> str:
    if cause == "kill":
        return "%d (kill: the kernel's OOM killer ended a run above it; kept until `memd forget`)" % ceiling
    left = max(1, CLEAN_RUNS - clean_runs)
    return "%d (out of memory above it; lifted after %d more clean run%s)" % (
        ceiling, left, "" if left == 1 else "s")


def _by_batch(points: List[List[int]]) -> List[str]:
    peaks: Dict[int, List[int]] = {}
    for batch, peak in points:
        peaks.setdefault(batch, []).append(peak)
    items = []
    for batch in sorted(peaks):
        low, high, n = min(peaks[batch]), max(peaks[batch]), len(peaks[batch])
        if _gib(low) == _gib(high):
            text = "%d: %s" % (batch, _gib(low))
        else:
            text = "%d: %s-%s" % (batch, _gib(low), _gib(high))
        items.append(text + (" (%d steps)" % n if n > 1 else ""))
    return items


def _field(name: str, value: str) -> str:
    return "  %-*s%s" % (LABEL - 2, name, value)


def _wrapped(name: str, lead: str, items: List[str]) -> List[str]:
    """``items`` after ``lead``, joined by commas, each whole on a line, lines within WIDTH."""
    if not items:
        return []
    lines, current = [], _field(name, lead)
    for i, item in enumerate(items):
        text = item + ("," if i < len(items) - 1 else "")
        if i and len(current) + 1 + len(text) > WIDTH:
            lines.append(current)
            current = " " * LABEL + text
        else:
            current += " " + text
    return lines + [current]


def _gib(value: int) -> str:
    return "%.2f" % (value / GiB)


def _curves(args: argparse.Namespace) -> int:
    try:
        curves = fetch(cli_call.asker("curves", args))
    except DaemonUnavailable as exc:
        return _unavailable(exc)
    if args.json:
        print(json.dumps(curves, indent=2))
    else:
        sys.stdout.write(render(curves))
    return 0


def _forget(args: argparse.Namespace) -> int:
    fields = {"job": args.job} if args.pool is None else {"job": args.job, "pool": args.pool}
    try:
        result = cli_call.call("forget", args, **fields)
    except DaemonUnavailable as exc:
        return _unavailable(exc)
    where = "job %s" % args.job if args.pool is None else "job %s in pool %s" % (args.job, args.pool)
    forgotten, sessions = result.get("forgotten", 0), result.get("sessions", 0)
    if not forgotten and not sessions:
        print("memd: nothing remembered for %s (`memd curves` lists what is)" % where, file=sys.stderr)
        return 1
    line = "forgot %d curve%s of %s" % (forgotten, "" if forgotten == 1 else "s", where)
    if sessions:
        line += "; %d live session%s of it will keep nothing learned before now" % (
            sessions, "" if sessions == 1 else "s")
    print(line)
    if result.get("saved") is False:
        print("memd: but the daemon could not write its state file (its log says why); it retries at its next "
              "flush", file=sys.stderr)
        return 1
    return 0


def _unavailable(exc: DaemonUnavailable) -> int:
    if isinstance(exc, Refused):
        print("memd: %s" % exc, file=sys.stderr)
        return 2 if exc.code == protocol.INVALID else 1
    print("memd: %s (is `memd serve` running? --endpoint picks another)" % exc, file=sys.stderr)
    return 1
