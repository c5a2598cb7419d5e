"""Unit tests of BlockPool: states, eviction through the policy, errors and atomicity."""

import re

import numpy as np
import pytest

from kvkit.backends.allocator import BlockPool
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.errors import (
    ConfigError,
    OutOfBlocksError,
    PoolUsageError,
    RefcountError,
    UnknownBlockError,
)
from kvkit.interfaces import BlockAllocator, EvictionOrder, PinAwarePolicy


def state(pool):
    """Everything observable about ``pool``, for atomicity checks."""
    n = pool.num_blocks
    return (
        pool.num_free, pool.num_empty, pool.num_evictable, pool.num_cached,
        [pool.refcount(b) for b in range(n)], [pool.block_hash(b) for b in range(n)],
        list(pool.policy),
    )


def lru_pool(num_blocks):
    """A fresh pool run by a fresh LRU policy."""
    return BlockPool(num_blocks, eviction=LRUPolicy())


def cached_pool(num_blocks, hashes):
    """A pool whose first ``len(hashes)`` blocks are ready, unreferenced, in LRU order 0, 1, ..."""
    return cached_pool_with(LRUPolicy(), hashes, num_blocks)


def cached_pool_with(policy, hashes, num_blocks=4):
    """A pool run by ``policy`` whose first ``len(hashes)`` blocks are ready and unreferenced."""
    pool = BlockPool(num_blocks, eviction=policy)
    blocks = pool.allocate(len(hashes))
    assert pool.commit(blocks, hashes) == [True] * len(hashes)
    pool.decref(blocks)
    return pool


class RecordingLRU(LRUPolicy):
    """LRU without its pin and batch hooks (opted out) that also records every notification it receives."""

    calls: list
    on_pin = on_unpin = None
    insert_pinned = pin_many = unpin_many = access_many = remove_many = None

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_insert(self, block, block_hash, parent):
        self.calls.append(("insert", block, block_hash, parent))
        super().on_insert(block, block_hash, parent)

    def on_access(self, block):
        self.calls.append(("access", block))
        super().on_access(block)

    def on_remove(self, block):
        self.calls.append(("remove", block))
        super().on_remove(block)


class RecordingPinLRU(RecordingLRU):
    """RecordingLRU with the optional pin hooks, recorded too; it hears every pin."""

    attach = None

    def on_pin(self, block):
        self.calls.append(("pin", block))

    def on_unpin(self, block):
        self.calls.append(("unpin", block))


# -- construction -------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8", None])
def test_bad_capacity_is_a_config_error_quoting_it(bad):
    """A capacity that is not a positive int raises ConfigError quoting it."""
    with pytest.raises(ConfigError, match=re.escape(f"num_blocks={bad!r}: must be an int >= 1")):
        BlockPool(bad, eviction=LRUPolicy())


def test_eviction_must_be_an_empty_policy():
    """A missing policy, a non-policy, or a policy already tracking blocks, is rejected at construction."""
    for missing in ({}, {"eviction": None}):
        with pytest.raises(ConfigError, match=r"needs an eviction policy, got eviction=None; hint: .*LRUPolicy"):
            BlockPool(4, **missing)
    with pytest.raises(ConfigError, match="eviction must be an EvictionPolicy, got 'lru'"):
        BlockPool(4, eviction="lru")
    used = LRUPolicy()
    used.on_insert(0, 1, None)
    with pytest.raises(ConfigError, match=r"already tracks 1 block$"):
        BlockPool(4, eviction=used)


@pytest.mark.parametrize(("hooks", "message"), [
    ({"on_pin": lambda self, block: None, "on_unpin": None}, "on_unpin=None"),
    ({"on_pin": None, "on_unpin": lambda self, block: None}, "on_pin=None"),
    ({"on_pin": 3}, "on_pin=3"),
])
def test_half_a_pair_of_pin_hooks_is_a_config_error(hooks, message):
    """A policy left with one pin hook, or a hook that is not callable, is rejected quoting it."""
    policy = type("HalfHooked", (LRUPolicy,), hooks)()
    with pytest.raises(ConfigError, match=f"HalfHooked needs both pin hooks.*{message}"):
        BlockPool(4, eviction=policy)


