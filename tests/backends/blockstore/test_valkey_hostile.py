"""The Valkey store against a server that answers what no Valkey would: a scripted RESP responder on loopback.

Whatever the replies (too long, too deep, out of range, of the wrong kind), every call answers by its
deadline and never raises: the keys fail, the node that sent it is marked down, and no reply is ever
taken for another command's (the connection never falls out of step).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable

import pytest

from kvkit.backends.blockstore import link
from kvkit.backends.blockstore.resp import MAX_REPLY_BULK, key_slot
from kvkit.backends.blockstore.valkey import ValkeyStore

DEADLINE = 0.5
SLACK = 1.0  # scheduling noise on a busy 2-core machine


def _commands(buf: bytearray) -> list[list[bytes]]:
    """The whole RESP commands at the head of ``buf`` (consumed), each as its arguments."""
    out = []
    while buf.startswith(b"*"):
        end = buf.find(b"\r\n")
        if end < 0:
            break
        pos, args = end + 2, []
        for _ in range(int(buf[1:end])):
            head = buf.find(b"\r\n", pos)
            if head < 0:
                return out
            size = int(buf[pos + 1:head])
            if len(buf) < head + 2 + size + 2:
                return out
            args.append(bytes(buf[head + 2:head + 2 + size]))
            pos = head + 2 + size + 2
        out.append(args)
        del buf[:pos]
    return out


_NO_INFO = b"-ERR unknown command 'INFO'\r\n"


class Scripted:
    """A loopback server answering each command with ``answer(args)`` (its port is ``self.port``).

    ``answer`` may read ``self.port``, and ``self.local.dialed``: the address its client connected to (with
    ``every_loopback``, the server listens on every address and serves clients of any loopback one, 127.0.0.0/8:
    as many Cluster nodes as a test names); a Cluster one answers ``CLUSTER SLOTS`` itself. ``INFO``, which a
    store asks each connection it opens (the server's ``run_id``), is refused as by a server that renamed it away,
    so ``answer`` sees the calls' commands only.
    """

    def __init__(self, answer: Callable[[list[bytes]], bytes], every_loopback: bool = False) -> None:
        self.answer = answer
        self.local = threading.local()
        self.listener = socket.create_server(("0.0.0.0" if every_loopback else "127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.peers: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                peer, _ = self.listener.accept()
            except OSError:
                return
            self.peers.append(peer)
            threading.Thread(target=self._talk, args=(peer,), daemon=True).start()

    def _talk(self, peer: socket.socket) -> None:
        self.local.dialed = peer.getsockname()[0]
        if not ipaddress.ip_address(peer.getpeername()[0]).is_loopback:
            peer.close()
            return
        buf = bytearray()
        with contextlib.suppress(OSError):
            while data := peer.recv(1 << 16):
                buf += data
                peer.sendall(b"".join(_NO_INFO if args[0] == b"INFO" else self.answer(args)
                                      for args in _commands(buf)))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        for peer in self.peers:
            peer.close()
        self.thread.join(5.0)


@pytest.fixture
def scripted():
    """``scripted(answer)`` starts a :class:`Scripted` server; each is closed after the test."""
    servers: list[Scripted] = []

    def start(answer, **kwargs):
        servers.append(Scripted(answer, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _slots(port: int, start: bytes = b":0", end: bytes = b":16383", node_port: bytes | None = None) -> bytes:
    """A CLUSTER SLOTS reply: one range, owned by ``127.0.0.1:node_port`` (default ``port``)."""
    node = b":%d" % port if node_port is None else node_port
    return b"*1\r\n*3\r\n" + start + b"\r\n" + end + b"\r\n*2\r\n$9\r\n127.0.0.1\r\n" + node + b"\r\n"


def _store(port: int, **kwargs) -> ValkeyStore:
    kwargs.setdefault("retry_interval_s", 30.0)
    return ValkeyStore([("127.0.0.1", port)], request_timeout_s=DEADLINE, connect_timeout_s=DEADLINE, **kwargs)


def _bounded(call):
    start = time.monotonic()
    out = call()
    assert time.monotonic() - start <= DEADLINE + SLACK, f"a call took {time.monotonic() - start:.2f} s"
    return out


def _put(store, keys):
    ticket = store.put(keys, [[memoryview(b"v")] for _ in keys])
    return _bounded(lambda: store.poll([ticket], DEADLINE + SLACK))[0]


@pytest.mark.parametrize(("reply", "why"), [
    (b"$99999999999999\r\n", "longer than"),  # a bulk no memory holds
    (b"*1\r\n" * 5000, "nested deeper than"),  # deeper than Python's recursion limit
])
@pytest.mark.parametrize("cluster", [False, True])
def test_a_reply_too_long_or_too_deep_fails_the_call_and_never_raises(scripted, reply, why, cluster):
    """EXISTS (or CLUSTER SLOTS) answered with a bulk of 100 TB or arrays nested 5,000 deep: ``contains`` and
    ``ping`` answer at once (nothing found, a transport failure) rather than raising MemoryError or
    RecursionError, and the node is marked down (a reply that is not what Valkey sends is evidence)."""
    server = scripted(lambda args: reply)
    store = _store(server.port, cluster=cluster)
    try:
        assert _bounded(lambda: store.contains([b"a", b"b"])) == 0
        assert why in store.last_error and "protocol error" in store.last_error, store.last_error
        assert list(store.down_nodes) == [("127.0.0.1", server.port)]
        assert (_bounded(store.ping) or "").startswith("transport:")
    finally:
        store.close()


@pytest.fixture
def streaming():
    """``streaming(head, element, count)``: a loopback server's port that answers its first command with
    ``head`` and then ``element`` ``count`` times, one send each (it holds one element, however much it sends)."""
    listeners: list[socket.socket] = []

    def serve(listener, head, element, count):
        with contextlib.suppress(OSError):
            peer, _ = listener.accept()
            with peer:
                peer.recv(1 << 16)
                peer.sendall(head)
                for _ in range(count):
                    peer.sendall(element)

    def start(head: bytes, element: bytes, count: int) -> int:
        listeners.append(socket.create_server(("127.0.0.1", 0)))
        threading.Thread(target=serve, args=(listeners[-1], head, element, count), daemon=True).start()
        return listeners[-1].getsockname()[1]

    yield start
    for listener in listeners:
        listener.close()


@pytest.mark.parametrize(("head", "element", "count"), [
    (b"*512\r\n", b"$1048576\r\n" + b"v" * (1 << 20) + b"\r\n", 512),  # 512 MiB of 1 MiB bulks
    (b"*10000\r\n", b"+" + b"v" * 60_000 + b"\r\n", 10_000),  # 600 MB of simple strings
    (b"*100000000\r\n", b"*0\r\n", 4_000_000),  # 100 million empty arrays announced, 4 million sent
])
def test_a_reply_holding_more_than_a_reply_may_is_refused_before_it_fills_memory(streaming, head, element, count):
    """EXISTS answered with an array of many bulks or lines, each short enough, or with more elements than a
    reply may hold: the reply is refused once it would hold more than 64 MiB or a million elements (an announced
    count at once), so one ``contains`` never holds much more than that (before: what the server sent in the
    deadline, 1,080 MiB at the peak for 512 MiB of bulks), the node is marked down, nothing raises. The deadline
    (10 s) is long enough that the limit, not the deadline, ends the reply on a busy machine."""
    deadline = 10.0
    store = ValkeyStore([("127.0.0.1", streaming(head, element, count))], request_timeout_s=deadline,
                        connect_timeout_s=deadline, retry_interval_s=30.0)
    tracemalloc.start()
    try:
        start = time.monotonic()
        assert store.contains([b"a"]) == 0
        assert time.monotonic() - start <= deadline + SLACK
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        store.close()
    assert peak < 3 * MAX_REPLY_BULK, f"{peak >> 20} MiB at the peak"
    assert "protocol error: a reply" in store.last_error and store.down_nodes, store.last_error


@pytest.mark.parametrize("redirect", [b"-MOVED 16384 127.0.0.1:%d\r\n", b"-MOVED 99999 127.0.0.1:%d\r\n",
                                      b"-ASK 20000 127.0.0.1:%d\r\n", b"-MOVED 7 127.0.0.1:99999\r\n"])
def test_a_redirect_out_of_range_fails_its_keys_and_never_raises(scripted, redirect):
    """A Cluster node answering MOVED/ASK to a slot past 16383 or a port past 65535: the keys fail with the
    server's words (no slot is re-mapped, no other port is tried), the call answers, nothing raises."""
    server = scripted(lambda args: _slots(server.port) if args[0] == b"CLUSTER" else redirect.replace(
        b"%d", b"%d" % server.port))
    store = _store(server.port, cluster=True)
    try:
        assert _bounded(lambda: store.contains([b"a", b"b"])) == 0
        result = _put(store, [b"a"])
        assert result.failed == (0,) and not result.transport_failed, result
        assert redirect.split()[0][1:].decode() in result.error, result
        assert store.down_nodes == {}
    finally:
        store.close()


@pytest.mark.parametrize("slots", [
    dict(end=b":999999999999"),  # a range no list holds
    dict(end=b":16384"), dict(start=b":-5"), dict(start=b":9", end=b":3"),
    dict(node_port=b":99999"), dict(node_port=b":65536"),
])
def test_a_slot_map_out_of_range_is_refused_and_never_raises(scripted, slots):
    """CLUSTER SLOTS naming slots outside 0-16383, a range that ends before it starts, or a port outside
    0-65535 (0 is a failed node's unknown address): the map is refused (the node is marked down), every call
    answers failed, none raises."""
    server = scripted(lambda args: _slots(server.port, **slots) if args[0] == b"CLUSTER" else b":1\r\n")
    store = _store(server.port, cluster=True)
    try:
        assert _bounded(lambda: store.contains([b"a", b"b"])) == 0
        assert "CLUSTER SLOTS" in store.last_error, store.last_error
        result = _put(store, [b"a"])
        assert result.failed == (0,) and result.transport_failed, result
    finally:
        store.close()


@pytest.mark.parametrize("ranges", [[(0, 9000), (8000, 16383)], [(0, 16383)] * 20_000])
def test_a_slot_map_listing_a_slot_twice_is_refused_by_the_deadline(scripted, ranges):
    """CLUSTER SLOTS listing a slot in two ranges (Valkey lists each once): two that overlap, or the whole range
    0-16383 20,000 times (within what a reply may hold). The map is refused at the first slot listed twice (the
    node is marked down) and ``contains`` answers by its deadline (before: the map was used, each range written
    into it whole: 40 us a range on the caller's thread, 160,000 ranges took 6.5 s past a 0.5 s deadline)."""
    entry = b"*3\r\n:%d\r\n:%d\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n"
    server = scripted(lambda args: b"*%d\r\n" % len(ranges) + b"".join(
        entry % (start, end, server.port) for start, end in ranges) if args[0] == b"CLUSTER" else b":1\r\n")
    deadline = 3.0
    store = ValkeyStore([("127.0.0.1", server.port)], cluster=True, request_timeout_s=deadline,
                        connect_timeout_s=deadline, retry_interval_s=30.0)
    try:
        start = time.monotonic()
        assert store.contains([b"a", b"b"]) == 0
        assert time.monotonic() - start <= deadline + SLACK, f"a call took {time.monotonic() - start:.2f} s"
        assert "overlap a range listed before them" in store.last_error, store.last_error
        assert list(store.down_nodes) == [("127.0.0.1", server.port)]
    finally:
        store.close()


def test_a_reply_arriving_faster_than_it_is_read_ends_with_the_deadline(scripted):
    """CLUSTER SLOTS answered with one range and 900,000 one-byte entries after its node (where replicas are
    listed; 8 MB, within what a reply may hold), sent at once: the bytes are always there to receive, and reading
    them stops at the call's deadline, so ``contains`` answers by then, nothing found (before: the deadline was
    looked at only when no byte was there, the whole reply was read, 3 s past a 0.5 s deadline, and its map used).
    The node was sending all along: it is not marked down."""
    extra = 900_000
    server = scripted(lambda args: b"*1\r\n*%d\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n%s" % (
        3 + extra, server.port, b"$1\r\nr\r\n" * extra) if args[0] == b"CLUSTER" else b":1\r\n")
    store = _store(server.port, cluster=True)
    try:
        assert _bounded(lambda: store.contains([b"a", b"b"])) == 0
        assert store.down_nodes == {}
    finally:
        store.close()


@pytest.mark.parametrize("login", [dict(password="pw"), dict(db=3)])
def test_a_server_that_never_answers_the_login_is_marked_down_once_it_had_the_connect_budget(scripted, login):
    """A server that takes the connection and never answers its AUTH (or SELECT): a login unanswered for the whole
    connect budget (0.3 s, less than half the 2 s deadline) is evidence against the node, as a connect or a TLS
    handshake that times out is: marked down by the first call, the next fail at once (before: never marked down,
    every call waited the connect budget again). A login that the call's own deadline cut short is none."""
    server = scripted(lambda args: b"")
    store = ValkeyStore([("127.0.0.1", server.port)], request_timeout_s=2.0, connect_timeout_s=0.3,
                        retry_interval_s=30.0, **login)
    try:
        assert store.contains([b"a"], timeout_s=0.1) == 0
        assert store.down_nodes == {}, store.down_nodes
        start = time.monotonic()
        assert store.contains([b"a"]) == 0
        assert time.monotonic() - start <= 0.3 + SLACK
        assert list(store.down_nodes) == [("127.0.0.1", server.port)], store.last_error
        assert "logging in" in store.last_error, store.last_error
        start = time.monotonic()
        assert store.contains([b"a"]) == 0
        assert time.monotonic() - start < 0.1
    finally:
        store.close()


def test_a_failed_node_listed_at_port_0_fails_only_its_own_slots(scripted):
    """CLUSTER SLOTS lists a failed node, whose address is unknown, at port 0 (as Valkey does): the map is used,
    the keys of the live node's slots are served, only the failed node's fail, and the live node stays up."""
    def answer(args):
        if args[0] == b"CLUSTER":
            return (b"*2\r\n*3\r\n:0\r\n:8191\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n"
                    b"*3\r\n:8192\r\n:16383\r\n*2\r\n$0\r\n\r\n:0\r\n" % server.port)
        return b"+OK\r\n"

    server = scripted(answer)
    store = _store(server.port, cluster=True)
    try:
        keys = [b"kvkit:port0:%d" % i for i in range(40)]
        result = _put(store, keys)
        on_failed = {i for i, k in enumerate(keys) if key_slot(k) >= 8192}
        assert 0 < len(on_failed) < len(keys) and set(result.failed) == on_failed, result
        assert ("127.0.0.1", server.port) not in store.down_nodes
    finally:
        store.close()


def test_a_set_answered_with_an_array_never_lends_its_reply_to_the_next_put(scripted):
    """A SET answered ``*1 +OK`` (no SET answers an array): the put fails as a protocol error and the
    connection is dropped, so the next put, which the server refuses (``-OOM``), is reported failed, not
    ``ok`` with the first SET's leftover ``+OK``."""
    replies = iter([b"*1\r\n+OK\r\n", b"-OOM command not allowed when used memory > 'maxmemory'\r\n"])
    server = scripted(lambda args: next(replies, b"-ERR no more\r\n"))
    store = _store(server.port, retry_interval_s=0.05)
    try:
        first = _put(store, [b"a"])
        assert first.transport_failed and "protocol error" in first.error, first
        time.sleep(0.06)  # the node is tried again
        second = _put(store, [b"b"])
        assert second.failed == (0,) and "OOM" in second.error, second
    finally:
        store.close()


def _node_threads() -> int:
    return sum(t.name == "kvkit-valkey-node" for t in threading.enumerate())


def test_a_slot_map_naming_more_nodes_than_a_cluster_has_is_refused(scripted, monkeypatch):
    """CLUSTER SLOTS naming one node more than :data:`~kvkit.backends.blockstore.link.MAX_NODES` (each slot range
    at another loopback address): the map is refused, nothing is connected to (before: a socket and a thread per
    node named, 2,000 nodes gave 2,000 sockets and 1,999 threads), every call answers failed."""
    monkeypatch.setattr(link, "MAX_NODES", 16)
    nodes = link.MAX_NODES + 1

    def answer(args):
        if args[0] != b"CLUSTER":
            return b":1\r\n"
        hosts = [b"127.0.1.%d" % (i + 1) for i in range(nodes)]
        entry = b"*3\r\n:%d\r\n:%d\r\n*2\r\n$%d\r\n%s\r\n:%d\r\n"
        return b"*%d\r\n" % nodes + b"".join(entry % (i * 64, i * 64 + 63, len(h), h, server.port)
                                              for i, h in enumerate(hosts))

    server = scripted(answer, every_loopback=True)
    store = _store(server.port, cluster=True)
    threads = _node_threads()
    try:
        assert _bounded(lambda: store.contains([b"k%d" % i for i in range(200)])) == 0
        assert "more than a Cluster has" in store.last_error, store.last_error
        assert len(server.peers) == 1 and _node_threads() == threads
    finally:
        store.close()


def test_redirects_to_ever_new_nodes_leave_the_link_within_its_node_limit(scripted, monkeypatch):
    """A node answering every key ASK to a loopback address never named before, call after call: the link stays
    connected to at most :data:`~kvkit.backends.blockstore.link.MAX_NODES` nodes (the asked nodes of past calls are
    let go first) and its crew within as many threads; keys beyond fail unreached and nothing raises (before:
    every call added a socket and a thread per key, 300 keys a call held 1,501 sockets after 5 calls)."""
    monkeypatch.setattr(link, "MAX_NODES", 16)
    fresh = iter(range(1, 1 << 16))

    def answer(args):
        if args[0] == b"CLUSTER":
            return _slots(server.port)
        if args[0] == b"EXISTS" and server.local.dialed == "127.0.0.1":
            n = next(fresh)
            return b"-ASK %d 127.2.%d.%d:%d\r\n" % (key_slot(args[1]), n // 250, 1 + n % 250, server.port)
        return b":1\r\n" if args[0] == b"EXISTS" else b"+OK\r\n"

    server = scripted(answer, every_loopback=True)
    store = _store(server.port, cluster=True)
    threads = _node_threads()
    try:
        keys = [b"k%d" % i for i in range(3 * link.MAX_NODES)]
        for _ in range(3):
            assert _bounded(lambda: store.contains(keys)) == link.MAX_NODES - 1  # the seed and 15 asked nodes
            assert len(store._lookup._conns) <= link.MAX_NODES
            assert _node_threads() - threads <= link.MAX_NODES - 1
        assert store.down_nodes == {}
    finally:
        store.close()


@pytest.mark.parametrize("cluster", [False, True])
def test_a_reply_to_no_command_is_never_taken_for_the_next_calls(scripted, cluster):
    """A server that answers one EXISTS twice (``:0`` and an extra ``:1``): the extra reply is found before the
    next call uses the connection, which is dropped and the node marked down, so the next ``contains`` is not
    answered with it (before: the key ``b``, which the server answers ``:0``, was found)."""
    def answer(args):
        if args[0] == b"CLUSTER":
            return _slots(server.port)
        return b":0\r\n:1\r\n" if args[1:] == [b"a"] else b":0\r\n"

    server = scripted(answer)
    store = _store(server.port, cluster=cluster)
    try:
        assert _bounded(lambda: store.contains([b"a"])) == 0
        assert _bounded(lambda: store.contains([b"b"])) == 0
        assert "no command asked for" in store.last_error, store.last_error
        assert list(store.down_nodes) == [("127.0.0.1", server.port)]
    finally:
        store.close()


_ESCAPES = b"\x1b]52;c;cHduZWQ=\x07\x1b[2J\r\x00\xff"  # a clipboard write, a screen clear, a return, NUL, not UTF-8


@pytest.mark.parametrize("reply", [b"-ERR %s\r\n" % _ESCAPES, b"-OOM %s\r\n" % _ESCAPES.replace(b"\r", b"")])
def test_a_servers_words_are_shown_with_their_control_bytes_escaped(scripted, reply):
    """An error reply holding terminal control sequences (or bytes not UTF-8): the key's error, which reaches
    warnings, status lines and logs, shows them escaped (``\\x1b``), never raw (before: as the server sent them)."""
    server = scripted(lambda args: reply)
    store = _store(server.port)
    try:
        result = _put(store, [b"a"])
        assert result.failed == (0,) and "\\x1b]52" in result.error, result
        assert result.error.isprintable(), repr(result.error)
    finally:
        store.close()


@pytest.mark.parametrize("host", [b"\x1b[2Jevil", b"ev il", b"evil\xff"])
@pytest.mark.parametrize("via", ["redirect", "slot map"])
def test_a_node_named_with_control_bytes_is_refused(scripted, host, via):
    """A MOVED/ASK or a CLUSTER SLOTS entry naming a host that is no host name (control bytes, a space, bytes not
    ASCII): it names no node, nothing is connected to it, and the errors show no raw control byte (before: the
    host, raw, was looked up and shown in every error about it)."""
    def answer(args):
        if args[0] == b"CLUSTER":
            if via == "redirect":
                return _slots(server.port)
            return b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$%d\r\n%s\r\n:%d\r\n" % (len(host), host, server.port)
        return b"-MOVED %d %s:%d\r\n" % (key_slot(args[1]), host, server.port)

    server = scripted(answer)
    store = _store(server.port, cluster=True)
    try:
        result = _put(store, [b"a"])
        assert result.failed == (0,) and result.error.isprintable(), repr(result.error)
        assert store.last_error.isprintable(), repr(store.last_error)
        assert all(node == ("127.0.0.1", server.port) for node in store.down_nodes), store.down_nodes
    finally:
        store.close()


def test_bulk_lengths_announced_by_many_nodes_cost_no_memory_before_their_bytes(scripted):
    """16 Cluster nodes each answering EXISTS with a bulk of 32 MiB announced, whose bytes never come: the call
    answers by its deadline holding far less than what was announced (before: 32 MiB allocated per node before a
    byte of it arrived, 512 MiB at the peak for one ``contains``)."""
    nodes = 16

    def answer(args):
        if args[0] != b"CLUSTER":
            return b"$%d\r\n" % (MAX_REPLY_BULK // 2)
        hosts = [b"127.0.2.%d" % (i + 1) for i in range(nodes)]
        entry = b"*3\r\n:%d\r\n:%d\r\n*2\r\n$%d\r\n%s\r\n:%d\r\n"
        step = 16384 // nodes
        return b"*%d\r\n" % nodes + b"".join(entry % (i * step, i * step + step - 1, len(h), h, server.port)
                                              for i, h in enumerate(hosts))

    server = scripted(answer, every_loopback=True)
    store = _store(server.port, cluster=True)
    tracemalloc.start()
    try:
        assert _bounded(lambda: store.contains([b"k%d" % i for i in range(400)])) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        store.close()
    assert peak < MAX_REPLY_BULK // 4, f"{peak >> 20} MiB at the peak"


def test_redirects_to_ever_new_dead_nodes_leave_the_store_remembering_a_bounded_number(scripted, monkeypatch):
    """A node answering every key ASK to a loopback address never named before, where nothing listens: the store
    remembers at most :data:`~kvkit.backends.blockstore.link.MAX_NODES` nodes down (and as many connected to, for
    its watchers), the ones tripped longest ago forgotten first (before: every address ever named stayed, about
    300 bytes each: 10,500 after 20 calls of 500 keys)."""
    monkeypatch.setattr(link, "MAX_NODES", 16)
    fresh = iter(range(1, 1 << 16))

    def answer(args):
        if args[0] == b"CLUSTER":
            return _slots(server.port)
        n = next(fresh)
        return b"-ASK %d 127.3.%d.%d:1\r\n" % (key_slot(args[1]), n // 250, 1 + n % 250)

    server = scripted(answer)
    store = _store(server.port, cluster=True)
    try:
        keys = [b"k%d" % i for i in range(3 * link.MAX_NODES)]
        for _ in range(3):
            assert _bounded(lambda: store.contains(keys)) == 0
            assert 0 < len(store.down_nodes) <= link.MAX_NODES, len(store.down_nodes)
            assert len(store._connected.seen) <= link.MAX_NODES
    finally:
        store.close()


@pytest.mark.parametrize("kind", [b"MOVED", b"ASK"])
def test_two_nodes_redirecting_to_each_other_forever_fail_the_keys_by_the_deadline(scripted, kind):
    """Two Cluster nodes answering every key MOVED (or ASK) to the other: each key fails after a bounded number
    of redirects ("still redirected"), every call answers by its deadline, neither node is marked down."""
    def answer(args):  # one server: 127.0.0.1 and 127.0.0.2 are its two nodes
        if args[0] == b"CLUSTER":
            return _slots(server.port)
        if args[0] == b"ASKING":
            return b"+OK\r\n"
        other = b"127.0.0.2" if server.local.dialed == "127.0.0.1" else b"127.0.0.1"
        return b"-%s %d %s:%d\r\n" % (kind, key_slot(args[1]), other, server.port)

    server = scripted(answer, every_loopback=True)
    store = _store(server.port, cluster=True)
    try:
        assert _bounded(lambda: store.contains([b"a", b"b"])) == 0
        result = _put(store, [b"a", b"b"])
        assert result.failed == (0, 1) and "still redirected" in result.error, result
        assert store.down_nodes == {}
    finally:
        store.close()
