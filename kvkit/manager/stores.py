"""Store planning: which confirmed GPU blocks go to the CPU tier at each step.

The planner turns the store policy's choices (block indices queued on live
requests), the stores that outlive an ended request (*detached*), and, for
write-back policies, the GPU pool's next eviction candidates into
:class:`StoreCandidate` records, and picks the ones to copy.

Invariants: a candidate is chosen only if
neither the CPU tier, nor a store in flight, nor an earlier candidate of the
same step has its hash; at most ``cpu.num_free`` are chosen; the GPU
references held for a candidate pass to its batch or are dropped, exactly
once; ``inflight`` is exactly the hashes of the stores in flight that may
still commit.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple, cast

import attrs

from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.capabilities import EvictionOrder, EvictionWindow
from kvkit.interfaces.store import StorePolicy
from kvkit.interfaces.types import BlockHash, BlockId, Direction
from kvkit.manager.ended import EndedRequests
from kvkit.manager.requests import Request
from kvkit.manager.transfers import Batch
from kvkit.stats import OffloadStats

__all__ = ["StoreCandidate", "StorePlanner"]


class StoreCandidate(NamedTuple):
    """One block that may be stored.

    Attributes:
        block_hash: what the CPU copy commits as.
        parent: the hash of the block before it in its request (``None`` for
            the first block and for write-back candidates).
        gpu_ids: the source GPU block of each KV group.
        owner: the request incarnation whose GPU blocks it reads (``None`` for
            a write-back candidate); the owner holds each batch it joins once.
        held: the manager already holds one GPU reference on each of
            ``gpu_ids`` (stores detached from an ended request, with a GPU pool).
    """

    block_hash: BlockHash
    parent: BlockHash | None
    gpu_ids: tuple[BlockId, ...]
    owner: Request | None
    held: bool


@attrs.define(eq=False)
class StorePlanner:
    """Owns the detached stores and the hashes in flight; plans each step's store batch.

    Args:
        cpu / gpu: the tiers' pools (``gpu`` is ``None`` for external engines).
        policy: the store policy (its write-back target is read here).
        stats: counters to add to.
        ended: ended incarnations; a detached store's owner is released through it.
        null_block: the engine's id for a missing block (a group that lacks a
            block makes its candidate unstorable).
        num_groups: KV groups; a CPU block holds every group's piece.
        writeback: ``policy`` writes back GPU eviction candidates.

    Write-back with an :class:`~kvkit.interfaces.capabilities.EvictionWindow`
    GPU pool is incremental: each step offers only the blocks that joined the
    window (``gpu.eviction_window``) and those whose cover was lost (their
    hash left the CPU tier, their store failed, or it was dropped for want of
    CPU space); after a reset it offers the whole window once. A plain
    :class:`~kvkit.interfaces.capabilities.EvictionOrder` pool has its whole
    window offered every step.
    """

    cpu: BlockAllocator
    gpu: BlockAllocator | None
    policy: StorePolicy
    stats: OffloadStats
    ended: EndedRequests
    null_block: int
    num_groups: int
    writeback: bool = False
    _detached: list[StoreCandidate] = attrs.field(init=False, factory=list)
    _inflight: set[BlockHash] = attrs.field(init=False, factory=set)
    # Incremental write-back (an EvictionWindow GPU pool): what the last pass offered, hashes of
    # window blocks in flight or on the CPU tier (hash -> GPU block), and blocks to offer again.
    _wb_incremental: bool = attrs.field(init=False, default=False)
    _wb_full: bool = attrs.field(init=False, default=True)
    _wb_offered: list[StoreCandidate] = attrs.field(init=False, factory=list)
    _wb_flying: dict[BlockHash, BlockId] = attrs.field(init=False, factory=dict)
    _wb_covered: dict[BlockHash, BlockId] = attrs.field(init=False, factory=dict)
    _wb_recheck: dict[BlockId, None] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.writeback and isinstance(self.gpu, EvictionWindow):
            self._wb_incremental = True
            self.cpu.add_evict_listener(self._wb_cpu_evicted)
            self.gpu.add_evict_listener(self._wb_gpu_evicted)

    def detach(self, r: Request, draining: bool) -> None:
        """Empty the store queue of ending ``r`` into candidates that outlive it.

        With ``gpu`` one GPU reference is taken on every source, so the engine
        may free the request's blocks at once. ``r`` holds each detached store.
        """
        # Drop what the CPU tier holds now (only a store's allocation evicts, so
        # it is still there at the next build): a long request's flush would
        # otherwise hold GPU references on blocks that are never copied. Stores
        # in flight are deduplicated at build time, once their outcome is known;
        # while a reset drains, the CPU tier's contents are doomed.
        held, hashes, lookup = self.gpu is not None, r.block_hashes, self.cpu.lookup
        queue = list(dict.fromkeys(r.store_queue))  # the flush repeats queued blocks
        if draining:
            needed = queue
        else:  # one prefix lookup settles the (usually stored) head of a flush
            ready = len(lookup(hashes[:r.num_confirmed_blocks]))
            needed = [i for i in queue if i >= ready and not lookup((hashes[i],))]
        self.stats.stores_deduplicated.add(len(queue) - len(needed))
        entries = self._resolve(((r, needed),), held)
        r.store_queue = []
        if self.gpu is not None:
            self.gpu.incref([g for e in entries for g in e.gpu_ids])
        self._detached += entries
        r.holds += len(entries)

    def plan(self, queued: Iterable[Request],
             limit: float = math.inf) -> tuple[Batch, list[list[BlockId]], list[list[BlockId]]] | None:
        """This step's store batch: detached stores, the queues of ``queued``, write-back candidates.

        Chosen hashes join the in-flight set and their CPU blocks are allocated
        (not ready, not findable). If the CPU pool cannot free enough blocks,
        fewer are stored (``stats.stores_dropped``); beyond ``limit`` blocks
        (the tier's backpressure) the rest are dropped too
        (``stats.stores_backpressured``); the engine is never failed. Every
        queue read is emptied.

        Returns:
            The batch and its per-group ``(src, dst)`` ids, or ``None`` if
            nothing is copied.
        """
        detached, self._detached = self._detached, []
        queued = [r for r in queued if r.store_queue]
        cands = detached + self._resolve([(r, r.store_queue) for r in queued], False)
        for r in queued:
            r.store_queue = []
        if self.writeback:
            cands += self._writeback_candidates()
        planned = self._choose(cands, limit)
        for c in detached:  # after the batch's hold, so an owner is released only when done
            self.ended.drop_hold(c.owner)
        return planned

    def prune(self) -> None:
        """Drop detached stores whose hash reached the CPU tier meanwhile.

        Releases their GPU blocks (and a delayed free) now rather than at the next step.
        """
        if not self._detached:
            return
        lookup = self.cpu.lookup
        keep: list[StoreCandidate] = []
        gone: list[StoreCandidate] = []
        for e in self._detached:
            (gone if lookup((e.block_hash,)) else keep).append(e)
        self._detached = keep
        if gone:
            self.stats.stores_deduplicated.add(len(gone))
            self._release(gone)

    def settled(self, batch: Batch) -> None:
        """A store batch completed: its hashes are no longer in flight (unless a reset cleared them)."""
        if not batch.abandoned:
            self._inflight.difference_update(batch.hashes)
            if self._wb_flying:  # write-back copies among them: covered now, or owed again
                self._wb_settled(batch)

    def reset(self) -> None:
        """Forget the in-flight hashes and release every detached store (a reset abandons them)."""
        self._inflight.clear()
        self._wb_full = True  # the CPU tier is emptied: the whole window is owed again
        self._wb_offered, self._wb_flying, self._wb_covered, self._wb_recheck = [], {}, {}, {}
        detached, self._detached = self._detached, []
        self._release(detached)

    def gpu_refs(self) -> Counter[BlockId]:
        """GPU references held for detached stores."""
        held: Counter[BlockId] = Counter()
        for e in self._detached:
            if e.held:
                held.update(e.gpu_ids)
        return held

    def check_invariants(self, inflight: list[BlockHash], holds: Counter[int]) -> None:
        """Check the in-flight set against ``inflight`` (the stores in flight); count owners' holds."""
        assert set(inflight) == self._inflight, "in-flight hash set != uncommitted stores"
        for e in self._detached:
            holds[id(e.owner)] += 1

    def _resolve(self, queues: Iterable[tuple[Request, Iterable[int]]], held: bool) -> list[StoreCandidate]:
        """Map each request's block indices to candidates; drop those a group lacks (the null block)."""
        null, make = self.null_block, tuple.__new__  # skips NamedTuple's Python-level __new__
        out: list[StoreCandidate] = []
        append = out.append
        for r, indices in queues:  # one call per step: the per-request cost is the hot path
            hashes, rows = r.block_hashes, r.block_table
            row = rows[0] if len(rows) == 1 else None
            for i in indices:
                ids = (row[i],) if row is not None else tuple([group[i] for group in rows])
                if null not in ids:
                    append(make(StoreCandidate, (hashes[i], hashes[i - 1] if i else None, ids, r, held)))
        return out

    def _writeback_candidates(self) -> list[StoreCandidate]:
        """The GPU pool's next eviction candidates (as many as the policy asks for) that may lack a CPU copy.

        Incremental (an ``EvictionWindow`` pool): the blocks that joined the
        window since the last pass, and the window blocks whose cover was lost;
        every window block is then on the CPU tier or in flight, or offered.
        """
        gpu = cast(EvictionOrder, self.gpu)  # write-back needs one (checked when the manager is built)
        target = self.policy.writeback_target(gpu.num_free, gpu.num_blocks)
        if not self._wb_incremental:
            blocks = gpu.eviction_candidates(target) if target > 0 else []
        else:
            window = cast(EvictionWindow, gpu)  # incremental only with one
            entered = window.eviction_window(target)  # every pass, so the pool's window keeps step
            self._wb_learn()
            if self._wb_full:
                self._wb_full = False
                blocks = gpu.eviction_candidates(target)
            else:
                in_window = window.in_eviction_window
                blocks = list(dict.fromkeys(entered + [b for b in self._wb_recheck if in_window(b)]))
            self._wb_recheck = {}
        block_hash, make = gpu.block_hash, tuple.__new__  # as in _resolve: no Python-level __new__
        offered = [make(StoreCandidate, (block_hash(b), None, (b,), None, False)) for b in blocks]
        if self._wb_incremental:
            self._wb_offered = offered
        return offered

    def _wb_settled(self, batch: Batch) -> None:
        """Write-back copies of ``batch`` landed (their blocks are covered) or failed (owed again)."""
        flying, covered, recheck = self._wb_flying, self._wb_covered, self._wb_recheck
        for h in batch.hashes:
            b = flying.pop(h, None)
            if b is None:
                continue
            if batch.ok:
                covered[h] = b
            else:
                recheck[b] = None

    def _wb_learn(self) -> None:
        """Sort the last pass's offers: in flight, covered by the CPU tier, or to offer again (dropped)."""
        inflight, lookup = self._inflight, self.cpu.lookup
        flying, covered, recheck = self._wb_flying, self._wb_covered, self._wb_recheck
        for c in self._wb_offered:  # chosen or in flight elsewhere, on the CPU tier, or dropped (no room)
            b = c.gpu_ids[0]
            if c.block_hash in inflight:
                flying[c.block_hash] = b
            elif lookup((c.block_hash,)):
                covered[c.block_hash] = b
            else:
                recheck[b] = None
        self._wb_offered = []

    def _wb_cpu_evicted(self, block: BlockId, block_hash: BlockHash) -> None:
        """A CPU eviction: a window block covered by that hash is owed again."""
        gpu_block = self._wb_covered.pop(block_hash, None)
        if gpu_block is not None:
            self._wb_recheck[gpu_block] = None

    def _wb_gpu_evicted(self, block: BlockId, block_hash: BlockHash) -> None:
        """A GPU eviction: the block holds other content from now on, its cover is moot."""
        self._wb_covered.pop(block_hash, None)

    def _release(self, entries: list[StoreCandidate]) -> None:
        """Drop the GPU references held for candidates that will not be copied, and their owners' holds."""
        self._unhold(entries)
        for e in entries:
            self.ended.drop_hold(e.owner)

    def _unhold(self, entries: list[StoreCandidate]) -> None:
        held = [g for e in entries if e.held for g in e.gpu_ids]
        if held:
            assert self.gpu is not None, "references are held only with a GPU pool"
            self.gpu.decref(held)

    def _choose(self, cands: list[StoreCandidate],
                limit: float) -> tuple[Batch, list[list[BlockId]], list[list[BlockId]]] | None:
        """Pick the candidates to copy (at most ``limit``) and allocate their CPU blocks; skipped ones drop
        their GPU holds."""
        cpu, gpu, inflight, stats = self.cpu, self.gpu, self._inflight, self.stats
        cpu_lookup = cpu.lookup
        chosen, skipped = [], []
        flying = 0
        for c in cands:  # deduplicate against stores in flight and this step, and the CPU tier
            if c.block_hash in inflight:
                flying += 1
                skipped.append(c)
            elif cpu_lookup((c.block_hash,)):
                skipped.append(c)
            else:
                inflight.add(c.block_hash)
                chosen.append(c)
        stats.stores_in_flight.add(flying)
        stats.stores_deduplicated.add(len(skipped) - flying)
        free = cpu.num_free
        keep = int(min(free, limit))
        if len(chosen) > keep:  # store fewer, never fail the engine
            for c in chosen[keep:]:
                inflight.discard(c.block_hash)
            skipped += chosen[keep:]
            (stats.stores_dropped if keep == free else stats.stores_backpressured).add(len(chosen) - keep)
            del chosen[keep:]
        cpu_blocks = cpu.allocate(len(chosen)) if chosen else []
        self._unhold(skipped)
        if gpu is not None:
            fresh = [g for c in chosen if not c.held for g in c.gpu_ids]
            if fresh:
                gpu.incref(fresh)
        owners = list({id(c.owner): c.owner for c in chosen if c.owner is not None}.values())
        for r in owners:
            r.holds += 1
        if not chosen:
            return None
        groups = range(self.num_groups)
        src = [[c.gpu_ids[g] for c in chosen] for g in groups]
        batch = Batch(Direction.STORE, cpu_blocks,
                      [b for row in src for b in row] if gpu is not None else [], owners,
                      hashes=[c.block_hash for c in chosen], parents=[c.parent for c in chosen])
        return batch, src, [cpu_blocks for _ in groups]
