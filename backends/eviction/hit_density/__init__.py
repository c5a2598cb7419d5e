"""Prefix-aware hit-density eviction: keep the blocks that earn the most hits for their space."""

from __future__ import annotations

import bisect
import math
import sys
from array import array
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from heapq import heappop, heappush
from typing import cast

import attrs
import numpy as np
from typing_extensions import override

from kvkit.backends.eviction._chains import FlatChains
from kvkit.backends.eviction._common import LearnsCapacity, check_count, define_policy, not_tracked, pin_mismatch
from kvkit.backends.eviction.hit_density import booking, census, selection
from kvkit.backends.eviction.hit_density.booking import KINDS as _KINDS
from kvkit.backends.eviction.hit_density.booking import LEAF, PARENT, TIP, Booking
from kvkit.backends.eviction.hit_density.booking import LISTED as _LISTED
from kvkit.backends.eviction.hit_density.booking import MAX_USES as _MAX_USES
from kvkit.backends.eviction.hit_density.booking import NONE as _NONE
from kvkit.backends.eviction.hit_density.census import Census
from kvkit.backends.eviction.hit_density.density import HitDensityModel
from kvkit.backends.eviction.hit_density.selection import Selection
from kvkit.backends.eviction.hit_density.shift import ShiftTest
from kvkit.errors import PoolUsageError
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import at_least, check_int, quote, real_in

__all__ = ["LEAF", "PARENT", "REUSE_LEVELS", "TIP", "HitDensityPolicy", "block_class", "reuse_level"]

REUSE_LEVELS = (0, 1, 2, 3, 4, 8, 16)
"""The least reuse count of each reuse level: counts 0-3 one level each (S3-FIFO's two bits), then
4-7, 8-15 and 16 or more (how often a block is wanted, to within a factor of two)."""
_CLASSES = _KINDS * len(REUSE_LEVELS)
_MIN_REFRESH = 64  # ticks between two refreshes while the pool is still tiny
_MIN_MEMORY = 4096  # ticks of history the model weighs at least, once the pool's size is known
_CENSUS_LIMIT = 1 << 18  # entries a refresh reads at most per census (beyond: an evenly strided sample)
_NEVER = sys.maxsize  # a clock no policy reaches
_GHOST_ENTRY_BYTES = 192  # a ghost's memory at most: its map entry and array slots (tests measure it)
_IntPredicate = Callable[[int], bool]
_Blocks = list[BlockId]
_UNTRACKED, _PARKED = 0, FlatChains.PARKED  # where a block id is, beside _LISTED


def _valid_ids(blocks: Sequence[object]) -> bool:
    """Whether every block id is an int ``>= 0`` (a pass at C speed; ``False`` for an empty batch)."""
    return len(blocks) > 0 and set(map(type, blocks)) == _INT and min(cast(Sequence[int], blocks)) >= 0


_INT = {int}


def reuse_level(uses: int) -> int:
    """The reuse level of a block hit ``uses`` times: the index of the last ``REUSE_LEVELS`` entry <= ``uses``."""
    return bisect.bisect_right(REUSE_LEVELS, uses) - 1


