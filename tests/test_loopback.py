"""Who a loopback TCP peer is (memd.loopback): the kernel's answer (sock_diag, and the
/proc/net/tcp tables where netlink is refused: as a fixture and for real) on real connections of
this process, and the per-connection cache."""
import os
import socket

from memd import loopback
from memd.sessions import Peer

# Two rows of a real /proc/net/tcp: a connection's two ends (127.0.0.1:41000 <-> 127.0.0.1:5555),
# and a TIME_WAIT row of an earlier connection from the same port (no inode: skipped).
TABLE = b"""\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:15B3 0100007F:A028 01 00000000:00000000 00:00000000 00000000     0        0 7001 1 0 20 4 30 10 -1
   1: 0100007F:A028 0100007F:15B3 06 00000000:00000000 03:00001770 00000000     0        0 0 3 0
   2: 0100007F:A028 0100007F:15B3 01 00000000:00000000 00:00000000 00000000  1000        0 7002 1 0 20 4 30 10 -1
"""


def test_an_address_is_written_as_the_kernel_prints_it():
    assert list(loopback.rows(("127.0.0.1", 41000), ("127.0.0.1", 5555))) == [
        ("net/tcp", "0100007F:A028", "0100007F:15B3")]
    assert list(loopback.rows(("::1", 41000, 0, 0), ("::1", 5555, 0, 0))) == [
        ("net/tcp6", "00000000000000000000000001000000:A028", "00000000000000000000000001000000:15B3")]
    # An IPv4 peer of a dual-stack socket: its own socket may be of either family
    assert [t for t, _, _ in loopback.rows(("::ffff:127.0.0.1", 41000, 0, 0), ("::ffff:127.0.0.1", 5555, 0, 0))] \
        == ["net/tcp6", "net/tcp"]


def test_only_a_loopback_peer_is_looked_up():
    assert not list(loopback.rows(("10.0.0.2", 41000), ("10.0.0.1", 5555)))
    assert not list(loopback.rows(("::ffff:10.0.0.2", 41000, 0, 0), ("::ffff:127.0.0.1", 5555, 0, 0)))
    assert not list(loopback.rows(("not an address", 1), ("127.0.0.1", 5555)))
    assert loopback.owner(("10.0.0.2", 41000), ("10.0.0.1", 5555)) is None


def test_the_peers_row_gives_its_uid_and_inode_past_a_closed_one():
    assert loopback.find(TABLE, "0100007F:A028", "0100007F:15B3") == (1000, 7002)
    assert loopback.find(TABLE, "0100007F:15B3", "0100007F:A028") == (0, 7001)  # our own end
    assert loopback.find(TABLE, "0100007F:A029", "0100007F:15B3") is None
    assert loopback.find(b"", "0100007F:A028", "0100007F:15B3") is None


def test_the_process_holding_the_socket_is_found_among_its_users_within_a_bound(tmp_path):
    uid = os.getuid()  # the fixture's directories are this user's
    for pid, links in (("17", ["pipe:[1]", "socket:[7001]"]), ("42", ["/dev/null", "socket:[7002]"])):
        fd = tmp_path / pid / "fd"
        fd.mkdir(parents=True)
        for i, target in enumerate(links):
            os.symlink(target, fd / str(i))
    (tmp_path / "self").mkdir()
    found = loopback.holder(7002, uid, str(tmp_path))
    assert found == 42
    assert loopback.holder(7002, uid + 1, str(tmp_path)) is None  # another user's processes are not read
    assert loopback.holder(9999, uid, str(tmp_path)) is None
    assert loopback.holder(7002, uid, str(tmp_path), limit=1) is None  # past the bound: pid unknown


def connection(family=socket.AF_INET, host="127.0.0.1"):
    """A real loopback connection: (listening, client, accepted) sockets; the caller closes them."""
    server = socket.socket(family)
    server.bind((host, 0))
    server.listen()
    client = socket.socket(family)
    client.connect(server.getsockname())
    return server, client, server.accept()[0]


def test_the_kernels_two_answers_agree_on_real_connections():
    """sock_diag and the tables name the client's own socket, in both families and for an IPv4
    client of a dual-stack server."""
    opened = []
    try:
        for family, host, server_family in ((socket.AF_INET, "127.0.0.1", socket.AF_INET),
                                            (socket.AF_INET6, "::1", socket.AF_INET6),
                                            (socket.AF_INET, "127.0.0.1", socket.AF_INET6)):
            server = socket.socket(server_family)
            if server_family != family:
                server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual-stack
            server.bind(("::" if server_family != family else host, 0))
            server.listen()
            client = socket.socket(family)
            client.connect((host, server.getsockname()[1]))
            accepted = server.accept()[0]
            opened += [server, client, accepted]
            theirs, ours = accepted.getpeername(), accepted.getsockname()
            expected = (os.getuid(), os.fstat(client.fileno()).st_ino)
            assert loopback.diag(theirs, ours) == expected, (theirs, ours)
            assert loopback.from_tables(theirs, ours) == expected, (theirs, ours)
            assert loopback.owner(theirs, ours) == expected
        assert loopback.diag(("127.0.0.1", 1), ("127.0.0.1", 2)) is None  # no such socket
    finally:
        for sock in opened:
            sock.close()


def test_a_real_loopback_connection_names_this_process_once_per_connection():
    peers = loopback.Peers()
    me = Peer(os.getuid(), os.getpid())
    opened = []
    try:
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            opened += connection(family, host)
            fd = opened[-1].fileno()
            assert peers.of(fd, pid=False) == Peer(os.getuid(), None)  # the user alone: no scan
            assert peers.scans == len(opened) // 3 - 1
            assert peers.of(fd) == me and peers.of(fd) == me and peers.of(fd, pid=False) == me
            assert (peers.lookups, peers.scans) == (len(opened) // 3,) * 2  # once per connection
        # Another connection on a descriptor number seen before is another socket: looked up again
        opened += connection()
        os.dup2(opened[-1].fileno(), opened[2].fileno())
        assert peers.of(opened[2].fileno()) == me
        assert (peers.lookups, peers.scans) == (3, 3)
    finally:
        for sock in opened:
            sock.close()
    assert peers.of(None) is None and peers.of(-1) is None
    read, write = os.pipe()
    try:
        assert peers.of(read) is None  # not a socket
    finally:
        os.close(read)
        os.close(write)
