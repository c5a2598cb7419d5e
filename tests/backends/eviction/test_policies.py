"""Characteristic behaviour of each built-in eviction policy (FIFO, LFU, ARC, S3-FIFO, OPT; LIRS in test_lirs)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.backends.eviction._common import LearnsCapacity
from kvkit.backends.eviction.arc import ARCPolicy
from kvkit.backends.eviction.fifo import FIFOPolicy
from kvkit.backends.eviction.hit_density import HitDensityPolicy
from kvkit.backends.eviction.lfu import LFUPolicy
from kvkit.backends.eviction.lirs import LIRSPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.eviction.opt import OptimalPolicy
from kvkit.backends.eviction.s3fifo import S3FIFOPolicy
from kvkit.errors import ConfigError, PoolUsageError
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.registry import EVICTION


def _all(block: int) -> bool:
    return True


def _h(k: int) -> int:
    """A hash far from every block id, so tests notice a hash/id mix-up."""
    return 1_000_000 + k


def _fill(policy: EvictionPolicy, blocks: Sequence[int]) -> None:
    for b in blocks:
        policy.on_insert(b, _h(b), None)


def _evict(policy: EvictionPolicy, n: int, is_evictable: Callable[[int], bool] = _all) -> list[int]:
    """Select ``n`` victims and remove them, as a pool does."""
    victims = policy.select_victims(n, is_evictable)
    assert victims is not None
    for v in victims:
        policy.on_remove(v)
    policy.check_invariants()
    return victims


def simulate(policy: EvictionPolicy, refs: Sequence[int], capacity: int,
             observe: bool = False) -> int:
    """Hits of a demand-paging cache of ``capacity`` blocks run by ``policy`` over ``refs``."""
    cached: dict[int, int] = {}  # hash -> block
    hash_of: dict[int, int] = {}
    free = list(range(capacity))
    hits = 0
    for h in refs:
        if observe:
            policy.observe(h)
        if h in cached:
            hits += 1
            policy.on_access(cached[h])
            continue
        if not free:
            [victim] = policy.select_victims(1, _all)
            policy.on_remove(victim)
            del cached[hash_of.pop(victim)]
            free.append(victim)
        block = free.pop()  # ids are reused for other content
        cached[h], hash_of[block] = block, h
        policy.on_insert(block, h, None)
    policy.check_invariants()
    return hits


def _optimum(refs: Sequence[int], capacity: int) -> int:
    """Most hits any demand-paging cache can get, by exhaustive search over victims."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(refs):
            return 0
        h = refs[i]
        if h in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < capacity:
            return best(i + 1, cache | {h})
        return max(best(i + 1, (cache - {v}) | {h}) for v in cache)

    return best(0, frozenset())


_MINE = [FIFOPolicy, LFUPolicy, ARCPolicy, S3FIFOPolicy, LIRSPolicy, lambda: OptimalPolicy([])]


# --- misuse ------------------------------------------------------------------


@pytest.mark.parametrize("make", _MINE)
def test_misuse_raises_pool_usage_error(make):
    """Inserting a tracked block, touching an untracked one or asking for -1 victims raises."""
    policy = make()
    policy.on_insert(3, _h(3), None)
    with pytest.raises(PoolUsageError, match="3"):
        policy.on_insert(3, _h(4), None)
    with pytest.raises(PoolUsageError, match="7"):
        policy.on_access(7)
    with pytest.raises(PoolUsageError, match="7"):
        policy.on_remove(7)
    with pytest.raises(PoolUsageError, match="-1"):
        policy.select_victims(-1, _all)
    assert len(policy) == 1
    policy.check_invariants()


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_capacity_is_a_config_error(bad):
    """ARC, S3-FIFO and LIRS reject a capacity that is not a positive int, quoting it."""
    for make in (ARCPolicy, S3FIFOPolicy, LIRSPolicy):
        with pytest.raises(ConfigError, match=repr(bad).replace(".", r"\.")):
            make(capacity=bad)


