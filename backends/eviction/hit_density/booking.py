"""The hit-density policy's per-block bookkeeping loops, one block after another.

This module's functions are the reference; :data:`LOOPS` holds them and their
compiled twins, the ``_booking`` extension's functions of the same contracts
(:mod:`~kvkit.backends.twins`). A policy runs the set in its ``_booking``;
the tests drive one policy of each on the same calls and compare every array,
map and counter.

:func:`book_inserts`, for the blocks ``start`` onwards of one insert call (ids
already valid, the per-block arrays already sized, the chain index already
holding the batch: ``parent_blocks`` and ``had_children`` are what it reported
per block):

* each block up to ``len(parent_blocks)`` (those the chain index took) is
  booked in order: its key (``hash(block_hash)``), its reuse count (from its
  ghost, if the ghost holds its key: the ghost leaves, and the reuse is
  learnt, recorded in the density model at the ghost's class and age), last
  access, class and mark; the previous tip becomes
  a parent or a leaf, a parent gains the parent kind; a block listed
  (``mark`` is the listed mark) enters its class list, and a listed block whose
  class changes moves to the young end of its new list;
* the booking stops right after the block whose tick reaches the policy's
  next refresh, and returns the index after the last block booked (the
  caller refreshes and calls again from there), else ``len(parent_blocks)``;
* the policy's clock, tracked count, tip and last reused hash are written
  back before it returns.

:func:`book_accesses`, for the blocks ``start`` onwards of one access call (a
block may repeat), counts a hit on each block in order:

* it stops before a block that is no int id of a tracked block (listed or
  parked), changing nothing for it, and returns its index (the caller refuses
  it);
* the policy's clock ticks, and the reuse is recorded in the density model at
  the block's class and age (the clock less its last access);
* it starts a reuse run (a sample for the shift test: its class's reuse level
  goes to the test's ``note``) unless its parent hash, as the chain index
  links it, is the hash reused last; either way its hash is the one reused
  last from then on;
* its reuse count gains one (saturating), its reuses since the last refresh
  (the recent map) gain one, its last access is now, and it enters the young
  end of the class of its new count and its kind (its list, if listed: the
  move happens even when the class stays);
* the loop stops right after the block whose tick reaches the next refresh,
  and returns the index after the last block counted (the caller refreshes
  and calls again from there), else ``len(blocks)``; the clock and the last
  reused hash are written back before it returns.

:func:`book_marks` moves tracked blocks between the places a block can be
(listed, parked, untracked): each block, in order, leaves its class list if
it is listed, enters the young end of its class's list if the new mark is the
listed one, and takes the mark. The ends that change are marked dirty.

:func:`book_pins` parks (``mark``: the parked mark) or lists again (the listed
mark) the blocks of one pin or unpin call:

* each block in order, while it is an int id of a block marked the other way
  (so not one named before in the call), takes ``mark`` as :func:`book_marks`
  gives it; the first block that is not stops the loop, changing nothing for
  it;
* the chain index hears of the blocks moved in one call
  (:meth:`~kvkit.backends.eviction._chains.FlatChains.pin_many` or
  :meth:`~kvkit.backends.eviction._chains.FlatChains.unpin_many`; none if none
  moved);
* it returns how many blocks moved: short of the call's, the next block is the
  one to refuse (not tracked, or already marked ``mark``), the caller's to raise.

:func:`book_removals` leaves a ghost for each block of one removal call (the
blocks distinct, already out of the chain index and untracked; ``c`` the
pool's capacity, at least 1):

* each block's key (as booked at its insert) is read first; a block's reuses
  since the last refresh (in the policy's recent map) move to its key in the
  ghosts' recent map, unless they are none;
* the turnover (``c`` times the mean gap between removals) takes one removal
  at a time: the call's first at the gap since the last removal (the first
  removal ever starts the clock), the rest at gap 0, each averaged over the
  removals so far up to ``c``; the float operations run in this order;
* the ghosts are appended in order, block ``k`` at eviction number
  ``evictions + 1 + k`` (class, reuse count, last access, key, live); then,
  in order, each key maps to its ghost's eviction number, and the live ghost
  it named before, if any (two hashes of one key), dies. The eviction count,
  turnover, last removal tick and tracked count are written back. The ghosts
  past their span are the caller's to forget.

:func:`forget_ghosts` forgets the live ghosts of indexes ``lo`` to ``hi - 1``
(``0 <= lo <= hi <=`` the ghost arrays' length): every ghost of the range is
marked dead, then each live one's key leaves the ghost map and the ghosts'
recent map, in order; each live one is recorded in the density model as a
history ended unreused, at its class and age (the policy's clock less its
last access).

The ghost keys a hash by Python's ``hash`` of it, an int of 64 bits that is
never -1, so it holds no Python object: an evicted block's hash object is
freed with the block, and a ghost is a few bytes in flat arrays and one entry
of the ghost map. Two hashes of one key (a 64-bit collision, which block
hashes digested from tokens all but never meet) share a ghost, the newer
replacing the older: what they teach merges, no block's data is involved.

:attr:`Booking.ghost_map` makes the policy's ghost map (``_ghost_at``, key to
eviction number): a ``dict`` with the references, the extension's
``GhostMap`` with the compiled loops. ``GhostMap`` keeps a dict's contract for
the methods it has (``[]``, ``in``, ``len``, ``get``, ``pop``, ``update``,
``keys``, ``values``, ``items``, ``==`` against a dict, pickling) for int keys
of 64 bits other than -1, in an open-addressing table of ints without
tombstones: each eviction puts one key in and the ghost's horizon takes one
out, and a dict's lookups of absent keys (most stores') slow down on the slots
its deletions leave. The references run on either map; a compiled loop given
any other map runs its reference.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from itertools import compress
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from kvkit.backends.eviction._chains import FlatChains
from kvkit.backends.twins import Twins
from kvkit.interfaces.types import BlockHash, BlockId

if TYPE_CHECKING:
    from kvkit.backends.eviction.hit_density import HitDensityPolicy

__all__ = ["LOOPS", "Booking", "book_accesses", "book_inserts", "book_marks", "book_pins", "book_removals",
           "forget_ghosts"]

LEAF, PARENT, TIP = 0, 1, 2
"""A block's *kind*: its hash never had a cached child; it had one; it is the block stored last,
which the next store may still continue (the only tip at any time)."""
KINDS = 3
NONE = -1  # no block, in the list links
MAX_USES = 255  # reuse counts saturate here (a byte each): far past the last level's least count
LISTED = 1  # where a block id is: in a class list (0: untracked; parked: the chain index's mark)
PARKED = FlatChains.PARKED


class BookInserts(Protocol):
    def __call__(self, policy: HitDensityPolicy, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
                 parents: Sequence[BlockHash | None], parent_blocks: Sequence[int], had_children: Sequence[bool],
                 mark: int, start: int, class_of: bytes) -> int:
        """Book ``blocks[start:]`` (module docstring); ``class_of[3 * min(uses, 16) + kind]`` is a class."""


class BookAccesses(Protocol):
    def __call__(self, policy: HitDensityPolicy, blocks: Sequence[BlockId], start: int, class_of: bytes) -> int:
        """Count a hit on each of ``blocks[start:]`` (module docstring)."""


class BookMarks(Protocol):
    def __call__(self, policy: HitDensityPolicy, blocks: Sequence[BlockId], mark: int) -> None:
        """Give each block ``mark``, leaving or entering its class list (module docstring)."""


class BookPins(Protocol):
    def __call__(self, policy: HitDensityPolicy, blocks: Sequence[BlockId], mark: int) -> int:
        """Park (``mark`` parked) or list again (listed) each block while it can; how many did (module docstring)."""


class BookRemovals(Protocol):
    def __call__(self, policy: HitDensityPolicy, blocks: Sequence[BlockId], c: int) -> None:
        """Leave a ghost for each of ``blocks`` and count the removals (module docstring)."""


class ForgetGhosts(Protocol):
    def __call__(self, policy: HitDensityPolicy, lo: int, hi: int) -> None:
        """Forget the live ghosts of indexes ``lo..hi - 1``, recording their ends (module docstring)."""


class Booking(NamedTuple):
    """The loops of one implementation (functions: a policy holding them copies and pickles), and the type of
    the ghost map they keep."""

    book_inserts: BookInserts
    book_accesses: BookAccesses
    book_marks: BookMarks
    book_pins: BookPins
    book_removals: BookRemovals
    forget_ghosts: ForgetGhosts
    ghost_map: Callable[[], MutableMapping[int, int]]


def book_inserts(policy: HitDensityPolicy, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
                 parents: Sequence[BlockHash | None], parent_blocks: Sequence[int], had_children: Sequence[bool],
                 mark: int, start: int, class_of: bytes) -> int:
    """Book ``blocks[start:]`` into ``policy``'s state until its next refresh is due (module docstring)."""
    p = policy
    classes, where, uses_of, last_of, move, ghost_at = p._cls, p._where, p._uses, p._last, p._move, p._ghost_at
    key_of, ghost_last, ghost_cls, ghost_uses, ghost_live, ghost_recent, base = p._key, p._ghost_last, \
        p._ghost_cls, p._ghost_uses, p._ghost_live, p._ghost_recent, p._ghost_base
    recent, note, turnover, record = p._recent, p._shift.note, p._turnover, p._model.record_reuse
    clock, tracked, tip, due, reused = p._clock, p._tracked, p._tip, p._next_refresh, p._reused
    listed = mark == LISTED
    top = len(class_of) // KINDS - 1  # the least count of the last reuse level
    i, n = start, len(parent_blocks)
    while i < n:
        block, block_hash, parent, parent_block = blocks[i], hashes[i], parents[i], parent_blocks[i]
        i += 1
        if tip is not None:  # stored before: a tip no more, a parent if this store continued it, else a leaf
            old = classes[tip]
            classes[tip] = cls = old - TIP + (PARENT if parent_block == tip else LEAF)
            if where[tip] == LISTED:  # a parked block enters its (new) class's list when unpinned
                move(tip, old, cls)
        clock += 1
        key = hash(block_hash)
        at = ghost_at.pop(key, None)
        if at is None:
            uses = 0
        else:  # a reuse the cache missed: learn from it, keep the history
            g = at - base
            cls, age = ghost_cls[g], clock - ghost_last[g]
            ghost_live[g] = 0
            record(cls, age)
            # It starts a reuse run unless its parent, as linked (a hash under itself heads its
            # chain), was reused just before.
            if parent is None or parent == block_hash or parent != reused:
                note(cls // KINDS)
            reused = block_hash
            gained = 1 + (age < turnover)  # back within a turnover: +1 more
            recent[block] = ghost_recent.pop(key, 0) + gained
            uses = min(ghost_uses[g] + gained, MAX_USES)
        row = KINDS * (uses if uses < top else top)
        if had_children[i - 1]:
            cls, tip = class_of[row + PARENT], None
        else:
            cls, tip = class_of[row + TIP], block
        uses_of[block] = uses
        last_of[block] = clock
        key_of[block] = key
        classes[block] = cls
        where[block] = mark  # a parked block keeps its class and enters its list when unpinned
        if listed:
            move(block, NONE, cls)
        tracked += 1
        if parent_block != NONE:
            old = classes[parent_block]
            kind = old % KINDS
            if kind != PARENT:  # its class's kind changes, its reuse level stays
                classes[parent_block] = cls = old - kind + PARENT
                if where[parent_block] == LISTED:
                    move(parent_block, old, cls)
        if clock >= due:
            break
    p._clock, p._tracked, p._tip, p._reused = clock, tracked, tip, reused
    return i


def book_accesses(policy: HitDensityPolicy, blocks: Sequence[BlockId], start: int, class_of: bytes) -> int:
    """Count a hit on each of ``blocks[start:]`` until ``policy``'s next refresh is due (module docstring)."""
    p = policy
    classes, where, uses_of, last_of, move, recent = p._cls, p._where, p._uses, p._last, p._move, p._recent
    links, note, record = p._chains.links, p._shift.note, p._model.record_reuse
    clock, due, reused = p._clock, p._next_refresh, p._reused
    top = len(class_of) // KINDS - 1  # the least count of the last reuse level
    i, n, size = start, len(blocks), len(where)
    while i < n:
        block = blocks[i]
        if block.__class__ is not int or not 0 <= block < size or not where[block]:
            break  # not tracked: the caller's to refuse
        i += 1
        cls = classes[block]
        clock += 1
        record(cls, clock - last_of[block])
        block_hash, parent = links(block)
        if parent is None or parent != reused:  # it starts a reuse run
            note(cls // KINDS)
        reused = block_hash
        uses = uses_of[block]
        if uses < MAX_USES:
            uses_of[block] = uses = uses + 1
        recent[block] = recent.get(block, 0) + 1
        last_of[block] = clock
        classes[block] = new = class_of[KINDS * (uses if uses < top else top) + cls % KINDS]
        if where[block] == LISTED:
            move(block, cls, new)
        if clock >= due:
            break
    p._clock, p._reused = clock, reused
    return i


def book_marks(policy: HitDensityPolicy, blocks: Sequence[BlockId], mark: int) -> None:
    """Give each of ``blocks`` (tracked, distinct) ``mark``, leaving or entering its class list (module docstring)."""
    where, classes, move = policy._where, policy._cls, policy._move
    for block in blocks:
        cls = classes[block]
        move(block, cls if where[block] == LISTED else NONE, cls if mark == LISTED else NONE)
        where[block] = mark


def book_pins(policy: HitDensityPolicy, blocks: Sequence[BlockId], mark: int) -> int:
    """Give each of ``blocks`` ``mark`` (parked or listed) while it is tracked with the other one; tell the
    chain index; return how many moved (module docstring)."""
    where, classes, move = policy._where, policy._cls, policy._move
    listed = mark == LISTED
    other, size = PARKED if listed else LISTED, len(where)
    moved: list[BlockId] = []
    for block in blocks:
        if block.__class__ is not int or not 0 <= block < size or where[block] != other:
            break  # the caller's to refuse
        cls = classes[block]
        if listed:
            move(block, NONE, cls)
        else:
            move(block, cls, NONE)
        where[block] = mark
        moved.append(block)
    if moved:
        chains = policy._chains
        (chains.unpin_many if listed else chains.pin_many)(moved)
    return len(moved)


def book_removals(policy: HitDensityPolicy, blocks: Sequence[BlockId], c: int) -> None:
    """Leave a ghost for each of ``blocks`` (untracked) and count the removals in a pool of ``c`` blocks
    (module docstring)."""
    p = policy
    keys = list(map(p._key.__getitem__, blocks))
    recent, ghost_recent = p._recent, p._ghost_recent
    clock, evictions, turnover, last = p._clock, p._evictions, p._turnover, p._last_removal
    first = evictions + 1  # the first block's eviction number
    if recent:  # a block's reuses since the last refresh go with its ghost
        for block, key in compress(zip(blocks, keys), map(recent.__contains__, blocks)):
            reuses = recent.pop(block)
            if reuses:
                ghost_recent[key] = reuses
    if blocks:
        # The mean gap between removals, one removal at a time: the first one starts the clock
        # (the fill before it is no gap), the rest of the call leave at the same tick (gap 0).
        gone = len(blocks)
        if evictions:
            turnover += ((clock - last) * c - turnover) / (evictions if evictions < c else c)
        evictions += 1
        while evictions < c and evictions < first + gone - 1:
            turnover -= turnover / evictions
            evictions += 1
        for _ in range(first + gone - 1 - evictions):
            turnover -= turnover / c
        evictions, last = first + gone - 1, clock
    # Each ghost's index is its eviction number less _ghost_base: they are appended in order.
    p._ghost_cls.extend(map(p._cls.__getitem__, blocks))  # a block's class and counters outlive it
    p._ghost_uses.extend(map(p._uses.__getitem__, blocks))
    p._ghost_last.extend(map(p._last.__getitem__, blocks))
    p._ghost_key.extend(keys)
    live, ghost_at, base = p._ghost_live, p._ghost_at, p._ghost_base
    live += b"\x01" * len(keys)
    for number, key in enumerate(keys, first):  # a key names its newest ghost: an older one of it dies
        old = ghost_at.get(key)
        if old is not None:
            live[old - base] = 0
        ghost_at[key] = number
    p._tracked -= len(keys)
    p._evictions, p._turnover, p._last_removal = evictions, turnover, last


def forget_ghosts(policy: HitDensityPolicy, lo: int, hi: int) -> None:
    """Forget the live ghosts of indexes ``lo`` to ``hi - 1``, recording their ends in the model (module
    docstring)."""
    p = policy
    live = p._ghost_live
    forgotten = np.flatnonzero(np.frombuffer(live[lo:hi], dtype=np.uint8))
    if not len(forgotten):
        return
    keys = np.frombuffer(p._ghost_key, dtype=np.int64)[lo:hi][forgotten].tolist()
    live[lo:hi] = bytes(hi - lo)
    ghost_at, recent = p._ghost_at, p._ghost_recent
    for key in keys:
        del ghost_at[key]
    if recent:
        for key in keys:
            recent.pop(key, None)
    classes = np.frombuffer(p._ghost_cls[lo:hi], dtype=np.uint8)[forgotten]
    lasts = np.frombuffer(p._ghost_last[lo:hi], dtype=np.int64)[forgotten]
    p._model.record_ends(classes.tolist(), (p._clock - lasts).tolist())


LOOPS: Twins[Booking] = Twins.load(Booking(book_inserts, book_accesses, book_marks, book_pins, book_removals,
                                           forget_ghosts, dict), "kvkit.backends.eviction.hit_density._booking")
