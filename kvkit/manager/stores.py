"""Store planning: which confirmed GPU blocks go to the CPU tier at each step.

The planner turns the store policy's choices (block indices queued on live
requests), the stores that outlive an ended request (*detached*), and, for
write-back policies, the GPU pool's next eviction candidates into
:class:`StoreCandidates` (parallel columns, one item per block: no
per-block object), and picks the ones to copy.

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
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import attrs

from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.capabilities import BatchedLookup, EvictionOrder, EvictionWindow
from kvkit.interfaces.store import StorePolicy
from kvkit.interfaces.types import BlockHash, BlockId, Direction
from kvkit.manager.ended import EndedRequests
from kvkit.manager.requests import Request
from kvkit.manager.transfers import Batch
from kvkit.stats import OffloadStats

__all__ = ["StoreCandidates", "StorePlanner"]


@attrs.define(eq=False)
class StoreCandidates:
    """Blocks that may be stored, in order, as parallel columns (one item per block in each).

    Attributes:
        hashes: what each CPU copy commits as.
        parents: the hash of the block before each in its request (``None``
            for a request's first block and for write-back candidates).
        gpu_ids: per KV group, the source GPU block of each candidate.
        owners: the request incarnation whose GPU blocks each reads (``None``
            for a write-back candidate); an owner holds each batch it joins once.
        held: the manager already holds one GPU reference on each source of
            the candidate (stores detached from an ended request, with a GPU pool).

    Invariants: every column (and every group's column) has one item per
    candidate; a candidate's sources, flattened, are listed candidate by
    candidate and group by group within one.
    """

    hashes: list[BlockHash]
    parents: list[BlockHash | None]
    gpu_ids: list[list[BlockId]]
    owners: list[Request | None]
    held: list[bool]

    @classmethod
    def empty(cls, num_groups: int) -> StoreCandidates:
        """No candidate, for ``num_groups`` KV groups."""
        return cls([], [], [[] for _ in range(num_groups)], [], [])

    def __len__(self) -> int:
        return len(self.hashes)

    def extend(self, other: StoreCandidates) -> None:
        """Append ``other``'s candidates after these."""
        self.hashes += other.hashes
        self.parents += other.parents
        for column, more in zip(self.gpu_ids, other.gpu_ids, strict=True):
            column += more
        self.owners += other.owners
        self.held += other.held

    def select(self, picks: list[int]) -> StoreCandidates:
        """The candidates at positions ``picks``, in that order."""
        hashes, parents, owners, held = self.hashes, self.parents, self.owners, self.held
        return StoreCandidates([hashes[i] for i in picks], [parents[i] for i in picks],
                               [[column[i] for i in picks] for column in self.gpu_ids],
                               [owners[i] for i in picks], [held[i] for i in picks])

    def sources(self, picks: Iterable[int]) -> list[BlockId]:
        """The GPU sources of the candidates at positions ``picks``, candidate by candidate."""
        columns = self.gpu_ids
        if len(columns) == 1:
            column = columns[0]
            return [column[i] for i in picks]
        return [column[i] for i in picks for column in columns]

    def held_sources(self, picks: Iterable[int] | None = None) -> list[BlockId]:
        """The GPU sources the manager holds references on, of the candidates at ``picks`` (default: all)."""
        held = self.held
        return self.sources(i for i in (range(len(held)) if picks is None else picks) if held[i])


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
    _detached: StoreCandidates = attrs.field(init=False)
    _inflight: set[BlockHash] = attrs.field(init=False, factory=set)
    _contains_many: Callable[[Sequence[BlockHash]], list[bool]] | None = attrs.field(init=False, default=None)
    # Incremental write-back (an EvictionWindow GPU pool): what the last pass offered, hashes of
    # window blocks in flight or on the CPU tier (hash -> GPU block), and blocks to offer again.
    _wb_incremental: bool = attrs.field(init=False, default=False)
    _wb_full: bool = attrs.field(init=False, default=True)
    _wb_offered: StoreCandidates = attrs.field(init=False)
    _wb_flying: dict[BlockHash, BlockId] = attrs.field(init=False, factory=dict)
    _wb_covered: dict[BlockHash, BlockId] = attrs.field(init=False, factory=dict)
    _wb_recheck: dict[BlockId, None] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.cpu, BatchedLookup):
            self._contains_many = self.cpu.contains_many
        self._detached = StoreCandidates.empty(self.num_groups)
        self._wb_offered = StoreCandidates.empty(self.num_groups)
        if self.writeback and isinstance(self.gpu, EvictionWindow):
            self._wb_incremental = True
            self.cpu.add_evict_listener(self._wb_cpu_evicted)
            self.gpu.add_evict_listener(self._wb_gpu_evicted)

    def _on_cpu(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Per hash, whether the CPU tier holds a ready block with it: one call to a
        :class:`~kvkit.interfaces.capabilities.BatchedLookup` pool, else a lookup per hash."""
        if self._contains_many is not None:
            return self._contains_many(hashes)
        lookup = self.cpu.lookup
        return [bool(lookup((h,))) for h in hashes]

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
        held, hashes = self.gpu is not None, r.block_hashes
        queue = list(dict.fromkeys(r.store_queue))  # the flush repeats queued blocks
        if draining:
            needed = queue
        else:  # one prefix lookup settles the (usually stored) head of a flush
            ready = len(self.cpu.lookup(hashes[:r.num_confirmed_blocks]))
            tail = [i for i in queue if i >= ready]
            needed = [i for i, stored in zip(tail, self._on_cpu([hashes[i] for i in tail])) if not stored]
        self.stats.stores_deduplicated.add(len(queue) - len(needed))
        entries = StoreCandidates.empty(self.num_groups)
        self._resolve(((r, needed),), held, entries)
        r.store_queue = []
        if self.gpu is not None:
            self.gpu.incref(entries.sources(range(len(entries))))
        self._detached.extend(entries)
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
        cands, self._detached = self._detached, StoreCandidates.empty(self.num_groups)
        detached_owners = list(cands.owners)
        queued = [r for r in queued if r.store_queue]
        self._resolve([(r, r.store_queue) for r in queued], False, cands)
        for r in queued:
            r.store_queue = []
        if self.writeback:
            cands.extend(self._writeback_candidates())
        planned = self._choose(cands, limit)
        self.ended.drop_holds(detached_owners)  # after the batch's hold, so an owner is released only when done
        return planned

    def prune(self) -> None:
        """Drop detached stores whose hash reached the CPU tier meanwhile.

        Releases their GPU blocks (and a delayed free) now rather than at the next step.
        """
        detached = self._detached
        if not detached.hashes:
            return
        found = self._on_cpu(detached.hashes)
        if True not in found:
            return
        self._detached = detached.select([i for i, f in enumerate(found) if not f])
        gone = detached.select([i for i, f in enumerate(found) if f])
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
        self._wb_offered = StoreCandidates.empty(self.num_groups)
        self._wb_flying, self._wb_covered, self._wb_recheck = {}, {}, {}
        detached, self._detached = self._detached, StoreCandidates.empty(self.num_groups)
        self._release(detached)

    def gpu_refs(self) -> Counter[BlockId]:
        """GPU references held for detached stores."""
        return Counter(self._detached.held_sources())

    def check_invariants(self, inflight: list[BlockHash], holds: Counter[int]) -> None:
        """Check the in-flight set against ``inflight`` (the stores in flight); count owners' holds."""
        assert set(inflight) == self._inflight, "in-flight hash set != uncommitted stores"
        for owner in self._detached.owners:
            holds[id(owner)] += 1

    def _resolve(self, queues: Iterable[tuple[Request, Iterable[int]]], held: bool, out: StoreCandidates) -> None:
        """Append each request's block indices to ``out`` as candidates; drop those a group lacks (the null block).

        A run of consecutive indices (the usual queue) is copied as slices of
        the request's hashes and block table; a single index (a decode step's
        block) is appended item by item.
        """
        null, columns = self.null_block, out.gpu_ids
        out_hashes, out_parents, out_owners, out_held = out.hashes, out.parents, out.owners, out.held
        one_group = columns[0] if len(columns) == 1 else None
        for r, indices in queues:  # one call per step: the per-request cost is the hot path
            idx = indices if indices.__class__ is list else list(indices)
            if not idx:
                continue
            hashes, rows = r.block_hashes, r.block_table
            if len(idx) == 1 and one_group is not None:
                i = idx[0]
                b = rows[0][i]
                if b != null:
                    out_hashes.append(hashes[i])
                    out_parents.append(hashes[i - 1] if i else None)
                    one_group.append(b)
                    out_owners.append(r)
                    out_held.append(held)
                continue
            first, stop = idx[0], idx[-1] + 1
            if (stop - first == len(idx) and (len(idx) == 1 or idx == list(range(first, stop)))
                    and not any(null in row[first:stop] for row in rows)):
                out_hashes += hashes[first:stop]
                out_parents += hashes[first - 1:stop - 1] if first else [None, *hashes[:stop - 1]]
                for column, row in zip(columns, rows, strict=True):
                    column += row[first:stop]
                n = stop - first
            else:
                keep = [i for i in idx if all(row[i] != null for row in rows)]
                out_hashes += [hashes[i] for i in keep]
                out_parents += [hashes[i - 1] if i else None for i in keep]
                for column, row in zip(columns, rows, strict=True):
                    column += [row[i] for i in keep]
                n = len(keep)
            out_owners += [r] * n
            out_held += [held] * n

    def _writeback_candidates(self) -> StoreCandidates:
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
        block_hash, n = gpu.block_hash, len(blocks)
        hashes = cast(list[BlockHash], [block_hash(b) for b in blocks])  # candidates are ready, hence hashed
        offered = StoreCandidates(hashes, [None] * n, [list(blocks)], [None] * n, [False] * n)
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
        inflight = self._inflight
        flying, covered, recheck = self._wb_flying, self._wb_covered, self._wb_recheck
        offered = self._wb_offered
        # Each was chosen or is in flight elsewhere, is on the CPU tier, or was dropped (no room).
        for h, b, stored in zip(offered.hashes, offered.gpu_ids[0], self._on_cpu(offered.hashes), strict=True):
            if h in inflight:
                flying[h] = b
            elif stored:
                covered[h] = b
            else:
                recheck[b] = None
        self._wb_offered = StoreCandidates.empty(self.num_groups)

    def _wb_cpu_evicted(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash]) -> None:
        """CPU evictions: a window block covered by one of those hashes is owed again."""
        covered, recheck = self._wb_covered, self._wb_recheck
        for block_hash in hashes:
            gpu_block = covered.pop(block_hash, None)
            if gpu_block is not None:
                recheck[gpu_block] = None

    def _wb_gpu_evicted(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash]) -> None:
        """GPU evictions: the blocks hold other content from now on, their covers are moot."""
        covered = self._wb_covered
        for block_hash in hashes:
            covered.pop(block_hash, None)

    def _release(self, entries: StoreCandidates) -> None:
        """Drop the GPU references held for candidates that will not be copied, and their owners' holds."""
        self._unhold(entries.held_sources())
        self.ended.drop_holds(entries.owners)

    def _unhold(self, held: list[BlockId]) -> None:
        if held:
            assert self.gpu is not None, "references are held only with a GPU pool"
            self.gpu.decref(held)

    def _choose(self, cands: StoreCandidates,
                limit: float) -> tuple[Batch, list[list[BlockId]], list[list[BlockId]]] | None:
        """Pick the candidates to copy (at most ``limit``) and allocate their CPU blocks; skipped ones drop
        their GPU holds."""
        cpu, gpu, inflight, stats = self.cpu, self.gpu, self._inflight, self.stats
        hashes = cands.hashes
        chosen: list[int] = []
        skipped: list[int] = []
        flying = 0
        # deduplicate against stores in flight and this step, and the CPU tier
        for i, (h, stored) in enumerate(zip(hashes, self._on_cpu(hashes))):
            if h in inflight:
                flying += 1
                skipped.append(i)
            elif stored:
                skipped.append(i)
            else:
                inflight.add(h)
                chosen.append(i)
        stats.stores_in_flight.add(flying)
        stats.stores_deduplicated.add(len(skipped) - flying)
        free = cpu.num_free
        keep = int(min(free, limit))
        if len(chosen) > keep:  # store fewer, never fail the engine
            for i in chosen[keep:]:
                inflight.discard(hashes[i])
            skipped += chosen[keep:]
            (stats.stores_dropped if keep == free else stats.stores_backpressured).add(len(chosen) - keep)
            del chosen[keep:]
        cpu_blocks = cpu.allocate(len(chosen)) if chosen else []
        self._unhold(cands.held_sources(skipped))
        held = cands.held
        if gpu is not None:
            fresh = cands.sources([i for i in chosen if not held[i]] if True in held else chosen)
            if fresh:
                gpu.incref(fresh)
        owners_of = cands.owners
        distinct = dict.fromkeys([owners_of[i] for i in chosen])
        distinct.pop(None, None)
        owners = cast(list[Request], list(distinct))
        for r in owners:
            r.holds += 1
        if not chosen:
            return None
        # ``chosen`` ascends, so as many as the candidates means every one, in order.
        picked = cands if len(chosen) == len(hashes) else cands.select(chosen)
        src = picked.gpu_ids
        batch = Batch(Direction.STORE, cpu_blocks,
                      [b for row in src for b in row] if gpu is not None else [], owners,
                      hashes=picked.hashes, parents=picked.parents)
        return batch, src, [cpu_blocks for _ in range(self.num_groups)]
