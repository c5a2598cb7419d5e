"""First in, first out: evict the block that became ready longest ago."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import (
    already_tracked,
    check_count,
    not_tracked,
    take_evictable,
)
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["FIFOPolicy"]


@attrs.define
class FIFOPolicy(EvictionPolicy):
    """Evicts in insertion order; hits change nothing.

    Invariants: ``_queue`` holds exactly the tracked blocks, oldest insertion first.
    """

    _queue: OrderedDict[BlockId, None] = attrs.field(factory=OrderedDict, init=False)

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        if block in self._queue:
            raise already_tracked(self, block)
        self._queue[block] = None

    @override
    def on_access(self, block: BlockId) -> None:
        if block not in self._queue:
            raise not_tracked(self, block)

    @override
    def on_remove(self, block: BlockId) -> None:
        try:
            del self._queue[block]
        except KeyError:
            raise not_tracked(self, block) from None

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        return take_evictable(self._queue, n, is_evictable)

    @override
    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[BlockId]:
        """Tracked blocks from the next victim to the last."""
        return iter(self._queue)

    @override
    def check_invariants(self) -> None:
        """Nothing to check: one ordered dict is the whole state."""
