"""Bound what libzmq holds for peers: messages it has not finished receiving, and connections.

Why a guard of its own: ``ZMQ_MAXMSGSIZE`` caps a frame, not a message, and libzmq keeps every
frame of a message until its last has come (``RCVHWM`` counts whole messages only), so a peer
sending frames of a message it never ends grows the daemon without bound before the server sees
one byte of it; no socket option stops it. And each connection costs the daemon about 28 KB
(1,000 idle ones: 28 MB), bounded before only by the open-file limit.

How: a socket monitor names each accepted connection's descriptor (``EVENT_ACCEPTED``) and its
end (``EVENT_DISCONNECTED``); each message names the descriptor it came by (``SRCFD``). While
bytes come, every ``INTERVAL`` the guard asks an edge-triggered epoll over duplicates of those
descriptors which connections received bytes since its last look (one call, nothing read); idle,
it waits for them instead of looking. A connection that received bytes at ``STREAK`` looks
without delivering a message the protocol allows (at most its three frames) is sending
something libzmq holds whole: a message of many frames, or one it never ends. A look decides
only when the server has caught up (``decisive``), so that whole messages waiting their turn in
a busy daemon are not taken for streams. While the daemon's resident memory is over its limit
(what it had when it began serving, plus ``HEADROOM``) such connections are shut down
(``shutdown(2)`` on the duplicate, no linger): libzmq then drops the half-received message and
frees it (the C heap is trimmed at the looks that follow, ``TRIM_WINDOW``), and the peer may
connect again. Over the limit the next look comes ``SOON``, so a stream is cut about one
interval after the limit is passed: libzmq's I/O thread takes in up to 2 GB/s here, 20-25 MB in
that time (docs/results.md), and nothing but a look bounds it: no socket option does.

A well-behaved client is not cut: its messages are whole within a look. Connections beyond
``max_connections`` are shut down as they come (the newest go), logged at most once a minute.
Linux only (epoll, /proc): elsewhere only the connection cap holds.
"""
from __future__ import annotations

import math
import os
import select
import socket
import struct
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Set

import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from memd.client.heap import trim_heap
from memd.logs import Throttle
from memd.units import MiB

log = structlog.get_logger("memd.guard")

INTERVAL = 0.01  # seconds between looks: what libzmq takes in meanwhile is the bound's slack
STREAK = 2  # looks with bytes received and no message delivered: one could be a message in passing
SOON = 0.002  # seconds to the next look while over the limit with a connection at one such look
TRIM_WINDOW = 1.0  # seconds after a cut in which each look trims the heap while the RSS is over the limit
HEADROOM = 16 * MiB  # what peers' unfinished messages may add to the RSS (the fuzzer's other shapes: 15 MB)
MAX_CONNECTIONS = 512  # each costs ~28 KB; 256 sessions and the commands beside them
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_SRCFD = int(zmq.SRCFD)  # deprecated in libzmq, present in 4.3: the descriptor a message came by
_NO_LINGER = struct.pack("ii", 1, 0)  # struct linger: on, 0 seconds
_MONITOR_HWM = 100_000  # events queued for the guard (a flood of connections): libzmq blocks past it


def descriptor(frame: zmq.Frame) -> Optional[int]:
    """The descriptor of the connection a message came on (ZMQ_SRCFD: deprecated in libzmq, still
    set by 4.3); None where it is not."""
    try:
        fd = frame.get(_SRCFD)
    except zmq.ZMQError:
        return None
    return fd if isinstance(fd, int) else None


def over_limit(rss: Optional[int], limit: Optional[int]) -> bool:
    return rss is not None and limit is not None and rss > limit


def to_cut(streaks: Mapping[int, int], rss: Optional[int], limit: Optional[int]) -> List[int]:
    """The connections to shut down: over the memory limit, those that kept receiving for
    STREAK looks without delivering an allowed message. Under it nobody: an unfinished message
    is only a harm by the memory it holds, and a slow link may be honest."""
    if not over_limit(rss, limit):
        return []
    return sorted(fd for fd, streak in streaks.items() if streak >= STREAK)


