"""Optional capabilities: each protocol recognises what has it and refuses what lacks it; ``Tier``."""

import pytest

import kvkit.reference.engine as engine_loop
from kvkit.backends.allocator import BlockPool
from kvkit.backends.copy import TorchCopy
from kvkit.backends.copy.cuda_dma import CudaDMACopy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.eviction.s3fifo import S3FIFOPolicy
from kvkit.errors import ConfigError
from kvkit.interfaces import (
    BlockAllocator,
    EvictionOrder,
    EvictionPolicy,
    ExplainsUnavailability,
    PinAwarePolicy,
    PrefillCompute,
    ReportsAvailability,
    SelfChecking,
    Tier,
)
from kvkit.interfaces.capabilities import pin_hooks


class _HooksOnly:
    """Pin hooks without the rest of an eviction policy."""

    def on_pin(self, block):
        pass

    def on_unpin(self, block):
        pass


def test_pin_aware_policy_needs_both_hooks_on_an_eviction_policy():
    """Policies with both hooks are PinAwarePolicy; plain policies, opt-outs and bare hooks are not."""
    assert isinstance(S3FIFOPolicy(), PinAwarePolicy) and isinstance(LRUPolicy(), PinAwarePolicy)
    plain = type("Plain", (LRUPolicy,), {"on_pin": None, "on_unpin": None})()
    assert not isinstance(plain, PinAwarePolicy) and isinstance(plain, EvictionPolicy)
    assert not isinstance(_HooksOnly(), PinAwarePolicy)
    opted_out = type("OptedOut", (S3FIFOPolicy,), {"on_pin": None, "on_unpin": None})()
    assert not isinstance(opted_out, PinAwarePolicy)


def test_pin_hooks_binds_the_pair_or_refuses_half_of_it():
    """pin_hooks returns the bound pair of a PinAwarePolicy, None without hooks, ConfigError for half."""
    policy = S3FIFOPolicy()
    assert pin_hooks(policy) == (policy.on_pin, policy.on_unpin)
    assert pin_hooks(type("Plain", (LRUPolicy,), {"on_pin": None, "on_unpin": None})()) is None
    half = type("Half", (LRUPolicy,), {"on_pin": lambda self, block: None, "on_unpin": None})()
    with pytest.raises(ConfigError, match=r"Half needs both pin hooks.*on_unpin=None"):
        pin_hooks(half)


_POOL_MEMBERS = ("num_blocks", "num_free", "allocate", "incref", "decref", "commit", "lookup", "touch",
                 "refcount", "block_hash", "add_evict_listener", "reset", "check_invariants")


def test_eviction_order_is_a_pool_that_previews_victims():
    """BlockPool is an EvictionOrder; a pool without eviction_candidates, or a non-pool, is not."""
    pool = BlockPool(4, eviction=LRUPolicy())
    assert isinstance(pool, EvictionOrder) and isinstance(pool, BlockAllocator)
    members = dict.fromkeys(_POOL_MEMBERS, lambda *args: None)
    no_preview = type("NoPreview", (), members)()
    assert isinstance(no_preview, BlockAllocator) and not isinstance(no_preview, EvictionOrder)
    assert isinstance(type("Previews", (), {**members, "eviction_candidates": lambda self, n: []})(), EvictionOrder)
    assert not isinstance(LRUPolicy(), EvictionOrder)


def test_availability_capabilities_are_checked_on_classes():
    """A class with is_available reports availability; only one with unavailable_reason explains it."""
    assert isinstance(CudaDMACopy, ExplainsUnavailability) and isinstance(CudaDMACopy, ReportsAvailability)
    assert isinstance(TorchCopy, ReportsAvailability) and not isinstance(TorchCopy, ExplainsUnavailability)
    assert not isinstance(LRUPolicy, ReportsAvailability)
    assert (CudaDMACopy.unavailable_reason() is None) == CudaDMACopy.is_available()


def test_self_checking_needs_check_invariants():
    """Pools, policies and copy backends check themselves; an arbitrary object does not."""
    for component in (BlockPool(2, eviction=LRUPolicy()), LRUPolicy(), TorchCopy()):
        assert isinstance(component, SelfChecking), component
    assert not isinstance(object(), SelfChecking)
    assert not isinstance(type("Opted", (TorchCopy,), {"check_invariants": None})(), SelfChecking)


def test_prefill_compute_lives_in_interfaces_and_stays_importable_from_the_engine_loop():
    """The engine loop re-imports PrefillCompute; its default compute satisfies it, a bare object does not."""
    assert engine_loop.PrefillCompute is PrefillCompute
    assert isinstance(engine_loop.SyntheticCompute(), PrefillCompute)
    assert not isinstance(object(), PrefillCompute)


def test_tier_is_a_str_enum_of_the_two_tiers():
    """Tier members equal, hash and format as their values, and convert back from them."""
    assert [t.value for t in Tier] == ["gpu", "cpu"]
    for tier in Tier:
        assert tier == tier.value and hash(tier) == hash(tier.value) and f"{tier}" == tier.value
        assert Tier(tier.value) is tier and {tier.value: 1}[tier] == 1
    with pytest.raises(ValueError, match="'disk' is not a valid Tier"):
        Tier("disk")
