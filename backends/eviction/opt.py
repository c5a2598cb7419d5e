"""Belady's offline optimum: evict the block whose next use is furthest away.

A yardstick, not a policy to deploy: it must be told the whole future.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import attrs
import numpy as np
from typing_extensions import override

from kvkit.backends.eviction._common import (
    already_tracked,
    check_count,
    define_policy,
    hash_already_tracked,
    not_tracked,
    pin_mismatch,
)
from kvkit.errors import PoolUsageError
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import plural

__all__ = ["OptimalPolicy"]


@define_policy(eq=False)
class OptimalPolicy(EvictionPolicy):
    """Belady's MIN: the evictable block used again furthest in the future goes first.

    Built from the reference string: every block hash the driver will look
    up, in trace order, one entry per block per lookup (hits *and* misses).
    The driver advances the policy's clock by calling :meth:`observe` once
    per reference, in that order, *before* it looks the block up (and so
    before any resulting ``on_access``, ``select_victims`` or
    ``on_insert``). A block's next use is then the first position at or after
    the clock where its hash occurs again; a hash that never occurs again is
    infinitely far (ties among those go to the one prioritised earliest).

    Hits need no ``on_access``: :meth:`observe` already moves the block
    holding the observed hash to its next use, so a tier that never sees a
    hit (a CPU tier behind a GPU hit) stays exact. Insertions of hashes not
    in the reference string are never used again.

    Blocks sit in a max-heap on next use with lazy invalidation: each
    tracked block has one live entry (matching its sequence number); stale
    entries are skipped and the heap is rebuilt when they outnumber live ones.

    Pinned blocks: with the pin hooks (a pool calls them), a selection that
    pops the entry of a block in use sets the entry aside instead of pushing
    it back, and :meth:`on_unpin` pushes it back, so a selection costs
    O(victims log n) amortised however many blocks are in use; the victims
    are those of a driver that never pins.

    Precondition: at most one tracked block per hash (a pool's prefix index
    guarantees it); inserting a second block under a tracked hash raises.

    Invariants:
        * Every tracked block has exactly one live entry, in the heap or (a
          pinned block's) set aside, keyed by its next use, which is at or
          after the clock and equal to the first occurrence of its hash from
          the clock on.
        * ``_hash_of`` and ``_block_of`` are inverse maps of the tracked blocks.
    """

    references: Sequence[BlockHash] = attrs.field(converter=tuple, repr=False)
    _codes: np.ndarray = attrs.field(init=False, repr=False)
    _code_of: dict[BlockHash, int] = attrs.field(init=False, repr=False)
    _following: np.ndarray = attrs.field(init=False, repr=False)
    _first: np.ndarray = attrs.field(init=False, repr=False)
    _last_seen: np.ndarray = attrs.field(init=False, repr=False)
    _clock: int = attrs.field(default=0, init=False)
    _hash_of: dict[BlockId, BlockHash] = attrs.field(factory=dict, init=False, repr=False)
    _block_of: dict[BlockHash, BlockId] = attrs.field(factory=dict, init=False, repr=False)
    _next_use: dict[BlockId, int] = attrs.field(factory=dict, init=False, repr=False)
    _live: dict[BlockId, int] = attrs.field(factory=dict, init=False, repr=False)
    _heap: list[tuple[int, int, BlockId]] = attrs.field(factory=list, init=False, repr=False)
    _pinned: set[BlockId] = attrs.field(factory=set, init=False, repr=False)
    # Live entries of pinned blocks that a selection popped: pushed back on unpin.
    _aside: dict[BlockId, tuple[int, int, BlockId]] = attrs.field(factory=dict, init=False, repr=False)
    _seq: int = attrs.field(default=0, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # Dense codes numbered by first appearance, then "next occurrence of
        # the same hash" for every position, vectorised over a stable sort.
        self._code_of = {}
        size = len(self.references)
        self._codes = np.fromiter(
            (self._code_of.setdefault(h, len(self._code_of)) for h in self.references),
            dtype=np.int64, count=size)
        order = np.argsort(self._codes, kind="stable")
        grouped = self._codes[order]
        same = grouped[1:] == grouped[:-1]
        self._following = np.full(size, size, dtype=np.int64)
        self._following[order[:-1][same]] = order[1:][same]
        self._first = order[np.flatnonzero(np.concatenate(([True], ~same)))] if size else order
        self._last_seen = np.full(len(self._code_of), -1, dtype=np.int64)

    @property
    def clock(self) -> int:
        """References observed so far (the position of the next one)."""
        return self._clock

    @property
    def never(self) -> int:
        """The next-use value meaning "never used again" (the trace length)."""
        return len(self.references)

    def observe(self, block_hash: BlockHash) -> None:
        """Advance the clock past the next reference, which must be ``block_hash``.

        Raises:
            PoolUsageError: the trace is exhausted or its next reference differs.
        """
        t = self._clock
        if t >= len(self.references):
            raise PoolUsageError(
                f"observe({block_hash!r}) after all {plural(len(self.references), 'reference')}")
        if self.references[t] != block_hash:
            raise PoolUsageError(
                f"reference {t} is {self.references[t]!r}, observe got {block_hash!r}")
        self._last_seen[self._codes[t]] = t
        self._clock = t + 1
        block = self._block_of.get(block_hash)
        if block is not None:
            self._prioritise(block, int(self._following[t]))

    def next_use(self, block_hash: BlockHash) -> int:
        """First position at or after the clock where ``block_hash`` occurs, else :attr:`never`."""
        code = self._code_of.get(block_hash)
        if code is None:
            return self.never
        last = int(self._last_seen[code])
        return int(self._following[last]) if last >= 0 else int(self._first[code])

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        if block in self._hash_of:
            raise already_tracked(self, block)
        if block_hash in self._block_of:
            raise hash_already_tracked(self, block, block_hash, self._block_of[block_hash])
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        self._prioritise(block, self.next_use(block_hash))

    @override
    def on_access(self, block: BlockId) -> None:
        if block not in self._hash_of:
            raise not_tracked(self, block)

    @override
    def on_remove(self, block: BlockId) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is None:
            raise not_tracked(self, block)
        del self._block_of[block_hash], self._next_use[block], self._live[block]
        self._pinned.discard(block)
        self._aside.pop(block, None)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def on_pin(self, block: BlockId) -> None:
        """A tracked block came into use: a selection that meets its entry sets it aside."""
        if block not in self._hash_of:
            raise not_tracked(self, block)
        if block in self._pinned:
            raise pin_mismatch(self, block, pinned=True)
        self._pinned.add(block)

    def on_unpin(self, block: BlockId) -> None:
        """A pinned block was released: its entry goes back into the heap if it was set aside."""
        if block not in self._hash_of:
            raise not_tracked(self, block)
        if block not in self._pinned:
            raise pin_mismatch(self, block, pinned=False)
        self._pinned.remove(block)
        entry = self._aside.pop(block, None)
        if entry is not None:
            heapq.heappush(self._heap, entry)

    @property
    def pinned(self) -> frozenset[BlockId]:
        """Blocks between :meth:`on_pin` and :meth:`on_unpin` (or removal)."""
        return frozenset(self._pinned)

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        popped, victims = [], []
        pinned, aside = self._pinned, self._aside
        while self._heap and len(victims) < n:
            entry = heapq.heappop(self._heap)
            if self._live.get(entry[2]) != entry[1]:
                continue  # stale: dropping it changes no decision
            if entry[2] in pinned:
                aside[entry[2]] = entry  # not selectable until released: out of later walks
                continue
            popped.append(entry)
            if is_evictable(entry[2]):
                victims.append(entry[2])
        for entry in popped:  # victims stay tracked until the pool removes them
            heapq.heappush(self._heap, entry)
        return victims if len(victims) == n else None

    @override
    def __len__(self) -> int:
        return len(self._hash_of)

    @override
    def check_invariants(self) -> None:
        assert self._clock <= len(self.references), "clock ran past the trace"
        assert len(self._block_of) == len(self._hash_of), "hash map and block map differ in size"
        assert all(self._block_of.get(h) == b for b, h in self._hash_of.items()), \
            "hash map and block map disagree"
        assert self._live.keys() == self._next_use.keys() == self._hash_of.keys(), \
            "heap bookkeeping drifted from the tracked blocks"
        assert self._pinned <= self._hash_of.keys(), "a pinned block is not tracked"
        assert self._aside.keys() <= self._pinned, "an entry is set aside for a block not in use"
        live = [e for e in (*self._heap, *self._aside.values()) if self._live.get(e[2]) == e[1]]
        assert sorted(e[2] for e in live) == sorted(self._live), "not one live entry per block"
        for neg_use, _, block in live:
            expected = self.next_use(self._hash_of[block])
            assert -neg_use == self._next_use[block] == expected, \
                f"block {block} keyed {-neg_use}, next use is {expected}"
            assert expected >= self._clock, f"block {block} next use {expected} is past"

    def _prioritise(self, block: BlockId, use: int) -> None:
        self._aside.pop(block, None)  # the entry set aside is stale from now on
        self._seq += 1
        self._next_use[block] = use
        self._live[block] = self._seq
        heapq.heappush(self._heap, (-use, self._seq, block))
