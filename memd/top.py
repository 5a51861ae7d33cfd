"""`memd top`: what the screen shows, as a pure function of one ``status`` reply.

``frame`` turns a reply (plus the user and command of each pid, read locally) into lines of
styled segments; the terminal side (memd/top_screen.py) only draws them with curses, and
``render`` joins them into plain text for `--once` and pipes. So every row, column, sort order
and legend is tested without a terminal.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from memd.units import GiB

MIN_REASON = 10  # the reason column shrinks to this at 80 columns; it never vanishes

# A line is segments of (text, style); styles: "" plain, "title", "head", "sorted" (the sort
# column's header), "warn", "bad", "dim". The screen maps them to attributes; text ignores them.
Segment = Tuple[str, str]
Line = List[Segment]
Labels = Mapping[int, Tuple[str, str]]  # pid -> (user, command), where this host can tell


@dataclass(frozen=True)
class Sort:
    key: str
    title: str  # as the sessions' title line names it
    numeric: bool  # numbers sort largest first, names A to Z, until reversed
    orders: Tuple[str, str] = ("largest first", "smallest first")  # natural, reversed


SORTS: Tuple[Sort, ...] = (
    Sort("gpu", "GPU", False, ("ascending", "descending")),
    Sort("job", "JOB/COMMAND", False, ("A to Z", "Z to A")),
    Sort("pid", "PID", False, ("ascending", "descending")),
    Sort("memory", "PEAK/GPU GiB", True),
    Sort("batch", "BATCH", True),
    Sort("budget", "BUDGET", True),
    Sort("ooms", "OOMS", True),
)
SORT_KEYS = tuple(s.key for s in SORTS)


@dataclass(frozen=True)
class View:
    """What the person chose: the sort column, its order, whether the legend shows, and whether
    each session's whole reason shows on a line of its own (the column is cut to fit)."""
    sort: str = "gpu"
    reverse: bool = False  # against the column's natural order (largest first / A to Z)
    legend: bool = True
    reasons: bool = False

    def next_sort(self, step: int) -> "View":
        at = SORT_KEYS.index(self.sort) if self.sort in SORT_KEYS else 0
        return replace(self, sort=SORT_KEYS[(at + step) % len(SORT_KEYS)], reverse=False)

    @property
    def descending(self) -> bool:
        return _sort(self.sort).numeric != self.reverse

    def describe(self) -> str:
        s = _sort(self.sort)
        return "%s, %s" % (s.title, s.orders[self.reverse])


@dataclass(frozen=True)
class Frame:
    body: List[Line]  # scrolls when taller than the screen
    legend: List[Line]  # what the session columns mean: stays above the footer


LEGEND = (
    "JOB#N: rank N of a job",
    "GPU: its GPU row (I:N: MIG device N of GPU I)",
    "BATCH: planned<-last used",
    "ACCUM: gradient accumulation steps",
    "WORKERS: data loader workers (paused: loading paused, memory is short)",
    "PEAK: last step's peak GiB",
    "BUDGET: GiB it may use",
    "OOMS: out-of-memory errors",
)


def render(status: Dict[str, Any], width: int = 100, view: View = View(),
           labels: Optional[Labels] = None) -> str:
    """One frame as plain text (`memd top --once`, or a pipe), the legend under the sessions."""
    shown = frame(status, width, view, labels or {})
    lines = shown.body + ([[]] + shown.legend if shown.legend else [])
    return "\n".join(text(line)[:width].rstrip() for line in lines) + "\n"


def text(line: Line) -> str:
    return "".join(t for t, _ in line)


