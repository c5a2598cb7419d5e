"""BlockPool refuses bad input before changing anything, resets by force, and follows its eviction window."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvkit.backends.allocator import BlockPool
from kvkit.backends.eviction.lfu import LFUPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.eviction.s3fifo import S3FIFOPolicy
from kvkit.errors import (
    ConfigError,
    InsufficientMemoryError,
    KVKitError,
    PoolUsageError,
    RefcountError,
    UnknownBlockError,
)
from kvkit.interfaces import EvictionWindow, WindowedPolicy


def state(pool):
    """Everything observable about ``pool``, for atomicity checks."""
    n = pool.num_blocks
    return (pool.num_free, pool.num_empty, pool.num_evictable, pool.num_cached,
            [pool.refcount(b) for b in range(n)], [pool.block_hash(b) for b in range(n)],
            [pool.lookup([h]) for h in (10, 11, 12, 1)])


def busy_pool():
    """Blocks 0 and 1 ready (hashes 10, 11; 0 referenced), block 2 referenced not ready, 3 empty."""
    pool = BlockPool(4, eviction=LRUPolicy())
    blocks = pool.allocate(3)
    pool.commit(blocks[:2], [10, 11])
    pool.decref([1])
    return pool


# Ids that are no ids: a bool is no block number, floats and strings are no ints.
NOT_IDS = [True, False, np.bool_(True), 1.0, np.float64(1.0), "1", None, b"1", (1,), [1], 2**80, -1, 4]


@pytest.mark.parametrize("bad", NOT_IDS, ids=repr)
@pytest.mark.parametrize("method", ["incref", "decref", "touch", "commit"])
def test_an_id_that_is_no_id_is_refused_whole(method, bad):
    """A bad id anywhere in the call raises UnknownBlockError quoting it; no refcount or hash changes."""
    pool = busy_pool()
    before = state(pool)
    args = ([2, bad], [12, 13]) if method == "commit" else ([0, bad],)
    with pytest.raises(UnknownBlockError, match=re.escape(f"block id {bad!r}")):
        getattr(pool, method)(*args)
    assert state(pool) == before
    pool.check_invariants()
    pool.incref([0])  # the pool serves the next valid call fully
    assert pool.refcount(0) == 2


@pytest.mark.parametrize("bad", NOT_IDS, ids=repr)
@pytest.mark.parametrize("getter", ["refcount", "block_hash", "is_ready", "in_eviction_window"])
def test_getters_refuse_what_is_no_id(getter, bad):
    """Read-only calls refuse a bad id with UnknownBlockError too (never IndexError or TypeError)."""
    with pytest.raises(UnknownBlockError):
        getattr(busy_pool(), getter)(bad)


def test_true_is_not_block_one():
    """``incref([True])`` refuses, instead of referencing block 1 (planted: ``True == 1``)."""
    pool = busy_pool()
    with pytest.raises(UnknownBlockError, match=r"block id True is out of range .* bool is not one"):
        pool.incref([True])
    assert pool.refcount(1) == 0


def test_an_out_of_range_id_after_valid_ones_changes_no_refcount():
    """``incref([0, 99])`` raises for 99 and leaves block 0's refcount alone."""
    pool = busy_pool()
    with pytest.raises(UnknownBlockError, match="block id 99 is out of range"):
        pool.incref([0, 99])
    assert pool.refcount(0) == 1
    with pytest.raises(UnknownBlockError, match="99"):
        pool.decref([0, 99])
    assert pool.refcount(0) == 1


@pytest.mark.parametrize("make", [np.int64, np.uint8, np.int32])
def test_numpy_integers_are_taken_as_ints(make):
    """NumPy integer ids and hashes work everywhere and leave only Python ints behind."""
    pool = BlockPool(4, eviction=LRUPolicy())
    blocks = [make(b) for b in pool.allocate(2)]
    pool.incref(blocks)
    pool.commit(blocks, [make(10), make(11)], [None, make(10)])
    assert pool.lookup([make(10), make(11)]) == [0, 1]
    assert all(type(b) is int for b in pool.lookup([10, 11]))
    assert all(type(pool.block_hash(b)) is int for b in range(2))
    pool.touch(blocks)
    pool.decref(blocks)
    pool.decref(np.asarray(blocks))
    assert (pool.refcount(make(0)), pool.num_evictable) == (0, 2)
    pool.check_invariants()


