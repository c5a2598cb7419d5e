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
* :class:`ComputeEstimate`: ``seconds = per_token * tokens + per_pair * pairs``
  where ``pairs = tokens * (context + (tokens + 1) / 2)`` counts the
  (query, key) pairs causal attention scores: the linear work of the MLPs and
  projections plus the quadratic work of attention. Fitted by iteratively
  reweighted least squares (Huber weights on the MAD scale), both
  coefficients >= 0; when the observations cannot separate the two terms
  (no spread in size or context), ``per_pair`` is 0 and ``per_token`` the
  median of ``seconds / tokens``.

An observation that is not finite, or not positive, is ignored.
"""

from __future__ import annotations

import math
from collections import deque

import attrs
import numpy as np

from kvkit.validate import at_least

__all__ = ["ComputeEstimate", "MoveEstimate", "attention_pairs"]

_HUBER = 1.345  # Huber's tuning constant (95% efficiency under Gaussian noise)
_MAD = 1.4826  # median absolute deviation -> standard deviation under Gaussian noise
_IRLS_ROUNDS = 8
_SEPARABLE = 1e-3  # the smallest normalised spread that separates the two compute terms


def attention_pairs(tokens: float, context: float) -> float:
    """(query, key) pairs causal attention scores for ``tokens`` tokens after ``context`` others."""
    return tokens * (context + (tokens + 1) / 2)


def _usable(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


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

    def fit(self) -> tuple[float, float] | None:
        """``(latency_s, seconds_per_byte)``, or ``None`` before any observation."""
        if self._stale:
            self._stale = False
            x, y = np.array(self._seen).T
            i, j = np.triu_indices(len(x), 1)
            dx = x[j] - x[i]
            apart = dx > 0.01 * np.maximum(x[i], x[j])  # pairs of clearly different sizes
            slope = float(np.median((y[j] - y[i])[apart] / dx[apart])) if apart.any() else 0.0
            if slope <= 0:
                self._fit = (0.0, float(np.median(y / x)))
            else:
                self._fit = (max(0.0, float(np.median(y - slope * x))), slope)
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
    """Prefill cost per token and per attention pair (see the module docstring).

    Args:
        window: observations kept.
        prior_tokens_per_s: the engine's own figure, used until the first
            observation (``None``: no estimate until then).

    Invariants: at most ``window`` observations are kept; the fit has both
    coefficients >= 0 and ``per_token > 0`` or ``per_pair > 0``.
    """

    window: int = attrs.field(default=64, validator=at_least(2))
    prior_tokens_per_s: float | None = None
    _seen: deque[tuple[float, float, float]] = attrs.field(init=False)
    _fit: tuple[float, float] | None = attrs.field(init=False, default=None)
    _stale: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self._seen = deque(maxlen=self.window)
        if self.prior_tokens_per_s is not None:
            self._fit = (1.0 / self.prior_tokens_per_s, 0.0)

    @property
    def samples(self) -> int:
        """Observations in the window."""
        return len(self._seen)

    def observe(self, tokens: float, context: float, seconds: float) -> None:
        """``tokens`` computed after ``context`` others in ``seconds`` (ignored unless usable)."""
        if _usable(tokens, seconds) and isinstance(context, (int, float)) and math.isfinite(context) \
                and context >= 0:
            self._seen.append((float(tokens), attention_pairs(tokens, context), float(seconds)))
            self._stale = True

    def fit(self) -> tuple[float, float] | None:
        """``(seconds_per_token, seconds_per_pair)``, or ``None`` with no observation and no prior."""
        if self._stale:
            self._stale = False
            t, p, y = np.array(self._seen).T
            self._fit = _robust_fit(t, p, y)
        return self._fit

    def seconds(self, tokens: float, context: float) -> float | None:
        """Estimated seconds to compute ``tokens`` after ``context`` (0 for none), or ``None`` without a fit."""
        fit = self.fit()
        if fit is None:
            return None
        return fit[0] * tokens + fit[1] * attention_pairs(tokens, context) if tokens > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | None]:
        """``tokens_per_s`` (the linear term alone), ``ns_per_pair`` and ``samples``, JSON-ready."""
        fit = self.fit()
        return {"tokens_per_s": None if fit is None or fit[0] <= 0 else round(1.0 / fit[0], 2),
                "ns_per_pair": None if fit is None else round(fit[1] * 1e9, 6), "samples": self.samples}


def _robust_fit(t: np.ndarray, p: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``(per_token, per_pair)`` >= 0 fitted to ``y ~ per_token * t + per_pair * p`` (Huber IRLS)."""
    ratio = float(np.median(y / t))
    q = p / t  # pairs per token: the second term is separable only if this spreads
    if len(t) < 3 or np.ptp(q) <= _SEPARABLE * max(float(np.max(q)), 1.0):
        return ratio, 0.0
    x = np.stack([t, p], axis=1)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)
    xs = x / scale
    w = np.ones_like(y)
    coef = np.array([ratio, 0.0])
    for _ in range(_IRLS_ROUNDS):
        sw = np.sqrt(w)
        sol, *_ = np.linalg.lstsq(xs * sw[:, None], y * sw, rcond=None)
        coef = sol / scale
        if (coef < 0).any():  # one term only: the one that stays positive
            keep = int(np.argmax(sol))  # compared in scaled units
            only = float(np.sum(w * x[:, keep] * y) / max(np.sum(w * x[:, keep] ** 2), 1e-300))
            coef = np.zeros(2)
            coef[keep] = max(only, 0.0)
        r = y - x @ coef
        mad = _MAD * float(np.median(np.abs(r - np.median(r))))
        if mad <= 0:
            break
        w = np.minimum(1.0, _HUBER * mad / np.maximum(np.abs(r), 1e-300))
    if coef.sum() <= 0:
        return ratio, 0.0
    return float(coef[0]), float(coef[1])
