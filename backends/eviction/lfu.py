"""Least frequently used: evict the block with the fewest hits, least recent first."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import already_tracked, bad_id, check_count, not_tracked
from kvkit.backends.eviction._queue import ParkingQueue, QueuedPins
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["LFUPolicy"]


@attrs.define
class LFUPolicy(QueuedPins, EvictionPolicy):
    """Evicts the least frequently used block; ties go to the least recently used.

    A block's frequency is 1 on insert plus one per hit; it is forgotten on
    removal. Blocks sit in one bucket per frequency, each bucket ordered least
    recently used first, and the non-empty buckets form a linked list in
    ascending frequency (a hit moves a block from bucket ``f`` to ``f + 1``,
    which is created right after ``f``), so every update is O(1).

    Pinned blocks: with the pin hooks (a pool calls them), a block in use
    keeps its place in its bucket (a hit still moves it up one) and is set
    aside at once, so no selection meets it; released, it is evicted exactly
    where its count and last use put it, as for a driver that never pins
    (:class:`~kvkit.backends.eviction._queue.ParkingQueue`). A selection costs
    O(victims + buckets), its first included, however many blocks are in use.

    Invariants:
        * ``_freq[b] == f`` iff ``b`` is in ``_buckets[f]``; no bucket is empty.
        * Walking ``_higher`` from ``_lowest`` visits every bucket once, in
          strictly ascending frequency; ``_lower`` is its mirror.
    """

    _freq: dict[BlockId, int] = attrs.field(factory=dict, init=False)
    _buckets: dict[int, ParkingQueue] = attrs.field(factory=dict, init=False)
    _higher: dict[int, int | None] = attrs.field(factory=dict, init=False)
    _lower: dict[int, int | None] = attrs.field(factory=dict, init=False)
    _lowest: int | None = attrs.field(default=None, init=False)

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        if block in self._freq:
            raise already_tracked(self, block)
        if block < 0:  # its queue's flat state would refuse it after this policy's own maps changed
            raise bad_id(self, block)
        if 1 not in self._buckets:
            self._add_bucket(1, below=None)  # 1 is the least possible frequency
        self._freq[block] = 1
        self._buckets[1].add(block)

    @override
    def on_access(self, block: BlockId) -> None:
        f = self._freq.get(block)
        if f is None:
            raise not_tracked(self, block)
        if f + 1 not in self._buckets:
            self._add_bucket(f + 1, below=f)
        self._buckets[f + 1].add(block, pinned=self._drop_from_bucket(block, f))
        self._freq[block] = f + 1

    @override
    def on_remove(self, block: BlockId) -> None:
        f = self._freq.pop(block, None)
        if f is None:
            raise not_tracked(self, block)
        self._drop_from_bucket(block, f)

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        victims: list[BlockId] = []
        for f in self._ascending():
            if len(victims) == n:
                break
            victims += self._buckets[f].first(n - len(victims), is_evictable)
        return victims if len(victims) == n else None

    @override
    def __len__(self) -> int:
        return len(self._freq)

    @override
    def check_invariants(self) -> None:
        walked, below = [], None
        for f in self._ascending():
            assert below is None or below < f, f"frequencies out of order: {below} then {f}"
            assert self._lower.get(f, -1) == below, f"bucket {f} does not link down to {below}"
            assert len(self._buckets[f]), f"bucket {f} is empty"
            assert all(self._freq[b] == f for b in self._buckets[f].in_order()), \
                f"bucket {f} holds a stranger"
            walked.append(f)
            below = f
        assert sorted(self._buckets) == walked, \
            f"unlinked buckets: {set(self._buckets) - set(walked)}"
        assert set(self._higher) == set(self._lower) == set(walked), "stale links"
        self._check_pins()
        assert sum(map(len, self._buckets.values())) == len(self._freq), "block in no bucket"

    def _ascending(self) -> Iterator[int]:
        f = self._lowest
        while f is not None:
            yield f
            f = self._higher[f]

    def _add_bucket(self, f: int, below: int | None) -> None:
        above = self._lowest if below is None else self._higher[below]
        self._buckets[f] = self._new_queue()
        self._lower[f], self._higher[f] = below, above
        if below is None:
            self._lowest = f
        else:
            self._higher[below] = f
        if above is not None:
            self._lower[above] = f

    @override
    def _queue_of(self, block: BlockId) -> ParkingQueue:
        f = self._freq.get(block)
        if f is None:
            raise not_tracked(self, block)
        return self._buckets[f]

    @override
    def _queues(self) -> Iterator[ParkingQueue]:
        return iter(self._buckets.values())

    def _drop_from_bucket(self, block: BlockId, f: int) -> bool:
        """Take ``block`` out of bucket ``f`` (unlinking the bucket if it empties); return its pin."""
        bucket = self._buckets[f]
        pinned = bucket.remove(block)
        if len(bucket):
            return pinned
        below, above = self._lower.pop(f), self._higher.pop(f)
        del self._buckets[f]
        if below is None:
            self._lowest = above
        else:
            self._higher[below] = above
        if above is not None:
            self._lower[above] = below
        return pinned
