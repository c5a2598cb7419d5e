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
"""

from __future__ import annotations

import attrs
import numpy as np

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
    pmf = np.fft.irfft(np.fft.rfft(q, length) ** n, length)
    return float(np.clip(pmf[:total + 1].sum(), 0.0, 1.0))


@attrs.define(eq=False)
class ShiftTest:
    """A one-sided test, once per window, that a window's reuse runs sit lower in the count ranking than before.

    Feed it :meth:`note` per run (its first block's reuse level) and call
    :meth:`check` at the end of each window: it says whether the window's
    levels are significant at ``alpha`` against the decayed history, and when
    they are it forgets that history (the counts it was drawn from restart).

    Args:
        levels: number of reuse levels (samples are ``0 .. levels - 1``).
        alpha: significance level; 0 never declares a shift.
        min_runs: decayed runs of history needed before a window is tested.

    Invariants: the history is finite and non-negative, one entry per level;
    the window's counts are non-negative integers, one per level.
    """

    levels: int = attrs.field(validator=at_least(1))
    alpha: float = attrs.field(default=1e-3, validator=real_in(low=0, high=1, high_open=True, label="ShiftTest."))
    min_runs: int = attrs.field(default=32, validator=at_least(1))
    _history: np.ndarray = attrs.field(init=False)
    _window: list[int] = attrs.field(init=False)
    _shifts: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._history = np.zeros(self.levels)
        self._window = [0] * self.levels

    @property
    def shifts(self) -> int:
        """How many windows were declared shifts so far."""
        return self._shifts

    def note(self, level: int) -> None:
        """One reuse run of the current window, starting at a block of reuse level ``level``."""
        self._window[level] += 1

    def check(self, keep: float) -> bool:
        """End the window: ``True`` (and the history forgotten) if its levels are significantly low.

        Otherwise the window joins the history, which is first scaled by ``keep`` (the
        caller's memory, as its other statistics decay).
        """
        window, self._window = self._window, [0] * self.levels
        runs = sum(window)
        history = self._history
        if runs and history.sum() >= self.min_runs:
            q = (history + 1) / (history.sum() + self.levels)
            if lower_tail(q, runs, sum(k * count for k, count in enumerate(window))) < self.alpha:
                self._history = np.zeros(self.levels)
                self._shifts += 1
                return True
        self._history = history * keep + np.asarray(window, dtype=np.float64)
        return False

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the history or the window is malformed."""
        assert self._history.shape == (self.levels,), "history has the wrong shape"
        assert np.isfinite(self._history).all() and (self._history >= 0).all(), "bad history"
        assert len(self._window) == self.levels and min(self._window) >= 0, "bad window"
