"""No selection scans the blocks in use: an evicting ``allocate`` costs O(victims), its first call included.

The cost counted is *work*: the Python lines the pool and its policy execute
during the call (a sys.settrace hook; a block a selection inspects costs at
least one), never wall time; the compiled loops run their Python references
here (``python_loops``), whose work the hook sees. Blocks in use come in four kinds, mixed: held
since their commit, orphans (their parent hash is not cached), chains whose
root is an orphan, and chains released and pinned again (loads).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkit import ALLOCATOR, EVICTION

CHAIN = 16
KINDS = ("held", "orphans", "orphan-root", "pinned-again")
_ROOTS = tuple(str(Path(p).resolve()) for p in (Path(__file__).parents[3] / "backends",
                                                 Path(__file__).parents[3] / "kvkit"))
pytestmark = pytest.mark.usefixtures("python_loops")
_POLICIES = ("lru", "fifo", "lfu", "arc", "s3fifo", "lirs", "prefix-lru", "hit-density", "adaptive", "hinted", "opt")


def make_policy(name: str):
    if name == "opt":
        return EVICTION.create("opt", references=())
    return EVICTION.create(name)


def build(policy: str, num_blocks: int, referenced: int, kinds: tuple[str, ...] = KINDS):
    """A full pool: the oldest ``referenced`` blocks in use (chains of 16, the kinds in turn), the rest evictable."""
    pool = ALLOCATOR.create("pool", num_blocks=num_blocks, eviction=make_policy(policy))
    blocks = pool.allocate(num_blocks)
    hashes, parents, kind_of = [], [], []
    for i in range(num_blocks):
        kind = kinds[(i // CHAIN) % len(kinds)] if i < referenced else "free"
        hashes.append(i + 1)
        untracked = 10**12 + i
        if kind == "orphans":
            parents.append(untracked)
        elif i % CHAIN == 0:
            parents.append(untracked if kind == "orphan-root" else None)
        else:
            parents.append(hashes[i - 1])
        kind_of.append(kind)
    pool.commit(blocks, hashes, parents)
    pool.decref([b for b, kind in zip(blocks, kind_of) if kind in ("free", "pinned-again")])
    pool.incref([b for b, kind in zip(blocks, kind_of) if kind == "pinned-again"])
    return pool


class _Work:
    """A trace hook counting the lines executed in kvkit's pool and policy code."""

    def __init__(self) -> None:
        self.lines = 0

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename.startswith(_ROOTS):
            self.lines += event == "line"
            return self
        return None


def work_of_allocate(pool, n: int = 1) -> int:
    work = _Work()
    previous = sys.gettrace()
    sys.settrace(work)
    try:
        pool.allocate(n)
    finally:
        sys.settrace(previous)
    return work.lines


@pytest.mark.slow
@pytest.mark.parametrize("policy", _POLICIES)
def test_an_evicting_allocate_on_a_pool_90_percent_in_use_costs_at_most_3x_a_small_one(policy):
    """100,000 blocks with 90,000 in use against 2,000 with 1,000: each of the first three evicting calls <= 3x."""
    small, large = build(policy, 2_000, 1_000), build(policy, 100_000, 90_000)
    for call in range(3):
        w_small, w_large = work_of_allocate(small), work_of_allocate(large)
        assert w_large <= 3 * w_small, f"{policy}: evicting call {call + 1} did {w_large} lines against {w_small}"
    large.check_invariants()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(_POLICIES), free_chains=st.integers(2, 12),
       kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=4, unique=True), victims=st.integers(1, 8))
def test_the_work_of_a_selection_does_not_grow_with_the_blocks_in_use(policy, free_chains, kinds, victims):
    """The same evictable blocks behind 32 or 1,024 blocks in use: the evicting call does about the same work.

    A selection that looked at each block in use would do at least a line per
    block, 992 more; the bound leaves room for what does not scale (the
    victims' own chains, the policy's class heads).
    """
    kinds = tuple(kinds)
    few = build(policy, 32 + free_chains * CHAIN, 32, kinds)
    many = build(policy, 1024 + free_chains * CHAIN, 1024, kinds)
    w_few, w_many = work_of_allocate(few, victims), work_of_allocate(many, victims)
    assert w_many <= 2 * w_few + 64, f"{policy} {kinds}: {w_many} lines with 1,024 blocks in use, {w_few} with 32"
    many.check_invariants()


def test_the_pools_here_run_the_python_loops():
    """The work counted is the Python references': no loop of the pools built here runs compiled."""
    from kvkit.backends.eviction import _chains, _queue
    from kvkit.backends.eviction.hit_density import booking, census, kernels, selection

    pool = build("hit-density", 64, 16)
    policy = pool.policy
    assert pool._loops is None
    assert policy._booking is booking.LOOPS.reference
    assert policy._selection is selection.LOOPS.reference
    assert policy._census is census.LOOPS.reference
    assert policy.model._loops is kernels.LOOPS.reference
    assert policy._chains._orphans._loops is _queue.LOOPS.reference
    assert build("lru", 64, 16).policy._loops is _queue.LOOPS.reference  # LRU is a parking queue
    assert policy._chains._loops is _chains.LOOPS.reference