def frame(status: Dict[str, Any], width: int, view: View, labels: Labels) -> Frame:
    """What one screen shows: machine, GPUs with their processes, sessions, errors; the legend."""
    snap = status.get("snapshot") or {}
    sessions = status.get("sessions") or []
    gpus = snap.get("gpus") or []
    names = gpu_names(gpus)
    body: List[Line] = []
    body.extend(_machine(status, snap))
    if gpus:
        body.append([])
        body.extend(_gpus(gpus, sessions, view, labels))
    body.append([])
    body.extend(_sessions(sessions, names, width, view))
    errors = snap.get("errors") or []
    if errors:
        body.append([])
        body.extend([("! %s: %s" % (e.get("source"), _cut(e.get("message"), width - 10)), "bad")]
                    for e in errors[:5])
    legend = wrap(LEGEND, width, "dim") if sessions and view.legend else []
    return Frame(body, legend)


def gpu_labels(gpus: Sequence[Dict[str, Any]]) -> List[str]:
    """Each GPU row's label: its NVML index, "I:N" for MIG device N of GPU I (in NVML's order)."""
    labels: List[str] = []
    migs: Dict[Any, int] = {}
    for g in gpus:
        parent = g.get("mig_parent_uuid")
        if parent:
            migs[parent] = migs.get(parent, -1) + 1
            labels.append("%s:%d" % (g.get("index"), migs[parent]))
        else:
            labels.append(str(g.get("index")))
    return labels


def gpu_names(gpus: Sequence[Dict[str, Any]]) -> Dict[str, str]:
    """uuid -> its row's label, to name a session's GPU (its pool) as the GPU rows do."""
    return {g["uuid"]: label for g, label in zip(gpus, gpu_labels(gpus)) if g.get("uuid")}


def wrap(items: Sequence[str], width: int, style: str) -> List[Line]:
    """Items joined by two spaces into lines of at most ``width`` (an item too long is cut)."""
    lines: List[str] = []
    for item in items:
        if lines and len(lines[-1]) + 2 + len(item) <= width:
            lines[-1] += "  " + item
        else:
            lines.append(_cut(item, width))
    return [[(line, style)] for line in lines]


# ---- sections ----

def _machine(status: Dict[str, Any], snap: Dict[str, Any]) -> List[Line]:
    system = snap.get("system") or {}
    level = str(status.get("pressure_level", "?")).upper()
    lines: List[Line] = [[
        ("memd %s on %s  up %s  " % (status.get("version", "?"), status.get("host", "?"),
                                     _duration(status.get("uptime_seconds"))), "title"),
        ("pressure %s" % level, "bad" if level in ("HIGH", "CRITICAL") else "warn" if level == "MODERATE"
         else "title"),
        ("  memory %s" % snap.get("memory_model", "?"), "title")]]
    total, available = system.get("total_bytes"), system.get("available_bytes")
    if total:
        used = total - (available or 0)
        lines.append([("host  %s %s / %s GiB used, %s GiB available" % (
            _bar(used / total, 24), _gib(used), _gib(total), _gib(available)), "")])
    if system.get("swap_total_bytes"):
        lines.append([("swap  %s %s / %s GiB used" % (
            _bar(system["swap_used_bytes"] / system["swap_total_bytes"], 24), _gib(system["swap_used_bytes"]),
            _gib(system["swap_total_bytes"])), "")])
    psi = snap.get("pressure")
    if psi:
        lines.append([("psi   stalled some %s  full %s  (10 s / 60 s / 300 s)" % (
            "/".join("%.1f%%" % (100 * psi["some_avg%d" % s]) for s in (10, 60, 300)),
            "/".join("%.1f%%" % (100 * psi["full_avg%d" % s]) for s in (10, 60, 300))), "")])
    else:
        lines.append([("psi   not available on this kernel", "dim")])
    cg = snap.get("cgroup")
    if cg and cg.get("limit_bytes"):
        ws = cg.get("working_set_bytes") or cg.get("usage_bytes") or 0
        lines.append([("cgroup %s %s / %s GiB working set  %s" % (
            _bar(ws / cg["limit_bytes"], 24), _gib(ws), _gib(cg["limit_bytes"]), cg.get("path", "")), "")])
    return lines


