"""The eviction-policy contract on the prefix-aware policies (prefix LRU, hit density)."""

from __future__ import annotations

from kvkit.backends.eviction.hit_density import HitDensityPolicy
from kvkit.backends.eviction.prefix_lru import PrefixLRUPolicy
from kvkit.testing import EvictionPolicyContract


class PrefixLRUPolicyContract(EvictionPolicyContract):
    checks_refusals = True

    def make_policy(self):
        return PrefixLRUPolicy()


TestPrefixLRU = PrefixLRUPolicyContract.TestCase


class PrefixLRUWithoutPinHooksContract(PrefixLRUPolicyContract):
    drive_pin_hooks = False  # a driver that never pins: prefix LRU must skip pinned blocks itself


TestPrefixLRUWithoutPinHooks = PrefixLRUWithoutPinHooksContract.TestCase


class HitDensityPolicyContract(EvictionPolicyContract):
    checks_refusals = True

    def make_policy(self):
        return HitDensityPolicy()


TestHitDensity = HitDensityPolicyContract.TestCase


class HitDensityWithoutPinHooksContract(HitDensityPolicyContract):
    drive_pin_hooks = False  # a driver that never pins: hit density must skip pinned blocks itself


TestHitDensityWithoutPinHooks = HitDensityWithoutPinHooksContract.TestCase


def _trained(policy: HitDensityPolicy) -> HitDensityPolicy:
    """``policy`` after a warm-up over the contract's own hashes, tracking nothing again."""
    hashes = [EvictionPolicyContract.hash_for(k) for k in range(EvictionPolicyContract.hash_space)]
    for round_ in range(12):
        chain = hashes[round_ % 3: round_ % 3 + 6]
        for block, (parent, block_hash) in enumerate(zip([None, *chain[:-1]], chain, strict=True)):
            policy.on_insert(block, block_hash, parent)
        for block in range(round_ % 4):
            policy.on_access(block)
        for block in reversed(range(len(chain))):
            policy.on_remove(block)
    assert policy.model.table is not None and len(policy) == 0
    return policy


class LearningHitDensityPolicyContract(EvictionPolicyContract):
    """A trained policy with a small assumed pool, so densities decide and keep being refreshed."""

    checks_refusals = True

    def make_policy(self):
        return _trained(HitDensityPolicy(capacity=4, ghost_span=2))


TestLearningHitDensity = LearningHitDensityPolicyContract.TestCase


class LearningHitDensityWithoutPinHooksContract(LearningHitDensityPolicyContract):
    drive_pin_hooks = False


TestLearningHitDensityWithoutPinHooks = LearningHitDensityWithoutPinHooksContract.TestCase
