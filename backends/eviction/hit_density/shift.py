"""A test for a shift in what a cache's reuses go to, read off its reuse counts (private).

Reuse counts rank blocks by how often they were wanted. When what is wanted
changes wholesale (few-shot templates whose popularity is reshuffled, one
batch of documents replaced by another), the counts go on describing an era
that has ended: the blocks they rank highest are stale, and the new
favourites have to climb the levels again, missing on the way.

The evidence is one sample per *reuse run*: a reuse (a hit, or the return of
an evicted hash) whose chain parent is not the block reused just before
starts a run, and the run's sample is its first block's reuse level, which
is where the prefix being reused sits in the count ranking. While the
workload holds still, a window's samples are draws from the distribution
earlier windows showed; after a shift, reuses move to prefixes the counts
have not ranked yet, and the window's levels fall. :class:`ShiftTest` tests
each window against a decayed histogram of the earlier ones, one-sided: the
probability that the window's runs, drawn independently from that histogram,
sum to a level no higher than observed (:func:`lower_tail`). The histogram
carries one pseudo-run per level (Laplace's rule of succession), so a level
not seen lately is unlikely rather than impossible, and a single run at a
rare level does not make a window significant.

A shift rarely shows in one window: the windows after a change point fall
short of significance one by one, and if each joined the history it would
train the reference it is tested against. So a window whose levels sit below
the history's median (pooled p < 1/2) starts or extends an *excursion*: it is
held out, the next window is tested pooled with it against the history from
before the excursion, and the held windows join the history only when the
pool no longer looks low, when the excursion grows as long as the history's
memory (``1 / (1 - keep)`` windows), or when it is declared a shift. Testing
one excursion again and again would inflate the false alarms (optional
stopping), so its ``k``-th test spends ``alpha * 6 / (pi**2 * k**2)``: these sum
to ``alpha``, so by the union bound an excursion on a stationary stream is
declared a shift with probability at most ``alpha``, as a single window was.
The pool grows with each window while the thresholds shrink only as
``1 / k**2``, so a real shift's p-value, falling geometrically, still crosses.
"""

from __future__ import annotations

import attrs
import numpy as np
from numpy import fft  # imported here, not lazily at the first test: that took 1 ms inside a scheduler step

from kvkit.validate import at_least, real_in

__all__ = ["ShiftTest", "lower_tail"]


def lower_tail(q: np.ndarray, n: int, total: int) -> float:
    """``P(X_1 + ... + X_n <= total)`` for ``n`` independent draws with ``P(X = k) = q[k]``.

    The distribution of the sum is the ``n``-fold convolution of ``q``, computed
    as one power of its discrete Fourier transform over a length that holds the
    whole support (no wrap-around): exact up to rounding, about ``1e-15`` times
    the support's length, far below any significance level worth testing.
    """
    if total < 0:
        return 0.0
    support = (len(q) - 1) * n + 1
    if total >= support - 1:
        return 1.0
    length = 1 << (support - 1).bit_length()
    pmf = fft.irfft(_power(fft.rfft(q, length), n), length)
    return float(np.clip(pmf[:total + 1].sum(), 0.0, 1.0))


def _power(z: np.ndarray, n: int) -> np.ndarray:
    """``z ** n`` elementwise for an int ``n >= 1``, by repeated squaring (numpy's complex power takes
    logarithms: an order of magnitude slower, no more exact)."""
    result = None
    while True:
        if n & 1:
            result = z if result is None else result * z
        n >>= 1
        if not n:
            assert result is not None
            return result
        z = z * z


