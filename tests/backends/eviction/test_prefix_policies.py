"""The rules the prefix-aware policies claim: leaves up, orphans first, LRU roots, learned density."""

from __future__ import annotations

import copy
import math
from array import array
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvkit.backends.eviction import hit_density
from kvkit.backends.eviction._chains import FlatChains
from kvkit.backends.eviction.hit_density import (
    LEAF,
    PARENT,
    REUSE_LEVELS,
    TIP,
    HitDensityPolicy,
    block_class,
    reuse_level,
)
from kvkit.backends.eviction.hit_density.density import HitDensityModel
from kvkit.backends.eviction.hit_density.kernels import isotonic
from kvkit.backends.eviction.hit_density.shift import ShiftTest
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.eviction.prefix_lru import PrefixLRUPolicy
from kvkit.errors import ConfigError, PoolUsageError
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockId
from kvkit.sim.policy_study import replay
from kvkit.sim.traces import TraceRequest

HIT_DENSITY = [HitDensityPolicy, lambda: HitDensityPolicy(capacity=4, ghost_span=1)]
POLICIES = [PrefixLRUPolicy, *HIT_DENSITY]


class Forest:
    """A pool's view of a policy: tracked blocks with chain parents, pins and recency.

    Block ids are never reused; hashes are, when an evicted hash is inserted
    again under its old parent (as content hashes are). With ``hooks`` pins
    call the policy's pin hooks, and the policy must never ask about a pinned
    block (:meth:`ask`).
    """

    def __init__(self, policy: EvictionPolicy, hooks: bool = False) -> None:
        self.policy = policy
        self.hooks = hooks
        self.hash_of: dict[int, int] = {}  # tracked block -> hash
        self.parent_of_hash: dict[int, int | None] = {}  # every hash ever inserted
        self.pinned: set[int] = set()
        self.recency: dict[int, int] = {}  # tracked block -> tick of last insert or access
        self.gone: list[int] = []  # evicted hashes, which may come back
        self.tick = 0
        self.next_block = 0

    def block_of(self, h: int) -> int | None:
        return next((b for b, bh in self.hash_of.items() if bh == h), None)

    def children(self, block: int) -> list[int]:
        h = self.hash_of[block]
        return [b for b, bh in self.hash_of.items() if self.parent_of_hash[bh] == h]

    def subtree(self, block: int) -> set[int]:
        out, todo = set(), [block]
        while todo:
            b = todo.pop()
            if b not in out:
                out.add(b)
                todo += self.children(b)
        return out

    def is_evictable(self, block: int) -> bool:
        return block in self.hash_of and block not in self.pinned

    def ask(self, block: int) -> bool:
        """``is_evictable`` as the policy sees it: with hooks, pinned blocks are off limits."""
        assert not (self.hooks and block in self.pinned), f"asked about parked block {block}"
        return self.is_evictable(block)

    def pin(self, block: int) -> None:
        if block not in self.pinned:
            if self.hooks:
                self.policy.on_pin(block)
            self.pinned.add(block)

    def unpin(self, block: int) -> None:
        if self.hooks:
            self.policy.on_unpin(block)
        self.pinned.remove(block)

    def orphans(self) -> list[int]:
        return [b for b, h in self.hash_of.items()
                if self.parent_of_hash[h] is not None and self.block_of(self.parent_of_hash[h]) is None]

    def insert(self, h: int, parent: int | None) -> None:
        block, self.next_block = self.next_block, self.next_block + 1
        self.parent_of_hash.setdefault(h, parent)
        self.tick += 1
        self.policy.on_insert(block, h, self.parent_of_hash[h])
        self.hash_of[block], self.recency[block] = h, self.tick

    def access(self, block: int) -> None:
        self.tick += 1
        self.policy.on_access(block)
        self.recency[block] = self.tick

    def remove(self, block: int) -> None:
        self.policy.on_remove(block)
        self.gone.append(self.hash_of.pop(block))
        del self.recency[block]
        self.pinned.discard(block)


op = st.one_of(
    st.tuples(st.just("chain"), st.sampled_from(["root", "orphan", "under"]), st.integers(0, 40),
              st.integers(1, 4)),
    st.tuples(st.just("again"), st.integers(0, 40)),
    st.tuples(st.sampled_from(["access", "pin", "unpin", "remove"]), st.integers(0, 40)),
    st.tuples(st.just("select"), st.integers(1, 6)),
)
ops = st.lists(op, max_size=40)


def drive(policy: EvictionPolicy, script: list[tuple],
          check: Callable[[Forest, int, list[int]], None], hooks: bool = False) -> None:
    """Run ``script`` on ``policy``; ``check(forest, n, victims)`` sees every successful selection."""
    f = Forest(policy, hooks)
    fresh = iter(range(1_000_000, 2_000_000))
    for op, *args in script:
        tracked = sorted(f.hash_of)
        if op == "chain":  # a new chain: a new root, under a lost parent, or under a tracked block
            kind, pick, length = args
            parent = (f.hash_of[tracked[pick % len(tracked)]] if kind == "under" and tracked
                      else next(fresh) if kind == "orphan" else None)
            for _ in range(length):
                h = next(fresh)
                f.insert(h, parent)
                parent = h
        elif op == "again" and f.gone:  # an evicted hash returns, under its first parent
            h = f.gone.pop(args[0] % len(f.gone))
            if f.block_of(h) is None:
                f.insert(h, f.parent_of_hash[h])
        elif op == "select":
            n = min(args[0], sum(map(f.is_evictable, tracked)))
            victims = policy.select_victims(n, f.ask)
            assert victims is not None and len(set(victims)) == n
            check(f, n, victims)
            for v in victims:
                f.remove(v)
        elif op == "unpin":
            if f.pinned:
                f.unpin(sorted(f.pinned)[args[0] % len(f.pinned)])
        elif tracked:
            block = tracked[args[0] % len(tracked)]
            if op == "access":
                f.access(block)
            elif op == "pin":
                f.pin(block)
            elif block not in f.pinned:  # remove, as a reset would: may leave orphans
                f.remove(block)
        policy.check_invariants()


def _leaves_first(f: Forest, n: int, victims: list[int]) -> None:
    for i, v in enumerate(victims):
        for d in f.subtree(v) - {v}:
            if f.is_evictable(d):
                assert d in victims[:i], f"victim {v} chosen before its evictable descendant {d}"


def _orphans_first(f: Forest, n: int, victims: list[int]) -> None:
    first = set()
    for o in f.orphans():
        if f.is_evictable(o):
            first |= {b for b in f.subtree(o) if f.is_evictable(b)}
    k = min(n, len(first))
    assert set(victims[:k]) <= first, f"victims {victims[:k]} taken before orphan subtrees {first}"


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("make", POLICIES)
@given(script=ops)
def test_a_victim_never_leaves_an_evictable_descendant_behind(make, hooks, script):
    """Every evictable descendant of a victim is a victim too, chosen before it."""
    drive(make(), script, _leaves_first, hooks)


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("make", POLICIES)
@given(script=ops)
@example(script=[("chain", "orphan", 0, 1), ("chain", "root", 0, 1), ("pin", 0), ("select", 1)])
def test_orphans_go_first(make, hooks, script):
    """While an evictable orphan (parent hash not cached) exists, its subtree goes first."""
    drive(make(), script, _orphans_first, hooks)


