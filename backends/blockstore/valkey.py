"""``ValkeyStore``: a ``BlockStore`` on a Valkey or Redis server, standalone or Cluster."""

from __future__ import annotations

import queue
import ssl
import threading
import time
from collections.abc import Collection, Sequence

import attrs

from kvkit.backends.blockstore._common import MAX_WAITING, TicketBox, check_call, check_keys, flat_views
from kvkit.backends.blockstore.resp import Address, ConnectOptions, Link, Redirect, ServerError, error_reply
from kvkit.errors import ConfigError
from kvkit.interfaces.shared import StoreResult
from kvkit.validate import check_bool, check_int, check_real, checked, quote

__all__ = ["ValkeyStore"]

_OK = b"+OK"


def _nodes(value: object) -> tuple[Address, ...]:
    try:
        nodes = tuple((str(host), int(port)) for host, port in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        nodes = ()
    if not nodes or any(not host or not 0 < port < 65536 for host, port in nodes):
        raise ConfigError(f"ValkeyStore.nodes={quote(value)}: must be a non-empty list of (host, port) pairs")
    return nodes


def _optional_text(value: object, field: attrs.Attribute) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"ValkeyStore.{field.name}={quote(value)}: must be a string or None")
    return value


_TEXT = attrs.Converter(_optional_text, takes_field=True)
_SECONDS = checked(check_real, low=0.0, low_open=True, label="ValkeyStore.")
_FLAG = checked(check_bool, label="ValkeyStore.")


@attrs.define(eq=False)
class _Health:
    """The link's breaker, shared by the lookup and I/O connections: down for ``retry_interval_s`` after a failure."""

    retry_interval_s: float
    down_until: float = 0.0
    last_error: str = ""
    failures: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def down(self) -> str | None:
        """The reason calls fail fast now, or ``None`` when the server may be tried."""
        with self._lock:
            return self.last_error if time.monotonic() < self.down_until else None

    def clear(self) -> None:
        """A call went through: close the breaker at once."""
        with self._lock:
            self.down_until = 0.0

    def trip(self, exc: BaseException) -> str:
        """Record a transport failure; answer its one-line ``"transport: ..."`` reason."""
        with self._lock:
            self.failures += 1
            self.last_error = f"transport: {type(exc).__name__}: {exc}"
            self.down_until = time.monotonic() + self.retry_interval_s
            return self.last_error