@pytest.mark.parametrize("bad", [0, 1, -0.1, 1.5])
def test_bad_small_ratio_is_a_config_error(bad):
    """S3-FIFO's small queue share must lie strictly between 0 and 1."""
    with pytest.raises(ConfigError, match="small_ratio"):
        S3FIFOPolicy(small_ratio=bad)


# --- FIFO --------------------------------------------------------------------


def test_fifo_ignores_hits_and_skips_pinned():
    """FIFO evicts the earliest inserted evictable blocks, whatever was hit since."""
    policy = FIFOPolicy()
    _fill(policy, [5, 1, 9, 2])
    policy.on_access(5)
    assert _evict(policy, 2, lambda b: b != 1) == [5, 9]
    assert _evict(policy, 2) == [1, 2]
    assert policy.select_victims(1, _all) is None


# --- LFU ---------------------------------------------------------------------


def test_lfu_keeps_frequent_blocks():
    """The block hit most survives; among equal counts the least recent goes first."""
    policy = LFUPolicy()
    _fill(policy, [0, 1, 2, 3])
    for b in (0, 0, 0, 2, 1):
        policy.on_access(b)
    # counts: 0 -> 4, 1 -> 2, 2 -> 2 (hit before 1), 3 -> 1
    assert _evict(policy, 3) == [3, 2, 1]
    assert _evict(policy, 1) == [0]


_LFU_OPS = st.lists(st.tuples(st.sampled_from(["insert", "access", "access", "select"]),
                              st.integers(0, 3)), max_size=40)


@given(_LFU_OPS)
def test_lfu_matches_a_brute_force_model(ops):
    """LFU's victims are the evictable blocks with the fewest uses, then the oldest last use."""
    policy, uses, last = LFUPolicy(), {}, {}
    for tick, (op, x) in enumerate(ops, 1):
        if op == "insert" and x not in uses:
            policy.on_insert(x, _h(x), None)
            uses[x], last[x] = 1, tick
        elif op == "access" and x in uses:
            policy.on_access(x)
            uses[x], last[x] = uses[x] + 1, tick
        elif op == "select" and uses:
            n = min(1 + x, len(uses))
            expected = sorted(uses, key=lambda b: (uses[b], last[b]))[:n]
            assert _evict(policy, n) == expected
            for b in expected:
                del uses[b], last[b]
        policy.check_invariants()


# --- ARC ---------------------------------------------------------------------


def test_arc_grows_p_on_a_recency_ghost_hit():
    """Re-inserting a hash evicted from T1 raises p and puts the block straight into T2."""
    policy = ARCPolicy(capacity=4)
    _fill(policy, [0, 1, 2, 3])
    assert _evict(policy, 1) == [0]  # p = 0, so T1's least recent goes
    assert policy.p == 0
    policy.on_insert(7, _h(0), None)  # a new block id, the evicted content again
    assert policy.p == 1
    # T1 = [1, 2, 3] is cut down to p = 1 block before T2 = [7] gives one up
    assert _evict(policy, 3) == [1, 2, 7]


def test_arc_shrinks_p_on_a_frequency_ghost_hit():
    """Re-inserting a hash evicted from T2 lowers p."""
    policy = ARCPolicy(capacity=4)
    _fill(policy, [0, 1, 2, 3])
    _evict(policy, 1)
    policy.on_insert(4, _h(0), None)  # B1 ghost hit: p = 1, block 4 in T2
    policy.on_access(1)  # T2 = [4, 1]; T1 = [2, 3]
    assert _evict(policy, 2, lambda b: b != 2) == [3, 4]  # |T1| = 2 > p, then |T1| = 1 = p
    policy.on_insert(5, _h(0), None)  # hash 0 was in B2
    assert policy.p == 0


