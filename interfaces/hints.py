"""Workload hints a request may carry to the eviction policies, and the capability that hears them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash
from kvkit.validate import check_int, checked, known_keywords, non_empty_str, real_in

__all__ = ["HintAwarePolicy", "WorkloadHints"]


_LABEL = "WorkloadHints."


@known_keywords
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

    priority: int = attrs.field(default=0, converter=checked(check_int, label=_LABEL))  # type: ignore[misc]
    ttl_s: float | None = attrs.field(default=None, validator=real_in(low=0, low_open=True, high=math.inf,
                                                                      high_open=True, label=_LABEL, optional=True))
    session: str | None = attrs.field(default=None, validator=non_empty_str(label=_LABEL, optional=True))
    kind: str | None = attrs.field(default=None, validator=non_empty_str(label=_LABEL, optional=True))


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
