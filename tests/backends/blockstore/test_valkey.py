"""The Valkey store against real servers: faults (killed, paused, refusing, restarted), hostile values,
logins, TLS, and Cluster redirects. No call may wait past its timeout; failures come back as tickets."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time

import pytest

from kvkit.backends.blockstore.resp import key_slot
from kvkit.backends.blockstore.valkey import ValkeyStore
from kvkit.errors import ConfigError
from kvkit.interfaces.types import KVCacheSpec
from kvkit.shared.format import Namespace, ValueStatus, block_key, check_value, encode_header
from kvkit.testing.servers import LocalCluster, LocalServer, free_port, server_binary_or_skip

TIMEOUT = 0.3
SLACK = 1.0  # scheduling noise on a busy 2-core machine


def _store(port, **kwargs):
    kwargs.setdefault("request_timeout_s", TIMEOUT)
    kwargs.setdefault("connect_timeout_s", TIMEOUT)
    kwargs.setdefault("retry_interval_s", 0.2)
    return ValkeyStore([("127.0.0.1", port)], **kwargs)


def _wait(store, ticket, limit):
    """The result of ``ticket``, asserting it came within ``limit`` seconds."""
    start = time.monotonic()
    results = store.poll([ticket], limit + SLACK)
    assert time.monotonic() - start <= limit + SLACK, "a ticket took longer than its timeout"
    assert [r.ticket for r in results] == [ticket], results
    return results[0]


def _put(store, keys, size=1000):
    values = [[memoryview(os.urandom(size))] for _ in keys]
    return _wait(store, store.put(keys, values), TIMEOUT), values


def _get(store, keys, size=1000):
    buffers = [bytearray(size) for _ in keys]
    return _wait(store, store.get(keys, [[memoryview(b)] for b in buffers]), TIMEOUT), buffers


def _recovers(store, limit=5.0):
    """The store works again within ``limit`` seconds (after its retry interval)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if _put(store, [b"after"])[0].ok:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_server_fails_tickets_fast_and_a_restarted_one_is_used_again(own_server):
    """Killed mid-run: calls fail as transport failures within the timeout, contains answers 0; restarted: back."""
    store = _store(own_server.port)
    assert _put(store, [b"a", b"b"])[0].ok
    own_server.kill()
    result, _ = _get(store, [b"a"])
    assert result.failed == (0,) and result.transport_failed, result
    start = time.monotonic()
    assert store.contains([b"a"]) == 0
    assert time.monotonic() - start < TIMEOUT + SLACK
    assert store.transport_failures >= 1 and store.last_error.startswith("transport:")
    own_server.start()
    assert _recovers(store)
    assert store.contains([b"after"]) == 1
    store.close()


def test_a_paused_server_times_out_and_comes_back(own_server):
    """SIGSTOP past the timeout: get, put and contains give up within it; after SIGCONT the store recovers."""
    store = _store(own_server.port)
    assert _put(store, [b"a"])[0].ok
    own_server.pause()
    try:
        start = time.monotonic()
        result, _ = _get(store, [b"a"])
        assert result.transport_failed and "timed out" in result.error, result
        assert _put(store, [b"b"])[0].transport_failed  # the breaker is open: fails at once
        assert store.contains([b"a"]) == 0
        assert time.monotonic() - start < 2 * TIMEOUT + SLACK
    finally:
        own_server.resume()
    assert _recovers(store)
    result, _ = _get(store, [b"a"])
    assert result.ok
    store.close()


def test_nothing_listening_is_a_transport_failure():
    """A refused connection fails every ticket (error 'transport: ...') and contains answers 0."""
    store = _store(free_port())
    result, _ = _put(store, [b"a"])
    assert result.failed == (0,) and result.transport_failed and "Refused" in result.error
    assert store.contains([b"a"]) == 0
    assert store.ping().startswith("transport:")
    store.close()


def test_close_with_a_stalled_server_reports_every_ticket(own_server):
    """close() while the I/O thread waits on a paused server returns promptly and fails what was queued."""
    store = _store(own_server.port, request_timeout_s=5.0)
    assert _put(store, [b"a"])[0].ok
    own_server.pause()
    try:
        tickets = {store.get([b"a"], [[memoryview(bytearray(1000))]]) for _ in range(3)}
        time.sleep(0.1)
        start = time.monotonic()
        store.close()
        assert time.monotonic() - start < 1.0
        results = store.poll(tickets, 0.0)
    finally:
        own_server.resume()
    assert {r.ticket for r in results} == tickets and all(r.failed == (0,) for r in results)


