"""The hand-written RESP pieces: Cluster hash slots, redirect parsing, replies read from a real server."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvkit.backends.blockstore.resp import (
    Connection,
    ConnectOptions,
    Redirect,
    ServerError,
    SlotUnserved,
    command,
    error_reply,
    key_slot,
)


@pytest.mark.parametrize(("key", "slot"), [
    (b"123456789", 0x31C3 % 16384),  # CRC16-XMODEM check value
    (b"foo", 12182), (b"bar", 5061),  # the Cluster spec's / CLUSTER KEYSLOT's answers
    (b"{user1000}.following", key_slot(b"user1000")), (b"{}x", key_slot(b"{}x")),
    (b"foo{}{bar}", key_slot(b"foo{}{bar}")), (b"foo{{bar}}zap", key_slot(b"{bar")),
])
def test_key_slot_follows_the_cluster_spec(key, slot):
    """Slots are CRC16 mod 16384 of the first non-empty {hash tag}, else of the whole key."""
    assert key_slot(key) == slot


def test_key_slot_agrees_with_the_server(valkey_cluster):
    """CLUSTER KEYSLOT on a real node gives the same slot for kvkit's keys and hash-tagged ones."""
    node = valkey_cluster.nodes[0]
    for key in (b"kvkit:v1:" + b"ab" * 16 + b":%032x:r0" % 7, b"{tag}x", b"a{b}c{d}", b"{}z", b""):
        assert node.call(b"CLUSTER", b"KEYSLOT", key) == key_slot(key), key


def test_error_replies():
    """MOVED and ASK become Redirects with slot and address; CLUSTERDOWN a SlotUnserved; anything else (one out of
    range too) a ServerError."""
    assert error_reply(b"MOVED 3999 127.0.0.1:6381") == Redirect(3999, ("127.0.0.1", 6381), False)
    assert error_reply(b"ASK 1 ::1:7000") == Redirect(1, ("::1", 7000), True)
    err = error_reply(b"WRONGTYPE Operation against a key")
    assert isinstance(err, ServerError) and not isinstance(err, SlotUnserved) and "WRONGTYPE" in str(err)
    down = error_reply(b"CLUSTERDOWN Hash slot not served")
    assert isinstance(down, SlotUnserved) and str(down) == "CLUSTERDOWN Hash slot not served"
    for out_of_range in (b"MOVED 16384 h:7000", b"ASK 1 h:0", b"MOVED 1 h:65536"):  # no slot or port names these
        assert isinstance(error_reply(out_of_range), ServerError), out_of_range


def test_replies_of_every_kind(valkey_server):
    """Simple strings, integers, bulk (and nil), arrays and errors parse; the connection stays in step."""
    conn = Connection(("127.0.0.1", valkey_server.port), ConnectOptions(1.0, 1.0))
    try:
        conn.send([command(b"SET", b"r:k", b"v" * 70_000), command(b"GET", b"r:k"), command(b"GET", b"r:none"),
                   command(b"EXISTS", b"r:k"), command(b"MGET", b"r:none", b"r:none"), command(b"NOSUCHCMD"),
                   command(b"PING")])
        assert conn.reply() == b"OK"
        assert conn.reply() == b"v" * 70_000  # longer than the read buffer
        assert conn.reply() is None and conn.reply() == 1 and conn.reply() == [None, None]
        assert isinstance(conn.reply(), ServerError) and conn.reply() == b"PONG"
        conn.send([command(b"EXISTS", b"r:k"), command(b"EXISTS", b"r:none")])
        assert conn.small_ints(2) == [1, 0]
    finally:
        conn.close()


def test_send_resumes_partial_writes_and_splits_past_iov_max(valkey_server):
    """A tiny send buffer forces partial ``sendmsg`` writes and 3,000 buffers exceed IOV_MAX;
    every byte arrives in order."""
    import socket

    conn = Connection(("127.0.0.1", valkey_server.port), ConnectOptions(5.0, 5.0))
    try:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        value = bytes(range(256)) * 4096  # 1 MiB, sent as three views, one of them empty
        view = memoryview(value)
        conn.send([b"*3\r\n$3\r\nSET\r\n$4\r\nr:pw\r\n$%d\r\n" % len(value), view[:1000], view[1000:1000], view[1000:],
                   b"\r\n"])
        assert conn.reply() == b"OK"
        pieces = [b"*2\r\n", b"$6\r\n", b"EXISTS\r\n", b"$4\r\n", b"r:pw\r\n"] * 600  # 600 commands, 3,000 buffers
        conn.send(pieces)
        assert [conn.reply() for _ in range(600)] == [1] * 600
        conn.send([command(b"GET", b"r:pw")])
        assert conn.reply() == value
    finally:
        conn.close()


