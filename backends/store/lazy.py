"""Write-back: store only the GPU pool's next eviction candidates, kept ahead by a watermark."""

from __future__ import annotations

import math

import attrs
from typing_extensions import override

from kvkit.backends.store.never import NeverStore
from kvkit.validate import real_in

__all__ = ["LazyStore"]


@attrs.define
class LazyStore(NeverStore):
    """Stores nothing on progress; keeps the next GPU eviction candidates stored.

    Each step the manager asks the GPU pool for its next
    ``ceil(watermark * gpu_blocks)`` eviction candidates and stores those the
    CPU tier does not hold yet, so a block is usually on the CPU before the
    GPU pool reclaims it. A finished request's blocks become eviction
    candidates, so this pass also stores them; progress and finish answers
    stay :class:`NeverStore`'s (empty). Needs the manager to own the GPU pool
    (``gpu=``).

    Args:
        watermark: fraction of the GPU pool, in ``(0, 1]``, kept stored ahead
            of eviction.

    Invariants: progress and finish answers are empty; the target is in
    ``[1, gpu_blocks]`` for a non-empty pool.
    """

    watermark: float = attrs.field(default=0.25, validator=real_in(low=0, low_open=True, high=1))

    @override
    def writeback_target(self, gpu_free: int, gpu_blocks: int) -> int:
        return math.ceil(self.watermark * gpu_blocks)
