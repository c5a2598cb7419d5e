"""The Valkey store under faults that keep bytes flowing or hit one node: a slow link, a server that closes
idle connections, a Cluster with a dead node, a failover, a store dropped without ``close``.

Each test bounds the time of every call: a whole call is done by its deadline however slowly bytes come.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import select
import socket
import threading
import time

import pytest

from kvkit.backends.blockstore.link import Identities
from kvkit.backends.blockstore.resp import Connection, ConnectOptions, command, key_slot
from kvkit.backends.blockstore.valkey import ValkeyStore
from kvkit.testing.forked import in_child
from kvkit.testing.servers import LocalCluster, LocalServer, server_binary, server_binary_or_skip
from kvkit.testing.slowlink import SlowLink

DEADLINE = 0.5
SLACK = 1.0  # scheduling noise on a busy 2-core machine


def _store(address, **kwargs):
    kwargs.setdefault("request_timeout_s", DEADLINE)
    kwargs.setdefault("connect_timeout_s", DEADLINE)
    kwargs.setdefault("retry_interval_s", 0.2)
    return ValkeyStore([address], **kwargs)


def _values(n, size, seed=0):
    return [os.urandom(size) for _ in range(n)]


def _put(store, keys, values, limit=DEADLINE):
    ticket = store.put(keys, [[memoryview(v)] for v in values])
    return _result(store, ticket, time.monotonic(), limit)


def _result(store, ticket, submitted, limit):
    """``ticket``'s result, asserting it came within ``limit`` seconds of ``submitted``."""
    results = store.poll([ticket], limit + SLACK)
    assert time.monotonic() - submitted <= limit + SLACK, "a call was reported after its deadline"
    assert [r.ticket for r in results] == [ticket], results
    return results[0]


def _get(store, keys, size, limit=DEADLINE):
    buffers = [bytearray(size) for _ in keys]
    ticket = store.get(keys, [[memoryview(b)] for b in buffers])
    return _result(store, ticket, time.monotonic(), limit), buffers


def _sockets() -> int:
    """Sockets this process holds open."""
    fds = os.listdir("/proc/self/fd")
    out = 0
    for fd in fds:
        try:
            out += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return out


def _io_threads() -> int:
    """The I/O threads of the stores alive now (two a store: its put lane's and its get lane's)."""
    return sum(t.name in ("kvkit-valkey-put", "kvkit-valkey-get") and t.is_alive() for t in threading.enumerate())


def _crew_threads() -> set[threading.Thread]:
    """The threads that run Cluster nodes' pipelines side by side, alive now."""
    return {t for t in threading.enumerate() if t.name == "kvkit-valkey-node" and t.is_alive()}


def _eventually(condition, limit=5.0):
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- a slow link ------------------------------------------------------------------------------------------


def test_a_trickled_get_the_get_behind_it_and_a_put_beside_them_are_reported_by_their_deadlines(valkey_server):
    """A link moving 500 KB/s each way with 64 KiB in flight: a get of 4 x 2 MiB, a get queued behind it (its lane
    serves calls in order) and a put of 2 MiB (on its own lane) all fail by their deadlines; the node, which kept
    sending and taking bytes, is not marked down; once the link is fast again the same store reads the right
    bytes."""
    valkey_server.call(b"FLUSHALL")
    keys, size = [b"slow:%d" % i for i in range(4)], 2 << 20
    values = _values(4, size)
    direct = _store(("127.0.0.1", valkey_server.port), request_timeout_s=10.0)
    assert _put(direct, keys, values, 10.0).ok
    direct.close()
    with SlowLink(("127.0.0.1", valkey_server.port), rate=500_000, window=64 << 10) as link:
        store = _store(link.address)
        buffers = [bytearray(size) for _ in keys]
        start = time.monotonic()
        get = store.get(keys, [[memoryview(b)] for b in buffers])
        get_behind = store.get(keys[:1], [[memoryview(bytearray(size))]])
        put = store.put([b"slow:beside"], [[memoryview(values[0])]])
        got = _result(store, get, start, DEADLINE)
        behind = _result(store, get_behind, start, DEADLINE)
        beside = _result(store, put, start, DEADLINE)
        assert got.failed == (0, 1, 2, 3) and got.transport_failed and "deadline" in got.error, got
        assert behind.failed == (0,) and behind.transport_failed, behind
        assert beside.failed == (0,) and beside.transport_failed and "deadline" in beside.error, beside
        start = time.monotonic()
        assert store.contains(keys) in (0, 4)
        assert time.monotonic() - start <= DEADLINE + SLACK
        link.rate = None
        assert not store.down_nodes, "a slow node that kept sending was marked down"
        result, buffers = _get(store, keys, size)
        assert result.ok and buffers == values
        store.close()


def test_a_put_through_a_crawling_uplink_fails_by_its_deadline_and_never_marks_the_node_down(valkey_server):
    """A put of 2 MiB whose bytes cross to the server at 500 KB/s through a link that holds 64 KiB in flight (the
    link, not the node, is slow; deadline 2 s): the put goes into the socket long before the server has it, and
    its reply is awaited while the bytes still leave. It fails by its deadline, never raises, and the node is not
    marked down: it was still taking the bytes. Once the link is fast again the same store puts at once."""
    valkey_server.call(b"FLUSHALL")
    value = os.urandom(2 << 20)
    with SlowLink(("127.0.0.1", valkey_server.port), rate=500_000, window=64 << 10) as link:
        store = _store(link.address, request_timeout_s=2.0, connect_timeout_s=2.0, retry_interval_s=30.0)
        result = _put(store, [b"uplink"], [value], 2.0)
        assert result.transport_failed and "deadline" in result.error, result
        assert store.down_nodes == {}, "a node still taking the put's bytes was marked down"
        link.rate = None
        assert _put(store, [b"uplink"], [value], 2.0).ok
        result, buffers = _get(store, [b"uplink"], 2 << 20, 2.0)
        assert result.ok and buffers == [value]
        store.close()


def test_keys_whose_bytes_never_left_by_the_deadline_are_unsent_and_those_sent_unreached(valkey_server):
    """A put of 10,000 x 1 KiB through an uplink of 100 KB/s (64 KiB in flight; deadline 1 s) and one queued behind it:
    the keys whose bytes had begun to leave when the deadline passed are unreached (sent, unanswered), those none
    of whose bytes were written are unsent (the call's later keys, and the whole call queued behind it, whose
    deadline passed in the lane's queue); none is both, and the node, which kept taking bytes, is not marked
    down. A key the server stored is neither; a get's missing key is neither."""
    valkey_server.call(b"FLUSHALL")
    with SlowLink(("127.0.0.1", valkey_server.port), rate=100_000, window=64 << 10) as link:
        store = _store(link.address, request_timeout_s=1.0, connect_timeout_s=1.0, retry_interval_s=30.0)
        n = 10_000
        start = time.monotonic()
        crawling = store.put([b"unsent:%d" % i for i in range(n)], [[memoryview(bytes(1024))]] * n)
        behind = store.put([b"unsent:behind"], [[memoryview(b"v")]])
        crawled = _result(store, crawling, start, 1.0)
        queued = _result(store, behind, start, 1.0)
        landed = tuple(i for i in range(n) if i not in set(crawled.failed))
        assert "deadline" in crawled.error and crawled.unreached and crawled.unsent, crawled.error
        assert landed + crawled.unreached + crawled.unsent == tuple(range(n)), "not in the order they were sent"
        assert all(valkey_server.call(b"EXISTS", b"unsent:%d" % i) == 1 for i in landed[-3:])
        assert queued.failed == queued.unsent == (0,) and queued.unreached == (), queued
        assert store.down_nodes == {}, "a node still taking the put's bytes was marked down"
        link.rate = None
        stored = _put(store, [b"unsent:fast"], [b"v"], 1.0)
        assert stored.ok and stored.unsent == stored.unreached == (), stored
        (missing,) = store.poll([store.get([b"unsent:none"], [[memoryview(bytearray(1))]])], 1.0 + SLACK)
        assert missing.failed == (0,) and missing.unsent == missing.unreached == (), missing
        store.close()


def test_a_get_never_waits_behind_a_put_held_up_by_a_slow_node():
    """A Cluster whose node 0 is reached through a crawling uplink (it announces the link's port; 500 KB/s, 64 KiB
    in flight; deadline 3 s): a put of 4 x 1 MiB to node 0 holds its lane up to its deadline, node 0 still taking
    the bytes (never marked down). A get of node 1's keys submitted while that put is in flight is served, right
    bytes, within a quarter of the deadline: queued behind the put it would wait about the whole deadline."""
    deadline = 3.0
    with LocalCluster(binary=server_binary_or_skip()) as cluster, \
            SlowLink(("127.0.0.1", cluster.nodes[0].port), window=64 << 10) as link:
        slow, seed = cluster.nodes[0], cluster.nodes[1]
        slow.call(b"CONFIG", b"SET", b"cluster-announce-bus-port", b"%d" % (slow.port + 10000))
        slow.call(b"CONFIG", b"SET", b"cluster-announce-port", b"%d" % link.port)
        assert _eventually(lambda: link.port in {r[2][1] for r in seed.call(b"CLUSTER", b"SLOTS")}, 10.0)
        keys = [b"kvkit:lane:%d" % i for i in range(100)]
        to_slow = [k for k in keys if _owner(cluster, k) == 0][:4]
        healthy = [k for k in keys if _owner(cluster, k) == 1][:8]
        values = _values(len(healthy), 1000)
        store = ValkeyStore([("127.0.0.1", seed.port)], cluster=True, request_timeout_s=deadline,
                            connect_timeout_s=deadline, retry_interval_s=30.0)
        try:
            assert _put(store, healthy, values, deadline).ok and _get(store, healthy, 1000, deadline)[0].ok
            link.rate = 500_000
            put = store.put(to_slow, [[memoryview(v)] for v in _values(len(to_slow), 1 << 20)])
            time.sleep(0.3)  # the put's bytes are crossing the link
            start = time.monotonic()
            got, buffers = _get(store, healthy, 1000, deadline)
            took = time.monotonic() - start
            assert got.ok and buffers == values, got
            assert took < deadline / 4, f"the get of a healthy node waited {took:.2f} s behind a put"
            (held,) = store.poll([put], deadline + SLACK)
            assert held.transport_failed and "deadline" in held.error, held
            assert store.down_nodes == {}, "a node still taking the put's bytes was marked down"
        finally:
            store.close()


def test_contains_through_a_crawling_link_answers_by_its_deadline(valkey_server):
    """1,000 EXISTS whose replies crawl at 500 B/s: contains answers 0 within its deadline, never raises."""
    valkey_server.call(b"FLUSHALL")
    keys = [b"crawl:%d" % i for i in range(1000)]
    direct = _store(("127.0.0.1", valkey_server.port), request_timeout_s=10.0)
    assert _put(direct, keys, [b"v"] * len(keys), 10.0).ok
    direct.close()
    with SlowLink(("127.0.0.1", valkey_server.port), rate=500) as link:
        store = _store(link.address)
        start = time.monotonic()
        assert store.contains(keys) == 0
        assert time.monotonic() - start <= DEADLINE + SLACK
        link.rate = None
        assert store.contains(keys) == 1000
        store.close()


def test_contains_answers_within_its_timeout_through_a_far_link(valkey_server):
    """Every reply held 0.8 s (deadline 2 s): ``contains`` given 0 answers 0 without a round trip (no
    connection made); given 0.2 s it answers 0 by then, never raises, and the node is not marked down (a short
    budget is no evidence against it); given more than the reply takes, or none, it answers every key."""
    valkey_server.call(b"FLUSHALL")
    keys = [b"far:%d" % i for i in range(100)]
    direct = _store(("127.0.0.1", valkey_server.port))
    assert _put(direct, keys, [b"v"] * len(keys)).ok
    direct.close()
    with SlowLink(("127.0.0.1", valkey_server.port), latency=0.8) as link:
        store = _store(link.address, request_timeout_s=2.0, connect_timeout_s=2.0)
        start = time.monotonic()
        assert store.contains(keys, timeout_s=0.0) == 0 and link.connections == 0
        assert store.contains(keys, timeout_s=0.2) == 0
        took = time.monotonic() - start
        assert took <= 0.2 + 0.45, f"contains given 0.2 s took {took:.2f} s"  # the reply takes 0.8 s
        assert store.down_nodes == {}
        assert store.contains(keys, timeout_s=1.5) == 100 and store.contains(keys) == 100
        store.close()


