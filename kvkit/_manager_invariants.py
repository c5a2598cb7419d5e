"""Consistency checks behind :meth:`~kvkit.manager.OffloadManager.check_invariants`.

Each check reads only the state it is handed and raises ``AssertionError`` on
a kvkit bug; none changes anything.
"""

from __future__ import annotations

from collections import Counter

from kvkit._transfers import Batch
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.types import BlockHash, Direction
from kvkit.request import Request, RequestState

__all__ = ["check_in_flight", "check_live"]


def check_in_flight(batches: list[Batch], cpu: BlockAllocator, draining: bool,
                    inflight_hashes: set[BlockHash]) -> Counter[int]:
    """Check the batches in flight against the CPU pool and the in-flight hash set.

    Returns:
        How many batches hold each request incarnation, keyed by ``id()``.
    """
    holds: Counter[int] = Counter()
    inflight: list[BlockHash] = []
    for batch in batches:
        assert batch.pending > 0, "a batch in the table has no pending transfer"
        for r in batch.requests:
            holds[id(r)] += 1
        if batch.direction is Direction.STORE:
            assert all(cpu.block_hash(b) is None for b in batch.cpu_blocks), (
                "an in-flight store's CPU block is findable before completion")
            if not batch.abandoned:
                inflight += batch.hashes
        else:
            assert all(cpu.block_hash(b) is not None for b in batch.cpu_blocks), (
                "an in-flight load's source is not ready")
        assert not draining or batch.abandoned, "a transfer was planned during a drain"
    assert len(inflight) == len(set(inflight)), "a hash has two stores in flight"
    assert set(inflight) == inflight_hashes, "in-flight hash set != uncommitted stores"
    return holds


def check_live(requests: dict[str, Request], dirty: dict[str, Request], cpu: BlockAllocator,
               block_size: int, holds: Counter[int]) -> None:
    """Check each live request's fields against each other, the CPU pool and ``holds``."""
    bs = block_size
    for rid, r in requests.items():
        assert r.request_id == rid and r.state is not RequestState.ENDED, (rid, r.state)
        assert r.num_confirmed_blocks == min(r.num_computed_tokens // bs,
                                             len(r.block_hashes)), rid
        assert all(0 <= i < r.num_confirmed_blocks for i in r.store_queue), rid
        assert not r.store_queue or rid in dirty, f"{rid}: queued stores not dirty"
        assert not r.pinned or r.state is RequestState.WAITING or r.load_pending, rid
        assert all(cpu.block_hash(b) is not None for b in r.pinned), f"{rid}: pin not ready"
        assert r.holds == holds[id(r)], f"{rid}: holds {r.holds} != {holds[id(r)]}"
