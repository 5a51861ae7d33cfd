"""`memd top` at a terminal: curses draws memd/top.py's frames; keys sort, scroll and quit.

curses (standard library, as nvitop) keeps what the terminal shows and sends only what changed
between two frames, so nothing flickers; a thread polls the daemon, so a key is answered at once
even while a reply is awaited. Without a terminal (a pipe, `--once`, no curses) one frame is
printed as plain text.
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import sys
import threading
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, TextIO, Tuple, Type

from memd import top
from memd.sampling.procs import process_owner

FOOTER = "q quit  </> sort  r reverse order  w whole reasons  l legend  up/down scroll"
_POLL_MS = 100  # how often keys are read while nothing else happens


def run(fetch: Callable[[], Dict[str, Any]], interval: float = 1.0, once: bool = False,
        out: TextIO = sys.stdout, unavailable: Type[BaseException] = Exception,
        view: Optional[top.View] = None) -> int:
    """Poll ``fetch`` and draw until `q`; ``once`` (or no terminal) prints one frame (exit 1
    without a daemon)."""
    view = view or top.View()
    if not once and out.isatty() and sys.stdin.isatty():
        try:
            import curses
        except ImportError:  # a Python built without curses: one plain frame
            curses = None  # type: ignore[assignment]
        if curses is not None:
            poller = Poller(fetch, interval, unavailable)
            poller.start()
            try:
                os.environ.setdefault("ESCDELAY", "25")  # Esc quits without a second's wait
                return int(curses.wrapper(_screen, poller, view))
            except KeyboardInterrupt:
                return 0
            except curses.error as exc:  # a terminal curses cannot drive (TERM unknown)
                print("memd: cannot draw on this terminal (%s): one frame follows" % exc, file=sys.stderr)
            finally:
                poller.stop()
    try:
        status = fetch()
    except unavailable as exc:
        print("memd: %s (is `memd serve` running?)" % exc, file=sys.stderr)
        return 1
    width = _columns()
    out.write(top.render(status, width, view, process_labels(status)))
    return 0


def process_labels(status: Dict[str, Any], proc_root: str = "/proc",
                   hostname: Optional[str] = None) -> Dict[int, Tuple[str, str]]:
    """pid -> (user, command) for the GPU processes and sessions of a status reply, read from
    this host's /proc; none when the daemon runs on another host (its pids mean nothing here)."""
    if status.get("host") != (hostname or socket.gethostname()):
        return {}
    pids = {s.get("pid") for s in status.get("sessions") or []}
    for g in (status.get("snapshot") or {}).get("gpus") or []:
        pids.update(p.get("pid") for p in g.get("processes") or [])
    labels = {}
    for pid in pids:
        if isinstance(pid, int) and pid > 0:
            found = _label(pid, proc_root)
            if found is not None:
                labels[pid] = found
    return labels


def _label(pid: int, proc_root: str) -> Optional[Tuple[str, str]]:
    uid = process_owner(pid, proc_root)
    if uid is None:
        return None  # gone
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    try:
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as f:
            command = f.read().rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
        if not command:  # a kernel thread, or a zombie: its name, as ps shows it
            with open(os.path.join(proc_root, str(pid), "comm"), "rb") as f:
                command = "[%s]" % f.read().strip().decode("utf-8", "replace")
    except OSError:
        command = "-"
    return user, command


class Poller:
    """Asks the daemon every ``interval`` seconds in a thread; ``latest`` is the last answer:
    (status, pid labels, None) or (None, {}, why the daemon did not answer)."""

    def __init__(self, fetch: Callable[[], Dict[str, Any]], interval: float,
                 unavailable: Type[BaseException]) -> None:
        self._fetch, self._interval, self._unavailable = fetch, interval, unavailable
        self.latest: Optional[Tuple[Optional[Dict[str, Any]], Dict[int, Tuple[str, str]], Optional[str]]] = None
        self.fresh = threading.Event()  # set when latest changed since the screen last drew
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memd-top-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                status = self._fetch()
                self.latest = (status, process_labels(status), None)
            except self._unavailable as exc:
                self.latest = (None, {}, str(exc))
            self.fresh.set()
            self._stop.wait(self._interval)