def test_arc_ghosts_are_keyed_by_hash_not_block_id():
    """A reused block id with new content is no ghost hit."""
    policy = ARCPolicy(capacity=4)
    _fill(policy, [0, 1, 2, 3])
    _evict(policy, 1)
    policy.on_insert(0, _h(99), None)
    assert policy.p == 0


def test_arc_survives_a_scan():
    """Blocks hit twice survive a long scan of one-time blocks, which pure LRU would lose."""
    arc, lru = ARCPolicy(capacity=4), LRUPolicy()
    refs = [0, 1, 0, 1, *range(10, 40), 0, 1]
    assert simulate(arc, [_h(r) for r in refs], capacity=4) == 4
    assert simulate(lru, [_h(r) for r in refs], capacity=4) == 2


def test_arc_learns_capacity_from_the_high_water_mark():
    """Without a capacity ARC takes the most blocks it ever tracked at once."""
    policy = ARCPolicy()
    _fill(policy, range(6))
    _evict(policy, 4)
    policy.on_insert(9, _h(9), None)
    assert policy.c == 6


@pytest.mark.parametrize("make", [ARCPolicy, S3FIFOPolicy, HitDensityPolicy])
def test_adaptive_policies_size_themselves_through_one_helper(make):
    """ARC, S3-FIFO and hit density learn the high-water mark, or keep the capacity given."""
    learned, fixed = make(), make(capacity=3)
    assert isinstance(learned, LearnsCapacity) and (learned.c, fixed.c) == (0, 3)
    for policy in (learned, fixed):
        _fill(policy, range(5))
        _evict(policy, 4)
        policy.on_insert(9, _h(9), None)
        policy.check_invariants()
    assert (learned.c, fixed.c) == (5, 3)
    with pytest.raises(ConfigError, match=rf"{make.__name__}\.capacity=0: must be an int >= 1"):
        make(capacity=0)


@pytest.mark.parametrize("name", sorted(EVICTION.names()))
def test_registered_policies_write_attributes_without_hooks(name):
    """No policy routes its per-reference attribute writes through attrs' validating ``__setattr__``
    (define_policy); validation at construction is tested per policy above."""
    policy = EVICTION.create(name, slot="policy", **({"references": ()} if name == "opt" else {}))
    assert type(policy).__setattr__ is object.__setattr__, f"{type(policy).__name__} has a setattr hook"


# --- S3-FIFO -----------------------------------------------------------------


def test_s3fifo_evicts_one_hit_wonders_and_promotes_reused_blocks():
    """From the small queue, unhit blocks are evicted in order and hit ones move to main."""
    policy = S3FIFOPolicy(capacity=10)  # small target: 1 block
    _fill(policy, range(10))
    policy.on_access(1)
    policy.on_access(2)
    assert _evict(policy, 3) == [0, 3, 4]
    assert policy.main == (1, 2)
    assert policy.ghost == (_h(0), _h(3), _h(4))


def test_s3fifo_ghost_hit_enters_main_and_main_reinserts_hit_blocks():
    """A ghost hash skips probation; main evicts unhit blocks and reinserts hit ones."""
    policy = S3FIFOPolicy(capacity=4)
    _fill(policy, [0, 1, 2, 3])
    assert _evict(policy, 1) == [0]
    policy.on_insert(8, _h(0), None)
    assert policy.main == (8,) and _h(0) not in policy.ghost
    policy.on_insert(0, _h(50), None)  # block id 0 reused for new content: probation
    assert policy.small == (1, 2, 3, 0)
    policy.on_access(8)
    # small (4 blocks) is over its target of 1: 1, 2, 3 go first, then 0
    assert _evict(policy, 4) == [1, 2, 3, 0]
    policy.on_insert(1, _h(60), None)
    # small has 1 block, its target: it still gives first
    assert _evict(policy, 1) == [1]
    # small empty: main's block 8 was hit, so it is reinserted once and then evicted
    assert _evict(policy, 1) == [8]