_GPU_ROW = "%-4s %-24s %-23s %14s %5s"
Column = Tuple[str, int, str]  # title, width (negative: left-aligned; 0: the rest), sort key
_PROCESS_COLUMNS: Tuple[Column, ...] = (
    ("", 4, ""), ("PID", 7, "pid"), ("USER", -10, ""), ("GPU GiB", 7, "memory"), (" COMMAND", 0, "job"))
_SESSION_COLUMNS: Tuple[Column, ...] = (
    ("JOB", -12, "job"), ("PID", 7, "pid"), ("GPU", -4, "gpu"), ("BATCH", 8, "batch"), ("ACCUM", 5, ""),
    ("WORKERS", 8, ""), ("PEAK", 5, "memory"), ("BUDGET", 6, "budget"), ("OOMS", 4, "ooms"), ("REASON", 0, ""))


def _gpus(gpus: Sequence[Dict[str, Any]], sessions: Sequence[Dict[str, Any]], view: View,
          labels: Labels) -> List[Line]:
    jobs = {s.get("pid"): s.get("job") for s in sessions}
    lines: List[Line] = [[(_GPU_ROW % ("GPU", "NAME", "MEMORY USED", "USED/TOTAL GiB", "UTIL"), "head")],
                         _header(_PROCESS_COLUMNS, view)]
    for g, label in zip(gpus, gpu_labels(gpus)):
        name = _cut(g.get("name"), 24)
        if not g.get("healthy", True):
            lines.append([("%-4s %-24s " % (label, name), ""), ("UNHEALTHY: %s" % g.get("error"), "bad")])
            continue
        util = "-" if g.get("utilization") is None else "%d%%" % round(100 * g["utilization"])
        if g.get("unified") or not g.get("total_bytes"):
            lines.append([(_GPU_ROW % (label, name, "unified (host RAM)", "", util), "")])
        else:
            used = g.get("used_bytes") or 0
            lines.append([(_GPU_ROW % (label, name, _bar(used / g["total_bytes"], 16),
                                       "%s/%s" % (_gib(used), _gib(g["total_bytes"])), util), "")])
        procs = sorted(g.get("processes") or [], key=lambda p: p.get("pid") or 0)
        by_memory = view.sort not in ("pid", "job")  # the GPU's biggest first, unless memory is reversed
        procs.sort(key=lambda p: _process_key(p, view.sort, jobs, labels),
                   reverse=not (view.reverse and view.sort == "memory") if by_memory else view.descending)
        for p in procs:
            user, command = labels.get(p.get("pid") or 0, ("-", "-"))
            job = jobs.get(p.get("pid"))
            if job:
                command = "[%s] %s" % (job, command)
            lines.append([(_row(_PROCESS_COLUMNS, ("", p.get("pid"), user, _gib(p.get("used_bytes")),
                                                   " " + command)), "")])
    return lines


def _sessions(sessions: Sequence[Dict[str, Any]], names: Dict[str, str], width: int,
              view: View) -> List[Line]:
    if not sessions:
        return [[("SESSIONS 0", "title")]]
    lines: List[Line] = [[("SESSIONS %d" % len(sessions), "title"), ("  sorted by %s" % view.describe(), "dim")]]
    lines.append(_header(_SESSION_COLUMNS, view))
    rows = sorted(sessions, key=lambda s: (s.get("job") or "", s.get("rank") or 0, s.get("pid") or 0))
    rows.sort(key=lambda s: _session_key(s, view.sort, names), reverse=view.descending)
    for s in rows:
        plan = s.get("plan") or {}
        batch = "%s" % plan.get("batch_size", "-")
        if s.get("latest_batch") is not None and s.get("latest_batch") != plan.get("batch_size"):
            batch = "%s<-%s" % (plan.get("batch_size", "-"), s["latest_batch"])  # planned <- used
        job = s.get("job") or ""
        if s.get("rank") is not None:
            rank = "#%s" % s["rank"]
            job = _cut(job, 12 - len(rank)) + rank
        workers = "%s" % plan.get("num_workers", "-")
        if plan.get("throttle"):
            workers += " paused"
        row = _row(_SESSION_COLUMNS[:-1], (job, s.get("pid", ""), _gpu_of(s, names), batch,
                                           plan.get("grad_accum_steps", "-"), workers,
                                           _gib(s.get("latest_peak_bytes")), _gib(s.get("budget_bytes")),
                                           s.get("ooms", 0))) + " "
        reason = _cut(plan.get("reason", ""), max(MIN_REASON, width - len(row)))
        lines.append([(row, "warn" if plan.get("throttle") or s.get("ooms") else ""), (reason, "")])
        if view.reasons and plan.get("reason") and reason != plan["reason"]:
            lines.extend([("    " + part, "dim")] for part in _lines(plan["reason"], width - 4))
    return lines


