"""The ``BlockAllocator`` protocol: a refcounted pool of fixed-size block slots."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["BlockAllocator", "EvictListener"]

EvictListener = Callable[[Sequence[BlockId], Sequence[BlockHash]], None]
"""Called by a pool once per evicting call, right after it evicted ``blocks`` that carried ``hashes``
(parallel lists, the i-th hash the i-th block's; read them, never change or keep them)."""


@runtime_checkable
class BlockAllocator(Protocol):
    """A pool of ``num_blocks`` block slots on one medium (GPU or CPU).

    One implementation serves both tiers. Every slot is in exactly one state:

    * **empty**: refcount 0, no hash; handed out first by :meth:`allocate`.
    * **not ready**: refcount > 0, no hash; content is being written and the
      block cannot be found by :meth:`lookup`.
    * **ready**: has a hash and sits in the prefix index; findable.
      With refcount 0 a ready block is **evictable**: it still serves hits but
      :meth:`allocate` may reclaim it through the pool's ``EvictionPolicy``.

    Invariants:
        * ``num_free == num_empty + num_evictable``; no block is both in use
          (refcount > 0) and free.
        * A block is evictable iff its refcount is 0 and it is ready.
        * Every indexed block carries the hash it is indexed under; eviction
          removes it from the index and clears its hash.
        * A referenced block (refcount > 0) is never evicted or reallocated.
        * Failing calls change nothing (atomic).
        * Each operation costs O(1) per block it touches (plus the policy's work).

    Caller input: block ids are ints in ``[0, num_blocks)`` (a NumPy integer
    is taken as the int it holds; ``bool`` is no id: ``True`` is not block 1),
    else ``UnknownBlockError`` quoting the value; hashes and parents are ints
    likewise, else ``PoolUsageError``; sequences may be lists, tuples, NumPy
    arrays or any iterable. A refused call changes nothing.
    """

    @property
    def num_blocks(self) -> int:
        """Total block slots (fixed)."""
        ...

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out now: empty plus evictable."""
        ...

    def allocate(self, n: int) -> list[BlockId]:
        """Hand out ``n`` blocks with refcount 1, not ready.

        Takes empty blocks first, then evicts ready unreferenced blocks chosen
        by the eviction policy. Prefers runs of consecutive ids.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks can be freed; nothing changed.
            ValueError: ``n`` is negative.
        """
        ...

    def incref(self, blocks: Sequence[BlockId]) -> None:
        """Add one reference to each block (an evictable block stops being evictable).

        Raises:
            UnknownBlockError: an id is out of range; nothing changed.
            RefcountError: a block is empty (free, no content); nothing changed.
        """
        ...

    def decref(self, blocks: Sequence[BlockId]) -> None:
        """Drop one reference from each block.

        At refcount 0 a ready block becomes evictable and a not-ready block
        becomes empty (its partial content is worthless).

        Raises:
            UnknownBlockError: an id is out of range; nothing changed.
            RefcountError: a refcount would go below zero; nothing changed.
        """
        ...

    def commit(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
               parents: Sequence[BlockHash | None] | None = None) -> list[bool]:
        """Mark referenced, not-ready blocks ready under ``hashes`` (findable from now).

        ``parents`` optionally names each block's predecessor in its hash chain,
        for prefix-aware eviction policies. A hash already indexed by another
        block keeps the first block; the duplicate stays not ready and returns
        ``False`` in the result (it empties when its last reference goes).

        Raises:
            UnknownBlockError / RefcountError: an id is out of range or unreferenced.
            ValueError: a block is already ready, or lengths differ; nothing changed.
        """
        ...

    def lookup(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Blocks of the longest prefix of ``hashes`` that is ready here.

        Pure: takes no references and records no access. Callers that keep
        the result call :meth:`incref` (and :meth:`touch`) before anything can
        evict it.
        """
        ...

    def touch(self, blocks: Sequence[BlockId]) -> None:
        """Tell the eviction policy each ready block was hit (used), in order."""
        ...

    def refcount(self, block: BlockId) -> int:
        """References held on ``block``."""
        ...

    def block_hash(self, block: BlockId) -> BlockHash | None:
        """Hash of a ready block, else ``None``."""
        ...

    def add_evict_listener(self, listener: EvictListener) -> None:
        """Call ``listener(blocks, hashes)`` after every call that evicted: one call per batch of evictions."""
        ...

    def reset(self, *, force: bool = False) -> int:
        """Forget every cached block; returns how many ready blocks were dropped.

        Every ready block leaves the prefix index and loses its hash (it is
        never found again) and the eviction policy is told it left; every
        unreferenced block is empty afterwards.

        Args:
            force: reset even while blocks are referenced (transfers that
                never complete): a referenced ready block keeps its references
                and becomes empty only when the last one is dropped (as a
                not-ready block does); referenced not-ready blocks are untouched.

        Raises:
            RefcountError: without ``force``, some block is still referenced; nothing changed.
            PoolUsageError: ``force`` is not a bool.
        """
        ...

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any invariant above is broken (tests, notebooks)."""
        ...
