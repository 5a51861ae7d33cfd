"""The one reader of ``/proc/PID/stat`` lines, shared by both ends (plain Python: the daemon's
process sampler and the client's hello, which tells the daemon its own start time).

The command name sits in parentheses and may itself hold spaces and parentheses: the fields are
counted from the last ``)``, as proc(5) numbers them (state is field 3, ppid 4, utime 14, stime
15, starttime 22).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional


class ProcStat(NamedTuple):
    name: str
    ppid: int
    cpu_ticks: Optional[int]  # user + system time, in clock ticks; None when the line is cut short
    start_time: Optional[int]  # clock ticks after boot; with the pid, names a process across pid reuse


def parse_stat(text: str) -> ProcStat:
    """The fields memd reads; raises ValueError when ``text`` is no stat line (no name, no ppid)."""
    close = text.rindex(")")
    name = text[text.index("(") + 1:close]
    fields = text[close + 2:].split()
    try:
        ppid = int(fields[1])
    except IndexError:
        raise ValueError("no ppid in the stat line") from None
    return ProcStat(name, ppid, _ticks(fields, 11, 12), _ticks(fields, 19))


def _ticks(fields: List[str], *indices: int) -> Optional[int]:
    try:
        return sum(int(fields[i]) for i in indices)
    except (IndexError, ValueError):
        return None
