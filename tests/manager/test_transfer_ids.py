"""Invariant 11 for transfer ids: unique for the manager's whole life (resets included), each completing once.

The manager machine checks a transfer's effects; this property checks its
identity: random interleavings of requests (stores and CPU-hit loads), steps,
out-of-order completions, repeated results and resets never hand out an id
twice, and a result applies only the first time it arrives.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.backends.allocator import BlockPool
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.store import EagerStore
from kvkit.interfaces import KVCacheSpec, TransferResult
from kvkit.manager import OffloadManager

BS = 4
SPEC = KVCacheSpec(num_layers=2, block_size=BS, num_kv_heads=1, head_dim=2)
NTOK = 3 * BS + 1  # three full blocks and one token to compute

# Weighted so that stores commit and their prefixes come back as loads between resets.
_OPS = ("request",) * 3 + ("finish",) * 2 + ("step",) * 3 + ("deliver",) * 2 + ("repeat", "reset")
_ops = st.lists(st.tuples(st.sampled_from(_OPS), st.integers(0, 2**16)), min_size=10, max_size=60)


def _run(ops: list[tuple[str, int]], manager_cls: type[OffloadManager] = OffloadManager) -> None:
    """Drive a manager through ``ops``, then drain it; fail if an id repeats or completes twice."""
    mgr = manager_cls(SPEC, BlockPool(8, eviction=LRUPolicy()), EagerStore(),
                      gpu=BlockPool(64, eviction=LRUPolicy()))
    issued: set[int] = set()
    outstanding: list[int] = []
    completed: list[int] = []

    def deliver(tids: list[int]) -> None:
        for tid in tids:
            in_flight = mgr.num_in_flight
            mgr.apply_completions([TransferResult(tid)])
            assert mgr.num_in_flight == in_flight - 1, f"transfer {tid} did not complete exactly once"
            outstanding.remove(tid)
            completed.append(tid)

    def finish(rid: str) -> None:
        table, hit = live.pop(rid)
        # Without a hit it computes and its blocks are stored; with one it ends before computing.
        mgr.finish(rid, num_computed_tokens=None if hit else NTOK)
        mgr.gpu.decref(table)  # the engine's own references; the manager holds what copies need

    live: dict[str, tuple[list[int], int]] = {}
    for n, (op, arg) in enumerate(ops):
        if op == "request" and len(live) < 8:  # a prefix stored before becomes a CPU hit to load
            rid = f"r{n}"
            mgr.add_request(rid, [arg % 2 * 1000 + i for i in range(3)], NTOK)
            hit = mgr.lookup(rid, 0)
            table = mgr.gpu.allocate(-(-NTOK // BS))
            mgr.on_allocated(rid, [table], hit)
            live[rid] = (table, hit)
        elif op == "finish" and live:
            finish(list(live)[arg % len(live)])
        elif op == "step":
            for tid, _ in mgr.build_step():
                assert tid not in issued, f"transfer id {tid} handed out twice"
                issued.add(tid)
                outstanding.append(tid)
        elif op == "deliver" and outstanding:
            picked = random.Random(arg).sample(outstanding, k=1 + arg % len(outstanding))
            deliver(picked)
        elif op == "repeat" and completed:
            tid = completed[arg % len(completed)]
            unknown = mgr.stats.unknown_completions.value
            mgr.apply_completions([TransferResult(tid)])
            assert mgr.stats.unknown_completions.value == unknown + 1, f"transfer {tid} completed twice"
        elif op == "reset":
            mgr.reset()
        mgr.check_invariants()
    for rid in list(live):
        finish(rid)
    for tid, _ in mgr.build_step():  # the finish flushes
        assert tid not in issued, f"transfer id {tid} handed out twice"
        outstanding.append(tid)
    deliver(list(outstanding))
    assert mgr.num_in_flight == 0 and mgr.num_requests == 0
    assert mgr.reset() is True
    mgr.check_invariants()


@given(_ops)
def test_transfer_ids_are_never_reused_and_complete_once(ops):
    """Across resets, every planned transfer gets a fresh id and completes exactly once."""
    _run(ops)


class _IdsRestartAtReset(OffloadManager):
    """Planted bug: ids start again at 0 after a reset, so late results hit new transfers."""

    def reset(self) -> bool:
        emptied = super().reset()
        self._transfers._next_id = 0
        return emptied


def test_property_catches_ids_restarting_at_reset():
    """The property fails for a manager whose ids restart after a reset."""
    with pytest.raises(AssertionError, match="handed out twice"):
        _run([("request", 0), ("finish", 0), ("step", 0), ("reset", 0), ("deliver", 0),
              ("request", 1), ("finish", 0), ("step", 0)],
             _IdsRestartAtReset)
