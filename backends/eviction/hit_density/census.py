"""The bounded-cost read of a policy's live entries at a refresh (private).

:class:`~kvkit.backends.eviction.hit_density.HitDensityPolicy` must count,
at each refresh, every block it tracks and every ghost it remembers at its
current age. It keeps both in flat ``array`` buffers (a block's class and
last access indexed by its id, a ghost's by its eviction number) beside a
byte of liveness per entry, and a refresh reads them as numpy views through
:func:`strided`: all live entries up to ``limit``, else an evenly strided
subset of about ``limit`` of them, weighted so that the counts stay unbiased.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["strided"]


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
