"""A batch's life outside the transfer table: its plans, the workers' results, and settling it.

Invariants: a batch is settled exactly once, when its last transfer completed
on every worker; a store commits (becomes findable) only if no transfer of it
failed and no reset abandoned it, and is discarded otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from kvkit._transfers import Batch, Outcome, TransferTable
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.callbacks import OffloadCallback
from kvkit.interfaces.types import BlockHash, Direction, TransferPlan, TransferResult
from kvkit.stats import OffloadStats

__all__ = ["abandon", "completed_batches", "plans", "settle"]


def plans(batch: Batch, src: list[list[int]], dst: list[list[int]],
          group_bytes: list[int]) -> list[TransferPlan]:
    """Turn per-group id lists into plans (empty groups skipped); count their bytes in ``batch``."""
    out = []
    for g, (s, d) in enumerate(zip(src, dst)):
        if s:
            out.append(TransferPlan(np.array(s, dtype=np.int64),
                                    np.array(d, dtype=np.int64), batch.direction, g))
            batch.num_bytes += len(s) * group_bytes[g]
    assert out, "a batch with blocks must copy at least one group"
    return out


def abandon(batches: Iterable[Batch]) -> int:
    """Mark ``batches`` abandoned by a reset (they never commit).

    Returns:
        Transfers in flight of the batches not abandoned before.
    """
    abandoned = 0
    for batch in batches:
        if not batch.abandoned:
            batch.abandoned = True
            abandoned += batch.pending
    return abandoned


def completed_batches(results: Iterable[TransferResult], table: TransferTable,
                      stats: OffloadStats,
                      callbacks: tuple[OffloadCallback, ...]) -> Iterator[Batch]:
    """Count each result in ``table``; yield each batch as its last transfer completes.

    Results for unknown transfer ids (or worker ranks) and repeated results
    from one worker are counted in ``stats`` and otherwise ignored.
    """
    for res in results:
        outcome, t = table.report(res)
        if outcome is Outcome.UNKNOWN:
            stats.unknown_completions.add()
            continue
        if outcome is Outcome.DUPLICATE:
            stats.duplicate_completions.add()
            continue
        stats.transfer_seconds.add(res.seconds)
        stats.transfer_bytes.add(res.num_bytes)
        if outcome is Outcome.PENDING:
            continue
        batch = t.batch
        stats.transfers_completed.add()
        if not t.ok:
            stats.transfers_failed.add()
            batch.ok = False
        for cb in callbacks:
            cb.on_transfer_completed(t.transfer_id, batch.direction, t.num_blocks,
                                     t.ok and not batch.abandoned)
        if not batch.pending:
            yield batch


def settle(batch: Batch, cpu: BlockAllocator, gpu: BlockAllocator | None,
           stats: OffloadStats, inflight: set[BlockHash]) -> bool:
    """Commit or discard a completed batch's CPU blocks and drop its pool references.

    A store not abandoned leaves ``inflight``.

    Returns:
        Whether the batch succeeded: no transfer failed and no reset abandoned it.
    """
    ok = batch.ok and not batch.abandoned
    if batch.direction is Direction.STORE:
        if not batch.abandoned:
            inflight.difference_update(batch.hashes)
        if ok:
            stats.blocks_stored.add(sum(cpu.commit(batch.cpu_blocks, batch.hashes,
                                                   batch.parents)))
            stats.bytes_stored.add(batch.num_bytes)
    elif ok:
        stats.blocks_loaded.add(len(batch.cpu_blocks))
        stats.bytes_loaded.add(batch.num_bytes)
    cpu.decref(batch.cpu_blocks)  # a committed block becomes evictable, a discarded one empty
    if batch.gpu_blocks:
        gpu.decref(batch.gpu_blocks)
    return ok