def test_a_stalled_server_is_marked_down_and_its_calls_then_fail_at_once(own_server):
    """SIGSTOP: the first call waits its deadline and marks the node down; the next fail at once."""
    store = _store(("127.0.0.1", own_server.port))
    assert _put(store, [b"a"], [b"x"]).ok
    own_server.pause()
    try:
        result, _ = _get(store, [b"a"], 1)
        assert result.transport_failed and "timed out" in result.error
        assert list(store.down_nodes) == [("127.0.0.1", own_server.port)]
        start = time.monotonic()
        assert _put(store, [b"b"], [b"y"]).transport_failed
        assert store.contains([b"a"]) == 0
        assert time.monotonic() - start < 0.8 * DEADLINE, "a call waited on a node known to be down"
    finally:
        own_server.resume()
    assert _eventually(lambda: _put(store, [b"c"], [b"z"]).ok)
    store.close()


def test_a_stalled_node_that_every_link_waits_on_at_once_counts_one_failure(own_server):
    """SIGSTOP while a put, a get and a ``contains`` (three links: the two lanes and the caller's) wait on the
    node at once: each finds it stalled, and the node was found unusable once (``transport_failures`` counts
    the breakers opened, not the links that found the breaker open)."""
    store = _store(("127.0.0.1", own_server.port))
    assert _put(store, [b"a"], [b"x"]).ok and store.contains([b"a"]) == 1 and _get(store, [b"a"], 1)[0].ok
    own_server.pause()
    try:
        put = store.put([b"b"], [[memoryview(b"y")]])
        get = store.get([b"a"], [[memoryview(bytearray(1))]])
        assert store.contains([b"a"]) == 0
        results = store.poll([put, get], DEADLINE + SLACK)
        results += store.poll([put, get], DEADLINE + SLACK) if len(results) < 2 else []
        assert len(results) == 2 and all(r.transport_failed for r in results), results
        assert list(store.down_nodes) == [("127.0.0.1", own_server.port)]
        assert store.transport_failures == 1, "one stalled node was counted once per link that waited on it"
    finally:
        own_server.resume()
    store.close()


def test_a_put_held_by_a_write_pause_never_marks_down_a_node_that_answers_the_gets_meanwhile(own_server):
    """``CLIENT PAUSE WRITE`` (as a coordinated ``FAILOVER`` does): the put lane hears nothing for its whole
    deadline while the get lane's replies keep coming. The put fails by its deadline, unreached, but the node
    answered the other lane meanwhile: no evidence against it, so it is not marked down and the next gets and
    lookups are served."""
    store = _store(("127.0.0.1", own_server.port))
    assert _put(store, [b"a"], [b"x"]).ok and _get(store, [b"a"], 1)[0].ok
    own_server.call(b"CLIENT", b"PAUSE", b"%d" % int(4000 * DEADLINE), b"WRITE")
    try:
        put = store.put([b"b"], [[memoryview(b"y")]])
        submitted = time.monotonic()
        while time.monotonic() - submitted < 1.2 * DEADLINE:
            result, buffers = _get(store, [b"a"], 1)
            assert result.ok and buffers == [b"x"], result
            time.sleep(0.02)
        held = _result(store, put, submitted, DEADLINE)
        assert held.transport_failed and "timed out" in held.error, held
        assert store.down_nodes == {} and store.transport_failures == 0, store.down_nodes
        assert _get(store, [b"a"], 1)[0].ok and store.contains([b"a"]) == 1
    finally:
        own_server.call(b"CLIENT", b"UNPAUSE")
    assert _put(store, [b"c"], [b"z"]).ok
    store.close()


def test_connections_opened_during_a_write_pause_read_the_restart_marker_and_serve_reads(own_server):
    """A store that marks restarts (as the shared tier's does) opens its lookup and get connections while the
    server holds writes (``CLIENT PAUSE WRITE``): their first round trip reads the marker (``GET``), never waits
    on a write, so ``contains`` and ``get`` are served at once and nothing is marked down. Once writes resume,
    the marker is in place and a restart is still told by it."""
    address = ("127.0.0.1", own_server.port)
    own_server.call(b"SET", b"kvkit:acme:a", b"x")
    marked = _store(address)
    marked.mark_restarts_under(b"kvkit:acme:")
    assert _put(marked, [b"kvkit:acme:b"], [b"y"]).ok  # the marker found missing
    assert _put(marked, [b"kvkit:acme:b"], [b"y"]).ok  # and planted ahead of the next call
    marked.close()
    store = _store(address)
    store.mark_restarts_under(b"kvkit:acme:")
    own_server.call(b"CLIENT", b"PAUSE", b"%d" % int(4000 * DEADLINE), b"WRITE")
    try:
        start = time.monotonic()
        assert store.contains([b"kvkit:acme:a"]) == 1
        result, buffers = _get(store, [b"kvkit:acme:a", b"kvkit:acme:b"], 1)
        assert result.ok and buffers == [b"x", b"y"], result
        assert time.monotonic() - start < 0.5 * DEADLINE, "a read waited on the paused writes"
        assert store.down_nodes == {} and store.transport_failures == 0, store.down_nodes
    finally:
        own_server.call(b"CLIENT", b"UNPAUSE")
    assert _put(store, [b"kvkit:acme:c"], [b"z"]).ok and store.restarts == 0
    own_server.call(b"FLUSHALL")
    own_server.call(b"CLIENT", b"KILL", b"TYPE", b"normal")
    _reconnect_all(store, b"kvkit:acme:d")
    assert store.restarts == 1
    assert own_server.call(b"KEYS", b"kvkit:acme:restart-marker") == [b"kvkit:acme:restart-marker"]
    store.close()


@pytest.mark.parametrize("timeout", [math.inf, 1e10])
def test_a_poll_of_any_length_waits_for_the_stalled_calls_deadline(own_server, timeout):
    """poll(timeout=math.inf), or longer than the platform's longest wait, returns when the call is reported
    (by its deadline): no OverflowError."""
    store = _store(("127.0.0.1", own_server.port))
    own_server.pause()
    try:
        ticket = store.put([b"a"], [[memoryview(b"x")]])
        start = time.monotonic()
        [result] = store.poll([ticket], timeout=timeout)
        assert result.transport_failed and time.monotonic() - start < DEADLINE + SLACK
    finally:
        own_server.resume()
        store.close()


def test_a_host_that_never_answers_a_connect_is_marked_down_however_short_the_deadline():
    """A listener whose queue is full drops connects unanswered. With connect_timeout_s above request_timeout_s,
    the first call times out connecting within its deadline and marks the node down; the next fail at once."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        with socket.create_connection(address):  # queued, never accepted: the queue is full from now on
            store = _store(address, connect_timeout_s=4 * DEADLINE, retry_interval_s=30)
            try:
                start = time.monotonic()
                assert store.contains([b"a"]) == 0
                assert time.monotonic() - start < DEADLINE + SLACK
                assert list(store.down_nodes) == [address]
                start = time.monotonic()
                assert store.contains([b"a"]) == 0 and _put(store, [b"b"], [b"y"]).transport_failed
                assert time.monotonic() - start < 0.8 * DEADLINE, "a call waited on a node known to be down"
            finally:
                store.close()


def test_a_name_whose_first_address_never_answers_is_served_by_the_next(own_server, monkeypatch):
    """A host name resolving to two addresses, the first a host that never answers a connect: the connect
    budget is shared between them, so the call reaches the live one by its deadline and nothing is marked
    down."""
    from kvkit.backends.blockstore import resp

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        silent = listener.getsockname()
        with socket.create_connection(silent):  # queued, never accepted: the queue is full from now on
            peers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", silent),
                     (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", own_server.port))]
            monkeypatch.setattr(resp, "_resolve", lambda host, port, timeout: peers)
            store = _store(("kvkit-two-addresses.test", 6379), retry_interval_s=30)
            try:
                start = time.monotonic()
                assert _put(store, [b"two"], [b"v"]).ok
                assert store.contains([b"two"]) == 1
                assert time.monotonic() - start < 2 * DEADLINE + SLACK
                assert store.down_nodes == {}
            finally:
                store.close()


def test_a_tls_handshake_gets_only_what_the_connect_left_of_its_budget(monkeypatch):
    """A slow connect (1.8 s of a 2 s budget) to a host that then never answers the TLS handshake: the call
    answers by its deadline: the handshake gets only what the connect left."""
    from kvkit.backends.blockstore import resp

    connect = resp._connect

    def slow_connect(address, timeout, openings=None):
        sock = connect(address, timeout, openings)
        time.sleep(0.9 * timeout)  # the connect took most of its budget (a far host, a lost SYN)
        return sock

    monkeypatch.setattr(resp, "_connect", slow_connect)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # the kernel completes connects; nothing answers
        store = ValkeyStore([listener.getsockname()[:2]], tls=True, tls_verify=False, request_timeout_s=2.0,
                            connect_timeout_s=2.0)
        try:
            start = time.monotonic()
            assert store.contains([b"a"]) == 0
            assert time.monotonic() - start < 2.0 + 0.5, f"the call took {time.monotonic() - start:.2f} s"
        finally:
            store.close()


def test_a_tls_handshake_cut_short_by_the_call_deadline_is_no_evidence_against_the_node():
    """A host that completes connects and never answers the TLS handshake: a call whose deadline is a small
    share of the connect budget gives up by it without marking the node down (its silence was short, as a
    connect cut short by the deadline is none); one that waits the whole budget marks it down."""
    with socket.create_server(("127.0.0.1", 0)) as listener:  # the kernel completes connects; nothing answers
        address = listener.getsockname()[:2]
        store = _store(address, tls=True, tls_verify=False, request_timeout_s=4 * DEADLINE,
                       connect_timeout_s=4 * DEADLINE, retry_interval_s=30)
        try:
            start = time.monotonic()
            assert store.contains([b"a"], timeout_s=DEADLINE / 2) == 0
            assert time.monotonic() - start < DEADLINE / 2 + SLACK
            assert store.down_nodes == {}, "a handshake silent for a short deadline marked its node down"
            assert store.contains([b"a"]) == 0
            assert list(store.down_nodes) == [address]
        finally:
            store.close()


# -- a server that closes idle connections ---------------------------------------------------------------


def _idle_closed(server, clients=1):
    """Wait until the server dropped its idle clients (only the one asking remains)."""
    return _eventually(lambda: b"connected_clients:%d\r" % clients in server.call(b"INFO", b"clients"))


def test_connections_the_server_closed_for_idleness_are_reopened_unseen():
    """``timeout 1``: after both connections were closed by the server, contains, get and put just work."""
    with LocalServer(server_binary_or_skip(), args=["--timeout", "1"]) as server:
        store = _store(("127.0.0.1", server.port))
        keys, values = [b"idle:%d" % i for i in range(8)], _values(8, 1000)
        assert _put(store, keys, values).ok
        assert store.contains(keys) == 8
        assert _idle_closed(server)
        assert store.contains(keys) == 8
        result, buffers = _get(store, keys, 1000)
        assert result.ok and buffers == values
        assert _idle_closed(server)
        assert _put(store, [b"idle:more"], [b"v"]).ok
        assert store.transport_failures == 0 and not store.down_nodes
        store.close()


def test_a_connection_killed_mid_call_is_reopened_and_the_call_served_even_on_its_first_use(own_server):
    """``CLIENT KILL`` of the store's connection while its put waits on the server (writes paused by ``CLIENT
    PAUSE WRITE``, as a manual failover pauses them): the connection is reopened and the put served, nothing
    marked down, whether the connection was reused or opened by that very call (a store's first put)."""
    keys, values = [b"killed:%d" % i for i in range(4)], _values(4, 100_000)

    def killed_while_paused(store):
        """A put of ``keys`` by ``store``, its connection killed while the server holds it."""
        own_server.call(b"CLIENT", b"PAUSE", b"5000", b"WRITE")
        ticket, start = store.put(keys, [[memoryview(v)] for v in values]), time.monotonic()
        assert _eventually(lambda: b"blocked_clients:1\r" in own_server.call(b"INFO", b"clients"))  # it waits now
        assert own_server.call(b"CLIENT", b"KILL", b"TYPE", b"normal") >= 1
        own_server.call(b"CLIENT", b"UNPAUSE")
        return _result(store, ticket, start, 2.0)

    for reused in (False, True):
        store = _store(("127.0.0.1", own_server.port), request_timeout_s=2.0, connect_timeout_s=2.0,
                       retry_interval_s=30.0)
        if reused:
            assert _put(store, keys, values, 2.0).ok
        result = killed_while_paused(store)
        assert result.ok, result
        assert store.down_nodes == {} and store.transport_failures == 0
        got, buffers = _get(store, keys, 100_000, 2.0)
        assert got.ok and buffers == values
        store.close()


def test_a_node_that_closes_each_connection_after_a_long_silence_is_marked_down():
    """A host that takes each connection and its commands, sends nothing for 0.3 s (more than half the 0.5 s
    deadline) and closes it (a load balancer whose backend hangs): that is a stalled node, evidence against it
    however the wait ended. The first call is reported by its deadline and marks the node down; the next ones
    fail at once rather than each waiting its deadline again."""
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.02)

        def serve():
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(1.0)
                    with contextlib.suppress(OSError):
                        conn.recv(1 << 16)
                    stop.wait(0.6 * DEADLINE)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        store = _store(listener.getsockname()[:2], retry_interval_s=30.0)
        try:
            assert _put(store, [b"a"], [b"x"]).transport_failed
            assert list(store.down_nodes) == [listener.getsockname()[:2]]
            start = time.monotonic()
            assert store.contains([b"a"]) == 0 and _put(store, [b"b"], [b"y"]).transport_failed
            assert time.monotonic() - start < 0.8 * DEADLINE, "a call waited on a node known to be down"
        finally:
            store.close()
            stop.set()
            server.join(5.0)