def test_defaults_and_protocol():
    """A new pool is all empty, consults the policy it was given and implements EvictionOrder."""
    policy = LRUPolicy()
    pool = BlockPool(5, eviction=policy)
    assert isinstance(pool, BlockAllocator) and isinstance(pool, EvictionOrder)
    assert pool.policy is policy
    assert (pool.num_blocks, pool.num_free, pool.num_empty, pool.num_evictable) == (5, 5, 5, 0)
    pool.check_invariants()
    with pytest.raises(AttributeError):
        pool.num_blocks = 6


# -- allocation and runs --------------------------------------------------------


def test_allocation_hands_out_ascending_runs():
    """Fresh ids come out ascending, and blocks released in order come back in order."""
    pool = lru_pool(10)
    first, second = pool.allocate(4), pool.allocate(3)
    assert (first, second) == ([0, 1, 2, 3], [4, 5, 6])
    pool.decref(first)
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.allocate(0) == []
    assert all(pool.refcount(b) == 1 and not pool.is_ready(b) for b in range(7))
    pool.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.0, "2", True, None])
def test_bad_allocation_count_quotes_it(bad):
    """A count that is not a non-negative int raises PoolUsageError (a ValueError) quoting it."""
    pool = lru_pool(4)
    with pytest.raises(PoolUsageError, match=re.escape(f"n={bad!r}: must be an int >= 0")) as info:
        pool.allocate(bad)
    assert isinstance(info.value, ValueError)
    assert pool.num_empty == 4


def test_out_of_blocks_is_atomic_and_quotes_counts():
    """Asking for more than empty + evictable fails, names the counts and changes nothing."""
    pool = cached_pool(6, [10, 11])
    pool.allocate(3)
    before = state(pool)
    message = r"cannot allocate 4 blocks: 3 free \(1 empty, 2 evictable\) of 6"
    with pytest.raises(OutOfBlocksError, match=message):
        pool.allocate(4)
    assert state(pool) == before


def test_allocation_takes_empty_blocks_before_evicting():
    """Empty blocks go first; only the shortfall is evicted, coldest first, then sorted."""
    pool = cached_pool(6, [10, 11, 12, 13])
    pool.touch([0])  # LRU order is now 1, 2, 3, 0
    evicted = []
    pool.add_evict_listener(lambda blocks, hashes: evicted.append((list(blocks), list(hashes))))
    assert pool.allocate(4) == [4, 5, 1, 2]
    assert evicted == [([1, 2], [11, 12])]  # one call for the allocation's evictions
    assert pool.lookup([10]) == [0] and pool.lookup([11]) == [] and pool.lookup([12]) == []
    assert pool.block_hash(1) is None and pool.refcount(1) == 1
    assert list(pool.policy) == [3, 0]
    pool.check_invariants()


def test_referenced_ready_blocks_are_never_evicted():
    """A ready block with references is skipped by eviction, however cold it is."""
    pool = cached_pool(3, [10, 11, 12])
    pool.incref([0])
    assert pool.num_free == 2
    assert sorted(pool.allocate(2)) == [1, 2]
    assert pool.lookup([10]) == [0]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)


def test_listeners_see_a_consistent_pool():
    """Evict listeners run after allocate finished: the victim is referenced and hashless."""
    pool = cached_pool(2, [10, 11])
    seen = []
    pool.add_evict_listener(
        lambda blocks, hashes: seen.extend((block, block_hash, pool.refcount(block), pool.block_hash(block),
                                            pool.lookup([block_hash])) for block, block_hash in zip(blocks, hashes))
    )
    pool.allocate(1)
    assert seen == [(0, 10, 1, None, [])]
    with pytest.raises(PoolUsageError, match="must be callable, got 3"):
        pool.add_evict_listener(3)


class WrongVictims(LRUPolicy):
    """A broken policy that always offers block 0, evictable or not."""

    def select_victims(self, n, is_evictable):
        return [0] * n


def test_a_policy_offering_a_referenced_block_is_caught_before_any_change():
    """The pool refuses a victim that is not evictable and changes nothing."""
    pool = BlockPool(2, eviction=WrongVictims())
    blocks = pool.allocate(2)
    pool.commit(blocks, [10, 11])
    pool.decref([1])
    before = state(pool)
    with pytest.raises(AssertionError, match="non-evictable"):
        pool.allocate(1)
    assert state(pool) == before


