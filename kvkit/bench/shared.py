"""The library half of ``kvkit bench shared``: a block store's put/get GB/s and ``contains`` latency.

Measured in one run against the same server, as ratios: the store itself, a valkey-py/redis-py
pipeline doing the same work (values as fresh ``bytes``), and the server's own
``valkey-benchmark``/``redis-benchmark`` SET/GET for the same value size when the binary is on ``PATH``,
at the same concurrency: one connection (the store's I/O thread has one per node; the tool runs
``-c 1 -P 1``). Every way runs once per round, the rounds in a fresh order each; a figure is the median
over the rounds, wall time and the CPU time of this process and its children (the tool) beside it.
Every value read back is compared with what was written. Each value size gets a fresh store and library
client, as a deployment moves one block size and the tool connects afresh for each run.

No password is shown or handed on: the report names the URL through
:func:`~kvkit.config.shown_url`, and the server tool, which takes a password
only on its command line (``-a``, readable by every local user in
``/proc/<pid>/cmdline``; neither tool reads one from the environment), is not
run against a server that needs one: the report says so (``server_tool_skipped``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl

import attrs
import numpy as np

from kvkit.config import shown_url
from kvkit.errors import BackendUnavailableError, ConfigError
from kvkit.interfaces.shared import BlockStore
from kvkit.shared.urls import open_block_store, process_wide
from kvkit.validate import plural, quote

__all__ = ["run_shared_bench"]

_HEADER = 100  # values are gathered from / scattered into [header, payload] as the tiers use them


def run_shared_bench(url: str | None = None, *, sizes: Sequence[int] = (2 << 20, 256 << 10),
                     batch_bytes: int = 128 << 20, contains_keys: int = 1000, repeat: int = 5) -> dict[str, Any]:
    """Measure put/get of ``batch_bytes`` per size and ``contains`` of ``contains_keys`` keys.

    With ``url=None`` a local server is started (``kvkit.testing.servers.LocalServer``) and stopped
    after. Answers a JSON-able report: per size the store's, the client library's and the
    server tool's GB/s (median of ``repeat`` rounds) with their CPU ms per GB, and the store's
    ratios to the tool and to the library (``ratios``: ``put``/``get`` move distinct rows, as the
    tiers do; ``put_hot``/``get_hot`` one cache-resident row, as the tool does); ``contains``
    medians in ms (wall and CPU).
    """
    from kvkit.testing.servers import LocalServer

    server: LocalServer | None = None
    if url is None:
        server = LocalServer().start()
        target = server.url
    else:
        target = url
    try:
        report: dict[str, Any] = {"url": shown_url(target), "repeat": repeat, "sizes": {}}
        # One store and one library client per value size, as a deployment moves one block size (and the tool
        # connects afresh for each run): a connection's congestion state after one size does not pace the next.
        for size in sizes:
            with _connected(target) as (store, client):
                skipped = _tool_skipped(store)
                if skipped is not None:
                    report["server_tool_skipped"] = skipped
                report["sizes"][str(size)] = _throughput(store, client, size, max(1, batch_bytes // size),
                                                         repeat)
        with _connected(target) as (store, client):
            report["contains"] = _contains(store, client, contains_keys, max(repeat, 20))
        return report
    finally:
        if server is not None:
            server.stop()


@contextlib.contextmanager
def _connected(url: str) -> Iterator[tuple[BlockStore, Any]]:
    """A fresh store of ``url`` (checked with a ping) and a client library's client, both closed after."""
    given = dict(parse_qsl(url.partition("?")[2]))
    store = open_block_store(url, **({} if "request_timeout_s" in given else {"request_timeout_s": 30.0}))
    client = None
    try:
        problem = store.ping() if hasattr(store, "ping") else None
        if problem is not None:
            raise ConfigError(f"--url {quote(url)}: {problem}")
        client = _library_client(store)
        yield store, client
    finally:
        if client is not None and hasattr(client, "close"):
            client.close()
        if not process_wide(store):
            store.close()


@attrs.frozen
class _Way:
    """One way to move the values: ``run`` answers its own seconds (a tool's report), or ``None`` (its wall
    time counts); ``num_bytes`` is what one run moves."""

    run: Callable[[], float | None]
    num_bytes: int


