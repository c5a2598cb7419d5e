"""Flat arrays of the (class, last access) of a policy's live entries, for a bounded-cost scan (private).

:class:`~kvkit.backends.eviction.hit_density.HitDensityPolicy` must count,
at each refresh, every block it tracks and every ghost it remembers at its
current age. Reading those out of dicts is a full pass over Python objects
each time (about 0.1 s for a 100k-block pool and its ghost). A census keeps
the same two numbers per entry in ``array`` buffers, written in O(1) as they
change, and :meth:`Census.sample` reads them as numpy views: all entries up
to ``limit``, else an evenly strided subset of about ``limit`` of them,
weighted so that the counts stay unbiased.
"""

from __future__ import annotations

import math
from array import array

import attrs
import numpy as np

__all__ = ["Census"]


@attrs.define(eq=False)
class Census:
    """Slots of ``(class, last)`` pairs; a freed slot is reused by the next :meth:`add`.

    Invariants: ``live`` marks exactly the slots handed out and not dropped;
    ``free`` lists exactly the others, each once.
    """

    _cls: array = attrs.field(init=False, factory=lambda: array("q"))
    _last: array = attrs.field(init=False, factory=lambda: array("q"))
    _live: bytearray = attrs.field(init=False, factory=bytearray)
    _free: list[int] = attrs.field(init=False, factory=list)
    _samples: int = attrs.field(init=False, default=0)  # rotates a strided sample's first entry

    def add(self, cls: int, last: int) -> int:
        """A slot holding ``(cls, last)``."""
        if self._free:
            slot = self._free.pop()
            self._cls[slot], self._last[slot], self._live[slot] = cls, last, 1
            return slot
        self._cls.append(cls)
        self._last.append(last)
        self._live.append(1)
        return len(self._live) - 1

    def set_class(self, slot: int, cls: int) -> None:
        self._cls[slot] = cls

    def set_last(self, slot: int, last: int) -> None:
        self._last[slot] = last

    def drop(self, slot: int) -> None:
        """Free ``slot`` (it must be live)."""
        self._live[slot] = 0
        self._free.append(slot)

    def __len__(self) -> int:
        return len(self._live) - len(self._free)

    def sample(self, limit: int) -> tuple[np.ndarray, np.ndarray, float]:
        """``(classes, lasts, weight)``: every live entry, or an evenly strided ``<= limit`` of them.

        Successive strided samples start at successive offsets, so an entry
        pattern that repeats with the stride is not always missed.

        ``weight`` is live entries over entries returned (1 when all are), so
        weighted counts estimate the whole census.
        """
        live = np.flatnonzero(np.frombuffer(self._live, dtype=np.uint8))
        if not len(live):
            return np.zeros(0, np.int64), np.zeros(0, np.int64), 1.0
        stride = math.ceil(len(live) / limit)
        self._samples += 1
        picked = live[self._samples % stride::stride]  # a different offset each time: no fixed aliasing
        cls = np.frombuffer(self._cls, dtype=np.int64)[picked]
        last = np.frombuffer(self._last, dtype=np.int64)[picked]
        return cls, last, len(live) / len(picked)

    def get(self, slot: int) -> tuple[int, int]:
        """The ``(class, last)`` of a live slot."""
        return self._cls[slot], self._last[slot]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the free list and the live marks disagree."""
        assert len(self._cls) == len(self._last) == len(self._live), "census arrays differ in length"
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        assert all(not self._live[s] for s in free), "a free slot is marked live"
        assert sum(self._live) + len(free) == len(self._live), "a dead slot is not free"
