"""``ValkeyStore``: a ``BlockStore`` on a Valkey or Redis server, standalone or Cluster."""

from __future__ import annotations

import errno
import os
import queue
import ssl
import stat
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import attrs

from kvkit.backends.blockstore import link
from kvkit.backends.blockstore._common import (
    MAX_WAITING,
    TicketBox,
    carry_through_fork,
    check_call,
    check_keys,
    check_timeout,
)
from kvkit.backends.blockstore.link import Identities, Link, NodeHealth, Topology, Unreachable, Unsent, commands
from kvkit.backends.blockstore.resp import (
    Address,
    Connection,
    ConnectOptions,
    ProtocolRefusal,
    Redirect,
    ServerError,
    error_reply,
)
from kvkit.errors import ConfigError
from kvkit.interfaces.shared import StoreResult
from kvkit.kept import warn_exposed
from kvkit.validate import check_bool, check_int, check_real, checked, quote

__all__ = ["ValkeyStore"]

_OK = b"+OK"
_CLOSED = "ValkeyStore closed"


def _nodes(value: Any) -> tuple[Address, ...]:
    try:
        nodes = tuple((str(host), int(port)) for host, port in value)
    except (TypeError, ValueError):
        nodes = ()
    if not nodes or any(not host or not 0 < port < 65536 for host, port in nodes):
        raise ConfigError(f"ValkeyStore.nodes={quote(value)}: must be a non-empty list of (host, port) pairs")
    return nodes


def _optional_text(value: object, field: attrs.Attribute) -> str | None:
    """``value``: ``None`` or a string UTF-8 encodes (what the server is sent); the message never shows it whole."""
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"ValkeyStore.{field.name}={quote(value)}: must be a string or None")
    if value is None:
        return None
    try:
        value.encode()
        return value
    except UnicodeEncodeError:
        pass  # the encoder's error holds the string, a password perhaps: raised without it as context (kvkit.redact)
    raise ConfigError(f"ValkeyStore.{field.name}: holds a character UTF-8 cannot encode (a lone surrogate, as "
                      f"undecodable bytes read from the environment or a file give)")


_TEXT = attrs.Converter(_optional_text, takes_field=True)
_MAX_SECONDS = 86_400.0
"""The longest deadline, connect timeout or retry interval: a day (a longer deadline is none: a stalled server
would hold a call that long; ``math.inf`` and huge numbers overflow the platform's waits)."""
_SECONDS = checked(check_real, low=0.0, low_open=True, high=_MAX_SECONDS, label="ValkeyStore.")
_MAX_TTL_S = 100 * 365 * 86_400
"""The longest expiry, a century: the server refuses one its millisecond clock cannot hold, which would fail every
put."""


def _ttl(value: object, field: attrs.Attribute) -> int | None:
    """``ttl_s``: ``None`` or an int in [1, ``_MAX_TTL_S``], else ``ConfigError`` quoting it."""
    if value is None:
        return None
    ttl = check_int(f"ValkeyStore.{field.name}", value, 1)
    if ttl > _MAX_TTL_S:
        raise ConfigError(f"ValkeyStore.{field.name}={quote(value)}: must be at most {_MAX_TTL_S:,} (a century)")
    return ttl
_FLAG = checked(check_bool, label="ValkeyStore.")


@attrs.define(eq=False)
class _Connected:
    """The nodes a store's links have connected to, and their watchers: each watcher hears of each node before its
    first connection (twice only if two links open their first connections to it at once, or if
    :data:`~kvkit.backends.blockstore.link.MAX_NODES` other nodes were first connected to since: only that many are
    remembered, so no server's redirects to ever new nodes grow this without bound)."""

    seen: dict[Address, None] = attrs.field(factory=dict)  # in the order first connected
    watchers: list[Callable[[Address], None]] = attrs.field(factory=list)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def __call__(self, address: Address) -> None:
        """A link is about to connect to ``address`` (its ``on_connect``). A watcher that raises (a warning turned
        into an error) fails that connection, and leaves the node unseen: the next connection to it asks again."""
        with self.lock:
            if address in self.seen:
                return
            watchers = list(self.watchers)
        for watcher in watchers:
            watcher(address)
        with self.lock:
            link.remember(self.seen, address, None)

    def watch(self, watcher: Callable[[Address], None]) -> None:
        with self.lock:
            self.watchers.append(watcher)
            seen = list(self.seen)
        for address in seen:
            watcher(address)