def _lines(text: str, width: int) -> List[str]:
    """``text`` broken at spaces into lines of at most ``width`` (a longer word is cut)."""
    out: List[str] = []
    for word in text.split():
        if out and len(out[-1]) + 1 + len(word) <= width:
            out[-1] += " " + word
        else:
            out.append(_cut(word, max(1, width)))
    return out


def _row(columns: Sequence[Column], values: Sequence[Any]) -> str:
    """Cells cut to their column's width, one space apart (a width-0 column takes the rest)."""
    cells = []
    for (_, width, _), value in zip(columns, values):
        value = "" if value is None else str(value)
        cells.append(value if width == 0 else ("%-*s" if width < 0 else "%*s") % (abs(width),
                                                                                   _cut(value, abs(width))))
    return " ".join(cells)


def _header(columns: Sequence[Column], view: View) -> Line:
    """A header line over ``_row``'s cells, the sort column's title styled apart."""
    line: Line = []
    for i, (title, width, key) in enumerate(columns):
        cell = _row([(title, width, key)], [title])
        line.append((cell, "sorted" if key and key == view.sort else "head"))
        if i < len(columns) - 1:
            line.append((" ", "head"))
    return line


# ---- sort keys (numbers and names never compared with each other) ----

def _session_key(s: Dict[str, Any], key: str, names: Dict[str, str]) -> Tuple[Any, ...]:
    plan = s.get("plan") or {}
    if key == "gpu":
        gpu = _gpu_of(s, names)
        return (0, int(gpu.split(":")[0]), gpu) if gpu[:1].isdigit() else (1, 0, gpu)
    if key == "job":
        return (s.get("job") or "",)
    if key == "pid":
        return (s.get("pid") or 0,)
    value = {"memory": s.get("latest_peak_bytes"), "batch": plan.get("batch_size"),
             "budget": s.get("budget_bytes"), "ooms": s.get("ooms")}.get(key)
    return (value is not None, value or 0)  # unknowns last, largest first


def _process_key(p: Dict[str, Any], key: str, jobs: Dict[Any, Any], labels: Labels) -> Tuple[Any, ...]:
    if key == "pid":
        return (p.get("pid") or 0,)
    if key == "job":
        return (jobs.get(p.get("pid")) or labels.get(p.get("pid") or 0, ("", ""))[1],)
    return (p.get("used_bytes") is not None, p.get("used_bytes") or 0)


def _gpu_of(s: Dict[str, Any], names: Dict[str, str]) -> str:
    pool = s.get("pool")
    if pool is None:
        return "-"
    if pool == "host":
        return "host"
    return names.get(pool, "?")


def _sort(key: str) -> Sort:
    return next((s for s in SORTS if s.key == key), SORTS[0])


def _bar(ratio: float, width: int) -> str:
    ratio = min(1.0, max(0.0, ratio))
    filled = int(round(ratio * width))
    return "[" + "#" * filled + "." * (width - filled) + "] %3d%%" % round(ratio * 100)


def _gib(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else "%.*f" % (digits, value / GiB)


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds < 3600:
        return "%dm%02ds" % divmod(seconds, 60)
    hours, rest = divmod(seconds, 3600)
    return "%dh%02dm" % (hours, rest // 60)


def _cut(text: Any, width: int) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= width else text[:max(0, width - 1)] + "~"

