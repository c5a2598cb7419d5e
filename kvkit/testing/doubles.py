"""Minimal stand-ins for tests: components that satisfy a protocol and do nothing."""

from __future__ import annotations

from collections.abc import Callable

from kvkit.interfaces.callbacks import OffloadCallback
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["InertPolicy", "RaisingCallback"]


class InertPolicy:
    """An ``EvictionPolicy`` that tracks nothing and never chooses a victim.

    For tests of what holds components (registries, configs), not of eviction.
    """

    def on_insert(self, block: BlockId, block_hash: BlockHash, parent: BlockHash | None) -> None:
        """Ignored."""

    def on_access(self, block: BlockId) -> None:
        """Ignored."""

    def on_remove(self, block: BlockId) -> None:
        """Ignored."""

    def select_victims(self, n: int, is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        """Never evicts."""
        return None

    def __len__(self) -> int:
        return 0

    def check_invariants(self) -> None:
        """Nothing to check."""


class RaisingCallback(OffloadCallback):
    """An ``OffloadCallback`` whose every hook raises ``RuntimeError("callback bug in <hook>")``.

    A manager must contain it: nothing it does may change.
    """

    def __getattribute__(self, name: str):
        if name.startswith("on_"):
            def hook(*args: object) -> None:
                raise RuntimeError(f"callback bug in {name}")
            return hook
        return super().__getattribute__(name)
