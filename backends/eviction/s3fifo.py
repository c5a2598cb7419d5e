"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import chain

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import (
    LearnsCapacity,
    already_tracked,
    check_count,
    define_policy,
    move_pinned,
    not_tracked,
    take_evictable,
)
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import real_in

__all__ = ["S3FIFOPolicy"]

_MAX_FREQ = 3  # two bits per block, as in the paper


@define_policy
class S3FIFOPolicy(LearnsCapacity, EvictionPolicy):
    """S3-FIFO: new blocks are probationary; only reused ones earn a place in main.

    A new block enters the small queue ``S``, or the main queue ``M`` if its
    hash is in the ghost queue ``G``. Each hit raises the block's frequency,
    capped at 3. Victims come from ``S`` while it holds at least its target
    share of the cache (``small_ratio`` of ``c``), else from ``M``:

    * from ``S``'s oldest end, a block hit at least once is promoted to ``M``
      with frequency 0; an unhit one (a one-hit wonder) is the victim and its
      hash enters ``G`` when the pool removes it;
    * from ``M``'s oldest end, a block with frequency > 0 is reinserted at the
      new end with frequency - 1; one with frequency 0 is the victim.

    Promotions and reinsertions happen only inside a successful
    :meth:`select_victims` (it first checks that ``n`` evictable blocks
    exist, and changes nothing otherwise). A block that may not be evicted
    now or is already chosen is rotated to its queue's new end, like a block
    in use. ``G`` holds hashes, as block ids are reused, and at most
    ``c - small target`` of them (the paper sizes it like ``M``); it forgets
    the oldest first.

    Pinned blocks: with the pin hooks (a pool calls them), a block in use
    leaves its queue's order on :meth:`on_pin` and is set aside, keeping its
    frequency and its queue, so selections never scan it; it still counts
    towards its queue's size, and hits still raise its frequency. On
    :meth:`on_unpin` it re-enters at its queue's new end, as a block just
    used (where a scan would have rotated it). A driver that never pins
    gets the scanning behaviour above.

    Args:
        capacity: ``c``, blocks the cache holds (the pool's size). ``None``
            learns it (:class:`~kvkit.backends.eviction._common.LearnsCapacity`).
        small_ratio: target share of ``S`` (0.1 in the paper).

    Invariants:
        * ``S``, ``M`` and the pinned blocks set aside from each hold exactly
          the tracked blocks, disjointly; every tracked block has a frequency
          in ``[0, 3]``.
        * ``G`` holds no tracked block's hash and at most its limit of entries.
    """

    small_ratio: float = attrs.field(default=0.1, validator=real_in(low=0, high=1, low_open=True, high_open=True,
                                                                    label="S3FIFOPolicy."))
    _small: OrderedDict[BlockId, BlockHash] = attrs.field(factory=OrderedDict, init=False)
    _main: OrderedDict[BlockId, BlockHash] = attrs.field(factory=OrderedDict, init=False)
    _freq: dict[BlockId, int] = attrs.field(factory=dict, init=False)
    # Pinned blocks set aside from S and from M (block -> hash), in pin order.
    _pinned_small: dict[BlockId, BlockHash] = attrs.field(factory=dict, init=False)
    _pinned_main: dict[BlockId, BlockHash] = attrs.field(factory=dict, init=False)
    _ghost: OrderedDict[BlockHash, None] = attrs.field(factory=OrderedDict, init=False)

    @property
    def small(self) -> tuple[BlockId, ...]:
        """Blocks of the small queue, oldest first (pinned ones set aside excluded)."""
        return tuple(self._small)

    @property
    def main(self) -> tuple[BlockId, ...]:
        """Blocks of the main queue, oldest first (pinned ones set aside excluded)."""
        return tuple(self._main)

    @property
    def pinned(self) -> tuple[BlockId, ...]:
        """Blocks set aside by :meth:`on_pin`, those of the small queue first, each in pin order."""
        return (*self._pinned_small, *self._pinned_main)

    @property
    def ghost(self) -> tuple[BlockHash, ...]:
        """Hashes of the ghost queue, oldest first."""
        return tuple(self._ghost)

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        if block in self._freq:
            raise already_tracked(self, block)
        self._learn(len(self) + 1)
        if block_hash in self._ghost:
            del self._ghost[block_hash]
            self._main[block] = block_hash
        else:
            self._small[block] = block_hash
        self._freq[block] = 0

    @override
    def on_access(self, block: BlockId) -> None:
        f = self._freq.get(block)
        if f is None:
            raise not_tracked(self, block)
        self._freq[block] = min(f + 1, _MAX_FREQ)

    @override
    def on_remove(self, block: BlockId) -> None:
        if self._freq.pop(block, None) is None:
            raise not_tracked(self, block)
        block_hash = self._small.pop(block, None)
        if block_hash is None:
            block_hash = self._pinned_small.pop(block, None)
        if block_hash is not None:
            self._ghost[block_hash] = None
            while len(self._ghost) > self._ghost_limit():
                self._ghost.popitem(last=False)
        elif self._main.pop(block, None) is None:
            del self._pinned_main[block]

    def on_pin(self, block: BlockId) -> None:
        """Set a tracked block in use aside, keeping its queue and frequency."""
        sides = ((self._small, self._pinned_small), (self._main, self._pinned_main))
        move_pinned(self, block, sides, pinned=True)

    def on_unpin(self, block: BlockId) -> None:
        """Put a pinned block back at its queue's new end, as a block just used."""
        sides = ((self._pinned_small, self._small), (self._pinned_main, self._main))
        move_pinned(self, block, sides, pinned=False)

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        if take_evictable(chain(self._small, self._main), n, is_evictable) is None:
            return None
        victims: list[BlockId] = []
        chosen: set[BlockId] = set()
        chosen_small = 0
        while len(victims) < n:
            # Small first while it holds its share; a pass over S can move its
            # last candidates into M, hence M is tried again after it.
            if len(self._small) + len(self._pinned_small) - chosen_small >= self._small_target():
                steps: tuple[Callable[[Callable[[BlockId], bool], set[BlockId]], BlockId | None], ...] = (
                    self._evict_small, self._evict_main)
            else:
                steps = (self._evict_main, self._evict_small, self._evict_main)
            victim = None
            for step in steps:
                victim = step(is_evictable, chosen)
                if victim is not None:
                    break
            assert victim is not None, "S3-FIFO lost an evictable block it had counted"
            chosen_small += victim in self._small
            chosen.add(victim)
            victims.append(victim)
        return victims

    @override
    def __len__(self) -> int:
        return len(self._freq)

    @override
    def check_invariants(self) -> None:
        parts = (self._small, self._main, self._pinned_small, self._pinned_main)
        assert sum(map(len, parts)) == len(self._freq) and self._freq.keys() == \
            self._small.keys() | self._main.keys() | self._pinned_small.keys() | \
            self._pinned_main.keys(), "S, M and the pinned blocks do not split the tracked blocks"
        assert all(0 <= f <= _MAX_FREQ for f in self._freq.values()), "frequency out of [0, 3]"
        tracked = {h for part in parts for h in part.values()}
        assert not tracked & self._ghost.keys(), \
            f"ghost holds tracked hashes {tracked & self._ghost.keys()}"
        assert len(self._ghost) <= self._ghost_limit(), "ghost queue over its limit"
        self._check_capacity()

    def _small_target(self) -> int:
        return max(1, round(self.small_ratio * self.c))

    def _ghost_limit(self) -> int:
        return max(0, self.c - self._small_target())

    def _evict_small(self, is_evictable: Callable[[BlockId], bool],
                     chosen: set[BlockId]) -> BlockId | None:
        """Next victim from ``S``, promoting hit blocks to ``M`` on the way; ``None`` if none."""
        skipped = 0
        while skipped < len(self._small):
            block = next(iter(self._small))
            if block in chosen or not is_evictable(block):
                self._small.move_to_end(block)
                skipped += 1
            elif self._freq[block] > 0:
                self._main[block] = self._small.pop(block)
                self._freq[block] = 0
            else:
                self._small.move_to_end(block)  # leaves S when the pool removes it
                return block
        return None

    def _evict_main(self, is_evictable: Callable[[BlockId], bool],
                    chosen: set[BlockId]) -> BlockId | None:
        """Next victim from ``M``, reinserting hit blocks with one hit less; ``None`` if none."""
        skipped = 0
        while skipped < len(self._main):
            block = next(iter(self._main))
            if block in chosen or not is_evictable(block):
                self._main.move_to_end(block)
                skipped += 1
            elif self._freq[block] > 0:
                self._freq[block] -= 1
                self._main.move_to_end(block)
                skipped = 0
            else:
                self._main.move_to_end(block)
                return block
        return None
