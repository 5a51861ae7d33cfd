"""`memd top`: the daemon's view, redrawn every second, for a person at a terminal.

``render`` is a pure function of one ``status`` reply, so what the screen shows is tested
without a terminal; ``run`` only polls, clears and prints (plain ANSI, no curses: it works over
ssh, in tmux and when piped).
"""
from __future__ import annotations

import shutil
import sys
import time
from typing import Any, Callable, Dict, List, Optional, TextIO, Type

from memd.units import GiB

CLEAR = "\x1b[H\x1b[2J"


def render(status: Dict[str, Any], width: int = 100) -> str:
    snap = status.get("snapshot") or {}
    system = snap.get("system") or {}
    lines: List[str] = []
    lines.append("memd %s on %s  up %s  pressure %s  memory %s" % (
        status.get("version", "?"), status.get("host", "?"), _duration(status.get("uptime_seconds")),
        str(status.get("pressure_level", "?")).upper(), snap.get("memory_model", "?")))
    total, available = system.get("total_bytes"), system.get("available_bytes")
    if total:
        used = total - (available or 0)
        lines.append("host  %s %s / %s GiB used, %s GiB available" % (
            _bar(used / total, 24), _gib(used), _gib(total), _gib(available)))
    if system.get("swap_total_bytes"):
        lines.append("swap  %s %s / %s GiB" % (_bar(system["swap_used_bytes"] / system["swap_total_bytes"], 24),
                                              _gib(system["swap_used_bytes"]), _gib(system["swap_total_bytes"])))
    psi = snap.get("pressure")
    if psi:
        averages = ("some_avg10", "some_avg60", "some_avg300", "full_avg10", "full_avg60", "full_avg300")
        lines.append("psi   some %5.1f%% %5.1f%% %5.1f%%   full %5.1f%% %5.1f%% %5.1f%%   (avg10 avg60 avg300)"
                     % tuple(100 * psi[k] for k in averages))
    else:
        lines.append("psi   not available on this kernel")
    cg = snap.get("cgroup")
    if cg and cg.get("limit_bytes"):
        ws = cg.get("working_set_bytes") or cg.get("usage_bytes") or 0
        lines.append("cgroup v%s %s %s / %s GiB working set  %s" % (
            cg["version"], _bar(ws / cg["limit_bytes"], 24), _gib(ws), _gib(cg["limit_bytes"]), cg.get("path", "")))
    gpus = snap.get("gpus") or []
    if gpus:
        lines.append("")
        lines.append("%-4s %-24s %-26s %9s %6s  %s" % ("gpu", "name", "memory", "GiB", "util", "state"))
        for g in gpus:
            if not g.get("healthy", True):
                lines.append("%-4s %-24s %-26s %9s %6s  UNHEALTHY: %s" % (g.get("index"), _cut(g.get("name"), 24), "",
                                                                        "", "", g.get("error")))
                continue
            util = "-" if g.get("utilization") is None else "%d%%" % round(100 * g["utilization"])
            if g.get("unified") or not g.get("total_bytes"):
                lines.append("%-4s %-24s %-26s %9s %6s  unified (host RAM)" % (g.get("index"), _cut(g.get("name"), 24),
                                                                            "", "", util))
                continue
            used = g.get("used_bytes") or 0
            lines.append("%-4s %-24s %-26s %9s %6s  ok" % (
                g.get("index"), _cut(g.get("name"), 24), _bar(used / g["total_bytes"], 24),
                "%s/%s" % (_gib(used, 0), _gib(g["total_bytes"], 0)), util))
    sessions = status.get("sessions") or []
    lines.append("")
    lines.append("sessions: %d" % len(sessions))
    if sessions:
        lines.append("%-18s %7s %4s %-10s %9s %5s %3s %8s %8s %4s %1s  %s" % (
            "job", "pid", "rank", "pool", "batch", "accum", "wrk", "peakGiB", "budget", "ooms", "T", "reason"))
        for s in sorted(sessions, key=lambda s: (s.get("pool") or "", s.get("job") or "")):
            plan = s.get("plan") or {}
            batch = "%s" % plan.get("batch_size", "-")
            if s.get("latest_batch") is not None and s.get("latest_batch") != plan.get("batch_size"):
                batch = "%s<-%s" % (plan.get("batch_size", "-"), s["latest_batch"])  # recommended <- used
            row = "%-18s %7s %4s %-10s %9s %5s %3s %8s %8s %4s %1s  " % (
                _cut(s.get("job"), 18), s.get("pid", ""), "" if s.get("rank") is None else s["rank"],
                _cut(s.get("pool"), 10), batch, plan.get("grad_accum_steps", "-"), plan.get("num_workers", "-"),
                _gib(s.get("latest_peak_bytes")), _gib(s.get("budget_bytes")), s.get("ooms", 0),
                "T" if plan.get("throttle") else "")
            lines.append(row + _cut(plan.get("reason", ""), max(10, width - len(row))))
    errors = snap.get("errors") or []
    if errors:
        lines.append("")
        lines.extend("! %s: %s" % (e.get("source"), _cut(e.get("message"), width - 10)) for e in errors[:5])
    return "\n".join(line[:width] for line in lines) + "\n"


def run(fetch: Callable[[], Dict[str, Any]], interval: float = 1.0, once: bool = False,
        out: TextIO = sys.stdout, unavailable: Type[BaseException] = Exception,
        iterations: Optional[int] = None) -> int:
    """Poll ``fetch`` and redraw until interrupted; ``once`` prints one frame (exit 1 without a daemon)."""
    shown = 0
    while iterations is None or shown < iterations:
        width = shutil.get_terminal_size((120, 40)).columns
        try:
            frame = render(fetch(), width)
        except unavailable as exc:
            if once:
                print("memd: %s (is `memd serve` running?)" % exc, file=sys.stderr)
                return 1
            frame = "memd top: waiting for the daemon (%s)\n" % exc
        if once:
            out.write(frame)
            return 0
        out.write(CLEAR + frame)
        out.flush()
        shown += 1
        time.sleep(interval)
    return 0


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