def test_a_server_restarted_between_calls_is_used_again_at_once(own_server):
    """The connection broke while idle (the server restarted): the next call reconnects, nothing marked down."""
    store = _store(("127.0.0.1", own_server.port))
    assert _put(store, [b"r"], [b"v"]).ok
    own_server.kill()
    own_server.start()
    assert store.contains([b"r"]) == 0  # restarted empty, and it says so rather than failing
    assert _put(store, [b"r"], [b"v"]).ok and store.contains([b"r"]) == 1
    assert store.transport_failures == 0
    store.close()


def test_a_server_that_demands_a_password_mid_run_is_marked_down_until_it_lets_the_store_in(own_server):
    """``requirepass`` set while the store runs (no password given to it) and its connections closed: every
    command would answer ``-NOAUTH``. That is evidence against the node: the call's keys fail with a transport
    error, the node is marked down and the next calls fail at once; once the server no longer demands a
    password the store uses it again."""
    address = ("127.0.0.1", own_server.port)
    store = _store(address)
    assert _put(store, [b"a"], [b"x"]).ok
    own_server.call(b"CONFIG", b"SET", b"requirepass", b"kvkit-test-only")
    own_server.password = "kvkit-test-only"  # the test's own calls log in from now on
    own_server.call(b"CLIENT", b"KILL", b"TYPE", b"normal")  # the store's connections: reopened, not logged in
    result = _put(store, [b"b"], [b"y"])
    assert result.transport_failed and "NOAUTH" in result.error, result
    assert list(store.down_nodes) == [address]
    start = time.monotonic()
    assert store.contains([b"a"]) == 0 and _get(store, [b"a"], 1)[0].transport_failed
    assert time.monotonic() - start < 0.8 * DEADLINE, "a call waited on a node known to be down"
    own_server.call(b"CONFIG", b"SET", b"requirepass", b"")
    own_server.password = None
    assert _eventually(lambda: _put(store, [b"c"], [b"z"]).ok)
    assert store.contains([b"a"]) == 1
    store.close()


def _binaries():
    """The bundled Valkey and, when installed, Debian's redis-server (Redis 7.0): a limit tested on both families."""
    import shutil

    return [pytest.param(None, id="valkey"),
            pytest.param("redis-server", id="redis", marks=pytest.mark.skipif(
                shutil.which("redis-server") is None, reason="redis-server is not installed"))]


def _server_binary(binary):
    """``binary`` from ``PATH``, or the bundled Valkey for ``None``."""
    return server_binary(binary) if binary else server_binary_or_skip()


@pytest.mark.parametrize("binary", _binaries())
def test_a_restart_between_calls_counts_as_a_restart_and_a_killed_connection_does_not(binary):
    """Valkey and Redis tell each run of a server apart (``run_id``): a connection reopened to a server restarted
    between calls (no call failed) counts one restart, however many links reconnect to it; connections the server
    closed (``CLIENT KILL``) and reopened to the same run count none. A user whose ACL refuses ``INFO`` (the
    tenant ACL line of docs/shared-tier.md) cannot be told: each reopened connection counts, the first ones not."""
    with LocalServer(_server_binary(binary)) as server:
        address = ("127.0.0.1", server.port)
        store = _store(address)
        assert _put(store, [b"r"], [b"v"]).ok and store.contains([b"r"]) == 1  # the lookup and put links connected
        assert _get(store, [b"r"], 1)[0].ok  # and the get link
        server.call(b"CLIENT", b"KILL", b"TYPE", b"normal")
        assert store.contains([b"r"]) == 1 and _put(store, [b"r"], [b"v"]).ok and _get(store, [b"r"], 1)[0].ok
        assert store.restarts == 0, "a connection reopened to the same run was taken for a restart"
        server.kill()
        server.start()
        assert store.contains([b"r"]) == 0 and _put(store, [b"r"], [b"v"]).ok and _get(store, [b"r"], 1)[0].ok
        assert store.restarts == 1 and store.transport_failures == 0
        store.close()
        server.call(b"ACL", b"SETUSER", b"kvkit-acme", b"on", b">kvkit-test-only", b"resetkeys", b"~kvkit:acme:*",
                    b"resetchannels", b"-@all", b"+ping", b"+exists", b"+get", b"+set", b"+select")
        store = _store(address, username="kvkit-acme", password="kvkit-test-only")
        assert _put(store, [b"kvkit:acme:r"], [b"v"]).ok and store.contains([b"kvkit:acme:r"]) == 1
        assert store.restarts == 0
        server.call(b"CLIENT", b"KILL", b"USER", b"kvkit-acme")
        assert store.contains([b"kvkit:acme:r"]) == 1
        assert store.restarts == 1, "a reopened connection that could not tell its server was trusted"
        store.close()


_TENANT_ACL = (b"ACL", b"SETUSER", b"kvkit-acme", b"on", b">kvkit-test-only", b"resetkeys", b"~kvkit:acme:*",
               b"resetchannels", b"-@all", b"+ping", b"+exists", b"+get", b"+set", b"+select", b"+asking",
               b"+cluster|slots")


def _reconnect_all(store, key):
    """Use every link of ``store`` (a lookup, a put, a get of ``key``), so each opens a connection if it has none."""
    assert store.contains([key]) in (0, 1)
    assert _put(store, [key], [b"v"], 2.0).ok and _get(store, [key], 1, 2.0)[0].ok


@pytest.mark.parametrize("binary", _binaries())
def test_a_marker_under_the_tenants_prefix_tells_restarts_and_flushes_where_info_is_refused(binary):
    """Under the tenant ACL (no ``INFO``), a store marking restarts under ``kvkit:acme:`` counts none for
    connections the server closed and every link reopened (its ``timeout``, ``CLIENT KILL``), one for a flush
    (``FLUSHALL``: the marker is gone; ``run_id`` would not tell) and one for a restart, however many links
    reconnect."""
    with LocalServer(_server_binary(binary)) as server:
        server.call(*_TENANT_ACL)
        store = _store(("127.0.0.1", server.port), username="kvkit-acme", password="kvkit-test-only",
                       request_timeout_s=2.0)
        store.mark_restarts_under(b"kvkit:acme:")
        key = b"kvkit:acme:r"
        _reconnect_all(store, key)
        for _ in range(2):
            server.call(b"CLIENT", b"KILL", b"USER", b"kvkit-acme")
            _reconnect_all(store, key)
        assert store.restarts == 0, "a connection reopened to a server that kept its data counted a restart"
        server.call(b"FLUSHALL")
        server.call(b"CLIENT", b"KILL", b"USER", b"kvkit-acme")
        _reconnect_all(store, key)
        assert store.restarts == 1, "a flush was not counted once"
        server.kill()
        server.start()
        server.call(*_TENANT_ACL)
        _reconnect_all(store, key)
        assert store.restarts == 2 and store.transport_failures == 0
        assert sorted(server.call(b"KEYS", b"*")) == [b"kvkit:acme:r", b"kvkit:acme:restart-marker"]
        store.close()


@pytest.mark.parametrize("binary", _binaries())
def test_a_marker_the_acl_lets_a_store_read_but_not_plant_never_hides_a_restart(binary):
    """Under an ACL refusing ``INFO`` and the marker's ``SET`` (it may read every tenant key, write only blocks'),
    the marker is never planted, so it cannot tell one run from the next: each reopened connection counts, as
    where no marker is kept, and a restart is never taken for the same run."""
    with LocalServer(_server_binary(binary)) as server:
        server.call(b"ACL", b"SETUSER", b"kvkit-acme", b"on", b">kvkit-test-only", b"resetkeys", b"%R~kvkit:acme:*",
                    b"%W~kvkit:acme:v2:*", b"resetchannels", b"-@all", b"+ping", b"+exists", b"+get", b"+set")
        store = _store(("127.0.0.1", server.port), username="kvkit-acme", password="kvkit-test-only",
                       request_timeout_s=2.0)
        store.mark_restarts_under(b"kvkit:acme:")
        key = b"kvkit:acme:v2:r"
        for _ in range(2):
            _reconnect_all(store, key)
        assert server.call(b"EXISTS", b"kvkit:acme:restart-marker") == 0 and store.restarts == 0
        server.kill()
        server.start()
        server.call(b"ACL", b"SETUSER", b"kvkit-acme", b"on", b">kvkit-test-only", b"resetkeys", b"%R~kvkit:acme:*",
                    b"%W~kvkit:acme:v2:*", b"resetchannels", b"-@all", b"+ping", b"+exists", b"+get", b"+set")
        _reconnect_all(store, key)
        assert store.restarts >= 1, "a restart was taken for the same run"
        store.close()


def test_a_marker_per_cluster_node_tells_which_node_restarted_where_info_is_refused(valkey_cluster):
    """In a Cluster under the tenant ACL, each node holds a marker of its own (hash-tagged into its slots):
    connections every node closed and the links reopened count no restart; one node flushed counts one."""
    nodes = valkey_cluster.nodes
    for node in nodes:
        node.call(b"FLUSHALL")
        node.call(*_TENANT_ACL)
    store = ValkeyStore([("127.0.0.1", nodes[0].port)], cluster=True, username="kvkit-acme",
                        password="kvkit-test-only", request_timeout_s=2.0, connect_timeout_s=2.0)
    store.mark_restarts_under(b"kvkit:acme:")
    keys = [b"kvkit:acme:c%d" % i for i in range(30)]
    try:
        def every_link():
            store.contains(keys)
            assert _put(store, keys, [b"v"] * 30, 2.0).ok and _get(store, keys, 1, 2.0)[0].ok
        every_link()
        every_link()
        held = [node.call(b"KEYS", b"kvkit:acme:restart-marker*") for node in nodes]
        assert all(len(markers) == 1 for markers in held), held
        for node in nodes:
            node.call(b"CLIENT", b"KILL", b"USER", b"kvkit-acme")
        every_link()
        assert store.restarts == 0, "connections reopened to nodes that kept their data counted a restart"
        nodes[1].call(b"FLUSHALL")
        nodes[1].call(b"CLIENT", b"KILL", b"USER", b"kvkit-acme")
        every_link()
        assert store.restarts == 1
    finally:
        store.close()
        for node in nodes:
            node.call(b"ACL", b"DELUSER", b"kvkit-acme")
            node.call(b"FLUSHALL")


@pytest.mark.parametrize("behind", [True, False], ids=["behind", "synchronised"])
def test_a_replica_promoted_without_the_marker_counts_a_restart_and_one_that_has_it_none(partial_cluster, behind):
    """A Cluster node's replica takes over its slots (its primary killed, ``CLUSTER FAILOVER TAKEOVER``), at an
    address the store never connected to. A replica that had not received the primary's latest writes (it was
    stopped while they queued behind 32 MiB of others, lost with the primary) lacks the store's values and its
    marker: the store counts one restart, so the tier forgets what it remembered as put there. A replica that
    had received everything holds the marker's token: no restart."""
    cluster = partial_cluster
    replica = cluster.add_replica(0)
    primary = cluster.nodes[0]
    tag = next(b"%d" % n for n in range(1000) if _owner(cluster, b"%d" % n) == 0)
    if behind:
        replica.pause()
        for i in range(32):  # more than the sockets buffer: the store's writes stay in the primary
            primary.call(b"SET", b"junk{%s}:%d" % (tag, i), b"j" * (1 << 20))
    store = ValkeyStore([("127.0.0.1", cluster.nodes[1].port)], cluster=True, request_timeout_s=DEADLINE,
                        connect_timeout_s=DEADLINE, retry_interval_s=0.2)
    store.mark_restarts_under(b"kvkit:acme:")
    keys = [b"kvkit:acme:promoted:%d" % i for i in range(60)]
    on_primary = [k for k in keys if _owner(cluster, k) == 0]
    try:
        assert _put(store, keys, [b"v"] * 60).ok and store.contains(keys) == 60
        if not behind:
            assert primary.call(b"WAIT", b"1", b"5000") == 1
        primary.kill()
        if behind:
            replica.resume()
        cluster.fail_over(replica)
        held = sum(replica.call(b"EXISTS", k) for k in on_primary)
        assert held == (0 if behind else len(on_primary)), held
        assert _eventually(lambda: _put(store, on_primary[:1], [b"v"]).ok and store.contains(on_primary[:1]) == 1,
                           10.0)  # the put and lookup links reach the new primary
        assert store.restarts == (1 if behind else 0), store.restarts
    finally:
        store.close()