NS = Namespace("org/model", KVCacheSpec(num_layers=1, block_size=16, num_kv_heads=1, head_dim=8))


def test_hostile_values_written_by_another_client_are_never_accepted(valkey_server):
    """Corrupted, truncated and foreign values that a raw client wrote are a failed get or a checked miss."""
    import valkey

    valkey_server.call(b"FLUSHALL")
    raw = valkey.Valkey(port=valkey_server.port)
    store = _store(valkey_server.port)
    payload = os.urandom(512)
    header = encode_header(NS, 7, 0, [payload])
    key = block_key(NS, 7, 0)
    other = Namespace("org/other", NS.spec)
    cases = {
        "corrupt": (header + payload[:-1] + bytes([payload[-1] ^ 1]), ValueStatus.CORRUPT),
        "foreign": (encode_header(other, 7, 0, [payload]) + payload, ValueStatus.FOREIGN),
        "good": (header + payload, ValueStatus.OK),
    }
    for name, (value, expected) in cases.items():
        raw.set(key, value)
        head, body = bytearray(len(header)), bytearray(len(payload))
        result = _wait(store, store.get([key], [[memoryview(head), memoryview(body)]]), TIMEOUT)
        assert result.ok, name
        assert check_value(NS, 7, 0, head, [body]) is expected, name
    raw.set(key, (header + payload)[:-5])  # truncated: the sizes disagree, the get fails
    result = _wait(store, store.get([key], [[memoryview(bytearray(len(header) + len(payload)))]]), TIMEOUT)
    assert result.failed == (0,) and not result.transport_failed
    raw.close()
    store.close()


def test_password_and_acl_user():
    """requirepass and an ACL user log in; a wrong password fails as a transport failure naming the refusal."""
    with LocalServer(password="pw") as server:
        assert _store(server.port, password="pw").ping() is None
        server.call(b"ACL", b"SETUSER", b"kvkit", b"on", b">userpw", b"~kvkit:*", b"+@all")
        user = _store(server.port, username="kvkit", password="userpw")
        assert _put(user, [b"kvkit:x"])[0].ok
        assert _put(user, [b"other:x"])[0].failed == (0,)  # outside the user's key pattern
        user.close()
        wrong = _store(server.port, password="nope")
        result, _ = _put(wrong, [b"kvkit:x"])
        assert result.transport_failed and "refused the login" in result.error
        wrong.close()


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("openssl") is None,
                    reason="needs Debian's redis-server (built with TLS) and openssl")
def test_tls(tmp_path):
    """valkeys://: a TLS server is reached with the CA given; without verification off, a wrong CA is refused, and
    so is a certificate of the CA that names another host than the one reached."""
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-days", "1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                               "127.0.0.2", "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", cert,
                               "--tls-auth-clients", "no", "--save", "", "--dir", tmp_path],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        store = _store(port, tls=True, tls_ca=str(cert), request_timeout_s=2.0, connect_timeout_s=2.0)
        deadline = time.monotonic() + 10
        while store.ping() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        result, values = _put(store, [b"t"])
        assert result.ok
        got, buffers = _get(store, [b"t"])
        assert got.ok and buffers[0] == bytes(values[0][0])
        store.close()
        untrusted = _store(port, tls=True, request_timeout_s=2.0, connect_timeout_s=2.0)
        assert "CERTIFICATE_VERIFY_FAILED" in (untrusted.ping() or "")
        untrusted.close()
        misnamed = ValkeyStore([("127.0.0.2", port)], tls=True, tls_ca=str(cert), request_timeout_s=2.0,
                               connect_timeout_s=2.0)  # the server, with a certificate naming 127.0.0.1 only
        assert "IP address mismatch" in (misnamed.ping() or "")
        misnamed.close()
    finally:
        server.kill()
        server.wait(5)