def decisive(caught_up: bool, received: int, connections: int) -> bool:
    """Whether a look can tell a connection's unfinished message from whole ones waiting their
    turn: the server has emptied its socket since the last decisive look, or has received a full
    round of messages since (a ROUTER takes one message from each waiting connection in turn,
    so any message whole at that look has come). A daemon behind on a burst of reports is not
    taken for streams; a flood that keeps it behind slows its looks to one such round."""
    return caught_up or received >= connections


def next_streaks(streaks: Mapping[int, int], active: Set[int], delivered: Set[int]) -> Dict[int, int]:
    """Each connection's looks with bytes received since it last delivered an allowed message.
    Never reset by silence: a peer pausing between frames still holds its message."""
    return {fd: 0 if fd in delivered else streak + (fd in active) for fd, streak in streaks.items()}


class Guard:
    """Watches one bound ROUTER's connections from its poll loop: call ``check`` when ``due``,
    and ``came_by`` with the first frame of each message the protocol allows."""

    def __init__(self, sock: zmq.Socket, max_connections: int = MAX_CONNECTIONS, headroom: int = HEADROOM,
                 interval: float = INTERVAL, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[], object] = trim_heap, statm: str = "/proc/self/statm"):
        self.max_connections, self.headroom, self.interval = max_connections, headroom, interval
        self.clock, self.trim = clock, trim
        self.due = 0.0  # monotonic time of the next look
        self.limit: Optional[int] = None  # bytes: set at the first look, when the daemon serves
        # libzmq's descriptor -> the guard's duplicate: the same socket while libzmq keeps it
        self.connections: Dict[int, int] = {}
        self.streaks: Dict[int, int] = {}
        self.delivered: Set[int] = set()  # descriptors that delivered an allowed message since the last look
        self.cut = 0  # connections shut down for what libzmq held for them, ever
        self.refused = 0  # connections shut down for being beyond max_connections, ever
        self.throttle = Throttle(interval=60.0, clock=clock)
        self._cut_at = -math.inf  # monotonic time of the last cut
        self._srcfd = True
        self._active: Set[int] = set()  # connections that received bytes since the last decisive look
        self._streaking = False  # whether a streak is above 0
        self._round = 0  # messages the server had received at the last decisive look
        # Idle (no bytes since the last look, no streak): the server waits on ``wakers`` instead of
        # looking every INTERVAL (a wake-up costs 30-50 us of CPU here: 100 a second were 0.7 %
        # of a core for an idle daemon); busy, it looks every INTERVAL and waits on them not (a
        # wake-up for each request would cost the report path).
        self.idle = False
        address = "inproc://memd-guard-%x" % id(self)
        sock.monitor(address, _EVENTS)
        self._sock = sock
        self.monitor: Optional[zmq.Socket] = sock.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, _MONITOR_HWM)
        self.monitor.connect(address)
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._by_dup: Dict[int, int] = {}  # our duplicate -> libzmq's descriptor
        try:
            self._statm: Optional[int] = os.open(statm, os.O_RDONLY)
        except OSError:
            self._statm = None  # no /proc: no memory limit, the connection cap still holds
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.wakers: List[Any] = [self.monitor] + ([self._epoll.fileno()] if self._epoll is not None else [])

    def came_by(self, frame: zmq.Frame) -> None:
        """Note the connection an allowed message came by (its streak ends)."""
        if self._srcfd:
            fd = descriptor(frame)
            if fd is not None:
                self.delivered.add(fd)
            else:  # a libzmq without SRCFD: every busy connection looks unfinished
                self._srcfd = False
                log.warning("guard_degraded", reason="libzmq does not say which connection a message came by")

    def check(self, now: float, caught_up: bool, received: int) -> None:
        """One look: new and ended connections, who received what, and the cuts. ``caught_up``:
        the server found its socket empty since the last look; ``received``: messages it has
        taken in all."""
        self.due = now + self.interval
        assert self.monitor is not None
        if int(self.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._events()
        if now - self._cut_at < TRIM_WINDOW and over_limit(self.rss(), self.limit):
            # libzmq frees a cut connection's frames once its I/O thread and the server's socket
            # have both let go of them: under load that can be looks after the cut (CI: 5.5 MiB
            # over the limit 5 s after a cut, when one trim came at the next look). A trim that
            # finds nothing to give back costs 0.06-0.3 ms here.
            self.trim()
        if self.limit is None:
            rss = self.rss()
            self.limit = None if rss is None else rss + self.headroom
        if self._epoll is not None:
            for dup, _ in self._epoll.poll(0):
                self._active.add(self._by_dup[dup])
        self.idle = not self._active and not self._streaking and now - self._cut_at >= TRIM_WINDOW
        if self.idle:
            self.delivered.clear()
            self.due = math.inf  # until bytes or a connection come (``wakers``): no look, no wake-up
            return
        if not decisive(caught_up, received - self._round, len(self.connections)):
            return  # whole messages may be waiting their turn: decide at a later look
        self._round = received
        self.streaks = next_streaks(self.streaks, self._active, self.delivered)
        self._active, self.delivered = set(), set()
        self._streaking = any(self.streaks.values())
        if not self._streaking:
            return  # no read of /proc
        rss = self.rss()
        if over_limit(rss, self.limit):
            self.due = now + SOON  # a message in passing is whole by then; a stream is still coming
        cut = to_cut(self.streaks, rss, self.limit)
        for fd in cut:
            self._shut(self.connections[fd])
            self._forget(fd)  # libzmq reads the end and closes its descriptor: the socket is gone
        if cut:
            self.cut += len(cut)
            self._cut_at = now
            held = self.throttle.allow("cut")
            if held is not None:
                log.warning("connections_cut", reason="messages libzmq held past the memory limit",
                            connections=len(cut), resident_bytes=rss, limit_bytes=self.limit, held_back=held)

    def rss(self) -> Optional[int]:
        """The daemon's resident bytes (/proc/self/statm), None where there is none."""
        if self._statm is None:
            return None
        try:
            return int(os.pread(self._statm, 128, 0).split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return None

    def _events(self) -> None:
        """Apply the monitor's events in order; only each descriptor's last state counts, as
        libzmq may have closed and reused a number since."""
        assert self.monitor is not None
        last: Dict[int, int] = {}
        while True:
            try:
                message = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            fd = int(message["value"])
            last.pop(fd, None)  # keep the order of last events
            last[fd] = int(message["event"])
        for fd, event in last.items():
            self._forget(fd)
            if event == zmq.EVENT_ACCEPTED:
                self._accepted(fd)

    def _accepted(self, fd: int) -> None:
        try:
            dup = os.dup(fd)
        except OSError:
            return  # already closed by libzmq: its DISCONNECTED event is on its way
        if len(self.connections) >= self.max_connections:
            self._shut(dup)
            os.close(dup)
            self.refused += 1
            held = self.throttle.allow("refused")
            if held is not None:
                log.warning("connection_refused", reason="too many connections (max_connections)",
                            max_connections=self.max_connections, held_back=held)
            return
        self.connections[fd] = dup
        self.streaks[fd] = 0
        if self._epoll is not None:
            self._by_dup[dup] = fd
            self._epoll.register(dup, select.EPOLLIN | select.EPOLLET)

    def _forget(self, fd: int) -> None:
        dup = self.connections.pop(fd, None)
        self.streaks.pop(fd, None)
        if dup is None:
            return
        if self._epoll is not None:
            self._by_dup.pop(dup, None)
            try:
                self._epoll.unregister(dup)
            except OSError:
                pass
        os.close(dup)  # the socket closes once libzmq's descriptor is closed too

    @staticmethod
    def _shut(dup: int) -> None:
        """Shut the socket down under libzmq: it reads the end, drops the connection and the
        message it was receiving. Closed without lingering (SO_LINGER 0), the last close resets a
        TCP peer: one blocked on a full window would otherwise wait out its probes (seen: 106 s)."""
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            return  # not a socket (a number reused before the event came): nothing of ours
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()

    def close(self) -> None:
        """Before the socket closes: the monitor's inproc socket would hold the context's term."""
        for fd in list(self.connections):
            self._forget(fd)
        if self.monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(0)
            self.monitor = None
        if self._epoll is not None:
            self._epoll.close()
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None