@attrs.define(eq=False)
class ShiftTest:
    """A one-sided test, once per window, that recent reuse runs sit lower in the count ranking than before.

    Feed it :meth:`note` per run (its first block's reuse level) and call
    :meth:`check` at the end of each window: it says whether the excursion's
    pooled levels are significant, at its ``k``-th test's share of ``alpha``,
    against the decayed history, and when they are it forgets that history
    (the counts it was drawn from restart).

    Args:
        levels: number of reuse levels (samples are ``0 .. levels - 1``).
        alpha: significance level; 0 never declares a shift.
        min_runs: decayed runs of history needed before a window is tested.

    Invariants: the history is finite and non-negative, one entry per level;
    the window's counts are non-negative integers, one per level; an
    excursion's pool is the sum of its held windows and its decayed pool a sum
    of them weighted at most 1 each (both empty outside an excursion).
    """

    levels: int = attrs.field(validator=at_least(1))
    alpha: float = attrs.field(default=1e-3, validator=real_in(low=0, high=1, high_open=True, label="ShiftTest."))
    min_runs: int = attrs.field(default=32, validator=at_least(1))
    _history: np.ndarray = attrs.field(init=False)
    _window: list[int] = attrs.field(init=False)
    # The excursion: how many windows it holds, their sum (ints), their sum as the history would decay
    # it, and the factor the history decays by meanwhile (the product of the windows' ``keep``). Per
    # level, as lists: a window's few levels cost less one by one than as arrays, to the same bits (a
    # product and a sum per level either way; the pool's sums are of ints, exact in any order).
    _held: int = attrs.field(init=False, default=0)
    _scale: float = attrs.field(init=False, default=1.0)
    _pool: list[int] = attrs.field(init=False)
    _decayed: list[float] = attrs.field(init=False)
    _shifts: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._history = np.zeros(self.levels)
        self._window = [0] * self.levels
        self._end_excursion()

    @property
    def shifts(self) -> int:
        """How many windows were declared shifts so far."""
        return self._shifts

    @property
    def in_excursion(self) -> bool:
        """Whether windows are held out of the history (their pooled levels look low, not yet significantly)."""
        return self._held > 0

    def note(self, level: int) -> None:
        """One reuse run of the current window, starting at a block of reuse level ``level``."""
        self._window[level] += 1

    def check(self, keep: float) -> bool:
        """End the window: ``True`` (and the history forgotten) if the excursion's levels are significantly low.

        The window is pooled with the held ones and tested against the history at the
        excursion's spent level. Significant: a shift, the history and the pool are forgotten.
        Below the median (p < 1/2) and shorter than the memory: the pool is held. Otherwise the
        held windows, in order, join the history, which is first scaled by ``keep`` per window
        (the caller's memory, as its other statistics decay).
        """
        window = self._window
        self._window = [0] * self.levels
        self._held += 1
        pool = self._pool = [count + runs for count, runs in zip(self._pool, window)]
        self._decayed = [count * keep + runs for count, runs in zip(self._decayed, window)]
        self._scale *= keep
        runs = sum(pool)
        history = self._history
        if runs and history.sum() >= self.min_runs:
            q = (history + 1) / (history.sum() + self.levels)
            p = lower_tail(q, runs, sum(level * count for level, count in enumerate(pool)))
            if p < self.alpha * 6 / (np.pi * self._held) ** 2:
                self._history = np.zeros(self.levels)
                self._end_excursion()
                self._shifts += 1
                return True
            if p < 0.5 and self._held * (1 - keep) < 1:
                return False
        self._history = history * self._scale + np.array(self._decayed)
        self._end_excursion()
        return False

    def _end_excursion(self) -> None:
        self._held, self._scale = 0, 1.0
        self._pool, self._decayed = [0] * self.levels, [0.0] * self.levels

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the history, the window or the excursion is malformed."""
        for counts in (self._history, np.array(self._pool, dtype=np.float64), np.array(self._decayed)):
            assert counts.shape == (self.levels,), "history or pool has the wrong shape"
            assert np.isfinite(counts).all() and (counts >= 0).all(), "bad history or pool"
        assert len(self._window) == self.levels and min(self._window) >= 0, "bad window"
        assert (self._held > 0 or not any(self._pool)) and all(type(count) is int for count in self._pool), "bad pool"
        assert all(d <= c + 1e-9 for d, c in zip(self._decayed, self._pool)), "decayed pool above the pool"
