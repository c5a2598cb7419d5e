"""An ordered queue of blocks that sets pinned blocks aside at once, keeping their place (private).

FIFO, LRU, LFU (one queue per frequency), ARC (``T1``, ``T2``) and LIRS (LIR, HIR) keep their
blocks in the order they entered a queue. A block in use (pinned) must not
be evicted, yet when it is released it must be evicted exactly where it would
have been had it never been pinned: its place is the moment it entered. Left
in the queue, pinned blocks at the old end are scanned by selections (O(pool)
when most of the pool is referenced); moved to the young end on release, they
change the policy's order (and its hit ratio).

:class:`ParkingQueue` keeps both properties: each block carries a stamp (this
queue's clock when it entered); a pinned block is *parked* (out of the queue,
its stamp kept) the moment it is pinned, and a parked block released goes back
by its stamp: appended when its stamp is the youngest (the common case: blocks
released in the order they entered), else into a sorted side list that walks
merge with the queue. A walk therefore never meets a pinned block: a
selection costs O(victims), its first included, however many blocks are in
use. The driver must report every pin (a pool calls the pin hooks for every
block, and commits blocks referenced, so a committed block enters parked).

It can also *watch* its first ``n`` unpinned blocks (the next victims) and
report those that joined them, so a write-back store policy examines only
what changed (:meth:`ParkingQueue.watch`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import chain, islice

import attrs
from sortedcontainers import SortedList

from kvkit.backends.eviction._common import any_block, not_tracked, pin_mismatch
from kvkit.interfaces.types import BlockId

__all__ = ["ParkingQueue", "QueuedPins"]


@attrs.define
class ParkingQueue:
    """Blocks in the order they entered (stamp order), each pinned (parked) or not.

    Parts (a block is in exactly one):

    * ``_win`` then ``_main``: block -> stamp, ascending across both; the
      unpinned blocks in entry order, except those released out of order.
      ``_win`` holds those of the watched *region* (stamps up to ``_edge``),
      ``_main`` the rest.
    * ``_parked``: pinned blocks, out of the queue (block -> stamp).
    * ``_back``: stamps of blocks released with a stamp older than the queue's
      youngest, sorted; ``_back_block`` / ``_back_stamp`` map both ways.

    The unpinned order is the merge by stamp of ``_win`` + ``_main`` and of
    ``_back``: the order blocks entered the queue, pins ignored. FIFO and LRU
    *are* such a queue (its methods are their hooks, one call each on the hot
    path); LFU, ARC and LIRS hold several, made by :meth:`of` through
    :class:`QueuedPins`. Misuse raises ``PoolUsageError`` naming the policy.

    Watching ``n`` (:meth:`watch`): the region is every unpinned block with a
    stamp up to ``_edge``, and holds ``_count == min(n, unpinned blocks)``
    blocks after every call, so they are exactly the first ``n`` a walk
    yields when ``is_evictable`` is true for every unpinned block (a driver
    that reports every pin). Blocks that join the region are noted for
    :meth:`entered`.

    Invariants:
        * The parts are disjoint.
        * Stamps ascend through ``_win`` then ``_main``; ``_win``'s are at most
          ``_edge`` and ``_main``'s above it; each stamp belongs to one block.
        * ``_count`` is the number of region blocks (``_win`` and the back
          stamps up to ``_edge``) and equals ``min(_size, unpinned blocks)``.
    """

    _clock: int = attrs.field(default=0, init=False)
    _win: OrderedDict[BlockId, int] = attrs.field(factory=OrderedDict, init=False)
    _main: OrderedDict[BlockId, int] = attrs.field(factory=OrderedDict, init=False)
    _parked: dict[BlockId, int] = attrs.field(factory=dict, init=False)
    _back: SortedList = attrs.field(factory=SortedList, init=False)
    _back_block: dict[int, BlockId] = attrs.field(factory=dict, init=False)
    _back_stamp: dict[BlockId, int] = attrs.field(factory=dict, init=False)
    _back_max: int = attrs.field(default=0, init=False)  # the largest stamp in _back (0: none)
    _owner: object = attrs.field(default=None, init=False, repr=False, eq=False)
    # The watched window: its size (0: not watching), blocks in the region, its edge.
    _size: int = attrs.field(default=0, init=False)
    _count: int = attrs.field(default=0, init=False)
    _edge: int = attrs.field(default=0, init=False)
    _entered: list[BlockId] = attrs.field(factory=list, init=False, repr=False)

    @classmethod
    def of(cls, owner: object) -> ParkingQueue:
        """An empty queue whose errors name ``owner`` (the policy holding it)."""
        queue = cls()
        queue._owner = owner
        return queue

    def __len__(self) -> int:
        return len(self._win) + len(self._main) + len(self._parked) + len(self._back_stamp)

    def __contains__(self, block: object) -> bool:
        return (block in self._main or block in self._win or block in self._parked
                or block in self._back_stamp)

    @property
    def pinned(self) -> set[BlockId]:
        """The pinned (parked) blocks (a new set)."""
        return set(self._parked)

    # -- membership ------------------------------------------------------------

    def add(self, block: BlockId, pinned: bool = False) -> None:
        """Enter ``block`` (not in the queue) at the young end; pinned, it is parked at once."""
        self._clock = stamp = self._clock + 1
        if pinned:
            self._parked[block] = stamp
            return
        self._main[block] = stamp
        if self._count < self._size:
            self._settle()

    def remove(self, block: BlockId) -> bool:
        """Take ``block`` out; return whether it was pinned.

        Raises:
            PoolUsageError: ``block`` is not in the queue.
        """
        if self._main.pop(block, None) is not None:
            return False
        if self._parked.pop(block, None) is not None:
            return True
        if self._win.pop(block, None) is None and self._unback(block) > self._edge:
            return False
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
        elif block in self._parked:
            self._clock = self._parked[block] = self._clock + 1
        else:
            self.add(block, self.remove(block))

    # -- pins --------------------------------------------------------------------

    def pin(self, block: BlockId) -> None:
        """Mark ``block`` in use: it is parked, keeping its stamp (a pool's ``on_pin``).

        Raises:
            PoolUsageError: ``block`` is not in the queue, or already pinned.
        """
        stamp = self._main.pop(block, None)
        if stamp is not None:
            self._parked[block] = stamp
            return
        if block in self._parked:
            raise pin_mismatch(self._who(), block, pinned=True)
        stamp = self._win.pop(block, None)
        if stamp is None:
            stamp = self._unback(block)
            if stamp > self._edge:
                self._parked[block] = stamp
                return
        self._parked[block] = stamp
        self._count -= 1
        self._settle()

    def unpin(self, block: BlockId) -> None:
        """Release ``block`` at the place it entered (a pool's ``on_unpin``).

        Raises:
            PoolUsageError: ``block`` is not in the queue, or not pinned.
        """
        stamp = self._parked.pop(block, None)
        if stamp is None:
            if block in self:
                raise pin_mismatch(self._who(), block, pinned=False)
            raise not_tracked(self._who(), block)
        main = self._main
        youngest = main[next(reversed(main))] if main else self._win[next(reversed(self._win))] if self._win else 0
        if stamp > youngest and stamp > self._edge:
            main[block] = stamp  # the youngest unpinned block: its place is the end
            if self._count < self._size:
                self._settle()
            return
        self._back.add(stamp)
        if stamp > self._back_max:
            self._back_max = stamp
        self._back_block[stamp] = block
        self._back_stamp[block] = stamp
        if stamp <= self._edge:
            self._joined(block)
        elif self._count < self._size:
            self._settle()

    # -- selection ---------------------------------------------------------------

    def first(self, n: int, is_evictable: Callable[[BlockId], bool]) -> list[BlockId]:
        """Up to ``n`` unpinned blocks with ``is_evictable`` true, oldest first; changes nothing."""
        if n <= 0:
            return []
        if not self._back_stamp:  # the common case: no block released out of order
            head = list(islice(chain(self._win, self._main) if self._win else self._main, n))
            if all(map(is_evictable, head)):
                return head
        return list(islice(self.walk(is_evictable), n))

    def walk(self, is_evictable: Callable[[BlockId], bool]) -> Iterator[BlockId]:
        """Yield the unpinned blocks with ``is_evictable`` true, oldest first (the queue must not change meanwhile).

        A driver that reports every pin makes ``is_evictable`` true for every
        block yielded; one that reports none gets the in-use blocks skipped here.
        """
        back_block = self._back_block
        stamps = iter(self._back)
        next_back = next(stamps, None)
        for block, stamp in chain(self._win.items(), self._main.items()):
            while next_back is not None and next_back < stamp:
                if is_evictable(back_block[next_back]):
                    yield back_block[next_back]
                next_back = next(stamps, None)
            if is_evictable(block):
                yield block
        while next_back is not None:
            if is_evictable(back_block[next_back]):
                yield back_block[next_back]
            next_back = next(stamps, None)

    # -- the watched window ------------------------------------------------------

    def watch(self, n: int) -> None:
        """Track the first ``n`` unpinned blocks from now on (``0``: stop); O(change)."""
        if n != self._size:
            self._size = n
            self._settle()

    def in_window(self, block: BlockId) -> bool:
        """Whether ``block`` is one of the first ``n`` unpinned blocks (``n`` watched)."""
        if block in self._win:
            return True
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
        """Take the next unpinned block past the edge into the region; ``False`` if there is none."""
        main, back = self._main, self._back
        back_next = None
        if self._back_max > self._edge:  # some released block lies past the edge
            i = back.bisect_right(self._edge)
            back_next = back[i] if i < len(self._back_stamp) else None
        if main and (back_next is None or main[next(iter(main))] < back_next):
            block, stamp = main.popitem(last=False)
            self._edge = stamp
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
            self._main[block] = stamp
            self._main.move_to_end(block, last=False)
            self._count -= 1
            return
        assert back_last is not None, "the region holds more blocks than it has"
        self._edge = back_last - 1
        self._count -= 1

    # -- helpers -----------------------------------------------------------------

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
        region = len(win) + self._back.bisect_right(self._edge)
        assert region == self._count, f"window counts {self._count}, holds {region}"
        unpinned = len(win) + len(main) + len(back)
        assert self._count == min(self._size, unpinned), (self._count, self._size, unpinned)

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
    """The pin hooks of a policy whose every block sits in one of its :class:`ParkingQueue` s (ARC, LFU, LIRS).

    A subclass makes its queues with :meth:`_new_queue`, names the queue
    holding a block (:meth:`_queue_of`, raising ``PoolUsageError`` for an
    untracked one) and lists its queues (:meth:`_queues`).
    """

    def _queue_of(self, block: BlockId) -> ParkingQueue:
        raise NotImplementedError

    def _queues(self) -> Iterator[ParkingQueue]:
        raise NotImplementedError

    def _new_queue(self) -> ParkingQueue:
        """An empty queue of this policy's (its errors name the policy)."""
        return ParkingQueue.of(self)

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
