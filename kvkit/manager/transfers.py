"""Transfers in flight: the batches they belong to, per-worker completion counting, settling.

A *batch* is one step's copies in one direction, across KV groups; each of its
per-group plans is one *transfer* with its own id. The table counts every
worker's result and hands a batch back once its last transfer completed on
every worker.

Invariants: transfer ids only increase (never reused, even across resets); a
transfer completes exactly once, when all ``world_size`` workers reported it;
a batch is settled exactly once, after its last transfer completed; a store
commits (becomes findable) only if no transfer of it failed and no reset
abandoned it, and is discarded otherwise; a shared-tier fetch commits block by
block: each block that no worker reported lost (``TransferResult.lost``), the
others discarded.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import attrs
import numpy as np

from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.shared import SharedPlan
from kvkit.interfaces.types import BlockHash, BlockId, Direction, TransferPlan, TransferResult
from kvkit.manager.events import Events
from kvkit.manager.requests import Request
from kvkit.stats import OffloadStats

__all__ = ["Batch", "Outcome", "Transfer", "TransferTable"]

_Plan = TypeVar("_Plan", TransferPlan, SharedPlan)
_T = TypeVar("_T")


@attrs.define(eq=False)
class Batch:
    """One step's transfers in one direction, across KV groups.

    The CPU blocks of a batch are shared by its per-group plans (a CPU block
    holds every group's piece), so the batch commits or releases only when
    all its transfers completed.

    Attributes:
        direction: store or load.
        cpu_blocks: store destinations (allocated, not ready) or load sources
            (pinned); the batch owns one reference on each.
        gpu_blocks: GPU blocks the manager holds one reference on (empty
            without a GPU pool).
        requests: incarnations whose GPU blocks the batch reads or writes;
            each holds the batch once.
        hashes / parents: what each store destination commits as.
        num_bytes: bytes its plans move, summed over groups.
        pending: transfers not yet completed on every worker.
        ok: no transfer failed.
        abandoned: a reset came while it was in flight; it never commits.
        shared: a shared-tier transfer (one :class:`~kvkit.interfaces.SharedPlan`):
            ``LOAD`` fetches from the store into ``cpu_blocks`` (allocated, not
            ready; committed when every worker's fetch landed), ``STORE`` puts
            ready ``cpu_blocks`` into the store.
        prefetch: a shared-tier fetch for waiting requests (no load reads it;
            it touches no GPU block).
        fetched: a load's sources that a fetch of the same step fills (not
            ready until that fetch commits).
        shares: a load's ``(CPU blocks, bytes)`` per request, in ``requests``' order.
        failed: a load's requests (incarnations) that some worker could not
            load although every transfer reported ``ok`` (their blocks were
            left out of its copies): they fail, the others load, and their
            shares count in no loaded block or byte.
        lost: a shared-tier fetch's positions (in ``cpu_blocks``) of the blocks some
            worker reported lost while its fetch succeeded: they are discarded, the
            others commit (sorted, distinct).
        committed: hashes that became findable when it settled.
        committed_parents: ``committed``'s parents (``None`` where unknown).
        seconds: the longest time a worker reported for one of its transfers
            (0 when none was measured).
    """

    direction: Direction
    cpu_blocks: list[BlockId]
    gpu_blocks: list[BlockId]
    requests: list[Request]
    hashes: list[BlockHash] = attrs.field(factory=list)
    parents: list[BlockHash | None] = attrs.field(factory=list)
    num_bytes: int = 0
    pending: int = 0
    ok: bool = True
    abandoned: bool = False
    shared: bool = False
    prefetch: bool = False
    fetched: list[BlockId] = attrs.field(factory=list)
    shares: list[tuple[int, int]] = attrs.field(factory=list)
    failed: list[Request] = attrs.field(factory=list)
    lost: list[int] = attrs.field(factory=list)
    committed: list[BlockHash] = attrs.field(factory=list)
    committed_parents: list[BlockHash | None] = attrs.field(factory=list)
    seconds: float = 0.0

    def plans(self, src: Sequence[Sequence[int]], dst: Sequence[Sequence[int]],
              group_bytes: list[int]) -> list[TransferPlan]:
        """Per-group id lists as plans (empty groups skipped); their bytes count in ``num_bytes``."""
        out = []
        for g, (s, d) in enumerate(zip(src, dst)):
            if s:
                out.append(TransferPlan(np.array(s, dtype=np.int64),
                                        np.array(d, dtype=np.int64), self.direction, g))
                self.num_bytes += len(s) * group_bytes[g]
        assert out, "a batch with blocks must copy at least one group"
        return out

    def intact(self, items: Sequence[_T]) -> list[_T]:
        """``items`` (one per CPU block, in order) but those of the ``lost`` blocks."""
        lost = set(self.lost)
        return [item for i, item in enumerate(items) if i not in lost]

    def left_out(self) -> tuple[int, int]:
        """The CPU blocks and bytes a successful batch did not move: a fetch's ``lost`` blocks, a load's
        ``failed`` requests' shares (left out of its copies)."""
        if self.lost:
            return len(self.lost), self.num_bytes * len(self.lost) // len(self.cpu_blocks)
        if not self.failed:
            return 0, 0
        lost = [share for r, share in zip(self.requests, self.shares, strict=True) if r in self.failed]
        return sum(n for n, _ in lost), sum(b for _, b in lost)

    def settle(self, cpu: BlockAllocator, gpu: BlockAllocator | None, stats: OffloadStats) -> bool:
        """Commit or discard the CPU blocks and drop the batch's pool references (once, when done).

        A store to the CPU tier and a fetch from the shared tier commit their
        CPU blocks (``committed``: the hashes that became findable; a hash the
        CPU tier already holds stays with its first block); a fetch's ``lost``
        blocks are discarded, and count in no fetched block or byte.

        Returns:
            Whether the batch succeeded: no transfer failed and no reset abandoned it.
        """
        ok = self.ok and not self.abandoned
        if ok:
            count = len(self.cpu_blocks)
            if (self.direction is Direction.STORE) is not self.shared:  # a CPU store or a fetch commits
                ids, hashes = self.cpu_blocks, self.hashes
                parents = self.parents or [None] * len(hashes)
                if self.lost:  # counted by left_out() below
                    ids, hashes, parents = self.intact(ids), self.intact(hashes), self.intact(parents)
                landed = cpu.commit(ids, hashes, parents)
                if False not in landed:  # the usual case: every block committed
                    self.committed, self.committed_parents = list(hashes), list(parents)
                else:
                    self.committed = [h for h, c in zip(hashes, landed, strict=True) if c]
                    self.committed_parents = [p for p, c in zip(parents, landed, strict=True) if c]
                if not self.shared:
                    count = len(self.committed)  # a store that lost to an equal hash stored nothing
            lost_blocks, lost_bytes = self.left_out()
            blocks, moved = _COUNTERS[self.direction, self.shared]
            getattr(stats, blocks).add(count - lost_blocks)
            getattr(stats, moved).add(self.num_bytes - lost_bytes)
        cpu.decref(self.cpu_blocks)  # a committed block becomes evictable, a discarded one empty
        if self.gpu_blocks:
            assert gpu is not None, "GPU blocks are held only with a GPU pool"
            gpu.decref(self.gpu_blocks)
        return ok


_COUNTERS = {
    (Direction.STORE, False): ("blocks_stored", "bytes_stored"),
    (Direction.LOAD, False): ("blocks_loaded", "bytes_loaded"),
    (Direction.LOAD, True): ("blocks_fetched", "bytes_fetched"),
    (Direction.STORE, True): ("blocks_put", "bytes_put"),
}
"""The stats counters (blocks, bytes) a settled batch adds to, by direction and tier."""


@attrs.define(eq=False)
class Transfer:
    """One plan in flight: which workers reported it, whether all succeeded, and the positions any lost."""

    transfer_id: int
    batch: Batch
    num_blocks: int
    reported: int = 0  # bitmask of worker ranks
    ok: bool = True
    lost: set[int] = attrs.field(factory=set)


class Outcome(enum.Enum):
    """What one worker's result did to the table."""

    UNKNOWN = "unknown"  # no such transfer in flight, or a bad worker rank
    DUPLICATE = "duplicate"  # this worker already reported it
    PENDING = "pending"  # counted; other workers still owe a result
    DONE = "done"  # every worker reported: the transfer left the table


@attrs.define
class TransferTable:
    """Transfers in flight, keyed by id, and the completion counting of every worker's results."""

    world_size: int
    _next_id: int = 0
    _live: dict[int, Transfer] = attrs.field(factory=dict)

    def __len__(self) -> int:
        return len(self._live)

    @property
    def next_id(self) -> int:
        """The id the next transfer will get."""
        return self._next_id

    def open(self, batch: Batch, plans: list[_Plan]) -> list[tuple[int, _Plan]]:
        """Give each plan of ``batch`` a fresh id and track it until it completes."""
        out = []
        for plan in plans:
            tid = self._next_id
            self._next_id += 1
            self._live[tid] = Transfer(tid, batch, len(plan))
            out.append((tid, plan))
        batch.pending += len(plans)
        return out

    def report(self, result: TransferResult) -> tuple[Outcome, Transfer | None]:
        """Count one worker's result; the transfer leaves the table when it is ``DONE``.

        A result's ``lost`` positions add to the transfer's when it is a shared-tier
        fetch and they lie within its plan; otherwise they fail the transfer.
        """
        t = self._live.get(result.transfer_id)
        worker = result.worker
        if t is None or not isinstance(worker, int) or not 0 <= worker < self.world_size:
            return Outcome.UNKNOWN, None
        bit = 1 << worker
        if t.reported & bit:
            return Outcome.DUPLICATE, t
        t.reported |= bit
        t.ok = t.ok and bool(result.ok)
        if result.lost:
            fetch = t.batch.shared and t.batch.direction is Direction.LOAD
            if fetch and result.lost[-1] < t.num_blocks:
                t.lost.update(result.lost)
            else:
                t.ok = False
        if t.reported != (1 << self.world_size) - 1:
            return Outcome.PENDING, t
        del self._live[result.transfer_id]
        t.batch.pending -= 1
        return Outcome.DONE, t

    def completed(self, results: Iterable[TransferResult], stats: OffloadStats,
                  events: Events) -> Iterator[Batch]:
        """Count each result; yield each batch as its last transfer completes on every worker.

        Results for unknown transfer ids (or worker ranks) and repeated results
        from one worker are counted in ``stats`` and otherwise ignored.
        """
        for res in results:
            outcome, t = self.report(res)
            if outcome is Outcome.UNKNOWN:
                stats.unknown_completions.add()
                continue
            assert t is not None  # only an unknown result comes without its transfer
            if outcome is Outcome.DUPLICATE:
                stats.duplicate_completions.add()
                continue
            stats.transfer_seconds.add(res.seconds)
            stats.transfer_bytes.add(res.num_bytes)
            if res.seconds > t.batch.seconds:
                t.batch.seconds = res.seconds
            if outcome is Outcome.PENDING:
                continue
            batch = t.batch
            stats.transfers_completed.add()
            if len(t.lost) == t.num_blocks:  # every block lost on some worker: the fetch failed
                t.ok = False
            if not t.ok:
                stats.transfers_failed.add()
                batch.ok = False
            elif t.lost:
                batch.lost = sorted(t.lost)  # a fetch batch has this one transfer
            if not batch.shared:  # a shared-tier batch reports when it settles
                events.emit("on_transfer_completed", t.transfer_id, batch.direction, t.num_blocks,
                            t.ok and not batch.abandoned)
            if not batch.pending:
                yield batch

    def abandon_all(self) -> int:
        """Mark every batch in flight abandoned by a reset (it never commits).

        Returns:
            Transfers in flight of the batches not abandoned before.
        """
        abandoned = 0
        for batch in self.batches():
            if not batch.abandoned:
                batch.abandoned = True
                abandoned += batch.pending
        return abandoned

    def batches(self) -> list[Batch]:
        """Distinct batches with a transfer in flight."""
        return list({id(t.batch): t.batch for t in self._live.values()}.values())

    def cpu_refs(self) -> Counter[BlockId]:
        """CPU references the batches in flight hold."""
        held: Counter[BlockId] = Counter()
        for batch in self.batches():
            held.update(batch.cpu_blocks)
        return held

    def check_invariants(self, cpu: BlockAllocator, draining: bool) -> tuple[Counter[int], list[BlockHash]]:
        """Check the batches in flight against the CPU pool; raise ``AssertionError`` on a kvkit bug.

        Returns:
            How many batches hold each request incarnation (keyed by ``id()``),
            and the hashes of the stores in flight that may still commit.
        """
        holds: Counter[int] = Counter()
        inflight: list[BlockHash] = []
        for batch in self.batches():
            assert batch.pending > 0, "a batch in the table has no pending transfer"
            for r in batch.requests:
                holds[id(r)] += 1
            assert not batch.failed or (batch.direction is Direction.LOAD and not batch.shared and all(
                r in batch.requests for r in batch.failed)), "a failed request of a batch is not among its loads"
            if batch.shared:
                if not batch.abandoned:  # a fetch is findable only once it landed; a put reads ready blocks
                    ready = [cpu.block_hash(b) is not None for b in batch.cpu_blocks]
                    assert all(ready) if batch.direction is Direction.STORE else not any(ready), (
                        f"a shared-tier {batch.direction.value}'s CPU blocks have the wrong readiness")
            elif batch.direction is Direction.STORE:
                assert all(cpu.block_hash(b) is None for b in batch.cpu_blocks), (
                    "an in-flight store's CPU block is findable before completion")
                if not batch.abandoned:
                    inflight += batch.hashes
            elif not batch.abandoned:  # a forced reset unhashes what abandoned loads still read
                fetched = set(batch.fetched)
                assert all(cpu.block_hash(b) is not None for b in batch.cpu_blocks if b not in fetched), (
                    "an in-flight load's source is not ready")
            assert not draining or batch.abandoned, "a transfer was planned during a drain"
        assert len(inflight) == len(set(inflight)), "a hash has two stores in flight"
        return holds, inflight