def test_cluster_follows_moved_after_a_stale_slot_map(valkey_cluster):
    """With every slot wrongly mapped to one node, MOVED replies route each key to its owner."""
    for node in valkey_cluster.nodes:
        node.call(b"FLUSHALL")
    store = ValkeyStore([("127.0.0.1", valkey_cluster.nodes[0].port)], cluster=True)
    keys = [b"kvkit:moved:%d" % i for i in range(50)]
    assert _put(store, keys[:1])[0].ok
    wrong = [("127.0.0.1", valkey_cluster.nodes[0].port)] * 16384
    topology = store._lookup.topology  # both links' slot map
    topology.slots, topology.stale = list(wrong), False
    result, values = _put(store, keys)
    assert result.ok
    topology.slots, topology.stale = list(wrong), False
    assert store.contains(keys) == 50
    got, buffers = _get(store, keys)
    assert got.ok and [bytes(v[0]) for v in values] == [bytes(b) for b in buffers]
    store.close()


def test_a_watcher_hears_of_every_node_the_store_connects_to_once(valkey_cluster):
    """``watch``: each node is reported once, before the store's first connection to it: the seed, and the
    nodes reached only through MOVED (the slot map wrongly names the seed for every slot); a watcher added later
    hears of them all at once."""
    nodes = [("127.0.0.1", n.port) for n in valkey_cluster.nodes]
    store = ValkeyStore(nodes[:1], cluster=True)
    heard: list[tuple[str, int]] = []
    store.watch(heard.append)
    topology = store._lookup.topology
    topology.slots, topology.stale = [nodes[0]] * 16384, False
    try:
        keys = [b"kvkit:watch:%d" % i for i in range(50)]
        assert _put(store, keys)[0].ok and store.contains(keys) == 50 and _get(store, keys)[0].ok
        assert heard[0] == nodes[0] and sorted(heard) == sorted(nodes)
        late: list[tuple[str, int]] = []
        store.watch(late.append)
        assert late == heard
    finally:
        store.close()


def test_cluster_follows_ask_during_a_migration(valkey_cluster):
    """A slot being migrated answers ASK for keys it lacks; the store asks the importing node."""
    nodes = valkey_cluster.nodes
    for node in nodes:
        node.call(b"FLUSHALL")
    key = b"kvkit:ask:0"
    slot = key_slot(key)
    store = ValkeyStore([("127.0.0.1", nodes[0].port)], cluster=True)
    store.contains([key])  # learn the slot map
    owner = next(n for n in nodes if ("127.0.0.1", n.port) == store._lookup.topology.slots[slot])
    target = next(n for n in nodes if n is not owner)
    ids = {n.port: n.call(b"CLUSTER", b"MYID") for n in nodes}
    target.call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"IMPORTING", ids[owner.port])
    owner.call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"MIGRATING", ids[target.port])
    try:
        result, values = _put(store, [key])
        assert result.ok
        assert target.call(b"ASKING") == b"OK"  # the value lives on the importing node
        got, buffers = _get(store, [key])
        assert got.ok and buffers[0] == bytes(values[0][0])
    finally:
        for node in (owner, target):
            node.call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"STABLE")
        store.close()


def test_a_refused_asking_fails_the_asked_keys_with_the_servers_error_and_keeps_the_node(valkey_cluster):
    """A user whose ACL lacks ``+asking`` (``-NOPERM``) during a migration: the asked key fails with the
    server's words (not a transport failure), the importing node's own keys land in the same call, and no node
    is marked down."""
    nodes = valkey_cluster.nodes
    for node in nodes:
        node.call(b"FLUSHALL")
        node.call(b"ACL", b"SETUSER", b"kvkit-noask", b"on", b">noask-pw", b"resetkeys", b"~kvkit:*",
                  b"resetchannels", b"-@all", b"+ping", b"+exists", b"+get", b"+set", b"+cluster|slots")
    store = ValkeyStore([("127.0.0.1", nodes[0].port)], cluster=True, username="kvkit-noask", password="noask-pw")
    key = b"kvkit:noask:0"
    slot = key_slot(key)
    store.contains([key])  # learn the slot map
    owners = store._lookup.topology.slots
    owner = next(n for n in nodes if ("127.0.0.1", n.port) == owners[slot])
    target = next(n for n in nodes if n is not owner)
    own = next(k for k in (b"kvkit:noask:%d" % i for i in range(1, 1000))
               if owners[key_slot(k)] == ("127.0.0.1", target.port))
    ids = {n.port: n.call(b"CLUSTER", b"MYID") for n in nodes}
    try:
        assert _put(store, [own])[0].ok  # the importing node's connection is open, and reused below
        target.call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"IMPORTING", ids[owner.port])
        owner.call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"MIGRATING", ids[target.port])
        result, _ = _put(store, [key, own])
        assert result.failed == (0,) and "NOPERM" in result.error and not result.transport_failed, result
        assert store.down_nodes == {} and store.transport_failures == 0, store.down_nodes
        assert _get(store, [own])[0].ok
    finally:
        for node in (owner, target):
            node.call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"STABLE")
        for node in nodes:
            node.call(b"ACL", b"DELUSER", b"kvkit-noask")
        store.close()


