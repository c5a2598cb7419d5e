"""The ``EvictionPolicy`` protocol: which cached block a pool reclaims next."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from kvkit.errors import ConfigError
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["EvictionPolicy", "pin_hooks"]


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

    Optional pin hooks: a policy may also define both of

    * ``on_pin(block: BlockId) -> None``: a tracked block came into use (a
      pool took its first reference, refcount 0 -> 1; a block inserted while
      referenced, as a pool commits every block, gets ``on_pin`` right after
      :meth:`on_insert`);
    * ``on_unpin(block: BlockId) -> None``: a pinned block's last reference
      went (refcount 1 -> 0).

    They are not protocol members (``isinstance`` does not require them); a
    driver finds them once with :func:`pin_hooks` and, if present, reports
    every such transition. They let a policy set in-use blocks aside instead
    of skipping them in every :meth:`select_victims`.

    Invariants of the hooks:
        * Between ``on_pin(b)`` and the next ``on_unpin(b)`` or
          :meth:`on_remove` (either may follow), ``is_evictable(b)`` is
          false; after ``on_unpin(b)`` it may be true again and ``b`` must be
          selectable again. ``on_access`` may arrive in between (a hit on a
          block in use).
        * A driver calls ``on_pin`` only on an unpinned tracked block and
          ``on_unpin`` only on a pinned one (the built-in policies raise
          ``PoolUsageError`` otherwise); a removed block is no longer pinned.
        * The converse does not hold: a driver may call no hooks at all, so
          :meth:`select_victims` still honours ``is_evictable`` for every
          block and returns only evictable ones.
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


def pin_hooks(policy: object) -> tuple[Callable[[BlockId], None], Callable[[BlockId], None]] | None:
    """``policy``'s bound ``(on_pin, on_unpin)``, or ``None`` if it defines neither.

    A hook set to ``None`` counts as absent, so a subclass can opt out of its
    parent's hooks.

    Raises:
        ConfigError: ``policy`` defines one hook without the other, or a
            hook that is not callable.
    """
    on_pin, on_unpin = getattr(policy, "on_pin", None), getattr(policy, "on_unpin", None)
    if on_pin is None and on_unpin is None:
        return None
    if not (callable(on_pin) and callable(on_unpin)):
        raise ConfigError(
            f"eviction policy {type(policy).__name__} needs both pin hooks callable or neither, "
            f"got on_pin={on_pin!r}, on_unpin={on_unpin!r}"
        )
    return on_pin, on_unpin