# -- references ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 4, 99, "x", 1.5, None])
@pytest.mark.parametrize("method", ["incref", "decref", "touch", "commit"])
def test_unknown_ids_quote_the_id_and_change_nothing(method, bad):
    """An out-of-range or non-int id raises UnknownBlockError quoting it; nothing changes."""
    pool = lru_pool(4)
    pool.allocate(2)
    before = state(pool)
    args = ([1, bad], [10, 11]) if method == "commit" else ([1, bad],)
    with pytest.raises(UnknownBlockError, match=f"block id {bad!r} is out of range"):
        getattr(pool, method)(*args)
    assert state(pool) == before
    for getter in (pool.refcount, pool.block_hash, pool.is_ready):
        with pytest.raises(UnknownBlockError, match=f"block id {bad!r}"):
            getter(bad)


def test_incref_of_an_empty_block_is_refused_atomically():
    """Referencing an empty block raises RefcountError quoting it, even after valid ids."""
    pool = cached_pool(4, [10])
    pool.allocate(1)
    before = state(pool)
    with pytest.raises(RefcountError, match="cannot incref empty block 3"):
        pool.incref([0, 1, 3])
    assert state(pool) == before


def test_incref_takes_an_evictable_block_out_of_the_free_count():
    """An evictable block stops being evictable when referenced, and returns when released."""
    pool = cached_pool(3, [10])
    pool.incref([0, 0])
    assert (pool.refcount(0), pool.num_evictable, pool.num_free) == (2, 0, 2)
    pool.decref([0, 0])
    assert (pool.refcount(0), pool.num_evictable, pool.num_free) == (0, 1, 3)
    pool.check_invariants()


def test_decref_below_zero_rolls_back():
    """A decref that drops one block below zero (even via repeats) undoes the rest."""
    pool = lru_pool(4)
    pool.allocate(2)
    pool.incref([1])
    before = state(pool)
    with pytest.raises(RefcountError, match="cannot decref block 0: refcount would go below 0"):
        pool.decref([1, 0, 0])
    assert state(pool) == before
    with pytest.raises(RefcountError, match="block 2"):
        pool.decref([2])
    assert state(pool) == before


def test_decref_to_zero_empties_not_ready_and_caches_ready_blocks():
    """At refcount 0 a not-ready block is empty again and a ready block becomes evictable."""
    pool = lru_pool(4)
    blocks = pool.allocate(2)
    pool.commit([blocks[0]], [10])
    pool.decref(blocks)
    assert (pool.num_empty, pool.num_evictable, pool.num_cached) == (3, 1, 1)
    assert pool.is_ready(0) and not pool.is_ready(1)
    pool.check_invariants()


def test_numpy_ids_are_accepted_and_stored_as_ints():
    """Ids from a numpy array work everywhere and never leak into the index as numpy ints."""
    pool = lru_pool(4)
    blocks = np.asarray(pool.allocate(2))
    pool.incref(blocks)
    pool.commit(blocks, [10, 11])
    assert all(type(b) is int for b in pool.lookup([10, 11]))
    pool.touch(blocks)
    pool.decref(blocks)
    pool.decref(blocks)
    assert pool.num_evictable == 2
    pool.check_invariants()


# -- commit, lookup, touch ---------------------------------------------------------


def test_commit_keeps_the_first_block_of_a_duplicate_hash():
    """A hash already indexed keeps its block; the duplicate stays not ready and later empties."""
    pool = lru_pool(4)
    a, b, c = pool.allocate(3)
    assert pool.commit([a], [10]) == [True]
    assert pool.commit([b, c], [10, 11]) == [False, True]
    assert pool.lookup([10, 11]) == [a, c]
    assert not pool.is_ready(b) and pool.block_hash(b) is None
    pool.decref([b])
    assert pool.num_empty == 2
    pool.check_invariants()


def test_commit_within_one_call_repeating_a_hash():
    """Two blocks committed under one hash in the same call: the first wins."""
    pool = lru_pool(2)
    assert pool.commit(pool.allocate(2), [7, 7]) == [True, False]


def test_commit_notifies_the_policy_with_parents():
    """Each newly ready block reaches the policy with its hash and chain parent."""
    policy = RecordingLRU()
    pool = BlockPool(4, eviction=policy)
    blocks = pool.allocate(3)
    pool.commit(blocks, [10, 11, 10], [None, 10, 11])
    assert policy.calls == [("insert", 0, 10, None), ("insert", 1, 11, 10)]


