"""The library half of ``kvkit bench shared``: a block store's put/get GB/s and ``contains`` latency.

Measured in one run against the same server, as ratios: the store itself, a valkey-py/redis-py
pipeline doing the same work (values as fresh ``bytes``), and the server's own
``valkey-benchmark``/``redis-benchmark`` SET/GET for the same value size when the binary is on ``PATH``.
Every value read back is compared with what was written.
"""

from __future__ import annotations

import importlib
import os
import random
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvkit.errors import BackendUnavailableError, ConfigError
from kvkit.interfaces.shared import BlockStore
from kvkit.shared.urls import open_block_store, process_wide

__all__ = ["run_shared_bench"]

_HEADER = 100  # values are gathered from / scattered into [header, payload] as the tiers use them


def run_shared_bench(url: str | None = None, *, sizes: Sequence[int] = (2 << 20, 256 << 10),
                     batch_bytes: int = 128 << 20, contains_keys: int = 1000, repeat: int = 5) -> dict[str, Any]:
    """Measure put/get of ``batch_bytes`` per size and ``contains`` of ``contains_keys`` keys.

    With ``url=None`` a local server is started (``kvkit.testing.servers.LocalServer``) and stopped
    after. Answers a JSON-able report: per size the store's, the client library's and the
    server tool's GB/s (median of ``repeat``), and ``contains`` medians in ms.
    """
    from kvkit.testing.servers import LocalServer

    server = LocalServer().start() if url is None else None
    target = server.url if server is not None else url
    try:
        store = open_block_store(target, request_timeout_s=30.0)
        problem = store.ping() if hasattr(store, "ping") else None
        if problem is not None:
            raise ConfigError(f"--url {target!r}: {problem}")
        try:
            report: dict[str, Any] = {"url": target, "repeat": repeat, "sizes": {}}
            client = _library_client(target)
            for size in sizes:
                report["sizes"][str(size)] = _throughput(store, client, target, size, max(1, batch_bytes // size),
                                                         repeat)
            report["contains"] = _contains(store, client, contains_keys, max(repeat, 20))
            return report
        finally:
            if not process_wide(store):
                store.close()
    finally:
        if server is not None:
            server.stop()


def _throughput(store: BlockStore, client: Any, url: str, size: int, n: int, repeat: int) -> dict[str, Any]:
    """GB/s of each way to move ``n`` values, measured in interleaved rounds (medians), so load hits all alike."""
    keys = [b"kvkit:bench:%d:%d" % (size, i) for i in range(n)]
    source = np.random.default_rng(0).integers(0, 256, (n, size), dtype=np.uint8)
    target = np.ones_like(source)  # touched, so no first-touch page faults are timed
    values = [[memoryview(line[:_HEADER]), memoryview(line[_HEADER:])] for line in source]
    buffers = [[memoryview(line[:_HEADER]), memoryview(line[_HEADER:])] for line in target]
    # "hot": every value from one row and into one row, as the server tool sends and receives them
    # (cache-resident); the tiers move distinct, cold rows, as the plain figures do.
    hot_keys = [b"kvkit:bench:%d:hot:%d" % (size, i) for i in range(n)]
    hot_row = np.ones(size, dtype=np.uint8)
    ways: dict[str, Callable[[], object]] = {
        "put_GBps": lambda: _finish(store, store.put(keys, values)),
        "get_GBps": lambda: _finish(store, store.get(keys, buffers)),
        "put_hot_GBps": lambda: _finish(store, store.put(hot_keys, [values[0]] * n)),
        "get_hot_GBps": lambda: _finish(store, store.get(hot_keys, [[memoryview(hot_row)]] * n)),
    }
    if client is not None:
        blobs = [line.tobytes() for line in source]

        def lib_put() -> None:
            pipe = client.pipeline(transaction=False)
            for key, blob in zip(keys, blobs):
                pipe.set(key, blob)
            pipe.execute()

        def lib_get() -> None:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            got = pipe.execute()
            assert got[-1] == blobs[-1], "the library read back other bytes"

        ways.update(library_put_GBps=lib_put, library_get_GBps=lib_get)
    tool: dict[str, list[float]] = {}

    def tool_round() -> None:
        for name, rate in _server_tool(url, size, n).items():
            tool.setdefault(name, []).append(rate)

    seconds = _interleaved(ways, repeat, tool_round)
    if not (np.array_equal(source, target) and np.array_equal(source[0], hot_row)):
        raise AssertionError(f"the values read back differ from those written ({size}-byte values)")
    row: dict[str, Any] = {"values": n, **{name: n * size / t / 1e9 for name, t in seconds.items()}}
    if tool:
        row.update({name: statistics.median(r) for name, r in tool.items()}, server_tool=os.path.basename(_tool()))
    return row


def _contains(store: BlockStore, client: Any, count: int, repeat: int) -> dict[str, Any]:
    keys = [b"kvkit:bench:contains:%032x" % i for i in range(count)]
    _finish(store, store.put(keys, [[memoryview(b"v")] for _ in keys]))
    found = store.contains(keys)
    if found != count:
        raise AssertionError(f"contains answered {found} of {count} keys just written")
    ways: dict[str, Callable[[], object]] = {"store_ms": lambda: store.contains(keys)}
    if client is not None:
        def lib() -> None:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            pipe.execute()

        ways["library_pipeline_ms"] = lib
    return {"keys": count, **{name: t * 1e3 for name, t in _interleaved(ways, repeat).items()}}


def _server_tool(url: str, size: int, n: int) -> dict[str, float]:
    """SET/GET GB/s of the server's own benchmark tool over ``n`` keys (``-P 1 -c 1``: its best case here).

    ``-r n`` spreads the tool's keys over as many values as the store moved (one key, the tool's
    default, would be served from the CPU cache); SET runs ``3 n`` requests first, so about 95 % of
    the keys GET asks for exist (a missing key's nil reply flatters the tool a little).
    """
    tool = _tool()
    scheme, _, rest = url.partition("://")
    auth, _, location = rest.rpartition("@")
    host_port = location.partition("/")[0]
    if tool is None or "," in host_port or "cluster" in scheme or scheme.endswith("s"):
        return {}
    host, _, port = host_port.rpartition(":")
    password = auth.partition(":")[2]
    rates: dict[str, float] = {}
    for test, requests in (("set", 3 * n), ("get", n)):
        command = [tool, "-h", host, "-p", port, "-t", test, "-d", str(size), "-n", str(requests), "-r", str(n),
                   "-P", "1", "-c", "1", "--csv", *(["-a", password] if password else [])]
        out = subprocess.run(command, capture_output=True, text=True, timeout=300).stdout
        for line in out.splitlines():
            cells = [c.strip('"') for c in line.split(",")]
            if len(cells) > 1 and cells[0] == test.upper():
                rates[f"server_tool_{test}_GBps"] = float(cells[1]) * size / 1e9
    return rates


def _tool() -> str | None:
    return shutil.which("valkey-benchmark") or shutil.which("redis-benchmark")


def _library_client(url: str) -> Any:
    """A valkey-py (else redis-py) client of ``url`` (its Cluster client for a Cluster URL), or ``None``."""
    scheme, _, rest = url.partition("://")
    base, _, mode = scheme.partition("+")
    auth, at, hosts = rest.rpartition("@")
    single = f"{base}://{auth}{at}{hosts.split(',')[0]}"  # a Cluster client finds the rest itself
    for module in ("valkey", "redis"):
        try:
            library = importlib.import_module(module)
        except ImportError:
            continue
        if module == "redis":
            single = single.replace("valkey", "redis", 1)
        if mode == "cluster":
            return getattr(library, "ValkeyCluster" if module == "valkey" else "RedisCluster").from_url(single)
        return library.from_url(single)
    return None


def _finish(store: BlockStore, ticket: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for result in store.poll((ticket,), 1.0):
            if not result.ok:
                raise BackendUnavailableError(f"a benchmark call failed: {result.error}")
            return
    raise BackendUnavailableError("a benchmark call was not reported within 60 s")


def _interleaved(ways: dict[str, Callable[[], object]], repeat: int,
                 extra: Callable[[], None] | None = None) -> dict[str, float]:
    """Median seconds of each way over ``repeat`` rounds; each round runs every way (and ``extra``,
    untimed) once, in a fresh order (seeded), so neither load nor the server's state favours one."""
    for work in ways.values():
        work()  # connections, first allocations
    times: dict[str, list[float]] = {name: [] for name in ways}
    order: list[str | None] = [*ways, None]
    shuffle = random.Random(0).shuffle
    for _ in range(repeat):
        shuffle(order)
        for name in order:
            if name is None:
                if extra is not None:
                    extra()
                continue
            start = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
