"""The watched window of FIFO and LRU (the next victims, tracked incrementally) against a model."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvkit.backends.eviction._queue import ParkingQueue
from kvkit.backends.eviction.fifo import FIFOPolicy
from kvkit.backends.eviction.lru import LRUPolicy

_PICK = st.integers(0, 63)


class WindowMachine(RuleBasedStateMachine):
    """Drives a policy through its pin hooks and checks its window against an OrderedDict model.

    The model is the policy's order (insertion, or last use for LRU) and the
    set of pinned blocks; the window must be the first ``n`` unpinned blocks
    of that order, and every block that joined it since the last look must be
    reported by ``entered()``.
    """

    lru = False
    max_blocks = 14

    def __init__(self) -> None:
        super().__init__()
        self.policy = LRUPolicy() if self.lru else FIFOPolicy()
        self.order: OrderedDict[int, None] = OrderedDict()
        self.pinned: set[int] = set()
        self.size = 0
        self.seen: set[int] = set()  # the window at the last look

    def expected(self) -> list[int]:
        return [b for b in self.order if b not in self.pinned][:self.size]

    @precondition(lambda self: len(self.order) < self.max_blocks)
    @rule(block=_PICK, pinned=st.booleans())
    def insert(self, block: int, pinned: bool) -> None:
        block = next(b for b in ((block + i) % 64 for i in range(64)) if b not in self.order)
        self.policy.on_insert(block, 1000 + block, None)
        self.order[block] = None
        if pinned:
            self.policy.on_pin(block)
            self.pinned.add(block)

    @precondition(lambda self: self.order)
    @rule(pick=_PICK)
    def access(self, pick: int) -> None:
        block = sorted(self.order)[pick % len(self.order)]
        self.policy.on_access(block)
        if self.lru:
            self.order.move_to_end(block)

    @precondition(lambda self: len(self.pinned) < len(self.order))
    @rule(pick=_PICK)
    def pin(self, pick: int) -> None:
        block = sorted(self.order.keys() - self.pinned)[pick % (len(self.order) - len(self.pinned))]
        self.policy.on_pin(block)
        self.pinned.add(block)

    @precondition(lambda self: self.pinned)
    @rule(pick=_PICK)
    def unpin(self, pick: int) -> None:
        block = sorted(self.pinned)[pick % len(self.pinned)]
        self.policy.on_unpin(block)
        self.pinned.discard(block)

    @precondition(lambda self: self.order)
    @rule(pick=_PICK)
    def remove(self, pick: int) -> None:
        block = sorted(self.order)[pick % len(self.order)]
        self.policy.on_remove(block)
        del self.order[block]
        self.pinned.discard(block)

    @rule(k=st.integers(1, 3))
    def evict(self, k: int) -> None:
        """Select and remove victims as a pool does (a walk parks the pinned blocks it meets)."""
        victims = self.policy.select_victims(k, lambda b: b not in self.pinned)
        expected = [b for b in self.order if b not in self.pinned][:k]
        assert victims == (expected if len(expected) == k else None)
        for b in victims or ():
            self.policy.on_remove(b)
            del self.order[b]

    @rule(size=st.integers(0, 8))
    def watch(self, size: int) -> None:
        self.policy.watch(size)
        self.size = size

    @rule()
    def look(self) -> None:
        """``entered()`` reports exactly the window's blocks that were not in it at the last look."""
        entered = self.policy.entered()
        window = set(self.expected())
        assert set(entered) <= window, f"entered {entered} outside the window {sorted(window)}"
        missing = window - self.seen - set(entered)
        assert not missing, f"blocks {sorted(missing)} joined the window unreported"
        assert len(entered) == len(set(entered)), f"entered repeats a block: {entered}"
        self.seen = window

    @invariant()
    def window_is_the_next_victims(self) -> None:
        self.policy.check_invariants()
        window = [b for b in self.order if self.policy.in_window(b)]
        assert window == self.expected(), f"window {window}, next victims {self.expected()}"


class LRUWindowMachine(WindowMachine):
    lru = True


