"""Workload hints: the value object, the hint-aware policy's contract and rules, the manager path, the gain."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import rule

from kvkit.backends.allocator import BlockPool
from kvkit.backends.eviction.hinted import HintedPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.store import EagerStore
from kvkit.errors import ConfigError
from kvkit.interfaces import KVCacheSpec
from kvkit.interfaces.hints import HintAwarePolicy, WorkloadHints
from kvkit.manager import OffloadManager
from kvkit.sim.policy_study import TraceClock, replay
from kvkit.sim.synthetic import MixedWorkload
from kvkit.testing import EvictionPolicyContract

_HINTS = st.builds(WorkloadHints, priority=st.integers(-1, 2),
                   ttl_s=st.none() | st.floats(0.5, 5), kind=st.none() | st.just("chat"))


class HintedPolicyContract(EvictionPolicyContract):
    """Hints on random hashes and a clock that moves: every contract property still holds."""

    checks_refusals = True

    def make_policy(self):
        return HintedPolicy(base=LRUPolicy, clock=TraceClock())

    @rule(ks=st.lists(st.integers(0, EvictionPolicyContract.hash_space - 1), max_size=4), hints=_HINTS)
    def hint(self, ks, hints) -> None:
        """Hint some hashes, cached or not."""
        for policy in self.policies():
            policy.on_hints([self.hash_for(k) for k in ks], hints)

    @rule(seconds=st.floats(0, 3))
    def tick(self, seconds) -> None:
        """Let time pass, so retentions run out (a twin is a deep copy: its clock too)."""
        for policy in self.policies():
            policy.clock.now += seconds


TestHinted = HintedPolicyContract.TestCase


class HintedWithoutPinHooksContract(HintedPolicyContract):
    drive_pin_hooks = False


TestHintedWithoutPinHooks = HintedWithoutPinHooksContract.TestCase


@pytest.mark.parametrize("kwargs", [{"priority": 1.5}, {"priority": True}, {"ttl_s": 0}, {"ttl_s": math.inf},
                                    {"ttl_s": "5"}, {"session": ""}, {"kind": 3}])
def test_bad_hints_are_refused_quoting_the_value(kwargs) -> None:
    """Each field is validated on construction; the message quotes the bad value."""
    with pytest.raises(ConfigError, match=re.escape(repr(next(iter(kwargs.values()))))):
        WorkloadHints(**kwargs)


def _pool(policy, n=4) -> BlockPool:
    return BlockPool(n, eviction=policy)


def _fill(pool: BlockPool, hashes: list[int]) -> list[int]:
    blocks = pool.allocate(len(hashes))
    pool.commit(blocks, hashes, [None] * len(hashes))
    pool.decref(blocks)
    return blocks


def test_low_priority_goes_first_and_retained_last_until_expiry() -> None:
    """Low priority is evicted before LRU's order, retained blocks after it, and ordinary once expired."""
    clock = TraceClock()
    policy = HintedPolicy(base=LRUPolicy, clock=clock)
    policy.on_hints([1], WorkloadHints(ttl_s=10))
    policy.on_hints([4], WorkloadHints(priority=-1))
    pool = _pool(policy)
    b1, b2, b3, b4 = _fill(pool, [1, 2, 3, 4])
    assert policy.hints_of(b1) == WorkloadHints(ttl_s=10) and policy.hints_of(b2) is None
    assert policy.select_victims(2, lambda b: True) == [b4, b2]
    assert policy.select_victims(4, lambda b: True) == [b4, b2, b3, b1]  # retained only when nothing else is
    clock.now = 11
    assert policy.select_victims(1, lambda b: True) == [b4]
    assert policy.select_victims(2, lambda b: True) == [b4, b1]  # expired: back at its LRU place, the oldest
    policy.check_invariants()