def test_s3fifo_skips_pinned_blocks():
    """Pinned blocks stay put while the policy finds victims behind them."""
    policy = S3FIFOPolicy(capacity=10)
    _fill(policy, range(5))
    assert _evict(policy, 2, lambda b: b >= 3) == [3, 4]
    assert policy.select_victims(4, lambda b: b == 0) is None
    assert len(policy) == 3


def test_s3fifo_sets_pinned_blocks_aside():
    """Pinned blocks are never shown to is_evictable and return at their queue's new end."""
    policy = S3FIFOPolicy(capacity=10)
    _fill(policy, range(5))
    policy.on_access(1)
    policy.on_pin(1)
    policy.on_pin(2)
    asked = []
    assert _evict(policy, 1, lambda b: asked.append(b) or True) == [0]
    assert 1 not in asked and 2 not in asked
    assert policy.pinned == (1, 2) and policy.small == (3, 4)
    policy.on_unpin(1)
    assert policy.small == (3, 4, 1)
    assert _evict(policy, 2) == [3, 4]
    # 1 kept its hit while pinned: promoted to main on the way, evicted from there
    assert _evict(policy, 1) == [1] and _h(1) not in policy.ghost
    assert policy.select_victims(1, _all) is None  # only 2 is left, pinned
    policy.on_remove(2)  # a pinned block may be removed: it leaves its hash in the ghost
    assert policy.pinned == () and _h(2) in policy.ghost


def test_s3fifo_pin_misuse_raises_pool_usage_error():
    """Pinning an untracked or pinned block, or unpinning an unpinned one, quotes the block."""
    policy = S3FIFOPolicy()
    policy.on_insert(3, _h(3), None)
    with pytest.raises(PoolUsageError, match="block 7 is not tracked"):
        policy.on_pin(7)
    with pytest.raises(PoolUsageError, match=r"on_unpin\(3\): block 3 is not pinned"):
        policy.on_unpin(3)
    policy.on_pin(3)
    with pytest.raises(PoolUsageError, match=r"on_pin\(3\): block 3 is already pinned"):
        policy.on_pin(3)
    with pytest.raises(PoolUsageError, match="block 7 is not tracked"):
        policy.on_unpin(7)
    assert policy.pinned == (3,) and len(policy) == 1
    policy.check_invariants()


_S3_OPS = st.lists(st.tuples(st.sampled_from(["insert", "insert", "access", "pin", "pin", "unpin",
                                              "remove", "select", "select"]),
                             st.integers(0, 63)), max_size=60)


@given(_S3_OPS)
def test_s3fifo_parking_keeps_queue_and_frequency(ops):
    """A pinned block is never scanned, and returns to the end of its own queue with its hits."""
    policy = S3FIFOPolicy(capacity=8, small_ratio=0.25)
    _fill(policy, range(8))
    for b in range(4):
        policy.on_access(b)
    _evict(policy, 4)  # warm up: hit blocks promoted to main, the rest into the ghost
    tracked = {b: _h(b) for b in (*policy.small, *policy.main)}
    pinned = {}  # block -> (queue, frequency) expected when it is unpinned
    asked = []  # blocks the current selection asked about

    def queue_of(block):
        return "S" if block in policy.small else "M" if block in policy.main else None

    def is_evictable(block):
        asked.append(block)
        return block not in pinned

    for op, x in ops:
        candidates = sorted({"insert": set(range(8)) - tracked.keys(),
                             "pin": tracked.keys() - pinned.keys(),
                             "unpin": pinned.keys()}.get(op, tracked))
        b = candidates[x % len(candidates)] if candidates else None
        if op == "insert" and b is not None:
            # ten hashes for eight blocks, so evicted hashes return (ghost hits fill main)
            taken = set(tracked.values())
            tracked[b] = next(_h(k % 10) for k in range(x, x + 10) if _h(k % 10) not in taken)
            policy.on_insert(b, tracked[b], None)
        elif op == "access" and b is not None:
            policy.on_access(b)
            if b in pinned:
                queue, freq = pinned[b]
                pinned[b] = queue, min(freq + 1, 3)
        elif op == "pin" and b is not None:
            pinned[b] = queue_of(b), policy._freq[b]
            policy.on_pin(b)
            assert queue_of(b) is None and b in policy.pinned
        elif op == "unpin" and b is not None:
            queue, freq = pinned.pop(b)
            policy.on_unpin(b)
            assert (policy.small if queue == "S" else policy.main)[-1] == b, (b, queue)
            assert policy._freq[b] == freq, (b, policy._freq[b], freq)
        elif op == "remove" and b is not None:
            policy.on_remove(b)
            del tracked[b]
            pinned.pop(b, None)
        elif op == "select":
            asked.clear()
            victims = policy.select_victims(1 + x % 3, is_evictable)
            scanned = set(asked) & pinned.keys()
            assert not scanned, f"selection scanned pinned blocks {scanned}"
            for victim in victims or ():
                assert victim in tracked and victim not in pinned, victim
                policy.on_remove(victim)
                del tracked[victim]
        assert len(policy) == len(tracked) and set(policy.pinned) == pinned.keys()
        policy.check_invariants()


