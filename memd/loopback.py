"""Who a loopback TCP peer is. TCP carries no credentials, but both ends of a loopback
connection are sockets of this machine, and the kernel knows each one's owner: asked for the
socket whose local address is the peer's and whose remote address is ours (sock_diag, the
netlink query `ss` makes; /proc/net/tcp and tcp6 where it does not answer), it gives the uid
that opened it and its inode, and the process holding that inode in its fd table is the peer's
process. So a loopback peer is a user (and a process), as over the ipc socket (SO_PEERCRED), in
the sharing of session slots and in what it may see.

The server asks by the connection's descriptor in libzmq (the message's SRCFD), only when a
handler needs the sender (hello, status, curves, forget: never a report), and once per
connection: the answer is kept per descriptor and that socket's inode (a new connection on a
reused descriptor is another socket). Measured here: sock_diag 10 us, /proc/net/tcp 1-2 ms (the
kernel prints its whole hash table); the pid is looked for only when asked (hello), through the
peer user's processes' descriptors, at most MAX_FDS of them (about 1.5 us each: past the bound
the pid is left unknown, the uid still stands).
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct
from typing import Dict, Iterator, List, Optional, Tuple, Union

from memd.sessions import Peer

MAX_FDS = 4096  # descriptors one pid scan reads at most (about 1.5 us each): a bound on one connection's cost
Address = Tuple  # as getpeername gives it: (host, port) or (host, port, flowinfo, scope_id)
Owner = Tuple[int, int]  # (uid, inode) of the peer's socket
# NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, NLMSG_ERROR (linux/sock_diag.h, netlink.h)
_SOCK_DIAG, _BY_FAMILY, _REQUEST, _ERROR = 4, 20, 1, 2
_NO_COOKIE = 0xFFFFFFFF
_UID_AT = 16 + 4 + 48 + 12  # in a reply: nlmsghdr, inet_diag_msg's family..retrans, sockid, expires..wqueue


def _loopback(theirs: Address) -> Union[ipaddress.IPv4Address, ipaddress.IPv6Address, None]:
    """The peer's address, if it is a loopback one (an IPv4 peer of a dual-stack socket shows as
    ::ffff:127.x.y.z); None for any other, and for what is not an address."""
    try:
        peer = ipaddress.ip_address(theirs[0])
    except ValueError:
        return None
    mapped = peer.ipv4_mapped if isinstance(peer, ipaddress.IPv6Address) else None
    return peer if peer.is_loopback or (mapped is not None and mapped.is_loopback) else None


def diag(theirs: Address, ours: Address) -> Optional[Owner]:
    """(uid, inode) of the socket from ``theirs`` to ``ours``, asked of the kernel by its exact
    addresses (sock_diag); None when it has none (closed since). Raises OSError where netlink
    is refused."""
    peer, own = ipaddress.ip_address(theirs[0]), ipaddress.ip_address(ours[0])
    family = socket.AF_INET6 if peer.version == 6 else socket.AF_INET
    sockid = (struct.pack("!HH", theirs[1], ours[1]) + peer.packed.ljust(16, b"\0") + own.packed.ljust(16, b"\0")
              + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE))
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _SOCK_DIAG) as netlink:
        netlink.settimeout(1.0)  # the kernel answers at once; never wait on it for ever
        netlink.send(struct.pack("=IHHII", 16 + len(request), _BY_FAMILY, _REQUEST, 1, 0) + request)
        reply = netlink.recv(4096)
    if len(reply) < _UID_AT + 8 or struct.unpack_from("=H", reply, 4)[0] == _ERROR:
        return None
    uid, inode = struct.unpack_from("=II", reply, _UID_AT)
    return (uid, inode) if inode else None


def _hex(packed: bytes, port: int) -> str:
    """An address as /proc/net/tcp prints it: each 32-bit word of the network-order address read
    in host order, %08X, then ":%04X" of the port."""
    words = struct.unpack("=%dI" % (len(packed) // 4), packed)
    return "".join("%08X" % w for w in words) + ":%04X" % port


def rows(theirs: Address, ours: Address) -> Iterator[Tuple[str, str, str]]:
    """(table, the peer end's local address, its remote address) to look for in /proc/net: a
    loopback peer only. An IPv4 peer of a dual-stack socket may have a socket of either family."""
    peer = _loopback(theirs)
    if peer is None:
        return
    own = ipaddress.ip_address(ours[0])
    yield "net/tcp6" if peer.version == 6 else "net/tcp", _hex(peer.packed, theirs[1]), _hex(own.packed, ours[1])
    mapped = peer.ipv4_mapped if isinstance(peer, ipaddress.IPv6Address) else None
    own4 = own.ipv4_mapped if isinstance(own, ipaddress.IPv6Address) else None
    if mapped is not None and own4 is not None:
        yield "net/tcp", _hex(mapped.packed, theirs[1]), _hex(own4.packed, ours[1])


def find(table: bytes, local: str, remote: str) -> Optional[Owner]:
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


def from_tables(theirs: Address, ours: Address, proc_root: str = "/proc") -> Optional[Owner]:
    """What diag() says, read from /proc/net/tcp and tcp6 (1-2 ms: where netlink does not answer)."""
    for table, local, remote in rows(theirs, ours):
        try:
            with open(os.path.join(proc_root, table), "rb") as f:
                found = find(f.read(), local, remote)
        except OSError:
            continue
        if found is not None:
            return found
    return None


def owner(theirs: Address, ours: Address, proc_root: str = "/proc") -> Optional[Owner]:
    """(uid, inode) of a loopback peer's socket; None for a peer not on loopback, or whose socket
    the kernel does not show here (another network namespace)."""
    if _loopback(theirs) is None:
        return None
    try:
        found = diag(theirs, ours)
    except OSError:  # no netlink here (a sandbox)
        found = None
    # The tables say the same, slower: where netlink is refused, or its inet_diag module is
    # missing (an error reply, as for a socket closed since: rare for a peer that just wrote)
    return found if found is not None else from_tables(theirs, ours, proc_root)


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


_UNSCANNED = -1  # a known peer whose process has not been looked for yet


class Peers:
    """Who is at the other end of each TCP connection the daemon holds, asked by descriptor and
    known per connection (the descriptor and its socket's inode)."""

    def __init__(self, proc_root: str = "/proc", limit: int = MAX_FDS):
        self.proc_root = proc_root
        self.limit = limit
        # fd -> [its socket's inode, the peer's (uid, inode) or None, the peer's pid]: as many as fds
        self._known: Dict[int, List] = {}
        self.lookups = self.scans = 0  # connections looked up, and processes looked for (not cached)

    def of(self, fd: Optional[int], pid: bool = True) -> Optional[Peer]:
        """The peer on connection ``fd``, its process looked for only when ``pid`` asks (a hello:
        status needs the user alone); None when it cannot be told (closed since, not loopback)."""
        if fd is None or fd < 0:
            return None
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return None
        known = self._known.get(fd)
        if known is None or known[0] != inode:
            try:
                theirs, ours = _names(fd)
            except OSError:
                return None
            self.lookups += 1
            known = self._known[fd] = [inode, owner(theirs, ours, self.proc_root), _UNSCANNED]
        if known[1] is None:
            return None
        uid, peer_inode = known[1]
        if pid and known[2] == _UNSCANNED:
            self.scans += 1
            known[2] = holder(peer_inode, uid, self.proc_root, self.limit)
        return Peer(uid, None if known[2] == _UNSCANNED else known[2])


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
