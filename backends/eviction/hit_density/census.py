"""The bounded-cost read of a policy's live entries at a refresh (private).

:class:`~kvkit.backends.eviction.hit_density.HitDensityPolicy` must count,
at each refresh, every block it tracks and every ghost it remembers at its
current age. It keeps both in flat ``array`` buffers (a block's class and
last access indexed by its id, a ghost's by its eviction number) beside a
byte of liveness per entry, and a refresh reads them as numpy views through
:func:`strided`: all live entries up to ``limit``, else an evenly strided
subset of about ``limit`` of them, weighted so that the counts stay unbiased.

:func:`read` is that read whole, from the flat buffers to the model's
histogram of censored blocks (:meth:`.HitDensityModel.census_counts`). It is
the reference; :data:`LOOPS` holds it and its compiled twin (the ``_census``
extension, built at install where a C compiler is), and the policy runs the
set its ``_census`` field holds. The compiled read takes each entry's bucket
from the model's :attr:`~.HitDensityModel.first_ages` (the integer
:meth:`~.HitDensityModel.bucket`, equal to the floating-point
:meth:`~.HitDensityModel.buckets_of` the reference uses at every age) and
adds each entry's weight to its cell in the reference's order, tracked blocks
then ghosts, each by index, so its histogram is the reference's to the last
bit. It writes nothing and runs the reference where an entry's class is not
one of the model's, its last access is past ``clock``, an index of a live
entry lies beyond the class or last-access buffers, or a buffer or argument
is of another kind.
"""

from __future__ import annotations

import math
from array import array
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from kvkit.backends.twins import Twins

if TYPE_CHECKING:
    from kvkit.backends.eviction.hit_density.density import HitDensityModel

__all__ = ["LOOPS", "Census", "read", "strided"]


def strided(live: bytearray, turn: int, limit: int) -> tuple[np.ndarray, float]:
    """``(entries, weight)``: the indices of the live entries, or an evenly strided ``<= limit`` of them.

    Successive ``turn`` s start a strided sample at successive offsets, so an
    entry pattern that repeats with the stride is not always missed.
    ``weight`` is live entries over entries returned (1 when all are), so
    weighted counts estimate the whole.

    Args:
        live: one byte per entry, nonzero where it is live.
        turn: how many samples of this census were taken before.
        limit: the most entries returned.
    """
    entries = np.flatnonzero(np.frombuffer(live, dtype=np.uint8))
    if not len(entries):
        return entries, 1.0
    stride = math.ceil(len(entries) / limit)
    picked = entries[turn % stride::stride]
    return picked, len(entries) / len(picked)


class Read(Protocol):
    def __call__(self, where: bytearray, classes: bytearray, lasts: array, ghost_live: bytearray,
                 ghost_classes: bytearray, ghost_lasts: array, clock: int, turn: int, limit: int,
                 model: HitDensityModel, out: np.ndarray) -> np.ndarray:
        """Fill and return ``out``: the census's histogram (module docstring)."""


class Census(NamedTuple):
    """The census of one implementation (a function: a policy holding it copies and pickles)."""

    read: Read


def read(where: bytearray, classes: bytearray, lasts: array, ghost_live: bytearray, ghost_classes: bytearray,
          ghost_lasts: array, clock: int, turn: int, limit: int, model: HitDensityModel,
          out: np.ndarray) -> np.ndarray:
    """Fill ``out`` with the model's histogram of the censored entries: the tracked blocks (``where``
    nonzero) and the live ghosts, each read through :func:`strided` and weighted by it, at age ``clock``
    less its last access.

    Args:
        where, classes, lasts: per block id, its place (nonzero: tracked), class and last access.
        ghost_live, ghost_classes, ghost_lasts: per ghost, whether it is live, its class and last access.
        clock: the policy's clock.
        turn, limit: as :func:`strided` takes them.
        model: the model whose histogram it is (classes and age buckets).
        out: the ``classes x buckets`` float array filled.
    """
    tracked, t_w = strided(where, turn, limit)
    ghosts, g_w = strided(ghost_live, turn, limit)
    entry_classes = np.concatenate([np.frombuffer(classes, dtype=np.uint8)[tracked],
                                    np.frombuffer(ghost_classes, dtype=np.uint8)[ghosts]]).astype(np.int64)
    entry_lasts = np.concatenate([np.frombuffer(lasts, dtype=np.int64)[tracked],
                                  np.frombuffer(ghost_lasts, dtype=np.int64)[ghosts]])
    weights = None if t_w == g_w == 1.0 else np.concatenate([np.full(len(tracked), t_w), np.full(len(ghosts), g_w)])
    out[...] = model.census_counts(entry_classes, clock - entry_lasts, weights)
    return out


LOOPS: Twins[Census] = Twins.load(Census(read), "kvkit.backends.eviction.hit_density._census")
