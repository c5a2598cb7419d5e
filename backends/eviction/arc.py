"""Adaptive replacement cache (Megiddo & Modha, FAST'03), driven by a pool."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import (
    LearnsCapacity,
    already_tracked,
    bad_id,
    check_count,
    define_policy,
    not_tracked,
)
from kvkit.backends.eviction._queue import ParkingQueue, QueuedPins
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["ARCPolicy"]


@define_policy
class ARCPolicy(QueuedPins, LearnsCapacity, EvictionPolicy):
    """ARC: balances a recency list ``T1`` and a frequency list ``T2`` with ghost feedback.

    A block enters ``T1`` (seen once) and moves to ``T2`` on its first hit.
    Evicted blocks leave their hash in ghost list ``B1`` (from ``T1``) or
    ``B2`` (from ``T2``). When a hash is inserted again while in a ghost list,
    the block goes straight to ``T2`` and the target size ``p`` of ``T1``
    moves: up after a ``B1`` ghost hit (recency would have helped), down after
    a ``B2`` one. Victims come from ``T1``'s least recent end while ``|T1| > p``,
    otherwise from ``T2``'s, falling back to the other list when one has no
    evictable block. Ghosts are keyed by hash, since a block id is reused for
    other content after eviction; every ``on_remove`` (eviction or reset)
    records a ghost.

    ARC does not decide *when* to evict, the pool does, so the ghost lists
    are bounded as in the paper, ``|T1| + |B1| <= c`` and
    ``|T1| + |T2| + |B1| + |B2| <= 2c``, by dropping their oldest entries.

    Pinned blocks: with the pin hooks (a pool calls them), a block in use
    keeps its place in ``T1`` or ``T2`` (a hit still moves it) and counts
    towards its list's size, and is set aside at once, so no selection meets
    it; released, it is evicted exactly where it would have been had it
    never been in use (:class:`~kvkit.backends.eviction._queue.ParkingQueue`),
    so a selection costs O(victims), its first included, however many blocks
    are in use.

    Args:
        capacity: ``c``, blocks the cache holds (the pool's size). ``None``
            learns it (:class:`~kvkit.backends.eviction._common.LearnsCapacity`).

    Precondition: at most one tracked block per hash (a pool's prefix index
    guarantees it).

    Invariants:
        * ``T1`` and ``T2`` hold exactly the tracked blocks, disjointly;
          ``B1`` and ``B2`` are disjoint and hold no tracked block's hash.
        * ``0 <= p <= c``; the ghost bounds above hold whenever a ghost list
          is non-empty.
    """

    _t1: ParkingQueue = attrs.field(init=False)
    _t2: ParkingQueue = attrs.field(init=False)
    # A tracked block's hash by id (None: untracked): a flat list, the hashes the pool's own objects.
    _hash_of: list[BlockHash | None] = attrs.field(factory=list, init=False)
    _tracked: int = attrs.field(default=0, init=False)
    _b1: OrderedDict[BlockHash, None] = attrs.field(factory=OrderedDict, init=False)
    _b2: OrderedDict[BlockHash, None] = attrs.field(factory=OrderedDict, init=False)
    _p: float = attrs.field(default=0.0, init=False)

    def __attrs_post_init__(self) -> None:
        self._t1, self._t2 = self._new_queue(), self._new_queue()

    @property
    def p(self) -> float:
        """Target size of ``T1``, adapted on ghost hits, in ``[0, c]``."""
        return self._p

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        hash_of = self._hash_of
        if not -1 < block < len(hash_of):
            if block < 0:
                raise bad_id(self, block)
            hash_of.extend([None] * (block + 1 - len(hash_of) + (len(hash_of) >> 3)))
        elif hash_of[block] is not None:
            raise already_tracked(self, block)
        self._tracked += 1
        self._learn(self._tracked)
        hash_of[block] = block_hash
        if block_hash in self._b1:
            self._p = min(self.c, self._p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[block_hash]
            self._t2.add(block)
        elif block_hash in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[block_hash]
            self._t2.add(block)
        else:
            self._t1.add(block)
        self._trim_ghosts()

    @override
    def on_access(self, block: BlockId) -> None:
        if block in self._t1:
            self._t2.add(block, pinned=self._t1.remove(block))
        elif block in self._t2:
            self._t2.touch(block)
        else:
            raise not_tracked(self, block)

    @override
    def on_remove(self, block: BlockId) -> None:
        block_hash = self._hash(block)
        if block_hash is None:
            raise not_tracked(self, block)
        self._hash_of[block] = None
        self._tracked -= 1
        if block in self._t1:
            self._t1.remove(block)
            self._b1[block_hash] = None
        else:
            self._t2.remove(block)
            self._b2[block_hash] = None
        self._trim_ghosts()

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        # The merge takes at most n from each list, so their first n evictable blocks suffice.
        recent, frequent = self._t1.first(n, is_evictable), self._t2.first(n, is_evictable)
        if len(recent) + len(frequent) < n:
            return None
        t1_left = len(self._t1)  # |T1| once the victims chosen so far are gone
        victims: list[BlockId] = []
        r = f = 0
        while len(victims) < n:
            if r < len(recent) and (t1_left > self._p or f == len(frequent)):
                victims.append(recent[r])
                r += 1
                t1_left -= 1
            else:
                victims.append(frequent[f])
                f += 1
        return victims

    @override
    def __len__(self) -> int:
        return self._tracked

    @override
    def check_invariants(self) -> None:
        c = self.c
        t1, t2 = set(self._t1.in_order()), set(self._t2.in_order())
        assert not t1 & t2, "a block is in both T1 and T2"
        hashes = {b: h for b, h in enumerate(self._hash_of) if h is not None}
        assert t1 | t2 == hashes.keys(), "T1 and T2 do not hold exactly the tracked blocks"
        assert len(hashes) == self._tracked, f"{self._tracked} counted, {len(hashes)} tracked"
        self._check_pins()
        assert not self._b1.keys() & self._b2.keys(), "a hash is in both B1 and B2"
        tracked = set(hashes.values())
        ghosts = self._b1.keys() | self._b2.keys()
        assert not tracked & ghosts, f"ghosts hold tracked hashes {tracked & ghosts}"
        assert 0 <= self._p <= c, f"p={self._p} outside [0, {c}]"
        self._check_capacity()
        assert not self._b1 or len(self._t1) + len(self._b1) <= c, "|T1| + |B1| > c"
        assert not ghosts or len(self) + len(ghosts) <= 2 * c, "|T1| + |T2| + |B1| + |B2| > 2c"

    @override
    def _queue_of(self, block: BlockId) -> ParkingQueue:
        if block in self._t1:
            return self._t1
        if block in self._t2:
            return self._t2
        raise not_tracked(self, block)

    def _hash(self, block: BlockId) -> BlockHash | None:
        """A tracked block's hash, else ``None`` (any other value too)."""
        hash_of = self._hash_of
        return hash_of[block] if block.__class__ is int and -1 < block < len(hash_of) else None

    @override
    def _queues(self) -> Iterator[ParkingQueue]:
        return iter((self._t1, self._t2))

    def _trim_ghosts(self) -> None:
        c, b1, b2 = self.c, self._b1, self._b2
        t1 = len(self._t1)  # the tracked lists do not change here: count them once
        while b1 and t1 + len(b1) > c:
            b1.popitem(last=False)
        tracked = t1 + len(self._t2)
        while tracked + len(b1) + len(b2) > 2 * c and (b1 or b2):
            (b2 or b1).popitem(last=False)
