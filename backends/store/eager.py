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

    At a request's finish the flush answers its history again: the blocks the
    CPU tier evicted while it ran (or whose store was dropped) are stored
    again, so a returning conversation finds its prefix. A returning request
    hits its longest stored prefix, so a flush can be bounded to the history's
    head: ``flush_limit`` answers only the first ``flush_limit`` blocks. On a
    tier that evicts much while requests run, a long history's re-stored tail
    mostly evicts other conversations' heads; the bound saves that work, and
    costs the hits of prefixes longer than it.

    Args:
        flush_limit: the most history blocks a finish answers, first blocks
            first; ``None`` (default): the whole confirmed history.

    Invariants: answers only indices in ``[start, stop)`` on progress and in
    ``[0, min(num_confirmed_blocks, flush_limit))`` on finish.
    """

    flush_limit: int | None = attrs.field(default=None, validator=optional_at_least(0))

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