@pytest.mark.parametrize("endpoint", ["unknown-endpoint", "hostname"])
def test_a_cluster_that_announces_no_endpoint_is_served(endpoint):
    """``cluster-preferred-endpoint-type unknown-endpoint`` (nodes behind a load balancer) names no host in
    CLUSTER SLOTS (NULL) or MOVED (``:port``): the answering node's host is used. ``hostname`` with no hostname
    announced names ``?``: CLUSTER SLOTS gives the node's IP beside it, and a MOVED to ``?`` fails its key only
    until the slot map is read again."""
    with LocalCluster(binary=server_binary_or_skip(), args=["--cluster-preferred-endpoint-type", endpoint]) as cluster:
        first = cluster.nodes[0].port
        store = ValkeyStore([("127.0.0.1", first)], cluster=True, request_timeout_s=2.0, connect_timeout_s=2.0)
        keys = [b"kvkit:endpoint:%d" % i for i in range(50)]
        try:
            result, _ = _put(store, keys)
            assert result.ok, result
            assert store.contains(keys) == 50
            store._puts.link.topology.slots = [("127.0.0.1", first)] * 16384  # every key but node 0's is MOVED
            result, values = _put(store, keys)
            if endpoint == "hostname":
                assert result.failed and "unknown endpoint" in result.error
                result, values = _put(store, keys)
            assert result.ok, result
            got, buffers = _get(store, keys)
            assert got.ok and [bytes(v[0]) for v in values] == [bytes(b) for b in buffers]
            assert store.down_nodes == {}
        finally:
            store.close()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"nodes": []}, "nodes"),
    ({"nodes": [("127.0.0.1", 0)]}, "nodes"),
    ({"cluster": True, "db": 1}, "database 0"),
    ({"username": "u"}, "password"),
    ({"tls_ca": "/x"}, "tls=True"),
    ({"tls": True, "tls_ca": "/nonexistent.pem"}, "cannot be loaded"),
    ({"request_timeout_s": 0}, "request_timeout_s"),
    ({"request_timeout_s": math.inf}, r"request_timeout_s=inf: must be a number in \(0.0, 86400.0\]"),
    ({"connect_timeout_s": 1e10}, "connect_timeout_s=10000000000.0"),
    ({"retry_interval_s": 1e308}, "retry_interval_s=1e\\+308"),
    ({"ttl_s": 10**20}, "ttl_s=100000000000000000000: must be at most 3,153,600,000"),  # else every SET is refused
    ({"ttl_s": 0}, "ttl_s=0: must be an int >= 1"),
    ({"password": "pw\udcff"}, "password: holds a character UTF-8 cannot encode"),
    ({"username": "u\udcff", "password": "pw"}, "username: holds a character UTF-8 cannot encode"),
])
def test_bad_settings_are_refused(kwargs, match):
    """Bad settings raise ConfigError quoting the field, before any thread starts."""
    kwargs = {"nodes": [("127.0.0.1", 6379)], **kwargs}
    threads = threading.active_count()
    with pytest.raises(ConfigError, match=match):
        ValkeyStore(**kwargs)
    assert threading.active_count() == threads


def test_a_server_answering_garbage_is_a_transport_failure():
    """A listener that answers non-RESP bytes fails the call as a transport (protocol) failure; nothing hangs."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def answer_junk():
        for _ in range(4):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

    thread = threading.Thread(target=answer_junk, daemon=True)
    thread.start()
    store = _store(listener.getsockname()[1])
    try:
        result, _ = _get(store, [b"a"])
        assert result.transport_failed and "protocol error" in result.error, result
        assert store.contains([b"a"]) == 0
    finally:
        store.close()
        listener.close()


def test_the_password_stays_out_of_reprs():
    """A store's repr (in logs, tracebacks) shows the user but never the password."""
    store = ValkeyStore([("127.0.0.1", free_port())], username="kvkit", password="hunter2")
    try:
        assert "hunter2" not in repr(store) and "kvkit" in repr(store)
        assert "hunter2" not in repr(store._puts) and "hunter2" not in repr(store._gets)
    finally:
        store.close()