@pytest.mark.parametrize("binary", _binaries())
def test_a_server_with_no_room_for_another_client_is_marked_down_until_it_has_room(binary):
    """``maxclients`` reached by other clients: the server answers a new connection ``-ERR max number of clients
    reached`` and closes it. That is evidence against the node, not a key's failure: a call of one key and a call
    of many fail every key with a transport error, the node is marked down and the next calls fail at once; once
    the other clients left, the store uses it again."""
    with LocalServer(_server_binary(binary), args=["--maxclients", "4"]) as server:
        address = ("127.0.0.1", server.port)
        hogs = [socket.create_connection(address, timeout=5.0) for _ in range(4)]
        try:
            for hog in hogs:  # each one served: the server has no room left
                hog.sendall(b"PING\r\n")
                assert hog.recv(7) == b"+PONG\r\n"
            store = _store(address)
            for keys in ([b"a"], [b"a", b"b", b"c"]):
                result = _put(store, keys, [b"x"] * len(keys))
                assert result.unreached == tuple(range(len(keys))) and "max number of clients" in result.error, result
                assert list(store.down_nodes) == [address]
                time.sleep(0.25)  # the retry interval: the next call tries the node again
            assert _put(store, [b"a"], [b"x"]).transport_failed and store.transport_failures >= 2
            start = time.monotonic()
            assert store.contains([b"a"]) == 0 and _put(store, [b"b"], [b"y"]).transport_failed
            assert time.monotonic() - start < 0.8 * DEADLINE, "a call waited on a node known to be down"
        finally:
            for hog in hogs:
                hog.close()
        assert _eventually(lambda: _put(store, [b"c"], [b"z"]).ok)
        assert store.contains([b"c"]) == 1
        store.close()


@pytest.mark.parametrize("binary", _binaries())
@pytest.mark.parametrize("refused", ["put", "get"])
def test_a_server_full_for_one_lanes_connection_is_not_marked_down_while_it_serves_the_others(binary, refused):
    """``maxclients`` reached after two of the store's three links connected (the lookup's and one lane's): the
    server refuses the third link's new connection (``-ERR max number of clients reached``). It serves the other
    two, so it is full, not down: the refused lane's keys fail refused, none unreached (a shared tier's probe,
    a put, keeps the tier on), nothing is marked down, and the other links go on serving at once. Once a client
    left, the third link connects."""
    with LocalServer(_server_binary(binary), args=["--maxclients", "3"]) as server:
        address = ("127.0.0.1", server.port)
        server.call(b"SET", b"a", b"x")
        store = _store(address, retry_interval_s=30.0)
        assert store.contains([b"a"]) == 1
        if refused == "put":
            assert _get(store, [b"a"], 1)[0].ok
        else:
            assert _put(store, [b"b"], [b"y"]).ok
        with socket.create_connection(address, timeout=5.0) as hog:
            hog.sendall(b"PING\r\n")
            assert hog.recv(7) == b"+PONG\r\n"  # served: the server has no room left
            for _ in range(2):
                result = _put(store, [b"c", b"d"], [b"z"] * 2) if refused == "put" else _get(store, [b"a", b"b"], 1)[0]
                assert result.failed == (0, 1) and result.unreached == (), result
                assert "max number of clients" in result.error and not result.transport_failed, result
                assert store.down_nodes == {} and store.transport_failures == 0, store.down_nodes
                start = time.monotonic()
                assert store.contains([b"a"]) == 1
                if refused == "put":
                    got, buffers = _get(store, [b"a"], 1)
                    assert got.ok and buffers == [b"x"], got
                else:
                    assert _put(store, [b"e"], [b"w"]).ok
                assert time.monotonic() - start < 0.8 * DEADLINE, "a link serving the node waited"
        assert _eventually(lambda: _put(store, [b"c"], [b"z"]).ok and _get(store, [b"c"], 1)[0].ok)
        assert store.transport_failures == 0
        store.close()


@pytest.mark.parametrize("binary", _binaries())
def test_a_server_busy_running_a_script_is_marked_down_until_the_script_ends(binary):
    """A Lua script that never ends (another client's ``EVAL``), past ``busy-reply-threshold``: the server answers
    every other command ``-BUSY``, as a loading node does. That is evidence against the node, not the keys'
    failure: a call's keys fail unreached with a transport error naming the reply, the node is marked down and
    the next calls fail at once; once the script is killed the store uses the node again."""
    from kvkit.backends.blockstore.resp import command

    with LocalServer(_server_binary(binary), args=["--busy-reply-threshold", "100"]) as server:
        address = ("127.0.0.1", server.port)
        store = _store(address)
        assert _put(store, [b"a"], [b"x"]).ok
        with socket.create_connection(address) as scripted:
            scripted.sendall(command(b"EVAL", b"while true do end", b"0"))
            assert _eventually(lambda: _refused_busy(server))
            try:
                result = _put(store, [b"a", b"b"], [b"x", b"y"])
                assert result.unreached == (0, 1) and "BUSY" in result.error, result
                assert list(store.down_nodes) == [address]
                start = time.monotonic()
                assert store.contains([b"a"]) == 0 and _get(store, [b"a"], 1)[0].transport_failed
                assert time.monotonic() - start < 0.8 * DEADLINE, "a call waited on a node known to be down"
            finally:
                server.call(b"SCRIPT", b"KILL")
        assert _eventually(lambda: store.contains([b"a"]) == 1)
        assert _put(store, [b"b"], [b"y"]).ok
        store.close()


def _refused_busy(server) -> bool:
    """Whether ``server`` answers ``-BUSY`` now (a refusal of the node)."""
    try:
        server.call(b"PING")
    except ConnectionRefusedError as exc:
        return "BUSY" in str(exc)
    return False


class _Answering:
    """A loopback proxy to ``target`` that, while ``answer`` is set, answers every whole command itself with
    that error line (as a loading or primary-less node answers every command) and forwards it otherwise."""

    def __init__(self, target):
        self.target, self.answer = target, None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = ("127.0.0.1", self._listener.getsockname()[1])
        self._stop = threading.Event()
        self._sockets = [self._listener]
        self._threads = [self._spawn(self._accept)]

    def close(self):
        self._stop.set()
        for thread in self._threads:
            thread.join(5.0)
        for sock in self._sockets:
            sock.close()

    def _spawn(self, target, *args):
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        return thread

    def _accept(self):
        while not self._stop.is_set():
            if select.select([self._listener], [], [], 0.02)[0]:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.target)
                self._sockets += [client, server]
                self._threads += [self._spawn(self._requests, client, server),
                                  self._spawn(self._replies, server, client)]

    def _requests(self, client, server):
        pending = bytearray()
        while not self._stop.is_set():
            if not select.select([client], [], [], 0.02)[0]:
                continue
            data = client.recv(1 << 16)
            if not data:
                return
            pending += data
            if self.answer is None:
                server.sendall(pending)
                pending.clear()
                continue
            count, used = _whole_commands(pending)
            del pending[:used]
            client.sendall((b"-" + self.answer + b"\r\n") * count)

    def _replies(self, server, client):
        while not self._stop.is_set():
            if select.select([server], [], [], 0.02)[0]:
                data = server.recv(1 << 16)
                if not data:
                    return
                client.sendall(data)


def _whole_commands(data):
    """How many whole RESP commands (arrays of bulks) ``data`` starts with, and how many bytes they take."""
    count = used = 0
    while data[used:used + 1] == b"*" and (end := data.find(b"\r\n", used)) >= 0:
        at = end + 2
        for _ in range(int(data[used + 1:end])):
            end = data.find(b"\r\n", at)
            if end < 0:
                return count, used
            at = end + 2 + int(data[at + 1:end]) + 2
        if at > len(data):
            return count, used
        count, used = count + 1, at
    return count, used


@pytest.mark.parametrize("answer", [
    b"LOADING Valkey is loading the dataset in memory",
    b"MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."])
def test_a_node_that_serves_no_command_for_now_is_marked_down_until_it_answers_normally(valkey_server, answer):
    """Every command answered ``-LOADING`` (a node loading its dataset) or ``-MASTERDOWN`` (a replica that lost
    its primary): that is evidence against the node, so the call's keys fail with a transport error naming
    the reply, the node is marked down and the next calls fail at once, without raising; once it answers
    normally again it is used again after its retry interval."""
    valkey_server.call(b"FLUSHALL")
    proxy = _Answering(("127.0.0.1", valkey_server.port))
    try:
        store = _store(proxy.address)
        assert _put(store, [b"a"], [b"x"]).ok
        proxy.answer = answer
        result, _ = _get(store, [b"a"], 1)
        code = answer.split()[0].decode()
        assert result.transport_failed and code in result.error and result.unreached == (0,), result
        assert list(store.down_nodes) == [proxy.address]
        start = time.monotonic()
        assert store.contains([b"a"]) == 0 and _put(store, [b"b"], [b"y"]).transport_failed
        assert time.monotonic() - start < 0.8 * DEADLINE, "a call waited on a node known to be down"
        proxy.answer = None
        assert _eventually(lambda: store.contains([b"a"]) == 1)
        assert _put(store, [b"b"], [b"y"]).ok and store.down_nodes == {}
        store.close()
    finally:
        proxy.close()


def test_a_server_that_refuses_writes_fails_the_puts_only(tmp_path):
    """A server that cannot persist (its ``dir`` gone, a failed ``BGSAVE`` under ``stop-writes-on-bgsave-error``)
    answers ``-MISCONF`` to writes and serves reads: each put fails with the server's error (refused, not
    unreached), the node is not marked down, and gets and ``contains`` go on being served."""
    gone = tmp_path / "gone"
    gone.mkdir()
    with LocalServer(server_binary_or_skip(), args=["--enable-protected-configs", "yes"]) as server:
        store = _store(("127.0.0.1", server.port))
        assert _put(store, [b"a"], [b"x"]).ok
        server.call(b"CONFIG", b"SET", b"dir", str(gone).encode())
        gone.rmdir()
        server.call(b"CONFIG", b"SET", b"save", b"3600 1")
        server.call(b"CONFIG", b"SET", b"stop-writes-on-bgsave-error", b"yes")
        server.call(b"BGSAVE")
        assert _eventually(lambda: b"rdb_last_bgsave_status:err" in server.call(b"INFO", b"persistence"))
        result = _put(store, [b"b", b"c"], [b"y", b"z"])
        assert result.failed == (0, 1) and "MISCONF" in result.error and result.unreached == (), result
        assert store.down_nodes == {} and not result.transport_failed
        got, buffers = _get(store, [b"a"], 1)
        assert got.ok and buffers == [bytearray(b"x")] and store.contains([b"a", b"b"]) == 1
        store.close()


# -- a server-side limit -----------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", _binaries())
def test_a_value_longer_than_the_servers_bulk_limit_fails_alone_and_never_marks_the_node_down(binary):
    """``proto-max-bulk-len 1mb``: a SET of a 2 MiB value is answered ``-ERR Protocol error: invalid bulk
    length`` and the connection closed. That is the value's failure, not the node's: in one put of small and
    large values the large ones fail refused (not unreached), the small ones are stored, the node is not marked
    down, and gets and ``contains`` go on being served. A later put of a value that long fails at once, refused,
    without being sent (no connection is reopened for it)."""
    with LocalServer(_server_binary(binary), args=["--proto-max-bulk-len", "1mb"]) as server:
        store = _store(("127.0.0.1", server.port), request_timeout_s=2.0, connect_timeout_s=2.0,
                       retry_interval_s=30.0)
        keys = [b"bulk:%d" % i for i in range(6)]
        big, small = {1, 3}, [0, 2, 4, 5]
        values = [os.urandom(2 << 20) if i in big else os.urandom(1000) for i in range(6)]
        result = _put(store, keys, values, 2.0)
        assert set(result.failed) == big and result.unreached == (), result
        assert "proto-max-bulk-len" in result.error and not result.transport_failed, result
        assert store.down_nodes == {} and store.transport_failures == 0, store.down_nodes
        assert store.contains([keys[i] for i in small]) == len(small)
        got, buffers = _get(store, [keys[i] for i in small], 1000, 2.0)
        assert got.ok and buffers == [values[i] for i in small]
        opened = _connections_received(server)
        again = _put(store, [keys[1], keys[0]], [values[1], values[0]], 2.0)
        assert again.failed == (0,) and again.unreached == () and "proto-max-bulk-len" in again.error, again
        assert _connections_received(server) == opened + 1, "the store reconnected: a refused size was sent again"
        store.close()


