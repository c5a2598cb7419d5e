"""vLLM's GPU ``BlockPool`` seen as a kvkit :class:`~kvkit.interfaces.BlockAllocator`.

vLLM-free (the pool is read by attribute: ``blocks``, ``num_gpu_blocks``,
``touch``, ``free_blocks``, ``get_num_free_blocks``, ``free_block_queue``).
vLLM hands the pool to a connector through ``bind_gpu_block_pool``; with it the
:class:`~kvkit.OffloadManager` holds its own reference on every GPU block a
transfer reads or writes, exactly as vLLM's own requests do, so vLLM can free
a finished, preempted or out-of-window block at once: it is not reused until
the copy completed. The pool's free queue is its eviction order, which the
``lazy`` store policy writes back.

vLLM allocates, caches and resets its own blocks, so the calls that would do
that through kvkit (``allocate``, ``commit``, ``lookup``, ``touch``,
``reset``) refuse with :class:`~kvkit.errors.PoolUsageError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvkit.errors import PoolUsageError, RefcountError, UnknownBlockError
from kvkit.integrations.vllm.scheduler import block_hash
from kvkit.interfaces import BlockHash, BlockId
from kvkit.interfaces.allocator import EvictListener
from kvkit.validate import is_int

__all__ = ["VllmGpuPool"]

_GROUP_ID_BYTES = 4
"""vLLM's ``BlockHashWithGroupId`` is the block hash's bytes then 4 bytes of KV group id."""
_INT = {int}  # the id types _blocks passes without a per-id check


@attrs.define(eq=False)
class VllmGpuPool:
    """A kvkit view of vLLM's GPU block pool: references, hashes and eviction order.

    Args:
        pool: vLLM's ``BlockPool`` (``vllm.v1.core.block_pool``).

    Invariants:
        * ``incref`` is vLLM's ``touch`` and ``decref`` its ``free_blocks``, so
          a referenced block stays out of vLLM's free queue (never evicted or
          reallocated) and the manager's references add to vLLM's own.
        * The null block and empty blocks (free, no hash) are never referenced.
        * ``eviction_candidates(n)`` evicts nothing and changes no refcount.
    """

    pool: Any

    @property
    def num_blocks(self) -> int:
        """Blocks of vLLM's pool, the null block included."""
        return self.pool.num_gpu_blocks

    @property
    def num_free(self) -> int:
        """Blocks vLLM can hand out now: empty plus cached and unreferenced."""
        return self.pool.get_num_free_blocks()

    def incref(self, blocks: Sequence[BlockId]) -> None:
        """One more reference on each block (vLLM's ``touch``: a cached free block leaves the free queue).

        Raises:
            UnknownBlockError: an id out of range; nothing changed.
            RefcountError: the null block, or an empty block; nothing changed.
        """
        found = self._blocks(blocks)
        for b in found:
            if b.is_null or (b.ref_cnt == 0 and b.block_hash is None):
                raise RefcountError(f"GPU block {b.block_id} is {'the null block' if b.is_null else 'empty'}: "
                                    f"it has no content to reference")
        self.pool.touch(found)

    def decref(self, blocks: Sequence[BlockId]) -> None:
        """Drop one reference from each (vLLM's ``free_blocks``: at 0 the block rejoins the free queue).

        Raises:
            UnknownBlockError / RefcountError: an id out of range, or a block
                without references; nothing changed.
        """
        found = self._blocks(blocks)
        for b in found:
            if b.ref_cnt <= 0 or b.is_null:
                raise RefcountError(f"GPU block {b.block_id} has no reference to drop")
        self.pool.free_blocks(found)

    def refcount(self, block: BlockId) -> int:
        """vLLM's reference count of ``block`` (its requests' and kvkit's)."""
        return self._blocks((block,))[0].ref_cnt

    def block_hash(self, block: BlockId) -> BlockHash | None:
        """kvkit's hash of a cached block (vLLM's hash without its group id), else ``None``."""
        key = self._blocks((block,))[0].block_hash
        return None if key is None else block_hash(key[:-_GROUP_ID_BYTES])

    def eviction_candidates(self, n: int) -> list[BlockId]:
        """The cached blocks among the next ``n`` vLLM hands out, next victim first.

        vLLM's free queue is one FIFO of empty and cached blocks, so these are
        exactly the blocks its next ``n`` allocations evict (fewer than ``n``
        while empty blocks come first); the walk visits at most ``n`` entries.

        Raises:
            PoolUsageError: ``n`` is not an int >= 0.
        """
        if not is_int(n, 0):
            raise PoolUsageError(f"eviction_candidates(n={n!r}): n must be an int >= 0")
        out: list[BlockId] = []
        for i, block in enumerate(self.pool.free_block_queue.iter_blocks_after(None)):
            if i >= n:
                break
            if block.block_hash is not None:
                out.append(BlockId(block.block_id))
        return out

    def add_evict_listener(self, listener: EvictListener) -> None:
        """Accepted and never called: vLLM evicts its GPU blocks without telling connectors."""

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a refcount is negative or a referenced block is in the free queue.

        vLLM does not count references on its null block; it is skipped.
        """
        free = {b.block_id for b in self.pool.free_block_queue.iter_blocks_after(None)}
        for b in self.pool.blocks:
            if not b.is_null:
                assert b.ref_cnt >= 0, f"GPU block {b.block_id}: refcount {b.ref_cnt}"
                assert (b.ref_cnt == 0) == (b.block_id in free), (
                    f"GPU block {b.block_id}: refcount {b.ref_cnt}, in the free queue: {b.block_id in free}")

    def allocate(self, n: int) -> list[BlockId]:
        """Refused: vLLM allocates its own blocks."""
        raise PoolUsageError("kvkit never allocates vLLM's GPU blocks; vLLM's scheduler does")

    def commit(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
               parents: Sequence[BlockHash | None] | None = None) -> list[bool]:
        """Refused: vLLM caches its own blocks."""
        raise PoolUsageError("kvkit never caches vLLM's GPU blocks; vLLM's prefix cache does")

    def lookup(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Refused: vLLM finds its own prefix hits (and passes them to the connector)."""
        raise PoolUsageError("vLLM's GPU prefix hit comes from vLLM's scheduler, not from a kvkit lookup")

    def touch(self, blocks: Sequence[BlockId]) -> None:
        """Refused: vLLM keeps its own eviction order."""
        raise PoolUsageError("kvkit never reorders vLLM's GPU eviction queue")

    def reset(self, *, force: bool = False) -> int:
        """Refused: ``reset_prefix_cache`` resets vLLM's pool."""
        raise PoolUsageError("vLLM's reset_prefix_cache resets its GPU pool")

    def _blocks(self, ids: Iterable[BlockId]) -> list[Any]:
        blocks, n = self.pool.blocks, self.pool.num_gpu_blocks
        ids = list(ids)
        if ids and not (set(map(type, ids)) == _INT and min(ids) >= 0 and max(ids) < n):  # C-level passes first
            bad = [b for b in ids if not is_int(b, 0) or b >= n]
            if bad:
                raise UnknownBlockError(f"GPU block ids {bad[:8]!r} are out of range [0, {n})")
        return [blocks[b] for b in ids]