class _EveryRootWalked(FlatChains):
    """The chain index with no child reported an only child: its owner takes every root with a child through
    :meth:`FlatChains.collect`, the walk that its inlined case (one child, chosen already) must match."""

    __slots__ = ()

    @property
    def sibling_rings(self) -> array:
        return array("i", [-2]) * len(self.child_rings)


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("make", HIT_DENSITY)
@given(script=ops)
@example(script=[("chain", "root", 0, 4), ("select", 3)])
@example(script=[("chain", "root", 0, 3), ("chain", "under", 1, 2), ("pin", 2), ("select", 4)])
def test_a_root_above_its_chosen_only_child_is_chosen_as_the_walk_chooses_it(make, hooks, script):
    """Every selection equals that of a copy that walks below every root with a child (a chain taken from
    its tip up: each parent's only child is chosen before it)."""
    runs: list[list[list[int]]] = []
    for walked in (False, True):
        policy = make()
        if walked:
            policy._chains.__class__ = _EveryRootWalked
        runs.append([])
        drive(policy, script, lambda f, n, victims, run=runs[-1]: run.append(list(victims)), hooks)
    assert runs[0] == runs[1]


def _lru_root(f: Forest, n: int, victims: list[int]) -> None:
    if not n or any(map(f.is_evictable, f.orphans())):
        return
    root = min((b for b in f.hash_of if f.is_evictable(b)), key=f.recency.__getitem__)
    below = {b for b in f.subtree(root) if f.is_evictable(b)}
    if n <= len(below):
        assert set(victims) <= below, f"{victims} not all in the LRU block {root}'s subtree {below}"
    else:
        assert below <= set(victims), f"LRU block {root}'s subtree {below} not all in {victims}"


@given(script=ops)
@example(script=[("chain", "root", 0, 2), ("chain", "root", 0, 1), ("select", 1)])
def test_prefix_lru_evicts_the_least_recently_used_chain_first(script):
    """Without orphans, prefix LRU's victims come from the least recently used block's subtree first."""
    drive(PrefixLRUPolicy(), script, _lru_root)


def _requests(*chains: tuple[int, ...]) -> list[TraceRequest]:
    return [TraceRequest(i, 16 * len(c), 1, c, i + 1) for i, c in enumerate(chains)]


def test_prefix_lru_keeps_the_head_of_a_chain_plain_lru_drops():
    """When a chain no longer fits, prefix LRU keeps its head (it hits); LRU keeps its dead tail."""
    trace = _requests((1, 2, 3, 4), (5, 6), (1, 2, 3, 4))
    assert replay(trace, 4, LRUPolicy()).hits == 0  # LRU evicted 1 and 2: 3 and 4 are stranded
    assert replay(trace, 4, PrefixLRUPolicy(), check_invariants=True).hits == 2


# -- hit density ---------------------------------------------------------------


def test_density_of_a_class_never_reused_is_zero():
    """A class whose blocks all ended unreused has density 0 at every age."""
    model = HitDensityModel(2, min_samples=1)
    for age in range(0, 5000, 50):
        model.record_end(0, age)
        model.record_reuse(1, age)
    model.refresh(np.zeros(0, np.int64), np.zeros(0, np.int64), keep=1.0)
    assert model.density(0, 10) == 0.0 and model.density(1, 10) > 0


@given(st.integers(1, 6), st.one_of(st.integers(0, 2 ** 44), st.sampled_from(
    [2 ** k + d for k in range(45) for d in (-2, -1, 0, 1) if 2 ** k + d >= 0])))
def test_bucket_is_the_exact_log_bucket_the_refresh_uses(per_octave, age):
    """An age's bucket is floor(per_octave * log2(age + 1)), capped, and the one a refresh files it in."""
    model = HitDensityModel(1, per_octave=per_octave, min_samples=1)
    exact = max(b for b in range(per_octave * 45 + 1) if 2 ** b <= (age + 1) ** per_octave)
    assert model.bucket(age) == min(exact, model.buckets - 1)
    assert model.buckets_of(np.array([age]))[0] == model.bucket(age)
    model.record_reuse(0, age)
    model.refresh(np.zeros(0, np.int64), np.zeros(0, np.int64), keep=1.0)
    assert list(np.flatnonzero(model.reuses[0])) == [model.bucket(age)]
    assert model.density(0, age) == model.table[0, model.bucket(age)]


@given(st.integers(1, 60), st.integers(0, 12), st.integers(1, 8))
def test_density_matches_a_hand_computed_reuse_window(never, reused, window_octaves):
    """Blocks reused at one age R, the others never: density before R is p / E[space until R]."""
    per_octave = 1
    model = HitDensityModel(1, per_octave=per_octave, min_samples=1)
    reuse_age = 2 ** window_octaves  # bucket start: 2**b - 1 with b = window_octaves * per_octave
    reuse_bucket = model.bucket(reuse_age)
    for _ in range(reused):
        model.record_reuse(0, reuse_age)
    for _ in range(never):
        model.record_end(0, 2 ** 20)  # long after R
    model.refresh(np.zeros(0, np.int64), np.zeros(0, np.int64), keep=1.0)
    edges = model.edges
    p = reused / (reused + never)
    # From age 0: every block is alive until bucket R, p of them end there (hit), the rest live on;
    # the best horizon is bucket R itself: hits p over space sum(widths of buckets 0..R).
    expected = p / (edges[reuse_bucket + 1] - edges[0]) if reused else 0.0
    assert math.isclose(model.density(0, 0), expected, rel_tol=1e-9)
    assert model.density(0, 2 ** 21) == 0.0  # past every reuse: nothing left to earn


def _density_by_definition(reuses: list[float], events: list[float], widths: list[float]) -> list[float]:
    """One class's density per bucket from its own definition, term by term: Kaplan-Meier survival,
    then at each age the best ratio of expected hits to expected space over every later horizon."""
    n = len(reuses)
    at_risk = [sum(events[b:]) for b in range(n)]
    alive, hits, space = 1.0, [], []
    for b in range(n):
        hazard = reuses[b] / at_risk[b] if at_risk[b] > 0 else 0.0
        hits.append(alive * hazard)
        space.append(alive * widths[b] if at_risk[b] > 0 else 0.0)
        alive *= 1 - hazard
    best = []
    for a in range(n):
        ratios = [sum(hits[a:t + 1]) / sum(space[a:t + 1]) for t in range(a, n) if sum(space[a:t + 1]) > 0]
        best.append(max(ratios, default=0.0) if space[a] > 0 else 0.0)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2 ** 24), st.booleans()), min_size=1, max_size=120),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2 ** 24)), max_size=20))
def test_density_table_is_its_definition_at_every_seen_age(events, alive):
    """At every age some block of its class reached, a class's density is the best hits-per-space
    ratio over every later horizon (the model searches only the ages some class reached)."""
    model = HitDensityModel(4, per_octave=2, min_samples=1)
    for cls, age, reused in events:
        (model.record_reuse if reused else model.record_end)(cls, age)
    reuses, ends = model.reuses.copy(), model.ends.copy()
    live = np.zeros_like(ends)
    for cls, age in alive:
        live[cls, model.bucket(age)] += 1
    model.refresh(np.array([c for c, _ in alive], np.int64), np.array([a for _, a in alive], np.int64), keep=1.0)
    widths = list(np.diff(model.edges))
    for cls in range(4):
        if not (reuses[cls] + ends[cls] + live[cls]).any():
            continue
        seen = int(np.flatnonzero(reuses[cls] + ends[cls] + live[cls]).max()) + 1
        expected = _density_by_definition(list(reuses[cls][:seen]),
                                          list((reuses[cls] + ends[cls] + live[cls])[:seen]), widths[:seen])
        assert np.allclose(model.table[cls, :seen], expected, rtol=1e-9, atol=0), cls


