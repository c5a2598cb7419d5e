"""Routing a call over one server or a Cluster's nodes, each node with its own breaker.

A :class:`Link` sends every key's command to the node that owns it and answers one outcome per key.
A node that cannot be used fails only its own keys (:class:`Unreachable`); the keys of the other nodes
complete. :class:`NodeHealth` remembers, per node, the evidence that it is unusable, so the next calls
fail that node's keys at once for a retry interval instead of waiting on it again.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import queue
import ssl
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import attrs
from typing_extensions import override

from kvkit.backends.blockstore.resp import (
    MISSING,
    SLOTS,
    Address,
    Connection,
    ConnectionClosedError,
    ConnectOptions,
    DeadlineExceeded,
    LookupsBusy,
    NoRoom,
    Openings,
    ProtocolRefusal,
    Redirect,
    ServerError,
    ShortOfDescriptors,
    SlotUnserved,
    key_slot,
    node_host,
)
from kvkit.validate import plural

__all__ = ["MARKER", "MAX_NODES", "Encode", "Identities", "Link", "NodeHealth", "Read", "Topology", "Unreachable",
           "Unsent", "commands", "remember"]

MAX_NODES = 1000
"""The most nodes a link is connected to at once (the Cluster specification's largest Cluster): a slot map naming
more is refused, and a key whose node would be one more fails (:meth:`Link._admit`), so no server's answers make a
link hold more sockets, or its crew more threads."""
K = TypeVar("K")
V = TypeVar("V")


def remember(nodes: dict[K, V], address: K, value: V) -> None:
    """Set ``nodes[address] = value`` as the newest entry, first forgetting the oldest entries beyond
    :data:`MAX_NODES` (no server's answers, naming ever new nodes or keys, grow ``nodes`` without bound)."""
    nodes.pop(address, None)
    while len(nodes) >= MAX_NODES:
        del nodes[next(iter(nodes))]
    nodes[address] = value


_MAX_ROUNDS = 5  # redirects followed, and the one retry on a fresh connection, per key and call
_ASKING = b"*1\r\n$6\r\nASKING\r\n"

Encode = Callable[[Address, list[int]], tuple[list[bytes | memoryview], list[int]]]
"""A node's address and the indices of keys bound for it -> the buffers of their commands, in order, and where each
key's command ends in them (bytes from the first buffer's start, one per index: a key that has no command there
ends where the one before it does)."""
Read = Callable[[Address, Connection, list[int]], Iterable[object]]
"""A node's address, its connection and the indices sent to it -> their outcomes (each may be a ``Redirect``), in
order, each given as soon as it is read (a generator): those read before the connection failed settle their keys."""


def commands(encoded: Iterable[bytes]) -> tuple[list[bytes | memoryview], list[int]]:
    """What an :data:`Encode` answers for one command per key, ``encoded`` in order: one buffer, and their ends."""
    each = list(encoded)
    return [b"".join(each)], list(itertools.accumulate(map(len, each)))


@attrs.frozen
class Unreachable:
    """The outcome of a key whose node could not be used in this call; ``reason`` starts ``"transport:"``."""

    reason: str

    @override
    def __str__(self) -> str:
        return self.reason


@attrs.frozen
class Unsent(Unreachable):
    """The outcome of a key none of whose command's bytes left this process: the call's deadline passed first
    (connecting, or while the key waited behind the call's earlier keys to its node). No evidence against any
    node; what the deadline says of the node is judged on the keys that were sent."""


@attrs.define(eq=False)
class NodeHealth:
    """Each node's breaker: a node with evidence against it is not tried for ``retry_interval_s``; the others are.

    Evidence that a node is unusable: a connection or login that fails, a connection that breaks
    on a call again right after it was reopened for it, a reply that is not RESP, a reply saying the
    node serves no command for now (``-NOAUTH``: the connection is not logged in; ``-LOADING``: the
    dataset is still loading; ``-MASTERDOWN``: a replica lost its primary; ``-BUSY``: a script runs past
    its time) or no connection (``-ERR max number of clients reached``, :class:`~kvkit.backends.blockstore.resp.NoRoom`,
    unless the node serves another connection of a link sharing this health: :meth:`serving`; then it is full,
    not down, and only the link refused fails its keys, as refused), or a node that sent nothing
    for at least half a call's deadline (stalled, whether the deadline then passed or the node closed
    the connection; asked for the slot map, at least half of its equal share of a call's deadline, see
    :meth:`Link.refresh`) while no link sharing this health read a reply from it (:meth:`heard`: a node
    that answers another link meanwhile holds back only that connection's commands, as ``CLIENT PAUSE
    WRITE`` holds writes and serves reads). Not evidence: a connection the server closed once without such a silence
    (idle, killed, restarted: reopened, and the call retried on it once), one it closed
    right after refusing a command (:class:`~kvkit.backends.blockstore.resp.ProtocolRefusal`: a value
    longer than its ``proto-max-bulk-len``; that command fails, the others are sent again once), a deadline that
    passed while the node was still sending (slow, not stalled) or before the node was reached,
    a missing key, any other error reply (``-OOM``, ``-READONLY``, ``-MISCONF``: writes refused,
    reads served; that key's failure) or a redirect.
    Thread-safe (a store's lookup, put and get links share one).
    """

    retry_interval_s: float
    failures: int = attrs.field(default=0, init=False)
    last_error: str = attrs.field(default="", init=False)
    _down: dict[Address, tuple[float, str]] = attrs.field(factory=dict, init=False)  # node -> (until, why)
    _heard: dict[Address, float] = attrs.field(factory=dict, init=False)  # node -> when a reply was last read
    _let_in: dict[Address, set[Connection]] = attrs.field(factory=dict, init=False)  # node -> its open connections
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def let_in(self, address: Address, conn: Connection) -> None:
        """``address`` answered the first commands of ``conn``, a connection a link holds open from now on."""
        with self._lock:
            self._let_in.setdefault(address, set()).add(conn)

    def let_go(self, address: Address, conn: Connection) -> None:
        """A link closed ``conn``, its connection to ``address``."""
        with self._lock:
            held = self._let_in.get(address)
            if held is not None:
                held.discard(conn)
                if not held:
                    del self._let_in[address]

    def serving(self, address: Address) -> bool:
        """Whether a link sharing this health holds a connection ``address`` let in (:meth:`let_in`): a node that
        refuses one more connection for want of room (``maxclients``) while it serves these is full, not down.
        Such a connection may have been closed by the server since, unseen until its link uses it again: that
        link then finds the node full too, and once no link holds one the refusal is evidence again."""
        with self._lock:
            return address in self._let_in

    def heard(self, address: Address) -> None:
        """A link read replies from ``address`` just now (at most :data:`MAX_NODES` nodes are remembered)."""
        with self._lock:
            remember(self._heard, address, time.monotonic())

    def silent(self, address: Address, seconds: float) -> bool:
        """Whether no link read a reply from ``address`` in the last ``seconds``."""
        with self._lock:
            return self._heard.get(address, -float("inf")) < time.monotonic() - seconds

    def down(self, address: Address) -> str | None:
        """Why ``address`` is not tried now, or ``None`` when it may be."""
        with self._lock:
            until, why = self._down.get(address, (0.0, ""))
            return why if time.monotonic() < until else None

    def trip(self, address: Address, reason: str) -> None:
        """Record evidence against ``address``: its keys fail at once for ``retry_interval_s``.

        ``failures`` counts the breakers opened: evidence against a node already down (another link sharing
        this health waited on it at the same time, and found it stalled too) renews its interval and
        ``last_error`` but counts no second failure.
        At most :data:`MAX_NODES` nodes are remembered down: one more forgets the one tripped longest ago (it
        is tried again), so no server's redirects to ever new nodes grow this without bound.
        """
        with self._lock:
            now = time.monotonic()
            if self._down.get(address, (0.0, ""))[0] <= now:
                self.failures += 1
            self.last_error = reason
            remember(self._down, address, (now + self.retry_interval_s, reason))

    def down_nodes(self) -> dict[Address, str]:
        """The nodes not tried now, with why."""
        with self._lock:
            now = time.monotonic()
            return {a: why for a, (until, why) in self._down.items() if now < until}


MARKER = b"restart-marker"
"""The marker key's name under :attr:`Identities.prefix` (a Cluster node's: with a hash tag into its slots)."""
_TAGS: list[tuple[int, int]] = []
"""Every slot's least hash tag ``{<n>}``, as ``(n, slot)`` in increasing ``n`` (:func:`_tags`)."""
_TAGS_LOCK = threading.Lock()


def _tags() -> list[tuple[int, int]]:
    """:data:`_TAGS`, counted once per process (about 110,000 tags, a fraction of a second), so finding a
    node's marker key never searches again: it takes the first tag whose slot the node owns, whichever slots
    those are."""
    if not _TAGS:
        with _TAGS_LOCK:
            if not _TAGS:
                least: dict[int, int] = {}
                n = 0
                while len(least) < SLOTS:
                    least.setdefault(key_slot(b"{%d}" % n), n)
                    n += 1
                _TAGS.extend(sorted((n, slot) for slot, n in least.items()))
    return _TAGS


@attrs.define(eq=False)
class Identities:
    """What server each node was when a connection to it was last opened, shared by the links of one store: its
    ``run_id`` (``INFO server``), per node address, and, given a ``prefix`` (keys the store's user may write: a
    tenant's), the token held in each marker key (:meth:`marker`; :data:`~kvkit.backends.blockstore.resp.MISSING`
    for a marker found missing, the data of its slots lost since, which the connection then plants with a token
    of its own, one no connection was told before: told next, that is no change), per key: a marker travels with
    its slot's data, so a Cluster node that takes over a slot (a replica promoted, at another address) is
    compared with the token its slot's data held before.

    ``changes`` counts the connections that found a node may hold another server's contents than before: one
    whose ``run_id`` differs from the last one seen at its address, or whose marker holds another token than the
    last one seen in that key (a restart, a restart from an older snapshot, a flush, another server at the
    address, a replica promoted without the marker: one that had not received it), or, where neither can be
    compared (``INFO`` refused, as an ACL does, and no marker told then and now), one whose ``run_id`` is no longer
    told or one reopened by a link that had a connection to that node before (it may have restarted). A
    connection with nothing seen before to compare with (the first to a node, its marker key new) is no change.
    At most :data:`MAX_NODES` nodes and as many marker keys are remembered (:func:`remember`). Thread-safe.
    """

    changes: int = attrs.field(default=0, init=False)
    prefix: bytes | None = attrs.field(default=None, init=False)
    _runs: dict[Address, bytes | None] = attrs.field(factory=dict, init=False)  # node -> run_id last told
    _tokens: dict[bytes, bytes] = attrs.field(factory=dict, init=False)  # marker key -> token last told
    lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def marker(self, address: Address, slots: list[Address] | None) -> bytes | None:
        """The marker key of ``address`` (``None`` without a ``prefix``): ``<prefix>restart-marker`` on a server
        (``slots`` ``None``); in a Cluster (``slots``: its slot map) one with the first hash tag ``{<n>}`` whose
        slot the map gives to ``address``, so each node holds its own and a node that lost its data is found by
        its own marker (``None`` where the node owns no slot in the map)."""
        prefix = self.prefix
        if prefix is None:
            return None
        if slots is None:
            return prefix + MARKER
        if address in slots:
            for n, slot in _tags():
                if slots[slot] == address:
                    return prefix + MARKER + b":{%d}" % n
        return None

    def missing(self, marker: bytes | None) -> bool:
        """Whether ``marker`` was last found missing (no token told since): a connection then plants it; else it
        only reads it (:meth:`~kvkit.backends.blockstore.resp.Connection.ask_identity`)."""
        with self.lock:
            return marker is not None and self._tokens.get(marker) == MISSING

    def opened(self, address: Address, run_id: bytes | None, marker: bytes | None, token: bytes | None,
               again: bool) -> None:
        """A link opened a connection to ``address``, which told ``run_id`` and the ``token`` held in its
        ``marker`` key; ``again``: the link had one before."""
        with self.lock:
            seen = address in self._runs
            then_run = self._runs.get(address)
            then_token = self._tokens.get(marker) if marker is not None else None
            remember(self._runs, address, run_id)
            if marker is not None and token is not None:
                remember(self._tokens, marker, token)
            compared = [run_id != then_run] if seen and run_id is not None and then_run is not None else []
            if token is not None and then_token is not None:  # a token after MISSING: the loss was counted then
                compared.append(then_token != MISSING and token != then_token)
            if any(compared) if compared else seen and (run_id != then_run or (run_id is None and again)):
                self.changes += 1


@attrs.define(eq=False)
class Topology:
    """A Cluster's slot map, shared by the links of one store, so what one learns serves the others.

    A map read by one link routes the others' calls (whose seeds may be down by then); a MOVED seen by
    one re-routes the others' next calls; a node that failed on one makes all use a map read again. A
    stale map is read once, by the first link whose call needs it: a link that finds another reading it
    waits for that read (within its own deadline) and uses it. ``stale``: the map must be read before
    the next call is routed (none read yet, a node failed, a redirect named no host). Thread-safe: a
    change noted while a read is in flight leaves the map it reads stale.
    """

    slots: list[Address] | None = attrs.field(default=None, init=False)
    stale: bool = attrs.field(default=True, init=False)
    generation: int = attrs.field(default=0, init=False)  # maps read so far
    _changes: int = attrs.field(default=0, init=False)  # changes noted so far
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _reading: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def outdated(self) -> None:
        """Have the map read again before the next call is routed."""
        with self._lock:
            self._changes += 1
            self.stale = True

    def moved(self, slot: int, owner: Address) -> None:
        """``owner`` serves ``slot`` from now on (a MOVED); the map is read again before the next call."""
        with self._lock:
            if self.slots is not None:
                self.slots[slot] = owner
            self._changes += 1
            self.stale = True

    def refresh(self, deadline: float, read: Callable[[], list[Address] | str]) -> str | None:
        """Read the map with ``read`` (the owner of each slot, or why it could not be read) unless it is fresh
        once no other read is in flight; ``None``, or why it is still unread."""
        if not self._reading.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return "transport: another call was reading the Cluster's slot map past the deadline"
        try:
            with self._lock:
                if not self.stale:
                    return None
                changes = self._changes
            slots = read()
            if isinstance(slots, str):
                return slots
            with self._lock:
                self.slots = slots
                self.generation += 1
                self.stale = self._changes != changes
            return None
        finally:
            self._reading.release()


@attrs.define(eq=False)
class _Leg:
    """One node's share of a flight: its chunks in sending order (``(asked, indices)``), what its pipeline read
    (one list of outcomes per chunk, in order, the last maybe cut short: keys past them were not read), how
    many of its keys, in that order, had bytes of their commands written to the connection (``sent``: the
    others' never left this process), and what stopped it."""

    address: Address
    chunks: list[tuple[bool, list[int]]] = attrs.field(factory=list)
    results: list[list[object]] = attrs.field(factory=list)
    sent: int = 0
    error: BaseException | None = None

    def unsent(self) -> set[int]:
        """The indices of the keys none of whose command's bytes were written."""
        order = [i for _, chunk in self.chunks for i in chunk]
        return set(order[self.sent:])


class _Crew:
    """Daemon threads that run a flight's node pipelines side by side; idle between flights.

    A flight of ``n`` tasks runs the first on the caller's thread and each other on a thread of its own
    (the crew grows to ``n - 1`` threads), so no task waits for another to start. Where no more threads can
    start (a pids limit), the caller's thread runs the tasks the crew has no thread for, one after another.
    The threads hold no reference to a task once it ended (nor to the link). After :meth:`stop` every thread
    started exits and the tasks of a later flight run one after another on the caller's thread.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = 0
        self._stopped = False
        self._lock = threading.Lock()

    def run(self, tasks: list[Callable[[], None]]) -> None:
        """Run every task; return once all have ended, raising the first exception any of them raised."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        queued = 0
        with self._lock:  # queued before stop()'s sentinels, or not at all
            if not self._stopped:
                while self._threads < len(tasks) - 1:
                    try:
                        threading.Thread(target=_crew_serve, args=(self._jobs,), name="kvkit-valkey-node",
                                         daemon=True).start()
                    except RuntimeError:  # no thread can start (a pids limit): the threads it has serve
                        break
                    self._threads += 1  # counted as each starts, so stop() ends every one
                queued = min(len(tasks) - 1, self._threads)
                for task in tasks[len(tasks) - queued:]:
                    self._jobs.put((task, done))
        errors = [error for task in tasks[:len(tasks) - queued] if (error := _attempt(task)) is not None]
        errors += [error for _ in range(queued) if (error := done.get()) is not None]
        if errors:
            raise errors[0]

    def stop(self) -> None:
        """Let every thread exit once the tasks queued before have ended; idempotent."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                for _ in range(self._threads):
                    self._jobs.put(None)


def _attempt(task: Callable[[], None]) -> BaseException | None:
    """Run ``task``; the exception it raised, or ``None``."""
    try:
        task()
    except BaseException as exc:  # noqa: BLE001 - handed to the flight's caller, which raises it
        return exc
    return None


def _crew_serve(jobs: queue.SimpleQueue) -> None:
    """A crew thread: run each queued task, answering its outcome to its flight, until a ``None``."""
    while True:
        job = jobs.get()
        if job is None:
            return
        task, done = job
        del job
        done.put(_attempt(task))
        del task, done


@attrs.define(eq=False)
class Link:
    """Connections to one server or one Cluster, used by one thread at a time.

    ``run`` sends every key's command to its node, follows MOVED (updating the slot map, re-read
    before the next call) and ASK redirects, and answers one outcome per key, within the call's
    deadline. Each node's commands go through a pipeline of their own, and the nodes' pipelines
    progress independently (side by side on the link's threads when a call spans several nodes;
    on the caller's thread when it spans one): a node that is slow or stalled delays no other
    node's sends or reads, so the others' keys complete within the deadline. Large values go in
    a window: a node gets chunk ``k + 1`` (about ``window_bytes`` of values) before chunk ``k``'s
    replies are read, so one to two chunks are in flight per node (a whole batch of 64-256 KiB
    values in flight ran 1.2-1.9x slower; BENCHMARKS.md, "Shared tier").

    Faults stay with their node: a node that fails (``OSError`` or a reply that is not RESP) has
    its connection closed and only its keys answer :class:`Unreachable` (those it answered before
    keep their outcomes; those none of whose bytes were written when the call's deadline passed,
    :class:`Unsent`); the other nodes' keys and connections are untouched. A connection the
    server closed (while idle, or mid-call: killed, restarted, or right after refusing a command,
    :class:`~kvkit.backends.blockstore.resp.ProtocolRefusal`, read even when the close broke a
    send) is reopened and the node's unanswered keys retried on it once, whether the closed one was
    reused or opened by the call. ``health`` decides which nodes are skipped (see
    :class:`NodeHealth`); in a Cluster a failed node also has the slot map read again, within the call
    while its deadline lasts (else by the next call), keeping every other connection: its keys whose
    slots the map now gives to another node (a failover, a node removed once its slots were resharded
    away) are sent there in the same call. So are the keys a node answered ``-CLUSTERDOWN`` (a node reset
    out of the Cluster serves no slot), with no evidence against it. Links given one ``topology`` share
    their slot map (see :class:`Topology`); links given one ``identities`` share what server each node was
    found to be: every connection opened reports the identity its node told (see :class:`Identities`).

    ``on_connect`` (if given) is called with a node's address before each connection to it is opened:
    every node the link ever talks to passes through it (seeds, the slot map's nodes, redirects'
    targets), on whichever thread opens the connection; if it raises, no connection is opened and
    the call fails with that exception.
    """

    seeds: tuple[Address, ...]
    cluster: bool
    options: ConnectOptions
    health: NodeHealth
    window_bytes: int = 256 << 10
    topology: Topology = attrs.field(factory=Topology, kw_only=True)
    identities: Identities = attrs.field(factory=Identities, kw_only=True)
    on_connect: Callable[[Address], None] | None = attrs.field(default=None, kw_only=True)
    _conns: dict[Address, Connection] = attrs.field(factory=dict, init=False)
    _openings: Openings = attrs.field(factory=Openings, init=False)  # sockets its calls are connecting on
    _opened: dict[Address, None] = attrs.field(factory=dict, init=False)  # the nodes it had a connection to
    _generation: int = attrs.field(default=0, init=False)  # the map whose nodes ``_conns`` was pruned to
    _closed: bool = attrs.field(default=False, init=False)
    _crew: _Crew = attrs.field(factory=_Crew, init=False)
    _stop_crew: weakref.finalize = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._stop_crew = weakref.finalize(self, self._crew.stop)  # a link dropped without close() lets its crew exit

    def run(self, keys: Sequence[bytes], encode: Encode, read: Read, weights: Sequence[int] | None = None,
            deadline: float | None = None) -> list[object]:
        """One outcome per key by ``deadline`` (default: ``request_timeout_s`` from now); with ``weights``
        (value bytes per key) at most two chunks of about ``window_bytes`` are in flight per node."""
        outcomes: list[object] = [None] * len(keys)
        if not keys:
            return outcomes
        if deadline is None:
            deadline = time.monotonic() + self.options.request_timeout_s
        if self.cluster:
            why = self.refresh(deadline) if self.topology.stale else None
            if why is not None:
                return [Unreachable(why)] * len(keys)
            self._prune()
        pending: list[int] = list(range(len(keys)))
        asked: dict[int, Address] = {}
        retried: set[Address] = set()
        for round_ in range(_MAX_ROUNDS):
            unserved: dict[int, Address] = {}  # keys a node did not serve this round (see _rerouted): that node
            groups: dict[tuple[Address, bool], list[int]] = defaultdict(list)
            for i in pending:
                target = asked.get(i)
                groups[(target, True) if target else (self._node_for(keys[i]), False)].append(i)
            pending, asked = [], {}
            flights: dict[tuple[Address, bool], list[list[int]]] = {}
            for group, indices in groups.items():
                why = self.health.down(group[0])
                if why is None:
                    flights[group] = self._chunks(indices, weights)
                else:
                    for i in indices:
                        outcomes[i] = Unreachable(why)
            self._admit(flights, outcomes)
            broken = self._fly(flights, encode, read, deadline, outcomes, pending, asked, unserved)
            for address, (exc, left, left_asked, refused, unsent) in broken.items():
                if (refused or _closed_by_server(exc)) and not self._stalled(exc) and address not in retried:
                    self._drop(address)
                    retried.add(address)
                    pending += left
                    asked.update(left_asked)
                    continue
                full = self._full(address, exc)
                why = self._failed(address, exc, explained=refused or full)
                if full:  # the node serves the other links: these keys are refused, not unreached
                    refusal = ServerError(why.removeprefix("transport: ") + " (it serves this store's other "
                                                                             "connections: full, not down)")
                    for i in left:
                        outcomes[i] = refusal
                    continue
                never_sent = unsent if _expired(exc) else set()
                for i in left:
                    outcomes[i] = Unsent(why) if i in never_sent else Unreachable(why)
                    unserved[i] = address
            if round_ + 1 < _MAX_ROUNDS:  # a round is left to send them in
                pending += self._rerouted(keys, unserved, deadline)
            if not pending:
                break
        for i in pending:
            outcomes[i] = ServerError(f"still redirected after {_MAX_ROUNDS} tries")
        return outcomes

    def _rerouted(self, keys: Sequence[bytes], unserved: dict[int, Address], deadline: float) -> list[int]:
        """The keys of ``unserved`` to send again in this call: in a Cluster, those whose slot the map, read again
        within ``deadline``, gives to another node than the one that did not serve them (index: that node) - a
        node found unusable (a failover moved its slots, or it was removed once they were resharded away) or one
        that answered ``-CLUSTERDOWN`` (it left the Cluster and serves no slot, or the Cluster is down). None once
        the deadline passed: the map is then read by the next call (no connection is used past its call's
        deadline)."""
        if not unserved or not self.cluster or time.monotonic() >= deadline or self.refresh(deadline) is not None:
            return []
        self._prune()
        return [i for i, node in unserved.items() if self._node_for(keys[i]) != node]

    def _admit(self, flights: dict[tuple[Address, bool], list[list[int]]], outcomes: list[object]) -> None:
        """Keep the link within :data:`MAX_NODES` connections for a round of ``flights`` (changed in place).

        When the round's nodes need more, the connections to nodes it does not use and that own no slot (an
        earlier ASK's targets) are closed first; the keys of the nodes still beyond the limit then fail,
        unreached (no evidence against those nodes: a slot map or redirects naming more nodes than a Cluster
        has are the answering node's doing).
        """
        nodes = dict.fromkeys(address for address, _ in flights)
        new = [address for address in nodes if address not in self._conns]
        if len(self._conns) + len(new) <= MAX_NODES:
            return
        owners = set(self.topology.slots or ())
        for idle in [address for address in self._conns if address not in nodes and address not in owners]:
            self._drop(idle)
        beyond = set(new[max(0, MAX_NODES - len(self._conns)):])
        for group in [group for group in flights if group[0] in beyond]:
            why = Unreachable(f"transport: {group[0][0]}:{group[0][1]}: not connected, the link has {MAX_NODES} "
                              f"nodes already (more than a Cluster has)")
            for chunk in flights.pop(group):
                for i in chunk:
                    outcomes[i] = why

    def _fly(self, flights: dict[tuple[Address, bool], list[list[int]]], encode: Encode, read: Read,
             deadline: float, outcomes: list[object], pending: list[int],
             asked: dict[int, Address], unserved: dict[int, Address],
             ) -> dict[Address, tuple[BaseException, list[int], dict[int, Address], bool, set[int]]]:
        """Send every chunk and read its replies, each node on its own: a node waited on never delays another.

        A node's chunks (its ASKed ones after the others) go through one pipeline (:meth:`_leg`): chunk
        ``k + 1`` goes out before chunk ``k`` is read. One node's pipeline runs on the caller's thread;
        with several, the others run side by side on the link's crew, and all have ended when this returns
        (each is bounded by ``deadline``). The pipelines touch only their own node's connection and record
        what they read in their own :class:`_Leg`; the outcomes, the keys to send again and the slot map are
        updated here, on the caller's thread, once they have all ended.

        Answers the nodes that failed: the exception, the indices they did not settle, which of those
        were asked of them (ASK), whether the last reply read before the failure was a
        :class:`~kvkit.backends.blockstore.resp.ProtocolRefusal` (the server said why it closed), and which
        of those indices had no byte of their commands written.
        """
        legs: dict[Address, _Leg] = {}
        for (address, ask), chunks in flights.items():
            leg = legs.get(address)
            if leg is None:
                leg = legs[address] = _Leg(address)
            leg.chunks += [(ask, chunk) for chunk in chunks]
        if len(legs) == 1:
            for leg in legs.values():
                self._leg(leg, encode, read, deadline)
        else:
            self._crew.run([functools.partial(self._leg, leg, encode, read, deadline) for leg in legs.values()])
        broken: dict[Address, tuple[BaseException, list[int], dict[int, Address], bool, set[int]]] = {}
        for address, leg in legs.items():
            read_so_far = [*leg.results, *[[]] * (len(leg.chunks) - len(leg.results))]
            for (_, indices), results in zip(leg.chunks, read_so_far):
                for i, outcome in zip(indices, results):
                    self._settle(i, outcome, address, outcomes, pending, asked, unserved)
            if leg.error is not None:
                left: list[int] = []
                left_asked: dict[int, Address] = {}
                for (ask, chunk), results in zip(leg.chunks, read_so_far):
                    left += chunk[len(results):]
                    if ask:
                        left_asked.update(dict.fromkeys(chunk[len(results):], address))
                last = next((results[-1] for results in reversed(leg.results) if results), None)
                broken[address] = (leg.error, left, left_asked, isinstance(last, ProtocolRefusal), leg.unsent())
        return broken

    def _leg(self, leg: _Leg, encode: Encode, read: Read, deadline: float) -> None:
        """Pipeline ``leg``'s chunks over its node's connection, chunk ``k + 1`` sent before chunk ``k`` is read;
        record each chunk's outcomes, as they are read, how many keys had bytes written, or the failure that
        stopped the pipeline, in ``leg``.

        A send the server broke off (it closed the connection) is followed by reading the replies to what was
        sent, until they end: a server closes after answering why (a
        :class:`~kvkit.backends.blockstore.resp.ProtocolRefusal`), and its earlier commands were answered too.
        """
        chunks = leg.chunks
        try:
            conn = self._conn(leg.address, deadline)
            for step in range(len(chunks) + 1):
                if step < len(chunks):
                    ask, parts = chunks[step]
                    buffers, ends = _asked(leg.address, parts, encode) if ask else encode(leg.address, parts)
                    try:
                        conn.send(buffers)
                    except (ConnectionError, ssl.SSLError):  # closed under it: its answers (why) are read first
                        leg.sent += _started(ends, conn.sent)
                        for ask, indices in chunks[len(leg.results):step + 1]:
                            leg.results.append([])
                            self._read(leg.address, conn, indices, ask, read, leg.results[-1])
                        raise
                    except BaseException:
                        leg.sent += _started(ends, conn.sent)
                        raise
                    leg.sent += len(parts)
                if step:
                    ask, indices = chunks[step - 1]
                    leg.results.append([])
                    self._read(leg.address, conn, indices, ask, read, leg.results[-1])
                    self.health.heard(leg.address)
        except (OSError, ValueError) as exc:
            leg.error = exc

    def _failed(self, address: Address, exc: BaseException, remap: bool = True, shares: int = 1,
                explained: bool = False) -> str:
        """Close ``address``'s connection; record the evidence against it (and, with ``remap``, have the slot
        map read again); answer the keys' reason.

        A deadline that passed is evidence when the node stalled (:meth:`_stalled`). A failure the server
        ``explained`` (it closed the connection right after refusing a command, or refused it for want of room
        while it serves the other links: :meth:`_full`) is none.
        """
        self._drop(address)
        why = f"transport: {address[0]}:{address[1]}: {type(exc).__name__}: {exc}"
        if explained:
            return why
        if not isinstance(exc, DeadlineExceeded) or self._stalled(exc, shares, address):
            self.health.trip(address, why)
            if remap:
                self.topology.outdated()  # in a Cluster, a failover may move its slots
        return why

    def _full(self, address: Address, exc: BaseException) -> bool:
        """Whether ``exc`` is ``address`` refusing this link's new connection for want of room (``maxclients``)
        while it serves a connection of another link sharing the health (:meth:`NodeHealth.serving`)."""
        return isinstance(exc, NoRoom) and self.health.serving(address)

    def _stalled(self, exc: BaseException, shares: int = 1, address: Address | None = None) -> bool:
        """Whether ``exc`` (a deadline that passed, a connection the server closed) came after the node sent nothing
        for at least half of its equal share of a call's deadline (``shares``: how many nodes it was split between)
        and, given its ``address``, no link sharing the health read a reply from it meanwhile."""
        silent = exc.stalled_s if isinstance(exc, DeadlineExceeded | ConnectionClosedError) else 0.0
        return silent >= self.options.request_timeout_s / (2 * shares) and (
            address is None or self.health.silent(address, silent))

    def _chunks(self, indices: list[int], weights: Sequence[int] | None) -> list[list[int]]:
        if weights is None:
            return [indices]
        chunks: list[list[int]] = [[]]
        load = 0
        for i in indices:
            if load >= self.window_bytes:
                chunks.append([])
                load = 0
            chunks[-1].append(i)
            load += weights[i]
        return chunks

    def _settle(self, i: int, outcome: object, answered: Address, outcomes: list[object], pending: list[int],
                asked: dict[int, Address], unserved: dict[int, Address]) -> None:
        """Record key ``i``'s outcome from ``answered``, or queue it for the node a redirect names.

        A redirect to the host ``""`` (a node with ``cluster-preferred-endpoint-type unknown-endpoint``)
        means ``answered``'s host at the port given; one to ``"?"`` (``hostname`` preferred, none
        announced) names no host: the key fails and the next call re-reads the slot map (whose
        ``?`` endpoints give their IP address beside them, see :func:`_slot_map`). A ``-CLUSTERDOWN`` from a
        Cluster node (it left the Cluster, or the Cluster is down) is the key's outcome unless the slot map, read
        again, gives its slot to another node (``unserved``, see :meth:`_rerouted`); it is no evidence against
        the node.
        """
        if isinstance(outcome, Redirect) and not self.cluster:
            outcome = ServerError("a MOVED/ASK reply: the server is a Cluster node; hint: use a valkey+cluster:// URL")
        if isinstance(outcome, Redirect) and outcome.address[0] in ("", "?"):
            if outcome.address[0] == "":
                outcome = attrs.evolve(outcome, address=(answered[0], outcome.address[1]))
            else:
                self.topology.outdated()
                outcome = ServerError(f"a redirect to the unknown endpoint ?:{outcome.address[1]} (a node prefers "
                                      f"hostnames and announces none); the slot map is read again")
        if isinstance(outcome, Redirect):
            if outcome.ask:
                asked[i] = outcome.address
            else:
                self.topology.moved(outcome.slot, outcome.address)
            pending.append(i)
        else:
            outcomes[i] = outcome
            if self.cluster and isinstance(outcome, SlotUnserved):
                self.topology.outdated()
                unserved[i] = answered

    @staticmethod
    def _read(address: Address, conn: Connection, indices: list[int], ask: bool, read: Read,
              outcomes: list[object]) -> None:
        """Append the outcome of each of ``indices`` to ``outcomes`` as ``address``'s connection ``conn`` gives it
        (``ask``: each reply follows its ASKING's)."""
        if not ask:
            for outcome in read(address, conn, indices):
                outcomes.append(outcome)  # noqa: PERF402 - one at a time: those read before a failure stay
            return
        for i in indices:
            asking = conn.reply()
            if isinstance(asking, bytes):
                outcomes += read(address, conn, [i])
            elif isinstance(asking, ServerError):  # refused (an ACL without +asking): the key fails, not the node
                list(read(address, conn, [i]))  # its own reply (a redirect, not asked) keeps the connection in step
                outcomes.append(ServerError(f"ASKING refused: {asking}"))
            else:
                raise ConnectionError(f"protocol error: ASKING answered {asking!r:.80}")

    def refresh(self, deadline: float | None = None) -> str | None:
        """Read the slot map (CLUSTER SLOTS) unless another link sharing :attr:`topology` just did; ``None``, or
        why no node answered with one.

        The seeds are asked first, then the nodes of the map known so far, one at a time; the map is the first
        usable one a node answers. Nodes the health marks down are not asked; a node that serves no slot
        (restarted without its cluster configuration, not part of the Cluster) is asked, and the next node
        after it. Each node asked waits at most an equal share of what is left of the deadline for it and the
        nodes after it (the last: all of it), so one that never answers (stalled) leaves the others their
        time; one that sent nothing for at least half of its share of a whole call's deadline is evidence
        against it (see :meth:`_failed`). A node that refuses the connection costs nothing of the others' time.
        """
        if deadline is None:
            deadline = time.monotonic() + self.options.request_timeout_s
        return self.topology.refresh(deadline, lambda: self._read_slots(deadline))

    def _read_slots(self, deadline: float) -> list[Address] | str:
        """The slot map from the first known node that answers with one within its share, or why none did."""
        known = list(dict.fromkeys([*self.seeds, *(self.topology.slots or ())]))
        last = "every known node is down"
        candidates: list[Address] = []
        for address in known:
            why = self.health.down(address)
            if why is None:
                candidates.append(address)
            else:
                last = why
        for i, address in enumerate(candidates):
            now = time.monotonic()
            share = now + (deadline - now) / (len(candidates) - i)
            try:
                slots = _slot_map(self._conn(address, share).call(b"CLUSTER", b"SLOTS"), address)
            except (OSError, ValueError) as exc:
                last = self._failed(address, exc, remap=False, shares=len(candidates),
                                    explained=self._full(address, exc))
                continue
            except ServerError as exc:
                last = f"transport: {address[0]}:{address[1]} refused CLUSTER SLOTS: {exc}"
                continue
            if slots is None:
                last = f"transport: {address[0]}:{address[1]} serves no slot (it is not part of the Cluster now)"
                continue
            return slots
        return f"transport: no Cluster node answered CLUSTER SLOTS (last: {last})"

    def _prune(self) -> None:
        """Close the connections to nodes that own no slot in the map read last (by this link or another)."""
        if self._generation == self.topology.generation:
            return
        self._generation = self.topology.generation
        owners = set(self.topology.slots or ())
        for gone in [a for a in self._conns if a not in owners]:
            self._drop(gone)

    def reset(self) -> None:
        """Close every connection; the next call opens them again."""
        for address in list(self._conns):
            self._drop(address)
        self.topology.outdated()

    def close(self) -> None:
        """Close every connection, and shut down those being opened (a wait in another thread returns at once),
        and open none again."""
        self._closed = True
        self._openings.shut()
        self._crew.stop()
        self.reset()

    def abandon(self) -> None:
        """In a process forked from the one that used the link: close this process's descriptors of its
        connections without shutting them down (the parent goes on using them) and leave its crew (the parent's
        threads, and their lock) alone; the link opens nothing again."""
        self._closed = True
        self._stop_crew.detach()
        for conn in self._conns.values():
            conn.release()
        self._conns.clear()

    def _node_for(self, key: bytes) -> Address:
        if not self.cluster:
            return self.seeds[0]
        slots = self.topology.slots
        assert slots is not None, "refresh() runs before routing"
        return slots[key_slot(key)]

    def _conn(self, address: Address, deadline: float) -> Connection:
        """``address``'s connection (opened if there is none: its server's identity is asked with its first
        commands), bounded by ``deadline``. One opened while :meth:`close` ran in another thread is closed at
        once (``close`` sets ``_closed`` before it closes the connections: either it closed this one, or this
        thread sees ``_closed`` once the connection is in ``_conns``), so no call waits on it."""
        conn = self._conns.get(address)
        if conn is None:
            if self._closed:
                raise ConnectionRefusedError("the link is closed")
            if self.on_connect is not None:
                self.on_connect(address)
            conn = self._conns[address] = Connection(address, self.options, deadline, self._openings)
            if self._closed:
                self._drop(address)
                raise ConnectionRefusedError("the link is closed")
            if self.cluster and self.topology.slots is None:
                marker = None  # no map to find the node's slots in yet: its identity is the run_id alone
            else:
                marker = self.identities.marker(address, self.topology.slots if self.cluster else None)
            conn.ask_identity(functools.partial(self._let_in, address, conn, address in self._opened, marker),
                              marker, plant=self.identities.missing(marker))
            remember(self._opened, address, None)
        conn.renew(deadline)
        return conn

    def _let_in(self, address: Address, conn: Connection, again: bool, marker: bytes | None, run_id: bytes | None,
                token: bytes | None) -> None:
        """``address`` answered ``conn``'s first commands, telling ``run_id`` and the ``token`` in its ``marker``
        key (``again``: this link had a connection to it before)."""
        self.health.let_in(address, conn)
        self.identities.opened(address, run_id, marker, token, again)

    def _drop(self, address: Address) -> None:
        conn = self._conns.pop(address, None)
        if conn is not None:
            conn.close()
            self.health.let_go(address, conn)


def _asked(address: Address, indices: list[int], encode: Encode) -> tuple[list[bytes | memoryview], list[int]]:
    """What :data:`Encode` answers for ``indices`` asked of ``address`` (an ASK): each key's command after an
    ``ASKING``."""
    buffers: list[bytes | memoryview] = []
    ends: list[int] = []
    end = 0
    for i in indices:
        parts, (own,) = encode(address, [i])
        buffers += (_ASKING, *parts)
        end += len(_ASKING) + own
        ends.append(end)
    return buffers, ends


def _started(ends: list[int], written: int) -> int:
    """How many of the keys whose commands end at ``ends`` had bytes among the first ``written`` written: those
    whose command starts before that."""
    return bisect.bisect_left([0, *ends[:-1]], written)


def _expired(exc: BaseException) -> bool:
    """Whether ``exc`` is the call's deadline passing (not a refusal, a break, or a node not reached for want of
    this process's own resources: :class:`~kvkit.backends.blockstore.resp.LookupsBusy`,
    :class:`~kvkit.backends.blockstore.resp.ShortOfDescriptors`)."""
    return isinstance(exc, DeadlineExceeded) and not isinstance(exc, LookupsBusy | ShortOfDescriptors)


def _closed_by_server(exc: BaseException) -> bool:
    """Whether ``exc`` is what a connection the server closed gives (not a timeout, a refusal or a reply out of
    step)."""
    return isinstance(exc, ConnectionError) and not isinstance(exc, ConnectionRefusedError) \
        and "protocol error" not in str(exc)


def _slot_map(reply: object, answered: Address) -> list[Address] | None:
    """CLUSTER SLOTS as the owner of each of the 16384 slots (those it does not list: ``answered``), ``None`` if it
    lists none (``ValueError`` if it is not such a reply: a range outside 0-16383, ending before it starts or
    overlapping one listed before it, a port outside 0-65535, more than :data:`MAX_NODES` nodes). Port 0 is how a
    node whose address is unknown (failed) is listed: its keys fail.

    Each slot is listed at most once, as Valkey lists them, so reading a map costs at most one write per slot
    however many ranges a reply holds (a reply repeating the whole range 0-16383 160,000 times would cost
    billions).
    """
    if reply == []:
        return None
    if not isinstance(reply, list):
        raise ValueError(f"CLUSTER SLOTS answered {reply!r:.80}")
    slots: list[Address] = [answered] * SLOTS
    listed = bytearray(SLOTS)  # 1: the slot's range was read
    try:
        for start, end, primary, *_ in reply:
            port = int(primary[1])
            if not 0 <= start <= end < SLOTS or not 0 <= port < 65536:  # 0: a failed node's unknown address
                raise ValueError(f"slots {start}-{end} at port {port} are out of range")
            if listed.find(1, start, end + 1) >= 0:
                raise ValueError(f"slots {start}-{end} overlap a range listed before them")
            listed[start:end + 1] = b"\1" * (end + 1 - start)
            slots[start:end + 1] = [(_endpoint(primary, answered), port)] * (end + 1 - start)
    except (TypeError, IndexError, AttributeError, ValueError) as exc:
        raise ValueError(f"CLUSTER SLOTS answered {reply!r:.80}: {exc}") from exc
    nodes = len(set(slots))
    if nodes > MAX_NODES:
        raise ValueError(f"CLUSTER SLOTS answered {plural(nodes, 'node')}, more than a Cluster has ({MAX_NODES})")
    return slots


def _endpoint(node: list, answered: Address) -> str:
    """The host of a CLUSTER SLOTS node entry ``[endpoint, port, id, metadata]``.

    The endpoint, except: NULL or ``""`` (``cluster-preferred-endpoint-type unknown-endpoint``, a node
    behind a load balancer) is the host of the node that answered; ``"?"`` (``hostname`` preferred, none
    announced) is the node's ``ip`` from the metadata (``ValueError`` without one, or for a host that is no host
    name: :func:`~kvkit.backends.blockstore.resp.node_host`).
    """
    endpoint = node[0]
    if endpoint is None or endpoint == b"":
        return answered[0]
    if endpoint == b"?":
        metadata = node[3] if len(node) > 3 and isinstance(node[3], list) else []
        ip = dict(zip(metadata[0::2], metadata[1::2])).get(b"ip")
        if not isinstance(ip, bytes) or not ip:
            raise ValueError(f"a node's endpoint is '?' and its metadata has no ip: {node!r:.80}")
        return node_host(ip)
    return node_host(endpoint)
