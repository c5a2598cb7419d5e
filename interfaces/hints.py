"""Workload hints a request may carry to the eviction policies, and the capability that hears them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvkit.errors import ConfigError
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash
from kvkit.validate import quote

__all__ = ["HintAwarePolicy", "WorkloadHints"]


def _ttl(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    try:
        ok = ok and math.isfinite(value) and value > 0  # type: ignore[arg-type]
    except OverflowError:  # an int beyond any float (10**400): not a usable number of seconds
        ok = False
    if not ok:
        raise ConfigError(f"WorkloadHints.ttl_s must be None or a finite number of seconds > 0, got {quote(value)}")


def _label(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"WorkloadHints.{attribute.name} must be None or a non-empty str, got {quote(value)}")


def _priority(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"WorkloadHints.priority must be an int, got {quote(value)}")


@attrs.frozen
class WorkloadHints:
    """What a caller knows about a request's blocks' future, for the CPU tier's eviction policy.

    Attributes:
        priority: 0 is ordinary; below 0 evict these blocks before any
            ordinary one (a one-shot batch job); above 0 keep them until only
            such blocks are left (higher priority kept longer).
        ttl_s: keep the blocks for this many seconds after their last use
            (the retention of hosted prompt caches), then treat them as ordinary.
        session: the conversation or agent session the request belongs to.
        kind: the request's category (``"chat"``, ``"agent"``, ``"batch"``...).

    Hints are advice: a policy that does not hear them evicts as it always
    does, and one that does never fails because of them.
    """

    priority: int = attrs.field(default=0, validator=_priority)
    ttl_s: float | None = attrs.field(default=None, validator=_ttl)
    session: str | None = attrs.field(default=None, validator=_label)
    kind: str | None = attrs.field(default=None, validator=_label)


@runtime_checkable
class HintAwarePolicy(EvictionPolicy, Protocol):
    """An eviction policy that hears requests' hints (a manager finds it once, at build).

    Invariants:
        * :meth:`on_hints` may name hashes not tracked yet (blocks still to be
          stored) or never; the policy applies a hint when a block of that hash
          is inserted or hit, the latest hint of a hash winning.
        * Hints change only the order of eviction, never the protocol's
          contract (atomic selections, only evictable victims).
    """

    def on_hints(self, hashes: Sequence[BlockHash], hints: WorkloadHints) -> None:
        """The blocks of ``hashes`` belong to a request that carries ``hints``.

        Raises:
            ConfigError: ``hints`` is not a ``WorkloadHints`` or ``hashes`` is
                not a sequence of ints (quoted); no hash was heard.
        """
        ...