def _pooled_fit(values: list[float], weights: list[float]) -> list[float]:
    """Pool adjacent violators: the weighted non-decreasing fit of one column (positive weights), built
    independently of :func:`isotonic`'s min-max form."""
    pools: list[list[float]] = []  # [value, weight, rows]
    for value, weight in zip(values, weights, strict=True):
        pools.append([value, weight, 1])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (v2, w2, n2), (v1, w1, n1) = pools.pop(), pools[-1]
            pools[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [value for value, _, rows in pools for _ in range(rows)]


_cells = st.floats(0, 1e3, allow_nan=False)


@given(st.integers(1, 7).flatmap(lambda rows: st.tuples(
    st.lists(st.lists(_cells, min_size=rows, max_size=rows), min_size=1, max_size=5),
    st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, 7.0, 1e3]), min_size=rows, max_size=rows),
             min_size=5, max_size=5))))
def test_isotonic_is_the_weighted_least_squares_monotone_fit(case):
    """Each column's fit is non-decreasing and equals pool-adjacent-violators' with the same weights
    (each plus 1e-9 of its column's total, or 1e-9 where all are zero)."""
    columns, weight_columns = case
    values = np.array(columns).T
    weights = np.array(weight_columns[:len(columns)]).T
    fit = isotonic(values, weights)
    assert (np.diff(fit, axis=0) >= 0).all()
    for c in range(values.shape[1]):
        w = weights[:, c] + 1e-9 * (weights[:, c].sum() or 1.0)
        assert np.allclose(fit[:, c], _pooled_fit(values[:, c].tolist(), w.tolist()), rtol=1e-9, atol=1e-9)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5_000), st.booleans()), max_size=200),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5_000)), max_size=40), st.integers(1, 40))
def test_a_sparse_class_borrows_the_pooled_density_bit_for_bit(events, alive, min_samples):
    """A class with fewer than ``min_samples`` observations takes the density of all classes pooled (a
    one-class model fed every event), the others keep their own (a model that pools none), to the last bit."""
    model, free, pooled = (HitDensityModel(classes, min_samples=samples)
                           for classes, samples in ((4, min_samples), (4, 1), (1, 1)))
    for cls, age, reused in events:
        for m, c in ((model, cls), (free, cls), (pooled, 0)):
            (m.record_reuse if reused else m.record_end)(c, age)
    ages = np.array([a for _, a in alive], np.int64)
    for m, classes in ((model, [c for c, _ in alive]), (free, [c for c, _ in alive]), (pooled, [0] * len(alive))):
        m.refresh(np.array(classes, np.int64), ages, keep=1.0)
    observed = [sum(1 for c, *_ in events if c == cls) + sum(1 for c, _ in alive if c == cls) for cls in range(4)]
    for cls in range(4):
        expected = pooled.table[0] if observed[cls] < min_samples else free.table[cls]
        assert model.table[cls].tobytes() == expected.tobytes(), cls


def _min_max_fit(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """:func:`isotonic`'s definition read literally: every mean of rows ``j..k`` summed from row ``j`` on
    (``cumsum``), in one array, then the max over ``j <= i`` of the min over ``k >= i``."""
    rows = len(values)
    total = weights.sum(axis=0, keepdims=True)
    weights = weights + 1e-9 * np.where(total > 0, total, 1.0)
    means = np.full((rows, *values.shape), np.inf)
    for j in range(rows):
        means[j, j:] = np.cumsum(values[j:] * weights[j:], axis=0) / np.cumsum(weights[j:], axis=0)
    lows = np.minimum.accumulate(means[:, ::-1], axis=1)[:, ::-1]
    lows[~np.triu(np.ones((rows, rows), dtype=bool))] = -np.inf
    return lows.max(axis=0)


@given(st.integers(1, 8).flatmap(lambda rows: st.tuples(
    st.lists(st.lists(st.floats(0, 1e9, allow_nan=False, allow_subnormal=True), min_size=rows, max_size=rows),
             min_size=1, max_size=6),
    st.lists(st.lists(st.one_of(st.sampled_from([0.0, 1e-300, 0.5, 1.0, 3.0]), st.floats(0, 1e6)),
                      min_size=rows, max_size=rows), min_size=6, max_size=6))))
def test_isotonic_is_its_min_max_definition_bit_for_bit(case):
    """The fit equals the min-max formula computed literally, to the last bit: the policy's densities,
    and so its decisions, do not depend on how the means are arranged."""
    columns, weight_columns = case
    values = np.array(columns).T
    weights = np.array(weight_columns[:len(columns)]).T
    assert isotonic(values, weights).tobytes() == _min_max_fit(values, weights).tobytes()


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20_000), st.booleans()), min_size=1, max_size=300))
def test_density_never_ranks_a_class_below_one_it_dominates(events):
    """With a monotone chain, each class's density is at least the ones before it, at every age: the
    fit of the unordered densities weighted by each class's blocks at risk at that age."""
    chain = (0, 1, 2, 3)
    model, free = HitDensityModel(4, min_samples=1, monotone=(chain,)), HitDensityModel(4, min_samples=1)
    for cls, age, reused in events:
        for m in (model, free):
            (m.record_reuse if reused else m.record_end)(cls, age)
    at_risk = np.cumsum((free.reuses + free.ends)[:, ::-1], axis=1)[:, ::-1]
    for m in (model, free):
        m.refresh(np.zeros(0, np.int64), np.zeros(0, np.int64), keep=1.0)
        m.check_invariants()
    assert (np.diff(model.table, axis=0) >= 0).all()
    assert np.allclose(model.table, isotonic(free.table, at_risk), rtol=1e-12, atol=0)


def test_the_order_weighs_each_class_by_its_evidence():
    """Many blocks of the dominating class that never came back pull the pair's fit down to near their
    own density; a thinly observed dominating class is raised to near the other's."""
    def fitted(low_blocks: int, high_blocks: int) -> tuple[float, float, float, float]:
        model, free = (HitDensityModel(2, min_samples=1, monotone=chains) for chains in (((0, 1),), ()))
        for m in (model, free):
            for _ in range(low_blocks):
                m.record_reuse(0, 1000)  # the lower class: every block back at age 1000
            for i in range(high_blocks):
                (m.record_reuse if i % 10 == 0 else m.record_end)(1, 1000 if i % 10 == 0 else 2**20)
            m.refresh(np.zeros(0, np.int64), np.zeros(0, np.int64), keep=1.0)
        return free.density(0, 0), free.density(1, 0), model.density(0, 0), model.density(1, 0)

    low, high, fit_low, fit_high = fitted(10, 1000)
    assert high < low  # the evidence inverts the order here
    assert fit_low == fit_high  # pooled into one value...
    assert high <= fit_high < high + 0.05 * (low - high)  # ... near the well-observed class's density
    low, high, fit_low, fit_high = fitted(1000, 10)
    assert high < low and fit_low == fit_high
    assert low - 0.05 * (low - high) < fit_high <= low  # a thin class follows the well-observed one


