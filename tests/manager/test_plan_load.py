"""The manager's side of load plans: ``plan_load``, ``recompute_tokens``, what is counted, a planner's bug."""

from __future__ import annotations

import pytest

from kvkit.backends.allocator.pool import BlockPool
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.plan import LoadAllPlanner
from kvkit.backends.store.eager import EagerStore
from kvkit.errors import ConfigError, RequestStateError
from kvkit.interfaces import KVCacheSpec, LoadPlan, TransferResult
from kvkit.manager import OffloadManager

SPEC = KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=1, head_dim=4, dtype="uint8")


class _Fixed(LoadAllPlanner):
    def __init__(self, plan=None, error=None):
        self.answer, self.error = plan, error

    def plan(self, query):
        if self.error is not None:
            raise self.error
        return self.answer


def _manager(planner) -> tuple[OffloadManager, BlockPool]:
    gpu = BlockPool(32, LRUPolicy())
    mgr = OffloadManager(SPEC, BlockPool(32, LRUPolicy()), EagerStore(), gpu=gpu, planner=planner)
    mgr.add_request("a", list(range(100, 106)), 25)  # six full blocks stored, then found by "b"
    mgr.lookup("a", 0)
    mgr.on_allocated("a", [gpu.allocate(7)])
    mgr.on_computed("a", 25)
    (tid, _), = mgr.build_step().stores
    mgr.apply_completions([TransferResult(tid, 0)])
    mgr.finish("a")
    mgr.add_request("b", list(range(100, 106)), 26)
    assert mgr.lookup("b", 0) == 24
    return mgr, gpu


def test_a_plan_with_a_head_loads_only_its_tail_and_counts_the_rest():
    """Head 2 blocks, tail 3, 1 declined: the load writes positions 2..4; 3 blocks counted declined."""
    mgr, gpu = _manager(_Fixed(LoadPlan(2, 3, 6)))
    plan = mgr.plan_load("b")
    table = gpu.allocate(7)
    mgr.on_allocated("b", [table], plan.accepted_blocks * 4, recompute_tokens=plan.compute_blocks * 4)
    (tid, load), = mgr.build_step().loads
    assert load.dst.tolist() == table[2:5]
    s = mgr.stats
    assert (s.cpu_hit_tokens.value, s.hits_declined_cpu.value, s.hit_tokens_overlapped.value) == (12, 12, 8)
    mgr.apply_completions([TransferResult(tid, 0)])
    mgr.check_invariants()


def test_without_overlap_a_head_is_refused_as_a_planner_bug():
    """A plan with a head for an engine that loads prefixes only is contained: the whole hit is loaded."""
    mgr, _ = _manager(_Fixed(LoadPlan(2, 3, 6)))
    with pytest.warns(RuntimeWarning, match="planner_errors"):
        assert mgr.plan_load("b", overlap=False) == LoadPlan.load_all(6)
    assert mgr.stats.planner_errors.value == 1


def test_a_planner_that_raises_is_contained():
    mgr, _ = _manager(_Fixed(error=RuntimeError("planner bug")))
    with pytest.warns(RuntimeWarning, match="planner bug"):
        assert mgr.plan_load("b") == LoadPlan.load_all(6)
    assert mgr.stats.planner_errors.value == 1


def test_without_a_planner_the_whole_hit_is_loaded():
    mgr, _ = _manager(None)
    assert mgr.plan_load("b") == LoadPlan.load_all(6)


@pytest.mark.parametrize(("accepted", "recompute"), [(24, 2), (8, 12), (24, -4), (24, 4.0)])
def test_a_recompute_outside_the_accepted_hit_is_refused(accepted, recompute):
    """recompute_tokens: a block-aligned prefix of the accepted tokens; anything else changes nothing."""
    mgr, gpu = _manager(None)
    with pytest.raises(RequestStateError, match="recompute_tokens"):
        mgr.on_allocated("b", [gpu.allocate(7)], accepted, recompute_tokens=recompute)
    assert mgr.request("b").pinned  # still pinned: nothing changed


def test_plan_load_needs_a_lookup_and_a_bool():
    mgr, gpu = _manager(None)
    with pytest.raises(ConfigError, match="overlap"):
        mgr.plan_load("b", overlap=1)
    mgr.on_allocated("b", [gpu.allocate(7)], 24)
    with pytest.raises(RequestStateError, match="plan_load needs a waiting request"):
        mgr.plan_load("b")