_TOP = REUSE_LEVELS[-1]
# The class of every (uses, kind), uses capped at the last level's least count: a table read per call.
_CLASS_OF = tuple(tuple(_KINDS * reuse_level(uses) + kind for kind in range(_KINDS)) for uses in range(_TOP + 1))
_CLASS_TABLE = bytes(cls for row in _CLASS_OF for cls in row)  # the same, flat: [_KINDS * uses + kind]


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

    The statistics are uncensored by a *ghost*: the keys (``hash`` of each
    block hash, 64 bits) of recently evicted blocks with their last access,
    class and reuse count. When an evicted hash is inserted again, that is a reuse the cache missed, at a
    known age; without it the policy would only ever see reuses younger than
    its own eviction age and could never learn that keeping a class longer
    pays. The ghost covers the last ``ghost_span`` pools' worth of evictions
    (a key and three ints each, far smaller than a KV block; no Python
    object: a hash leaves memory with its block).

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
    what a fresh walk would (:meth:`~kvkit.backends.eviction._chains.FlatChains.collect`),
    so evicting a long chain a victim per selection costs O(1) per victim,
    not the chain's depth. Until the first refresh every density is 0 and
    the order is plain LRU.

    Layout: per-block state sits in flat arrays indexed by block id (a mark
    of where the block is, its class, its reuse count saturating at 255, its
    last access and key, its class list links), the ghost in arrays indexed by
    eviction number, and the chain links in
    :class:`~kvkit.backends.eviction._chains.FlatChains`: a
    tracked block costs a few dozen bytes and one entry of the chain index's
    hash map (none under a pool, whose index and hash list it reads:
    :meth:`use_index`), a ghost a few bytes and one entry of the ghost's map. Each end
    of each class list caches its ordering key until that end changes, its
    age bucket moves on or the model refreshes, so a selection's first root
    is the least cached key once one batched ``is_evictable`` pass has found
    every end usable.

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

    Batches: the policy is a :class:`~kvkit.interfaces.capabilities.BatchedPolicy`.
    Every hook runs one loop over its blocks, so a per-block hook is the same
    loop on one block; a commit's blocks are parked as they enter (never
    listed in between), and a removal of several blocks leaves the chain
    index in one pass (a child leaving with its parent never joins the orphans).

    Args:
        capacity: blocks in the pool, which sizes the ghost and the refresh
            period. ``None`` learns it (:class:`~kvkit.backends.eviction._common.LearnsCapacity`).
        ghost_span: how many pools' worth of evictions the ghost covers; it
            bounds the longest reuse the policy can learn to wait for.
        ghost_bytes: the ghost's memory bound: it holds at most
            ``ghost_bytes // 192`` ghosts (192 bytes bound one), so at
            the default 256 MiB it covers fewer than ``ghost_span`` pools
            above about 175,000 blocks.
        shift_alpha: significance level of the popularity-shift test (a false
            alarm restarts the counts); 0 turns it off.

    Invariants:
        * Each tracked block sits in exactly one class list or is parked,
          and its class is that of its reuse count and kind; a block with a
          cached child is a parent, and the tip is the block stored last, if
          it is still tracked and the next store has not come.
        * The ghost's map holds one key per live ghost, mapped to its
          eviction number; a ghost was evicted within the last
          ``min(ghost_span * capacity, ghost_bytes // 192)`` evictions, and
          its key leaves when a hash of that key is stored again or a newer
          ghost takes it (two hashes of one key share a ghost).
        * A refresh reads the (class, last access) of every tracked block
          and of every ghost, at most ``2**18`` entries of each (a strided,
          reweighted sample beyond).
        * A block's or ghost's reuses since the last refresh that held no
          excursion (the change point a restart keeps), capped at 255, never
          exceed its count.
        * A cached end key that is not dirty is the key of the end's block
          at the current clock and model.
        * The chain index's, the density model's and the shift test's invariants.
    """

    ghost_span: float = attrs.field(default=8.0, validator=real_in(low=1, high=math.inf, high_open=True,
                                                                   label="HitDensityPolicy."))
    ghost_bytes: int = attrs.field(default=256 << 20, validator=at_least(_GHOST_ENTRY_BYTES,
                                                                        label="HitDensityPolicy."))
    shift_alpha: float = attrs.field(default=1e-3, validator=real_in(low=0, high=1, high_open=True,
                                                                     label="HitDensityPolicy."))
    # Per block id: where it is (_UNTRACKED, _LISTED, _PARKED), its class, reuse count, last access and key
    # (hash of its hash: its ghost's, once evicted), and its links in its class list (parked blocks sit in none).
    _where: bytearray = attrs.field(init=False, factory=bytearray)
    _cls: bytearray = attrs.field(init=False, factory=bytearray)
    _uses: bytearray = attrs.field(init=False, factory=bytearray)  # saturating at _MAX_USES
    _last: array = attrs.field(init=False, factory=lambda: array("q"))
    _key: array = attrs.field(init=False, factory=lambda: array("q"))
    _next: array = attrs.field(init=False, factory=lambda: array("i"))
    _prev: array = attrs.field(init=False, factory=lambda: array("i"))
    # The ends of every list: _ends[2 * list] its oldest block, _ends[2 * list + 1] its youngest. Each end
    # of a class list is a candidate *stream* of selections; _keys[stream] caches its end's ordering key
    # (density, last access, block, stream), or None (empty, or _dirty: to compute), until the clock
    # reaches the age bucket's next edge (_due, a heap of (clock, stream)) or the model refreshes.
    _ends: list[int] = attrs.field(init=False, factory=lambda: [_NONE] * (2 * _CLASSES))
    _keys: list[tuple[float, int, int, int] | None] = attrs.field(
        init=False, factory=lambda: [None] * (2 * _CLASSES))
    _dirty: set[int] = attrs.field(init=False, factory=set)
    _due: list[tuple[int, int]] = attrs.field(init=False, factory=list)
    _due_at: list[int] = attrs.field(init=False, factory=lambda: [_NEVER] * (2 * _CLASSES))  # its earliest entry
    _keyed_table: object = attrs.field(init=False, default=None)  # the model's table the keys were read from
    _tracked: int = attrs.field(init=False, default=0)
    _chains: FlatChains = attrs.field(init=False, default=attrs.Factory(
        lambda self: FlatChains(self._where), takes_self=True))
    # Reuses since the change point a restart would keep (absent: none), of tracked blocks and of ghosts.
    _recent: dict[BlockId, int] = attrs.field(init=False, factory=dict)
    _ghost_recent: dict[int, int] = attrs.field(init=False, factory=dict)  # by key
    # The ghost, by eviction number (index + _ghost_base): key (hash of its hash), class, uses, last
    # access, liveness; a live key's eviction number; the oldest eviction number that may be live.
    _ghost_key: array = attrs.field(init=False, factory=lambda: array("q"))
    _ghost_cls: bytearray = attrs.field(init=False, factory=bytearray)
    _ghost_uses: bytearray = attrs.field(init=False, factory=bytearray)
    _ghost_last: array = attrs.field(init=False, factory=lambda: array("q"))
    _ghost_live: bytearray = attrs.field(init=False, factory=bytearray)
    _ghost_at: MutableMapping[int, int] = attrs.field(init=False)  # the booking's ghost_map
    _ghost_base: int = attrs.field(init=False, default=1)
    _ghost_oldest: int = attrs.field(init=False, default=1)
    _samples: int = attrs.field(init=False, default=0)  # refreshes that read the censuses
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
    # The per-block loops, the census and the selection rounds: compiled where they were built (the tests set
    # the references to compare the two).
    _booking: Booking = attrs.field(init=False, factory=booking.LOOPS.default, eq=False, repr=False)
    _census: Census = attrs.field(init=False, factory=census.LOOPS.default, eq=False, repr=False)
    _selection: Selection = attrs.field(init=False, factory=selection.LOOPS.default, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._ghost_at = self._booking.ghost_map()
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
        """Evicted hashes the ghost remembers (by key)."""
        return len(self._ghost_at)

    @property
    def pinned(self) -> tuple[BlockId, ...]:
        """Blocks parked by :meth:`on_pin`, in block id order."""
        parked = np.flatnonzero(np.frombuffer(self._where, dtype=np.uint8) == _PARKED)
        return tuple(BlockId(block) for block in parked.tolist())

    def class_blocks(self, cls: int) -> tuple[BlockId, ...]:
        """The blocks of class ``cls``'s list, oldest entry first (parked blocks excluded)."""
        if not 0 <= cls < _CLASSES:
            raise PoolUsageError(f"class_blocks: class {quote(cls)} is not one of 0..{_CLASSES - 1}")
        return tuple(self._listed(cls))

    def class_of(self, block: BlockId) -> int:
        """The class of a tracked block (see :func:`block_class`)."""
        return self._cls[self._tracked_id(block)]

    def uses_of(self, block: BlockId) -> int:
        """The reuse count of a tracked block, saturating at 255 (the last reuse level starts at 16)."""
        return self._uses[self._tracked_id(block)]

    def density_of(self, block: BlockId) -> float:
        """The current hit density of a tracked block (0 before the first refresh)."""
        block = self._tracked_id(block)
        return self._model.density(self._cls[block], self._clock - self._last[block])

    # -- notifications ---------------------------------------------------------
    # Each hook, per block or batched, runs one loop over its blocks (_insert, _access, _remove, _pin,
    # _unpin) that binds the per-block arrays once (they grow in place).

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        self._insert((block,), (block_hash,), (parent,), _LISTED)

    def insert_pinned(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
                      parents: Sequence[BlockHash | None]) -> None:
        """:meth:`on_insert` then :meth:`on_pin` for each block, in order: each is parked as it enters."""
        self._insert(blocks, hashes, parents, _PARKED)

    def _insert(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
                parents: Sequence[BlockHash | None], mark: int) -> None:
        """Track each block under its hash and parent: listed (``_LISTED``) or parked at once (``_PARKED``).

        The chain index takes the whole batch first (what it reports per block
        is what it held right after that block's add: a later block of the
        batch never changes it), then each block is booked in order
        (:mod:`.booking`), the model refreshed whenever one falls due. The tip
        gains a child exactly when the next block names it as its parent: it
        has none while it is the tip (it would be a parent), and no block is
        added in between.
        """
        if not _valid_ids(blocks):  # one at a time: raises at the first bad id, those before it tracked
            for block, block_hash, parent in zip(blocks, hashes, parents):
                if block.__class__ is not int or block < 0:
                    raise PoolUsageError(f"{type(self).__name__}.on_insert: block ids are ints >= 0, got "
                                         f"{quote(block)}")
                self._insert((block,), (block_hash,), (parent,), mark)
            return
        top = max(blocks)
        if top >= len(self._where):
            self._grow(top + 1)
        pinned = mark == _PARKED
        parent_blocks, fresh, refusal = self._chains.add_many(self, blocks, hashes, parents, pinned)
        book = self._booking.book_inserts
        done = 0
        while done < len(parent_blocks):
            done = book(self, blocks, hashes, parents, parent_blocks, fresh, mark, done, _CLASS_TABLE)
            if self._clock >= self._next_refresh:
                self._learn(self._tracked)
                self._refresh()
        self._learn(self._tracked)
        if refusal is not None:
            raise refusal

    @override
    def on_access(self, block: BlockId) -> None:
        self._access((block,))

    def access_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`on_access` for each block, in order."""
        self._access(blocks)

    def _access(self, blocks: Sequence[BlockId]) -> None:
        """Count a hit on each block (:mod:`.booking`): its reuse, its class, its age from now; the model
        refreshed whenever one falls due; the first block not tracked is refused, those before it counted."""
        book = self._booking.book_accesses
        done, n = 0, len(blocks)
        while done < n:
            done = book(self, blocks, done, _CLASS_TABLE)
            if self._clock >= self._next_refresh:
                self._refresh()
            elif done < n:  # the booking stops short of a refresh only before a block not tracked
                raise not_tracked(self, blocks[done])

    @override
    def on_remove(self, block: BlockId) -> None:
        self._remove((block,))

    def remove_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`on_remove` for each block, in order."""
        self._remove(blocks)

    def _remove(self, blocks: Sequence[BlockId]) -> None:
        """Forget each block, leaving its ghost; the ghosts past their span are forgotten once, after."""
        leaving = self._chains.distinct_tracked(blocks)
        if len(blocks) > 1 and not leaving:
            for block in blocks:  # one at a time: raises at the first untracked block, those before it removed
                self._remove((block,))
            return
        self._chains.remove_many(self, blocks, leaving)  # the chains first (what follows reads none)
        if self._tip in (leaving or blocks):
            self._tip = None
        self._booking.book_marks(self, blocks, _UNTRACKED)
        c = max(self.c, 1)
        self._booking.book_removals(self, blocks, c)
        self._forget_ghosts(self._evictions - self._ghost_limit(c))

    def use_index(self, index: Mapping[BlockHash, BlockId], hashes: Sequence[BlockHash | None],
                  num_blocks: int) -> None:
        """Read hashes and their blocks from the pool's index and hash list instead of keeping copies, and
        size the per-block arrays for ``num_blocks`` ids at once
        (:class:`~kvkit.interfaces.capabilities.IndexedPolicy`).

        Raises:
            PoolUsageError: the policy already tracks a block or reads an index, or ``num_blocks`` is
                not an int >= 1 (quoted); nothing changes.
        """
        num_blocks = check_int("use_index: num_blocks", num_blocks, 1, error=PoolUsageError)
        self._chains.use_index(self, index, hashes)
        if num_blocks > len(self._where):
            self._grow(num_blocks)

    def on_pin(self, block: BlockId) -> None:
        """Park a tracked block in use: out of its class list, keeping its class and counters."""
        self._pin((block,))

    def pin_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`on_pin` for each block, in order."""
        self._pin(blocks)

    def _pin(self, blocks: Sequence[BlockId]) -> None:
        done = self._booking.book_pins(self, blocks, _PARKED)
        if done < len(blocks):
            raise self._pin_refusal(blocks[done], pinning=True)

    def on_unpin(self, block: BlockId) -> None:
        """Put a parked block back at its class's young end; its age still counts from its last use."""
        self._unpin((block,))

    def unpin_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`on_unpin` for each block, in order."""
        self._unpin(blocks)

    def _unpin(self, blocks: Sequence[BlockId]) -> None:
        done = self._booking.book_pins(self, blocks, _LISTED)
        if done < len(blocks):
            raise self._pin_refusal(blocks[done], pinning=False)

    def _pin_refusal(self, block: BlockId, pinning: bool) -> PoolUsageError:
        """The error for a block :func:`~.booking.book_pins` stopped at: not tracked, or already pinned
        (``pinning``) or not pinned."""
        self._tracked_id(block)  # raises for a block not tracked
        return pin_mismatch(self, block, pinned=pinning)

    # -- decisions -------------------------------------------------------------

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        if n.__class__ is not int or not 0 <= n <= sys.maxsize:
            check_count(n)
        chosen: dict[int, None] = {}
        if not n:
            return []
        evictable = cast(_IntPredicate, is_evictable)  # block ids read from the arrays
        verified = False
        if self._chains.orphans() is None:
            # Orphans go first; without them the first root is the stream end of least key, and
            # when every end is evictable (a pool that reports its pins: always), that is the
            # least cached key. A selection that needs more goes on in the rounds of selection.py.
            ends = self._ends
            verified = all(map(evictable, filter(_NONE.__ne__, ends)))
            if verified:
                keys = self._current_keys()
                if not any(keys):
                    return None
                self._chains.collect(min(filter(None, keys))[2], evictable, chosen, n)
                if len(chosen) >= n:
                    return cast(_Blocks, list(chosen))
        return self._selection.select_rounds(self, n, evictable, chosen, verified)

    def _current_keys(self) -> list[tuple[float, int, int, int] | None]:
        """``_keys`` brought up to date: the dirty streams' keys and those whose age bucket moved computed."""
        keys, dirty, due, due_at, clock = self._keys, self._dirty, self._due, self._due_at, self._clock
        table = self._model.table
        if table is not self._keyed_table:  # refreshed: every key is stale
            self._keyed_table = table
            dirty.update(range(2 * _CLASSES))
            due.clear()
            due_at[:] = [_NEVER] * (2 * _CLASSES)
        while due and due[0][0] <= clock:
            at, stream = heappop(due)
            if due_at[stream] == at:
                due_at[stream] = _NEVER
            dirty.add(stream)  # at worst a key computed again
        if dirty:
            ends, last_of, cls_of = self._ends, self._last, self._cls
            octave, top, first_age = self._model.per_octave, self._model.buckets - 1, self._model.first_ages
            for stream in dirty:
                block = ends[stream]
                if block == _NONE:
                    keys[stream] = None
                    continue
                last = last_of[block]
                if table is None:
                    keys[stream] = (0.0, last, block, stream)
                    continue
                b = ((clock - last + 1) ** octave).bit_length() - 1
                if b < top:
                    keys[stream] = (table.item(cls_of[block], b), last, block, stream)
                    at = last + first_age[b + 1]
                    if at < due_at[stream]:  # else the entry due earlier has it computed again
                        due_at[stream] = at
                        heappush(due, (at, stream))
                else:
                    keys[stream] = (table.item(cls_of[block], top), last, block, stream)
            dirty.clear()
        return keys

    # -- bookkeeping -----------------------------------------------------------

    def _tracked_id(self, block: BlockId) -> BlockId:
        """``block`` if tracked, else ``PoolUsageError``."""
        if block.__class__ is int and 0 <= block < len(self._where) and self._where[block]:
            return block
        raise not_tracked(self, block)

    def _grow(self, size: int) -> None:
        """Make room for block ids below ``size`` (at least doubling: amortised O(1) per block)."""
        size = max(size, 2 * len(self._where), 1024)
        more = size - len(self._where)
        self._where += bytes(more)
        self._cls += bytes(more)
        self._uses += bytes(more)
        self._last += array("q", bytes(8 * more))
        self._key += array("q", bytes(8 * more))
        links = array("i", [_NONE]) * more
        self._next += links
        self._prev += links
        self._chains.grow(size)  # it reads the same _where bytes: a bytearray grows in place

    def _move(self, block: int, old: int, new: int) -> None:
        """Take ``block`` out of list ``old`` and put it at the young end of list ``new``.

        Lists are the classes; ``_NONE`` for ``old``: it was in none (new, or parked), for ``new``: it
        leaves the lists (removed, or parked). The ends that change are marked dirty.
        """
        nxt, prv, ends, dirty = self._next, self._prev, self._ends, self._dirty
        if old != _NONE:
            before, after = prv[block], nxt[block]
            if before == _NONE:
                ends[2 * old] = after
                dirty.add(2 * old)
            else:
                nxt[before] = after
            if after == _NONE:
                ends[2 * old + 1] = before
                dirty.add(2 * old + 1)
            else:
                prv[after] = before
        if new != _NONE:
            young = 2 * new + 1
            tail = ends[young]
            prv[block] = tail
            nxt[block] = _NONE
            if tail == _NONE:
                ends[young - 1] = block
                dirty.add(young - 1)
            else:
                nxt[tail] = block
            ends[young] = block
            dirty.add(young)

    def _listed(self, lst: int) -> Iterator[BlockId]:
        """The blocks of list ``lst``, oldest entry first."""
        block, nxt = self._ends[2 * lst], self._next
        while block != _NONE:
            yield BlockId(block)
            block = nxt[block]

    def _ghost_limit(self, capacity: int) -> float:
        """How many of the latest evictions the ghost covers: ``ghost_span`` pools, within ``ghost_bytes``."""
        return min(self.ghost_span * capacity, self.ghost_bytes // _GHOST_ENTRY_BYTES)

    def _forget_ghosts(self, horizon: float) -> None:
        """Forget the ghosts evicted at or before ``horizon`` (censored at their age); compact the arrays.

        Eviction numbers grow with the index, so those ghosts are the live ones of one leading range;
        the oldest that may be live is then the first live one past it.
        """
        base, live = self._ghost_base, self._ghost_live
        oldest, end = self._ghost_oldest, base + len(live)
        stop = min(end, math.floor(horizon) + 1)  # the first eviction number past the horizon
        if stop > oldest:
            self._booking.forget_ghosts(self, oldest - base, stop - base)  # their ends recorded: censored
            oldest = stop
        first_live = live.find(1, oldest - base)
        oldest = end if first_live < 0 else base + first_live
        self._ghost_oldest = oldest
        gone = oldest - base
        if gone >= 1024 and 2 * gone >= len(live):  # amortised O(1): each entry is moved at most once
            for entries in (self._ghost_key, self._ghost_cls, self._ghost_uses, self._ghost_last, live):
                del entries[:gone]
            self._ghost_base = oldest

    def _restart_counts(self) -> None:
        """Every tracked block and ghost counts only its reuses since the change point; kind and age kept.

        The class lists are rebuilt oldest last use first, as if every block had
        just entered its new class in the order it was last used (ties: lower
        block id first); a parked block's links stay as they were. Whole-array
        operations: the reuse counts of ``_recent`` (tracked blocks, an invariant)
        and ``_ghost_recent`` (live ghosts) are the only per-entry Python steps.
        """
        ends, dirty = self._ends, self._dirty
        for end in range(2 * _CLASSES):
            ends[end] = _NONE
            dirty.add(end)
        where = np.frombuffer(self._where, dtype=np.uint8)
        uses, classes = np.frombuffer(self._uses, dtype=np.uint8), np.frombuffer(self._cls, dtype=np.uint8)
        tracked = np.flatnonzero(where)
        uses[tracked] = 0
        for block, recent in self._recent.items():
            uses[block] = min(recent, _MAX_USES)
        kinds = classes[tracked] % _KINDS
        classes[tracked] = np.frombuffer(_CLASS_TABLE, dtype=np.uint8)[
            _KINDS * np.minimum(uses[tracked], _TOP) + kinds]
        # the listed blocks by last use (stable: block id order among equal ones), then by class (stable)
        by_last = tracked[np.argsort(np.frombuffer(self._last, dtype=np.int64)[tracked], kind="stable")]
        listed = by_last[where[by_last] == _LISTED]
        if len(listed):
            listed = listed[np.argsort(classes[listed], kind="stable")]
            listed_classes = classes[listed].astype(np.intp)
            same = listed_classes[1:] == listed_classes[:-1]  # a block and the next share a list
            nxt, prv = np.frombuffer(self._next, dtype=np.int32), np.frombuffer(self._prev, dtype=np.int32)
            nxt[listed[:-1]] = np.where(same, listed[1:], _NONE)
            nxt[listed[-1]] = _NONE
            prv[listed[1:]] = np.where(same, listed[:-1], _NONE)
            prv[listed[0]] = _NONE
            firsts, lasts = np.flatnonzero(np.r_[True, ~same]), np.flatnonzero(np.r_[~same, True])
            for cls, first, last in zip(listed_classes[firsts].tolist(), listed[firsts].tolist(),
                                        listed[lasts].tolist()):
                ends[2 * cls], ends[2 * cls + 1] = first, last
        ghost_uses = np.frombuffer(self._ghost_uses, dtype=np.uint8)
        ghost_uses[np.frombuffer(self._ghost_live, dtype=np.uint8) != 0] = 0  # its class stays: what its return teaches
        at, base = self._ghost_at, self._ghost_base
        for key, recent in self._ghost_recent.items():  # live ghosts only (an invariant)
            ghost_uses[at[key] - base] = min(recent, _MAX_USES)

    def _refresh(self) -> None:
        """Recompute the densities (bounded work, see :mod:`.census`); due about once per pool's worth of ticks."""
        period = max(self.c, _MIN_REFRESH)
        self._next_refresh = self._clock + period
        sized = self.capacity is not None or self._evictions > 0  # a learned size is final once the pool evicts
        keep = 1 - 1 / (max(self.ghost_span, _MIN_MEMORY / period) if sized else self.ghost_span)
        if self._shift.check(keep):
            self._restart_counts()
        if not self._shift.in_excursion:  # the next change point a restart would keep: now
            self._recent.clear()
            self._ghost_recent.clear()
        self._samples = turn = self._samples + 1
        model = self._model
        live = self._census.read(self._where, self._cls, self._last, self._ghost_live, self._ghost_cls,
                                 self._ghost_last, self._clock, turn, _CENSUS_LIMIT, model,
                                 np.empty((model.classes, model.buckets)))
        model.refresh_counted(live, keep)

    @override
    def __len__(self) -> int:
        return self._tracked

    @override
    def check_invariants(self) -> None:
        where = self._where
        n = len(where)
        assert len(self._cls) == len(self._uses) == len(self._last) == len(self._key) == len(self._next) \
            == len(self._prev) == n, "per-block arrays differ in length"
        tracked = [BlockId(b) for b in range(n) if where[b]]
        assert len(tracked) == self._tracked == len(self._chains), "tracked counts differ"
        listed: dict[int, int] = {}
        for lst in range(_CLASSES):
            blocks = list(self._listed(lst))
            assert self._ends[2 * lst + 1] == (blocks[-1] if blocks else _NONE), f"list {lst} tail drifted"
            assert all(self._prev[b] == a for a, b in zip([_NONE, *blocks], blocks)), f"list {lst} links broken"
            for block in blocks:
                assert block not in listed, f"block {block} is in lists {listed.get(block)} and {lst}"
                listed[block] = lst
        assert sorted(listed) == [b for b in tracked if where[b] == _LISTED], "class lists drifted from the marks"
        for block in tracked:
            cls = self._cls[block]
            parked = where[block] == _PARKED
            assert where[block] in (_LISTED, _PARKED), f"block {block} marked {where[block]}"
            assert listed.get(block) == (None if parked else cls), f"block {block} is listed in {listed.get(block)}"
            assert cls // _KINDS == reuse_level(self._uses[block]), f"block {block} reuse class"
            assert 0 <= min(self._recent.get(block, 0), _MAX_USES) <= self._uses[block], f"block {block} recent reuses"
            assert cls % _KINDS == PARENT or not self._chains.has_children(block), \
                f"block {block} has a child but is not classed a parent"
            assert (cls % _KINDS == TIP) == (block == self._tip), f"block {block} tip kind"
            assert self._last[block] <= self._clock, f"block {block} accessed in the future"
            assert self._key[block] == hash(self._chains.links(block)[0]), f"block {block} key"
        assert all(where[block] for block in self._recent), "recent reuses of an untracked block"
        if self._model.table is self._keyed_table:  # else every key is computed again first
            for stream, key in enumerate(self._keys):
                end = self._ends[stream]
                if stream in self._dirty:
                    continue
                if end == _NONE:
                    assert key is None, f"empty stream {stream} keeps a key"
                    continue
                assert key is not None and key[1:] == (self._last[end], end, stream), f"stream {stream} key"
                due = any(at <= self._clock and at_stream == stream for at, at_stream in self._due)
                assert due or key[0] == self.density_of(BlockId(end)), f"stream {stream} key is stale"
        live = [g for g, alive in enumerate(self._ghost_live) if alive]
        assert len(self._ghost_cls) == len(self._ghost_uses) == len(self._ghost_last) == len(self._ghost_live) \
            == len(self._ghost_key), "ghost arrays differ in length"
        ghosts = {self._ghost_key[g]: g + self._ghost_base for g in live}
        assert len(ghosts) == len(live), "two live ghosts share a key"
        assert ghosts == dict(self._ghost_at.items()), "ghost map drifted"
        assert all(e >= self._ghost_oldest for e in ghosts.values()), "a ghost older than the oldest"
        for ghost_key, e in ghosts.items():
            assert e > self._evictions - self._ghost_limit(max(self.c, 1)), f"ghost {ghost_key} outlived its span"
        for ghost_key, recent in self._ghost_recent.items():
            at = self._ghost_at.get(ghost_key)
            assert at is not None, f"recent reuses of forgotten ghost {ghost_key}"
            assert 0 < min(recent, _MAX_USES) <= self._ghost_uses[at - self._ghost_base], \
                f"ghost {ghost_key} recent reuses"
        assert self._chains.parked is self._where, "the chain index reads other pin marks"
        self._shift.check_invariants()
        self._check_capacity()
        self._chains.check_invariants()
        self._model.check_invariants()
