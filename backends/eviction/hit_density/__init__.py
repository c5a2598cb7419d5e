"""Prefix-aware hit-density eviction: keep the blocks that earn the most hits for their space."""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator

import attrs
import numpy as np
from typing_extensions import override

from kvkit.backends.eviction._chains import ChainIndex
from kvkit.backends.eviction._common import LearnsCapacity, check_count, define_policy, not_tracked, pin_mismatch
from kvkit.backends.eviction.hit_density.census import Census
from kvkit.backends.eviction.hit_density.density import HitDensityModel
from kvkit.backends.eviction.hit_density.shift import ShiftTest
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import real_in

__all__ = ["LEAF", "PARENT", "REUSE_LEVELS", "TIP", "HitDensityPolicy", "block_class", "reuse_level"]

LEAF, PARENT, TIP = 0, 1, 2
"""A block's *kind*: its hash never had a cached child; it had one; it is the block stored last,
which the next store may still continue (the only tip at any time)."""
_KINDS = 3
REUSE_LEVELS = (0, 1, 2, 3, 4, 8, 16)
"""The least reuse count of each reuse level: counts 0-3 one level each (S3-FIFO's two bits), then
4-7, 8-15 and 16 or more (how often a block is wanted, to within a factor of two)."""
_CLASSES = _KINDS * len(REUSE_LEVELS)
_MIN_REFRESH = 64  # ticks between two refreshes while the pool is still tiny
_MIN_MEMORY = 4096  # ticks of history the model weighs at least, once the pool's size is known
_CENSUS_LIMIT = 1 << 18  # entries a refresh reads at most per census (beyond: an evenly strided sample)


def reuse_level(uses: int) -> int:
    """The reuse level of a block hit ``uses`` times: the index of the last ``REUSE_LEVELS`` entry <= ``uses``."""
    return bisect.bisect_right(REUSE_LEVELS, uses) - 1


_TOP = REUSE_LEVELS[-1]
# The class of every (uses, kind), uses capped at the last level's least count: a table read per call.
_CLASS_OF = tuple(tuple(_KINDS * reuse_level(uses) + kind for kind in range(_KINDS)) for uses in range(_TOP + 1))


def block_class(uses: int, kind: int) -> int:
    """The class of a block hit ``uses`` (>= 0) times, of kind ``LEAF``, ``PARENT`` or ``TIP`` (``False``
    and ``True`` read as leaf and parent)."""
    return _CLASS_OF[uses if uses < _TOP else _TOP][kind]


# Per kind, the classes by reuse level: a block reused more is never valued below one reused less
# (the model fits each age's densities to this order).
_BY_USES = tuple(tuple(block_class(uses, kind) for uses in REUSE_LEVELS) for kind in (LEAF, PARENT, TIP))


