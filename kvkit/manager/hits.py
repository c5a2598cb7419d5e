"""CPU hits: pinned at lookup, accepted at allocation, loaded into the GPU blocks after the GPU hit.

Offered hit block ``i`` of a request sits at position ``gpu_hit_blocks + i``;
the engine accepts a prefix of the offered hit and may recompute its first
``head_blocks`` itself (the head, computed while the rest loads), so the
loaded block ``j`` goes to position ``gpu_hit_blocks + head_blocks + j`` of
each KV group; a sliding-window group loads only the positions inside its
window before the hit end (the others may be the engine's null block).

Invariants: each block in ``Request.pinned`` carries one CPU reference, held
by the request from lookup until its load is planned and by the load's batch
after; only the accepted prefix of an offered hit stays pinned.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvkit.errors import RequestStateError
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.types import BlockHash, BlockId, Direction, GroupKind, KVCacheSpec
from kvkit.manager.requests import Request
from kvkit.manager.transfers import Batch

__all__ = ["CpuHits"]


@attrs.frozen(eq=False)
class CpuHits:
    """Finds, pins, checks and plans the loads of CPU hits (owns no state beyond the pools').

    Args:
        kv: the KV cache shape (block size, groups).
        cpu: the CPU tier's pool, whose references the pins are.
        gpu: the GPU pool when the manager holds references on load
            destinations (``None`` for external engines).
        null_block: the engine's id for a missing block.
    """

    kv: KVCacheSpec
    cpu: BlockAllocator
    gpu: BlockAllocator | None
    null_block: int

    def pin(self, r: Request, hashes: Sequence[BlockHash]) -> int:
        """Pin the CPU-ready prefix of ``hashes`` for ``r`` (one reference each); return its length."""
        blocks = self.cpu.lookup(hashes) if hashes else []
        if blocks:
            self.cpu.incref(blocks)
        r.pinned = blocks
        r.offered_blocks = r.offered_cpu = len(blocks)
        r.head_blocks = 0
        return len(blocks)

    def unpin(self, r: Request) -> None:
        """Release ``r``'s pins and the blocks reserved for its shared-tier fetch; no load is pending afterwards."""
        if r.pinned:
            self.cpu.decref(r.pinned)
            r.pinned = []
        if r.fetch:
            self.cpu.decref(r.fetch)  # never committed: the blocks are empty again
            r.fetch = []
        r.load_pending = False

    def accept(self, r: Request, n: int, head: int = 0) -> None:
        """Keep blocks ``[head, n)`` of ``r``'s offered hit (CPU pins, then fetch blocks) to load; release the rest.

        The first ``head`` blocks are recomputed by the engine (``r.head_blocks``).
        """
        c = len(r.pinned)
        keep = r.pinned[head:n]
        drop = r.pinned[:min(head, c)] + r.pinned[n:]
        lo, hi = max(head - c, 0), max(n - c, 0)
        fetch, unfetch = r.fetch[lo:hi], r.fetch[:lo] + r.fetch[hi:]
        if drop or unfetch:
            self.cpu.decref(drop + unfetch)
        if keep:
            self.cpu.touch(keep)  # a use, for the CPU eviction policy: only what is loaded
        r.pinned, r.fetch = keep, fetch
        r.fetch_start += lo
        r.head_blocks = head if keep or fetch else 0
        r.load_pending = bool(keep or fetch)

    def check_targets(self, r: Request, table: list[list[BlockId]], n: int, head: int = 0) -> None:
        """Raise ``RequestStateError`` unless ``table`` has a real GPU block at each position ``r`` loads:
        blocks ``[head, n)`` of its hit."""
        assert r.gpu_hit_blocks is not None, "a request with a hit was looked up"
        start, stop = r.gpu_hit_blocks + head, r.gpu_hit_blocks + n
        for g, row in enumerate(table):
            first = self._first_loaded(g, start, stop)
            targets = row[first:stop]
            if len(targets) != stop - first or self.null_block in targets:
                raise RequestStateError(
                    f"request {r.request_id!r}: group {g} needs GPU blocks at positions "
                    f"[{first}, {stop}) for its CPU hit, got {row[first:stop]!r}")

    def plan(self, reqs: list[Request], group_bytes: Sequence[int]) -> tuple[Batch, list[list[BlockId]],
                                                                          list[list[BlockId]]]:
        """One load batch for the accepted hits of ``reqs`` and its per-group ``(src, dst)`` ids.

        The requests' pins move to the batch, and each request holds it once;
        with ``gpu`` one reference is taken on every destination block. The
        batch's ``shares`` hold each request's CPU blocks and bytes
        (``group_bytes``: one block's bytes per group).
        """
        groups = range(len(self.kv.groups))
        src: list[list[BlockId]] = [[] for _ in groups]
        dst: list[list[BlockId]] = [[] for _ in groups]
        cpu_blocks: list[BlockId] = []
        shares: list[tuple[int, int]] = []
        for r in reqs:
            assert r.gpu_hit_blocks is not None, "a request with a hit was looked up"
            blocks, start = r.pinned, r.gpu_hit_blocks + r.head_blocks
            stop = start + len(blocks)
            num_bytes = 0
            for g in groups:
                first = self._first_loaded(g, start, stop)
                src[g] += blocks[first - start:]
                dst[g] += r.block_table[g][first:stop]
                num_bytes += (stop - first) * group_bytes[g]
            shares.append((len(blocks), num_bytes))
            cpu_blocks += blocks
            r.pinned = []  # the pins move to the batch
            r.load_pending = False
            r.holds += 1
        gpu_blocks = [b for row in dst for b in row] if self.gpu is not None else []
        if gpu_blocks:
            assert self.gpu is not None
            self.gpu.incref(gpu_blocks)
        return Batch(Direction.LOAD, cpu_blocks, gpu_blocks, reqs, shares=shares), src, dst

    def unfilled(self, r: Request) -> range:
        """Positions of ``r``'s accepted hit that some sliding-window group does not load (it holds no KV there)."""
        assert r.gpu_hit_blocks is not None, "a request with a hit was looked up"
        start = r.gpu_hit_blocks + r.head_blocks
        stop = start + len(r.pinned) + len(r.fetch)
        return range(start, max(self._first_loaded(g, start, stop) for g in range(len(self.kv.groups))))

    def _first_loaded(self, g: int, start: int, stop: int) -> int:
        """First block position of ``[start, stop)`` that group ``g`` must load."""
        group = self.kv.groups[g]
        if group.kind is GroupKind.FULL:
            return start
        bs = self.kv.block_size
        return max(start, stop - group.blocks_needed(stop * bs, bs))
