"""CPU hits: pinned at lookup, accepted at allocation, loaded into the GPU blocks after the GPU hit.

CPU hit ``i`` of a request is loaded into the GPU block at position
``gpu_hit_blocks + i`` of each KV group; a sliding-window group loads only the
positions inside its window before the hit end (the others may be the engine's
null block).

Invariants: each block in ``Request.pinned`` carries one CPU reference, held
by the request from lookup until its load is planned and by the load's batch
after; only the accepted prefix of an offered hit stays pinned.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvkit.errors import RequestStateError
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.types import BlockHash, BlockId, Direction, GroupKind, KVCacheSpec
from kvkit.manager.requests import Request
from kvkit.manager.transfers import Batch

__all__ = ["accept", "check_load_targets", "load_span", "pin", "plan_loads", "unpin"]


def pin(cpu: BlockAllocator, hashes: Sequence[BlockHash]) -> list[BlockId]:
    """The CPU-ready prefix of ``hashes``, with one reference taken on each of its blocks."""
    blocks = cpu.lookup(hashes)
    if blocks:
        cpu.incref(blocks)
    return blocks


def unpin(cpu: BlockAllocator, r: Request) -> None:
    """Release ``r``'s pins; it has no load pending afterwards."""
    if r.pinned:
        cpu.decref(r.pinned)
        r.pinned = []
    r.load_pending = False


def accept(cpu: BlockAllocator, r: Request, n: int) -> None:
    """Keep the first ``n`` blocks of ``r``'s offered hit pinned for its load; unpin the rest."""
    keep, drop = r.pinned[:n], r.pinned[n:]
    if drop:
        cpu.decref(drop)
    if keep:
        cpu.touch(keep)  # a use, for the CPU eviction policy: only what is loaded
    r.pinned = keep
    r.load_pending = bool(keep)


def load_span(spec: KVCacheSpec, g: int, start: int, stop: int) -> int:
    """First block position of ``[start, stop)`` that group ``g`` must load."""
    group = spec.groups[g]
    if group.kind is GroupKind.FULL:
        return start
    bs = spec.block_size
    return max(start, stop - group.blocks_needed(stop * bs, bs))


def check_load_targets(spec: KVCacheSpec, null_block: int, r: Request,
                       table: list[list[int]], n: int) -> None:
    """Raise ``RequestStateError`` unless ``table`` has a real GPU block at each loaded position."""
    start, stop = r.gpu_hit_blocks, r.gpu_hit_blocks + n
    for g, row in enumerate(table):
        first = load_span(spec, g, start, stop)
        targets = row[first:stop]
        if len(targets) != stop - first or null_block in targets:
            raise RequestStateError(
                f"request {r.request_id!r}: group {g} needs GPU blocks at positions "
                f"[{first}, {stop}) for its CPU hit, got {row[first:stop]!r}")


def plan_loads(reqs: list[Request], spec: KVCacheSpec, gpu: BlockAllocator | None,
               ) -> tuple[Batch, list[list[BlockId]], list[list[int]]]:
    """One load batch for the accepted hits of ``reqs`` and its per-group ``(src, dst)`` ids.

    The requests' pins move to the batch, and each request holds it once;
    with ``gpu`` one reference is taken on every destination block.
    """
    groups = range(len(spec.groups))
    src: list[list[BlockId]] = [[] for _ in groups]
    dst: list[list[int]] = [[] for _ in groups]
    cpu_blocks: list[BlockId] = []
    for r in reqs:
        blocks, start = r.pinned, r.gpu_hit_blocks
        stop = start + len(blocks)
        for g in groups:
            first = load_span(spec, g, start, stop)
            src[g] += blocks[first - start:]
            dst[g] += r.block_table[g][first:stop]
        cpu_blocks += blocks
        r.pinned = []  # the pins move to the batch
        r.load_pending = False
        r.holds += 1
    gpu_blocks = [b for row in dst for b in row] if gpu is not None else []
    if gpu_blocks:
        gpu.incref(gpu_blocks)
    return Batch(Direction.LOAD, cpu_blocks, gpu_blocks, reqs), src, dst
