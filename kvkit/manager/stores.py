"""Store candidates: queued block indices resolved to GPU blocks, and each step's choice of copies.

A candidate is ``(hash, parent hash, GPU id per KV group, owner, held)``: the
owner is the request incarnation whose GPU blocks it reads (``None`` for a
write-back candidate); ``held`` says the manager already holds one GPU
reference on each of its ids (stores detached from an ended request, with a
GPU pool).

Invariants: a candidate is chosen only if neither the CPU tier, nor a store in
flight, nor an earlier candidate of the same step has its hash (DESIGN §4,
invariant 6); at most ``cpu.num_free`` are chosen; the GPU references held for
a candidate pass to its batch or are dropped, exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.store import StorePolicy
from kvkit.interfaces.types import BlockHash, BlockId, Direction
from kvkit.manager.requests import Request
from kvkit.manager.transfers import Batch
from kvkit.stats import OffloadStats

__all__ = ["StoreCandidate", "choose", "detach", "landed", "resolve", "unhold",
           "writeback_candidates"]

StoreCandidate = tuple[BlockHash, "BlockHash | None", tuple[int, ...], "Request | None", bool]


def resolve(r: Request, indices: Iterable[int], held: bool,
            null_block: int) -> list[StoreCandidate]:
    """Map block indices to (hash, parent, GPU ids per group); drop those a group lacks."""
    hashes, table, null = r.block_hashes, r.block_table, null_block
    out = []
    for i in indices:
        ids = tuple(row[i] for row in table)
        if null not in ids:
            out.append((hashes[i], hashes[i - 1] if i else None, ids, r, held))
    return out


def detach(r: Request, cpu: BlockAllocator, gpu: BlockAllocator | None, stats: OffloadStats,
           draining: bool, null_block: int) -> list[StoreCandidate]:
    """Empty the store queue of ending ``r`` into candidates that outlive it.

    With ``gpu`` one GPU reference is taken on every source, so the engine may
    free the request's blocks at once.
    """
    # Drop what the CPU tier holds now (only a store's allocation evicts, so
    # it is still there at the next build): a long request's flush would
    # otherwise hold GPU references on blocks that are never copied. Stores
    # in flight are deduplicated at build time, once their outcome is known;
    # while a reset drains, the CPU tier's contents are doomed.
    held, hashes, lookup = gpu is not None, r.block_hashes, cpu.lookup
    queue = list(dict.fromkeys(r.store_queue))  # the flush repeats queued blocks
    if draining:
        needed = queue
    else:  # one prefix lookup settles the (usually stored) head of a flush
        ready = len(lookup(hashes[:r.num_confirmed_blocks]))
        needed = [i for i in queue if i >= ready and not lookup((hashes[i],))]
    stats.stores_deduplicated.add(len(queue) - len(needed))
    entries = resolve(r, needed, held, null_block)
    r.store_queue = []
    if held:
        gpu.incref([g for e in entries for g in e[2]])
    return entries


def writeback_candidates(gpu: BlockAllocator, store: StorePolicy) -> list[StoreCandidate]:
    """The GPU pool's next eviction candidates, as many as ``store`` asks for (write-back)."""
    target = store.writeback_target(gpu.num_free, gpu.num_blocks)
    block_hash = gpu.block_hash
    return [(block_hash(b), None, (b,), None, False)
            for b in gpu.eviction_candidates(target)] if target > 0 else []


def unhold(gpu: BlockAllocator | None, entries: list[StoreCandidate]) -> None:
    """Drop the GPU references held for store candidates that will not be copied."""
    held = [g for e in entries if e[4] for g in e[2]]
    if held:
        gpu.decref(held)


def landed(entries: list[StoreCandidate], cpu: BlockAllocator, gpu: BlockAllocator | None,
           stats: OffloadStats) -> tuple[list[StoreCandidate], list[StoreCandidate]]:
    """Split ``entries`` into ``(keep, gone)``: gone ones' hashes reached the CPU tier meanwhile.

    The GPU references held for the gone ones are dropped.
    """
    lookup = cpu.lookup
    keep, gone = [], []
    for e in entries:
        (gone if lookup((e[0],)) else keep).append(e)
    if gone:
        stats.stores_deduplicated.add(len(gone))
        unhold(gpu, gone)
    return keep, gone


def choose(cands: list[StoreCandidate], inflight: set[BlockHash], cpu: BlockAllocator,
           gpu: BlockAllocator | None, stats: OffloadStats, num_groups: int,
           ) -> tuple[Batch, list[list[int]], list[list[BlockId]]] | None:
    """Pick the candidates to copy and allocate their CPU blocks (not ready, not findable).

    Chosen hashes join ``inflight``. If the CPU pool cannot free enough
    blocks, fewer are stored (``stats.stores_dropped``); the engine is never
    failed. Skipped candidates drop their held GPU references; with ``gpu``,
    chosen ones not yet held take one; each owner holds the batch once.

    Returns:
        The store batch and its per-group ``(src, dst)`` ids, or ``None`` if
        nothing is copied.
    """
    # Deduplicate against the CPU tier, stores in flight and this step (invariant 6).
    cpu_lookup = cpu.lookup
    chosen, skipped = [], []
    for c in cands:
        if c[0] in inflight or cpu_lookup((c[0],)):
            skipped.append(c)
        else:
            inflight.add(c[0])
            chosen.append(c)
    stats.stores_deduplicated.add(len(skipped))
    free = cpu.num_free
    if len(chosen) > free:  # store fewer, never fail the engine
        for c in chosen[free:]:
            inflight.discard(c[0])
        skipped += chosen[free:]
        stats.stores_dropped.add(len(chosen) - free)
        del chosen[free:]
    cpu_blocks = cpu.allocate(len(chosen)) if chosen else []
    unhold(gpu, skipped)
    if gpu is not None:
        fresh = [g for c in chosen if not c[4] for g in c[2]]
        if fresh:
            gpu.incref(fresh)
    owners = list({id(c[3]): c[3] for c in chosen if c[3] is not None}.values())
    for r in owners:
        r.holds += 1
    if not chosen:
        return None
    groups = range(num_groups)
    src = [[c[2][g] for c in chosen] for g in groups]
    batch = Batch(Direction.STORE, cpu_blocks,
                  [b for row in src for b in row] if gpu is not None else [], owners,
                  hashes=[c[0] for c in chosen], parents=[c[1] for c in chosen])
    return batch, src, [cpu_blocks for _ in groups]