def test_density_at_an_age_never_seen_fades_from_the_oldest_seen():
    """Before any block of a class grew old, old ages start from the oldest seen age's density, not 0,
    and halve with every doubling of age past it."""
    model = HitDensityModel(1, min_samples=1)
    for _ in range(50):
        model.record_reuse(0, 3000)  # reused as old as any block has been seen so far
    model.refresh(np.zeros(10, np.int64), np.full(10, 3000), keep=1.0)  # ten alive, 3000 old
    oldest = model.density(0, 3000)
    assert oldest > 0
    last = model.bucket(3000)
    for age in (2**20 - 1, 2**22 - 1, 2**30 - 1):  # no block was seen this old yet
        assert math.isclose(model.density(0, age), oldest * 2 ** (-(model.bucket(age) - last) / model.per_octave))
    assert math.isclose(model.density(0, 2**21 - 1), model.density(0, 2**20 - 1) / 2)


@given(st.lists(st.tuples(st.integers(0, 50_000), st.booleans()), min_size=1, max_size=200),
       st.lists(st.integers(0, 50_000), max_size=20))
def test_unseen_ages_fade_geometrically_from_the_oldest_seen(events, alive):
    """Past the oldest age any block reached, a row falls by 2 ** (-1 / per_octave) per bucket."""
    model = HitDensityModel(1, min_samples=1)
    for age, reused in events:
        (model.record_reuse if reused else model.record_end)(0, age)
    model.refresh(np.zeros(len(alive), np.int64), np.array(alive, np.int64), keep=1.0)
    model.check_invariants()
    last = max(model.bucket(age) for age in [*alive, *(a for a, _ in events)])
    row = model.table[0]
    expected = row[last] * 2.0 ** (-np.arange(1, model.buckets - last) / model.per_octave)
    assert np.allclose(row[last + 1:], expected, rtol=1e-12, atol=0)


def test_a_monotone_chain_outside_the_classes_is_refused():
    """A chain naming a class the model lacks (or a non-int) is a ConfigError quoting it."""
    with pytest.raises(ConfigError, match=r"\[5\] in \(\(0, 5\), \(1, 2\)\)"):
        HitDensityModel(4, monotone=((0, 5), (1, 2)))
    with pytest.raises(ConfigError, match="True"):
        HitDensityModel(4, monotone=((0, True),))
    with pytest.raises(ConfigError, match="got 5"):
        HitDensityModel(4, monotone=5)
    with pytest.raises(ConfigError, match=r"got \(1, 2\)"):
        HitDensityModel(4, monotone=(1, 2))


def test_a_hash_back_within_a_turnover_counts_one_use_more():
    """Back sooner than the pool's turnover: ghost uses + 2; later, or before any gap was measured: + 1."""
    policy = HitDensityPolicy(capacity=4)
    for block in range(4):
        policy.on_insert(block, 100 + block, None)  # ticks 1-4: the fill
    policy.on_remove(0)              # tick 4: the first removal only starts the clock
    policy.on_insert(4, 100, None)   # tick 5: hash 100 back, no turnover measured yet: + 1
    assert policy.class_of(4) == block_class(1, TIP)
    policy.on_remove(1)              # tick 5, 1 tick after the first removal: turnover 4 * 1 = 4
    policy.on_insert(5, 105, None)   # tick 6
    policy.on_remove(5)              # tick 6: turnover (4 + 4) / 2 = 4
    policy.on_insert(6, 105, None)   # tick 7: hash 105 back 1 tick after its last use (< 4): + 2
    assert policy.class_of(6) == block_class(2, TIP)
    policy.on_remove(2)              # tick 7
    policy.on_insert(7, 101, None)   # tick 8: hash 101 back 6 ticks after its last use (>= 4): + 1
    assert policy.class_of(7) == block_class(1, TIP)
    policy.check_invariants()


@given(capacity=st.integers(2, 6), fill_hits=st.integers(0, 300),
       gaps=st.lists(st.integers(0, 5), min_size=1, max_size=20))
def test_the_turnover_is_c_times_the_mean_gap_between_removals(capacity, fill_hits, gaps):
    """The turnover is ``c`` times the mean gap between removals (the first ``c`` gaps averaged alike,
    then each new one weighing ``1 / c``), whatever the pool did before its first removal: a fill
    that took long, or was hit often, is not a gap."""
    policy = HitDensityPolicy(capacity=capacity)
    for block in range(capacity):
        policy.on_insert(block, block, None)
    for _ in range(fill_hits):
        policy.on_access(0)
    next_block = capacity
    policy.on_remove(capacity - 1)  # the first removal
    expected = 0.0
    for n, gap in enumerate(gaps, start=1):
        for _ in range(gap):  # ticks between two removals: hits on block 0
            policy.on_access(0)
        policy.on_insert(next_block, next_block, None)  # refill, then evict it: one more tick
        policy.on_remove(next_block)
        next_block += 1
        expected += ((gap + 1) * capacity - expected) / min(n, capacity)
        assert policy._turnover == pytest.approx(expected)
    policy.check_invariants()


def test_density_looks_past_a_dead_zone():
    """A block too young to be reused yet is still worth its space if reuses come later."""
    model = HitDensityModel(1, min_samples=1)
    for _ in range(50):
        model.record_reuse(0, 4000)  # users come back after a think time of ~4000 ticks
        model.record_end(0, 100_000)
    model.refresh(np.zeros(0, np.int64), np.zeros(0, np.int64), keep=1.0)
    young, ripe, stale = (model.density(0, a) for a in (0, 3000, 10_000))
    assert ripe > young > 0 and stale == 0


def _train(policy: HitDensityPolicy, rounds: int) -> int:
    """Blocks hit once come back ~100 ticks later; blocks never hit never come back."""
    block = 0
    for r in range(rounds):
        base = 10 * r
        policy.on_insert(block, base, None)          # will be hit, evicted, and re-inserted
        policy.on_insert(block + 1, base + 1, None)  # never hit, never back
        policy.on_access(block)
        policy.on_remove(block)
        policy.on_remove(block + 1)
        for k in range(100):  # filler: 100 ticks of unrelated one-off blocks
            policy.on_insert(block + 2, 10**9 + 200 * r + k, None)
            policy.on_remove(block + 2)
        policy.on_insert(block + 3, base, None)      # the hit block returns (a ghost hit)
        policy.on_remove(block + 3)
        block += 4
    return block


def test_hit_density_learns_to_evict_a_fresh_one_off_before_an_older_reused_block():
    """Having learnt that unhit blocks never return, it evicts one before an older hit block."""
    policy = HitDensityPolicy(capacity=16)
    block = _train(policy, 40)
    policy.on_insert(block, 7, None)
    policy.on_access(block)  # hit once: this class comes back
    policy.on_insert(block + 1, 8, None)  # newer, never hit
    assert policy.density_of(block) > policy.density_of(block + 1)
    assert policy.select_victims(1, lambda b: True) == [block + 1]
    lru = LRUPolicy()
    lru.on_insert(block, 7, None)
    lru.on_access(block)
    lru.on_insert(block + 1, 8, None)
    assert lru.select_victims(1, lambda b: True) == [block]