@attrs.define(eq=False)
class ValkeyStore:
    """Block values on a Valkey/Redis server (or Cluster), one key per block, over hand-written RESP.

    ``put`` and ``get`` go to one background I/O thread with its own
    connection (one per Cluster node), which pipelines a whole call: SETs
    are written from the caller's buffers (no copy), GET replies are
    received straight into the caller's buffers (``recv_into``). ``contains``
    runs on the caller's thread over a second connection: one pipeline of
    EXISTS per node, one round trip. In a Cluster, keys go to the node owning
    their hash slot (CLUSTER SLOTS, updated on MOVED, ASK followed).

    Failure: every socket operation is bounded by ``request_timeout_s`` (no
    progress for that long fails it) and connecting by
    ``connect_timeout_s``. A transport failure fails the call with an error
    starting ``"transport:"`` and makes every call fail fast (``contains``
    answers 0) for ``retry_interval_s``; then the next call reconnects.
    ``ttl_s`` gives every value an expiry, so a ``volatile-*`` eviction
    policy of the server can act. At most ``max_waiting`` finished results
    wait for the polls naming their tickets (one more abandons the oldest).

    Invariants: every ticket is reported at most once, only to a poll naming
    it; after ``close`` the
    I/O thread has stopped, so no buffer is touched after its ticket was
    reported.
    """

    nodes: tuple[Address, ...] = attrs.field(converter=_nodes)
    cluster: bool = attrs.field(default=False, converter=_FLAG)
    db: int = attrs.field(default=0, converter=checked(check_int, minimum=0, label="ValkeyStore."))
    username: str | None = attrs.field(default=None, converter=_TEXT)
    password: str | None = attrs.field(default=None, converter=_TEXT, repr=False)
    tls: bool = attrs.field(default=False, converter=_FLAG)
    tls_ca: str | None = attrs.field(default=None, converter=_TEXT)
    tls_cert: str | None = attrs.field(default=None, converter=_TEXT)
    tls_key: str | None = attrs.field(default=None, converter=_TEXT)
    tls_verify: bool = attrs.field(default=True, converter=_FLAG)
    connect_timeout_s: float = attrs.field(default=1.0, converter=_SECONDS)
    request_timeout_s: float = attrs.field(default=2.0, converter=_SECONDS)
    retry_interval_s: float = attrs.field(default=1.0, converter=_SECONDS)
    ttl_s: int | None = attrs.field(default=None, converter=checked(check_int, minimum=1, optional=True,
                                                                    label="ValkeyStore."))
    window_bytes: int = attrs.field(default=256 << 10, converter=checked(check_int, minimum=1,
                                                                         label="ValkeyStore."))
    """Bytes of values per chunk of a put or get; at most two chunks are in flight per node."""
    max_waiting: int = attrs.field(default=MAX_WAITING, kw_only=True,
                                   converter=checked(check_int, minimum=1, label="ValkeyStore."))
    closed: bool = attrs.field(default=False, init=False)
    _health: _Health = attrs.field(init=False)
    _lookup: Link = attrs.field(init=False)
    _io: Link = attrs.field(init=False)
    _lookup_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _tickets: TicketBox = attrs.field(init=False, default=attrs.Factory(
        lambda self: TicketBox(self.max_waiting), takes_self=True))
    _jobs: queue.SimpleQueue = attrs.field(factory=queue.SimpleQueue, init=False)
    _thread: threading.Thread = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.cluster and self.db:
            raise ConfigError(f"ValkeyStore.db={self.db}: a Cluster has only database 0")
        if self.username is not None and self.password is None:
            raise ConfigError(f"ValkeyStore.username={self.username!r} needs a password")
        options = ConnectOptions(self.connect_timeout_s, self.request_timeout_s, self.username, self.password,
                                 self.db, self._tls_context())
        self._health = _Health(self.retry_interval_s)
        self._lookup = Link(self.nodes, self.cluster, options)
        self._io = Link(self.nodes, self.cluster, options, self.window_bytes)
        self._thread = threading.Thread(target=self._serve, name="kvkit-valkey-io", daemon=True)
        self._thread.start()

    @property
    def last_error(self) -> str:
        """The latest transport failure (``""`` if none yet)."""
        return self._health.last_error

    @property
    def transport_failures(self) -> int:
        """Transport failures seen so far (each trips the breaker once)."""
        return self._health.failures

    def ping(self) -> str | None:
        """``None`` when the server answers (and logs us in), closing the breaker; else ``"transport: <why>"``."""
        check_keys("ValkeyStore", self.closed, ())
        with self._lookup_lock:
            try:
                self._lookup.run([b"kvkit:ping"], lambda _: [b"*1\r\n$4\r\nPING\r\n"], lambda c, _: [c.reply()])
            except OSError as exc:
                return self._health.trip(exc)
            except ServerError as exc:
                return f"transport: the server refused us: {exc}"
        self._health.clear()
        return None

    def contains(self, keys: Sequence[bytes]) -> int:
        check_keys("ValkeyStore", self.closed, keys)
        if not keys or self._health.down() is not None:
            return 0
        with self._lookup_lock:
            try:
                found = self._lookup.run(
                    keys, lambda ids: [b"".join(_EXISTS % (len(keys[i]), keys[i]) for i in ids)], _read_ints)
            except (OSError, ServerError) as exc:
                self._health.trip(exc)
                return 0
        n = 0
        while n < len(found) and found[n] == 1:
            n += 1
        return n

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview]]) -> int:
        check_call("ValkeyStore", self.closed, keys, values)
        return self._queue("put", keys, values)

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        check_call("ValkeyStore", self.closed, keys, buffers)
        return self._queue("get", keys, buffers)

    def poll(self, tickets: Collection[int], timeout: float = 0.0) -> list[StoreResult]:
        return self._tickets.poll(tickets, timeout)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._jobs.put(None)
        self._io.close()  # a read blocked in the I/O thread returns at once
        self._thread.join(self.request_timeout_s + self.connect_timeout_s)
        assert not self._thread.is_alive(), "the I/O thread did not stop"
        self._io.close()  # a connection the thread opened while we were closing
        with self._lookup_lock:
            self._lookup.close()
        self._tickets.fail_open("ValkeyStore closed")

    def check_invariants(self) -> None:
        assert self.closed or self._thread.is_alive(), "the I/O thread died"
        assert not self.closed or self._tickets.outstanding == 0, "tickets left unfinished after close"
        self._tickets.check_invariants()

    def _queue(self, op: str, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        ticket = self._tickets.issue(len(keys))
        self._jobs.put((ticket, op, list(keys), [flat_views(b) for b in buffers]))
        return ticket

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self.closed:
                break
            ticket, op, keys, views = job
            if not keys:
                self._tickets.report(ticket)
                continue
            down = self._health.down()
            if down is not None:
                self._tickets.report(ticket, range(len(keys)), down)
                continue
            try:
                outcomes = self._put(keys, views) if op == "put" else self._get(keys, views)
            except Exception as exc:  # OSError, or a reply we cannot parse: the link is dropped either way
                self._io.close()
                reason = self._health.trip(exc)
                self._tickets.report(ticket, range(len(keys)), "ValkeyStore closed" if self.closed else reason)
                continue
            failed = [i for i, problem in enumerate(outcomes) if problem is not None]
            self._tickets.report(ticket, failed, "; ".join(sorted({str(outcomes[i]) for i in failed}))[:500])

    def _put(self, keys: list[bytes], views: list[list[memoryview]]) -> list[object]:
        expire = b"" if self.ttl_s is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(self.ttl_s)), self.ttl_s)

        tail = b"\r\n" + expire

        def encode(ids: list[int]) -> list[bytes | memoryview]:
            parts: list[bytes | memoryview] = []
            for i in ids:
                size = sum(v.nbytes for v in views[i])
                parts.append(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
                    5 if expire else 3, len(keys[i]), keys[i], size))
                parts += views[i]
                parts.append(tail)
            return parts

        def read(conn, ids: list[int]) -> list[object]:
            return [_set_outcome(conn.line()) for _ in ids]

        return self._io.run(keys, encode, read, [sum(v.nbytes for v in parts) for parts in views])

    def _get(self, keys: list[bytes], views: list[list[memoryview]]) -> list[object]:
        def read_one(conn, i: int) -> object:
            line = conn.line()
            if line[:1] == b"-":
                return error_reply(line[1:])
            if line[:1] != b"$":
                raise ConnectionError(f"protocol error: a GET answered {line[:80]!r}")
            size = int(line[1:])
            if size < 0:
                return "missing value"
            want = sum(v.nbytes for v in views[i])
            if size != want:
                conn.skip(size + 2)
                return f"value of {size} bytes, buffers of {want}"
            for view in views[i]:
                conn.read_into(view)
            conn.skip(2)
            return None

        return self._io.run(keys, lambda ids: [b"".join(_GET % (len(keys[i]), keys[i]) for i in ids)],
                            lambda conn, ids: [read_one(conn, i) for i in ids],
                            [sum(v.nbytes for v in parts) for parts in views])

    def _tls_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            if self.tls_ca or self.tls_cert or self.tls_key:
                raise ConfigError("tls_ca/tls_cert/tls_key given without tls=True; hint: use a valkeys:// URL")
            return None
        try:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"ValkeyStore TLS files (tls_ca={self.tls_ca!r}, tls_cert={self.tls_cert!r}, "
                              f"tls_key={self.tls_key!r}) cannot be loaded: {exc}") from exc
        if not self.tls_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


_EXISTS = b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n"
_GET = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n"


def _set_outcome(line: bytes) -> object:
    if line == _OK:
        return None
    return error_reply(line[1:]) if line[:1] == b"-" else ServerError(f"unexpected reply {line[:80]!r}")


def _read_ints(conn, ids: list[int]) -> list[object]:
    """EXISTS replies: all at once when they are plain 0/1 (the common case), else one by one."""
    fast = conn.small_ints(len(ids))
    if fast is not None:
        return fast
    replies = [conn.reply() for _ in ids]
    for reply in replies:
        if not isinstance(reply, ServerError | Redirect | int):
            raise ConnectionError(f"protocol error: EXISTS answered {reply!r}")
    return replies