def test_a_hit_renews_the_retention() -> None:
    """A block used again is retained for ``ttl_s`` after that use."""
    clock = TraceClock()
    policy = HintedPolicy(base=LRUPolicy, clock=clock)
    policy.on_hints([1], WorkloadHints(ttl_s=10))
    pool = _pool(policy, 2)
    b1, b2 = _fill(pool, [1, 2])
    clock.now = 8
    pool.touch([b1])
    clock.now = 9
    pool.touch([b2])  # LRU order now b1, b2
    clock.now = 15  # past the first retention (10), within the renewed one (18)
    assert policy.select_victims(1, lambda b: True) == [b2]
    clock.now = 19
    assert policy.select_victims(1, lambda b: True) == [b1]


def test_the_manager_passes_hints_to_a_hint_aware_cpu_policy_only() -> None:
    """add_request hands the hashes and hints to the CPU policy if it hears them; bad hints are refused."""
    spec = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=2)
    heard: list[tuple[list[int], WorkloadHints]] = []

    class Listening(HintedPolicy):
        def on_hints(self, hashes, hints):
            heard.append((list(hashes), hints))
            super().on_hints(hashes, hints)

    policy = Listening(base=LRUPolicy)
    assert isinstance(policy, HintAwarePolicy)
    manager = OffloadManager(spec, BlockPool(8, eviction=policy), EagerStore(), gpu=BlockPool(16, eviction=LRUPolicy()))
    hints = WorkloadHints(session="s1", kind="chat", ttl_s=60)
    manager.add_request("r1", [11, 12], 9, hints=hints)
    assert heard == [([11, 12], hints)]
    with pytest.raises(ConfigError, match="'urgent'"):
        manager.add_request("r2", [13], 5, hints="urgent")
    plain = OffloadManager(spec, BlockPool(8, eviction=LRUPolicy()), EagerStore(),
                           gpu=BlockPool(16, eviction=LRUPolicy()))
    plain.add_request("r1", [11, 12], 9, hints=hints)  # a policy that does not hear hints: nothing changes
    plain.check_invariants()


def test_hints_gain_on_sessions_among_batch_jobs_and_are_ignored_by_others() -> None:
    """On the mixed workload the hinted rule beats its base; a policy without hints replays identically with them."""
    requests, hints = MixedWorkload(num_sessions=60, block_size=64).hinted()
    clock = TraceClock()
    hinted = replay(requests, 400, HintedPolicy(base=LRUPolicy, clock=clock), hints=hints, clock=clock)
    plain = replay(requests, 400, "lru")
    assert hinted.hit_ratio > plain.hit_ratio + 0.02
    for name in ("lru", "s3fifo", "hit-density"):
        assert replay(requests, 400, name, hints=hints).hits == replay(requests, 400, name).hits


def test_hints_must_be_one_per_request() -> None:
    """A hint list of the wrong length is refused before any replay."""
    requests, hints = MixedWorkload(num_sessions=5, block_size=64).hinted()
    with pytest.raises(ConfigError, match="one per request"):
        replay(requests, 100, "lru", hints=hints[:-1])


def test_studies_leave_out_hinted_unless_asked() -> None:
    """Without hints ``hinted`` is its base's twin, so a default study does not replay it; by name it runs."""
    from kvkit.sim.policy_study import default_policies, study

    assert "hinted" not in default_policies() and "adaptive" in default_policies()
    requests = MixedWorkload(num_sessions=5, block_size=64).requests()
    result = study(list(requests), [50], ["hinted", "lru"], jobs=1)
    assert result.hit_ratio("hinted", 50) >= 0


def test_a_failed_selection_while_a_retained_block_is_in_use_keeps_the_release_order() -> None:
    """Found by the CI profile: a select_victims that fails must not reorder retained blocks parked in use."""

    def run(fail_while_pinned: bool) -> list:
        policy = HintedPolicy(base=LRUPolicy, clock=TraceClock())
        policy.on_hints([10, 11], WorkloadHints(priority=1))
        policy.on_insert(0, 10, None)
        policy.on_insert(1, 11, 10)
        policy.on_pin(0)
        if fail_while_pinned:  # two victims asked, one evictable (block 0 is in use): refused
            assert policy.select_victims(2, lambda b: b != 0) is None
        policy.on_unpin(0)
        policy.check_invariants()
        return policy.select_victims(1, lambda b: True)

    assert run(True) == run(False)
