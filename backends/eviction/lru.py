"""Least-recently-used eviction: the block inserted or hit longest ago goes first."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable, Iterator

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import check_count, not_tracked, take_evictable
from kvkit.errors import PoolUsageError
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["LRUPolicy"]


@attrs.define
class LRUPolicy(EvictionPolicy):
    """Evicts the evictable block whose last insert or hit is oldest.

    Recency lives in one ``OrderedDict`` from the cold end (next victim) to the
    hot end; insert and access both move a block to the hot end. Referenced
    blocks stay tracked in place and are skipped when victims are chosen.

    Invariants: every tracked block appears exactly once; selection changes
    nothing (LRU order only moves on insert, access and remove).
    """

    _order: OrderedDict[BlockId, None] = attrs.field(init=False, factory=OrderedDict)

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        if block in self._order:
            raise PoolUsageError(f"block {block!r} is already tracked by LRUPolicy")
        self._order[block] = None

    @override
    def on_access(self, block: BlockId) -> None:
        try:
            self._order.move_to_end(block)
        except KeyError:
            raise not_tracked(self, block) from None

    @override
    def on_remove(self, block: BlockId) -> None:
        try:
            del self._order[block]
        except KeyError:
            raise not_tracked(self, block) from None

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        return take_evictable(self._order, n, is_evictable)

    @override
    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[BlockId]:
        """Tracked blocks from the cold end (next victim) to the hot end."""
        return iter(self._order)

    @override
    def check_invariants(self) -> None:
        for block in self._order:
            assert operator.index(block) >= 0, f"negative tracked block {block!r}"
