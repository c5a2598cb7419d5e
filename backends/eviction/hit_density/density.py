"""An online estimate of how many hits a cached block still earns per unit of space (private).

Time is counted in block references (one tick per insert or hit a policy
sees), and a block's *age* is the ticks since its last insert or hit. Blocks
fall into a few classes; per class the model keeps two histograms over
log-spaced age buckets:

* *reuses*: ages at which blocks of the class were referenced again (a hit,
  or a re-insert of an evicted hash, which would have been a hit had the
  block stayed);
* *ends*: ages at which a block's history stopped without a reuse (its ghost
  was forgotten), so its reuse time is only known to exceed that age.

Blocks still cached or remembered are censored too, at their current age.
From these the model estimates, per class, the hazard of reuse at each age
(Kaplan-Meier) and from it the *hit density* of a block of age ``a``:

    density(a) = max over T >= a of  E[hits in (a, T]] / E[block-ticks spent in (a, T]]

that is, the best rate of hits per unit of cache space-time the block can
still earn if kept until some later age ``T``. An age older than any block of
the class was seen at has no evidence either way (the first refreshes of a
trace see only young ages): it starts from the density of the oldest age seen
and halves with every doubling of age past it, as the expected reuse rate of
a block not reused for age ``a`` falls like ``1 / a`` when the class's blocks
have Gamma-distributed rates. Classes can be ordered so that one is never
valued below another it dominates (``monotone``): at each age the chain's
densities are fitted by weighted isotonic regression, each class weighted by
its blocks observed alive at that age, so an order the evidence barely
contradicts is restored where that evidence is thin, and evidence that the
"better" class really is worse there pulls the fit down rather than being
overruled. Evicting the block of lowest
density maximises hits for the space (the Lagrangian argument behind LHD,
Beckmann et al., NSDI'18); the maximum over ``T`` looks past ages where a
block is unlikely to be reused yet (a user still reading the reply) to the
ages where it is.

The histograms are sums decayed over the model's memory, but the censored
blocks are the census of the moment, at full weight, so the fit leans on the
blocks waiting now: a class whose old blocks pile up unreused (templates
after a popularity shift, sessions that ended) loses value at once, before
the decayed events say so. The price is calibration: the hazards
over-predict reuse somewhat, which shifts every class's density alike and
so leaves the ranking, the only thing a selection reads, intact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kvkit.backends.eviction.hit_density import kernels
from kvkit.backends.eviction.hit_density.kernels import Kernels
from kvkit.errors import ConfigError
from kvkit.validate import at_least, is_int, quote

_FEW = 16  # below this many ends one call each beats one vectorised call

__all__ = ["HitDensityModel"]


_positive_int = at_least(1)


def _as_chains(value: Any) -> tuple[tuple[object, ...], ...]:
    """``value`` as a tuple of tuples (the ``monotone`` chains), or a ConfigError quoting it."""
    try:
        return tuple(tuple(chain) for chain in value)
    except TypeError:
        raise ConfigError(f"HitDensityModel.monotone must be chains (sequences) of class numbers, "
                          f"got {quote(value)}") from None


def _least_root(value: int, k: int) -> int:
    """The least int ``r >= 1`` with ``r ** k >= value`` (exact on ints)."""
    r = max(1, round(value ** (1 / k)))
    while r ** k < value:
        r += 1
    while r > 1 and (r - 1) ** k >= value:
        r -= 1
    return r


@attrs.define(eq=False)
class HitDensityModel:
    """Per-class reuse histograms over age, and the hit-density table derived from them.

    Args:
        classes: number of block classes (rows of every table).
        per_octave: age buckets per doubling of age (bucket ``b`` starts at
            age ``2 ** (b / per_octave) - 1``).
        min_samples: a class with fewer observations (reuses, ends and
            censored blocks) than this borrows the density of all classes pooled.
        monotone: chains of classes, each listed from least to most valuable
            by construction (say, by reuse count): after each refresh, at
            every age, the chain's densities are replaced by their isotonic
            (non-decreasing) fit weighted by each class's blocks at risk at
            that age (:func:`.kernels.isotonic`), so a class never looks worth less
            than one it dominates at the same age, and the order costs as
            little of the evidence as it can.

    Invariants: the histograms are finite and non-negative; the table, once
    computed, has one row per class and one column per bucket, all finite
    and non-negative, and non-decreasing along every ``monotone`` chain.
    """

    classes: int = attrs.field(validator=_positive_int)
    per_octave: int = attrs.field(default=4, validator=_positive_int)
    min_samples: int = attrs.field(default=32, validator=_positive_int)
    monotone: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_as_chains)
    _edges: np.ndarray = attrs.field(init=False, repr=False)
    _reuses: np.ndarray = attrs.field(init=False, repr=False)
    _ends: np.ndarray = attrs.field(init=False, repr=False)
    _table: np.ndarray | None = attrs.field(init=False, default=None, repr=False)
    # _table as lists, made at the first read of rows after a refresh (None until then)
    _rows: list[list[float]] | None = attrs.field(init=False, default=None, repr=False)
    _last_bucket: int = attrs.field(init=False, repr=False)
    # The monotone chains of two classes or more (one has no order to restore), in the order they are
    # fitted: groups of chains of one length, fitted in one call, disjoint when a group holds several.
    # Each group is the int array of its rows, [i, j] the i-th class of its j-th chain: the table's
    # rows it gathers are, laid flat, the columns of the fit, chain after chain.
    _fits: list[np.ndarray] = attrs.field(init=False, repr=False)
    _first_ages: tuple[int, ...] = attrs.field(init=False, repr=False)
    _widths: np.ndarray = attrs.field(init=False, repr=False)  # each bucket's span of ages
    _fades: np.ndarray = attrs.field(init=False, repr=False)  # [p]: 2 ** (-p / per_octave)
    _loops: Kernels = attrs.field(init=False, factory=kernels.LOOPS.default, repr=False)  # the kernels it runs

    def __attrs_post_init__(self) -> None:
        bad = [c for chain in self.monotone for c in chain
               if not is_int(c) or not 0 <= c < self.classes]
        if bad:
            raise ConfigError(f"HitDensityModel.monotone names classes outside 0..{self.classes - 1}: "
                              f"{quote(bad)} in {quote(self.monotone)}")
        chains = [list(chain) for chain in self.monotone if len(chain) > 1]
        rows = [row for chain in chains for row in chain]
        if len(set(rows)) == len(rows):  # disjoint: fitted in any order, those of one length together
            lengths = sorted({len(chain) for chain in chains})
            fits = [[chain for chain in chains if len(chain) == n] for n in lengths]
        else:  # one after another, as listed: a later chain fits what an earlier one left
            fits = [[chain] for chain in chains]
        self._fits = [np.array(fit, dtype=np.intp).T.copy() for fit in fits]
        buckets = 40 * self.per_octave  # ages up to 2**40 ticks
        self._last_bucket = buckets - 1
        self._first_ages = tuple(_least_root(1 << b, self.per_octave) - 1 for b in range(buckets))
        self._edges = 2.0 ** (np.arange(buckets + 1) / self.per_octave) - 1
        self._widths = np.diff(self._edges)
        self._fades = 2.0 ** (-np.arange(buckets) / self.per_octave)
        self._reuses = np.zeros((self.classes, buckets))
        self._ends = np.zeros((self.classes, buckets))

    @property
    def buckets(self) -> int:
        """Number of age buckets."""
        return self._reuses.shape[1]

    @property
    def edges(self) -> np.ndarray:
        """Lower age of each bucket, and the upper age of the last (``buckets + 1`` values)."""
        return self._edges

    @property
    def reuses(self) -> np.ndarray:
        """Reuses observed per (class, bucket), decayed by past refreshes (read-only view)."""
        view = self._reuses.view()
        view.flags.writeable = False
        return view

    @property
    def ends(self) -> np.ndarray:
        """Histories ended unreused per (class, bucket), decayed likewise (read-only view)."""
        view = self._ends.view()
        view.flags.writeable = False
        return view

    @property
    def first_ages(self) -> tuple[int, ...]:
        """The least age of each bucket: ``bucket(age) >= b`` exactly when ``age >= first_ages[b]``."""
        return self._first_ages

    @property
    def rows(self) -> list[list[float]] | None:
        """:attr:`table` as lists, ``rows[class][bucket]`` (read it; ``None`` before the first refresh).

        One list per refresh, made at its first read: the same object until the next refresh.
        """
        if self._rows is None and self._table is not None:
            self._rows = self._table.tolist()
        return self._rows

    @property
    def table(self) -> np.ndarray | None:
        """``density[class, bucket]`` from the last :meth:`refresh`, or ``None`` before it."""
        return self._table

    def bucket(self, age: int) -> int:
        """The age bucket of ``age`` (ticks, ``>= 0``).

        ``floor(per_octave * log2(age + 1))`` computed exactly on integers: the
        largest ``b`` with ``2 ** b <= (age + 1) ** per_octave`` (then capped),
        the same bucket as :meth:`buckets_of`'s floating-point one at every age.
        """
        b = ((age + 1) ** self.per_octave).bit_length() - 1
        return b if b < self._last_bucket else self._last_bucket

    def buckets_of(self, ages: np.ndarray) -> np.ndarray:
        """:meth:`bucket` of each age of an int array, in floating point (equal at every age)."""
        return np.minimum(self.buckets - 1,
                          (self.per_octave * np.log2(ages.astype(np.float64) + 1)).astype(np.int64))

    def record_reuse(self, cls: int, age: int) -> None:
        """A block of class ``cls`` was referenced again at ``age``."""
        self._reuses[cls, self.bucket(age)] += 1

    def record_end(self, cls: int, age: int) -> None:
        """A block of class ``cls`` left the model unreused at ``age`` (censored)."""
        self._ends[cls, self.bucket(age)] += 1

    def record_ends(self, classes: Sequence[int], ages: Sequence[int]) -> None:
        """:meth:`record_end` for each ``(classes[i], ages[i])``, in order: the same sums, bit for bit
        (``np.add.at`` adds one at a time, however often a cell repeats)."""
        if len(ages) < _FEW:
            for cls, age in zip(classes, ages):
                self._ends[cls, self.bucket(age)] += 1
            return
        np.add.at(self._ends, (np.asarray(classes, dtype=np.intp), self.buckets_of(np.asarray(ages, dtype=np.int64))),
                  1.0)

    def density(self, cls: int, age: int) -> float:
        """Hit density of a class-``cls`` block of age ``age`` (0 before the first refresh)."""
        table = self._table
        if table is None:
            return 0.0
        b = ((age + 1) ** self.per_octave).bit_length() - 1  # self.bucket(age), inlined: the hot path
        return table.item(cls, b if b < self._last_bucket else self._last_bucket)

    def refresh(self, classes: np.ndarray, ages: np.ndarray, keep: float,
                weights: np.ndarray | None = None) -> None:
        """Recompute the table, counting the given live blocks as censored at their ages.

        Args:
            classes, ages: parallel int arrays, one entry per block still
                cached or remembered (not yet reused, not yet ended), or per
                block of a sample of them.
            keep: factor in ``[0, 1]`` applied to the histograms afterwards,
                so older observations weigh less in later refreshes (0: the
                next refresh sees only what happens until then).
            weights: how many blocks each entry stands for (default 1 each).
        """
        assert 0 <= keep <= 1, keep
        self.refresh_counted(self.census_counts(classes, ages, weights), keep)

    def census_counts(self, classes: np.ndarray, ages: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        """The histogram of censored blocks, per (class, bucket): each entry's weight (default 1) added at
        its class and the bucket of its age, entry after entry (the sums :meth:`refresh` counts)."""
        live = np.zeros_like(self._ends)
        if len(ages):
            flat = classes.astype(np.int64, copy=False) * self.buckets + self.buckets_of(ages)
            live += np.bincount(flat, weights=weights, minlength=live.size).reshape(live.shape)
        return live

    def refresh_counted(self, live: np.ndarray, keep: float) -> None:
        """:meth:`refresh` with the censored blocks already counted: ``live`` as :meth:`census_counts` makes it."""
        assert 0 <= keep <= 1, keep
        reuses = self._reuses
        events = reuses + self._ends + live
        sparse = events.sum(axis=1) < self.min_samples
        densities, widths, fades = self._loops.densities, self._widths, self._fades
        if sparse.any():  # the rows kept and the pooled row, computed together: each row's densities are its own
            own = ~sparse
            rows_reuses = np.concatenate([reuses[own], reuses.sum(axis=0, keepdims=True)])
            kept = densities(rows_reuses, np.concatenate([events[own], events.sum(axis=0, keepdims=True)]),
                             widths, fades, np.empty_like(rows_reuses))
            table = np.empty_like(reuses)
            table[own], table[sparse] = kept[:-1], kept[-1]
        else:
            table = densities(reuses, events, widths, fades, np.empty_like(reuses))
        if self._fits:
            at_risk = kernels.at_risk(events)
            for fit in self._fits:  # chains side by side: isotonic fits each column on its own
                values = table[fit].reshape(len(fit), -1)
                fitted = self._loops.isotonic(values, at_risk[fit].reshape(len(fit), -1), np.empty_like(values))
                table[fit] = fitted.reshape(*fit.shape, -1)
        self._table = table
        self._rows = None
        np.multiply(reuses, keep, out=reuses)
        np.multiply(self._ends, keep, out=self._ends)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a histogram or the table is negative or not finite."""
        for name, array in (("reuses", self._reuses), ("ends", self._ends)):
            assert np.isfinite(array).all() and (array >= 0).all(), f"bad {name} histogram"
        if self._table is not None:
            assert self._table.shape == self._reuses.shape, "table shape drifted"
            assert np.isfinite(self._table).all() and (self._table >= 0).all(), "bad density table"
            for chain in self.monotone:
                assert (np.diff(self._table[list(chain)], axis=0) >= 0).all(), f"table not monotone along {chain}"