class _ParkingWitness:
    """A hit-density policy driven with pin hooks, beside a twin that never hears of pins.

    Forwards every call to both (selections and hooks to the policy only) and
    checks that parking keeps a block's counters: every tracked block has the
    twin's class (reuse count and parenthood, however many hits or children
    it got while parked) and density (age and learned model), a parked block
    sits in no class list, and an unpinned one is back at the young end of
    its class's list.
    """

    def __init__(self, policy: HitDensityPolicy) -> None:
        self.policy, self.twin = policy, copy.deepcopy(policy)
        self.tracked: set[int] = set()

    def on_insert(self, block: int, block_hash: int, parent: int | None) -> None:
        self.policy.on_insert(block, block_hash, parent)
        self.twin.on_insert(block, block_hash, parent)
        self.tracked.add(block)

    def on_access(self, block: int) -> None:
        self.policy.on_access(block)
        self.twin.on_access(block)

    def on_remove(self, block: int) -> None:
        self.policy.on_remove(block)
        self.twin.on_remove(block)
        self.tracked.discard(block)

    def on_pin(self, block: int) -> None:
        self.policy.on_pin(block)
        assert block in self.policy.pinned

    def on_unpin(self, block: int) -> None:
        policy = self.policy
        policy.on_unpin(block)
        cls = policy.class_of(block)
        assert policy.class_blocks(cls)[-1] == block, f"unpinned {block} not young in class {cls}"

    def select_victims(self, n: int, is_evictable: Callable[[int], bool]) -> list[int] | None:
        return self.policy.select_victims(n, is_evictable)

    def __len__(self) -> int:
        return len(self.policy)

    def check_invariants(self) -> None:
        policy = self.policy
        policy.check_invariants()
        self.twin.check_invariants()
        listed = {b for cls in range(block_class(REUSE_LEVELS[-1], TIP) + 1) for b in policy.class_blocks(cls)}
        assert listed.isdisjoint(policy.pinned), f"listed parked {listed & set(policy.pinned)}"
        for block in self.tracked:
            mine = policy.class_of(block), policy.density_of(block)
            twins = self.twin.class_of(block), self.twin.density_of(block)
            assert mine == twins, f"block {block} has (class, density) {mine}, its twin {twins}"


@pytest.mark.parametrize("make", HIT_DENSITY)
@given(script=ops)
def test_hit_density_parks_a_pinned_block_and_returns_it_to_its_class(make, script):
    """A parked block is never asked about, keeps its hookless twin's class, and returns young."""
    drive(_ParkingWitness(make()), script, lambda f, n, victims: None, hooks=True)


@pytest.mark.parametrize("hooks", [False, True])
@given(script=st.lists(op, min_size=60, max_size=200))
@settings(max_examples=60, deadline=None)
def test_restarting_every_count_keeps_every_invariant(hooks, script):
    """With a refresh every 8 ticks and a shift test that fires at nearly every one (alpha 0.999, one
    run of history), the counts of tracked blocks, parked blocks, the tip and the ghosts restart again
    and again while victims still come leaves first and the invariants hold after every step."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hit_density, "_MIN_REFRESH", 8)
        policy = HitDensityPolicy(capacity=4, ghost_span=1)
        policy._shift = ShiftTest(len(REUSE_LEVELS), alpha=0.999, min_runs=1)
        drive(policy, script, _leaves_first, hooks)


def test_a_restart_keeps_only_the_reuses_since_the_change_point_and_keeps_kinds_and_order():
    """After a declared shift every count is its reuses since the last refresh outside an excursion (tracked,
    parked and ghosts alike), kinds stay, and each class list runs oldest last use first."""
    policy = HitDensityPolicy(capacity=8)
    for block in range(6):
        policy.on_insert(block, 100 + block, None)
    for block, hits in ((1, 5), (2, 3), (3, 1), (4, 6), (5, 2)):
        for _ in range(hits):
            policy.on_access(block)
    policy._refresh()  # no excursion (too little history to test): the change point a restart keeps
    for block, hits in ((1, 1), (3, 2), (5, 1)):
        for _ in range(hits):
            policy.on_access(block)
    policy.on_pin(2)
    policy.on_remove(4)  # a ghost with 6 uses, none since the change point
    policy.on_remove(5)  # a ghost with 3 uses, 1 since
    policy._restart_counts()
    assert [policy.uses_of(b) for b in range(4)] == [0, 1, 0, 2]
    assert policy.class_blocks(block_class(0, LEAF)) == (0,) and policy.pinned == (2,)
    assert policy.class_blocks(block_class(1, LEAF)) == (1,) and policy.class_blocks(block_class(2, LEAF)) == (3,)
    assert policy.class_of(2) == block_class(0, LEAF)
    policy.check_invariants()
    # the ghosts return: their uses since the change point plus this reuse (the two removals came at
    # one tick: a turnover of 0, so no extra use)
    policy.on_insert(6, 104, None)  # 0 uses, plus 1
    policy.on_insert(7, 105, None)  # 1 use, plus 1
    assert policy.class_of(6) == block_class(1, LEAF) and policy.class_of(7) == block_class(2, TIP)
    policy.check_invariants()


def _restart_block_by_block(policy: HitDensityPolicy) -> None:
    """The restart's rule, one block and one ghost at a time: each tracked block, oldest last use first,
    takes its reuses since the change point and re-enters the young end of its new class if listed."""
    for end in range(len(policy._ends)):
        policy._ends[end] = -1
        policy._dirty.add(end)
    tracked = np.flatnonzero(np.frombuffer(policy._where, dtype=np.uint8))
    lasts = np.frombuffer(policy._last, dtype=np.int64)[tracked]
    for block in tracked[np.argsort(lasts, kind="stable")].tolist():
        uses = min(policy._recent.get(block, 0), 255)
        policy._uses[block] = uses
        policy._cls[block] = cls = block_class(uses, policy._cls[block] % 3)
        if policy._where[block] == 1:
            policy._move(block, -1, cls)
    for i, key in enumerate(policy._ghost_key):
        if policy._ghost_live[i]:
            policy._ghost_uses[i] = min(policy._ghost_recent.get(key, 0), 255)


@pytest.mark.parametrize("seed", range(6))
def test_a_restart_is_the_block_by_block_rule(seed: int) -> None:
    """The restart's whole-array steps leave the state the rule block by block leaves: counts, classes,
    every list link (a parked block's untouched), the list ends and the ghosts' counts."""
    rng = np.random.default_rng(seed)
    policy = HitDensityPolicy(capacity=64, ghost_span=2)
    free, tracked, parked = list(range(300)), [], set()
    for _ in range(1500):
        op = rng.integers(4)
        if op == 0 and len(free) > 4:  # a chain of new blocks over hashes that repeat (ghosts return)
            n = int(rng.integers(1, 5))
            blocks = [free.pop(int(rng.integers(len(free)))) for _ in range(n)]
            hashes = [int(h) for h in rng.choice(400, size=n, replace=False)]
            hashes = [h for h in hashes if not policy._chains.has_hash(h)]
            free += blocks[len(hashes):]
            for block, parent, block_hash in zip(blocks, [None, *hashes], hashes):
                policy.on_insert(block, block_hash, parent)
                tracked.append(block)
        elif op == 1 and tracked:
            policy.on_access(tracked[int(rng.integers(len(tracked)))])
        elif op == 2 and tracked:
            block = tracked[int(rng.integers(len(tracked)))]
            if block in parked:
                policy.on_unpin(block)
                parked.discard(block)
            else:
                policy.on_pin(block)
                parked.add(block)
        elif op == 3 and len(tracked) > len(parked):
            block = next(b for b in tracked[int(rng.integers(len(tracked))):] + tracked if b not in parked)
            policy.on_remove(block)
            tracked.remove(block)
            free.append(block)
    leaving = next(b for b in tracked if b not in parked)
    policy.on_access(leaving)
    policy.on_remove(leaving)  # a ghost with a reuse since the change point
    assert policy._recent and policy._ghost_recent and parked
    expected = copy.deepcopy(policy)
    policy._restart_counts()
    _restart_block_by_block(expected)
    for name in ("_uses", "_cls", "_next", "_prev", "_ends", "_dirty", "_ghost_uses"):
        assert getattr(policy, name) == getattr(expected, name), name
    policy.check_invariants()


def test_a_ghost_hit_keeps_the_reuse_count():
    """An evicted hash inserted again (no sooner than a turnover) is in the class of its old reuse count plus one."""
    policy = HitDensityPolicy(capacity=4)
    policy.on_insert(0, 42, None)
    policy.on_access(0)
    policy.on_remove(0)  # at tick 2, the first removal: no turnover measured yet, so no extra use
    for block in range(10, 20):
        policy.on_insert(block, block, None)  # ticks 3-12 pass
    policy.on_insert(1, 42, None)  # tick 13, 11 ticks after its last use
    assert policy.class_of(1) == block_class(2, TIP)
    learned = policy.model.reuses[block_class(1, TIP)]
    assert learned[policy.model.bucket(11)] == 1 and learned.sum() == 1  # the missed reuse, at age 11
    policy.check_invariants()


def test_the_ghost_is_bounded_by_its_span():
    """The ghost remembers at most ``ghost_span`` pools' worth of evictions."""
    policy = HitDensityPolicy(capacity=3, ghost_span=2)
    for b in range(50):
        policy.on_insert(b, 1000 + b, None)
        policy.on_remove(b)
    assert policy.num_ghosts == 6
    policy.check_invariants()



@given(st.integers(2, 40), st.integers(1, 12))
def test_the_ghost_is_bounded_in_bytes(capacity, entries):
    """``ghost_bytes`` caps the ghost below ``ghost_span`` pools when it binds: at most ``ghost_bytes // 192``."""
    policy = HitDensityPolicy(capacity=capacity, ghost_span=4, ghost_bytes=192 * entries + 191)
    for b in range(6 * capacity):
        policy.on_insert(b, 1000 + b, None)
        policy.on_remove(b)
    assert policy.num_ghosts == min(4 * capacity, entries)
    policy.check_invariants()


def test_a_ghost_costs_at_most_the_bytes_its_bound_counts():
    """The bytes ``ghost_bytes`` counts per ghost (192) cover what a ghost holds: its map entry and array slots
    (its hash object leaves with its block), at every size up to 200,000 ghosts (the map's resizes included)."""
    import gc
    import tracemalloc

    from kvkit.backends.eviction.hit_density import _GHOST_ENTRY_BYTES

    policy = HitDensityPolicy(capacity=1 << 20, ghost_span=8)
    for b in range(1000):
        policy.on_insert(b, (1 << 127) + b, None)
    gc.collect()
    tracemalloc.start()
    worst = 0.0
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1000, 201_000):
            policy.on_remove(i % 1000)
            policy.on_insert(i % 1000, (1 << 127) + i, None)
            if i % 5000 == 0:
                worst = max(worst, (tracemalloc.get_traced_memory()[0] - before) / policy.num_ghosts)
    finally:
        tracemalloc.stop()
    assert policy.num_ghosts == 200_000
    assert 0 < worst <= _GHOST_ENTRY_BYTES, worst


