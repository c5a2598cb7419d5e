"""Least-recently-used eviction: the block inserted or hit longest ago goes first."""

from __future__ import annotations

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import not_tracked
from kvkit.backends.eviction.fifo import FIFOPolicy
from kvkit.interfaces.types import BlockId

__all__ = ["LRUPolicy"]


@attrs.define
class LRUPolicy(FIFOPolicy):
    """Evicts the evictable block whose last insert or hit is oldest.

    FIFO's queue with one decision changed: a hit moves the block to the hot
    end. Referenced blocks stay tracked in place and are skipped when victims
    are chosen.

    Invariants: every tracked block appears exactly once; selection changes
    nothing (the order only moves on insert, access and remove).
    """

    @override
    def on_access(self, block: BlockId) -> None:
        try:
            self._queue.move_to_end(block)
        except KeyError:
            raise not_tracked(self, block) from None
