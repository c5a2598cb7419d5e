"""An ordered queue of blocks that sets pinned blocks aside without moving them (private).

FIFO, LRU, LFU (one queue per frequency), ARC (``T1``, ``T2``) and LIRS (LIR, HIR) keep their
blocks in the order they entered a queue. A block in use (pinned) must not
be evicted, yet when it is released it must be evicted exactly where it would
have been had it never been pinned: its place is the moment it entered. Left
in place, pinned blocks at the old end are scanned by every selection (O(pool)
when most of the pool is referenced); moved to the young end on release, they
change the policy's order (and its hit ratio).

:class:`ParkingQueue` keeps both properties: each block carries a stamp (this
queue's clock when it entered), a pinned block stays where it is until a
walk meets it, which *parks* it (takes it out of the walk), and a parked block
released re-enters by its stamp into a sorted side list that walks merge with
the queue. A walk therefore meets each pinned block at most once per pin:
selections cost O(victims) amortised.

It can also *watch* its first ``n`` evictable blocks (the next victims) and
report those that joined them, so a write-back store policy examines only
what changed (:meth:`ParkingQueue.watch`).

A pool that finds the capability
:class:`~kvkit.interfaces.capabilities.SelectivePins` attaches its
``is_evictable`` and reports only the pins of the blocks in :attr:`pin_watch`
(those parked, released from parking, in the watched window, or pinned by a
report): the queue learns every other block's use from the predicate when a
walk meets it, so a block pinned and released without being met costs no
hook call at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from itertools import chain, islice

import attrs
from sortedcontainers import SortedList

from kvkit.backends.eviction._common import any_block, not_tracked, pin_mismatch
from kvkit.interfaces.types import BlockId

__all__ = ["ParkingQueue", "QueuedPins"]


@attrs.define
class ParkingQueue:
    """Blocks in the order they entered (stamp order), each pinned or not; pinned ones are walked past once.

    Parts (a block is in exactly one):

    * ``_win`` then ``_main``: block -> stamp, ascending across both; unpinned
      blocks and pinned ones (also in ``_pinned``) that no walk has met yet.
      ``_win`` holds those of the watched *region* (stamps up to ``_edge``),
      ``_main`` the rest.
    * ``_parked``: pinned blocks a walk met, out of the queue (block -> stamp).
    * ``_back``: stamps of blocks released while parked (evictable), sorted;
      ``_back_block`` / ``_back_stamp`` map both ways.

    The evictable order is the merge by stamp of the unpinned blocks of
    ``_win`` + ``_main`` and of ``_back``: the order blocks entered the
    queue, pins ignored. A block is *pinned* if it is parked or in ``_pinned``
    (reported), or, once a pool attached its predicate (``_alive``), if that
    predicate is false for it (a block of ``_main`` whose use went
    unreported). FIFO and LRU *are* such a queue (its methods are their
    hooks, one call each on the hot path); LFU, ARC and LIRS hold several, made by
    :meth:`of` through :class:`QueuedPins`. Misuse raises ``PoolUsageError`` naming the policy.

    Watching ``n`` (:meth:`watch`): the region is every block with a stamp
    up to ``_edge``, and holds ``_count == min(n, evictable blocks)``
    unpinned blocks after every call, so its unpinned blocks are exactly the
    first ``n`` a walk yields when ``is_evictable`` is true for every
    unpinned block (a pool that calls the pin hooks). Blocks that join the
    region's unpinned ones are noted for :meth:`entered`.

    Invariants:
        * The parts are disjoint; ``_pinned`` is a subset of ``_win`` + ``_main``;
          ``_watch`` holds ``_win`` + ``_parked`` + ``_back`` + ``_pinned``
          (exactly those, unless shared with the owner's other queues).
        * Stamps ascend through ``_win`` then ``_main``; ``_win``'s are at most
          ``_edge`` and ``_main``'s above it; each stamp belongs to one block.
        * Watching, ``_count`` is the number of unpinned region blocks and
          equals ``min(_size, evictable blocks)``.
    """

    _clock: int = attrs.field(default=0, init=False)
    _win: OrderedDict[BlockId, int] = attrs.field(factory=OrderedDict, init=False)
    _main: OrderedDict[BlockId, int] = attrs.field(factory=OrderedDict, init=False)
    _pinned: set[BlockId] = attrs.field(factory=set, init=False)
    _parked: dict[BlockId, int] = attrs.field(factory=dict, init=False)
    _back: SortedList = attrs.field(factory=SortedList, init=False)
    _back_block: dict[int, BlockId] = attrs.field(factory=dict, init=False)
    _back_stamp: dict[BlockId, int] = attrs.field(factory=dict, init=False)
    _back_max: int = attrs.field(default=0, init=False)  # the largest stamp in _back (0: none)
    _owner: object = attrs.field(default=None, init=False, repr=False, eq=False)
    # The watched window: its size (0: not watching), unpinned blocks in the region, its edge.
    _size: int = attrs.field(default=0, init=False)
    _count: int = attrs.field(default=0, init=False)
    _edge: int = attrs.field(default=0, init=False)
    _entered: list[BlockId] = attrs.field(factory=list, init=False, repr=False)
    # Blocks whose pins must be reported, and the attached pool's predicate (None: every pin is).
    _watch: set[BlockId] = attrs.field(factory=set, init=False, repr=False)
    _alive: Callable[[BlockId], bool] | None = attrs.field(default=None, init=False, repr=False, eq=False)

    @classmethod
    def of(cls, owner: object, watch: set[BlockId] | None = None,
           alive: Callable[[BlockId], bool] | None = None) -> ParkingQueue:
        """An empty queue whose errors name ``owner`` (the policy holding it).

        ``watch`` is a set to share with the owner's other queues (their
        union is the owner's ``pin_watch``); ``alive`` the predicate attached.
        """
        queue = cls()
        queue._owner = owner
        if watch is not None:
            queue._watch = watch
        queue._alive = alive
        return queue

    def __len__(self) -> int:
        return len(self._win) + len(self._main) + len(self._parked) + len(self._back_stamp)

    def __contains__(self, block: object) -> bool:
        return (block in self._main or block in self._win or block in self._parked
                or block in self._back_stamp)

    @property
    def pinned(self) -> set[BlockId]:
        """The blocks known to be pinned: reported, or parked (a new set)."""
        return self._pinned | self._parked.keys()

    @property
    def pin_watch(self) -> set[BlockId]:
        """The blocks whose pins and releases an attached pool reports (a live set: read only)."""
        return self._watch

    def attach(self, is_evictable: Callable[[BlockId], bool]) -> None:
        """A pool reports only the pins of :attr:`pin_watch` from now on; ``is_evictable`` tells the rest."""
        self._alive = is_evictable

    # -- membership ------------------------------------------------------------

    def add(self, block: BlockId, pinned: bool = False) -> None:
        """Enter ``block`` (not in the queue) at the young end."""
        self._clock = stamp = self._clock + 1
        self._main[block] = stamp
        if pinned:
            self._pinned.add(block)
            self._watch.add(block)
        elif self._count < self._size:
            self._settle()

    def remove(self, block: BlockId) -> bool:
        """Take ``block`` out; return whether it was pinned.

        Raises:
            PoolUsageError: ``block`` is not in the queue.
        """
        if self._main.pop(block, None) is not None:
            if block in self._pinned:
                self._pinned.remove(block)
                self._watch.remove(block)
                return True
            return False
        watch = self._watch
        if self._parked.pop(block, None) is not None:
            watch.remove(block)
            return True
        if self._win.pop(block, None) is not None:
            watch.remove(block)
            if block in self._pinned:
                self._pinned.remove(block)
                return True
            self._count -= 1
        elif self._unback(block) > self._edge:
            watch.remove(block)
            return False
        else:
            watch.remove(block)
            self._count -= 1
        self._settle()
        return False

    def touch(self, block: BlockId) -> None:
        """Re-enter ``block`` at the young end, keeping its pin (``PoolUsageError`` if absent)."""
        main = self._main
        if block in main:
            self._clock = stamp = self._clock + 1
            main[block] = stamp
            main.move_to_end(block)
        else:
            self.add(block, self.remove(block))

    # -- pins --------------------------------------------------------------------

    def pin(self, block: BlockId) -> None:
        """Mark ``block`` in use: it keeps its place and walks skip it (a pool's ``on_pin``).

        Raises:
            PoolUsageError: ``block`` is not in the queue, or already pinned.
        """
        pinned = self._pinned
        if block in self._main:
            if block in pinned:
                raise pin_mismatch(self._who(), block, pinned=True)
            pinned.add(block)
            self._watch.add(block)
        elif block in self._win:
            if block in pinned:
                raise pin_mismatch(self._who(), block, pinned=True)
            pinned.add(block)
            self._count -= 1
            self._settle()
        elif block in self._parked:
            if self._alive is None:  # attached: the queue may have found it in use first (a commit)
                raise pin_mismatch(self._who(), block, pinned=True)
        else:
            stamp = self._parked[block] = self._unback(block)
            if stamp <= self._edge:
                self._count -= 1
                self._settle()

    def unpin(self, block: BlockId) -> None:
        """Release ``block`` at the place it entered (a pool's ``on_unpin``).

        Raises:
            PoolUsageError: ``block`` is not in the queue, or not pinned.
        """
        try:
            self._pinned.remove(block)  # still in place
        except KeyError:
            pass
        else:
            if block in self._win:
                self._joined(block)
            else:
                self._watch.remove(block)
                if self._count < self._size:
                    self._settle()
            return
        stamp = self._parked.pop(block, None)
        if stamp is None:
            if block in self:
                raise pin_mismatch(self._who(), block, pinned=False)
            raise not_tracked(self._who(), block)
        self._back.add(stamp)
        self._back_max = max(self._back_max, stamp)
        self._back_block[stamp] = block
        self._back_stamp[block] = stamp
        if stamp <= self._edge:
            self._joined(block)
        elif self._count < self._size:
            self._settle()

    # -- selection ---------------------------------------------------------------

    def first(self, n: int, is_evictable: Callable[[BlockId], bool]) -> list[BlockId]:
        """Up to ``n`` unpinned blocks with ``is_evictable`` true, oldest first; changes no order.

        Pinned blocks the walk meets are parked, so no later walk meets them again.
        """
        if n <= 0:
            return []
        if not self._back_stamp:  # the common case: the oldest blocks are free, nothing is parked
            head = list(islice(chain(self._win, self._main) if self._win else self._main, n))
            if (not self._pinned or self._pinned.isdisjoint(head)) and all(map(is_evictable, head)):
                return head
        walk = self.walk(is_evictable)
        try:
            return list(islice(walk, n))
        finally:
            walk.close()

    def walk(self, is_evictable: Callable[[BlockId], bool]) -> Generator[BlockId, None, None]:
        """Yield the unpinned blocks with ``is_evictable`` true, oldest first.

        The queue must not change while the walk is open; pinned blocks it met
        are parked when it ends (exhausted or closed: close it explicitly).
        """
        pinned, back_block = self._pinned, self._back_block
        met: list[BlockId] = []
        stamps = iter(self._back)
        next_back = next(stamps, None)
        try:
            for block, stamp in chain(self._win.items(), self._main.items()):
                while next_back is not None and next_back < stamp:
                    if is_evictable(back_block[next_back]):
                        yield back_block[next_back]
                    next_back = next(stamps, None)
                if block in pinned:
                    met.append(block)
                elif is_evictable(block):
                    yield block
                elif self._alive is not None and block in self._main:
                    met.append(block)  # in use, unreported: park it, and hear of its release
            while next_back is not None:
                if is_evictable(back_block[next_back]):
                    yield back_block[next_back]
                next_back = next(stamps, None)
        finally:
            for block in met:
                self._park(block)

    # -- the watched window ------------------------------------------------------

    def watch(self, n: int) -> None:
        """Track the first ``n`` evictable blocks from now on (``0``: stop); O(change)."""
        if n != self._size:
            self._size = n
            self._settle()

    def in_window(self, block: BlockId) -> bool:
        """Whether ``block`` is one of the first ``n`` evictable blocks (``n`` watched)."""
        if block in self._win:
            return block not in self._pinned
        stamp = self._back_stamp.get(block)
        return stamp is not None and stamp <= self._edge

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
        while self._count < self._size and (self._main or self._back_max > self._edge) and self._grow():
            pass
        while self._count > self._size:
            self._shrink()

    def _grow(self) -> bool:
        """Take the next block past the edge into the region; ``False`` if there is none."""
        main, back = self._main, self._back
        back_next = None
        if self._back_max > self._edge:  # some released block lies past the edge
            i = back.bisect_right(self._edge)
            back_next = back[i] if i < len(self._back_stamp) else None
        if main and (back_next is None or main[next(iter(main))] < back_next):
            block, stamp = main.popitem(last=False)
            self._edge = stamp
            self._watch.add(block)
            if block in self._pinned or (self._alive is not None and not self._alive(block)):
                self._pinned.discard(block)
                self._parked[block] = stamp  # out of every later walk
            else:
                self._win[block] = stamp
                self._count += 1
                self._entered.append(block)
            return True
        if back_next is None:
            return False
        self._edge = back_next
        self._count += 1
        self._entered.append(self._back_block[back_next])
        return True

    def _shrink(self) -> None:
        """Give the region's last block back to the rest of the queue."""
        win, back = self._win, self._back
        back_last = None
        if self._back_stamp:
            i = back.bisect_right(self._edge)
            back_last = back[i - 1] if i else None
        if win and (back_last is None or win[next(reversed(win))] > back_last):
            block, stamp = win.popitem(last=True)
            self._edge = stamp - 1
            if block in self._pinned:
                self._pinned.remove(block)
                self._parked[block] = stamp  # out of every later walk
            else:
                self._main[block] = stamp
                self._main.move_to_end(block, last=False)
                self._watch.remove(block)
                self._count -= 1
            return
        assert back_last is not None, "the region holds more unpinned blocks than it has"
        self._edge = back_last - 1
        self._count -= 1

    # -- helpers -----------------------------------------------------------------

    def watched(self) -> set[BlockId]:
        """The blocks whose pins this queue must hear: parked, back, in the region, or pinned by a report."""
        return self._win.keys() | self._parked.keys() | self._back_stamp.keys() | self._pinned

    def in_order(self) -> list[BlockId]:
        """Every block, pinned or not, in the order it entered (O(n log n): tests, notebooks)."""
        stamped = [*self._win.items(), *self._main.items(), *self._parked.items(),
                   *self._back_stamp.items()]
        return [block for block, _ in sorted(stamped, key=lambda item: item[1])]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the parts overlap, a stamp is out of order or the window is off."""
        win, main, parked, back = self._win, self._main, self._parked, self._back_stamp
        parts = (win.keys(), main.keys(), parked.keys(), back.keys())
        assert sum(map(len, parts)) == len(set().union(*parts)), "a block is in two parts of the queue"
        assert self._pinned <= win.keys() | main.keys(), "a pinned block is not in the queue"
        assert self.watched() <= self._watch, "a block whose pins matter is not watched"
        if self._owner is None:  # not shared with other queues: exactly those
            assert self._watch == self.watched(), "watch set drifted"
        stamps = [*win.values(), *main.values()]
        assert stamps == sorted(stamps), "queue out of stamp order"
        assert all(s <= self._edge for s in win.values()), "a region block past the edge"
        assert all(s > self._edge for s in main.values()), "a block before the edge outside the region"
        assert sorted(back.values()) == list(self._back), "back list out of step"
        assert self._back_max == max(back.values(), default=0), "largest back stamp out of step"
        assert all(self._back_block[s] == b for b, s in back.items()), "back maps disagree"
        every = [*stamps, *parked.values(), *back.values()]
        assert len(set(every)) == len(every), "a stamp is shared"
        assert not every or max(every) <= self._clock, "a stamp from the future"
        unpinned = sum(b not in self._pinned for b in win) + self._back.bisect_right(self._edge)
        assert unpinned == self._count, f"window counts {self._count}, holds {unpinned}"
        evictable = len(win) + len(main) - len(self._pinned) + len(back)
        assert self._count == min(self._size, evictable), (self._count, self._size, evictable)

    def _park(self, block: BlockId) -> None:
        """Take a pinned block a walk met out of the queue (its region count is unchanged: pinned)."""
        self._pinned.discard(block)
        self._watch.add(block)
        stamp = self._main.pop(block, None)
        self._parked[block] = self._win.pop(block) if stamp is None else stamp

    def _who(self) -> object:
        return self if self._owner is None else self._owner

    def _unback(self, block: BlockId) -> int:
        stamp = self._back_stamp.pop(block, None)
        if stamp is None:
            raise not_tracked(self._who(), block)
        del self._back_block[stamp]
        self._back.remove(stamp)
        if stamp == self._back_max:
            self._back_max = self._back[-1] if self._back_stamp else 0
        return stamp


@attrs.define(slots=False, on_setattr=attrs.setters.NO_OP)  # unslotted: it mixes with slotted bases
class QueuedPins:
    """The pin hooks and :class:`~kvkit.interfaces.capabilities.SelectivePins` of a policy whose
    every block sits in one of its :class:`ParkingQueue` s (ARC, LFU, LIRS).

    A subclass makes its queues with :meth:`_new_queue`, so they share one watch
    set (the policy's :attr:`pin_watch`) and the attached predicate, names the
    queue holding a block (:meth:`_queue_of`, raising ``PoolUsageError`` for an
    untracked one) and lists its queues (:meth:`_queues`).

    Invariant: :attr:`pin_watch` is the union of the queues' watched blocks
    (:meth:`_check_pins`).
    """

    _watch: set[BlockId] = attrs.field(factory=set, init=False, repr=False)
    _alive: Callable[[BlockId], bool] | None = attrs.field(default=None, init=False, repr=False, eq=False)

    def _queue_of(self, block: BlockId) -> ParkingQueue:
        raise NotImplementedError

    def _queues(self) -> Iterator[ParkingQueue]:
        raise NotImplementedError

    def _new_queue(self) -> ParkingQueue:
        """An empty queue of this policy's, sharing its watch set and attached predicate."""
        return ParkingQueue.of(self, self._watch, self._alive)

    @property
    def pin_watch(self) -> set[BlockId]:
        """The blocks whose pins an attached pool reports (those its queues watch)."""
        return self._watch

    def attach(self, is_evictable: Callable[[BlockId], bool]) -> None:
        """A pool reports only the pins of :attr:`pin_watch` from now on; ``is_evictable`` tells the rest."""
        self._alive = is_evictable
        for queue in self._queues():
            queue.attach(is_evictable)

    def on_pin(self, block: BlockId) -> None:
        """A tracked block came into use: it keeps its place in its queue and is skipped from now on."""
        self._queue_of(block).pin(block)

    def on_unpin(self, block: BlockId) -> None:
        """A pinned block was released: selectable again at its place."""
        self._queue_of(block).unpin(block)

    @property
    def pinned(self) -> frozenset[BlockId]:
        """Blocks between :meth:`on_pin` and :meth:`on_unpin` (or removal)."""
        return frozenset(b for queue in self._queues() for b in queue.pinned)

    def _check_pins(self) -> None:
        """Every queue's invariants, and the shared watch set's."""
        watched: set[BlockId] = set()
        for queue in self._queues():
            queue.check_invariants()
            watched |= queue.watched()
        assert self._watch == watched, "pin watch set drifted"
