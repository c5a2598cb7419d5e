"""The ``BlockStore`` protocol: the third tier, a shared store of block values keyed by block identity."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvkit.errors import PlanError
from kvkit.validate import check_int, checked

__all__ = ["BlockStore", "StoreResult"]


@attrs.frozen
class StoreResult:
    """One finished ``put`` or ``get`` as ``BlockStore.poll`` reports it.

    Attributes:
        ticket: the id ``put``/``get`` answered (an int >= 0).
        failed: indices (into that call's ``keys``) of the keys that did not
            complete: a ``get`` whose key is missing, whose value's length is
            not the destination's, or whose transport failed; a ``put`` that
            did not land. Sorted, no repeats; empty means all landed.
        error: a one-line reason when anything failed (``""`` otherwise); a
            transport failure (timeout, refused connection) starts with
            ``"transport:"`` so a caller can tell a sick server from a miss.
    """

    ticket: int = attrs.field(converter=checked(check_int, minimum=0, label="StoreResult.", error=PlanError))
    failed: tuple[int, ...] = attrs.field(default=(), converter=lambda v: tuple(sorted(set(v))))
    error: str = ""

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

    Invariants (``kvkit.testing.BlockStoreContract`` checks them; those about
    a failing medium need one, and kvkit's Valkey fault tests provide it):
        * ``contains`` answers the length of the leading run of present keys,
          in one round trip to the medium; it never raises for a sick
          server (it answers ``0``).
        * ``put``/``get`` never block on the medium: they queue the work and
          answer a fresh ticket (never reused); every ticket is reported by
          ``poll`` exactly once, failed or not. No call waits on the medium
          longer than the backend's request timeout without progress; once
          the medium failed, queued work fails at once (``"transport: ..."``)
          until the backend's retry interval has passed.
        * Until its ticket is reported the caller must not touch the buffers
          of a ``put`` (the store may still read them) or of a ``get`` (the
          store may still write them); after it, the store never touches them.
        * A ``get`` fills a key's buffers only with a value of exactly their
          total length; any other key is reported failed (buffers undefined).
        * A key whose ``put`` was reported landed is readable until the store
          drops it; nothing is readable before its ``put`` landed.
        * ``close`` reports every outstanding ticket by the next ``poll``
          (failed, unless it completed first), releases connections and
          files, and is idempotent; ``contains``/``put``/``get`` after it
          raise ``KVKitError``. Malformed calls (keys not non-empty
          ``bytes``, buffer lists not one per key) raise ``ConfigError``.
    """

    def contains(self, keys: Sequence[bytes]) -> int:
        """Count the leading keys that are present (stop at the first absent one)."""
        ...

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview]]) -> int:
        """Queue writing ``values[i]`` (its buffers concatenated) under ``keys[i]``; answer the ticket."""
        ...

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        """Queue reading ``keys[i]`` into ``buffers[i]`` (scattered in order); answer the ticket."""
        ...

    def poll(self, timeout: float = 0.0) -> list[StoreResult]:
        """Report finished tickets, waiting up to ``timeout`` seconds for the first one."""
        ...

    def close(self) -> None:
        """Fail outstanding work, release every resource; idempotent."""
        ...

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the store's own bookkeeping is inconsistent."""
        ...
