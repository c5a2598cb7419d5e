"""LIRS (Jiang & Zhang, SIGMETRICS'02): keeps the blocks whose reuse distance is short, driven by a pool."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import islice

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import (
    LearnsCapacity,
    already_tracked,
    bad_id,
    check_count,
    define_policy,
    hash_already_tracked,
    not_tracked,
)
from kvkit.backends.eviction._queue import ParkingQueue, QueuedPins
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import plural, real_in

__all__ = ["LIRSPolicy"]


@define_policy
class LIRSPolicy(QueuedPins, LearnsCapacity, EvictionPolicy):
    """LIRS: ranks blocks by their last inter-reference recency (IRR), not their last use.

    A block is *LIR* (low IRR: kept) or *HIR* (high IRR: on probation). The
    recency stack ``S`` (hashes, least recent first) holds every LIR block,
    the HIR blocks referenced since the least recent LIR block, and *ghosts*:
    hashes of blocks that left the pool while in ``S``. The queue ``Q``
    holds the resident HIR blocks; victims come from its old end, and only
    when it has too few evictable blocks from the LIR blocks, least recent
    first. ``S`` is *pruned*: its bottom is always an LIR block, so a hash in
    ``S`` was referenced more recently than some LIR block, which is what makes
    its IRR low enough to compete.

    * A new block is LIR while fewer than ``c - h`` blocks are (``h``: the HIR
      share, ``hir_ratio`` of ``c``, at least 1), else resident HIR. A hash
      returning as a ghost was re-referenced within the LIR set's span: it
      enters as LIR.
    * A hit on an HIR block still in ``S`` makes it LIR; a hit on one not in
      ``S`` moves it to ``Q``'s young end. Either way it goes to ``S``'s top.
    * Whenever more than ``c - h`` blocks are LIR (provisional ones aside, below),
      the bottom one is demoted to ``Q``'s young end and leaves ``S`` (then
      ``S`` is pruned).
    * A block the pool removes leaves a ghost if its hash is in ``S``. Ghosts
      are bounded as in libCacheSim: ``S`` holds at most ``2c`` entries while
      it holds a ghost, the ghosts that left first going first.

    Learning the capacity: until the pool fills, a policy without ``capacity``
    cannot tell when the LIR set is full, so every block it admits while its
    high-water mark rises is LIR, *provisionally*. Once ``c`` is known, the
    blocks over the limit are the ones admitted last (with ``capacity``
    given they would have been HIR): they are the first victims, and the
    first removal demotes those left to ``Q``, oldest first. A policy told
    ``capacity`` never admits provisionally.

    That demotion is *pending* until a call meets the block: the removal
    reserves each block's place at ``Q``'s young end, in order (a stamp,
    :meth:`~kvkit.backends.eviction._queue.ParkingQueue.reserve`), and counts
    it out of the LIR set at once; the block moves to its reserved place
    when a hook names it or a selection reaches it (selections demote the
    pending blocks in order until they have the victims they need). Every
    decision is the one an immediate demotion would make, and no call
    demotes more blocks than it meets.

    Pinned blocks: with the pin hooks (a pool calls them), a block in use keeps
    its place in its list (a hit still moves it) and is set aside at once
    (:class:`~kvkit.backends.eviction._queue.ParkingQueue`), so no selection
    meets it. Every step is O(1) amortised: pruning pops each entry of
    ``S`` at most once per reference, and a pending demotion is carried out
    once, by the call that meets its block. Learning ``c`` adds C-level
    work only: the first removal after a learned fill lists the provisional
    excess, ``hir_ratio`` of the pool, and forgets the provisional marks; the
    first selection before it asks ``is_evictable`` of the excess blocks in
    order until it has its victims.

    Args:
        capacity: ``c``, blocks the cache holds (the pool's size). ``None``
            learns it (:class:`~kvkit.backends.eviction._common.LearnsCapacity`).
        hir_ratio: the HIR share of ``c`` (0.01 in the paper and libCacheSim).

    Precondition: at most one tracked block per hash (a pool's prefix index
    guarantees it).

    Invariants:
        * The LIR and HIR lists hold exactly the tracked blocks, disjointly; at
          most ``c - h`` are LIR besides the provisional ones, which are LIR
          and exist only while the capacity is learned. The LIR blocks are
          those of the LIR list not pending demotion; each pending one keeps
          a reserved stamp of ``Q``'s, the pending in ascending order, none
          provisional.
        * ``S`` holds every LIR block's hash; its bottom is an LIR block's;
          its other entries are resident HIR blocks' hashes or ghosts. Ghosts
          are exactly the entries of ``S`` no tracked block has.
    """

    hir_ratio: float = attrs.field(default=0.01, validator=real_in(
        low=0, high=1, low_open=True, high_open=True, label="LIRSPolicy."))
    _lir: ParkingQueue = attrs.field(init=False)
    _hir: ParkingQueue = attrs.field(init=False)
    _stack: OrderedDict[BlockHash, None] = attrs.field(factory=OrderedDict, init=False)
    _ghosts: OrderedDict[BlockHash, None] = attrs.field(factory=OrderedDict, init=False)
    _hash_of: dict[BlockId, BlockHash] = attrs.field(factory=dict, init=False)
    _block_of: dict[BlockHash, BlockId] = attrs.field(factory=dict, init=False)
    _provisional: dict[BlockId, None] = attrs.field(factory=dict, init=False)  # admitted while c rose
    # Blocks of the LIR list demoted to Q, not moved yet: block -> its reserved stamp in Q, in demotion order.
    _demoting: OrderedDict[BlockId, int] = attrs.field(factory=OrderedDict, init=False)

    def __attrs_post_init__(self) -> None:
        self._lir, self._hir = self._new_queue(), self._new_queue()

    @property
    def lir(self) -> frozenset[BlockId]:
        """The LIR blocks."""
        return frozenset(self._lir.in_order()).difference(self._demoting)

    @property
    def lir_limit(self) -> int:
        """``c - h``: the most blocks that are LIR at once."""
        return max(0, self.c - max(1, round(self.hir_ratio * self.c)))

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        if block in self._hash_of:
            raise already_tracked(self, block)
        if block < 0:  # its queue's flat state would refuse it after this policy's own maps changed
            raise bad_id(self, block)
        holder = self._block_of.get(block_hash)
        if holder is not None:
            raise hash_already_tracked(self, block, block_hash, holder)
        rising = self.capacity is None and len(self._hash_of) >= self.c
        self._learn(len(self._hash_of) + 1)
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        returning = block_hash in self._ghosts
        if returning:
            del self._ghosts[block_hash]
        if rising:
            self._provisional[block] = None
        if returning or rising or self._num_lir() < self.lir_limit:
            self._lir.add(block)
        else:
            self._hir.add(block)
        self._to_top(block_hash)
        if returning:
            self._balance()

    @override
    def on_access(self, block: BlockId) -> None:
        block_hash = self._hash_of.get(block)
        if block_hash is None:
            raise not_tracked(self, block)
        if self._demoting:
            self._settle(block)
        promoted = block not in self._lir and block_hash in self._stack
        if promoted:
            self._lir.add(block, pinned=self._hir.remove(block))
        else:
            (self._lir if block in self._lir else self._hir).touch(block)
        self._to_top(block_hash)
        if promoted:
            self._balance()

    @override
    def on_remove(self, block: BlockId) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is None:
            raise not_tracked(self, block)
        del self._block_of[block_hash]
        self._provisional.pop(block, None)
        if self._demoting:
            self._settle(block)
        (self._lir if block in self._lir else self._hir).remove(block)
        if block_hash in self._stack:
            self._ghosts[block_hash] = None
            self._prune()
            self._limit_stack()
        extra = self._over_limit()
        if extra:  # c is known now: the provisional excess joins Q, each block when a call meets it
            first = self._hir.reserve(len(extra))
            self._demoting.update(zip(extra, range(first, first + len(extra))))
            self._prune()
        self._provisional.clear()

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        victims = list(islice(filter(is_evictable, self._over_limit()), n))
        if self._demoting:
            self._demote_until(n - len(victims), is_evictable)
        victims += self._hir.first(n - len(victims), is_evictable)
        if len(victims) < n:
            chosen = set(victims)
            lir = self._lir.first(n - len(victims) + len(chosen), is_evictable)
            victims += [b for b in lir if b not in chosen][:n - len(victims)]
        return victims if len(victims) == n else None

    @override
    def __len__(self) -> int:
        return len(self._hash_of)

    @override
    def check_invariants(self) -> None:
        listed, hir = set(self._lir.in_order()), set(self._hir.in_order())
        assert not listed & hir, "a block is both in the LIR and the HIR list"
        assert listed | hir == self._hash_of.keys(), "the LIR and HIR lists do not hold the tracked blocks"
        assert self._demoting.keys() <= listed, "a block pending demotion is not in the LIR list"
        assert not self._demoting.keys() & self._provisional.keys(), "a block pending demotion is provisional"
        stamps = list(self._demoting.values())
        assert stamps == sorted(set(stamps)), "pending demotions out of stamp order"
        lir = listed - self._demoting.keys()
        assert all(self._block_of[h] == b for b, h in self._hash_of.items()), "hash maps drifted"
        assert len(self._block_of) == len(self._hash_of), "hash maps differ in size"
        self._check_pins()
        assert self._provisional.keys() <= lir, "a provisional block is not LIR"
        assert len(lir) - len(self._provisional) <= self.lir_limit, \
            f"{plural(len(lir), 'LIR block')}, {len(self._provisional)} provisional, over {self.lir_limit}"
        assert not self._provisional or self.capacity is None, "provisional blocks with a capacity given"
        stack = self._stack
        assert all(self._hash_of[b] in stack for b in lir), "an LIR block is not in S"
        assert not stack or self._block_of.get(next(iter(stack))) in lir, "S's bottom is not LIR"
        ghosts = {h for h in stack if h not in self._block_of}
        assert ghosts == self._ghosts.keys(), "ghosts are not S's untracked entries"
        assert not ghosts or len(stack) <= 2 * self.c, "S holds a ghost beyond 2c entries"
        self._check_capacity()

    @override
    def _queue_of(self, block: BlockId) -> ParkingQueue:
        """The queue holding ``block`` (a pending demotion is carried out first: a pin hook meets it)."""
        if self._demoting:
            self._settle(block)
        if block in self._lir:
            return self._lir
        if block in self._hash_of:
            return self._hir
        raise not_tracked(self, block)

    @override
    def _queues(self) -> Iterator[ParkingQueue]:
        return iter((self._lir, self._hir))

    def _to_top(self, block_hash: BlockHash) -> None:
        """Put ``block_hash`` on ``S``'s top (pruning, if it was the bottom)."""
        stack = self._stack
        stack[block_hash] = None
        stack.move_to_end(block_hash)
        self._prune()
        self._limit_stack()

    def _num_lir(self) -> int:
        """How many blocks are LIR (the LIR list less its blocks pending demotion)."""
        return len(self._lir) - len(self._demoting)

    def _settle(self, block: BlockId) -> None:
        """Move ``block`` to its reserved place in ``Q`` if its demotion is pending."""
        stamp = self._demoting.pop(block, None)
        if stamp is not None:
            self._demote_at(block, stamp)

    def _demote_at(self, block: BlockId, stamp: int) -> bool:
        """Move ``block`` from the LIR list to its reserved place ``stamp`` in ``Q``; return whether it is pinned."""
        pinned = self._lir.remove(block)
        self._hir.enter_at(block, stamp, pinned)
        return pinned

    def _demote_until(self, n: int, is_evictable: Callable[[BlockId], bool]) -> None:
        """Carry out pending demotions in order until ``n`` of the blocks moved may be evicted, or none is left.

        ``Q``'s first ``n`` evictable blocks are then the same as with every demotion done: the rest
        of the pending blocks have younger places than these.
        """
        demoting, found = self._demoting, 0
        while demoting and found < n:
            block, stamp = demoting.popitem(last=False)
            found += not self._demote_at(block, stamp) and is_evictable(block)

    def _balance(self) -> None:
        """Demote the bottom LIR blocks to ``Q`` while more than ``c - h`` are LIR, the provisional ones aside."""
        while self._num_lir() > self.lir_limit + len(self._provisional):
            block = self._block_of[self._stack.popitem(last=False)[0]]  # pruned: the bottom is LIR
            self._provisional.pop(block, None)
            self._hir.add(block, pinned=self._lir.remove(block))
            self._prune()

    def _over_limit(self) -> list[BlockId]:
        """The provisional LIR blocks beyond ``c - h``: the ones admitted last, oldest first."""
        excess = self._num_lir() - self.lir_limit
        if excess <= 0 or not self._provisional:
            return []
        last = list(islice(reversed(self._provisional), excess))
        return last[::-1]

    def _prune(self) -> None:
        """Pop ``S``'s bottom entries until an LIR block's hash is at the bottom."""
        stack, block_of, lir, demoting = self._stack, self._block_of, self._lir, self._demoting
        while stack:
            block_hash = next(iter(stack))
            block = block_of.get(block_hash)
            if block is not None and block in lir and not (demoting and block in demoting):
                return
            stack.popitem(last=False)
            if block is None:
                del self._ghosts[block_hash]

    def _limit_stack(self) -> None:
        """Drop the oldest ghosts while ``S`` holds more than ``2c`` entries."""
        limit, ghosts = 2 * self.c, self._ghosts
        while ghosts and len(self._stack) > limit:
            del self._stack[ghosts.popitem(last=False)[0]]
