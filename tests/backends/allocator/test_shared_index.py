"""A pool hands its prefix index to an IndexedPolicy: one map between them, and the same decisions as two."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvkit.backends.allocator import BlockPool
from kvkit.backends.eviction._common import any_block
from kvkit.backends.eviction.hit_density import HitDensityPolicy
from kvkit.errors import PoolUsageError
from kvkit.interfaces import IndexedPolicy


class OwnIndex(HitDensityPolicy):
    """Hit density without the capability (opted out): it keeps a map of its own."""

    use_index = None


def test_a_pool_hands_its_index_to_an_indexed_policy_once():
    assert isinstance(HitDensityPolicy(), IndexedPolicy) and not isinstance(OwnIndex(), IndexedPolicy)
    policy = HitDensityPolicy()
    pool = BlockPool(4, eviction=policy)
    with pytest.raises(PoolUsageError, match="already reads one"):
        policy.use_index({}, [None] * 4, 4)
    blocks = pool.allocate(2)
    pool.commit(blocks, [10, 11], [None, 10])
    assert pool.lookup([10, 11]) == blocks
    pool.decref(blocks)
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]  # both evicted: the policy read their hashes as they left
    assert pool.lookup([10]) == [] and policy.num_ghosts == 2
    pool.check_invariants()


def test_an_index_is_refused_once_blocks_are_tracked():
    policy = HitDensityPolicy()
    policy.on_insert(0, 10, None)
    with pytest.raises(PoolUsageError, match="tracks 1 block"):
        policy.use_index({10: 0}, [10, None, None, None], 4)
    with pytest.raises(PoolUsageError, match="num_blocks"):
        HitDensityPolicy().use_index({}, [], 0)
    assert len(policy) == 1
    policy.check_invariants()


_OPS = st.lists(st.tuples(st.sampled_from(("store", "store", "store", "hit", "release", "release", "reset")),
                          st.integers(0, 63),
                          st.integers(1, 6)), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None)
@given(ops=_OPS)
@example(ops=[("store", 0, 6), ("store", 6, 6), ("store", 12, 6), ("store", 18, 6), ("release", 0, 1),
              ("store", 30, 6), ("store", 40, 6), ("hit", 0, 6), ("release", 0, 1), ("store", 50, 6)])
def test_a_shared_index_decides_exactly_as_a_policy_keeping_its_own(ops):
    """Chains stored out of order (orphans), hits, releases and forced resets: same victims, same state."""
    pools = [BlockPool(24, eviction=policy) for policy in (HitDensityPolicy(capacity=24), OwnIndex(capacity=24))]
    held: list[list[int]] = [[], []]
    for op, start, length in ops:
        for i, pool in enumerate(pools):
            if op == "store":  # a chain's blocks start..start+length, its head's parent cached or not
                if pool.num_free < length:
                    continue
                hashes = list(range(start, start + length))
                blocks = pool.allocate(length)
                pool.commit(blocks, hashes, [h - 1 if h else None for h in hashes])
                held[i] += blocks
            elif op == "hit":
                hit = pool.lookup(list(range(start, start + length)))
                pool.incref(hit)
                pool.touch(hit)
                held[i] += hit
            elif op == "release":
                pool.decref(held[i])
                held[i] = []
            else:
                pool.reset(force=True)
        shared, own = pools
        assert [shared.block_hash(b) for b in range(24)] == [own.block_hash(b) for b in range(24)]
        assert shared.eviction_candidates(24) == own.eviction_candidates(24)
    for pool in pools:
        pool.check_invariants()


@settings(max_examples=40, deadline=None)
@given(chains=st.lists(st.permutations(range(4)), min_size=1, max_size=6), data=st.data())
def test_entries_of_blocks_a_call_inserts_or_removes_are_ignored(chains, data):
    """A driver that indexes a call's blocks before telling of any and clears them after the last.

    Each call stores one chain of four in a drawn order (tails first makes
    orphans of blocks whose parent is already indexed), or removes a drawn
    set of tracked blocks (parents and children together, in any order).
    """
    index: dict[int, int] = {}
    hashes: list[int | None] = [None] * (4 * len(chains))
    shared, own = HitDensityPolicy(), OwnIndex()
    shared.use_index(index, hashes, len(hashes))
    tracked: list[int] = []
    for k, order in enumerate(chains):
        blocks = [4 * k + i for i in order]
        index.update({1000 + b: b for b in blocks})  # the whole call's entries and hashes first
        for b in blocks:
            hashes[b] = 1000 + b
        for b in blocks:
            parent = None if b % 4 == 0 else 1000 + b - 1
            for policy in (shared, own):
                policy.on_insert(b, 1000 + b, parent)
        tracked += blocks
        leaving = data.draw(st.lists(st.sampled_from(tracked), unique=True, max_size=6))
        for b in leaving:
            for policy in (shared, own):
                policy.on_remove(b)
        for b in leaving:  # the entries and hashes go after the last removal
            del index[1000 + b]
            hashes[b] = None
            tracked.remove(b)
        assert shared.select_victims(len(tracked), any_block) == own.select_victims(len(tracked), any_block)
        shared.check_invariants()
        own.check_invariants()