def _screen(stdscr: Any, poller: Poller, view: top.View) -> int:
    import curses

    styles = _styles(curses)
    try:
        curses.curs_set(0)
    except curses.error:
        pass  # a terminal that cannot hide the cursor
    stdscr.timeout(_POLL_MS)
    scroll = 0
    dirty = True
    while True:
        if poller.fresh.is_set():
            poller.fresh.clear()
            dirty = True
        if dirty:
            scroll = _draw(stdscr, curses, styles, poller.latest, view, scroll)
            dirty = False
        key = stdscr.getch()
        if key == -1:
            continue
        dirty = True
        if key in (ord("q"), ord("Q"), 27):
            return 0
        if key in (ord(">"), ord("."), curses.KEY_RIGHT):
            view = view.next_sort(1)
        elif key in (ord("<"), ord(","), curses.KEY_LEFT):
            view = view.next_sort(-1)
        elif key in (ord("r"), ord("R")):
            view = replace(view, reverse=not view.reverse)
        elif key in (ord("l"), ord("L")):
            view = replace(view, legend=not view.legend)
        elif key in (ord("w"), ord("W")):
            view = replace(view, reasons=not view.reasons)
        elif key in (curses.KEY_DOWN, ord("j")):
            scroll += 1
        elif key in (curses.KEY_UP, ord("k")):
            scroll -= 1
        elif key == curses.KEY_NPAGE:
            scroll += 10
        elif key == curses.KEY_PPAGE:
            scroll -= 10
        elif key == curses.KEY_HOME:
            scroll = 0


def _draw(stdscr: Any, curses: Any, styles: Dict[str, int], latest: Any, view: top.View, scroll: int) -> int:
    """One frame: erase and write the virtual screen, then refresh (curses sends the difference)."""
    height, width = stdscr.getmaxyx()
    if latest is None:
        body: List[top.Line] = [[("memd top: asking the daemon...", "dim")]]
        legend: List[top.Line] = []
    elif latest[0] is None:
        body, legend = [[("memd top: waiting for the daemon (%s)" % latest[2], "warn")]], []
    else:
        shown = top.frame(latest[0], width, view, latest[1])
        body, legend = shown.body, shown.legend
    footer: top.Line = [((" " + FOOTER).ljust(width), "head")]
    room = max(1, height - 1 - len(legend))
    scroll = max(0, min(scroll, len(body) - room))
    stdscr.erase()
    for y, line in enumerate(body[scroll:scroll + room]):
        _put(stdscr, curses, styles, y, line, width)
    for y, line in enumerate(legend, start=height - 1 - len(legend)):
        _put(stdscr, curses, styles, y, line, width)
    _put(stdscr, curses, styles, height - 1, footer, width)
    stdscr.refresh()
    return scroll


def _put(stdscr: Any, curses: Any, styles: Dict[str, int], y: int, line: top.Line, width: int) -> None:
    x = 0
    for text, style in line:
        if x >= width or y < 0:
            return
        try:
            stdscr.addnstr(y, x, text, width - x, styles.get(style, 0))
        except curses.error:
            pass  # the bottom-right cell: curses writes it, then cannot move the cursor past it
        x += len(text)


def _styles(curses: Any) -> Dict[str, int]:
    styles = {"": 0, "title": curses.A_BOLD, "head": curses.A_REVERSE, "sorted": curses.A_REVERSE | curses.A_BOLD
              | curses.A_UNDERLINE, "warn": curses.A_BOLD, "bad": curses.A_BOLD, "dim": curses.A_DIM}
    try:
        if curses.has_colors():
            curses.start_color()
            curses.use_default_colors()
            curses.init_pair(1, curses.COLOR_YELLOW, -1)
            curses.init_pair(2, curses.COLOR_RED, -1)
            curses.init_pair(3, curses.COLOR_CYAN, -1)
            styles.update(warn=curses.color_pair(1), bad=curses.color_pair(2) | curses.A_BOLD,
                          sorted=curses.color_pair(3) | curses.A_REVERSE | curses.A_BOLD)
    except curses.error:
        pass  # a monochrome terminal: attributes only
    return styles


def _columns() -> int:
    """The width to print at: $COLUMNS, else the terminal's, else 120 (a pipe or a file)."""
    return shutil.get_terminal_size((120, 40)).columns
