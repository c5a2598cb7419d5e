"""Bad input to a policy's newer entry points (counts, experts, hints): a typed error quoting it, nothing changed."""

import copy

import pytest

from kvkit.backends.eviction.adaptive import AdaptivePolicy
from kvkit.backends.eviction.hinted import HintedPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.eviction.prefix_lru import PrefixLRUPolicy
from kvkit.errors import ConfigError, PoolUsageError
from kvkit.interfaces.hints import WorkloadHints
from kvkit.registry import EVICTION


def _make(name):
    return EVICTION.create(name, slot="policy", **({"references": ()} if name == "opt" else {}))


@pytest.mark.parametrize("name", sorted(EVICTION.names()))
@pytest.mark.parametrize("n", [2**63, 10**30])
def test_a_victim_count_beyond_any_pool_is_refused(name, n):
    """Every policy refuses a count no pool can hold with PoolUsageError quoting it, not islice's ValueError."""
    policy = _make(name)
    if name != "opt":
        policy.on_insert(0, 100, None)
    with pytest.raises(PoolUsageError, match=rf"n={n}: must be at most"):
        policy.select_victims(n, lambda b: True)
    policy.check_invariants()


@pytest.mark.parametrize("name", ["fifo", "lru", "lfu", "arc", "lirs", "prefix-lru"])
def test_a_negative_block_id_is_refused_by_a_policy_with_flat_per_block_state(name):
    """Flat state is indexed by id: -1 would name the last slot, so it is refused, quoted, nothing changed."""
    policy = _make(name)
    policy.on_insert(0, 100, None)
    with pytest.raises(PoolUsageError, match=r"block ids are ints >= 0, got -1"):
        policy.on_insert(-1, 101, None)
    assert len(policy) == 1
    policy.check_invariants()
    assert policy.select_victims(1, lambda b: True) == [0]


def test_adaptive_refuses_experts_that_need_arguments():
    """An expert factory that cannot be called bare (``opt`` needs the future) is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=r"experts must be factories callable with no arguments.*OptimalPolicy"):
        EVICTION.create("adaptive", experts=[EVICTION.load("opt")])


@pytest.mark.parametrize(("block", "block_hash", "pattern"), [
    (2, 10, r"hash 10 of block 2 is already tracked by block 1 in AdaptivePolicy"),
    (1, 11, r"block 1 is already tracked by AdaptivePolicy"),
])
def test_adaptive_refuses_a_tracked_block_or_hash_before_any_mirror_hears_it(block, block_hash, pattern):
    """Mirrors differ in what they refuse (LRU takes a repeated hash): the refusal comes first, no mirror changes."""
    policy = AdaptivePolicy(experts=[LRUPolicy, PrefixLRUPolicy])
    policy.on_insert(1, 10, None)
    with pytest.raises(PoolUsageError, match=pattern):
        policy.on_insert(block, block_hash, None)
    policy.check_invariants()
    assert [len(m) for m in policy._mirrors] == [1, 1]
    policy.on_insert(2, 11, 10)
    assert policy.select_victims(2, lambda b: True) is not None


BAD_HINTS = {
    "hashes an int": (5, WorkloadHints(priority=1), r"hashes=5: must be a sequence"),
    "hashes a str": ("abc", WorkloadHints(priority=1), r"hashes='abc': must be a sequence"),
    "a float hash": ([1.5], WorkloadHints(priority=1), r"hashes=\[1.5\]: block hashes must be ints, got 1.5"),
    "a nested hash last": ([1, 2, [3]], WorkloadHints(priority=1), r"got \[3\]"),
    "a None hash": ([1, None], WorkloadHints(priority=1), r"got None"),
    "a bool hash": ([True], WorkloadHints(priority=1), r"got True"),
    "hints a dict": ([1], {"priority": 1}, r"hints must be a WorkloadHints"),
}


@pytest.mark.parametrize(("hashes", "hints", "pattern"), BAD_HINTS.values(), ids=BAD_HINTS.keys())
def test_bad_hints_are_refused_whole(hashes, hints, pattern):
    """``on_hints`` checks every hash before hearing any: a refusal leaves no hash with the new priority."""
    policy = HintedPolicy(capacity=8)
    policy.on_hints([7], WorkloadHints(priority=-1))
    before = copy.deepcopy(policy._pending)
    with pytest.raises(ConfigError, match=pattern):
        policy.on_hints(hashes, hints)
    assert policy._pending == before
    for block, block_hash in enumerate((1, 2, 3)):
        policy.on_insert(block, block_hash, None)
        assert policy.hints_of(block) is None
    policy.check_invariants()


@pytest.mark.parametrize("ttl", [10**400, -(10**400), float("inf"), float("nan"), 0, True, "5"])
def test_workload_hints_refuse_unusable_retention(ttl):
    """A retention that is not a finite number of seconds > 0 is a ConfigError, even an int beyond any float."""
    with pytest.raises(ConfigError, match=r"WorkloadHints.ttl_s="):
        WorkloadHints(ttl_s=ttl)
