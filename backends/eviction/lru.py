"""Least-recently-used eviction: the block inserted or hit longest ago goes first."""

from __future__ import annotations

import attrs

from kvkit.backends.eviction._queue import ParkingQueue
from kvkit.backends.eviction.fifo import FIFOPolicy

__all__ = ["LRUPolicy"]


@attrs.define
class LRUPolicy(FIFOPolicy):
    """Evicts the evictable block whose last insert or hit is oldest.

    FIFO's queue with one decision changed: a hit moves the block to the hot
    end (pinned or not). A block in use keeps the place of its last insert or
    hit and is set aside at once (FIFO's pin hooks); released,
    it is evicted where its last use puts it, exactly as if it had never been
    pinned. Hits are what make a block recent, not its release: a pool
    touches the blocks a request hits when it pins them.

    Invariants: every tracked block appears exactly once, in order of its
    last insert or hit; selection changes no order.
    """

    on_access = ParkingQueue.touch
