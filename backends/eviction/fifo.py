"""First in, first out: evict the block that became ready longest ago."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import check_count, not_tracked
from kvkit.backends.eviction._queue import ParkingQueue
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["FIFOPolicy"]


@attrs.define
class FIFOPolicy(ParkingQueue, EvictionPolicy):
    """Evicts in insertion order; hits change nothing.

    The policy is one :class:`~kvkit.backends.eviction._queue.ParkingQueue`,
    whose pin hooks it exposes: a block in use is set aside at once, keeping
    its place in the queue, so no selection meets it; released, it is evicted
    exactly where it would have been had it never been in use (its place is
    its insertion), so the victims, and a trace's hits, are those of a driver
    that never pins. A selection costs O(victims), its first included,
    however many blocks are in use; a driver that never pins gets the same
    victims by scanning (``is_evictable``).

    Invariants: the queue holds exactly the tracked blocks, in insertion order.
    """

    # The queue's own methods are the hooks: one call per notification on the hot path.
    on_pin = ParkingQueue.pin
    on_unpin = ParkingQueue.unpin
    on_remove = ParkingQueue.remove  # type: ignore[assignment]  # returns whether it was pinned; the pool ignores it

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        self.add(block)  # refuses a tracked block

    # The batch hooks (BatchedPolicy): each is its per-block hook in turn (a subclass's override included).
    @override
    def pin_many(self, blocks: Sequence[BlockId]) -> None:
        """``on_pin`` for each block in order; the queue's own pins leave the side list in one pass."""
        if type(self).on_pin is ParkingQueue.pin:
            ParkingQueue.pin_many(self, blocks)
        else:
            for block in blocks:
                self.on_pin(block)

    def insert_pinned(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
                      parents: Sequence[BlockHash | None]) -> None:
        """``on_insert`` then ``on_pin`` for each block in order; the queue's own hooks in one batch."""
        cls = type(self)
        if cls.on_insert is FIFOPolicy.on_insert and cls.on_pin is ParkingQueue.pin:
            n = min(len(blocks), len(hashes), len(parents))
            self.add_pinned_many(blocks if n == len(blocks) else blocks[:n])
            return
        for block, block_hash, parent in zip(blocks, hashes, parents):
            self.on_insert(block, block_hash, parent)
            self.on_pin(block)

    @override
    def unpin_many(self, blocks: Sequence[BlockId]) -> None:
        """``on_unpin`` for each block in order; the queue's own releases in one batch."""
        if type(self).on_unpin is ParkingQueue.unpin:
            ParkingQueue.unpin_many(self, blocks)
        else:
            for block in blocks:
                self.on_unpin(block)

    def access_many(self, blocks: Sequence[BlockId]) -> None:
        """``on_access`` for each block in order; the queue's own touches (LRU's) in one batch."""
        if type(self).on_access is ParkingQueue.touch:
            ParkingQueue.touch_many(self, blocks)
        else:
            for block in blocks:
                self.on_access(block)

    @override
    def on_access(self, block: BlockId) -> None:
        if block not in self:
            raise not_tracked(self, block)

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        victims = self.first(n, is_evictable)
        return victims if len(victims) == n else None

    def __iter__(self) -> Iterator[BlockId]:
        """Tracked blocks, pinned ones included, from the next victim to the last (unpinned)."""
        return iter(self.in_order())