@pytest.mark.parametrize(("blocks", "hashes", "parents", "error", "message"), [
    ([0, 1], [10], None, PoolUsageError, "equal lengths, got 2 blocks, 1 hash"),
    ([0], [10], [None, 3], PoolUsageError, "got 1 block, 1 hash, 2 parents"),
    ([0, 0], [10, 11], None, PoolUsageError, r"names a block twice: \[0, 0\]"),
    ([0, 4], [10, 11], None, RefcountError, "cannot commit unreferenced block 4"),
    ([0, 1], [10, "11"], None, PoolUsageError, "block hashes must be ints, got '11'"),
    ([0], [None], None, PoolUsageError, "block hashes must be ints, got None"),
    ([0], [10], [1.5], PoolUsageError, "parent hashes must be ints or None, got 1.5"),
    ([1, 3], [10, 11], None, PoolUsageError, "block 3 is already ready"),
])
def test_bad_commits_quote_the_value_and_change_nothing(blocks, hashes, parents, error, message):
    """Every malformed commit raises the typed error quoting the culprit; nothing changes."""
    pool = lru_pool(5)
    pool.allocate(2)
    ready = pool.allocate(2)
    pool.commit([ready[1]], [99])
    before = state(pool)
    with pytest.raises(error, match=message):
        pool.commit(blocks, hashes, parents)
    assert state(pool) == before


def test_pin_hooks_hear_every_refcount_transition_of_a_ready_block():
    """on_pin at 0 -> 1 and after commit, on_unpin at 1 -> 0, and at no other refcount change."""
    policy = RecordingPinLRU()
    pool = BlockPool(4, eviction=policy)
    a, b, c = pool.allocate(3)
    assert policy.calls == []  # allocated blocks are not ready: not tracked, not pinned
    pool.commit([a, b], [10, 11])
    assert policy.calls == [("insert", a, 10, None), ("pin", a),
                            ("insert", b, 11, None), ("pin", b)]
    policy.calls.clear()
    pool.incref([a, a])  # 1 -> 3: already pinned
    pool.decref([a, b, c])  # a 3 -> 2; b 1 -> 0; c is not ready: it empties
    assert policy.calls == [("unpin", b)]
    policy.calls.clear()
    pool.incref([b, b])  # 0 -> 2 in one call: one pin
    pool.decref([b, a, a, b])  # a 2 -> 0, b 2 -> 0: each unpinned once, in the order they hit 0
    assert policy.calls == [("pin", b), ("unpin", a), ("unpin", b)]
    policy.calls.clear()
    pool.allocate(4)  # evicts a and b, both unpinned: removal only
    assert sorted(policy.calls) == [("remove", a), ("remove", b)]
    pool.check_invariants()


def test_a_failed_call_tells_the_pin_hooks_nothing():
    """A rejected incref or decref changes no refcount, so no hook is called."""
    policy = RecordingPinLRU()
    pool = cached_pool_with(policy, [10, 11])
    pool.allocate(1)
    policy.calls.clear()
    with pytest.raises(RefcountError):
        pool.incref([0, 3])  # 3 is empty
    with pytest.raises(RefcountError):
        pool.decref([2, 0])  # 0 is unreferenced
    assert policy.calls == []


def test_a_subclass_can_opt_out_of_its_parents_pin_hooks():
    """Hooks set to None are absent: the pool never calls them, the policy skips pinned blocks."""
    policy = type("Hookless", (RecordingPinLRU,), {"on_pin": None, "on_unpin": None})()
    pool = cached_pool_with(policy, [10, 11])
    pool.incref([0])
    assert pool.allocate(3) == [2, 3, 1]
    assert not any(call[0] in ("pin", "unpin") for call in policy.calls)


def test_pin_hooks_are_decided_once_when_the_pool_adopts_the_policy():
    """Only a PinAwarePolicy at construction hears pins; hooks added to the object later are never called."""
    assert isinstance(RecordingPinLRU(), PinAwarePolicy) and not isinstance(RecordingLRU(), PinAwarePolicy)
    policy = RecordingLRU()
    pool = cached_pool_with(policy, [10, 11])
    policy.on_pin = policy.on_unpin = lambda block: policy.calls.append(("late hook", block))
    assert isinstance(policy, PinAwarePolicy)  # it is one now, but the pool already decided
    policy.calls.clear()
    pool.incref([0])
    pool.decref([0])
    assert policy.calls == []


