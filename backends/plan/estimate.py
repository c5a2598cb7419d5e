"""Online estimates of what moving and computing KV costs, fitted on completed work.

Both estimates keep only their last ``window`` observations (bounded memory,
and a changed link or load replaces the old figures within a window) and fit
them robustly, so a minority of outliers (a copy that waited behind another, a
step that was preempted) moves neither:

* :class:`MoveEstimate`: ``seconds = latency + num_bytes * seconds_per_byte``,
  a Theil-Sen fit: the slope is the median of the slopes between every two
  observations of different sizes, the latency the median residual (clipped
  at 0). With one size only, the latency is 0 and the slope the median of
  ``seconds / num_bytes``.
* :class:`ComputeEstimate`: ``seconds = latency + per_token * tokens +
  per_pair * pairs`` per forward pass, where ``pairs = tokens * (context +
  (tokens + 1) / 2)`` counts the (query, key) pairs causal attention scores:
  a fixed cost per pass, the linear work of the MLPs and projections, and
  the quadratic work of attention. ``latency`` and ``per_token`` come from a
  Theil-Sen fit of seconds on tokens (as a move's); when the observations
  spread in pairs per token, all three are refitted by iteratively
  reweighted least squares (Huber weights on the MAD scale), kept if none is
  negative.

An observation that is not finite, or not positive, is ignored.
"""

from __future__ import annotations

import math
from collections import deque

import attrs
import numpy as np

from kvkit.validate import at_least

__all__ = ["ComputeEstimate", "MoveEstimate", "SlowdownEstimate", "attention_pairs"]

_HUBER = 1.345  # Huber's tuning constant (95% efficiency under Gaussian noise)
_MAD = 1.4826  # median absolute deviation -> standard deviation under Gaussian noise
_IRLS_ROUNDS = 8
_SPREAD = 0.01  # two observations at least this far apart (relatively) count as of different sizes
_SEPARABLE = 1e-3  # the smallest normalised spread that separates the two compute terms


def attention_pairs(tokens: float, context: float) -> float:
    """(query, key) pairs causal attention scores for ``tokens`` tokens after ``context`` others."""
    return tokens * (context + (tokens + 1) / 2)


def _theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``(intercept, slope)`` of ``y ~ intercept + slope * x`` (both >= 0, slope > 0): the median slope between
    observations of clearly different ``x`` and the median residual; without two such, ``(0, median(y / x))``."""
    i, j = np.triu_indices(len(x), 1)
    dx = x[j] - x[i]
    apart = np.abs(dx) > _SPREAD * np.maximum(x[i], x[j])
    slope = float(np.median((y[j] - y[i])[apart] / dx[apart])) if apart.any() else 0.0
    if slope <= 0:
        return 0.0, float(np.median(y / x))
    return max(0.0, float(np.median(y - slope * x))), slope


def _apart(a: float, b: float) -> bool:
    """Two sizes clearly different (the rule :func:`_theil_sen` pairs observations by)."""
    return abs(a - b) > _SPREAD * max(a, b)


def _usable(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def _usable_pass(tokens: float, context: float, seconds: float) -> bool:
    """A forward pass's figures: ``tokens`` and ``seconds`` finite and > 0, ``context`` finite and >= 0."""
    return _usable(tokens, seconds) and isinstance(context, (int, float)) and math.isfinite(context) and context >= 0


@attrs.define(eq=False)
class MoveEstimate:
    """Delivered bandwidth and fixed latency of one kind of move (see the module docstring).

    Invariants: at most ``window`` observations are kept; the fit, once there
    is one, has ``latency_s >= 0`` and ``seconds_per_byte > 0``.
    """

    window: int = attrs.field(default=64, validator=at_least(2))
    _seen: deque[tuple[float, float]] = attrs.field(init=False)
    _fit: tuple[float, float] | None = attrs.field(init=False, default=None)
    _stale: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self._seen = deque(maxlen=self.window)

    @property
    def samples(self) -> int:
        """Observations in the window."""
        return len(self._seen)

    def observe(self, num_bytes: float, seconds: float) -> None:
        """One completed move of ``num_bytes`` in ``seconds`` (ignored unless both are finite and > 0)."""
        if _usable(num_bytes, seconds):
            self._seen.append((float(num_bytes), float(seconds)))
            self._stale = True

    def teaches(self, num_bytes: float) -> bool:
        """Whether a move of ``num_bytes`` would be the first of a clearly different size: every observation
        so far is of one size and ``num_bytes`` is not (a second size tells latency and bandwidth apart)."""
        if not self._seen or num_bytes <= 0:
            return False
        sizes = [b for b, _ in self._seen]
        low, high = min(sizes), max(sizes)
        return not _apart(low, high) and _apart(high, num_bytes)

    def fit(self) -> tuple[float, float] | None:
        """``(latency_s, seconds_per_byte)``, or ``None`` before any observation."""
        if self._stale:
            self._stale = False
            x, y = np.array(self._seen).T
            self._fit = _theil_sen(x, y)
        return self._fit

    def seconds(self, num_bytes: float) -> float | None:
        """Estimated seconds of one move of ``num_bytes`` (0 for none), or ``None`` before any observation."""
        fit = self.fit()
        if fit is None:
            return None
        return fit[0] + fit[1] * num_bytes if num_bytes > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | None]:
        """``gbps`` (10**9 bytes/s), ``latency_ms`` and ``samples``, JSON-ready."""
        fit = self.fit()
        return {"gbps": None if fit is None else round(1e-9 / fit[1], 4),
                "latency_ms": None if fit is None else round(fit[0] * 1e3, 4), "samples": self.samples}