@settings(max_examples=12)
@given(st.integers(1, 2500), st.booleans(), st.sampled_from([1.0, 2.5, 8.0, 64.0]))
@example(100, True, 8.0)
@example(100, False, 8.0)
def test_the_model_remembers_ghost_span_pools_but_never_fewer_than_4096_ticks(capacity, given_size, ghost_span):
    """Each refresh keeps ``1 - 1 / span`` of the reuse histograms, ``span = ghost_span`` refreshes while
    a learned size may still grow, and at least enough to span 4,096 ticks once the size is known."""
    policy = HitDensityPolicy(capacity=capacity if given_size else None, ghost_span=ghost_span)
    policy.on_insert(0, 0, None)
    for _ in range(5):
        policy.on_access(0)  # 5 reuses, all before the first refresh (tick 64)
    fifo, ratios, mass, sized = [0], [], policy.model.reuses.sum(), given_size
    for block in range(1, 4 * max(capacity, 64) + 70):
        if len(fifo) >= capacity:
            policy.on_remove(fifo.pop(0))  # as a pool evicts to make room: fresh hashes never come back
            sized = True
        policy.on_insert(block, 10**6 + block, None)
        fifo.append(block)
        if policy.model.reuses.sum() != mass:  # a refresh: the only thing that changes the mass now
            period = max(policy.c, 64)
            span = max(ghost_span, 4096 / period) if sized else ghost_span
            ratios.append((policy.model.reuses.sum() / mass, 1 - 1 / span))
            mass = policy.model.reuses.sum()
            if not mass:
                break  # a span of one refresh forgets everything (ghost_span=1 before the size is known)
    assert len(ratios) >= 3 or ratios[-1] == (0, 0)
    for got, want in ratios:
        assert math.isclose(got, want, rel_tol=1e-9), ratios
    policy.check_invariants()


def test_a_first_child_makes_its_parent_a_parent_class():
    """A block moves to the parent class when its first child is inserted, and stays there."""
    policy = HitDensityPolicy()
    policy.on_insert(0, 100, None)
    assert policy.class_of(0) == block_class(0, TIP)
    policy.on_insert(1, 101, 100)
    policy.on_remove(1)
    assert policy.class_of(0) == block_class(0, PARENT)


def test_reuse_levels_are_counts_to_three_then_powers_of_two():
    """Counts 0-3 are a level each, then 4-7, 8-15 and 16+; a level never falls as the count grows."""
    assert [reuse_level(uses) for uses in (0, 1, 2, 3, 4, 7, 8, 15, 16, 10**6)] == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6]
    levels = [reuse_level(uses) for uses in range(64)]
    assert levels == sorted(levels) and set(levels) == set(range(len(REUSE_LEVELS)))
    classes = {block_class(uses, kind) for uses in range(64) for kind in (LEAF, PARENT, TIP)}
    assert classes == set(range(3 * len(REUSE_LEVELS)))


@given(hits=st.integers(min_value=0, max_value=40))
def test_a_block_hit_k_times_is_in_the_class_of_k_uses(hits):
    """Every hit moves a block to the class of its new count, past the fourth level too."""
    policy = HitDensityPolicy()
    policy.on_insert(0, 100, None)
    policy.on_insert(1, 200, None)  # 0 is a leaf now
    for _ in range(hits):
        policy.on_access(0)
    assert policy.class_of(0) == block_class(hits, LEAF)
    assert 0 in policy.class_blocks(block_class(hits, LEAF))
    policy.check_invariants()


def test_under_stable_popularity_a_block_hit_16_times_outranks_one_hit_4_times():
    """On a Zipf stream of one-block prompts the model learns that the 16+ level comes back sooner
    than the 4-7 level at the same age: how often a block was wanted ranks it past its third use."""
    rng = np.random.default_rng(0)
    popularity = 1 / np.arange(1, 401)
    stream = rng.choice(400, size=20_000, p=popularity / popularity.sum())
    requests = [TraceRequest(timestamp_ms=i, input_length=16, output_length=1, hash_ids=(int(h),), line=i + 1)
                for i, h in enumerate(stream)]
    policy = HitDensityPolicy(capacity=50)
    replay(requests, 50, policy)
    for age in (10, 50):
        assert policy.model.density(block_class(16, LEAF), age) > 2 * policy.model.density(block_class(4, LEAF), age)


