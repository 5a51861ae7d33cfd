"""Who a loopback TCP peer is. TCP carries no credentials, but both ends of a loopback
connection are sockets of this machine, and the kernel lists each with its owner: the peer's end
is the row of /proc/net/tcp (tcp6) whose local address is the peer's and whose remote address is
ours; the row gives the uid that opened it and its inode, and the process holding that inode in
its fd table is the peer's process. So a loopback peer is a user (and a process), as over the
ipc socket (SO_PEERCRED), in the sharing of session slots and in what it may see.

The server asks for it by the connection's descriptor in libzmq (the message's SRCFD), only
when a handler needs the sender (hello, status, curves, forget: never a report), and once per
connection: the answer is kept per descriptor and that socket's inode (a new connection on a
reused descriptor is another socket). Reading the tables costs about 1 ms each here (the kernel
walks its whole hash table); the fd scan reads only the peer user's processes, at most MAX_FDS
descriptors (more: the pid is left unknown, the uid still stands).
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct
from typing import Dict, Iterator, Optional, Tuple

from memd.sessions import Peer

MAX_FDS = 16384  # descriptors the pid scan reads at most (about 2 us each): a bound on one connection's cost
Address = Tuple  # as getpeername gives it: (host, port) or (host, port, flowinfo, scope_id)


def _hex(packed: bytes, port: int) -> str:
    """An address as /proc/net/tcp prints it: each 32-bit word of the network-order address read
    in host order, %08X, then ":%04X" of the port."""
    words = struct.unpack("=%dI" % (len(packed) // 4), packed)
    return "".join("%08X" % w for w in words) + ":%04X" % port


def rows(theirs: Address, ours: Address) -> Iterator[Tuple[str, str, str]]:
    """(table, the peer end's local address, its remote address) to look for: a loopback peer only.
    An IPv4 peer of a dual-stack socket shows as ::ffff:a.b.c.d here, and its own socket may be
    either family."""
    try:
        peer, own = ipaddress.ip_address(theirs[0]), ipaddress.ip_address(ours[0])
    except ValueError:
        return
    mapped = peer.ipv4_mapped if isinstance(peer, ipaddress.IPv6Address) else None
    own4 = own.ipv4_mapped if isinstance(own, ipaddress.IPv6Address) else None
    if not (peer.is_loopback or (mapped is not None and mapped.is_loopback)):
        return
    table = "net/tcp6" if peer.version == 6 else "net/tcp"
    yield table, _hex(peer.packed, theirs[1]), _hex(own.packed, ours[1])
    if mapped is not None and own4 is not None:
        yield "net/tcp", _hex(mapped.packed, theirs[1]), _hex(own4.packed, ours[1])


def find(table: bytes, local: str, remote: str) -> Optional[Tuple[int, int]]:
    """(uid, inode) of the row of a /proc/net/tcp ``table`` from ``local`` to ``remote``, or
    None. A row without an inode (TIME_WAIT: a closed socket of that address pair) is skipped."""
    needle = (" %s %s " % (local, remote)).encode()
    at = table.find(needle)
    while at >= 0:
        end = table.find(b"\n", at)
        fields = table[at:end if end >= 0 else len(table)].split()
        try:
            uid, inode = int(fields[6]), int(fields[8])  # local remote st queues timer retr uid timeout inode
        except (IndexError, ValueError):
            return None
        if inode:
            return uid, inode
        at = table.find(needle, at + 1)
    return None


def holder(inode: int, uid: int, proc_root: str = "/proc", limit: int = MAX_FDS) -> Optional[int]:
    """The pid of a process of ``uid`` holding socket ``inode``, reading at most ``limit`` of its
    descriptors; None when not found (another pid namespace hides it, it is not dumpable, or
    past the limit)."""
    target = "socket:[%d]" % inode
    read = 0
    with os.scandir(proc_root) as processes:
        for process in processes:
            if not process.name.isdigit():
                continue
            try:
                if process.stat().st_uid != uid:
                    continue
                fds = os.scandir(os.path.join(process.path, "fd"))
            except OSError:  # gone, or not ours to read
                continue
            with fds:
                for fd in fds:
                    read += 1
                    if read > limit:
                        return None
                    try:
                        if os.readlink(fd.path) == target:
                            return int(process.name)
                    except OSError:
                        continue
    return None


def identify(theirs: Address, ours: Address, proc_root: str = "/proc", limit: int = MAX_FDS) -> Optional[Peer]:
    """The user (and process, when found) at the other end of a loopback connection; None for a
    peer that is not on loopback, or whose row is not found (another network namespace)."""
    for table, local, remote in rows(theirs, ours):
        try:
            with open(os.path.join(proc_root, table), "rb") as f:
                found = find(f.read(), local, remote)
        except OSError:
            continue
        if found is not None:
            uid, inode = found
            return Peer(uid, holder(inode, uid, proc_root, limit))
    return None


class Peers:
    """Who is at the other end of each TCP connection the daemon holds, asked by descriptor and
    known per connection (the descriptor and its socket's inode)."""

    def __init__(self, proc_root: str = "/proc", limit: int = MAX_FDS):
        self.proc_root = proc_root
        self.limit = limit
        self._known: Dict[int, Tuple[int, Optional[Peer]]] = {}  # fd -> (socket inode, peer): as many as fds
        self.lookups = 0  # connections looked up in the kernel's tables (not served from the cache)

    def of(self, fd: Optional[int]) -> Optional[Peer]:
        """The peer on connection ``fd``; None when it cannot be told (closed since, not loopback)."""
        if fd is None or fd < 0:
            return None
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return None
        known = self._known.get(fd)
        if known is not None and known[0] == inode:
            return known[1]
        try:
            theirs, ours = _names(fd)
        except OSError:
            return None
        self.lookups += 1
        peer = identify(theirs, ours, self.proc_root, self.limit)
        self._known[fd] = (inode, peer)
        return peer


def _names(fd: int) -> Tuple[Address, Address]:
    """(peer address, own address) of the socket on ``fd`` (libzmq's: read through a copy of it)."""
    copy = os.dup(fd)
    try:
        sock = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        raise
    with sock:
        return sock.getpeername(), sock.getsockname()
