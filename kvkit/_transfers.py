"""In-flight transfers: per-worker completion counting and the batches they belong to."""

from __future__ import annotations

import enum

import attrs

from kvkit.interfaces.types import BlockHash, BlockId, Direction, TransferPlan, TransferResult
from kvkit.request import Request

__all__ = ["Batch", "Outcome", "Transfer", "TransferTable"]


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
        hashes / parents: what each store destination commits as.
        requests: incarnations whose GPU blocks the batch reads or writes.
        num_bytes: bytes its plans move, summed over groups.
        pending: transfers not yet completed on every worker.
        ok: no transfer failed.
        abandoned: a reset came while it was in flight; it never commits.
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


@attrs.define(eq=False)
class Transfer:
    """One plan in flight: which workers reported it, and whether all succeeded."""

    transfer_id: int
    batch: Batch
    num_blocks: int
    reported: int = 0  # bitmask of worker ranks
    ok: bool = True


class Outcome(enum.Enum):
    """What one worker's result did to the table."""

    UNKNOWN = "unknown"  # no such transfer in flight, or a bad worker rank
    DUPLICATE = "duplicate"  # this worker already reported it
    PENDING = "pending"  # counted; other workers still owe a result
    DONE = "done"  # every worker reported: the transfer left the table


@attrs.define
class TransferTable:
    """Transfers in flight, keyed by id; ids only ever increase (never reused, even across resets).

    Invariants: a transfer completes exactly once, when all ``world_size``
    workers reported it; ``batch.pending`` counts its transfers still here.
    """

    world_size: int
    _next_id: int = 0
    _live: dict[int, Transfer] = attrs.field(factory=dict)

    def open(self, batch: Batch, plans: list[TransferPlan]) -> list[tuple[int, TransferPlan]]:
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
        """Count one worker's result; the transfer leaves the table when it is ``DONE``."""
        t = self._live.get(result.transfer_id)
        worker = result.worker
        if t is None or not isinstance(worker, int) or not 0 <= worker < self.world_size:
            return Outcome.UNKNOWN, None
        bit = 1 << worker
        if t.reported & bit:
            return Outcome.DUPLICATE, t
        t.reported |= bit
        t.ok = t.ok and bool(result.ok)
        if t.reported != (1 << self.world_size) - 1:
            return Outcome.PENDING, t
        del self._live[result.transfer_id]
        t.batch.pending -= 1
        return Outcome.DONE, t

    def batches(self) -> list[Batch]:
        """Distinct batches with a transfer in flight."""
        return list({id(t.batch): t.batch for t in self._live.values()}.values())

    def __len__(self) -> int:
        return len(self._live)

    @property
    def next_id(self) -> int:
        """The id the next transfer will get."""
        return self._next_id
