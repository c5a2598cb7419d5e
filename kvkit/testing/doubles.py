"""Minimal stand-ins for tests: components that satisfy a protocol and do nothing."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import attrs
from typing_extensions import override

from kvkit.interfaces.callbacks import OffloadCallback
from kvkit.interfaces.shared import BlockStore, StoreResult
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["FailingStore", "InertPolicy", "RaisingCallback"]


class InertPolicy:
    """An ``EvictionPolicy`` that tracks nothing and never chooses a victim.

    For tests of what holds components (registries, configs), not of eviction.
    """

    def on_insert(self, block: BlockId, block_hash: BlockHash, parent: BlockHash | None) -> None:
        """Ignored."""

    def on_access(self, block: BlockId) -> None:
        """Ignored."""

    def on_remove(self, block: BlockId) -> None:
        """Ignored."""

    def select_victims(self, n: int, is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        """Never evicts."""
        return None

    def __len__(self) -> int:
        return 0

    def check_invariants(self) -> None:
        """Nothing to check."""


class RaisingCallback(OffloadCallback):
    """An ``OffloadCallback`` whose every hook raises ``RuntimeError("callback bug in <hook>")``.

    A manager must contain it: nothing it does may change.
    """

    @override
    def __getattribute__(self, name: str):
        if name.startswith("on_"):
            def hook(*args: object) -> None:
                raise RuntimeError(f"callback bug in {name}")
            return hook
        return super().__getattribute__(name)


@attrs.define(eq=False)
class FailingStore:
    """A ``BlockStore`` in front of another that a test can take down and bring back.

    While ``down`` is ``True`` every ``put``/``get`` is reported failed with a
    ``"transport:"`` error and ``contains`` answers 0, as a stopped or
    unreachable server looks through a real client; otherwise every call goes
    to ``inner``. Its own tickets never collide with the inner store's; as
    there, a result waits for the poll naming its ticket, and at most
    ``max_waiting`` of its own failures wait (one more abandons the oldest).
    """

    inner: BlockStore
    down: bool = False
    max_waiting: int = 1 << 14
    _failed: dict[int, StoreResult] = attrs.field(factory=dict, init=False)  # in the order they failed
    _next: int = attrs.field(default=1 << 40, init=False)  # never collides with the inner store's tickets

    def contains(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        return 0 if self.down else self.inner.contains(keys, timeout_s=timeout_s)

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview]]) -> int:
        return self._fail(keys) if self.down else self.inner.put(keys, values)

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        return self._fail(keys) if self.down else self.inner.get(keys, buffers)

    def poll(self, tickets: Collection[int], timeout: float = 0.0) -> list[StoreResult]:
        wanted = set(tickets)
        mine = [self._failed.pop(t) for t in sorted(wanted.intersection(self._failed))]
        return mine + self.inner.poll(wanted, 0.0 if mine else timeout)

    def close(self) -> None:
        self.inner.close()

    def check_invariants(self) -> None:
        assert len(self._failed) <= self.max_waiting, "more failures wait than max_waiting"
        self.inner.check_invariants()

    def _fail(self, keys: Sequence[bytes]) -> int:
        ticket, self._next = self._next, self._next + 1
        while len(self._failed) >= self.max_waiting:
            del self._failed[next(iter(self._failed))]
        self._failed[ticket] = StoreResult(ticket, range(len(keys)), "transport: connection refused (FailingStore)")
        return ticket