def test_the_block_stored_last_is_the_tip_until_the_next_store_shows_its_kind():
    """The last stored block is a tip; a store that continues it makes it a parent, any other a leaf."""
    policy = HitDensityPolicy()
    policy.on_insert(0, 100, None)
    policy.on_insert(1, 101, 100)  # continues 0
    assert (policy.class_of(0), policy.class_of(1)) == (block_class(0, PARENT), block_class(0, TIP))
    policy.on_access(1)  # a hit keeps the kind
    assert policy.class_of(1) == block_class(1, TIP)
    policy.on_insert(2, 200, None)  # another prompt: 1 was that prompt's end
    assert (policy.class_of(1), policy.class_of(2)) == (block_class(1, LEAF), block_class(0, TIP))
    policy.on_remove(2)  # an evicted tip leaves no tip behind
    policy.on_insert(3, 300, None)
    assert policy.class_of(3) == block_class(0, TIP)
    policy.check_invariants()


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"capacity": 2.5}, {"ghost_span": 0.5},
                                    {"ghost_span": float("inf")}, {"ghost_span": "8"},
                                    {"shift_alpha": 1.0}, {"shift_alpha": -0.01}])
def test_bad_hit_density_settings_are_config_errors(kwargs):
    """Bad constructor values raise ConfigError quoting the value."""
    with pytest.raises(ConfigError, match=repr(next(iter(kwargs.values())))):
        HitDensityPolicy(**kwargs)


@pytest.mark.parametrize("make", POLICIES)
def test_misuse_raises_pool_usage_error(make):
    """Double inserts, a second block under a tracked hash and unknown blocks are usage errors."""
    policy = make()
    policy.on_insert(0, 100, None)
    with pytest.raises(PoolUsageError, match="already tracked"):
        policy.on_insert(0, 101, None)
    with pytest.raises(PoolUsageError, match="already tracked"):
        policy.on_insert(1, 100, None)
    with pytest.raises(PoolUsageError, match="not tracked"):
        policy.on_access(7)
    with pytest.raises(PoolUsageError, match="not tracked"):
        policy.on_remove(7)
    with pytest.raises(PoolUsageError, match="n=-1: must be an int >= 0"):
        policy.select_victims(-1, lambda b: True)
    policy.check_invariants()


