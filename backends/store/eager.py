"""Write-through: store every block as soon as its KV is confirmed computed."""

from __future__ import annotations

import attrs
from typing_extensions import override

from kvkit.interfaces.store import RequestView, StorePolicy
from kvkit.validate import optional_at_least

__all__ = ["EagerStore"]


@attrs.define
class EagerStore(StorePolicy):
    """Stores each block the moment the engine confirms its KV (write-through).

    Keeps no per-request state: the manager reports every request's confirmed
    range from block 0 (GPU prefix hits included), so a block evicted from the
    CPU tier while it stayed on the GPU is stored again by the next request
    that confirms it (no stale cursor), and the manager drops what the CPU
    tier already holds or has in flight.

    By default each block is stored once, as it is confirmed: a finish stores
    nothing again. A *flush* answers the history again at the finish, so the
    blocks the CPU tier evicted while the request ran (or whose store was
    dropped) are stored again before the request's GPU blocks are freed:
    ``flush_limit`` answers the history's first ``flush_limit`` blocks (a
    returning request hits its longest stored prefix), ``None`` all of them.
    A flush pays where a returning conversation would find its prefix on no
    other tier (no GPU prefix cache, or a GPU tier that turns over between
    turns); elsewhere its re-stores evict other prefixes for no hit and
    lengthen the scheduler's step.

    Args:
        flush_limit: the most history blocks a finish answers, first blocks
            first; ``0`` (default): none; ``None``: the whole confirmed
            history.

    Invariants: answers only indices in ``[start, stop)`` on progress and in
    ``[0, min(num_confirmed_blocks, flush_limit))`` on finish.
    """

    flush_limit: int | None = attrs.field(default=0, validator=optional_at_least(0))

    @override
    def on_computed(self, request: RequestView, start: int, stop: int) -> range:
        return range(start, stop)

    @override
    def on_finished(self, request: RequestView) -> range:
        n = request.num_confirmed_blocks
        return range(n if self.flush_limit is None else min(n, self.flush_limit))

    @override
    def writeback_target(self, gpu_free: int, gpu_blocks: int) -> int:
        return 0