def _throughput(store: BlockStore, client: Any, size: int, n: int, repeat: int) -> dict[str, Any]:
    """GB/s and CPU ms per GB of each way to move ``n`` values, measured in interleaved rounds (medians),
    so load hits all alike; the store's ratios to the server tool and to the library."""
    keys = [b"kvkit:bench:%d:%d" % (size, i) for i in range(n)]
    source = np.random.default_rng(0).integers(0, 256, (n, size), dtype=np.uint8)
    target = np.ones_like(source)  # touched, so no first-touch page faults are timed
    values = [[memoryview(line[:_HEADER]), memoryview(line[_HEADER:])] for line in source]
    buffers = [[memoryview(line[:_HEADER]), memoryview(line[_HEADER:])] for line in target]
    # "hot": every value from one row and into one row, as the server tool sends and receives them
    # (cache-resident); the tiers move distinct, cold rows, as the plain figures do.
    hot_keys = [b"kvkit:bench:%d:hot:%d" % (size, i) for i in range(n)]
    hot_row = np.ones(size, dtype=np.uint8)
    batch = n * size
    ways: dict[str, _Way] = {
        "put": _Way(lambda: _finish(store, store.put(keys, values)), batch),
        "get": _Way(lambda: _finish(store, store.get(keys, buffers)), batch),
        "put_hot": _Way(lambda: _finish(store, store.put(hot_keys, [values[0]] * n)), batch),
        "get_hot": _Way(lambda: _finish(store, store.get(hot_keys, [[hot_row.data]] * n)), batch),
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

        ways.update(library_put=_Way(lib_put, batch), library_get=_Way(lib_get, batch))
    tool = _tool_command(store)
    if tool is not None:
        for test, requests in (("set", 3 * n), ("get", n)):
            ways[f"server_tool_{test}"] = _Way(functools.partial(_run_tool, tool, test, size, requests, n),
                                                requests * size)
    measured = _interleaved({name: way.run for name, way in ways.items()}, repeat)
    if not (np.array_equal(source, target) and np.array_equal(source[0], hot_row)):
        raise AssertionError(f"the values read back differ from those written ({size}-byte values)")
    row: dict[str, Any] = {"values": n}
    for name, (seconds, cpu) in measured.items():
        row[f"{name}_GBps"] = ways[name].num_bytes / seconds / 1e9
        row[f"{name}_cpu_ms_per_GB"] = cpu / ways[name].num_bytes * 1e12
    if tool is not None:
        row["server_tool"] = f"{os.path.basename(tool[0])} -c 1 -P 1"
    ratios = row["ratios"] = {}
    for op, other, theirs in (("put", "tool", "server_tool_set"), ("get", "tool", "server_tool_get"),
                              ("put_hot", "tool", "server_tool_set"), ("get_hot", "tool", "server_tool_get"),
                              ("put", "library", "library_put"), ("get", "library", "library_get")):
        if f"{theirs}_GBps" in row:
            ratios[f"{op}_vs_{other}"] = row[f"{op}_GBps"] / row[f"{theirs}_GBps"]
    return row


def _contains(store: BlockStore, client: Any, count: int, repeat: int) -> dict[str, Any]:
    keys = [b"kvkit:bench:contains:%032x" % i for i in range(count)]
    _finish(store, store.put(keys, [[memoryview(b"v")] for _ in keys]))
    found = store.contains(keys)
    if found != count:
        raise AssertionError(f"contains answered {found} of {plural(count, 'key')} just written")
    ways: dict[str, Callable[[], object]] = {"store": lambda: store.contains(keys)}
    if client is not None:
        def lib() -> None:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            pipe.execute()

        ways["library_pipeline"] = lib
    out: dict[str, Any] = {"keys": count}
    for name, (seconds, cpu) in _interleaved(ways, repeat).items():
        out[f"{name}_ms"], out[f"{name}_cpu_ms"] = seconds * 1e3, cpu * 1e3
    return out


def _tool_command(store: BlockStore) -> list[str] | None:
    """The server tool's command line for ``store``'s server, or ``None`` (no tool, a store without ``nodes``,
    a Cluster, TLS, or a server that needs a password: the tool takes one only in its argv, which any local user
    can read).

    Built from the store's own settings (first node, database, login, TLS), never from the URL, as
    :func:`_library_client` is: the URL's scheme and address have forms (``redis://``, no port, ``[::1]``) a
    second parser would misread.
    """
    tool = _tool()
    nodes = getattr(store, "nodes", None)
    if tool is None or not nodes or getattr(store, "cluster", False) or getattr(store, "tls", False) or \
            _tool_skipped(store):
        return None
    host, port = nodes[0]
    return [tool, "-h", host, "-p", str(port), "--dbnum", str(getattr(store, "db", 0))]


def _run_tool(command: list[str], test: str, size: int, requests: int, keys: int) -> float | None:
    """Seconds the server tool reports for ``requests`` SETs or GETs of ``size`` bytes over ``keys`` keys;
    ``None`` for a run too short for its millisecond clock (it says ``inf``: the wall time, start-up
    included, counts instead).

    ``-c 1 -P 1``: one connection, one request at a time (its best case here). ``-r keys`` spreads
    the tool's keys over as many values as the store moved (one key, the tool's default, would be
    served from the CPU cache); SET runs ``3 keys`` requests, so about 95 % of the keys GET asks
    for exist (a missing key's nil reply flatters the tool a little).
    """
    out = subprocess.run([*command, "-t", test, "-d", str(size), "-n", str(requests), "-r", str(keys),
                          "-P", "1", "-c", "1", "--csv"], capture_output=True, text=True, timeout=300).stdout
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) > 1 and cells[0] == test.upper():
            rate = float(cells[1])
            return requests / rate if math.isfinite(rate) and rate > 0 else None
    raise BackendUnavailableError(f"{os.path.basename(command[0])} -t {test} printed no result: {out[-200:]!r}")


