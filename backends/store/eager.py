"""Write-through: store every block as soon as its KV is confirmed computed."""

from __future__ import annotations

import attrs
from typing_extensions import override

from kvkit.interfaces.store import RequestView, StorePolicy

__all__ = ["EagerStore"]


@attrs.define
class EagerStore(StorePolicy):
    """Stores each block the moment the engine confirms its KV (write-through).

    Keeps no per-request state: the manager reports every request's confirmed
    range from block 0 (GPU prefix hits included), so a block evicted from the
    CPU tier while it stayed on the GPU is stored again by the next request
    that confirms it (no stale cursor), and the manager drops what the CPU
    tier already holds or has in flight.

    Invariants: answers only indices in ``[start, stop)`` on progress and in
    ``[0, num_confirmed_blocks)`` on finish.
    """

    @override
    def on_computed(self, request: RequestView, start: int, stop: int) -> range:
        return range(start, stop)

    @override
    def on_finished(self, request: RequestView) -> range:
        # The flush: a block confirmed in the request's last step, or evicted
        # from the CPU tier since it was stored, is (re)stored here.
        return range(request.num_confirmed_blocks)

    @override
    def writeback_target(self, gpu_free: int, gpu_blocks: int) -> int:
        return 0
