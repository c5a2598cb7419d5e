"""The adaptive policy: the eviction contract, its shadows' replay, and that it follows the best expert."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkit.backends.eviction.adaptive import AdaptivePolicy, Shadow
from kvkit.backends.eviction.fifo import FIFOPolicy
from kvkit.backends.eviction.hit_density import HitDensityPolicy
from kvkit.backends.eviction.lfu import LFUPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.errors import ConfigError
from kvkit.interfaces import BlockId
from kvkit.sim.policy_study import replay
from kvkit.sim.synthetic import SyntheticWorkload, shape
from kvkit.sim.traces import TraceRequest
from kvkit.testing import EvictionPolicyContract


class AdaptivePolicyContract(EvictionPolicyContract):
    checks_refusals = True

    def make_policy(self):
        return AdaptivePolicy()


TestAdaptive = AdaptivePolicyContract.TestCase


class SwitchingAdaptiveContract(EvictionPolicyContract):
    """Two experts, no margin and a short memory: the leader changes often under the contract."""

    checks_refusals = True

    def make_policy(self):
        return AdaptivePolicy(experts=(LRUPolicy, LFUPolicy), half_life=0.5, switch_sigmas=0)


TestSwitchingAdaptive = SwitchingAdaptiveContract.TestCase


class AdaptiveWithoutPinHooksContract(SwitchingAdaptiveContract):
    drive_pin_hooks = False


TestAdaptiveWithoutPinHooks = AdaptiveWithoutPinHooksContract.TestCase


def _requests(keys: list[int]) -> list[TraceRequest]:
    """One single-block request per key (every block a chain root)."""
    return [TraceRequest(i, 16, 1, (k,), i + 1) for i, k in enumerate(keys)]


def _hot_and_scans(rng: random.Random, capacity: int, rounds: int) -> list[int]:
    """A hot set of half the pool, read twice between scans of fresh blocks longer than the pool: LFU wins."""
    hot = list(range(capacity // 2))
    fresh = 10**6
    keys: list[int] = []
    for _ in range(rounds):
        keys += rng.sample(hot, len(hot)) + rng.sample(hot, len(hot))
        keys += range(fresh, fresh + 2 * capacity)
        fresh += 2 * capacity
    return keys


def _shifting_sets(rng: random.Random, capacity: int, rounds: int) -> list[int]:
    """Working sets of most of the pool that move on after a few passes: old counts mislead LFU, LRU wins."""
    keys: list[int] = []
    for phase in range(rounds):
        working = [phase * 10**4 + k for k in range(capacity * 3 // 4)]
        for _ in range(3 if phase == 0 else 2):
            keys += rng.sample(working, len(working))
    return keys


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), capacity=st.integers(20, 60), lfu_wins=st.booleans())
def test_leader_converges_to_the_strictly_better_expert(seed: int, capacity: int, lfu_wins: bool) -> None:
    """On a stream where one expert alone hits clearly more, the adaptive policy ends up led by it
    and nearly matches it."""
    rng = random.Random(seed)
    make = _hot_and_scans if lfu_wins else _shifting_sets
    requests = _requests(make(rng, capacity, 40))
    alone = {e: replay(requests, capacity, e()).hit_ratio for e in (LRUPolicy, LFUPolicy)}
    best = max(alone, key=alone.__getitem__)
    assert best is (LFUPolicy if lfu_wins else LRUPolicy)
    assert alone[best] > alone[min(alone, key=alone.__getitem__)] + 0.05  # strictly, clearly better
    policy = AdaptivePolicy(experts=(LFUPolicy, LRUPolicy) if not lfu_wins else (LRUPolicy, LFUPolicy))
    result = replay(requests, capacity, policy, check_invariants=True)
    assert type(policy.leader) is best
    assert result.hit_ratio >= alone[best] - 0.05


@pytest.mark.parametrize(("expert", "tolerance"), [(LRUPolicy, 0), (HitDensityPolicy, 0.005)])
def test_a_shadow_fed_a_whole_trace_scores_the_expert_replay(expert, tolerance) -> None:
    """A shadow given every reference of a trace hits as the expert's own pool replay (LRU exactly).

    Hit density differs slightly: a pool pins a request's blocks, and its
    pin hooks re-order a class list, which a shadow (no pins) does not.
    """
    requests = list(shape("chat", block_size=64).requests())[:400]
    capacity = 300
    shadow = Shadow(expert())
    hits = 0
    for request in requests:
        parent = None
        for block_hash in request.hash_ids:
            hits += shadow.reference(block_hash, parent, capacity)
            parent = block_hash
        hits += shadow.flush(capacity)  # the next request could continue this chain's last block
        shadow.check_invariants()
    expected = replay(requests, capacity, expert()).hits
    assert abs(hits - expected) <= tolerance * expected


def test_one_expert_is_that_expert() -> None:
    """With a single expert the adaptive policy evicts exactly as that expert does."""
    requests = list(SyntheticWorkload(num_conversations=60, block_size=64).requests())
    assert (replay(requests, 200, AdaptivePolicy(experts=(HitDensityPolicy,))).hits
            == replay(requests, 200, HitDensityPolicy()).hits)


@pytest.mark.parametrize("experts", [(), (LRUPolicy, 3), (lambda: object(),)])
def test_bad_experts_are_refused(experts) -> None:
    """Experts must be a non-empty sequence of factories of pin-aware policies; the message quotes them."""
    with pytest.raises(ConfigError, match="experts"):
        AdaptivePolicy(experts=experts)


def test_fifo_expert_is_accepted_and_reported() -> None:
    """Any pin-aware policy class can be an expert; ``lead`` names each by class."""
    policy = AdaptivePolicy(experts=(FIFOPolicy, LRUPolicy))
    assert set(policy.lead) == {"FIFOPolicy", "LRUPolicy"}


def test_a_selection_that_fails_keeps_the_leader() -> None:
    """A challenger whose lead clears the bar takes over only with a selection that succeeds: one that returns
    ``None`` changes nothing, the leader included (the contract's atomic ``None``)."""
    policy = AdaptivePolicy(experts=(LRUPolicy, LFUPolicy), switch_sigmas=0)
    policy.on_insert(BlockId(0), 7, None)
    policy._lead = [[0.0, -1.0], [1.0, 0.0]]  # LFU leads LRU by one hit, past a bar of 0 sigmas
    policy._var = [[0.0, 1.0], [1.0, 0.0]]
    policy.check_invariants()
    assert policy.select_victims(2, lambda block: True) is None
    assert isinstance(policy.leader, LRUPolicy)
    assert policy.select_victims(1, lambda block: True) == [BlockId(0)]
    assert isinstance(policy.leader, LFUPolicy)
