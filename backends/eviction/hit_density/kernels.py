"""The density model's numeric kernels: a refresh's table from its histograms, and the monotone fit.

This module's functions are the reference; :data:`LOOPS` holds them and their
compiled twins (the ``_kernels`` extension, built at install where a C compiler
is), and a model runs the set its ``_loops`` field holds. The compiled kernels
perform the same float operations on each value, in the same order, so their
results are the reference's to the last bit; on an input outside what they were
written for (below) they write nothing and run the reference. The tests drive
both on the same inputs and compare every output bit.

:func:`densities` fills ``out`` (``rows x buckets``) with the hit density of
each row's histograms (:mod:`.density` states the estimate); ``widths`` holds
each bucket's span of ages and ``fades[p]`` the factor ``2 ** (-p / per_octave)``
that fades a density ``p`` buckets past a row's oldest seen age. The compiled
kernel computes rows whose counts are finite, non-negative, never ``-0.0``,
and whose reuses are at most their events: there every at-risk count, hazard,
survival and sum is non-negative and no ratio is NaN, so its maxima and
comparisons are the reference's.

:func:`isotonic` fills ``out`` with the column-by-column monotone fit of
``values`` weighted by ``weights`` (its docstring states it). The compiled
kernel computes arrays of two columns or more (a single column's sum is
pairwise in numpy, not row after row) whose values and weights are
non-negative and never ``-0.0``, and whose weighted means are all numbers
(none ``0 / 0`` or ``inf * 0``).

Both compiled kernels take C-contiguous float64 arrays of the shapes stated;
they write ``out`` only after every value is computed, so ``out`` may be one
of the inputs.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from kvkit.backends.twins import Twins

__all__ = ["LOOPS", "Kernels", "at_risk", "densities", "isotonic"]

_CELLS = 1 << 14  # ratio cells a density pass computes at once: a few rows' k-by-k arrays, in cache


class Densities(Protocol):
    def __call__(self, reuses: np.ndarray, events: np.ndarray, widths: np.ndarray, fades: np.ndarray,
                 out: np.ndarray) -> np.ndarray:
        """Fill and return ``out``: the densities of the histograms (module docstring)."""


class Isotonic(Protocol):
    def __call__(self, values: np.ndarray, weights: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill and return ``out``: the monotone fit of ``values`` (module docstring)."""


class Kernels(NamedTuple):
    """The kernels of one implementation (functions: a model holding them copies and pickles)."""

    densities: Densities
    isotonic: Isotonic


def at_risk(events: np.ndarray) -> np.ndarray:
    """Per (row, bucket): the events at that bucket or later (blocks observed alive at its age)."""
    return np.cumsum(events[:, ::-1], axis=1)[:, ::-1]


