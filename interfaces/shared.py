"""The shared tier's protocols and the values they exchange.

``BlockStore`` is a store of block values keyed by block identity (the third
tier, shared by every instance of a deployment); ``StoreResult`` is what one of
its calls reports. ``BlockCodec`` names the keys and frames the values;
``SharedPlan`` is one fetch or put a step asks the workers to run.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvkit.errors import ConfigError, PlanError
from kvkit.interfaces.types import BlockHash, Direction
from kvkit.validate import check_enum, check_int, checked, is_int, plural, quote

__all__ = ["DEFAULT_TENANT", "SHARED_WRITES", "BlockCodec", "BlockStore", "SharedPlan", "StoreResult",
           "check_tenant"]

SHARED_WRITES = ("write-through", "write-back")
"""When CPU blocks go to the shared tier: after a CPU store committed them, or ahead of their CPU eviction."""

DEFAULT_TENANT = "default"
"""The tenant of a deployment that names none."""

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_tenant(name: str, value: object) -> str:
    """``value`` if it is a tenant id, else ``ConfigError`` quoting it.

    A tenant id is 1-64 letters, digits, ``_``, ``.`` or ``-``, starting with a
    letter or digit: every key of the tenant starts with ``kvkit:<tenant>:``,
    so it holds no ``:`` (one tenant's prefix is never another's) and none of
    the characters a Valkey ACL key pattern or a Cluster hash tag reads
    (``* ? [ ] \\ { }``).
    """
    if isinstance(value, str) and _TENANT.fullmatch(value) is not None:
        return value
    raise ConfigError(f"{name}={quote(value)}: must be 1-64 letters, digits, '_', '.' or '-', starting with a "
                      f"letter or digit (it is the key prefix kvkit:<tenant>: that ACL key patterns match)")


def _check_indices(name: str, value: object) -> tuple[int, ...]:
    """``value`` (key indices: an iterable of ints >= 0) as a sorted tuple without repeats, else ``PlanError``
    quoting it."""
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        indices = tuple(value)
        if all(i.__class__ is int and i >= 0 for i in indices):  # the common case: a store's own list or range
            return tuple(sorted(set(indices)))
        if all(is_int(i, 0) for i in indices):
            return tuple(sorted({int(i) for i in indices}))
    raise PlanError(f"{name}={quote(value)}: must be key indices (ints >= 0)")


@attrs.frozen
class StoreResult:
    """One finished ``put`` or ``get`` as ``BlockStore.poll`` reports it to the caller naming its ticket.

    Attributes:
        ticket: the id ``put``/``get`` answered (an int >= 0).
        failed: indices (into that call's ``keys``) of the keys that did not
            complete: a ``get`` whose key is missing, whose value's length is
            not the destination's, or whose transport failed; a ``put`` that
            did not land. Sorted, no repeats; empty means all landed.
        error: a one-line reason when anything failed (``""`` otherwise); a
            transport failure (timeout, refused connection) starts with
            ``"transport:"`` so a caller can tell a sick server from a miss.
        unreached: the failed keys sent (some of their command's bytes, at
            least) that no server answered (their transport failed), for a
            store that tells them from the keys a server refused or lacks (a
            Cluster with one dead node and live ones refusing writes fails
            both kinds in one call); ``None``, for a store that does not: as
            ``error`` says of them all (see :attr:`unanswered`). Sorted, no
            repeats, a subset of ``failed``.
        unsent: the failed keys never sent: the call's deadline passed
            before any byte of their command left this process (while they
            waited in the store's own queue behind earlier calls, connecting,
            or behind the call's earlier keys), so they are no evidence against any
            server; ``None`` for a store that does not tell (its failed keys
            are taken as sent). Sorted, no repeats, a subset of ``failed``
            disjoint from ``unreached``. A get among them is a miss and a put
            did not land, as any failed key.

    Bad ``failed``, ``unreached`` or ``unsent`` (not key indices, or breaking
    the rules above) raise ``PlanError`` quoting them.
    """

    ticket: int = attrs.field(converter=checked(check_int, minimum=0, label="StoreResult.", error=PlanError))  # type: ignore[misc]
    failed: tuple[int, ...] = attrs.field(default=(), converter=checked(_check_indices, label="StoreResult."))  # type: ignore[misc]
    error: str = ""
    unreached: tuple[int, ...] | None = attrs.field(default=None, converter=checked(  # type: ignore[misc]
        _check_indices, label="StoreResult.", optional=True))
    unsent: tuple[int, ...] | None = attrs.field(default=None, converter=checked(  # type: ignore[misc]
        _check_indices, label="StoreResult.", optional=True))

    def __attrs_post_init__(self) -> None:
        for name, part in (("unreached", self.unreached), ("unsent", self.unsent)):
            if part and not set(part) <= set(self.failed):
                raise PlanError(f"StoreResult.{name}={quote(part)}: keys that did not fail "
                                f"(failed={quote(self.failed)})")
        if self.unreached and self.unsent and not set(self.unreached).isdisjoint(self.unsent):
            raise PlanError(f"StoreResult.unsent={quote(self.unsent)}: keys also unreached "
                            f"(unreached={quote(self.unreached)}): a key was sent or it was not")

    @property
    def unanswered(self) -> tuple[int, ...]:
        """The failed keys sent that no server answered (the evidence against the servers): ``unreached``, or
        for a store that does not tell them apart, every failed key not :attr:`unsent` when the failure was the
        transport (:attr:`transport_failed`), else none."""
        if self.unreached is not None:
            return self.unreached
        if not self.transport_failed:
            return ()
        if not self.unsent:
            return self.failed
        unsent = set(self.unsent)
        return tuple(i for i in self.failed if i not in unsent)

    @property
    def ok(self) -> bool:
        """``True`` when every key of the call completed."""
        return not self.failed

    @property
    def transport_failed(self) -> bool:
        """``True`` when the failure was the server or the link, not a missing or bad value."""
        return self.error.startswith("transport:")


@runtime_checkable
class BlockStore(Protocol):
    """A store of immutable values, one per block key, shared by many engine instances.

    Keys are ``bytes`` (kvkit derives them from the namespace, the block hash
    and the worker rank); values are gathered from and scattered into
    caller-owned buffers (``memoryview``-able, typically pinned CPU blocks), so
    a backend can move bytes without copying them through Python objects. A
    value is the concatenation of its buffers; kvkit puts a fixed header in the
    first buffer and the payload in the rest, and checks both on every read:
    the store itself need not understand them.

    The store is a cache, not a source of truth: it may drop any key at any
    time, and a key is written with the same bytes by whoever writes it, so
    concurrent writers are idempotent.

    Results belong to the caller that submitted them: ``put``/``get`` answer
    a ticket, and only a ``poll`` naming that ticket reports its result, so
    several users of one store (the scheduler and every worker rank of every
    stack in a process) each collect their own, with no routing between them.

    Invariants (``kvkit.testing.BlockStoreContract`` checks them; those about
    a failing medium need one, and kvkit's Valkey fault tests provide it):
        * ``contains`` answers the length of the leading run of present keys,
          in one round trip to the medium; it never raises for a sick
          server (it answers ``0``). Given ``timeout_s``, a store with a
          deadline of its own answers by then (by its own deadline if that
          is sooner), a key not answered in time counting as absent, and
          with ``0`` answers ``0`` without a round trip; a local store (whose
          calls take what its medium takes) may ignore it, and says so.
        * ``put``/``get`` never block on the medium: they queue the work and
          answer a fresh ticket (never reused). ``poll(tickets)`` reports
          only results of the tickets it names, each ticket's exactly once
          over all polls, failed or not; a finished result not named yet
          waits for a poll that names it (never handed to another caller,
          never lost unless abandoned, below). Naming a ticket already
          reported, abandoned or never issued reports nothing.
        * Deadlines: a ``put`` or ``get`` is reported, and ``contains``
          answers, within the backend's deadline (its request timeout) of
          the call, however slowly the medium sends: what did not complete
          by then is reported failed (``"transport: ..."``; a store that
          tells which of those keys it never sent names them in
          ``StoreResult.unsent``), and its buffers are never touched after
          the report. A part of the medium with
          evidence against it (a dead or stalled node) fails its keys at
          once until the backend's retry interval has passed; the other
          parts keep serving theirs.
        * Waiting results are bounded: a store documents how many finished
          results may wait at once (the built-ins: ``max_waiting``); when
          one more finishes, the result that has waited longest is
          discarded and its ticket is *abandoned*: no poll ever reports it.
          A caller that polls its tickets as often as it submits (kvkit's
          scheduler and workers poll every step) never loses a result;
          results nobody collects cannot pile up.
        * Until its ticket is reported the caller must not touch the buffers
          of a ``put`` (the store may still read them) or of a ``get`` (the
          store may still write them); after it, the store never touches them.
        * A ``get`` fills a key's buffers only with a value of exactly their
          total length; any other key is reported failed (buffers undefined).
        * A key whose ``put`` was reported landed is readable until the store
          drops it; nothing is readable before its ``put`` landed.
        * ``close`` makes every outstanding ticket finish (failed, unless it
          completed first), to be reported by the next poll naming it,
          releases connections and files, and is idempotent;
          ``contains``/``put``/``get`` after it raise ``KVKitError``.
          Malformed calls (keys not non-empty ``bytes``, buffer lists not
          one per key, ``poll`` tickets not a collection of ints, a
          ``timeout_s`` not ``None`` or a number >= 0) raise ``ConfigError``.
    """

    def contains(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """Count the leading keys that are present (stop at the first absent one), answering within ``timeout_s``
        seconds (``None``: the store's own deadline; see the invariants)."""
        ...

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview]]) -> int:
        """Queue writing ``values[i]`` (its buffers concatenated) under ``keys[i]``; answer the ticket."""
        ...

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        """Queue reading ``keys[i]`` into ``buffers[i]`` (scattered in order); answer the ticket."""
        ...

    def poll(self, tickets: Collection[int], timeout: float = 0.0) -> list[StoreResult]:
        """Report the finished ones of ``tickets``, waiting up to ``timeout`` seconds for the first one."""
        ...

    def close(self) -> None:
        """Fail outstanding work, release every resource; idempotent."""
        ...

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the store's own bookkeeping is inconsistent."""
        ...



def _ints(value: Iterable[int]) -> tuple[int, ...]:
    out = tuple(value)
    if not all(v.__class__ is int for v in out):
        raise PlanError(f"SharedPlan: block ids and hashes must be ints, got {list(out)[:8]!r}")
    return out


@attrs.frozen
class SharedPlan:
    """One shared-tier transfer, for every worker to run on its own shard.

    ``direction`` is :attr:`Direction.LOAD` for a *fetch* (the store's values
    into CPU blocks ``blocks``, which are allocated and not ready) and
    :attr:`Direction.STORE` for a *put* (ready CPU blocks into the store).
    ``hashes[i]`` names the content of ``blocks[i]``; each worker derives its
    keys from them and its rank.

    Invariants: ``len(blocks) == len(hashes) >= 1``; every id and hash is an int.
    """

    direction: Direction = attrs.field(converter=checked(check_enum, cls=Direction, label="SharedPlan.",  # type: ignore[misc]
                                                         error=PlanError))
    blocks: tuple[int, ...] = attrs.field(converter=_ints)
    hashes: tuple[BlockHash, ...] = attrs.field(converter=_ints)

    def __attrs_post_init__(self) -> None:
        if not self.blocks or len(self.blocks) != len(self.hashes):
            raise PlanError(f"SharedPlan needs as many hashes as blocks (at least one), got "
                            f"{plural(len(self.blocks), 'block')} and {plural(len(self.hashes), 'hash', 'hashes')}")

    def __len__(self) -> int:
        return len(self.blocks)


@runtime_checkable
class BlockCodec(Protocol):
    """Names and frames the values a :class:`~kvkit.interfaces.shared.BlockStore` holds.

    The one seam between the shared-tier lifecycle (which keys exist, which
    bytes go where) and the value format (header, checksum, namespace): the
    scheduler side derives keys for ``contains``, each worker frames what it
    puts and checks what it gets. A value is ``header + payload``, the header
    exactly ``header_bytes`` long.

    Invariants:
        * ``key`` is a pure function of ``(namespace, block_hash, rank)``: two
          codecs of one namespace agree, two namespaces never share a key.
        * ``check`` is ``True`` only for a header ``seal`` wrote for the same
          ``block_hash``, ``rank`` and payload bytes; anything else (corrupted,
          truncated, foreign) is ``False``, never an exception.
    """

    @property
    def header_bytes(self) -> int:
        """Length of every header ``seal`` writes."""
        ...

    @property
    def probe_key(self) -> bytes:
        """A key no block has, with the prefix of the codec's keys (a health probe writes it)."""
        ...

    def key(self, block_hash: BlockHash, rank: int) -> bytes:
        """The store key of ``rank``'s shard of the block ``block_hash``."""
        ...

    def seal(self, header: memoryview, block_hash: BlockHash, rank: int, payload: Sequence[memoryview]) -> None:
        """Write the header of ``payload`` (``rank``'s shard of ``block_hash``) into ``header``."""
        ...

    def check(self, header: memoryview, block_hash: BlockHash, rank: int, payload: Sequence[memoryview]) -> bool:
        """Whether ``header`` and ``payload``, as read back, are a valid value of that shard."""
        ...
