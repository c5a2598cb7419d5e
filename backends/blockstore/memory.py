"""``MemoryStore``: an in-process ``BlockStore``, the reference the others are tested against."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence

import attrs

from kvkit.backends.blockstore._common import MAX_WAITING, TicketBox, check_call, check_keys, check_timeout
from kvkit.interfaces.shared import StoreResult
from kvkit.validate import check_int, checked

__all__ = ["MemoryStore"]


@attrs.define(eq=False)
class MemoryStore:
    """A dict of values shared by every stack in one process (the simulator's shared tier).

    Work completes inside ``put``/``get`` and is reported by the next ``poll``
    naming its ticket. With ``capacity_bytes`` the store drops its least
    recently written or read values to make room, as a server with
    ``maxmemory`` and an LRU policy does. At most ``max_waiting`` finished
    results wait for their owners (one more abandons the oldest).
    ``contains`` answers at once, so it ignores ``timeout_s`` (checked only).
    Thread-safe: several stacks may share one instance.

    Invariants: ``used_bytes`` is the sum of the held values' lengths and never
    exceeds ``capacity_bytes``; every ticket is reported at most once, only
    to a poll naming it.
    """

    capacity_bytes: int | None = attrs.field(
        default=None, converter=attrs.converters.optional(checked(check_int, minimum=1, label="MemoryStore.")))  # type: ignore[misc]
    max_waiting: int = attrs.field(default=MAX_WAITING, kw_only=True,
                                   converter=checked(check_int, minimum=1, label="MemoryStore."))  # type: ignore[misc]
    _values: OrderedDict[bytes, bytes] = attrs.field(factory=OrderedDict, init=False)
    _tickets: TicketBox = attrs.field(init=False, default=attrs.Factory(
        lambda self: TicketBox(self.max_waiting), takes_self=True))
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    used_bytes: int = attrs.field(default=0, init=False)
    closed: bool = attrs.field(default=False, init=False)

    def contains(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        check_keys("MemoryStore", self.closed, keys)
        check_timeout("MemoryStore", timeout_s)
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._values:
                    break
                n += 1
            return n

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview]]) -> int:
        views = check_call("MemoryStore", self.closed, keys, values)
        ticket = self._tickets.issue(len(keys))
        with self._lock:
            failed = []
            for i, (key, parts) in enumerate(zip(keys, views)):
                value = b"".join(parts)  # one copy: join reads the buffers directly
                if self.capacity_bytes is not None and len(value) > self.capacity_bytes:
                    failed.append(i)
                    continue
                self._forget(key)
                while self.capacity_bytes is not None and self.used_bytes + len(value) > self.capacity_bytes:
                    self._forget(next(iter(self._values)))
                self._values[key] = value
                self.used_bytes += len(value)
        self._tickets.report(ticket, failed, "value larger than the store's capacity")
        return ticket

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        views = check_call("MemoryStore", self.closed, keys, buffers)
        ticket = self._tickets.issue(len(keys))
        with self._lock:
            failed = []
            for i, (key, parts) in enumerate(zip(keys, views)):
                value = self._values.get(key)
                if value is None or len(value) != sum(v.nbytes for v in parts):
                    failed.append(i)
                    continue
                self._values.move_to_end(key)
                at = 0
                for v in parts:
                    v[:] = value[at:at + v.nbytes]
                    at += v.nbytes
        self._tickets.report(ticket, failed, "missing or wrong-sized value")
        return ticket

    def poll(self, tickets: Collection[int], timeout: float = 0.0) -> list[StoreResult]:
        return self._tickets.poll(tickets, timeout)

    def drop(self, key: bytes) -> bool:
        """Forget ``key`` as a server's own eviction would; answer whether it was held."""
        with self._lock:
            return self._forget(key)

    def close(self) -> None:
        with self._lock:
            self.closed = True

    def check_invariants(self) -> None:
        with self._lock:
            assert self.used_bytes == sum(len(v) for v in self._values.values()), "used_bytes drifted"
            assert self.capacity_bytes is None or self.used_bytes <= self.capacity_bytes, "over capacity"
        self._tickets.check_invariants()

    def _forget(self, key: bytes) -> bool:
        value = self._values.pop(key, None)
        if value is not None:
            self.used_bytes -= len(value)
        return value is not None