def test_lookup_returns_the_longest_ready_prefix_and_is_pure():
    """Lookup stops at the first missing hash and changes neither refcounts nor LRU order."""
    pool = cached_pool(5, [10, 11, 12])
    pool.allocate(1)
    before = state(pool)
    assert pool.lookup([10, 11, 12, 13]) == [0, 1, 2]
    assert pool.lookup([10, 99, 12]) == [0]
    assert pool.lookup([11]) == [1]
    assert pool.lookup([]) == []
    assert state(pool) == before


def test_touch_refreshes_ready_blocks_in_order_and_skips_others():
    """Touch moves ready blocks to the hot end in the order given; not-ready ones are skipped."""
    policy = RecordingLRU()
    pool = BlockPool(5, eviction=policy)
    blocks = pool.allocate(4)
    pool.commit(blocks[:3], [10, 11, 12])
    policy.calls.clear()
    pool.touch([1, 3, 0])
    assert policy.calls == [("access", 1), ("access", 0)]
    assert list(pool.policy) == [2, 1, 0]


def test_eviction_candidates_preview_without_evicting():
    """Candidates are the next victims in order, at most the evictable ones; nothing changes."""
    pool = cached_pool(6, [10, 11, 12, 13])
    pool.incref([1])
    before = state(pool)
    assert pool.eviction_candidates(2) == [0, 2]
    assert pool.eviction_candidates(10) == [0, 2, 3]
    assert pool.eviction_candidates(0) == []
    assert state(pool) == before
    with pytest.raises(PoolUsageError, match="n=-1: must be an int >= 0"):
        pool.eviction_candidates(-1)


# -- reset and invariants ---------------------------------------------------------------


def test_reset_is_refused_while_referenced():
    """Reset with references raises RefcountError naming them and changes nothing."""
    pool = cached_pool(4, [10])
    pool.allocate(2)
    before = state(pool)
    with pytest.raises(RefcountError, match=r"2 blocks still referenced, e.g. \[1, 2\]"):
        pool.reset()
    assert state(pool) == before


def test_reset_forgets_everything_and_tells_only_the_policy():
    """Reset drops cached blocks, empties the policy, skips listeners and restarts ids at 0."""
    policy = RecordingLRU()
    pool = BlockPool(4, eviction=policy)
    blocks = pool.allocate(3)
    pool.commit(blocks[:2], [10, 11])
    pool.decref(list(reversed(blocks)))
    evicted = []
    pool.add_evict_listener(lambda blocks, hashes: evicted.extend(blocks))
    policy.calls.clear()
    assert pool.reset() == 2
    assert sorted(policy.calls) == [("remove", 0), ("remove", 1)] and evicted == []
    assert (pool.num_empty, pool.num_cached, len(policy)) == (4, 0, 0)
    assert pool.lookup([10]) == []
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.check_invariants()


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda pool: pool._empty.append(1), "twice"),
    (lambda pool: pool._ref.__setitem__(3, 1), "empty stack"),
    (lambda pool: setattr(pool, "_num_evictable", 5), r"\(1, 5\)"),
    (lambda pool: pool._index.__setitem__(77, 0), "indexed"),
    (lambda pool: pool._hash.__setitem__(0, 12), "carries 12"),
    (lambda pool: pool.policy.on_remove(0), "policy tracks 0 blocks, 1 ready"),
])
def test_check_invariants_detects_corruption(corrupt, message):
    """Each kind of internal corruption makes check_invariants raise AssertionError."""
    pool = cached_pool(4, [10])
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_invariants()


@pytest.mark.parametrize("method", ["incref", "decref", "touch", "commit", "lookup"])
def test_a_non_sequence_argument_is_a_typed_error(method):
    """Passing a bare int where a sequence belongs raises PoolUsageError quoting it."""
    pool = lru_pool(4)
    pool.allocate(2)
    before = state(pool)
    args = (3, [10]) if method == "commit" else (3,)
    with pytest.raises(PoolUsageError, match="got 3"):
        getattr(pool, method)(*args)
    assert state(pool) == before


def test_generators_and_ranges_are_accepted():
    """Any iterable of ids works, even though the pool walks it twice (validate, then act)."""
    pool = lru_pool(4)
    pool.allocate(3)
    pool.incref(b for b in range(3))
    pool.commit(range(3), (h for h in (10, 11, 12)))
    pool.decref(range(3))
    assert pool.lookup(iter([10, 11, 12])) == [0, 1, 2]
    assert [pool.refcount(b) for b in range(3)] == [1, 1, 1]
    pool.check_invariants()