@attrs.define(eq=False)
class ComputeEstimate:
    """Prefill cost per forward pass, per token and per attention pair (see the module docstring).

    Args:
        window: observations kept.
        prior_tokens_per_s: the engine's own figure, used until the first
            observation (``None``: no estimate until then).

    Invariants: at most ``window`` observations are kept; the fit has every
    coefficient >= 0 and ``per_token > 0`` or ``per_pair > 0``.
    """

    window: int = attrs.field(default=64, validator=at_least(2))
    prior_tokens_per_s: float | None = None
    _seen: deque[tuple[float, float, float]] = attrs.field(init=False)
    _fit: tuple[float, float, float] | None = attrs.field(init=False, default=None)
    _stale: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self._seen = deque(maxlen=self.window)
        if self.prior_tokens_per_s is not None:
            self._fit = (0.0, 1.0 / self.prior_tokens_per_s, 0.0)

    @property
    def samples(self) -> int:
        """Observations in the window."""
        return len(self._seen)

    def observe(self, tokens: float, context: float, seconds: float) -> None:
        """``tokens`` computed after ``context`` others in ``seconds`` (ignored unless usable)."""
        if _usable_pass(tokens, context, seconds):
            self._seen.append((float(tokens), attention_pairs(tokens, context), float(seconds)))
            self._stale = True

    def fit(self) -> tuple[float, float, float] | None:
        """``(latency_s, seconds_per_token, seconds_per_pair)``, or ``None`` with no observation and no prior."""
        if self._stale:
            self._stale = False
            t, p, y = np.array(self._seen).T
            self._fit = _robust_fit(t, p, y)
        return self._fit

    def seconds(self, tokens: float, context: float) -> float | None:
        """Estimated seconds of one forward pass over ``tokens`` after ``context`` (0 for none), or ``None``."""
        fit = self.fit()
        if fit is None:
            return None
        return fit[0] + fit[1] * tokens + fit[2] * attention_pairs(tokens, context) if tokens > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | None]:
        """``latency_ms``, ``tokens_per_s`` (the linear term alone), ``ns_per_pair`` and ``samples``, JSON-ready."""
        fit = self.fit()
        return {"latency_ms": None if fit is None else round(fit[0] * 1e3, 4),
                "tokens_per_s": None if fit is None or fit[1] <= 0 else round(1.0 / fit[1], 2),
                "ns_per_pair": None if fit is None else round(fit[2] * 1e9, 6), "samples": self.samples}


@attrs.define(eq=False)
class SlowdownEstimate:
    """How many times slower than a reference fit some passes run (heads beside their step's loads).

    One parameter: the median, over the window, of each pass's seconds over the
    reference's estimate for the same work. Passes of any sizes identify it
    (passes of one size cannot tell a fixed cost from a per-token one, but a
    ratio needs neither), and a minority of outliers moves it not.

    Invariants: at most ``window`` observations are kept; :meth:`factor` is
    ``None`` or > 0.
    """

    window: int = attrs.field(default=64, validator=at_least(2))
    _seen: deque[tuple[float, float, float]] = attrs.field(init=False)
    _cached: tuple[object, float | None] | None = attrs.field(init=False, default=None)  # (reference fit, factor)

    def __attrs_post_init__(self) -> None:
        self._seen = deque(maxlen=self.window)

    @property
    def samples(self) -> int:
        """Observations in the window."""
        return len(self._seen)

    def observe(self, tokens: float, context: float, seconds: float) -> None:
        """A pass over ``tokens`` after ``context`` others took ``seconds`` (ignored unless usable)."""
        if _usable_pass(tokens, context, seconds):
            self._seen.append((float(tokens), float(context), float(seconds)))
            self._cached = None

    def span(self) -> float:
        """The largest observed pass over the smallest, in tokens (1 with none)."""
        tokens = [t for t, _, _ in self._seen]
        return max(tokens) / min(tokens) if tokens else 1.0

    def factor(self, reference: ComputeEstimate) -> float | None:
        """The median ratio of the observed passes to ``reference``'s estimates; ``None`` without either."""
        fit = reference.fit()
        if self._cached is None or self._cached[0] is not fit:
            ratios = [s / r for t, c, s in self._seen if (r := reference.seconds(t, c))]
            self._cached = (fit, float(np.median(ratios)) if ratios else None)
        return self._cached[1]


def _robust_fit(t: np.ndarray, p: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """``(latency, per_token, per_pair)`` >= 0 fitted to ``y ~ latency + per_token * t + per_pair * p``."""
    latency, per_token = _theil_sen(t, y)
    q = p / t  # pairs per token: the attention term is separable only if this spreads
    if len(t) < 4 or np.ptp(q) <= _SEPARABLE * max(float(np.max(q)), 1.0):
        return latency, per_token, 0.0
    x = np.stack([np.ones_like(t), t, p], axis=1)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)
    xs = x / scale
    w = np.ones_like(y)
    sol = np.zeros(3)
    for _ in range(_IRLS_ROUNDS):
        sw = np.sqrt(w)
        sol, *_ = np.linalg.lstsq(xs * sw[:, None], y * sw, rcond=None)
        r = y - xs @ sol
        mad = _MAD * float(np.median(np.abs(r - np.median(r))))
        if mad <= 0:
            break
        w = np.minimum(1.0, _HUBER * mad / np.maximum(np.abs(r), 1e-300))
    if (sol < -1e-9 * np.abs(sol).max()).any() or sol[1:].max() <= 0:  # a negative term: tokens alone
        return latency, per_token, 0.0
    coef = np.maximum(sol, 0.0) / scale  # round-off below zero is zero
    return float(coef[0]), float(coef[1]), float(coef[2])
