"""The ``EvictionPolicy`` protocol: which cached block a pool reclaims next."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["EvictionPolicy"]


@runtime_checkable
class EvictionPolicy(Protocol):
    """Decides which ready blocks a pool evicts. Decides, never acts.

    The pool notifies the policy as blocks enter the cache (:meth:`on_insert`,
    when a block becomes ready), are hit (:meth:`on_access`) and leave it
    (:meth:`on_remove`, after an eviction or a reset). The policy tracks
    exactly the blocks inserted and not yet removed; referenced blocks stay
    tracked, and ``is_evictable`` tells which may go now.

    Invariants:
        * :meth:`select_victims` returns ``n`` distinct tracked blocks, each
          with ``is_evictable(block)`` true, or ``None`` when fewer than ``n``
          qualify; with ``None`` the policy's state is unchanged (atomic).
        * It never removes blocks itself: the pool evicts the victims and
          then calls :meth:`on_remove` for each.
        * Ghost/history state (ARC, S3-FIFO) never holds tracked blocks.

    Optional capabilities (their contracts are in
    :mod:`kvkit.interfaces.capabilities`; a pool finds them once, when it
    adopts the policy): ``on_pin`` and ``on_unpin`` make a
    :class:`~kvkit.interfaces.capabilities.PinAwarePolicy`, which sets blocks
    in use aside as it hears of them instead of skipping them in selections
    (every built-in policy is one, so a selection costs O(victims), its first
    included, not O(blocks in use));
    :class:`~kvkit.interfaces.capabilities.WindowedPolicy`
    follows its next ``n`` victims for write-back;
    :class:`~kvkit.interfaces.capabilities.BatchedPolicy` hears a pool call's
    blocks in one call (the per-block hooks remain its reference).
    """

    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        """``block`` became ready under ``block_hash``; ``parent`` is its chain predecessor."""
        ...

    def on_access(self, block: BlockId) -> None:
        """A tracked block was hit."""
        ...

    def on_remove(self, block: BlockId) -> None:
        """A tracked block left the cache (evicted or reset)."""
        ...

    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        """Choose ``n`` blocks to evict, or ``None`` (and change nothing) if impossible."""
        ...

    def __len__(self) -> int:
        """Number of tracked blocks."""
        ...

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if internal state is inconsistent."""
        ...

