"""Adaptive replacement cache (Megiddo & Modha, FAST'03), driven by a pool."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import LearnsCapacity, already_tracked, check_count, not_tracked
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["ARCPolicy"]


@attrs.define
class ARCPolicy(LearnsCapacity, EvictionPolicy):
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

    _t1: OrderedDict[BlockId, BlockHash] = attrs.field(factory=OrderedDict, init=False)
    _t2: OrderedDict[BlockId, BlockHash] = attrs.field(factory=OrderedDict, init=False)
    _b1: OrderedDict[BlockHash, None] = attrs.field(factory=OrderedDict, init=False)
    _b2: OrderedDict[BlockHash, None] = attrs.field(factory=OrderedDict, init=False)
    _p: float = attrs.field(default=0.0, init=False)

    @property
    def p(self) -> float:
        """Target size of ``T1``, adapted on ghost hits, in ``[0, c]``."""
        return self._p

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        if block in self._t1 or block in self._t2:
            raise already_tracked(self, block)
        self._learn(len(self) + 1)
        if block_hash in self._b1:
            self._p = min(self.c, self._p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[block_hash]
            self._t2[block] = block_hash
        elif block_hash in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[block_hash]
            self._t2[block] = block_hash
        else:
            self._t1[block] = block_hash
        self._trim_ghosts()

    @override
    def on_access(self, block: BlockId) -> None:
        if block in self._t1:
            self._t2[block] = self._t1.pop(block)
        elif block in self._t2:
            self._t2.move_to_end(block)
        else:
            raise not_tracked(self, block)

    @override
    def on_remove(self, block: BlockId) -> None:
        if block in self._t1:
            self._b1[self._t1.pop(block)] = None
        elif block in self._t2:
            self._b2[self._t2.pop(block)] = None
        else:
            raise not_tracked(self, block)
        self._trim_ghosts()

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        recent = filter(is_evictable, self._t1)
        frequent = filter(is_evictable, self._t2)
        next_recent, next_frequent = next(recent, None), next(frequent, None)
        t1_left = len(self._t1)  # |T1| once the victims chosen so far are gone
        victims = []
        while len(victims) < n:
            if next_recent is not None and (t1_left > self._p or next_frequent is None):
                victims.append(next_recent)
                t1_left -= 1
                next_recent = next(recent, None)
            elif next_frequent is not None:
                victims.append(next_frequent)
                next_frequent = next(frequent, None)
            else:
                return None
        return victims

    @override
    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    @override
    def check_invariants(self) -> None:
        c = self.c
        assert not self._t1.keys() & self._t2.keys(), "a block is in both T1 and T2"
        assert not self._b1.keys() & self._b2.keys(), "a hash is in both B1 and B2"
        tracked = set(self._t1.values()) | set(self._t2.values())
        ghosts = self._b1.keys() | self._b2.keys()
        assert not tracked & ghosts, f"ghosts hold tracked hashes {tracked & ghosts}"
        assert 0 <= self._p <= c, f"p={self._p} outside [0, {c}]"
        self._check_capacity()
        assert not self._b1 or len(self._t1) + len(self._b1) <= c, "|T1| + |B1| > c"
        assert not ghosts or len(self) + len(ghosts) <= 2 * c, "|T1| + |T2| + |B1| + |B2| > 2c"

    def _trim_ghosts(self) -> None:
        c = self.c
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self) + len(self._b1) + len(self._b2) > 2 * c and (self._b1 or self._b2):
            (self._b2 or self._b1).popitem(last=False)