@define_policy
class HitDensityPolicy(LearnsCapacity, EvictionPolicy):
    """Evicts the block expected to earn the fewest hits per unit of cache space, leaves first.

    Why: on multi-turn chat traces most blocks are never referenced again
    (single-turn chats, the partial last block of every prompt), and the
    blocks that are come back only after the user's think time, much later
    than a recency list keeps them. The offline optimum wins by dropping the
    first kind at once and holding the second for as long as needed. This
    policy learns online which blocks look like which, from what a pool
    knows when it evicts:

    * **Class** of a block: its reuse level (``REUSE_LEVELS``: counts 0, 1,
      2, 3, then 4-7, 8-15, 16+: a turn of a conversation that already came
      back is likelier to come back again, shared heads such as system
      prompts are hit constantly, and where popularity holds still, a
      template wanted 40 times is worth more than one wanted 4 times, which
      a last level of "3 or more" cannot tell apart) and its kind:
      a *parent* if its hash ever had a cached child, a *leaf* if not
      (the last block of a prompt never does, and it is almost never reused,
      since the next turn's block at that position holds more tokens), and
      the *tip* while it is the block stored last, until the next store shows
      which of the two it is. A tip is what a selection during a prompt's
      stores weighs against the cache: valued as a leaf, it made the policy
      evict each new block as the next one arrived, on evidence about prompt
      ends rather than about new prompts. The tip
      classes learn from the tips evicted (their ghosts' returns), so they
      price admitting a new chain; without that evidence yet they borrow the
      pooled density. The reuse count survives eviction
      through the ghost, so a conversation that returns keeps its history.
      A hash back from the ghost within one *turnover* (the ticks the pool
      takes to replace a pool's worth of blocks: c times the recent mean gap
      between removals, counted from the first removal on, since the fill
      before it is no gap) counts one use more: an LRU cache of this size
      would still have held it, so the eviction was the policy's own
      misjudgement, and without the extra use a template that became popular would have
      to miss a third time before it reached the class worth keeping (as
      ARC's and S3-FIFO's ghost hits, and LIRS's short reuse distances,
      promote on the second sighting).
    * **Age**: ticks (block references) since its last insert or hit.
    * **Hit density** of a (class, age): the hits a block still earns per
      unit of space-time if kept to its best horizon, estimated from reuse
      and eviction statistics by :class:`~kvkit.backends.eviction.hit_density.density.HitDensityModel`
      and refreshed about once per pool's worth of references. Each refresh
      weighs past observations by ``1 - 1 / ghost_span``, so the model
      remembers about ``ghost_span`` pools' worth of references, but never
      fewer than 4,096 once the pool's size is known (given, or learned at
      the first eviction): a pool of a few hundred blocks would otherwise
      estimate 12 classes' reuse curves from a thousand or so events, and
      sampling noise, not the workload, would rank them. At each age
      a class is valued at least as high as every class of fewer reuses and
      the same kind (if blocks differ in how often they are wanted, a
      block seen more often is the likelier to be wanted again). A class's
      estimate averages over its blocks, and the average can invert that
      order: on few-shot templates whose popularity shifts, the top class
      mixed templates wanted every few requests with stale and lukewarm
      ones, its density at 2-4 pools of age fell below the 2-use class's,
      and the policy evicted the templates it had seen most often to keep
      ones seen twice. The order is restored by weighted isotonic regression per
      age, each class weighted by its blocks at risk there (the model's
      ``monotone`` chains), not by raising every class to the best below
      it: where many blocks of a high level show, after a reshuffle, that
      they no longer come back, that evidence lowers the fit instead of
      being overruled by a thinly observed lower level.

    The statistics are uncensored by a *ghost*: the hashes of recently
    evicted blocks with their last access, class and reuse count. When an
    evicted hash is inserted again, that is a reuse the cache missed, at a
    known age; without it the policy would only ever see reuses younger than
    its own eviction age and could never learn that keeping a class longer
    pays. The ghost covers the last ``ghost_span`` pools' worth of evictions
    (a hash and three ints each, far smaller than a KV block).

    Popularity shifts: reuse counts describe the era they were counted in.
    When what is wanted changes wholesale (templates whose popularity is
    reshuffled), the top levels hold stale blocks the model still values,
    and each newly popular prefix must miss three times before it reaches a
    level worth keeping (where LIRS and ARC keep it after two). At each
    refresh a :class:`~kvkit.backends.eviction.hit_density.shift.ShiftTest` asks whether
    the window's reuse runs (one per reused prefix) started at levels
    significantly lower than earlier windows' did, at ``shift_alpha``; windows
    that look low but not yet significantly so are pooled with the next one
    (an *excursion*, see :mod:`~kvkit.backends.eviction.hit_density.shift`, whose repeated tests spend
    ``shift_alpha`` between them). On a shift every tracked block and
    ghost restarts its count at its reuses since the change point (the start
    of the excursion, or of the window): what the new era already showed is
    kept, what the old one counted is dropped. Kind, age and the class lists'
    order by last use stay, and so do the model's histograms. On workloads
    whose reused prefixes start with a shared system prompt the test has
    nothing to see and never fires.

    Selection: each class keeps its blocks in the order they entered it
    (insert, hit, first child, or a restart of the counts), so its two ends
    hold its oldest and its youngest blocks; densities are roughly monotone
    in age on either side of their peak, so these ends are the candidates,
    and the one of lowest density (ties: least recently used) becomes the
    *root* of the next
    eviction. Evicting a young block is an admission decision: the blocks of
    a class not worth their space leave right after their request. Then two
    prefix rules, shared with :class:`~kvkit.backends.eviction.prefix_lru.PrefixLRUPolicy`:
    orphans (tracked blocks whose parent hash is not tracked, which cannot
    hit) go before everything, and a root's subtree goes deepest first, so
    no victim leaves an evictable descendant behind. A walk from the last
    walk's root goes on where that one stopped when this provably chooses
    what a fresh walk would (:meth:`~kvkit.backends.eviction._chains.ChainIndex.collect`),
    so evicting a long chain a victim per selection costs O(1) per victim,
    not the chain's depth. Until the first refresh every density is 0 and
    the order is plain LRU.

    Pinned blocks: with the pin hooks (a pool calls them), a block in use
    leaves its class list on :meth:`on_pin` and is *parked*, keeping its
    class, reuse count and chain links, so selections never scan it and
    never ask ``is_evictable`` about it. It stays in the chain index: a
    parked parent still makes its children non-orphans and keeps its parent
    class, and the walk below a root passes through it (skipping it) to its
    evictable descendants. Hits on a parked block still count (reuse
    statistics, reuse count, class). On :meth:`on_unpin` it re-enters the
    young end of its class, its age still counted from its last insert or
    hit (a pool touches a hit block when it pins it): time spent pinned is
    time in use, not evidence that the block is wanted less.
    A driver that never pins gets the scanning behaviour above.

    Args:
        capacity: blocks in the pool, which sizes the ghost and the refresh
            period. ``None`` learns it (:class:`~kvkit.backends.eviction._common.LearnsCapacity`).
        ghost_span: how many pools' worth of evictions the ghost covers; it
            bounds the longest reuse the policy can learn to wait for.
        shift_alpha: significance level of the popularity-shift test (a false
            alarm restarts the counts); 0 turns it off.

    Invariants:
        * Each tracked block sits in exactly one class list or is parked,
          and its class is that of its reuse count and kind; a block with a
          cached child is a parent, and the tip is the block stored last, if
          it is still tracked and the next store has not come.
        * The ghost holds only hashes of untracked blocks, evicted within
          the last ``ghost_span * capacity`` evictions, oldest first.
        * The two censuses hold exactly the (class, last access) of every
          tracked block and of every ghost; a refresh reads at most
          ``2**18`` entries of each (a strided, reweighted sample beyond).
        * A block's or ghost's reuses since the last refresh that held no
          excursion (the change point a restart keeps) never exceed its count.
        * The chain index's, the density model's and the shift test's invariants.
    """

    ghost_span: float = attrs.field(default=8.0, validator=real_in(low=1, high=math.inf, high_open=True,
                                                                   label="HitDensityPolicy."))
    shift_alpha: float = attrs.field(default=1e-3, validator=real_in(low=0, high=1, high_open=True,
                                                                     label="HitDensityPolicy."))
    _lists: list[OrderedDict[BlockId, None]] = attrs.field(
        init=False, factory=lambda: [OrderedDict() for _ in range(_CLASSES)])
    _class: dict[BlockId, int] = attrs.field(init=False, factory=dict)
    # Pinned blocks set aside from their class lists (on_pin), in pin order.
    _parked: dict[BlockId, None] = attrs.field(init=False, factory=dict)
    _chains: ChainIndex = attrs.field(init=False, default=attrs.Factory(
        lambda self: ChainIndex(parked=self._parked), takes_self=True))
    _uses: dict[BlockId, int] = attrs.field(init=False, factory=dict)
    # Reuses since the change point a restart would keep (absent: none), of tracked blocks and of ghosts.
    _recent: dict[BlockId, int] = attrs.field(init=False, factory=dict)
    _ghost_recent: dict[BlockHash, int] = attrs.field(init=False, factory=dict)
    _last: dict[BlockId, int] = attrs.field(init=False, factory=dict)
    # hash -> (eviction number, last access tick, class, uses, census slot), oldest eviction first
    _ghost: OrderedDict[BlockHash, tuple[int, int, int, int, int]] = attrs.field(
        init=False, factory=OrderedDict)
    # (class, last access) of every tracked block and of every ghost, read by each refresh
    _census: Census = attrs.field(init=False, factory=Census)
    _ghost_census: Census = attrs.field(init=False, factory=Census)
    _slot: dict[BlockId, int] = attrs.field(init=False, factory=dict)
    _model: HitDensityModel = attrs.field(init=False, factory=lambda: HitDensityModel(_CLASSES, monotone=_BY_USES))
    _shift: ShiftTest = attrs.field(init=False)
    _reused: BlockHash | None = attrs.field(init=False, default=None)  # the hash reused last (runs continue it)
    _tip: BlockId | None = attrs.field(init=False, default=None)
    _clock: int = attrs.field(init=False, default=0)
    _evictions: int = attrs.field(init=False, default=0)
    # Ticks the pool takes to replace a pool's worth of blocks: c times the mean gap between removals,
    # averaged over about the last c of them (0 before the second: the fill before the first is no gap).
    _turnover: float = attrs.field(init=False, default=0.0)
    _last_removal: int = attrs.field(init=False, default=0)
    _next_refresh: int = attrs.field(init=False, default=_MIN_REFRESH)

    def __attrs_post_init__(self) -> None:
        self._shift = ShiftTest(len(REUSE_LEVELS), alpha=self.shift_alpha)

    @property
    def shifts(self) -> int:
        """How many times a popularity shift was declared and every reuse count restarted."""
        return self._shift.shifts

    @property
    def model(self) -> HitDensityModel:
        """The learned hit-density model (read it; the policy updates it)."""
        return self._model

    @property
    def num_ghosts(self) -> int:
        """Evicted hashes the ghost remembers."""
        return len(self._ghost)

    @property
    def pinned(self) -> tuple[BlockId, ...]:
        """Blocks parked by :meth:`on_pin`, in pin order."""
        return tuple(self._parked)

    def class_blocks(self, cls: int) -> tuple[BlockId, ...]:
        """The blocks of class ``cls``'s list, oldest entry first (parked blocks excluded)."""
        return tuple(self._lists[cls])

    def class_of(self, block: BlockId) -> int:
        """The class of a tracked block (see :func:`block_class`)."""
        return self._class[block]

    def density_of(self, block: BlockId) -> float:
        """The current hit density of a tracked block (0 before the first refresh)."""
        return self._model.density(self._class[block], self._clock - self._last[block])

    # -- notifications ---------------------------------------------------------

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        if parent == block_hash:  # no hash is its own prefix: such a block heads its chain
            parent = None
        parent_block = self._chains.add(self, block, block_hash, parent)
        self._settle_tip()
        self._clock = clock = self._clock + 1
        uses = 0
        ghost = self._ghost.pop(block_hash, None)
        if ghost is not None:  # a reuse the cache missed: learn from it, keep the history
            _, last, cls, ghost_uses, slot = ghost
            self._ghost_census.drop(slot)
            self._model.record_reuse(cls, clock - last)
            self._note_reuse(cls, block_hash, parent)
            gained = 1 + (clock - last < self._turnover)  # back within a turnover: +1 more
            uses = ghost_uses + gained
            self._recent[block] = self._ghost_recent.pop(block_hash, 0) + gained
        cls = block_class(uses, PARENT if self._chains.has_children(block) else TIP)
        self._tip = block if cls % _KINDS == TIP else None
        self._uses[block] = uses
        self._last[block] = clock
        self._slot[block] = self._census.add(cls, clock)
        self._class[block] = cls
        self._lists[cls][block] = None  # never parked yet: a pool pins a block after committing it
        if parent_block is not None and self._class[parent_block] % _KINDS != PARENT:
            self._enter(parent_block, block_class(self._uses[parent_block], PARENT))
        self._learn(len(self._class))
        if clock >= self._next_refresh:
            self._refresh()

    @override
    def on_access(self, block: BlockId) -> None:
        cls = self._class.get(block)
        if cls is None:
            raise not_tracked(self, block)
        self._clock = clock = self._clock + 1
        self._model.record_reuse(cls, clock - self._last[block])
        self._note_reuse(cls, *self._chains.links(block))
        self._uses[block] = uses = self._uses[block] + 1
        self._recent[block] = self._recent.get(block, 0) + 1
        self._last[block] = clock
        self._census.set_last(self._slot[block], clock)
        self._enter(block, block_class(uses, cls % _KINDS))
        if clock >= self._next_refresh:
            self._refresh()

    @override
    def on_remove(self, block: BlockId) -> None:
        block_hash = self._chains.remove(self, block)
        if block == self._tip:
            self._tip = None
        cls = self._class.pop(block)
        if self._parked.pop(block, False) is False:
            del self._lists[cls][block]
        last, uses = self._last.pop(block), self._uses.pop(block)
        recent = self._recent.pop(block, 0)
        if recent:
            self._ghost_recent[block_hash] = recent
        self._census.drop(self._slot.pop(block))
        self._evictions = evictions = self._evictions + 1
        gap, self._last_removal, c = self._clock - self._last_removal, self._clock, max(self.c, 1)
        if evictions > 1:  # the first removal only starts the clock: the fill before it is no gap
            self._turnover += (gap * c - self._turnover) / min(evictions - 1, c)
        self._ghost[block_hash] = (evictions, last, cls, uses, self._ghost_census.add(cls, last))
        horizon = evictions - self.ghost_span * c
        while self._ghost:
            ghost_hash, (evicted, last, cls, _, slot) = next(iter(self._ghost.items()))
            if evicted > horizon:
                break
            del self._ghost[ghost_hash]  # forgotten unreused: censored at its age
            self._ghost_recent.pop(ghost_hash, None)
            self._ghost_census.drop(slot)
            self._model.record_end(cls, self._clock - last)

    def on_pin(self, block: BlockId) -> None:
        """Park a tracked block in use: out of its class list, keeping its class and counters."""
        cls = self._class.get(block)
        if cls is None:
            raise not_tracked(self, block)
        if self._lists[cls].pop(block, False) is False:  # tracked, not listed: parked already
            raise pin_mismatch(self, block, pinned=True)
        self._parked[block] = None
        self._chains.pin(block)

    def on_unpin(self, block: BlockId) -> None:
        """Put a parked block back at its class's young end; its age still counts from its last use."""
        cls = self._class.get(block)
        if cls is None:
            raise not_tracked(self, block)
        blocks = self._lists[cls]
        if self._parked.pop(block, False) is False:
            raise pin_mismatch(self, block, pinned=False)
        blocks[block] = None
        self._chains.unpin(block)

    # -- decisions -------------------------------------------------------------

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        chosen: dict[BlockId, None] = {}
        parked = self._parked

        def usable(block: BlockId) -> bool:
            return block not in chosen and block not in parked and is_evictable(block)

        # One cursor per candidate stream (the orphans, then both ends of every class list),
        # kept across the rounds of this selection: nothing a round skips can become usable
        # later in it, so each stream is walked at most once and a selection costs O(n + skipped).
        orphans = filter(usable, self._chains.orphans())
        ends = [filter(usable, reversed(blocks) if young else iter(blocks))
                for blocks in self._lists if blocks for young in (False, True)]
        heads: list[tuple[float, int, BlockId] | None] = [self._head(end) for end in ends]
        while len(chosen) < n:
            root = next(orphans, None)
            if root is None:
                live = [head for head in heads if head is not None]
                if not live:
                    return None
                root = min(live)[2]
            self._chains.collect(root, is_evictable, chosen, n, parked)
            for i, head in enumerate(heads):
                if head is not None and head[2] in chosen:
                    heads[i] = self._head(ends[i])
        return list(chosen)

    def _head(self, stream: Iterator[BlockId]) -> tuple[float, int, BlockId] | None:
        """The next usable block of a candidate stream as ``(density, last access, block)``, or ``None``."""
        block = next(stream, None)
        if block is None:
            return None
        last = self._last[block]
        return self._model.density(self._class[block], self._clock - last), last, block

    # -- bookkeeping -----------------------------------------------------------

    def _note_reuse(self, cls: int, block_hash: BlockHash, parent: BlockHash | None) -> None:
        """A block of class ``cls`` is reused: a sample for the shift test if it starts a reuse run."""
        if parent is None or parent != self._reused:
            self._shift.note(cls // _KINDS)
        self._reused = block_hash

    def _restart_counts(self) -> None:
        """Every tracked block and ghost counts only its reuses since the change point; kind and age kept.

        The class lists are rebuilt oldest last use first, as if every block had
        just entered its new class in the order it was last used.
        """
        for blocks in self._lists:
            blocks.clear()
        for block in sorted(self._class, key=self._last.__getitem__):
            self._uses[block] = uses = self._recent.get(block, 0)
            cls = block_class(uses, self._class[block] % _KINDS)
            self._class[block] = cls
            self._census.set_class(self._slot[block], cls)
            if block not in self._parked:
                self._lists[cls][block] = None
        for block_hash, (evicted, last, cls, _, slot) in self._ghost.items():
            # its class stays: what its return teaches
            self._ghost[block_hash] = (evicted, last, cls, self._ghost_recent.get(block_hash, 0), slot)

    def _settle_tip(self) -> None:
        """The block stored before this store is a tip no more: a parent if this store continued it, else a leaf."""
        tip, self._tip = self._tip, None
        if tip is not None:
            self._enter(tip, block_class(self._uses[tip], PARENT if self._chains.has_children(tip) else LEAF))

    def _enter(self, block: BlockId, cls: int) -> None:
        """Put ``block`` at the young end of class ``cls``'s list (if parked: only its class)."""
        old = self._class.get(block)
        self._class[block] = cls
        self._census.set_class(self._slot[block], cls)
        if block in self._parked:
            return  # it enters its (new) class's list on on_unpin
        if old is not None:
            del self._lists[old][block]
        self._lists[cls][block] = None

    def _refresh(self) -> None:
        """Recompute the densities (bounded work, see :mod:`._census`); due about once per pool's worth of ticks."""
        period = max(self.c, _MIN_REFRESH)
        self._next_refresh = self._clock + period
        sized = self.capacity is not None or self._evictions > 0  # a learned size is final once the pool evicts
        keep = 1 - 1 / (max(self.ghost_span, _MIN_MEMORY / period) if sized else self.ghost_span)
        if self._shift.check(keep):
            self._restart_counts()
        if not self._shift.in_excursion:  # the next change point a restart would keep: now
            self._recent.clear()
            self._ghost_recent.clear()
        (t_cls, t_last, t_w), (g_cls, g_last, g_w) = (
            census.sample(_CENSUS_LIMIT) for census in (self._census, self._ghost_census))
        weights = np.concatenate([np.full(len(t_cls), t_w), np.full(len(g_cls), g_w)])
        self._model.refresh(np.concatenate([t_cls, g_cls]), self._clock - np.concatenate([t_last, g_last]),
                            keep=keep, weights=weights)

    @override
    def __len__(self) -> int:
        return len(self._class)

    @override
    def check_invariants(self) -> None:
        assert len(self._chains) == len(self._class) == len(self._uses) == len(self._last), \
            "per-block maps differ in size"
        assert sum(map(len, self._lists)) + len(self._parked) == len(self._class), \
            "class lists and parked blocks do not split the tracked blocks"
        for cls, blocks in enumerate(self._lists):
            for block in blocks:
                assert self._class[block] == cls, f"block {block} is listed in class {cls}"
                assert block not in self._parked, f"parked block {block} is listed in class {cls}"
        for block, cls in self._class.items():
            assert cls // _KINDS == reuse_level(self._uses[block]), f"block {block} reuse class"
            assert 0 <= self._recent.get(block, 0) <= self._uses[block], f"block {block} recent reuses"
            assert cls % _KINDS == PARENT or not self._chains.has_children(block), \
                f"block {block} has a child but is not classed a parent"
            assert (cls % _KINDS == TIP) == (block == self._tip), f"block {block} tip kind"
            assert self._last[block] <= self._clock, f"block {block} accessed in the future"
        assert len(self._slot) == len(self._census) == len(self._class), "census of tracked blocks drifted"
        for block, slot in self._slot.items():
            assert self._census.get(slot) == (self._class[block], self._last[block]), f"census of block {block}"
        assert len(self._ghost_census) == len(self._ghost), "census of ghosts drifted"
        for ghost_hash, (_, last, cls, _, slot) in self._ghost.items():
            assert self._ghost_census.get(slot) == (cls, last), f"census of ghost {ghost_hash}"
        for ghost_hash, recent in self._ghost_recent.items():
            assert 0 < recent <= self._ghost[ghost_hash][3], f"ghost {ghost_hash} recent reuses"
        self._census.check_invariants()
        self._ghost_census.check_invariants()
        self._shift.check_invariants()
        evicted = [g[0] for g in self._ghost.values()]
        assert evicted == sorted(evicted), "ghost is not in eviction order"
        for ghost_hash in self._ghost:
            assert not self._chains.has_hash(ghost_hash), f"ghost {ghost_hash} is tracked"
        self._check_capacity()
        self._chains.check_invariants()
        self._model.check_invariants()