@attrs.define(eq=False)
class ValkeyStore:
    """Block values on a Valkey/Redis server (or Cluster), one key per block, over hand-written RESP.

    ``put`` and ``get`` each go to a lane of their own (:class:`_Lane`): a
    background I/O thread with its own connection (one per Cluster node),
    which pipelines a whole call: SETs are written from the caller's buffers
    (no copy), GET replies are received straight into the caller's buffers
    (``recv_into``). A get never waits behind a put: a put held up by a slow
    node (one still taking its bytes, up to the deadline) delays no fetch,
    which the engine's step waits on. ``contains`` runs on the caller's thread
    over a third connection: one pipeline of EXISTS per node, one round trip.
    So a store opens up to three connections per node, each when first used.
    The three links share the node health, the Cluster's slot map and what
    server each node was (``run_id``, restart marker): evidence found on one counts for all.
    In a Cluster, keys go to the node owning their hash slot (CLUSTER SLOTS,
    updated on MOVED, ASK followed).

    Deadlines: ``request_timeout_s`` bounds a whole call, however slowly
    the bytes trickle: a ``put`` or ``get`` is reported by then from its
    submission (time spent queued behind earlier calls of its lane included;
    one whose deadline passed in the queue fails without being sent), and ``contains``
    answers by then (``0`` past the first key it could not confirm), or by
    its ``timeout_s`` if that is sooner (``0``: at once, nothing sent; a
    lookup cut short by it is evidence against its node only as a call cut
    short by the deadline is: the node sent nothing for half the deadline).
    Connecting is bounded by ``connect_timeout_s`` as well (at most
    ``request_timeout_s``: a connect that times out then is evidence against
    its node, however short the deadline). Each of these and ``retry_interval_s``
    is a number of seconds in (0, 86400]. A key that missed
    the deadline or whose node failed is reported failed with an error starting
    ``"transport:"``, its buffers never touched after that, and among the result's
    ``unsent`` when the deadline passed before any byte of its command was written to
    the connection (queued behind earlier calls of its lane, connecting, or behind the
    call's earlier keys to its node: no evidence against the node), else among its
    ``unreached`` (a key a server refused or lacks is neither).

    Faults stay with their node (:class:`~kvkit.backends.blockstore.link.Link`,
    :class:`~kvkit.backends.blockstore.link.NodeHealth`): a connection the
    server closed (while idle, or mid-call: killed, restarted) is reopened and
    the call retried once, unseen; a node with evidence against it (refused,
    broken, stalled) fails its keys at once for ``retry_interval_s`` while the
    other nodes serve theirs. A node with no room for one more connection
    (``maxclients``) while it serves another of the store's is full, not down:
    only the link it refused fails its keys, refused. The slot map comes from the first node that
    answers it; a stalled node holds that read up for at most its share of
    the deadline.

    A value longer than the server's ``proto-max-bulk-len`` fails its put
    refused (the server closes the connection after refusing it: the
    other keys are sent again on a new one, and the node is not marked
    down); for ``retry_interval_s`` after, values that long to that node
    fail at once, unsent; the other nodes' are sent (:class:`_BulkLimit`).

    ``ttl_s`` gives every value an expiry, so a ``volatile-*`` eviction
    policy of the server can act. At most ``max_waiting`` finished results
    wait for the polls naming their tickets (one more abandons the oldest).

    Fork. A store inherited through ``os.fork`` (multiprocessing's workers)
    serves the child on connections and I/O threads of its own, opened in
    the child: no socket is shared, so no process reads a reply meant for the
    other, and closing or collecting the store in the child leaves the
    parent's connections open; the child closes its copies of the sockets the
    parent's threads were still connecting at the fork (a TLS handshake or a
    login included), which no link of the child holds. The tickets still open at the fork are
    reported failed in the child (``"transport:"``; the parent's I/O threads
    serve them in the parent). A child where the I/O threads cannot start (a
    pids limit) gets the store closed.

    Invariants: every ticket is reported at most once, only to a poll naming
    it (``poll`` reports both lanes' tickets); after ``close`` both I/O threads
    have stopped, so no buffer is touched after its ticket was reported. The
    I/O threads hold no reference to the store: a store dropped without
    ``close`` is collected, and collecting it closes it (threads stopped,
    sockets closed, open tickets failed). A store whose second I/O thread
    cannot start (a pids limit) stops the first and closes what it opened
    before its construction raises.
    """

    nodes: tuple[Address, ...] = attrs.field(converter=_nodes)
    cluster: bool = attrs.field(default=False, converter=_FLAG)  # type: ignore[misc]
    db: int = attrs.field(default=0, converter=checked(check_int, minimum=0, label="ValkeyStore."))  # type: ignore[misc]
    username: str | None = attrs.field(default=None, converter=_TEXT)  # type: ignore[misc]
    password: str | None = attrs.field(default=None, converter=_TEXT, repr=False)  # type: ignore[misc]
    tls: bool = attrs.field(default=False, converter=_FLAG)  # type: ignore[misc]
    tls_ca: str | None = attrs.field(default=None, converter=_TEXT)  # type: ignore[misc]
    tls_cert: str | None = attrs.field(default=None, converter=_TEXT)  # type: ignore[misc]
    tls_key: str | None = attrs.field(default=None, converter=_TEXT)  # type: ignore[misc]
    tls_verify: bool = attrs.field(default=True, converter=_FLAG)  # type: ignore[misc]
    connect_timeout_s: float = attrs.field(default=1.0, converter=_SECONDS)  # type: ignore[misc]
    request_timeout_s: float = attrs.field(default=2.0, converter=_SECONDS)  # type: ignore[misc]
    """The deadline of a whole ``put``, ``get`` or ``contains`` (see the class docstring)."""
    retry_interval_s: float = attrs.field(default=1.0, converter=_SECONDS)  # type: ignore[misc]
    ttl_s: int | None = attrs.field(default=None, converter=attrs.Converter(_ttl, takes_field=True))  # type: ignore[misc]
    window_bytes: int = attrs.field(default=256 << 10, converter=checked(check_int, minimum=1,  # type: ignore[misc]
                                                                         label="ValkeyStore."))
    """Bytes of values per chunk of a put or get; at most two chunks are in flight per node and lane (a put's and
    a get's side by side: four)."""
    max_waiting: int = attrs.field(default=MAX_WAITING, kw_only=True,
                                   converter=checked(check_int, minimum=1, label="ValkeyStore."))  # type: ignore[misc]
    closed: bool = attrs.field(default=False, init=False)
    _health: NodeHealth = attrs.field(init=False)
    _connected: _Connected = attrs.field(factory=_Connected, init=False)
    _identities: Identities = attrs.field(factory=Identities, init=False)
    _lookup: Link = attrs.field(init=False)
    _lookup_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _close_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _tickets: TicketBox = attrs.field(init=False)
    _puts: _Lane = attrs.field(init=False)
    _gets: _Lane = attrs.field(init=False)
    _finalizer: weakref.finalize = attrs.field(init=False)
    _options: ConnectOptions = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.cluster and self.db:
            raise ConfigError(f"ValkeyStore.db={self.db}: a Cluster has only database 0")
        if self.username is not None and self.password is None:
            raise ConfigError(f"ValkeyStore.username={self.username!r} needs a password")
        self._options = ConnectOptions(self.connect_timeout_s, self.request_timeout_s, self.username,
                                       self.password, self.db, self._tls_context())
        self._tickets = TicketBox(self.max_waiting)
        self._open()
        carry_through_fork(self)

    def _open(self) -> None:
        """Fresh links (no connection yet), node health and slot map, and both lanes' I/O threads started, serving
        ``_tickets``; if a thread cannot start (``RuntimeError``), what was started is shut down before it
        raises."""
        self._health = NodeHealth(self.retry_interval_s)
        topology = Topology()  # one slot map for every link: what one learns routes the others' calls

        def link() -> Link:
            return Link(self.nodes, self.cluster, self._options, self._health, self.window_bytes, topology=topology,
                        identities=self._identities, on_connect=self._connected)

        self._lookup = link()
        bulk_limit = _BulkLimit(self.retry_interval_s)
        self._puts = _Lane("kvkit-valkey-put", link(), self._tickets, self.ttl_s, bulk_limit)
        self._gets = _Lane("kvkit-valkey-get", link(), self._tickets, self.ttl_s, bulk_limit)
        self._finalizer = weakref.finalize(self, _shut_down, (self._puts, self._gets), self._tickets, self._lookup,
                                           self._lookup_lock, self.request_timeout_s + self.connect_timeout_s)
        try:
            self._puts.thread.start()
            self._gets.thread.start()
        except RuntimeError:
            self._finalizer()
            raise

    def _forked(self, parent: int) -> None:
        """In a child forked from process ``parent`` (see the class): let go of the parent's connections and
        threads, fail the tickets they serve, and open this process's own."""
        self._finalizer.detach()  # collecting or closing the store here never shuts the parent's sockets down
        self._puts.link.abandon()
        self._gets.link.abandon()
        self._lookup.abandon()
        self._close_lock, self._lookup_lock = threading.Lock(), threading.Lock()  # the copies may be held
        self._connected.lock = threading.Lock()
        self._identities.lock = threading.Lock()
        self._tickets.after_fork(f"transport: issued by process {parent}, which forked process {os.getpid()} "
                                 f"before it was answered")
        if not self.closed:
            try:
                self._open()
            except RuntimeError:  # an I/O thread cannot start here (a pids limit): the store is closed in this process
                self.closed = True

    @property
    def last_error(self) -> str:
        """The latest evidence against a node (``""`` if none yet)."""
        return self._health.last_error

    @property
    def transport_failures(self) -> int:
        """Times a node was found unusable so far (each opens that node's breaker: links that find one node
        unusable while its breaker is open, waiting on it at the same time, count once)."""
        return self._health.failures

    @property
    def restarts(self) -> int:
        """Times a connection found that a node may have lost what it held since this store's last connection
        to it: another ``run_id`` there (a restart, a failover at the same address), another token in its
        restart marker (:meth:`mark_restarts_under`: a restart, a flush), or a connection reopened where the
        server tells neither (``INFO`` refused, as the tenant ACL of docs/shared-tier.md does, and no marker).
        The shared tier forgets what it remembered as put when this grows
        (:func:`~kvkit.shared.client.store_restarts`)."""
        return self._identities.changes

    def mark_restarts_under(self, prefix: bytes) -> None:
        """Tell a server's restarts, flushes and lost data by a marker key under ``prefix`` (keys this store's
        user may ``SET`` and ``GET``: its tenant's, ``kvkit:<tenant>:``), as well as by ``run_id``: each
        connection opened from now on reads ``<prefix>restart-marker`` with its first commands, in their round
        trip (``GET``: served while the server holds writes), and a token other than the one found there
        before, or none, counts in :attr:`restarts` (one per node of a Cluster, hash-tagged into its slots); a
        marker found missing is planted (``SET ... <random token> NX GET``, see
        :meth:`~kvkit.backends.blockstore.resp.Connection.ask_identity`). So a user refused ``INFO``
        (the tenant ACL of docs/shared-tier.md) reopens connections (a server's ``timeout``) without counting a
        restart. ``ConfigError`` (quoting it) for a ``prefix`` that is not ``bytes`` or holds a ``{`` (a hash
        tag of its own would put every node's marker in one slot); the last prefix given is used."""
        if not isinstance(prefix, bytes) or b"{" in prefix:
            raise ConfigError(f"ValkeyStore.mark_restarts_under({quote(prefix)}): the prefix must be bytes "
                              f"without a '{{'")
        self._identities.prefix = prefix

    @property
    def down_nodes(self) -> dict[Address, str]:
        """The nodes whose keys fail at once now (their breaker is open), with why."""
        return self._health.down_nodes()

    def watch(self, watcher: Callable[[Address], None]) -> None:
        """Have ``watcher`` called once with the address of every node this store connects to (again if
        :data:`~kvkit.backends.blockstore.link.MAX_NODES` other nodes were first connected to since).

        The nodes connected to so far are reported at once; each later one
        (a seed, a node of the Cluster's slot map, a redirect's target) before
        its first connection, on the thread that opens it (the I/O thread, a
        ``contains`` caller's). If ``watcher`` raises, that connection fails
        (its keys fail as the call's) and the next one asks it again. It must
        hold no reference to the store (its threads would keep it alive).
        """
        self._connected.watch(watcher)

    def ping(self) -> str | None:
        """``None`` when the server answers (and logs us in); else ``"transport: <why>"``."""
        check_keys("ValkeyStore", self.closed, ())
        found = self._look_up([b"kvkit:ping"], lambda _, __: commands([b"*1\r\n$4\r\nPING\r\n"]),
                              lambda _, c, __: [c.reply()], self.request_timeout_s)
        if isinstance(found[0], Unreachable):
            return found[0].reason
        if isinstance(found[0], ServerError):
            return f"transport: the server refused us: {found[0]}"
        return None

    def contains(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        check_keys("ValkeyStore", self.closed, keys)
        budget = check_timeout("ValkeyStore", timeout_s)
        budget = self.request_timeout_s if budget is None else min(budget, self.request_timeout_s)
        if not keys or budget <= 0:
            return 0
        found = self._look_up(keys, lambda _, ids: commands(_EXISTS % (len(keys[i]), keys[i]) for i in ids),
                              _read_ints, budget)
        n = 0
        while n < len(found) and found[n] == 1:
            n += 1
        return n

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview]]) -> int:
        views = check_call("ValkeyStore", self.closed, keys, values)
        return self._puts.queue("put", keys, views, time.monotonic() + self.request_timeout_s)

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        views = check_call("ValkeyStore", self.closed, keys, buffers)
        return self._gets.queue("get", keys, views, time.monotonic() + self.request_timeout_s)

    def poll(self, tickets: Collection[int], timeout: float = 0.0) -> list[StoreResult]:
        return self._tickets.poll(tickets, timeout)

    def close(self) -> None:
        """Stop both I/O threads, close every connection, fail every open ticket; a ``close`` while another
        thread closes the store returns once it is closed."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            self._finalizer()
            assert not (self._puts.thread.is_alive() or self._gets.thread.is_alive()), "an I/O thread did not stop"

    def check_invariants(self) -> None:
        assert self.closed or (self._puts.thread.is_alive() and self._gets.thread.is_alive()), "an I/O thread died"
        assert not self.closed or self._tickets.outstanding == 0, "tickets left unfinished after close"
        self._tickets.check_invariants()

    def _look_up(self, keys: Sequence[bytes], encode, read, budget_s: float) -> list[object]:
        """One outcome per key over the lookup connection, on the caller's thread, within ``budget_s`` seconds
        (waiting for the connection included)."""
        deadline = time.monotonic() + budget_s
        if not self._lookup_lock.acquire(timeout=budget_s):
            return [Unreachable("transport: another lookup held the connection past the deadline")] * len(keys)
        try:
            return self._lookup.run(keys, encode, read, deadline=deadline)
        finally:
            self._lookup_lock.release()

    def _tls_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            if self.tls_ca or self.tls_cert or self.tls_key:
                raise ConfigError("tls_ca/tls_cert/tls_key given without tls=True; hint: use a valkeys:// URL")
            return None
        if self.tls_key and not self.tls_cert:
            raise ConfigError(f"tls_key={self.tls_key!r} given without tls_cert: the key is the client "
                              f"certificate's; give both")
        problem: str | None = None  # the error quotes a path unmasked (a private key's text given as one perhaps):
        try:  # raised below without it as context (kvkit.redact), its text masked as every message is
            for path in (self.tls_ca, self.tls_cert, self.tls_key):
                _check_regular(path)
            if self.tls_cert:  # the private key is in tls_key, or else in the certificate's file
                label, key = ("ValkeyStore.tls_key", self.tls_key) if self.tls_key else ("ValkeyStore.tls_cert",
                                                                                        self.tls_cert)
                warn_exposed(label, key, os.stat(key).st_mode)
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key, password=_no_passphrase)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError; a path holding NUL: a ValueError
            problem = str(exc)
        if problem is not None:
            raise ConfigError(f"ValkeyStore TLS files (tls_ca={self.tls_ca!r}, tls_cert={self.tls_cert!r}, "
                              f"tls_key={self.tls_key!r}) cannot be loaded: {problem}")
        if not self.tls_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


def _no_passphrase() -> bytes:
    """What OpenSSL asks for an encrypted key: refused (``OSError``), never its prompt on the terminal, which
    would wait for a typist forever."""
    raise OSError(errno.EINVAL, "the key is encrypted; kvkit takes no passphrase: give it the key decrypted")


def _check_regular(path: str | None) -> None:
    """Raise ``OSError`` unless ``path`` (when given) is a regular file, a symlink to one included: OpenSSL's
    open of a FIFO would wait for a writer forever."""
    if path is not None and not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file", path)


@attrs.define(eq=False)
class _BulkLimit:
    """Per node, the shortest value it refused as longer than its ``proto-max-bulk-len`` (``-ERR Protocol error:
    invalid bulk length``) in the last ``hold_s`` seconds: values that long or longer to that node fail at once,
    unsent (each would cost its connection: the server closes it after the refusal); other nodes' values are sent
    (a Cluster's nodes may be configured apart). Once ``hold_s`` passed, one is sent again (the limit may have been
    raised). At most :data:`~kvkit.backends.blockstore.link.MAX_NODES` nodes are remembered (``link.remember``).
    Nodes' pipelines run side by side: each node's bound is read in one step and replaced under a lock."""

    hold_s: float
    _refused: dict[Address, tuple[int, float]] = attrs.field(factory=dict, init=False)  # bytes, held until
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def holding(self, node: Address, size: int) -> int:
        """The size ``node`` refused that holds back a value of ``size`` bytes to it now (0: it is sent)."""
        refused, until = self._refused.get(node, (0, 0.0))
        return refused if refused and size >= refused and time.monotonic() < until else 0

    def refuse(self, node: Address, size: int) -> None:
        """``node`` refused a value of ``size`` bytes."""
        with self._lock:
            now = time.monotonic()
            refused, until = self._refused.get(node, (0, 0.0))
            link.remember(self._refused, node, (min(size, refused) if refused and now < until else size,
                                                now + self.hold_s))

    def refusal(self, node: Address, size: int, refused: int) -> ProtocolRefusal:
        """Why a value of ``size`` bytes was not sent to ``node``, which refused one of ``refused`` bytes."""
        return ProtocolRefusal(f"a value of {size} bytes, not sent: the server {node[0]}:{node[1]} refused one of "
                               f"{refused} bytes as longer than its proto-max-bulk-len less than {self.hold_s:g} s ago")


_EXISTS = b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n"
_GET = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n"


@attrs.define(eq=False)
class _Lane:
    """An I/O thread (``thread``, named ``name``, not yet started) and what it runs on: its own link (connections
    no other lane uses), its queue of calls, served in order, and what it shares with the store's other lane: the
    tickets and the bulk limit learned per node (its link shares the node health, slot map and identities); no
    reference to the store. A store runs its puts and its gets on a lane each, so no get waits behind a put."""

    name: str
    link: Link
    tickets: TicketBox
    ttl_s: int | None
    bulk_limit: _BulkLimit
    jobs: queue.SimpleQueue = attrs.field(factory=queue.SimpleQueue)
    closing: bool = False
    lock: threading.Lock = attrs.field(factory=threading.Lock)  # held to queue a job, or to set ``closing``
    thread: threading.Thread = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.thread = threading.Thread(target=self.serve, name=self.name, daemon=True)

    def queue(self, op: str, keys: Sequence[bytes], views: list[list[memoryview]], deadline: float) -> int:
        """Issue a ticket for a checked call (its byte views) and queue it, or, once the store closes, report
        it failed at once. Queueing and :func:`_shut_down`'s setting ``closing`` (then queueing the end)
        exclude each other: a job queued is ahead of the end, reported by the lane (its buffers let go of)
        or by ``_shut_down``'s failing the open tickets after the lane stopped, never by this call while the
        lane may be reading into its buffers; no ticket stays open."""
        ticket = self.tickets.issue(len(keys))
        with self.lock:
            if not self.closing:
                self.jobs.put((ticket, op, list(keys), views, deadline))
                return ticket
        self.tickets.report(ticket, range(len(keys)), _CLOSED)
        return ticket

    def serve(self) -> None:
        while (job := self.jobs.get()) is not None and not self.closing:
            ticket, op, keys, views, deadline = job
            if not keys:
                self.tickets.report(ticket)
                continue
            if time.monotonic() >= deadline:  # nothing of it was sent: no evidence against any node
                every = range(len(keys))
                self.tickets.report(ticket, every, "transport: the call's deadline passed while it waited behind "
                                                   "earlier calls, unsent", unreached=(), unsent=every)
                continue
            try:
                outcomes = self._put(keys, views, deadline) if op == "put" else self._get(keys, views, deadline)
            except Exception as exc:  # noqa: BLE001 - a reply we cannot handle: the link is dropped, the call failed
                self.link.reset()
                self.tickets.report(ticket, range(len(keys)), f"transport: {type(exc).__name__}: {exc}")
                continue
            failed = [i for i, problem in enumerate(outcomes) if problem is not None]
            reasons = sorted({str(outcomes[i]) for i in failed}, key=lambda r: (not r.startswith("transport:"), r))
            unsent = [i for i in failed if isinstance(outcomes[i], Unsent)]
            unreached = [i for i in failed if isinstance(outcomes[i], Unreachable) and not isinstance(outcomes[i],
                                                                                                        Unsent)]
            self.tickets.report(ticket, failed, "; ".join(reasons)[:500], unreached, unsent)

    def _put(self, keys: list[bytes], views: list[list[memoryview]], deadline: float) -> list[object]:
        expire = b"" if self.ttl_s is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(self.ttl_s)), self.ttl_s)
        head = b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" if expire else b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
        tail = b"\r\n" + expire
        sizes = _sizes(views)
        limit = self.bulk_limit
        held: dict[int, int] = {}  # keys whose values a node's limit held back: the size it refused

        def encode(node: Address, ids: list[int]) -> tuple[list[bytes | memoryview], list[int]]:
            parts: list[bytes | memoryview] = []
            ends: list[int] = []
            end = 0
            for i in ids:
                if refused := limit.holding(node, sizes[i]):
                    held[i] = refused
                    ends.append(end)
                    continue
                key = keys[i]
                start = head % (len(key), key, sizes[i])
                parts.append(start)
                parts += views[i]
                parts.append(tail)
                end += len(start) + sizes[i] + len(tail)
                ends.append(end)
            return parts, ends

        def read(node: Address, conn: Connection, ids: list[int]) -> Iterator[object]:
            for i in ids:
                if i in held:
                    yield limit.refusal(node, sizes[i], held[i])
                    continue
                outcome = _set_outcome(conn.line())
                if isinstance(outcome, ProtocolRefusal) and "invalid bulk length" in str(outcome):
                    limit.refuse(node, sizes[i])
                    outcome = ProtocolRefusal(f"{outcome} (a value of {sizes[i]} bytes: longer than the server's "
                                              f"proto-max-bulk-len)")
                yield outcome

        return self.link.run(keys, encode, read, sizes, deadline)

    def _get(self, keys: list[bytes], views: list[list[memoryview]], deadline: float) -> list[object]:
        sizes = _sizes(views)

        def read(_: Address, conn: Connection, ids: list[int]) -> Iterator[object]:
            return (_get_outcome(conn, views[i], sizes[i]) for i in ids)

        return self.link.run(keys, lambda _, ids: commands(_GET % (len(keys[i]), keys[i]) for i in ids), read,
                             sizes, deadline)


def _sizes(views: list[list[memoryview]]) -> list[int]:
    """Bytes of each value (the sum of its buffers)."""
    return [sum(v.nbytes for v in parts) for parts in views]


def _get_outcome(conn: Connection, views: list[memoryview], want: int) -> object:
    """Read one GET reply into ``views`` (``want`` bytes in all): ``None``, or why the key has no value here."""
    line = conn.line(ahead=len(str(want)) + 3)  # "$<want>\r\n": the value stays in the socket
    if line[:1] == b"-":
        return error_reply(line[1:])
    if line[:1] != b"$":
        raise ConnectionError(f"protocol error: a GET answered {line[:80]!r}")
    size = int(line[1:])
    if size < 0:
        return "missing value"
    if size != want:
        conn.skip(size + 2)
        return f"value of {size} bytes, buffers of {want}"
    conn.read_bulk(views)
    return None


def _shut_down(lanes: tuple[_Lane, ...], tickets: TicketBox, lookup: Link, lookup_lock: threading.Lock,
               join_s: float) -> None:
    """Stop the lanes' I/O threads (those started), close every connection, fail every open ticket (``close``, the
    store collected, or its opening failed); the threads are given ``join_s`` in all to end.

    Each link is closed first while its calls may still be waiting (a wait on a closed connection returns at
    once: a ``get`` or ``contains`` on a stalled node does not hold ``close`` up to its deadline), then again
    once its calls ended (a connection one of them opened meanwhile).
    """
    for lane in lanes:
        with lane.lock:
            lane.closing = True
            lane.jobs.put(None)
        lane.link.close()
    lookup.close()
    end = time.monotonic() + join_s
    for lane in lanes:
        if lane.thread.is_alive() and lane.thread is not threading.current_thread():
            lane.thread.join(max(0.0, end - time.monotonic()))
        lane.link.close()
    if lookup_lock.acquire(timeout=join_s):
        try:
            lookup.close()
        finally:
            lookup_lock.release()
    tickets.fail_open(_CLOSED)


def _set_outcome(line: bytes) -> object:
    """A SET's reply line: ``None`` (``+OK``), or why its key was not set. A SET answers one line; any other
    reply (a bulk, an array: lines of their own follow) raises ``ConnectionError``, the connection out of step."""
    if line == _OK:
        return None
    if line[:1] == b"-":
        return error_reply(line[1:])
    if line[:1] in (b"+", b":"):
        return ServerError(f"unexpected reply {line[:80]!r}")
    raise ConnectionError(f"protocol error: a SET answered {line[:80]!r}")


def _read_ints(_node: Address, conn: Connection, ids: list[int]) -> Iterator[object]:
    """EXISTS replies: all at once when they are plain 0/1 (the common case), else one by one."""
    fast = conn.small_ints(len(ids))
    if fast is not None:
        yield from fast
        return
    for _ in ids:
        reply = conn.reply()
        if not isinstance(reply, ServerError | Redirect | int):
            raise ConnectionError(f"protocol error: EXISTS answered {reply!r:.80}")
        yield reply