# --- OPT ---------------------------------------------------------------------


def test_opt_evicts_the_block_used_furthest_ahead():
    """Never-used-again blocks go first, then the one whose next use is furthest."""
    refs = [_h(r) for r in [0, 1, 2, 3, 2, 0, 1]]
    policy = OptimalPolicy(refs)
    for b, h in enumerate(refs[:4]):
        policy.observe(h)
        policy.on_insert(b, h, None)
    # clock 4: next uses 0 -> 5, 1 -> 6, 2 -> 4, 3 -> never
    assert policy.next_use(_h(3)) == policy.never
    assert policy.select_victims(2, _all) == [3, 1]
    assert policy.select_victims(2, lambda b: b != 1) == [3, 0]
    policy.observe(_h(2))
    assert policy.next_use(_h(2)) == policy.never
    assert policy.select_victims(1, lambda b: b != 3) == [2]


def test_opt_rejects_references_out_of_trace_order():
    """observe() must follow the reference string exactly and stop at its end."""
    policy = OptimalPolicy([_h(0), _h(1)])
    with pytest.raises(PoolUsageError, match=str(_h(1))):
        policy.observe(_h(1))
    policy.observe(_h(0))
    policy.observe(_h(1))
    with pytest.raises(PoolUsageError, match="after all 2 references"):
        policy.observe(_h(0))


def test_opt_rejects_a_second_block_under_a_tracked_hash():
    """Two tracked blocks may not share a hash (a pool's index keeps one)."""
    policy = OptimalPolicy([])
    policy.on_insert(0, _h(0), None)
    with pytest.raises(PoolUsageError, match="already tracked by block 0"):
        policy.on_insert(1, _h(0), None)


_REFS = st.lists(st.integers(0, 6), min_size=1, max_size=14)


@given(_REFS, st.integers(1, 4))
def test_opt_is_optimal_on_tiny_traces(refs, capacity):
    """OPT scores the most hits any demand-paging cache can get (exhaustive search)."""
    hashes = [_h(r) for r in refs]
    best = _optimum(refs, capacity)
    assert simulate(OptimalPolicy(hashes), hashes, capacity, observe=True) == best


@given(st.lists(st.integers(0, 12), min_size=1, max_size=80), st.integers(1, 8))
def test_opt_is_never_beaten(refs, capacity):
    """No built-in policy gets more hits than OPT on a random reference string."""
    hashes = [_h(r) for r in refs]
    best = simulate(OptimalPolicy(hashes), hashes, capacity, observe=True)
    for make in (LRUPolicy, FIFOPolicy, LFUPolicy, ARCPolicy, S3FIFOPolicy):
        assert simulate(make(), hashes, capacity) <= best, make.__name__