NOT_HASHES = [True, np.bool_(False), 1.5, "10", None, b"10", [10], (10,)]


@pytest.mark.parametrize("bad", NOT_HASHES, ids=repr)
def test_a_hash_that_is_no_int_is_refused(bad):
    """Commit and lookup refuse a hash that is no int (``True`` is not hash 1) with PoolUsageError."""
    pool = busy_pool()
    pool.commit([2], [1])
    before = state(pool)
    fresh = pool.allocate(1)
    with pytest.raises(PoolUsageError, match="block hashes must be ints, got " + re.escape(repr(bad))):
        pool.commit(fresh, [bad])
    if bad is not None:  # None is a parent: the first of a chain
        with pytest.raises(PoolUsageError, match="parent hashes must be ints or None"):
            pool.commit(fresh, [12], [bad])
    with pytest.raises(PoolUsageError, match="lookup hashes must be ints"):
        pool.lookup([10, bad])
    pool.decref(fresh)
    assert state(pool) == before


def test_lookup_reads_only_up_to_the_first_miss():
    """Hashes past the first miss are not read, so a bad one there is not seen (documented)."""
    pool = busy_pool()
    assert pool.lookup([99, "junk"]) == []
    with pytest.raises(PoolUsageError):
        pool.lookup([10, "junk"])


@pytest.mark.parametrize(("method", "arg"), [("incref", range(10**18)), ("decref", range(10**18)),
                                             ("touch", range(10**18))])
def test_an_argument_too_long_to_hold_is_a_typed_error(method, arg):
    """A sequence no pool call could take raises PoolUsageError (never a raw MemoryError)."""
    pool = busy_pool()
    with pytest.raises(PoolUsageError, match="too long"):
        getattr(pool, method)(arg)


@pytest.mark.parametrize("size", [10**15, 2**62, 10**100])
def test_a_pool_too_large_to_allocate_names_the_size(size):
    """A size this machine cannot hold raises InsufficientMemoryError naming it, before anything is kept."""
    with pytest.raises(InsufficientMemoryError, match=f"num_blocks={size}.*bytes"):
        BlockPool(size, eviction=LRUPolicy())


@pytest.mark.parametrize("bad", [True, np.bool_(True), 2.0, "8", None, 0, -1])
def test_bad_sizes_are_config_errors(bad):
    """A size that is no positive int is refused; a NumPy int size becomes an int."""
    with pytest.raises(ConfigError, match="num_blocks"):
        BlockPool(bad, eviction=LRUPolicy())
    assert type(BlockPool(np.int64(3), eviction=LRUPolicy()).num_blocks) is int


@pytest.mark.parametrize("bad", [1, 0, "yes", None, 1.0])
def test_reset_force_must_be_a_bool(bad):
    """``reset(force=...)`` takes a bool only; anything else changes nothing."""
    pool = busy_pool()
    before = state(pool)
    with pytest.raises(PoolUsageError, match="force"):
        pool.reset(force=bad)
    assert state(pool) == before


@pytest.mark.parametrize("bad", [True, -1, 1.5, "2", None])
@pytest.mark.parametrize("method", ["allocate", "eviction_candidates", "eviction_window"])
def test_bad_counts_are_refused(method, bad):
    """Counts are ints >= 0; the error is a kvkit error quoting the value."""
    pool = busy_pool()
    before = state(pool)
    with pytest.raises(KVKitError, match=re.escape(repr(bad))):
        getattr(pool, method)(bad)
    assert state(pool) == before


# -- forced reset -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", [LRUPolicy, S3FIFOPolicy, LFUPolicy])
def test_a_forced_reset_drops_referenced_blocks_once_released(policy):
    """Every cached block leaves the index; referenced ones keep their references and empty when released."""
    pool = BlockPool(4, eviction=policy())
    blocks = pool.allocate(3)
    pool.commit(blocks, [10, 11, 12])
    pool.decref([blocks[2]])  # 0, 1 referenced and ready; 2 evictable; 3 empty
    pool.incref([0])
    with pytest.raises(RefcountError, match="force=True"):
        pool.reset()
    assert pool.reset(force=True) == 3
    assert pool.lookup([10]) == pool.lookup([11]) == pool.lookup([12]) == []
    assert [pool.block_hash(b) for b in range(4)] == [None] * 4
    assert [pool.refcount(b) for b in range(4)] == [2, 1, 0, 0]
    assert (pool.num_empty, pool.num_evictable, pool.num_cached, len(pool.policy)) == (2, 0, 0, 0)
    pool.check_invariants()
    assert pool.allocate(2) == [2, 3]  # the referenced blocks are not handed out
    pool.decref([0, 0, 1])
    assert pool.num_empty == 2 and pool.allocate(2) == [0, 1]
    pool.check_invariants()