TestFIFOWindow = WindowMachine.TestCase
TestLRUWindow = LRUWindowMachine.TestCase


def test_a_pinned_block_is_met_by_one_walk_at_most():
    """After one selection walked past them, pinned blocks at the old end cost the next selection nothing."""
    policy = FIFOPolicy()
    for b in range(1000):
        policy.on_insert(b, b, None)
        if b < 990:
            policy.on_pin(b)
    calls = []

    def counting(block: int) -> bool:
        calls.append(block)
        return True

    assert policy.select_victims(2, counting) == [990, 991]
    assert len(calls) <= 2 + 2  # the victims (plus the pool's own re-check, at most)
    calls.clear()
    assert policy.select_victims(5, counting) == [990, 991, 992, 993, 994]
    assert len(calls) == 5
    policy.on_unpin(3)
    assert policy.select_victims(2, counting) == [3, 990]  # released where it entered
    policy.check_invariants()


def test_a_broken_window_count_is_caught():
    """check_invariants notices a window that holds fewer blocks than it claims (a planted bug)."""
    queue = ParkingQueue()
    for b in range(4):
        queue.add(b)
    queue.watch(2)
    queue._count += 1
    with pytest.raises(AssertionError, match="window counts 3, holds 2"):
        queue.check_invariants()


class _ForgetsToGrow(FIFOPolicy):
    """A planted bug: releasing a pinned block beyond the window never refills a short window."""

    def on_unpin(self, block):
        size, self._size = self._size, 0
        try:
            super().on_unpin(block)
        finally:
            self._size = size


def test_the_model_catches_a_window_left_short():
    """The window machine fails a policy whose window misses a block that became evictable."""

    class Broken(WindowMachine):
        def __init__(self):
            super().__init__()
            self.policy = _ForgetsToGrow()

        def window_is_the_next_victims(self):  # the model comparison alone must find it
            window = [b for b in self.order if self.policy.in_window(b)]
            assert window == self.expected(), f"window {window}, next victims {self.expected()}"

    hunt = settings(max_examples=300, stateful_step_count=30, deadline=None, database=None,
                    derandomize=True, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    with pytest.raises(AssertionError, match=r"window|joined the window unreported"):
        run_state_machine_as_test(Broken, settings=hunt)


def _every_policy():
    from kvkit.backends.eviction.arc import ARCPolicy
    from kvkit.backends.eviction.hit_density import HitDensityPolicy
    from kvkit.backends.eviction.lfu import LFUPolicy
    from kvkit.backends.eviction.lirs import LIRSPolicy
    from kvkit.backends.eviction.opt import OptimalPolicy
    from kvkit.backends.eviction.prefix_lru import PrefixLRUPolicy
    from kvkit.backends.eviction.s3fifo import S3FIFOPolicy

    return [FIFOPolicy, LRUPolicy, LFUPolicy, ARCPolicy, S3FIFOPolicy, LIRSPolicy, PrefixLRUPolicy, HitDensityPolicy,
            lambda: OptimalPolicy([])]


@pytest.mark.parametrize("make", _every_policy())
def test_no_policy_scans_the_blocks_in_use(make):
    """With 990 of 1,000 blocks in use (oldest first), a selection asks about O(victims) blocks, not 990.

    Driven as a pool drives it (every pin reported); before the pin hooks, LRU, FIFO, LFU, ARC and the
    optimum asked about every block in use on every selection.
    """
    from kvkit.interfaces.capabilities import pin_hooks

    policy = make()
    pinned = set(range(990))
    asked = []

    def is_evictable(block):
        asked.append(block)
        return block not in pinned

    hooks = pin_hooks(policy) is not None
    for b in range(1000):
        policy.on_insert(b, 10_000 + b, None)
        if b in pinned and hooks:
            policy.on_pin(b)
    for _ in range(3):
        asked.clear()
        victims = policy.select_victims(2, is_evictable)
        assert victims is not None and not pinned & set(victims)
    assert len(asked) <= 10, f"{type(policy).__name__} asked about {len(asked)} blocks for 2 victims"
    policy.check_invariants()