def test_a_selection_walks_each_candidate_once():
    """``select_victims(n)`` asks ``is_evictable`` O(n + skipped) times, not once per block per round.

    Before the per-stream cursors, each round rescanned every class list end past
    the blocks already chosen: n * (n - 1) / 2 calls here.
    """
    n = 3000
    policy = HitDensityPolicy(capacity=n)
    for b in range(n):
        policy.on_insert(b, 10_000 + b, None)
    asked = 0

    def evictable(block: int) -> bool:
        nonlocal asked
        asked += 1
        return block % 3 != 0  # every third block is skipped

    victims = policy.select_victims(n // 2, evictable)
    assert victims is not None and len(set(victims)) == n // 2 and all(v % 3 for v in victims)
    assert asked <= 3 * n, asked  # each block asked about a bounded number of times
    policy.check_invariants()


# -- resumed walks -------------------------------------------------------------


class _Tier:
    """A pool's view for the walk tests: few block ids, reused as soon as freed, and free-form chains.

    A hash may come back under any parent (cycles included), blocks are
    pinned (through the hooks with ``hooks``) and refused by the predicate
    without the policy hearing of it, and selections are carried out or not.
    """

    IDS = 24

    def __init__(self, policy: EvictionPolicy, hooks: bool) -> None:
        self.policy, self.hooks = policy, hooks
        self.hash_of: dict[int, int] = {}  # tracked block -> hash
        self.pinned: set[int] = set()
        self.refused: set[int] = set()

    def ask(self, block: int) -> bool:
        assert not (self.hooks and block in self.pinned), f"asked about parked block {block}"
        return block in self.hash_of and block not in self.pinned and block not in self.refused

    def insert(self, h: int, parent: int | None) -> None:
        free = [b for b in range(self.IDS) if b not in self.hash_of]
        if free and h not in self.hash_of.values():
            self.policy.on_insert(free[0], h, parent)  # the lowest free id: a victim's, often
            self.hash_of[free[0]] = h

    def remove(self, block: int) -> None:
        self.policy.on_remove(block)
        del self.hash_of[block]
        self.refused.discard(block)

    def select(self, n: int, carry_out: bool) -> None:
        """Select ``n`` and check the victims against a copy of the policy that walks afresh (and, for hit
        density, computes every list end's key afresh)."""
        fresh = copy.deepcopy(self.policy)
        fresh._chains._walk = None
        if isinstance(fresh, HitDensityPolicy):
            fresh._dirty.update(range(len(fresh._keys)))
        expected = fresh.select_victims(n, self.ask)
        victims = self.policy.select_victims(n, self.ask)
        assert victims == expected, f"resumed walk chose {victims}, a fresh one {expected}"
        if carry_out and victims is not None:
            for v in sorted(victims):  # as the pool removes them
                self.remove(v)


walk_ops = st.lists(st.one_of(
    st.tuples(st.just("chain"), st.sampled_from(["root", "under", "any"]), st.integers(0, 39),
              st.lists(st.integers(0, 39), min_size=1, max_size=8)),
    st.tuples(st.sampled_from(["access", "pin", "unpin", "remove", "refuse", "allow"]), st.integers(0, 23)),
    st.tuples(st.just("select"), st.integers(1, 3), st.booleans()),
), max_size=50)


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("make", POLICIES)
@given(script=walk_ops)
# One per reason to walk afresh: a skipped block turned evictable, or was unpinned; the last victims
# were not removed; a block the walk passed got a child (under a reused id) or was removed; a
# victim's reused id comes back in the part of the tree not walked yet.
@example(script=[("chain", "root", 0, [0, 1]), ("chain", "under", 0, [2, 3]), ("refuse", 1),
                 ("select", 1, True), ("allow", 1), ("select", 1, True)])
@example(script=[("chain", "root", 0, [0, 1]), ("chain", "under", 0, [2, 3]), ("pin", 1),
                 ("select", 1, True), ("unpin", 0), ("select", 1, True)])
@example(script=[("chain", "root", 0, [0, 1]), ("select", 1, False), ("select", 1, True)])
@example(script=[("chain", "root", 0, [0, 1, 2]), ("select", 1, True), ("chain", "under", 1, [5]),
                 ("select", 1, True)])
@example(script=[("chain", "root", 0, [0, 1, 2, 3]), ("chain", "under", 2, [4]), ("select", 1, True),
                 ("remove", 1), ("refuse", 1), ("select", 1, True)])
@example(script=[("chain", "root", 0, [0, 1, 2]), ("chain", "under", 0, [3, 4]), ("select", 1, True),
                 ("chain", "under", 3, [5]), ("select", 2, True)])
@example(script=[("chain", "root", 0, [3, 4]), ("chain", "any", 1, [1, 2, 0]), ("remove", 12)])  # hash 1 under 1
# A hash stored under itself as its parent, then evicted: it was never an orphan.
@example(script=[("chain", "root", 0, [0]), ("chain", "any", 1, [1, 0, 2, 3]), ("select", 1, True)])
def test_a_resumed_walk_chooses_what_a_fresh_walk_would(make, hooks, script):
    """Every selection, resuming the last walk or not, equals that of a copy whose walk starts afresh."""
    tier = _Tier(make(), hooks)
    _play(tier, script, tier.select)


def _play(tier: _Tier, script: list[tuple], select: Callable[[int, bool], None]) -> None:
    """Run a ``walk_ops`` script on ``tier``; ``select(n, carry_out)`` makes (and checks) each selection."""
    for op, *args in script:
        tracked = sorted(tier.hash_of)
        if op == "chain":  # a head, under a tracked block, or under any hash (a hash may change parent)
            kind, pick, hashes = args
            parent = (None if kind == "root" or not tracked else pick if kind == "any"
                      else tier.hash_of[tracked[pick % len(tracked)]])
            for h in hashes:
                tier.insert(h, parent)
                parent = h
        elif op == "select":
            select(*args)
        elif tracked:
            block = tracked[args[0] % len(tracked)]
            if op == "refuse":
                tier.refused.add(block)
            elif op == "allow" and tier.refused:
                tier.refused.remove(sorted(tier.refused)[args[0] % len(tier.refused)])
            elif op == "access":
                tier.policy.on_access(block)
            elif op == "pin" and block not in tier.pinned:
                if tier.hooks:
                    tier.policy.on_pin(block)
                tier.pinned.add(block)
            elif op == "unpin" and tier.pinned:
                block = sorted(tier.pinned)[args[0] % len(tier.pinned)]
                if tier.hooks:
                    tier.policy.on_unpin(block)
                tier.pinned.remove(block)
            elif op == "remove" and block not in tier.pinned:  # as a reset would, or a dropped store
                tier.remove(block)
        tier.policy.check_invariants()


def _selection_by_definition(policy: HitDensityPolicy, n: int, ask: Callable[[int], bool]) -> list[int] | None:
    """Hit density's ``select_victims(n)`` as its docstring defines it, read afresh from the policy's state.

    Rounds until ``n`` are chosen: the root is the first usable (not chosen, not parked, evictable)
    orphan in the order the blocks became orphans, else, of the first usable block from either end
    of every class list, the one of least (density, last access, block, stream); its subtree is
    walked depth first, children in link order, never below a chosen block nor into the root again,
    each block chosen after its descendants if it is usable and fewer than ``n`` are chosen.
    """
    chains, parked = policy._chains, set(policy.pinned)
    chosen: dict[int, None] = {}

    def usable(block: int) -> bool:
        return block not in chosen and block not in parked and ask(block)

    def visit(block: int, root: int) -> None:
        for child in chains.children(BlockId(block)):
            if child != root and child not in chosen:
                visit(child, root)
        if len(chosen) < n and usable(block):
            chosen[block] = None

    orphans = [b for b in chains._orphans.in_order() if b not in chains._orphans.pinned]
    while len(chosen) < n:
        root = next((b for b in orphans if usable(b)), None)
        if root is None:
            heads = []
            for cls in range(3 * len(REUSE_LEVELS)):
                blocks = policy.class_blocks(cls)
                for stream, end in ((2 * cls, blocks), (2 * cls + 1, blocks[::-1])):
                    head = next((b for b in end if usable(b)), None)
                    if head is not None:
                        heads.append((policy.density_of(head), policy._last[head], head, stream))
            if not heads:
                return None
            root = min(heads)[2]
        visit(root, root)
    return list(chosen)


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("make", HIT_DENSITY)
@given(script=st.lists(st.one_of(
    st.tuples(st.just("chain"), st.sampled_from(["root", "under", "any"]), st.integers(0, 39),
              st.lists(st.integers(0, 39), min_size=1, max_size=8)),
    st.tuples(st.sampled_from(["access", "pin", "unpin", "remove", "refuse", "allow"]), st.integers(0, 23)),
    st.tuples(st.just("select"), st.integers(1, 12), st.booleans()),
), max_size=80))
@settings(max_examples=300)
# A run along a stream ends at the rival's key, ties in density broken by last access (before any refresh).
@example(script=[("chain", "root", 0, [1, 2, 5]), ("access", 1), ("chain", "root", 0, [0]), ("refuse", 0),
                 ("chain", "root", 0, [3]), ("chain", "root", 0, [4]), ("select", 2, False)])
def test_a_selection_chooses_what_its_definition_chooses(make, hooks, script):
    """Every hit-density selection (runs along a stream below the rival key, walks listed in one pass,
    resumed walks) chooses the victims of :func:`_selection_by_definition`, in its order."""
    tier = _Tier(make(), hooks)

    def select(n: int, carry_out: bool) -> None:
        expected = _selection_by_definition(tier.policy, n, tier.ask)
        victims = tier.policy.select_victims(n, tier.ask)
        assert victims == expected, f"chose {victims}, the definition chooses {expected}"
        if carry_out and victims is not None:
            for v in sorted(victims):  # as the pool removes them
                tier.remove(v)

    _play(tier, script, select)


class _CountedHash(int):
    """A block hash that counts the dict lookups made with it."""

    lookups = 0

    def __hash__(self) -> int:
        _CountedHash.lookups += 1
        return int.__hash__(self)


@pytest.mark.parametrize("make", [PrefixLRUPolicy, HitDensityPolicy])
def test_evicting_a_chain_a_victim_at_a_time_walks_it_once(make):
    """Evicting a 2,048-block chain one victim per selection looks up O(chain) hashes, not O(chain^2).

    Before selections resumed their walk, each one walked from the head to
    the deepest block left: about 2,048^2 / 2 lookups here.
    """
    n = 2048
    policy = make()
    parent = None
    for b in range(n):
        policy.on_insert(b, _CountedHash(10_000 + b), parent)
        parent = _CountedHash(10_000 + b)
    _CountedHash.lookups = 0
    for b in reversed(range(n)):
        assert policy.select_victims(1, lambda block: True) == [b]
        policy.on_remove(b)
    assert _CountedHash.lookups <= 20 * n, _CountedHash.lookups
    policy.check_invariants()


def test_census_reads_every_live_entry_or_an_unbiased_stride():
    """A census read returns all live entries up to its limit, else a strided sample weighted to their number."""
    from kvkit.backends.eviction.hit_density.census import strided

    live = bytearray([c % 2 for c in range(1000)])  # entries 1, 3, 5, ... live
    entries, weight = strided(live, 1, 10_000)
    assert (entries.tolist(), weight) == (list(range(1, 1000, 2)), 1.0)
    seen = set()
    for turn in range(8):  # successive samples start at successive offsets: no fixed aliasing
        entries, weight = strided(live, turn, 64)
        assert len(entries) <= 64 and len(entries) * weight == pytest.approx(500)
        seen |= {e % 4 for e in entries.tolist()}
    assert seen == {1, 3}
    assert strided(bytearray(8), 3, 4)[0].tolist() == []


def test_a_refresh_past_the_census_limit_estimates_the_same_table(monkeypatch):
    """Sampled censoring (past the census limit) gives the exact densities on a stationary stream, within noise."""
    import kvkit.backends.eviction.hit_density as hd

    requests = [TraceRequest(i, 16, 1, (i % 97 + 1, ), i + 1) for i in range(6000)]
    exact = HitDensityPolicy(capacity=40)
    replay(requests, 40, exact)
    monkeypatch.setattr(hd, "_CENSUS_LIMIT", 16)
    sampled = HitDensityPolicy(capacity=40)
    replay(requests, 40, sampled, check_invariants=True)
    a, b = exact.model.table, sampled.model.table
    assert a is not None and b is not None and np.isfinite(b).all()
    assert np.abs(a - b).max() <= 0.25 * a.max()
