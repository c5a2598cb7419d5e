"""An ordered queue of blocks that sets pinned blocks aside at once, keeping their place (private).

FIFO, LRU, LFU (one queue per frequency), ARC (``T1``, ``T2``) and LIRS (LIR, HIR) keep their
blocks in the order they entered a queue. A block in use (pinned) must not
be evicted, yet when it is released it must be evicted exactly where it would
have been had it never been pinned: its place is the moment it entered. Left
in the queue, pinned blocks at the old end are scanned by selections (O(pool)
when most of the pool is referenced); moved to the young end on release, they
change the policy's order (and its hit ratio).

:class:`ParkingQueue` keeps both properties: each block carries a stamp (a
clock's value when it entered); a pinned block is *parked* (out of the queue,
its stamp kept) the moment it is pinned, and a parked block released goes back
by its stamp: appended when its stamp is the youngest (the common case: blocks
released in the order they entered), else into a sorted side list that walks
merge with the queue. A walk therefore never meets a pinned block: a
selection costs O(victims), its first included, however many blocks are in
use. The driver must report every pin (a pool calls the pin hooks for every
block, and commits blocks referenced, so a committed block enters parked).

The bookkeeping is flat: a block's links, stamp and state sit in arrays
indexed by block id (:class:`Slots`, shared by the queues of one policy), and
the queue is an intrusive doubly linked list through them; only the side
list holds one int per block, for blocks released out of order until they
leave it.

It can also *watch* its first ``n`` unpinned blocks (the next victims) and
report those that joined them, so a write-back store policy examines only
what changed (:meth:`ParkingQueue.watch`).

The batch loops a scheduler step runs per block (:meth:`ParkingQueue.add_many`,
:meth:`~ParkingQueue.add_pinned_many`, :meth:`~ParkingQueue.pin_many`, :meth:`~ParkingQueue.unpin_many`,
:meth:`~ParkingQueue.remove_many`, :meth:`~ParkingQueue.touch_many`) and the selection
(:meth:`~ParkingQueue.first`) run the set of :data:`LOOPS` a queue holds in its ``_loops``
(:mod:`~kvkit.backends.twins`): the compiled ``_queue_loops`` module's functions where that extension was
built, else their Python references (the methods named ``*_reference``), which hold the contract; the tests
drive both on the same calls and compare the whole state, the side list chunk by chunk (the compiled loops
change its chunks in place as its methods do, so blocks released out of order cost no Python call). The set
also holds :meth:`ParkingQueue.add` (the method itself its reference), which compiled callers run per block.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterator, Sequence
from itertools import chain, islice, repeat
from typing import NamedTuple, cast

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import already_tracked, any_block, bad_id, not_tracked, pin_mismatch
from kvkit.backends.twins import Twins
from kvkit.interfaces.types import BlockId
from kvkit.validate import plural

__all__ = ["LOOPS", "ParkingQueue", "QueueLoops", "QueuedPins", "Slots"]

_ABSENT, _MAIN, _PARKED, _BACK = 0, 1, 2, 3  # a block's state in its queue
_NIL = -1  # no block: the end of a list
_SHIFT = 32  # a side-list key is stamp << _SHIFT | block
_MASK = (1 << _SHIFT) - 1


class Slots:
    """The per-block state of the :class:`ParkingQueue` s of one policy, in flat arrays indexed by block id.

    ``prev`` / ``next`` link a queue's unpinned blocks in order (``-1``: none),
    ``stamp`` is a block's place (the shared clock when it entered its
    queue), and ``state`` says which queue holds it and how: ``qid << 2 |
    part``, ``part`` being absent (0), in the queue's list, parked or in its
    side list. A queue alone on its slots is queue 0 and its states fit a
    byte; shared slots number their queues from 1. The arrays grow with the
    largest block id seen, by an eighth at least, so the policy needs no pool
    size.

    Invariant: the arrays have one length; a block is in at most one queue.
    """

    __slots__ = ("clock", "next", "prev", "queues", "stamp", "state")

    def __init__(self, shared: bool = False) -> None:
        self.prev = array("i")
        self.next = array("i")
        self.stamp = array("q")
        self.state = array("q" if shared else "b")
        self.clock = 0
        self.queues = 0

    def __len__(self) -> int:
        return len(self.state)

    def grow(self, block: int) -> None:
        """Make room for ids up to ``block`` (an int >= 0)."""
        size = len(self.state)
        extra = max(block + 1, size + (size >> 3) + 64) - size
        self.prev.extend(repeat(_NIL, extra))
        self.next.extend(repeat(_NIL, extra))
        self.stamp.extend(repeat(0, extra))
        self.state.extend(repeat(_ABSENT, extra))

    def __deepcopy__(self, memo: dict) -> Slots:
        copy = Slots.__new__(Slots)
        copy.__setstate__(self.__getstate__())
        memo[id(self)] = copy
        return copy

    @override
    def __getstate__(self) -> tuple:
        return (array("i", self.prev), array("i", self.next), array("q", self.stamp),
                array(self.state.typecode, self.state), self.clock, self.queues)

    def __setstate__(self, state: tuple) -> None:
        self.prev, self.next, self.stamp, self.state, self.clock, self.queues = state


class _SortedKeys:
    """Distinct ints in ascending order: sorted chunks, each at most ``2 * chunk`` long, and their maxima.

    Inserting or removing one costs O(log n) comparisons plus a chunk's move
    (C-level), never a pass over the others. Removals never merge chunks, so
    removing keys one at a time or in one :meth:`remove_many` leaves the same
    chunks.
    """

    __slots__ = ("_chunks", "_maxes")
    chunk = 512  # a chunk splits in two halves past twice this (read by the compiled loops too)

    def __init__(self) -> None:
        self._chunks: list[list[int]] = []
        self._maxes: list[int] = []

    def __bool__(self) -> bool:
        return bool(self._maxes)

    def __len__(self) -> int:
        return sum(map(len, self._chunks))

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self._chunks)

    def __deepcopy__(self, memo: dict) -> _SortedKeys:
        copy = _SortedKeys()
        copy._chunks = [list(c) for c in self._chunks]
        copy._maxes = list(self._maxes)
        return copy

    @override
    def __getstate__(self) -> tuple:
        return self._chunks, self._maxes

    def __setstate__(self, state: tuple) -> None:
        self._chunks, self._maxes = state

    @property
    def max(self) -> int:
        return self._maxes[-1]

    def add(self, key: int) -> None:
        maxes, chunks = self._maxes, self._chunks
        i = bisect_left(maxes, key)
        if i == len(maxes):
            if not maxes:
                chunks.append([key])
                maxes.append(key)
                return
            i -= 1
            chunk = chunks[i]
            chunk.append(key)
            maxes[i] = key
        else:
            chunk = chunks[i]
            insort(chunk, key)
        half = self.chunk
        if len(chunk) > 2 * half:
            chunks.insert(i + 1, chunk[half:])
            del chunk[half:]
            maxes.insert(i, chunk[-1])

    def remove(self, key: int) -> None:
        maxes, chunks = self._maxes, self._chunks
        i = bisect_left(maxes, key)
        chunk = chunks[i]
        j = bisect_left(chunk, key)
        assert chunk[j] == key, f"side-list key {key} is not listed"
        del chunk[j]
        if not chunk:
            del chunks[i], maxes[i]
        elif j == len(chunk):
            maxes[i] = chunk[-1]

    def remove_many(self, keys: list[int]) -> None:
        """Remove each of ``keys`` (all listed, distinct): the chunks that :meth:`remove` one at a time leaves."""
        keys.sort()
        maxes, chunks = self._maxes, self._chunks
        i = k = 0
        while k < len(keys):
            i = bisect_left(maxes, keys[k], i)
            stop = bisect_right(keys, maxes[i], k)  # the keys in chunk i
            gone = set(keys[k:stop])
            chunk = chunks[i]
            kept = [key for key in chunk if key not in gone]
            assert len(kept) == len(chunk) - len(gone), "a side-list key is not listed"
            if kept:
                chunks[i] = kept
                maxes[i] = kept[-1]
                i += 1
            else:
                del chunks[i], maxes[i]
            k = stop

    def after(self, key: int) -> int | None:
        """The least key above ``key``, or ``None``."""
        maxes = self._maxes
        i = bisect_right(maxes, key)
        if i == len(maxes):
            return None
        chunk = self._chunks[i]
        return chunk[bisect_right(chunk, key)]

    def before(self, key: int) -> int | None:
        """The greatest key below ``key``, or ``None``."""
        maxes = self._maxes
        i = bisect_left(maxes, key)
        if i < len(maxes):
            chunk = self._chunks[i]
            j = bisect_left(chunk, key)
            if j:
                return chunk[j - 1]
        return self._maxes[i - 1] if i else None


@attrs.define
class ParkingQueue:
    """Blocks in the order they entered (stamp order), each pinned (parked) or not.

    Parts (a block is in exactly one, its ``Slots.state``):

    * the *list*: unpinned blocks linked in ascending stamp order through
      ``Slots.prev`` / ``Slots.next`` (``_head`` to ``_tail``): the blocks in
      entry order, except those released out of order. Its blocks with stamps
      up to ``_edge`` form a prefix, the watched *region*; ``_cut`` is the
      first block past it (``-1``: none).
    * *parked*: pinned blocks, out of the queue, their stamps kept.
    * the *side list* ``_back``: blocks released with a stamp older than the
      list's youngest, as sorted keys ``stamp << 32 | block``.

    The unpinned order is the merge by stamp of the list and the side list:
    the order blocks entered the queue, pins ignored. FIFO and LRU *are* such
    a queue (its methods are their hooks, one call each on the hot path);
    LFU, ARC and LIRS hold several sharing one :class:`Slots`, made by
    :meth:`of` through :class:`QueuedPins`. Misuse raises ``PoolUsageError``
    naming the policy.

    Watching ``n`` (:meth:`watch`): the region is every unpinned block with a
    stamp up to ``_edge``, and holds ``_count == min(n, unpinned blocks)``
    blocks after every call, so they are exactly the first ``n`` a walk
    yields when ``is_evictable`` is true for every unpinned block (a driver
    that reports every pin). Blocks that join the region are noted for
    :meth:`entered`.

    Invariants:
        * The parts are disjoint and hold ``_len`` blocks, all owned by this queue.
        * Stamps ascend through the list; those up to ``_edge`` come first and
          ``_cut`` is the first above it; each stamp belongs to one block.
        * Every side-list key names a block in the side list and its stamp.
        * ``_count`` is the number of region blocks (the list's and the side
          list's stamps up to ``_edge``) and equals ``min(_size, unpinned blocks)``.
    """

    _slots: Slots = attrs.field(factory=Slots, init=False, repr=False)
    _base: int = attrs.field(default=0, init=False, repr=False)  # qid << 2: this queue's states are _base | part
    _len: int = attrs.field(default=0, init=False)
    _head: int = attrs.field(default=_NIL, init=False)
    _tail: int = attrs.field(default=_NIL, init=False)
    _back: _SortedKeys = attrs.field(factory=_SortedKeys, init=False, repr=False)
    _owner: object = attrs.field(default=None, init=False, repr=False, eq=False)
    # The watched window: its size (0: not watching), blocks in the region, its edge, the list's first block past it.
    _size: int = attrs.field(default=0, init=False)
    _count: int = attrs.field(default=0, init=False)
    _edge: int = attrs.field(default=0, init=False)
    _cut: int = attrs.field(default=_NIL, init=False)
    _pending: int = attrs.field(default=_NIL, init=False)  # the youngest block, not linked yet (see add)
    _entered: list[BlockId] = attrs.field(factory=list, init=False, repr=False)
    # The batch loops: compiled where they were built (the tests set the references to compare the two).
    _loops: QueueLoops = attrs.field(init=False, eq=False, repr=False, factory=lambda: LOOPS.default())

    @classmethod
    def of(cls, owner: object, slots: Slots | None = None) -> ParkingQueue:
        """An empty queue whose errors name ``owner`` (the policy holding it), on ``slots`` if given (shared)."""
        queue = cls()
        queue._owner = owner
        if slots is not None:
            slots.queues += 1
            queue._slots, queue._base = slots, slots.queues << 2
        return queue

    def __len__(self) -> int:
        return self._len

    def _part(self, block: object) -> int:
        """Where ``block`` sits in this queue: ``_ABSENT`` (also for any value that is no id), ``_MAIN``, ..."""
        states = self._slots.state
        if block.__class__ is not int or not -1 < block < len(states):
            return _ABSENT
        state = states[block]
        return state & 3 if state >> 2 == self._base >> 2 else _ABSENT

    def __contains__(self, block: object) -> bool:
        return self._part(block) != _ABSENT

    def _blocks(self, *parts: int) -> list[BlockId]:
        """This queue's blocks in ``parts``, by id (O(ids seen): tests, notebooks)."""
        wanted = {self._base | part for part in parts}
        return [BlockId(b) for b, state in enumerate(self._slots.state) if state in wanted]

    @property
    def pinned(self) -> set[BlockId]:
        """The pinned (parked) blocks (a new set)."""
        return set(self._blocks(_PARKED))

    # -- the list ----------------------------------------------------------------

    def _link(self, block: int) -> None:
        """Link ``block`` (stamped, in the list's state) at the list's young end: its stamp is the youngest."""
        slots = self._slots
        tail = self._tail
        slots.prev[block] = tail
        slots.next[block] = _NIL
        if tail == _NIL:
            self._head = block
        else:
            slots.next[tail] = block
        self._tail = block
        if self._cut == _NIL:
            self._cut = block

    def _flush(self) -> None:
        """Link the block :meth:`add` left pending (it is the youngest: nothing entered since)."""
        block, self._pending = self._pending, _NIL
        self._link(block)

    def _unlink(self, block: int) -> None:
        slots = self._slots
        before, after = slots.prev[block], slots.next[block]
        if before == _NIL:
            self._head = after
        else:
            slots.next[before] = after
        if after == _NIL:
            self._tail = before
        else:
            slots.prev[after] = before
        if block == self._cut:
            self._cut = after

    # -- membership ------------------------------------------------------------

    def add(self, block: BlockId, pinned: bool = False) -> None:
        """Enter ``block`` at the young end; pinned, it is parked at once.

        An unpinned block past the watched window is linked by the next call
        that needs the list (a pool pins a block right after inserting it:
        then it never is).

        Raises:
            PoolUsageError: ``block`` is in the queue (or another of its slots'), or a negative int.
        """
        slots = self._slots
        states = slots.state
        if not -1 < block < len(states):
            if block < 0:
                raise bad_id(self._who(), block)
            slots.grow(block)
            states = slots.state
        elif states[block]:
            raise already_tracked(self._who(), block)
        if self._pending != _NIL:
            self._flush()
        slots.clock = slots.stamp[block] = slots.clock + 1
        self._len += 1
        if pinned:
            states[block] = self._base | _PARKED
            return
        states[block] = self._base | _MAIN
        if self._count < self._size:
            self._link(block)
            self._settle()
        else:
            self._pending = block

    def add_many(self, blocks: Sequence[BlockId], pinned: Sequence[bool]) -> None:
        """:meth:`add` each of ``blocks`` with its flag in ``pinned``, in order (paired to the shorter's end;
        ``PoolUsageError`` at the first refused block, those before it added)."""
        self._loops.add_many(self, blocks, pinned)

    def add_many_reference(self, blocks: Sequence[BlockId], pinned: Sequence[bool]) -> None:
        """:meth:`add_many` in Python: the reference of the compiled loop."""
        for block, pin in zip(blocks, pinned):
            self.add(block, pin)

    def add_pinned_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`add` then :meth:`pin` each of ``blocks`` in order (a pool inserts blocks in use)."""
        self._loops.add_pinned_many(self, blocks)

    def add_pinned_many_reference(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`add_pinned_many` in Python: the reference of the compiled loop."""
        for block in blocks:
            self.add(block)
            self.pin(block)

    def reserve(self, k: int) -> int:
        """Set aside ``k`` consecutive stamps, younger than every block's, for :meth:`enter_at`; return the first."""
        slots = self._slots
        first = slots.clock + 1
        slots.clock += k
        return first

    def enter_at(self, block: BlockId, stamp: int, pinned: bool) -> None:
        """Enter ``block`` at ``stamp``, one of :meth:`reserve`'s, as if :meth:`add` had entered it then.

        It is parked there and, unpinned, released at once: it takes its place
        among the blocks by stamp, however many entered since the reservation.

        Raises:
            PoolUsageError: ``block`` is in the queue (or another of its slots').
        """
        states = self._slots.state
        if states[block]:
            raise already_tracked(self._who(), block)
        states[block] = self._base | _PARKED
        self._slots.stamp[block] = stamp
        self._len += 1
        if not pinned:
            self.unpin(block)

    def remove(self, block: BlockId) -> bool:
        """Take ``block`` out; return whether it was pinned.

        Raises:
            PoolUsageError: ``block`` is not in the queue.
        """
        if self._pending != _NIL:
            self._flush()
        slots = self._slots
        states = slots.state
        part = states[block] - self._base if block.__class__ is int and -1 < block < len(states) else -1
        if part == _PARKED:
            states[block] = _ABSENT
            self._len -= 1
            return True
        if part == _MAIN:
            self._unlink(block)
        elif part == _BACK:
            self._back.remove(slots.stamp[block] << _SHIFT | block)
        else:
            raise not_tracked(self._who(), block)
        states[block] = _ABSENT
        self._len -= 1
        if slots.stamp[block] <= self._edge:
            self._count -= 1
            self._settle()
        return False

    def remove_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`remove` for each block, in order (``PoolUsageError`` at the first absent one, those before it
        removed)."""
        self._loops.remove_many(self, blocks)

    def remove_many_reference(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`remove_many` in Python: the reference of the compiled loop."""
        if self._pending != _NIL:
            self._flush()
        slots = self._slots
        states, stamp, unlink, listed = slots.state, slots.stamp, self._unlink, self._base | _MAIN
        for block in blocks:
            if block.__class__ is not int or not -1 < block < len(states) or states[block] != listed \
                    or stamp[block] <= self._edge:
                self.remove(block)  # parked, in the side list, watched or no block here: the general case
                continue
            unlink(block)
            states[block] = _ABSENT
            self._len -= 1

    def touch(self, block: BlockId) -> None:
        """Re-enter ``block`` at the young end, keeping its pin (``PoolUsageError`` if absent)."""
        if self._pending != _NIL:
            self._flush()
        slots = self._slots
        states = slots.state
        part = states[block] - self._base if block.__class__ is int and -1 < block < len(states) else -1
        if part == _PARKED:
            slots.clock = slots.stamp[block] = slots.clock + 1
        elif part == _MAIN and slots.stamp[block] > self._edge:
            self._unlink(block)
            slots.clock = slots.stamp[block] = slots.clock + 1
            self._link(block)
        else:
            self.add(block, pinned=self.remove(block))

    def touch_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`touch` each of ``blocks`` in order (``PoolUsageError`` at the first absent one, those before it
        touched)."""
        self._loops.touch_many(self, blocks)

    def touch_many_reference(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`touch_many` in Python: the reference of the compiled loop."""
        for block in blocks:
            self.touch(block)

    # -- pins --------------------------------------------------------------------

    def pin(self, block: BlockId) -> None:
        """Mark ``block`` in use: it is parked, keeping its stamp (a pool's ``on_pin``).

        Raises:
            PoolUsageError: ``block`` is not in the queue, or already pinned.
        """
        if block.__class__ is int and block == self._pending != _NIL:  # pinned as it entered: never linked
            self._pending = _NIL
            self._slots.state[block] = self._base | _PARKED
            return
        if self._pending != _NIL:
            self._flush()
        slots = self._slots
        states = slots.state
        base = self._base
        part = states[block] - base if block.__class__ is int and -1 < block < len(states) else -1
        if part == _MAIN:
            self._unlink(block)
        elif part == _BACK:
            self._back.remove(slots.stamp[block] << _SHIFT | block)
        elif part == _PARKED:
            raise pin_mismatch(self._who(), block, pinned=True)
        else:
            raise not_tracked(self._who(), block)
        states[block] = base | _PARKED
        if slots.stamp[block] <= self._edge:
            self._count -= 1
            self._settle()

    def pin_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`pin` each of ``blocks`` in order; the side list loses its blocks in one pass.

        Watching a window, each pin may move the region: then one at a time.
        """
        self._loops.pin_many(self, blocks)

    def pin_many_reference(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`pin_many` in Python: the reference of the compiled loop."""
        if self._size:
            for block in blocks:
                self.pin(block)
            return
        slots = self._slots
        states, stamps, base = slots.state, slots.stamp, self._base
        start = 0
        if self._pending != _NIL and blocks:  # only a first block can still be the unlinked youngest
            if blocks[0].__class__ is int and blocks[0] == self._pending:
                self._pending = _NIL
                states[blocks[0]] = base | _PARKED
                start = 1
            else:
                self._flush()
        back: list[int] = []
        size, unlink, parked = len(states), self._unlink, base | _PARKED
        try:
            for block in blocks[start:]:
                part = states[block] - base if block.__class__ is int and -1 < block < size else -1
                if part == _MAIN:
                    unlink(block)
                elif part == _BACK:  # unwatched, so no pin moves a region: the side list can wait
                    back.append(stamps[block] << _SHIFT | block)
                elif part == _PARKED:
                    raise pin_mismatch(self._who(), block, pinned=True)
                else:
                    raise not_tracked(self._who(), block)
                states[block] = parked
        finally:
            if back:
                self._back.remove_many(back)

    def unpin(self, block: BlockId) -> None:
        """Release ``block`` at the place it entered (a pool's ``on_unpin``).

        Raises:
            PoolUsageError: ``block`` is not in the queue, or not pinned.
        """
        if self._pending != _NIL:
            self._flush()
        slots = self._slots
        states = slots.state
        base = self._base
        if block.__class__ is not int or not -1 < block < len(states) or states[block] != base | _PARKED:
            if self._part(block) != _ABSENT:
                raise pin_mismatch(self._who(), block, pinned=False)
            raise not_tracked(self._who(), block)
        stamps = slots.stamp
        stamp = stamps[block]
        tail = self._tail
        if stamp > self._edge and (tail == _NIL or stamp > stamps[tail]):
            states[block] = base | _MAIN  # the youngest unpinned block: its place is the list's end
            self._link(block)
            if self._count < self._size:
                self._settle()
            return
        states[block] = base | _BACK
        self._back.add(stamp << _SHIFT | block)
        if stamp <= self._edge:
            self._joined(block)
        elif self._count < self._size:
            self._settle()

    def unpin_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`unpin` each of ``blocks`` in order (``PoolUsageError`` at the first refused one, those before
        it released)."""
        self._loops.unpin_many(self, blocks)

    def unpin_many_reference(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`unpin_many` in Python: the reference of the compiled loop."""
        for block in blocks:
            self.unpin(block)

    # -- selection ---------------------------------------------------------------

    def first(self, n: int, is_evictable: Callable[[BlockId], bool]) -> list[BlockId]:
        """Up to ``n`` unpinned blocks with ``is_evictable`` true, oldest first; changes nothing."""
        return self._loops.first(self, n, is_evictable)

    def first_reference(self, n: int, is_evictable: Callable[[BlockId], bool]) -> list[BlockId]:
        """:meth:`first` in Python: the reference of the compiled loop."""
        if n <= 0:
            return []
        if self._pending != _NIL:
            self._flush()
        if not self._back:  # the common case: no block released out of order
            head: list[int] = []
            after, block = self._slots.next, self._head
            while block != _NIL and len(head) < n:
                head.append(block)
                block = after[block]
            if all(map(cast(Callable[[int], bool], is_evictable), head)):
                return cast(list[BlockId], head)
        return list(islice(self.walk(is_evictable), n))

    def walk(self, is_evictable: Callable[[BlockId], bool]) -> Iterator[BlockId]:
        """Yield the unpinned blocks with ``is_evictable`` true, oldest first (the queue must not change meanwhile).

        A driver that reports every pin makes ``is_evictable`` true for every
        block yielded; one that reports none gets the in-use blocks skipped here.
        """
        return cast(Iterator[BlockId], self._walk(cast(Callable[[int], bool], is_evictable)))

    def _walk(self, is_evictable: Callable[[int], bool]) -> Iterator[int]:
        if self._pending != _NIL:
            self._flush()
        after, stamps = self._slots.next, self._slots.stamp
        block = self._head
        if is_evictable is any_block and not self._back:  # the list alone, nothing to ask (orphan walks)
            while block != _NIL:
                yield block
                block = after[block]
            return
        keys = iter(self._back)
        key = next(keys, None)
        while block != _NIL:
            bound = stamps[block] << _SHIFT
            while key is not None and key < bound:
                if is_evictable(key & _MASK):
                    yield key & _MASK
                key = next(keys, None)
            if is_evictable(block):
                yield block
            block = after[block]
        while key is not None:
            if is_evictable(key & _MASK):
                yield key & _MASK
            key = next(keys, None)

    # -- the watched window ------------------------------------------------------

    def watch(self, n: int) -> None:
        """Track the first ``n`` unpinned blocks from now on (``0``: stop); O(change)."""
        if n != self._size:
            if self._pending != _NIL:
                self._flush()
            self._size = n
            self._settle()

    def in_window(self, block: BlockId) -> bool:
        """Whether ``block`` is one of the first ``n`` unpinned blocks (``n`` watched)."""
        part = self._part(block)
        return part in (_MAIN, _BACK) and self._slots.stamp[block] <= self._edge

    def entered(self) -> list[BlockId]:
        """The blocks that joined the window since the last call and are still in it, in joining order."""
        entered, self._entered = self._entered, []
        if len(entered) > 4 * self._size + 64:  # joined and left many times: the window itself is shorter
            return self.first(self._size, any_block)
        return [b for b in dict.fromkeys(entered) if self.in_window(b)]

    def _joined(self, block: BlockId) -> None:
        """``block`` became an unpinned region block."""
        self._count += 1
        self._entered.append(block)
        if self._count > self._size:
            self._settle()

    def _settle(self) -> None:
        """Grow or shrink the region until it holds ``min(_size, evictable)`` unpinned blocks."""
        while self._count < self._size and self._grow():
            pass
        while self._count > self._size:
            self._shrink()

    def _grow(self) -> bool:
        """Take the next unpinned block past the edge into the region; ``False`` if there is none."""
        back_next = self._back.after(self._edge << _SHIFT | _MASK) if self._back else None
        cut, stamps = self._cut, self._slots.stamp
        if cut != _NIL and (back_next is None or stamps[cut] < back_next >> _SHIFT):
            self._edge = stamps[cut]
            self._cut = self._slots.next[cut]
            self._count += 1
            self._entered.append(BlockId(cut))
            return True
        if back_next is None:
            return False
        self._edge = back_next >> _SHIFT
        self._count += 1
        self._entered.append(BlockId(back_next & _MASK))
        return True

    def _shrink(self) -> None:
        """Give the region's last block back to the rest of the queue."""
        back_last = self._back.before((self._edge + 1) << _SHIFT) if self._back else None
        slots = self._slots
        last = slots.prev[self._cut] if self._cut != _NIL else self._tail
        if last != _NIL and slots.stamp[last] <= self._edge and \
                (back_last is None or slots.stamp[last] > back_last >> _SHIFT):
            self._edge = slots.stamp[last] - 1
            self._cut = last
            self._count -= 1
            return
        assert back_last is not None, "the region holds more blocks than it has"
        self._edge = (back_last >> _SHIFT) - 1
        self._count -= 1

    # -- helpers -----------------------------------------------------------------

    def in_order(self) -> list[BlockId]:
        """Every block, pinned or not, in the order it entered (O(ids seen + n log n): tests, notebooks)."""
        stamps = self._slots.stamp
        return sorted(self._blocks(_MAIN, _PARKED, _BACK), key=stamps.__getitem__)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the parts overlap, a stamp is out of order or the window is off."""
        if self._pending != _NIL:
            self._flush()  # changes no order: the pending block is the youngest
        slots = self._slots
        listed, block, before = [], self._head, _NIL
        while block != _NIL:
            assert self._part(block) == _MAIN, f"listed block {block} is not in the list"
            assert slots.prev[block] == before, f"block {block} links back to {slots.prev[block]}, not {before}"
            listed.append(block)
            assert len(listed) <= self._len, "the list loops"
            before, block = block, slots.next[block]
        assert before == self._tail, f"the list ends at {before}, its tail is {self._tail}"
        stamps = [slots.stamp[b] for b in listed]
        assert stamps == sorted(stamps), "queue out of stamp order"
        region = [b for b in listed if slots.stamp[b] <= self._edge]
        assert listed[:len(region)] == region, "a block before the edge outside the region"
        cut = listed[len(region)] if len(region) < len(listed) else _NIL
        assert self._cut == cut, f"the cut is {self._cut}, the first block past the edge {cut}"
        keys = list(self._back)
        assert keys == sorted(set(keys)), "back list out of order"
        for key in keys:
            assert self._part(key & _MASK) == _BACK and slots.stamp[key & _MASK] == key >> _SHIFT, \
                f"side-list key {key!r}: its block is not in the side list under that stamp"
        parked, back = self._blocks(_PARKED), self._blocks(_BACK)
        assert len(back) == len(keys), "back maps disagree"
        main = self._blocks(_MAIN)
        assert len(main) == len(listed), f"{plural(len(main), 'block')} in the list state, {len(listed)} listed"
        assert len(main) + len(parked) + len(back) == self._len, "a block is in two parts of the queue"
        every = [*stamps, *(slots.stamp[b] for b in parked), *(k >> _SHIFT for k in keys)]
        assert len(set(every)) == len(every), "a stamp is shared"
        assert not every or max(every) <= slots.clock, "a stamp from the future"
        count = len(region) + sum(1 for k in keys if k >> _SHIFT <= self._edge)
        assert count == self._count, f"window counts {self._count}, holds {count}"
        unpinned = len(listed) + len(keys)
        assert self._count == min(self._size, unpinned), (self._count, self._size, unpinned)

    def _who(self) -> object:
        return self if self._owner is None else self._owner


class QueueLoops(NamedTuple):
    """The loops a :class:`ParkingQueue` runs, each called with the queue first.

    ``add`` is :meth:`ParkingQueue.add` (the method is its reference), for a compiled caller (the chain
    index's loops) to call the queue's own set without a Python frame; such a caller enters a batch with
    ``add_many`` (the chain index's ``add_many``, the orphans of a call in one).
    """

    add: Callable[[ParkingQueue, BlockId, bool], None]
    add_many: Callable[[ParkingQueue, Sequence[BlockId], Sequence[bool]], None]
    add_pinned_many: Callable[[ParkingQueue, Sequence[BlockId]], None]
    pin_many: Callable[[ParkingQueue, Sequence[BlockId]], None]
    unpin_many: Callable[[ParkingQueue, Sequence[BlockId]], None]
    remove_many: Callable[[ParkingQueue, Sequence[BlockId]], None]
    touch_many: Callable[[ParkingQueue, Sequence[BlockId]], None]
    first: Callable[[ParkingQueue, int, Callable[[BlockId], bool]], list[BlockId]]


LOOPS: Twins[QueueLoops] = Twins.load(
    QueueLoops(ParkingQueue.add, ParkingQueue.add_many_reference, ParkingQueue.add_pinned_many_reference,
               ParkingQueue.pin_many_reference, ParkingQueue.unpin_many_reference, ParkingQueue.remove_many_reference,
               ParkingQueue.touch_many_reference, ParkingQueue.first_reference),
    "kvkit.backends.eviction._queue_loops")


@attrs.define(slots=False, on_setattr=attrs.setters.NO_OP)  # unslotted: it mixes with slotted bases
class QueuedPins:
    """The pin hooks of a policy whose every block sits in one of its :class:`ParkingQueue` s (ARC, LFU, LIRS).

    A subclass makes its queues with :meth:`_new_queue` (all on one
    :class:`Slots`), names the queue holding a block (:meth:`_queue_of`,
    raising ``PoolUsageError`` for an untracked one) and lists its queues
    (:meth:`_queues`).
    """

    def _queue_of(self, block: BlockId) -> ParkingQueue:
        raise NotImplementedError

    def _queues(self) -> Iterator[ParkingQueue]:
        raise NotImplementedError

    def _new_queue(self) -> ParkingQueue:
        """An empty queue of this policy's (its errors name the policy), on the policy's shared slots."""
        slots = vars(self).setdefault("_queue_slots", Slots(shared=True))
        return ParkingQueue.of(self, slots)

    def on_pin(self, block: BlockId) -> None:
        """A tracked block came into use: it is set aside in its queue, keeping its place."""
        self._queue_of(block).pin(block)

    def on_unpin(self, block: BlockId) -> None:
        """A pinned block was released: selectable again at its place."""
        self._queue_of(block).unpin(block)

    @property
    def pinned(self) -> frozenset[BlockId]:
        """Blocks between :meth:`on_pin` and :meth:`on_unpin` (or removal)."""
        return frozenset(b for queue in self._queues() for b in queue.pinned)

    def _check_pins(self) -> None:
        """Every queue's invariants."""
        for queue in self._queues():
            queue.check_invariants()