class _RawServer:
    """One accepted loopback connection whose bytes the test writes itself (no login is asked for)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]

    def __enter__(self) -> tuple[Connection, socket.socket]:
        self.conn = Connection(self.address, ConnectOptions(1.0, 1.0))
        self.peer, _ = self.listener.accept()
        return self.conn, self.peer

    def __exit__(self, *exc: object) -> None:
        self.conn.close()
        self.peer.close()
        self.listener.close()


@pytest.mark.parametrize("ahead", [4, 1 << 16])
def test_read_bulk_fills_several_buffers_from_the_read_buffer_or_the_socket(ahead):
    """Whether the header's read took part of the bulk into the read buffer (``ahead`` 64 KiB) or left it in
    the socket (``ahead`` = the header's length), the buffers get the bulk's bytes and the next reply follows."""
    with _RawServer() as (conn, peer):
        peer.sendall(b"$10\r\n0123456789\r\n+OK\r\n")
        head, body = bytearray(3), bytearray(7)
        assert conn.line(ahead=ahead) == b"$10"
        conn.read_bulk([memoryview(head), memoryview(body)])
        assert (head, body) == (b"012", b"3456789")
        assert conn.reply() == b"OK"


def test_a_header_read_with_its_length_ahead_leaves_the_bulk_in_the_socket():
    """``line(ahead=len(header))`` takes no byte of the bulk: it is still in the socket for ``read_bulk``."""
    with _RawServer() as (conn, peer):
        peer.sendall(b"$5\r\nhello\r\n")
        time.sleep(0.05)
        assert conn.line(ahead=4) == b"$5"
        assert conn.sock.recv(64, socket.MSG_PEEK) == b"hello\r\n"
        out = bytearray(5)
        conn.read_bulk([memoryview(out)])
        assert out == b"hello"


def test_read_bulk_resumes_a_trickled_bulk_and_refuses_one_not_closed_by_crlf():
    """A bulk that arrives in pieces is filled across buffers; one ending in other bytes than CRLF raises
    ``ConnectionError`` (the connection is out of step)."""
    with _RawServer() as (conn, peer):
        def trickle() -> None:
            for piece in (b"$8\r\nab", b"cde", b"fgh", b"\r", b"\n$2\r\nxyZZ"):
                peer.sendall(piece)
                time.sleep(0.02)

        writer = threading.Thread(target=trickle)
        writer.start()
        try:
            first, second = bytearray(4), bytearray(4)
            assert conn.line(ahead=4) == b"$8"
            conn.read_bulk([memoryview(first), memoryview(second)])
            assert (first, second) == (b"abcd", b"efgh")
            assert conn.line(ahead=4) == b"$2"
            with pytest.raises(ConnectionError, match="not CRLF"):
                conn.read_bulk([memoryview(bytearray(2))])
        finally:
            writer.join()


def _congestion(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="TCP_CONGESTION is Linux-only")
def test_a_loopback_connection_uses_reno_and_a_remote_one_the_systems_choice():
    """Reno (no pacing) on a loopback peer, set before the handshake; any other peer keeps the system default."""
    from kvkit.testing.servers import non_loopback_address_or_skip

    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        if "reno" not in f.read().split():
            pytest.skip("this kernel offers no Reno")
    with _RawServer() as (conn, _):
        assert _congestion(conn.sock) == "reno"
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        default = f.read().strip()
    remote = non_loopback_address_or_skip()
    with socket.create_server((remote, 0)) as listener:
        conn = Connection(listener.getsockname()[:2], ConnectOptions(1.0, 1.0))
        try:
            assert _congestion(conn.sock) == default
        finally:
            conn.close()