def test_a_forced_reset_tells_the_policy_and_not_the_listeners():
    """The policy forgets every dropped block (pinned ones too); evict listeners hear nothing."""
    pool = BlockPool(3, eviction=LRUPolicy())
    heard = []
    pool.add_evict_listener(lambda blocks, hashes: heard.extend(blocks))
    blocks = pool.allocate(2)
    pool.commit(blocks, [10, 11])
    pool.reset(force=True)
    assert heard == [] and len(pool.policy) == 0 and not pool.policy.pinned
    pool.commit(blocks, [20, 21])  # not ready again: they may hold new content
    assert pool.lookup([20, 21]) == blocks
    pool.check_invariants()


def test_a_plain_reset_keeps_refusing_while_referenced():
    """Without force the reset is refused atomically, as before."""
    pool = busy_pool()
    before = state(pool)
    with pytest.raises(RefcountError, match="still referenced"):
        pool.reset()
    assert state(pool) == before


# -- pins and windows -----------------------------------------------------------------------


def test_lru_hears_every_pin_and_never_meets_a_block_in_use():
    """Committed blocks enter pinned; each release and each later pin is heard, so a selection meets none."""
    calls = []

    class Counting(LRUPolicy):
        def on_pin(self, block):
            calls.append(("pin", block))
            super().on_pin(block)

        def on_unpin(self, block):
            calls.append(("unpin", block))
            super().on_unpin(block)

    policy = Counting()
    assert isinstance(policy, WindowedPolicy)
    pool = BlockPool(8, eviction=policy)
    blocks = pool.allocate(4)
    pool.commit(blocks, [10, 11, 12, 13])
    pool.decref(blocks)
    assert calls == [*(("pin", b) for b in blocks), *(("unpin", b) for b in blocks)]
    calls.clear()
    pool.incref([0])  # block 0 is the oldest: set aside at once, the next candidate is block 1
    assert calls == [("pin", 0)] and policy.pinned == {0} and pool.eviction_candidates(1) == [1]
    pool.decref([0])  # released, it is the next victim again (its place kept)
    assert calls == [("pin", 0), ("unpin", 0)] and pool.eviction_candidates(1) == [0]
    pool.check_invariants()


def test_a_pool_follows_its_eviction_window_with_a_windowed_policy():
    """eviction_window reports the blocks that joined the next n candidates; nothing twice."""
    pool = BlockPool(8, eviction=LRUPolicy())
    assert isinstance(pool, EvictionWindow)
    blocks = pool.allocate(6)
    pool.commit(blocks, list(range(10, 16)))
    pool.decref(blocks)
    assert pool.eviction_window(3) == [0, 1, 2]
    assert pool.eviction_window(3) == []
    pool.incref([1])  # leaves the window: block 3 joins
    assert pool.eviction_window(3) == [3]
    assert [pool.in_eviction_window(b) for b in range(6)] == [True, False, True, True, False, False]
    pool.decref([1])  # comes back at its place; block 3 leaves again
    assert pool.eviction_window(3) == [1]
    assert pool.eviction_window(4) == [0, 1, 2, 3]  # a new n: the whole window
    pool.check_invariants()


@pytest.mark.parametrize("policy", [LFUPolicy, S3FIFOPolicy])
def test_the_window_of_any_other_policy_is_taken_again_only_after_a_change(policy):
    """Without a windowed policy the pool re-derives the window when it changed, else answers []."""
    pool = BlockPool(8, eviction=policy())
    blocks = pool.allocate(6)
    pool.commit(blocks, list(range(10, 16)))
    pool.decref(blocks)
    first = pool.eviction_window(3)
    assert len(first) == 3 and pool.eviction_window(3) == []
    pool.incref([first[0]])
    joined = pool.eviction_window(3)
    assert first[0] not in joined and len(joined) >= 1
    assert not pool.in_eviction_window(first[0])
    pool.check_invariants()