def _tool_skipped(store: BlockStore) -> str | None:
    """Why the server tool is not run against ``store``'s server (it needs a login), or ``None``."""
    if getattr(store, "password", None) is not None:
        return ("the server needs a login, and the server tool takes a password only on its command line "
                "(readable by every local user)")
    return None


def _tool() -> str | None:
    return shutil.which("valkey-benchmark") or shutil.which("redis-benchmark")


def _library_client(store: BlockStore) -> Any:
    """A valkey-py (else redis-py) client of ``store``'s server (its Cluster client for a Cluster), or ``None``
    (a store without ``nodes``, or neither library installed).

    Built from the store's own settings (first node, database, login, TLS), never from the URL: a password may
    hold what kvkit's URL syntax allows unencoded ('/', '#', spaces), which the library's URL parser would
    misread and quote in its errors. The query's other options are the store's (``ttl_s``...), not the library's.
    """
    nodes = getattr(store, "nodes", None)
    if not nodes:
        return None
    host, port = nodes[0]  # a Cluster client finds the rest itself
    settings: dict[str, Any] = {"host": host, "port": port, "username": getattr(store, "username", None),
                                "password": getattr(store, "password", None)}
    if getattr(store, "tls", False):
        settings.update(ssl=True, ssl_ca_certs=getattr(store, "tls_ca", None),
                        ssl_certfile=getattr(store, "tls_cert", None), ssl_keyfile=getattr(store, "tls_key", None),
                        ssl_cert_reqs="required" if getattr(store, "tls_verify", True) else "none")
    for module in ("valkey", "redis"):
        try:
            library = importlib.import_module(module)
        except ImportError:
            continue
        prefix = "Valkey" if module == "valkey" else "Redis"
        if getattr(store, "cluster", False):
            return getattr(library, prefix + "Cluster")(**settings)
        return getattr(library, prefix)(db=getattr(store, "db", 0), **settings)
    return None


def _finish(store: BlockStore, ticket: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for result in store.poll((ticket,), 1.0):
            if not result.ok:
                raise BackendUnavailableError(f"a benchmark call failed: {result.error}")
            return
    raise BackendUnavailableError("a benchmark call was not reported within 60 s")


def _interleaved(ways: dict[str, Callable[[], object]], repeat: int) -> dict[str, tuple[float, float]]:
    """Median seconds and median CPU seconds (this process and its children) of each way over ``repeat``
    rounds; each round runs every way once, in a fresh order (seeded), so neither load nor the server's
    state favours one. A way that answers a number reports its own seconds (a tool's); else its wall
    time counts."""
    for work in ways.values():
        work()  # connections, first allocations
    times: dict[str, list[float]] = {name: [] for name in ways}
    cpus: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways)
    shuffle = random.Random(0).shuffle
    for _ in range(repeat):
        shuffle(order)
        for name in order:
            cpu = _cpu_seconds()
            start = time.perf_counter()
            reported = ways[name]()
            wall = time.perf_counter() - start
            cpus[name].append(_cpu_seconds() - cpu)
            times[name].append(reported if isinstance(reported, float) else wall)
    return {name: (statistics.median(times[name]), statistics.median(cpus[name])) for name in ways}


def _cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and of its finished children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime
