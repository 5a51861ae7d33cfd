"""systemd's notification protocol (sd_notify), spoken directly: one datagram per message.

READY=1 once memd answers, STOPPING=1 on the way out, WATCHDOG=1 while the sampling loop is
healthy, STATUS= (what `systemctl status` shows) when the sessions or the pressure change, and
RELOADING=1 with MONOTONIC_USEC= then READY=1 around a reload (SIGHUP), which is what
``Type=notify-reload`` (systemd 253) waits for. Without NOTIFY_SOCKET (not under systemd) every
call is a no-op.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Mapping, Optional


class Notifier:
    def __init__(self, environ: Optional[Mapping[str, str]] = None):
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or ""
        if address.startswith("@"):
            address = "\0" + address[1:]  # abstract namespace
        self.address = address or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog_for_us = not pid or pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 1e6 / 2 if usec.isdigit() and int(usec) > 0 and watchdog_for_us else None
        self._sock: Optional[socket.socket] = None

    def send(self, message: str) -> bool:
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message.encode(), self.address)
            return True
        except OSError:
            return False  # systemd gone or socket unwritable: nothing useful to do about it

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1" + ("\nSTATUS=" + status if status else ""))

    def reloading(self) -> bool:
        """Reload begun: MONOTONIC_USEC lets systemd tell this answer from one to an older SIGHUP."""
        return self.send("RELOADING=1\nMONOTONIC_USEC=%d" % (time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000))

    def status(self, text: str) -> bool:
        return self.send("STATUS=" + text)

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