def densities(reuses: np.ndarray, events: np.ndarray, widths: np.ndarray, fades: np.ndarray,
              out: np.ndarray) -> np.ndarray:
    """Fill ``out`` with the hit density per (row, bucket) of reuse and all-event histograms (``rows x
    buckets``), each row's from its own histograms alone, bit for bit whatever rows it is computed with.

    Args:
        reuses, events: the histograms, one row each; events count reuses, ends and live blocks.
        widths: the span of ages of each bucket.
        fades: ``fades[p]`` is ``2 ** (-p / per_octave)``, for ``p`` below the number of buckets.
        out: the table filled.
    """
    risk = at_risk(events)
    seen = risk > 0  # at-risk counts fall with age: each row's seen ages are a leading run
    ages_seen = seen.sum(axis=1, keepdims=True)
    # Past the oldest age any row saw, no bucket adds hits or space, so no horizon there beats
    # one before it: the O(buckets**2) search below runs over the seen ages only.
    k = int(ages_seen.max())
    reuses, risk, alive = reuses[:, :k], risk[:, :k], seen[:, :k]
    hazard = np.divide(reuses, risk, out=np.zeros_like(reuses), where=alive)
    survive = np.cumprod(np.concatenate(
        [np.ones((len(reuses), 1)), 1 - hazard[:, :-1]], axis=1), axis=1)
    hits = survive * hazard
    space = survive * widths[:k] * alive
    zero = np.zeros((len(reuses), 1))
    cum_hits = np.concatenate([zero, np.cumsum(hits, axis=1)], axis=1)
    cum_space = np.concatenate([zero, np.cumsum(space, axis=1)], axis=1)
    # ratio[a, t] of a row: hits over space in buckets a..t (t >= a); the best t per a. A few rows
    # at a time (elementwise, so the same values however many): their k-by-k arrays stay in cache,
    # where all rows' at once might not, and the calls are few where k is small.
    upper = np.triu(np.ones((k, k), dtype=bool))
    best = np.zeros(events.shape)
    step = max(1, _CELLS // max(k * k, 1))
    for row in range(0, len(reuses), step):
        rows = slice(row, row + step)
        num = cum_hits[rows, None, 1:] - cum_hits[rows, :-1, None]
        den = cum_space[rows, None, 1:] - cum_space[rows, :-1, None]
        ratio = np.divide(num, den, out=np.zeros_like(num), where=upper & (den > 0))
        best[rows, :k] = ratio.max(axis=2, initial=0.0)
    best[:, :k][space <= 0] = 0.0  # no block survives to this age: nothing to expect
    # Ages no block was seen at (they end each row): no evidence yet, not evidence of
    # nothing. The oldest seen age's density, halved per octave past it.
    oldest = np.maximum(ages_seen - 1, 0)
    past = np.arange(events.shape[1])[None, :] - oldest  # buckets past the oldest seen one
    faded = np.take_along_axis(best, oldest, axis=1) * fades[np.maximum(past, 0)]
    out[...] = np.where(seen | ~seen.any(axis=1, keepdims=True), best, faded)
    return out


def isotonic(values: np.ndarray, weights: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Column by column, the non-decreasing (down the rows) fit of ``values`` of least weighted squared error.

    Each row weighs its weight plus ``1e-9`` of its column's total (or 1 in a column of all-zero
    weights): a row without evidence keeps its own value where the order allows, and otherwise takes
    the value of the run it joins. The fit at row ``i`` is the max over ``j <= i`` of the min over
    ``k >= i`` of the weighted mean of rows ``j..k`` (the min-max form of isotonic regression, exact).
    Each mean's sums run from row ``j`` down to row ``k``, one row added at a time, not as differences
    of running sums, which would round a light row away; they are formed for every ``j`` at once as
    ``k`` grows, then the mins and maxes taken (exact), so the work is O(rows**2) whole-row operations
    on arrays of the columns' width (the chains here have a handful of rows).

    Args:
        values, weights: arrays of one shape ``(rows, columns)``; weights non-negative.
        out: the array of that shape filled with the fit and returned (a new one if ``None``).
    """
    rows = len(values)
    total = weights.sum(axis=0, keepdims=True)
    weights = weights + 1e-9 * np.where(total > 0, total, 1.0)
    terms = values * weights
    num, den = np.empty_like(terms), np.empty_like(weights)  # num[j] / den[j]: the mean of rows j..k
    means = np.empty((rows, *values.shape))  # means[k, j]: the weighted mean of rows j..k, for j <= k
    for k in range(rows):
        num[k], den[k] = terms[k], weights[k]
        num[:k] += terms[k]
        den[:k] += weights[k]
        np.divide(num[:k + 1], den[:k + 1], out=means[k, :k + 1])
    fit = np.empty_like(terms) if out is None else out
    lows = means[-1].copy()  # lows[j] for j <= i: the min over k >= i of means[k, j]
    for i in range(rows - 1, -1, -1):
        np.minimum(lows[:i + 1], means[i, :i + 1], out=lows[:i + 1])
        lows[:i + 1].max(axis=0, out=fit[i])
    return fit


LOOPS: Twins[Kernels] = Twins.load(Kernels(densities, isotonic), "kvkit.backends.eviction.hit_density._kernels")
