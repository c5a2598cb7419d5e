"""Backpressure on writes to a tier: stores to the CPU tier, puts to the shared tier.

A tier that writes slower than the engine produces KV must not make the
engine wait, nor queue writes without bound (a put queued behind others
also delays the fetches behind it). A :class:`WriteGate` watches one tier's
writes and says how many blocks may start now:

* *latency*: an exponentially weighted moving average of the time each
  completed write batch took (from its submission to its completion, as the
  workers report it); above ``high_ms`` the tier is *congested* and stays so
  until the average falls to ``low_ms`` (high and low water marks, so it
  does not flap). While congested, a write starts only when none is in
  flight: one batch at a time probes the tier, and its latency moves the
  average.
* *queue*: at most ``max_blocks_in_flight`` blocks written and not yet
  completed.

What the gate holds back is dropped (CPU stores, ``stats.stores_backpressured``)
or deferred to a later step (shared-tier puts, up to a bounded backlog;
beyond it the oldest are dropped, ``stats.puts_backpressured``). Nothing
ever waits for a write.

Invariants: ``in_flight`` counts the blocks of the write batches started and
not finished (never negative); :meth:`WriteGate.budget` is never negative.
"""

from __future__ import annotations

import math

import attrs

from kvkit.errors import ConfigError
from kvkit.validate import check_real, quote

__all__ = ["Backpressure", "WriteGate"]


def _positive_or_inf(inst: object, attribute: attrs.Attribute, value: object) -> None:
    check_real(f"Backpressure.{attribute.name}", value, low=0, low_open=True)


@attrs.frozen(kw_only=True)
class Backpressure:
    """The bounds of one tier's :class:`WriteGate` (``math.inf`` turns a bound off).

    Attributes:
        high_ms / low_ms: the latency average above which the tier is
            congested, and to which it must fall to be clear again.
        max_blocks_in_flight: blocks written and not completed at most.
        smoothing: weight of each new latency in the average, in ``(0, 1]``.

    Raises:
        ConfigError: a bound that is not a number > 0, ``low_ms > high_ms``,
            or a smoothing outside ``(0, 1]``.
    """

    high_ms: float = attrs.field(default=1000.0, validator=_positive_or_inf)
    low_ms: float = attrs.field(default=200.0, validator=_positive_or_inf)
    max_blocks_in_flight: float = attrs.field(default=math.inf, validator=_positive_or_inf)
    smoothing: float = attrs.field(default=0.2)

    def __attrs_post_init__(self) -> None:
        if self.low_ms > self.high_ms:
            raise ConfigError(f"Backpressure: low_ms={quote(self.low_ms)} is above high_ms={quote(self.high_ms)}")
        check_real("Backpressure.smoothing", self.smoothing, low=0, low_open=True, high=1)


@attrs.define(eq=False)
class WriteGate:
    """Says how many blocks of writes to one tier may start now (see the module docstring)."""

    bounds: Backpressure = attrs.field(factory=Backpressure)
    in_flight: int = attrs.field(init=False, default=0)
    latency_ms: float | None = attrs.field(init=False, default=None)
    congested: bool = attrs.field(init=False, default=False)

    def budget(self) -> float:
        """Blocks that may start now (``math.inf``: no bound)."""
        if self.congested and self.in_flight:
            return 0
        return max(self.bounds.max_blocks_in_flight - self.in_flight, 0)

    def started(self, blocks: int) -> None:
        """A write batch of ``blocks`` blocks was submitted."""
        self.in_flight += blocks

    def finished(self, blocks: int, seconds: float) -> None:
        """A write batch of ``blocks`` blocks completed (or failed, or was abandoned) after ``seconds``.

        ``seconds <= 0`` (not measured) leaves the average as it was.
        """
        self.in_flight = max(self.in_flight - blocks, 0)
        if seconds > 0:
            ms, a = seconds * 1e3, self.bounds.smoothing
            self.latency_ms = ms if self.latency_ms is None else (1 - a) * self.latency_ms + a * ms
            if self.latency_ms > self.bounds.high_ms:
                self.congested = True
            elif self.latency_ms <= self.bounds.low_ms:
                self.congested = False
