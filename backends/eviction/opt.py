"""Belady's offline optimum: evict the block whose next use is furthest away.

A yardstick, not a policy to deploy: it must be told the whole future. It is
optimal for plain hits; under the prefix hit rule (a block hits only while its
whole chain does) it is no bound: a pool too small for a chain may do better
keeping the chain's head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice

import attrs
import numpy as np
from sortedcontainers import SortedList
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

    Each unpinned block has one key, ``(-next use, sequence number, block)``,
    in a sorted list (furthest next use first, ties to the one prioritised
    earliest); a new next use replaces the key.

    Pinned blocks: with the pin hooks (a pool calls them), a block in use
    leaves the sorted list at once and :meth:`on_unpin` puts its key back, so
    a selection costs O(victims + log n), its first included, however many
    blocks are in use; the victims are those of a driver that never pins.

    Precondition: at most one tracked block per hash (a pool's prefix index
    guarantees it); inserting a second block under a tracked hash raises.

    Invariants:
        * Every tracked block has exactly one key, in the sorted list unless
          it is pinned, keyed by its next use, which is at or after the clock
          and equal to the first occurrence of its hash from the clock on.
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
    _key: dict[BlockId, tuple[int, int, BlockId]] = attrs.field(factory=dict, init=False, repr=False)
    _order: SortedList = attrs.field(factory=SortedList, init=False, repr=False)  # keys of unpinned blocks
    _pinned: set[BlockId] = attrs.field(factory=set, init=False, repr=False)
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
        del self._block_of[block_hash]
        key = self._key.pop(block)
        if block in self._pinned:
            self._pinned.remove(block)
        else:
            self._order.remove(key)

    def on_pin(self, block: BlockId) -> None:
        """A tracked block came into use: its key leaves the sorted list."""
        if block not in self._hash_of:
            raise not_tracked(self, block)
        if block in self._pinned:
            raise pin_mismatch(self, block, pinned=True)
        self._pinned.add(block)
        self._order.remove(self._key[block])

    def on_unpin(self, block: BlockId) -> None:
        """A pinned block was released: its key goes back into the sorted list."""
        if block not in self._hash_of:
            raise not_tracked(self, block)
        if block not in self._pinned:
            raise pin_mismatch(self, block, pinned=False)
        self._pinned.remove(block)
        self._order.add(self._key[block])

    @property
    def pinned(self) -> frozenset[BlockId]:
        """Blocks between :meth:`on_pin` and :meth:`on_unpin` (or removal)."""
        return frozenset(self._pinned)

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        victims = list(islice((key[2] for key in self._order if is_evictable(key[2])), n))
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
        assert self._key.keys() == self._hash_of.keys(), "keys drifted from the tracked blocks"
        assert self._pinned <= self._hash_of.keys(), "a pinned block is not tracked"
        unpinned = [key for block, key in self._key.items() if block not in self._pinned]
        assert sorted(unpinned) == list(self._order), "the sorted list holds other keys than the unpinned blocks'"
        for block, (neg_use, _, keyed) in self._key.items():
            expected = self.next_use(self._hash_of[block])
            assert keyed == block and -neg_use == expected, f"block {block} keyed {-neg_use}, next use is {expected}"
            assert expected >= self._clock, f"block {block} next use {expected} is past"

    def _prioritise(self, block: BlockId, use: int) -> None:
        self._seq += 1
        key = (-use, self._seq, block)
        old = self._key.get(block)
        self._key[block] = key
        if block not in self._pinned:
            if old is not None:
                self._order.remove(old)
            self._order.add(key)
