"""Real Valkey/Redis servers on loopback ports: one standalone and one 3-node Cluster per session."""

from __future__ import annotations

import pytest

from kvkit.testing.servers import LocalCluster, LocalServer, server_binary, server_binary_or_skip


@pytest.fixture(scope="session")
def valkey_server():
    """A standalone server shared by the tests that only read and write keys (each flushes first)."""
    with LocalServer(server_binary_or_skip()) as server:
        yield server


@pytest.fixture(scope="session")
def valkey_cluster():
    """A 3-node Cluster (slots split evenly, no replicas)."""
    with LocalCluster(binary=server_binary_or_skip()) as cluster:
        yield cluster


@pytest.fixture
def own_server():
    """A standalone server of this test's own, to kill, pause or restart."""
    server = LocalServer(server_binary_or_skip())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server():
    """Debian's redis-server (Redis 7.0), when installed: the same tests against the other server family."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with LocalServer(server_binary("redis-server")) as server:
        yield server