@pytest.mark.parametrize("binary", _binaries())
def test_a_put_of_large_values_without_the_password_marks_the_node_down_with_no_limit_learned(binary):
    """A store given no password for a server that demands one: the server refuses a bulk longer than 16 KiB from
    a connection not logged in (``-ERR Protocol error: unauthenticated bulk length``) and closes it. That is the
    missing login, evidence against the node (as ``-NOAUTH`` is), not a value longer than the server takes: the
    put's keys fail unreached, the node is marked down, and once the server lets the store in the same values
    are sent and stored."""
    with LocalServer(_server_binary(binary), password="kvkit-test-only") as server:
        address = ("127.0.0.1", server.port)
        store = _store(address, request_timeout_s=2.0, connect_timeout_s=2.0)
        keys, values = [b"login:%d" % i for i in range(3)], _values(3, 100_000)
        result = _put(store, keys, values, 2.0)
        assert result.unreached == (0, 1, 2) and "not logged in" in result.error, result
        assert list(store.down_nodes) == [address]
        server.call(b"CONFIG", b"SET", b"requirepass", b"")
        server.password = None
        assert _eventually(lambda: _put(store, keys, values, 2.0).ok)
        assert _get(store, keys, 100_000, 2.0)[1] == values
        store.close()


def test_a_bulk_limit_learned_from_one_cluster_node_holds_back_only_that_nodes_values(valkey_cluster):
    """Cluster nodes configured apart: node 0 takes values up to 1 MiB (``proto-max-bulk-len``), the others the
    default. Once node 0 refused a 2 MiB value, values that long to node 0 fail at once, unsent, while one to
    another node is still sent and stored."""
    cluster = valkey_cluster
    limited = cluster.nodes[0]
    default = limited.call(b"CONFIG", b"GET", b"proto-max-bulk-len")[1]
    limited.call(b"CONFIG", b"SET", b"proto-max-bulk-len", b"1mb")
    try:
        store = ValkeyStore([("127.0.0.1", limited.port)], cluster=True, request_timeout_s=2.0,
                            connect_timeout_s=2.0, retry_interval_s=30.0)
        names = (b"kvkit:bulk-node:%d" % i for i in range(1000))
        on = {}
        for key in names:
            on.setdefault(_owner(cluster, key), []).append(key)
        value = os.urandom(2 << 20)
        refused = _put(store, on[0][:1], [value], 2.0)
        assert refused.failed == (0,) and "proto-max-bulk-len" in refused.error and refused.unreached == (), refused
        stored = _put(store, [on[1][0], on[0][1]], [value, value], 2.0)
        assert stored.failed == (1,) and stored.unreached == (), stored
        assert f"not sent: the server 127.0.0.1:{limited.port} refused one of {len(value)} bytes" in stored.error
        got, buffers = _get(store, [on[1][0]], len(value), 2.0)
        assert got.ok and buffers == [value]
        assert store.down_nodes == {}
        store.close()
    finally:
        limited.call(b"CONFIG", b"SET", b"proto-max-bulk-len", default)


def _connections_received(server) -> int:
    """Connections the server accepted so far (``INFO stats``), the asking one included."""
    stats = server.call(b"INFO", b"stats").decode()
    return int(stats.split("total_connections_received:")[1].split()[0])


# -- a Cluster with a dead node, a failover, a moved slot ----------------------------------------------------


@pytest.fixture
def partial_cluster():
    """A 3-node Cluster that keeps serving the slots of its live nodes when one dies."""
    cluster = LocalCluster(binary=server_binary_or_skip(), args=["--cluster-require-full-coverage", "no"])
    cluster.start()
    yield cluster
    cluster.stop()


