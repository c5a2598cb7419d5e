"""Stores nothing: the CPU tier stays empty (the no-offload baseline)."""

from __future__ import annotations

import attrs
from typing_extensions import override

from kvkit.interfaces.store import RequestView, StorePolicy

__all__ = ["NeverStore"]


@attrs.define
class NeverStore(StorePolicy):
    """Never stores a block; every hit comes from the GPU tier.

    Invariants: every answer is empty and the write-back target is 0.
    """

    @override
    def on_computed(self, request: RequestView, start: int, stop: int) -> tuple[int, ...]:
        return ()

    @override
    def on_finished(self, request: RequestView) -> tuple[int, ...]:
        return ()

    @override
    def writeback_target(self, gpu_free: int, gpu_blocks: int) -> int:
        return 0