def _owner(cluster, key):
    slot = key_slot(key)
    step = 16384 // cluster.size
    return min(slot // step, cluster.size - 1)


def test_a_cluster_with_a_dead_node_serves_what_the_live_nodes_hold(partial_cluster):
    """One node killed: a batch gets every key the live nodes hold (right bytes), fails only the dead node's,
    and only that node is marked down; its keys then fail at once while the live nodes keep serving."""
    cluster = partial_cluster
    store = ValkeyStore([("127.0.0.1", cluster.nodes[0].port)], cluster=True, request_timeout_s=DEADLINE,
                        connect_timeout_s=DEADLINE, retry_interval_s=30.0)
    keys = [b"kvkit:dead:%d" % i for i in range(60)]
    values = _values(60, 2000)
    assert _put(store, keys, values).ok
    dead = cluster.nodes[2]
    dead.kill()
    on_dead = {i for i, k in enumerate(keys) if _owner(cluster, k) == 2}
    assert 0 < len(on_dead) < len(keys)
    result, buffers = _get(store, keys, 2000)
    assert set(result.failed) == on_dead and result.transport_failed, result
    assert all(buffers[i] == values[i] for i in range(len(keys)) if i not in on_dead)
    assert list(store.down_nodes) == [("127.0.0.1", dead.port)]
    live = [k for i, k in enumerate(keys) if i not in on_dead]
    start = time.monotonic()
    assert store.contains(live) == len(live)
    again, _ = _get(store, keys, 2000)
    assert set(again.failed) == on_dead
    fresh = [b"kvkit:dead:new:%d" % i for i in range(30)]
    put = _put(store, fresh, _values(30, 100))
    assert set(put.failed) == {i for i, k in enumerate(fresh) if _owner(cluster, k) == 2}
    assert time.monotonic() - start < DEADLINE, "calls waited on the dead node again"
    store.close()


def test_a_paused_node_costs_only_its_own_keys_on_the_first_call(partial_cluster):
    """One node paused (SIGSTOP: it accepts bytes and answers nothing): the first get, put and contains of a
    fresh store each return every key the live nodes hold (right bytes) by their deadline; only the paused
    node's keys fail, and only that node is marked down. Each node's pipeline moves on its own, so a node
    waited on never holds back the chunks of the others (60 x 100 KB: several chunks per node)."""
    cluster = partial_cluster
    size = 100_000
    keys = [b"kvkit:paused:%d" % i for i in range(60)]
    values = _values(60, size)
    options = dict(cluster=True, request_timeout_s=1.0, connect_timeout_s=1.0, retry_interval_s=30.0)
    seed = ("127.0.0.1", cluster.nodes[1].port)
    writer = ValkeyStore([seed], **options)
    assert _put(writer, keys, values, 1.0).ok
    writer.close()
    paused = cluster.nodes[_owner(cluster, keys[0])]  # the first group of every call
    on_paused = {i for i, k in enumerate(keys) if cluster.nodes[_owner(cluster, k)] is paused}
    assert 0 < len(on_paused) < len(keys)
    live = [k for i, k in enumerate(keys) if i not in on_paused]
    crew = _crew_threads()
    stores = [ValkeyStore([seed], **options) for _ in range(3)]
    for store in stores:  # the slot map read by both connections while every node answers
        assert store.contains(live) == len(live) and _get(store, keys[:1], size, 1.0)[0].ok
    paused.pause()
    try:
        getter, putter, looker = stores
        result, buffers = _get(getter, keys, size, 1.0)
        assert set(result.failed) == on_paused and result.transport_failed, result
        assert all(buffers[i] == values[i] for i in range(len(keys)) if i not in on_paused), \
            "a live node's key was lost to the paused node"
        fresh = _values(60, size)
        put = _put(putter, keys, fresh, 1.0)
        assert set(put.failed) == on_paused and put.transport_failed, put
        start = time.monotonic()
        assert looker.contains([*live, *(keys[i] for i in sorted(on_paused))]) == len(live)
        assert time.monotonic() - start <= 1.0 + SLACK
        for store in (getter, putter, looker):
            assert list(store.down_nodes) == [("127.0.0.1", paused.port)], store.down_nodes
        assert _crew_threads() - crew, "the nodes' pipelines did not run side by side"
    finally:
        paused.resume()
        for store in stores:
            store.close()
    assert _eventually(lambda: not _crew_threads() - crew), "a closed store left its node threads running"
    reader = ValkeyStore([seed], **options)
    again, buffers = _get(reader, keys, size, 1.0)
    assert again.ok and all(buffers[i] == fresh[i] for i in range(len(keys)) if i not in on_paused)
    # the paused node's keys: old, or the failed put's (the node may apply what it had received once resumed)
    assert all(buffers[i] in (values[i], fresh[i]) for i in on_paused)
    reader.close()


def test_a_failover_moves_the_dead_nodes_slots_and_keeps_the_other_connections(partial_cluster):
    """Node 0 dies and its replica takes over: its keys fail once, then are read from the new primary; the
    connections to the nodes that stayed up are never reopened."""
    cluster = partial_cluster
    replica = cluster.add_replica(0)
    store = ValkeyStore([("127.0.0.1", cluster.nodes[1].port)], cluster=True, request_timeout_s=DEADLINE,
                        connect_timeout_s=DEADLINE, retry_interval_s=0.2)
    keys = [b"kvkit:failover:%d" % i for i in range(60)]
    values = _values(60, 1000)
    assert _put(store, keys, values).ok
    cluster.nodes[0].call(b"WAIT", b"1", b"5000")  # the replica has every value
    result, _ = _get(store, keys, 1000)
    assert result.ok
    links = dict(store._gets.link._conns)
    stayed = [("127.0.0.1", n.port) for n in cluster.nodes[1:]]
    cluster.nodes[0].kill()
    cluster.fail_over(replica)
    on_dead = {i for i, k in enumerate(keys) if _owner(cluster, k) == 0}
    first, _ = _get(store, keys, 1000)
    assert set(first.failed) <= on_dead
    assert _eventually(lambda: _get(store, keys, 1000)[0].ok, 10.0), "the new primary's keys were never read"
    result, buffers = _get(store, keys, 1000)
    assert result.ok and buffers == values
    assert all(store._gets.link._conns[a] is links[a] for a in stayed), "a connection to a live node was reopened"
    store.close()


def test_a_seed_that_came_back_empty_does_not_hide_the_live_nodes(partial_cluster):
    """Node 0 restarted without its cluster configuration (a fresh container): it serves no slot and answers
    CLUSTER SLOTS with an empty map. A store given it as its first seed reads the map from the next seed, so
    the live nodes serve their keys and only node 0's old slots fail."""
    cluster = partial_cluster
    first = cluster.nodes[0]
    first.kill()
    first.stop()  # its directory, with the cluster configuration, is gone
    first.start()
    assert first.call(b"CLUSTER", b"SLOTS") == []
    store = ValkeyStore([("127.0.0.1", n.port) for n in cluster.nodes], cluster=True, request_timeout_s=DEADLINE,
                        connect_timeout_s=DEADLINE, retry_interval_s=0.2)
    try:
        keys = [b"kvkit:empty-seed:%d" % i for i in range(60)]
        result = _put(store, keys, _values(60, 100))
        on_first = {i for i, k in enumerate(keys) if _owner(cluster, k) == 0}
        assert 0 < len(on_first) < len(keys) and set(result.failed) == on_first, result
        live = [k for i, k in enumerate(keys) if i not in on_first]
        assert store.contains(live) == len(live)
    finally:
        store.close()


def test_a_paused_first_seed_leaves_the_next_seeds_time_to_give_the_slot_map(partial_cluster):
    """The first seed paused (SIGSTOP: it takes the connection and answers nothing) before any map was read: a
    fresh store waits on it for at most its share of the deadline and reads the map from the next seed, so its
    first ``contains`` and first ``get`` answer every key the live nodes hold (right bytes) by the deadline; only
    the paused node's keys fail, and only it is marked down."""
    cluster = partial_cluster
    keys = [b"kvkit:paused-seed:%d" % i for i in range(60)]
    values = _values(60, 1000)
    options = dict(cluster=True, request_timeout_s=1.0, connect_timeout_s=1.0, retry_interval_s=30.0)
    seeds = [("127.0.0.1", n.port) for n in cluster.nodes]
    writer = ValkeyStore(seeds[1:], **options)
    assert _put(writer, keys, values, 1.0).ok
    writer.close()
    paused = cluster.nodes[0]
    on_paused = {i for i, k in enumerate(keys) if _owner(cluster, k) == 0}
    assert 0 < len(on_paused) < len(keys)
    live = [k for i, k in enumerate(keys) if i not in on_paused]
    looker, getter = ValkeyStore(seeds, **options), ValkeyStore(seeds, **options)
    paused.pause()
    try:
        start = time.monotonic()
        assert looker.contains(live) == len(live), "the paused seed hid the live nodes from contains"
        assert time.monotonic() - start <= 1.0 + SLACK
        result, buffers = _get(getter, keys, 1000, 1.0)
        assert set(result.failed) == on_paused and result.transport_failed, result
        assert all(buffers[i] == values[i] for i in range(len(keys)) if i not in on_paused)
        for store in (looker, getter):
            assert list(store.down_nodes) == [seeds[0]], store.down_nodes
    finally:
        paused.resume()
        looker.close()
        getter.close()


def test_a_bug_in_one_nodes_pipeline_fails_the_call_once_every_pipeline_ended(valkey_cluster, monkeypatch):
    """A reader that raises (not a transport error) on one node of a get spanning three: the call is reported
    failed, only after the other nodes' pipelines ended (a slow one included: no buffer is written after its
    ticket was reported), and the store serves the next call."""
    from kvkit.backends.blockstore import valkey as valkey_module

    cluster = valkey_cluster
    store = ValkeyStore([("127.0.0.1", cluster.nodes[0].port)], cluster=True, request_timeout_s=5.0)
    keys = [b"kvkit:bug:%d" % i for i in range(30)]
    values = _values(30, 1000)
    assert _put(store, keys, values, 5.0).ok
    faulty, slow = (("127.0.0.1", cluster.nodes[i].port) for i in (1, 2))
    ended = []
    original = valkey_module._get_outcome

    def outcome(conn, views, want):
        peer = conn.sock.getpeername()[:2]
        if peer == faulty:
            raise RuntimeError("a bug in a reader")
        if peer == slow:
            time.sleep(0.05)
        got = original(conn, views, want)
        ended.append(time.monotonic())
        return got

    monkeypatch.setattr(valkey_module, "_get_outcome", outcome)
    buffers = [bytearray(1000) for _ in keys]
    ticket = store.get(keys, [[memoryview(b)] for b in buffers])
    result = store.poll([ticket], 5.0)[0]
    reported = time.monotonic()
    assert result.failed == tuple(range(30)) and "RuntimeError" in result.error, result
    assert ended and max(ended) <= reported, "a node's pipeline wrote a buffer after the call was reported"
    monkeypatch.setattr(valkey_module, "_get_outcome", original)
    again, buffers = _get(store, keys, 1000, 5.0)
    assert again.ok and buffers == values
    store.close()


def test_a_stores_lookup_put_and_get_links_share_one_slot_map(partial_cluster):
    """A store's lookup, put and get links read the slot map once between them, and what one learned routes the
    others: with the only seed killed, the first contains and the first get of a store that has put (and the
    first get of one that has looked up) reach the live nodes, and only the seed's keys fail."""
    cluster = partial_cluster
    seed = cluster.nodes[0]
    options = dict(cluster=True, request_timeout_s=DEADLINE, connect_timeout_s=DEADLINE, retry_interval_s=30.0)
    keys = [b"kvkit:one-map:%d" % i for i in range(60)]
    values = _values(60, 100)
    putter = ValkeyStore([("127.0.0.1", seed.port)], **options)
    looker = ValkeyStore([("127.0.0.1", seed.port)], **options)
    try:
        assert _put(putter, keys, values).ok
        assert looker.contains(keys) == len(keys)
        seed.kill()
        on_seed = {i for i, k in enumerate(keys) if _owner(cluster, k) == 0}
        assert 0 < len(on_seed) < len(keys)
        live = [k for i, k in enumerate(keys) if i not in on_seed]
        assert putter.contains(live) == len(live), "the lookups knew only the dead seed"
        result, buffers = _get(putter, live, 100)
        assert result.ok and buffers == [v for i, v in enumerate(values) if i not in on_seed], result
        assert putter._lookup.topology.generation == 1, "the lookups or gets read a map of their own"
        result, buffers = _get(looker, keys, 100)
        assert set(result.failed) == on_seed and result.transport_failed, result
        assert all(buffers[i] == values[i] for i in range(len(keys)) if i not in on_seed)
        assert list(looker.down_nodes) == [("127.0.0.1", seed.port)]
        assert looker.contains(live) == len(live), "the map read again after the seed failed missed the live nodes"
    finally:
        putter.close()
        looker.close()


def test_a_slot_moved_to_another_node_is_followed_without_reconnecting(valkey_cluster):
    """CLUSTER SETSLOT NODE moves a slot: MOVED re-maps it; every connection stays the same object."""
    nodes = valkey_cluster.nodes
    for node in nodes:
        node.call(b"FLUSHALL")
    store = ValkeyStore([("127.0.0.1", nodes[0].port)], cluster=True)
    keys = [b"kvkit:moving:%d" % i for i in range(30)]
    assert _put(store, keys, [b"v"] * 30).ok
    conns = dict(store._puts.link._conns)
    key = keys[0]
    source, target = nodes[_owner(valkey_cluster, key)], nodes[(_owner(valkey_cluster, key) + 1) % 3]
    slot, target_id = b"%d" % key_slot(key), target.call(b"CLUSTER", b"MYID")
    try:
        for node in (target, source, *[n for n in nodes if n not in (source, target)]):
            if node is source:
                source.call(b"DEL", *[k for k in keys if key_slot(k) == key_slot(key)])
            node.call(b"CLUSTER", b"SETSLOT", slot, b"NODE", target_id)
        assert _put(store, keys, [b"w"] * 30).ok
        assert target.call(b"EXISTS", key) == 1
        assert store._puts.link._conns == conns and all(store._puts.link._conns[a] is c for a, c in conns.items())
    finally:
        source_id = source.call(b"CLUSTER", b"MYID")
        target.call(b"DEL", *[k for k in keys if key_slot(k) == key_slot(key)])
        for node in nodes:
            node.call(b"CLUSTER", b"SETSLOT", slot, b"NODE", source_id)
        store.close()


def _pipelined(node, commands):
    """Send ``commands`` (argument tuples) to ``node`` over one connection, in one pipeline; answer the replies."""
    conn = Connection(("127.0.0.1", node.port), ConnectOptions(10.0, 10.0))
    try:
        conn.send([command(*args) for args in commands])
        return [conn.reply() for _ in commands]
    finally:
        conn.close()


@pytest.mark.parametrize("removal", ["killed", "reset"])
def test_a_node_removed_after_its_slots_were_resharded_away_costs_no_key_of_the_live_nodes(partial_cluster, removal):
    """Node 0's keys migrated to node 1, every slot of node 0 given to node 1 (SETSLOT NODE on every node), node 0
    forgotten, then shut down or reset (CLUSTER RESET: it runs on, in no Cluster, and answers -CLUSTERDOWN for
    every key), all while the store was idle: its first get finds node 0 gone or serving no slot, reads the slot
    map again within the call and returns every key (right bytes) from node 1, which keeps its connection; so do
    the next calls (a lookup, a get, a put), which send nothing to node 0: no link keeps a connection to it. Only a
    node shut down is marked down (a reset one is usable)."""
    cluster = partial_cluster
    nodes = cluster.nodes
    ids = [n.call(b"CLUSTER", b"MYID") for n in nodes]
    seeds = [("127.0.0.1", n.port) for n in nodes]
    store = ValkeyStore(seeds, cluster=True, request_timeout_s=1.0, connect_timeout_s=1.0, retry_interval_s=30.0)
    keys = [b"kvkit:removed:%d" % i for i in range(60)]
    values = _values(60, 1000)
    try:
        assert _put(store, keys, values, 1.0).ok and _get(store, keys, 1000, 1.0)[0].ok
        on_gone = {key_slot(k) for k in keys if _owner(cluster, k) == 0}
        assert on_gone and len(on_gone) < len(keys)
        gone, heir = nodes[0], nodes[1]
        heir_conn = store._gets.link._conns[seeds[1]]
        for slot in sorted(on_gone):
            held = gone.call(b"CLUSTER", b"GETKEYSINSLOT", b"%d" % slot, b"100")
            heir.call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"IMPORTING", ids[0])
            gone.call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"MIGRATING", ids[1])
            gone.call(b"MIGRATE", b"127.0.0.1", b"%d" % heir.port, b"", b"0", b"5000", b"KEYS", *held)
        for node in (heir, gone, nodes[2]):
            replies = _pipelined(node, [(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"NODE", ids[1])
                                        for slot in range(16384 // 3)])
            # Node 0 turns into node 1's replica as soon as the Cluster bus tells it node 1 owns all its slots,
            # which may be mid-pipeline: it then refuses SETSLOT, having given its slots up already.
            refused = [r for r in replies if r != b"OK"]
            assert not refused or (node is gone and all("only with masters" in str(r) for r in refused)), replies[:3]
        for node in nodes[1:]:
            node.call(b"CLUSTER", b"FORGET", ids[0])
        if removal == "killed":
            gone.kill()
        else:
            gone.call(b"CLUSTER", b"RESET", b"HARD")
        result, buffers = _get(store, keys, 1000, 1.0)
        assert result.ok and buffers == values, result
        assert store._gets.link._conns[seeds[1]] is heir_conn, "the connection to a live node was reopened"
        start = time.monotonic()
        assert store.contains(keys) == len(keys)
        again, buffers = _get(store, keys, 1000, 1.0)
        assert again.ok and buffers == values, again
        assert _put(store, keys, values, 1.0).ok
        assert time.monotonic() - start < 1.0, "calls waited on the removed node again"
        assert all(seeds[0] not in link._conns for link in (store._puts.link, store._gets.link, store._lookup))
        assert list(store.down_nodes) == ([seeds[0]] if removal == "killed" else []), store.down_nodes
    finally:
        store.close()


# -- fork ----------------------------------------------------------------------------------------------


def test_a_store_inherited_through_fork_serves_the_child_on_connections_of_its_own(valkey_server):
    """A parent and its forked child look keys up at once on one store: neither reads a reply meant for the other
    (they shared the lookup connection: about 40% of lookups read the other process's answer); the child's put
    and get are served (they queued for an I/O thread the child does not have: never reported), a ticket open
    at the fork is reported failed in the child at once and served in the parent, and the child's close leaves
    the parent's connections open."""
    valkey_server.call(b"FLUSHALL")
    store = _store(("127.0.0.1", valkey_server.port))
    assert _put(store, [b"here"], [b"x" * 10]).ok and store.contains([b"here"]) == 1
    with SlowLink(("127.0.0.1", valkey_server.port), latency=0.5) as far_link:
        far = _store(far_link.address, request_timeout_s=5.0)
        assert _put(far, [b"warm"], [b"w"], limit=5.0).ok and far.contains([b"warm"]) == 1  # both connections open
        in_flight = far.put([b"late"], [[memoryview(b"l" * 10)]])

        def child():
            open_at_fork = far.poll([in_flight], 5.0)
            end, wrong = time.monotonic() + 1.0, 0
            while time.monotonic() < end:
                wrong += store.contains([b"absent"]) != 0
            put = _put(store, [b"child"], [b"c" * 10])
            got, (value,) = _get(store, [b"child"], 10)
            far.close()
            store.close()
            return {"open_at_fork": [(r.ok, r.error[:10], "fork" in r.error) for r in open_at_fork],
                    "wrong": wrong, "put": put.ok, "got": got.ok and bytes(value) == b"c" * 10}

        outcome = in_child(child)
        end, wrong = time.monotonic() + 1.0, 0
        while time.monotonic() < end:
            wrong += store.contains([b"here"]) != 1
        child_saw = outcome()
        assert [r.ok for r in far.poll([in_flight], 5.0)] == [True], "the parent's own put failed"
        connections = far_link.connections
        assert _put(far, [b"after"], [b"a"], limit=5.0).ok and far.contains([b"after"]) == 1
        assert far_link.connections == connections, "the child's close shut the parent's connections down"
        far.close()
    assert child_saw == {"open_at_fork": [[False, "transport:", True]], "wrong": 0, "put": True, "got": True}
    assert wrong == 0, f"the parent read {wrong} replies meant for its child"
    assert store.transport_failures == 0 and store.contains([b"here", b"child"]) == 2
    store.close()


@pytest.mark.parametrize("refused", ["kvkit-valkey-put", "kvkit-valkey-get"])
def test_a_store_inherited_through_fork_where_no_thread_can_start_is_closed_there(valkey_server, monkeypatch,
                                                                                  refused):
    """A child forked where no thread can start (a pids limit), from the put lane's on or only from the get lane's
    on, gets the store closed: its calls raise at once, none queues for a thread that is not there, and no I/O
    thread is left running there; the parent's store keeps serving."""
    from kvkit.errors import KVKitError

    store = _store(("127.0.0.1", valkey_server.port))
    parent, start, names = os.getpid(), threading.Thread.start, ["kvkit-valkey-put", "kvkit-valkey-get"]

    def start_in_parent_only(thread):
        if os.getpid() != parent and (thread.name not in names or names.index(thread.name) >= names.index(refused)):
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_in_parent_only)

    def child():
        try:
            store.put([b"k"], [[memoryview(b"v")]])
        except KVKitError as exc:
            return [store.closed, "closed" in str(exc), _io_threads()]
        return [store.closed, "queued", _io_threads()]

    assert in_child(child)() == [True, True, 0]
    assert _put(store, [b"k"], [b"v"]).ok
    store.close()


def _socket_links() -> set[str]:
    """This process's sockets, as ``/proc/self/fd`` names them (``socket:[inode]``): the same in a forked child."""
    links = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            links.add(os.readlink(f"/proc/self/fd/{fd}"))
    return {link for link in links if link.startswith("socket:")}


def test_a_child_forked_while_a_lane_connects_keeps_no_copy_of_that_socket():
    """A child forked while the put lane is still opening its connection (a TLS handshake that a server, silent
    once it accepted, never answers) closes its copy of that socket: the connection is not the link's yet, so
    letting go of the link's connections misses it, and a copy left open would hold the half-opened
    connection against the server for as long as the child lives."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept():
        with contextlib.suppress(OSError):
            while True:
                accepted.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    before = _socket_links()
    store = _store(listener.getsockname(), tls=True, connect_timeout_s=2.0, request_timeout_s=2.0)
    try:
        put = store.put([b"k"], [[memoryview(b"v")]])
        assert _eventually(lambda: accepted)
        connecting = _socket_links() - before - {os.readlink(f"/proc/self/fd/{accepted[0].fileno()}")}
        assert len(connecting) == 1, connecting

        def child():
            store.close()
            return sorted(connecting & _socket_links())

        assert in_child(child)() == []
    finally:
        store.close()
        listener.close()
        for conn in accepted:
            conn.close()
    assert store.poll([put])[0].failed == (0,)


def test_a_child_forked_while_a_name_was_being_resolved_resolves_it_afresh(valkey_server, monkeypatch):
    """A host name whose resolution was in flight (a parent's thread) at the fork is resolved afresh in the child:
    it never waits for a thread that is not in its process, so its store reaches the server."""
    from kvkit.backends.blockstore import resp

    parent, real, stuck = os.getpid(), socket.getaddrinfo, threading.Event()

    def getaddrinfo(host, *args):
        if os.getpid() == parent and threading.current_thread().name == "kvkit-resolve":
            stuck.wait(10.0)  # the parent's resolver thread answers late
        return real(host, *args)

    monkeypatch.setattr(resp.socket, "getaddrinfo", getaddrinfo)
    with pytest.raises(TimeoutError):
        resp._resolve("localhost", valkey_server.port, 0.1)  # its thread is still resolving at the fork

    def child():
        store = _store(("localhost", valkey_server.port))
        outcome = [_put(store, [b"from-child"], [b"c"]).ok, store.contains([b"from-child"])]
        store.close()
        return outcome

    try:
        assert in_child(child)() == [True, 1]
    finally:
        stuck.set()


# -- leaks ---------------------------------------------------------------------------------------------


def test_a_store_dropped_without_close_stops_its_threads_and_closes_its_sockets(valkey_server):
    """Collected without close(), every lane used (a put, a get, a lookup: three connections): both I/O threads
    end and every socket of the store is closed."""
    threads, sockets = _io_threads(), _sockets()
    store = _store(("127.0.0.1", valkey_server.port))
    assert _put(store, [b"leak"], [b"v"]).ok and store.contains([b"leak"]) == 1
    assert _get(store, [b"leak"], 1)[0].ok
    assert _io_threads() == threads + 2 and _sockets() == sockets + 3
    del store
    gc.collect()
    assert _eventually(lambda: _io_threads() == threads and _sockets() == sockets), "the dropped store leaked"


def test_a_store_whose_get_lane_cannot_start_raises_and_leaves_no_thread_or_socket(valkey_server, monkeypatch):
    """The put lane's I/O thread started, the get lane's cannot (a pids limit): the store's construction raises,
    and the thread started is stopped and every socket closed; a store opened once threads can start serves."""
    threads, sockets, start = _io_threads(), _sockets(), threading.Thread.start

    def no_get_lane(thread):
        if thread.name == "kvkit-valkey-get":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", no_get_lane)
    with pytest.raises(RuntimeError, match="can't start") as raised:
        _store(("127.0.0.1", valkey_server.port))
    monkeypatch.setattr(threading.Thread, "start", start)
    # The error's traceback, kept (as a log of it may), holds the half-built store: nothing waits for its collection.
    assert raised.tb is not None and _io_threads() == threads and _sockets() == sockets, \
        "a store that failed to open left a thread or socket"
    store = _store(("127.0.0.1", valkey_server.port))
    assert _put(store, [b"lanes"], [b"v"]).ok and _get(store, [b"lanes"], 1)[0].ok
    assert _io_threads() == threads + 2
    store.close()
    assert _io_threads() == threads and _eventually(lambda: _sockets() == sockets)


def test_failed_calls_leave_no_socket_open(own_server):
    """A refused, a stalled and a closed server: every failure path closes its sockets."""
    sockets = _sockets()
    store = _store(("127.0.0.1", own_server.port))
    assert _put(store, [b"a"], [b"v"]).ok
    own_server.pause()
    assert _put(store, [b"a"], [b"v"]).transport_failed
    own_server.resume()
    own_server.kill()
    time.sleep(0.25)  # the retry interval: the next call tries the node again
    assert _put(store, [b"a"], [b"v"]).transport_failed
    assert store.contains([b"a"]) == 0
    assert _sockets() == sockets, "a failed call left a socket open"
    store.close()
    assert _sockets() == sockets


def test_a_put_or_get_racing_close_is_reported_failed_at_once(valkey_server, monkeypatch):
    """``close`` running between a ``put``'s (or ``get``'s) check and its queueing: the call's ticket is
    reported failed at once, and the closed store keeps its invariants."""
    from kvkit.backends.blockstore._common import TicketBox

    issue = TicketBox.issue
    for op in ("put", "get"):
        store = _store(("127.0.0.1", valkey_server.port))

        def closing_first(box, n_keys, store=store):
            store.close()  # another thread's close, landing just before the ticket is issued
            return issue(box, n_keys)

        monkeypatch.setattr(TicketBox, "issue", closing_first)
        ticket = getattr(store, op)([b"racing"], [[memoryview(bytearray(1))]])
        monkeypatch.setattr(TicketBox, "issue", issue)
        start = time.monotonic()
        results = store.poll([ticket], 2.0)
        assert time.monotonic() - start < 0.5, "the racing call's ticket was left open"
        assert [r.ticket for r in results] == [ticket] and results[0].failed == (0,), results
        assert "closed" in results[0].error
        store.check_invariants()


def test_a_get_its_lane_took_while_close_began_is_reported_only_once_its_lane_let_go_of_the_buffers(own_server,
                                                                                                   monkeypatch):
    """``close`` begins after a ``get`` was queued and its lane took it (the lane waits on a paused server, and
    reads into the buffers for a while after it wakes) but before ``get`` returned: its ticket is reported only
    once the lane let go of the buffers, never by the closing ``get`` itself while the lane still reads."""
    import kvkit.backends.blockstore.valkey as valkey_module

    store = _store(("127.0.0.1", own_server.port), request_timeout_s=2.0, connect_timeout_s=2.0)
    assert _put(store, [b"a"], [b"x"]).ok and _get(store, [b"a"], 1)[0].ok
    lane = store._gets
    ended = []
    original = valkey_module._Lane._get

    def slow_reader(self, keys, views, deadline):
        outcomes = original(self, keys, views, deadline)
        time.sleep(0.2)  # still writing the buffers
        ended.append(time.monotonic())
        return outcomes

    class Taken:
        """The lane's queue: a job put is taken by the lane, then ``close`` begins, then ``put`` returns."""

        def __init__(self, jobs):
            self.jobs = jobs

        def get(self):
            return self.jobs.get()

        def put(self, job):
            self.jobs.put(job)
            if job is not None:
                time.sleep(0.1)  # the lane took it and waits on the paused server
                threading.Thread(target=store.close).start()
                begun = time.monotonic() + 0.5  # close begins (or waits for this call to queue its job)
                while not lane.closing and time.monotonic() < begun:
                    time.sleep(0.001)

    monkeypatch.setattr(valkey_module._Lane, "_get", slow_reader)
    lane.jobs = Taken(lane.jobs)
    own_server.pause()
    try:
        ticket = store.get([b"a"], [[memoryview(bytearray(1))]])
        result = store.poll([ticket], 5.0)
        reported = time.monotonic()
        assert [r.ticket for r in result] == [ticket] and result[0].failed == (0,), result
        assert ended and ended[0] <= reported, "the ticket was reported while its lane still read into its buffers"
    finally:
        own_server.resume()
    store.close()


def test_close_while_calls_wait_on_a_stalled_server_returns_at_once(own_server):
    """A ``get`` and a ``contains`` (on another thread) wait on a paused server with a 2 s deadline: ``close``
    wakes both and returns at once, the get reported failed, the contains answering 0; no thread or socket
    of the store is left."""
    sockets, threads = _sockets(), _io_threads()
    store = _store(("127.0.0.1", own_server.port), request_timeout_s=2.0, connect_timeout_s=2.0)
    assert _put(store, [b"a"], [b"x"]).ok and store.contains([b"a"]) == 1
    own_server.pause()
    try:
        found = []
        looker = threading.Thread(target=lambda: found.append(store.contains([b"a"])))
        get = store.get([b"a"], [[memoryview(bytearray(1))]])
        looker.start()
        time.sleep(0.2)  # both are waiting on the server now
        start = time.monotonic()
        store.close()
        assert time.monotonic() - start < 1.0, f"close waited {time.monotonic() - start:.2f} s on the calls"
        looker.join(0.5)
        assert found == [0] and store.poll([get])[0].failed == (0,)
    finally:
        own_server.resume()
    assert _io_threads() == threads
    assert _eventually(lambda: _sockets() == sockets), "a socket of the closed store is still open"


def test_close_racing_a_lanes_connect_to_a_stalled_server_returns_at_once(own_server):
    """``close`` runs while the get lane is opening its connection (held in the store's ``watch`` hook, which
    runs just before it) to a paused server: the connection opened after ``close`` closed the link is closed at
    once, so ``close`` does not wait for the get's deadline, and no thread or socket of the store is left."""
    sockets, threads = _sockets(), _io_threads()
    store = _store(("127.0.0.1", own_server.port), request_timeout_s=2.0, connect_timeout_s=2.0)
    link = store._gets.link
    entered, closing = threading.Event(), threading.Event()

    def held(_address):
        entered.set()
        assert closing.wait(5.0)
        while not link._closed:
            time.sleep(0.001)
        time.sleep(0.05)  # close() has closed the link's connections (none yet) and waits for the lane

    store.watch(held)
    own_server.pause()
    try:
        get = store.get([b"a"], [[memoryview(bytearray(1))]])
        assert entered.wait(5.0)
        closing.set()
        start = time.monotonic()
        store.close()
        assert time.monotonic() - start < 1.0, f"close waited {time.monotonic() - start:.2f} s on the get"
        assert store.poll([get])[0].failed == (0,)
    finally:
        own_server.resume()
    assert _io_threads() == threads
    assert _eventually(lambda: _sockets() == sockets), "a socket of the closed store is still open"


def test_close_called_again_while_another_thread_closes_returns_once_closed(valkey_server, monkeypatch):
    """Two threads close one store: the second ``close`` waits for the first and returns with the store closed
    (its I/O thread ended, every ticket reported)."""
    from kvkit.backends.blockstore import valkey

    shut_down = valkey._shut_down

    def slow_shut_down(*args):
        time.sleep(0.3)  # the first close is still at work when the second comes
        shut_down(*args)

    monkeypatch.setattr(valkey, "_shut_down", slow_shut_down)
    store = _store(("127.0.0.1", valkey_server.port))
    first = threading.Thread(target=store.close)
    first.start()
    time.sleep(0.05)
    try:
        store.close()
        assert not store._puts.thread.is_alive() and not store._gets.thread.is_alive()
        store.check_invariants()
    finally:
        first.join()


# -- one round trip --------------------------------------------------------------------------------------


def test_contains_of_1000_keys_is_one_round_trip_per_node(valkey_server, valkey_cluster):
    """contains writes every EXISTS to a node before reading any of its replies: one send per node, then
    that node's read (the nodes' pipelines are independent: one node's read may come before another's send)."""
    from kvkit.backends.blockstore import link as link_module

    events = []

    class Counted(link_module.Connection):
        def send(self, parts):
            events.append(("send", self.sock.getpeername()[1]))
            super().send(parts)

        def small_ints(self, n):
            events.append(("read", self.sock.getpeername()[1]))
            return super().small_ints(n)

    keys = [b"kvkit:rtt:%d" % i for i in range(1000)]
    for address, cluster, nodes in ((("127.0.0.1", valkey_server.port), False, 1),
                                    (("127.0.0.1", valkey_cluster.nodes[0].port), True, 3)):
        store = ValkeyStore([address], cluster=cluster)
        assert _put(store, keys, [b"v"] * 1000).ok
        store.contains(keys[:1])  # connections (and the slot map) exist
        original, link_module.Connection = link_module.Connection, Counted
        try:
            store._lookup.reset()  # reconnect through the counting class
            store.contains(keys[:1])
            events.clear()
            assert store.contains(keys) == 1000
        finally:
            link_module.Connection = original
        sends = [e for e in events if e[0] == "send"]
        assert len(sends) == nodes and len({port for _, port in sends}) == nodes, events
        for _, port in sends:
            assert [kind for kind, p in events if p == port] == ["send", "read"], \
                f"a reply of {port} was read before it had its whole pipeline: {events}"
        store.close()


# -- a host whose name servers do not answer --------------------------------------------------------------

_SILENT_NAME_SERVER = r"""
import json, re, socket, sys, threading, time
from kvkit.backends.blockstore.resp import key_slot
from kvkit.backends.blockstore.valkey import ValkeyStore

silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
silent.bind(("127.0.0.1", 53))  # takes the queries, answers none
start = time.monotonic()
try:
    socket.getaddrinfo("kvkit-cache.internal", 6379)
except OSError:
    pass
resolver_s = time.monotonic() - start
"""
"""The start of a child script run by :func:`_with_a_silent_name_server`: a name server on loopback that takes the
queries and answers none, and ``resolver_s``, how long the system resolver took to give up on a first name."""

_SILENT_RESOLVER = _SILENT_NAME_SERVER + r"""
store = ValkeyStore([("kvkit-cache.internal", 6379)], request_timeout_s=0.3, connect_timeout_s=1.0)
start = time.monotonic()
found = store.contains([b"k"])
contains_s = time.monotonic() - start
start = time.monotonic()
results = store.poll([store.get([b"k"], [[memoryview(bytearray(8))]])], 5.0)
get_s = time.monotonic() - start
resolvers = 0
for _ in range(4):  # calls cut short by their deadline are no evidence against the node: each one asks again
    store.contains([b"k"])
    resolvers = max(resolvers, sum(t.name == "kvkit-resolve" for t in threading.enumerate()))
store.close()
print(json.dumps({"resolver_s": resolver_s, "contains_s": contains_s, "get_s": get_s, "found": found,
                  "error": results[0].error, "resolvers": resolvers}))
"""


def _with_a_silent_name_server(tmp_path, script: str) -> dict:
    """What ``script`` prints (JSON), run in a network and mount namespace of its own (``unshare``), where the only
    name server is whatever ``script`` binds to 127.0.0.1:53 and the system resolver waits 2 s a try; skips where
    that cannot be set up or the resolver does not use /etc/resolv.conf (the report's ``resolver_s``: how long a
    first name took to fail)."""
    import json
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or shutil.which("ip") is None or shutil.which("mount") is None:
        pytest.skip("needs unshare, ip and mount (util-linux, iproute2)")
    if subprocess.run(["unshare", "-rmn", "true"], capture_output=True).returncode != 0:
        pytest.skip("this host refuses unprivileged user namespaces")
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.1\noptions timeout:2 attempts:1\n")
    child = tmp_path / "child.py"
    child.write_text(script)
    shell = f"ip link set lo up && mount --bind {conf} /etc/resolv.conf && exec {sys.executable} {child}"
    run = subprocess.run(["unshare", "-rmn", "sh", "-c", shell], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    if report["resolver_s"] < 1.5:
        pytest.skip(f"the system resolver does not use /etc/resolv.conf here (answered in {report['resolver_s']} s)")
    return report


def test_a_host_whose_name_servers_do_not_answer_costs_a_call_its_deadline(tmp_path):
    """Resolving a host name is bounded by the call's deadline: a name server that takes the query and never
    answers (the system resolver waits 2 s a try here) costs ``contains`` and ``get`` their deadlines, not the
    resolver's, and calls that keep coming share one resolution (one thread). Runs in a network and mount
    namespace of its own (``unshare``), where the only name server is a silent socket on loopback."""
    report = _with_a_silent_name_server(tmp_path, _SILENT_RESOLVER)
    assert report["contains_s"] <= 0.3 + SLACK and report["found"] == 0, report
    assert report["get_s"] <= 0.3 + SLACK and report["error"].startswith("transport:"), report
    assert report["resolvers"] == 1, report


_ASKED_TO_EVER_NEW_NAMES = _SILENT_NAME_SERVER + r"""
node = socket.create_server(("127.0.0.1", 0))
port = node.getsockname()[1]
names = iter(range(1 << 30))
COMMAND = re.compile(rb"\*2\r\n\$\d+\r\n([A-Z]+)\r\n\$(\d+)\r\n")

def talk(peer):  # a Cluster node owning every slot that answers each key ASK to a host name never given before
    buf = b""
    while data := peer.recv(1 << 16):
        buf += data
        out = []
        while (m := COMMAND.match(buf)) and len(buf) >= m.end() + int(m[2]) + 2:
            arg, buf = buf[m.end():m.end() + int(m[2])], buf[m.end() + int(m[2]) + 2:]
            out.append(b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % port if m[1] == b"CLUSTER"
                       else b"-ASK %d n%d.internal:%d\r\n" % (key_slot(arg), next(names), port))
        peer.sendall(b"".join(out))

def serve():
    while True:
        threading.Thread(target=talk, args=(node.accept()[0],), daemon=True).start()

threading.Thread(target=serve, daemon=True).start()
store = ValkeyStore([("127.0.0.1", port)], cluster=True, request_timeout_s=0.3, connect_timeout_s=0.3)
resolvers, slowest = 0, 0.0
for _ in range(10):
    start = time.monotonic()
    store.contains([b"k%d" % i for i in range(200)])
    slowest = max(slowest, time.monotonic() - start)
    resolvers = max(resolvers, sum(t.name == "kvkit-resolve" for t in threading.enumerate()))
down = list(store.down_nodes)
store.close()
print(json.dumps({"resolver_s": resolver_s, "resolvers": resolvers, "slowest_s": slowest,
                  "seed_down": ["127.0.0.1", port] in [list(a) for a in down]}))
"""


def test_redirects_to_ever_new_host_names_hold_a_bounded_number_of_resolver_threads(tmp_path):
    """A Cluster node answering every key ASK to a host name never given before, call after call, where the name
    server never answers: at most :data:`~kvkit.backends.blockstore.resp.MAX_LOOKUPS` names are resolved at once
    (one thread each), a key whose node's name would be one more fails at once; each call answers by its deadline
    and the seed is not marked down (before: a thread per name, 1,114 alive after ten calls of 200 keys, each
    living as long as the resolver waited)."""
    from kvkit.backends.blockstore.resp import MAX_LOOKUPS

    report = _with_a_silent_name_server(tmp_path, _ASKED_TO_EVER_NEW_NAMES)
    assert report["resolvers"] <= MAX_LOOKUPS, report
    assert report["slowest_s"] <= 0.3 + SLACK and not report["seed_down"], report


@pytest.mark.parametrize("owned", [0, 1, 8191, 16383, "beyond"], ids=str)
def test_a_cluster_node_owning_any_one_slot_has_a_marker_key_in_it(owned):
    """A node's marker key is hash-tagged into a slot it owns, whichever slot that is: also one that no numeric tag
    below 65,536 reaches (608 slots), which a node taking its first slots may own alone."""
    if owned == "beyond":  # a slot the first 65,536 numeric tags miss
        reached = {key_slot(b"{%d}" % n) for n in range(1 << 16)}
        owned = min(set(range(16384)) - reached)
    identities = Identities()
    identities.prefix = b"kvkit:acme:"
    slots = [("10.0.0.1", 7000)] * 16384
    slots[owned] = ("10.0.0.2", 7000)
    key = identities.marker(("10.0.0.2", 7000), slots)
    assert key is not None and key.startswith(b"kvkit:acme:restart-marker:{") and key_slot(key) == owned
    other = identities.marker(("10.0.0.1", 7000), slots)
    assert other is not None and slots[key_slot(other)] == ("10.0.0.1", 7000)
    assert identities.marker(("10.0.0.3", 7000), slots) is None, "a node owning no slot has no marker"


_OUT_OF_DESCRIPTORS = """
import json, os, resource, sys
from kvkit.backends.blockstore.valkey import ValkeyStore
from kvkit.testing.limits import hold_every_descriptor
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
store = ValkeyStore([("127.0.0.1", int(sys.argv[1]))], retry_interval_s=60.0, request_timeout_s=2.0)
keys, value, report = [b"k"], [[memoryview(b"v" * 100)]], {}
report["contains"] = store.contains(keys)  # the contains connection is open
held, report["exhausted"] = hold_every_descriptor()
(short,) = store.poll([store.put(keys, value)], 10.0)  # the put lane finds no descriptor for its connection
report["short"] = [short.ok, short.error]
for fd in held:
    os.close(fd)
(again,) = store.poll([store.put(keys, value)], 10.0)
report["again"] = [again.ok, again.error]
report["contains_after"] = store.contains(keys)
store.close()
print(json.dumps(report))
"""


def test_a_process_out_of_descriptors_fails_its_keys_and_marks_no_node_down(valkey_server, tmp_path):
    """A connection the process has no descriptor for (``EMFILE``) fails that call's keys, but says nothing of the
    node: once descriptors are back the next call is served, not refused for ``retry_interval_s``."""
    import errno
    import json
    import subprocess
    import sys

    valkey_server.call(b"FLUSHALL")
    script = tmp_path / "short.py"
    script.write_text(_OUT_OF_DESCRIPTORS)
    run = subprocess.run([sys.executable, str(script), str(valkey_server.port)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["exhausted"] == errno.EMFILE
    assert report["short"][0] is False and "open files" in report["short"][1], report
    assert report["again"] == [True, ""], "a node was marked down for the client's own shortage"
    assert report["contains_after"] == 1


@pytest.mark.parametrize("opening", ["tls handshake", "login"])
def test_close_while_a_lane_waits_on_its_connections_handshake_or_login_returns_at_once(own_server, opening):
    """``close`` while the get lane's new connection waits on its TLS handshake (a server silent once it accepted)
    or on its login (``AUTH`` to a paused server) shuts that socket down, so ``close`` returns at once instead of
    after the connect budget, failing the get, leaving no thread or socket."""
    sockets, threads = _sockets(), _io_threads()
    accepted: list[socket.socket] = []
    listener = None
    if opening == "tls handshake":
        listener = socket.create_server(("127.0.0.1", 0))

        def accept():
            with contextlib.suppress(OSError):
                while True:
                    accepted.append(listener.accept()[0])

        threading.Thread(target=accept, daemon=True).start()
        store = _store(listener.getsockname(), tls=True, connect_timeout_s=4.0, request_timeout_s=4.0)
    else:
        own_server.call(b"CONFIG", b"SET", b"requirepass", b"kvkit-test-only")
        store = _store(("127.0.0.1", own_server.port), password="kvkit-test-only", connect_timeout_s=4.0,
                       request_timeout_s=4.0)
        own_server.pause()
    try:
        get = store.get([b"a"], [[memoryview(bytearray(1))]])
        time.sleep(0.5)  # the lane is connecting: its handshake or login waits on the silent server
        start = time.monotonic()
        store.close()
        assert time.monotonic() - start < 1.0, f"close waited {time.monotonic() - start:.2f} s on the {opening}"
        assert store.poll([get])[0].failed == (0,)
    finally:
        if listener is None:
            own_server.resume()
        else:
            listener.close()
            for conn in accepted:
                conn.close()
    assert _io_threads() == threads
    assert _eventually(lambda: _sockets() == sockets), "a socket of the closed store is still open"
