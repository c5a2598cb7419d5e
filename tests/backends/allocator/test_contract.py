"""BlockPool passes the allocator contract, and the contract catches broken allocators."""

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

from kvkit.backends.allocator import BlockPool
from kvkit.backends.eviction.lfu import LFUPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.eviction.s3fifo import S3FIFOPolicy
from kvkit.errors import PoolUsageError
from kvkit.testing import AllocatorContract


class BlockPoolContract(AllocatorContract):
    def make_allocator(self, num_blocks):
        return BlockPool(num_blocks, eviction=LRUPolicy())


TestBlockPool = BlockPoolContract.TestCase


class PinnedBlockPoolContract(AllocatorContract):
    """The pool with S3-FIFO, which sets pinned blocks aside: its pins must mirror the refcounts."""

    def make_allocator(self, num_blocks):
        return BlockPool(num_blocks, eviction=S3FIFOPolicy())

    @invariant()
    def policy_pins_exactly_the_referenced_ready_blocks(self):
        """The pool called on_pin and on_unpin at exactly the refcount transitions."""
        if self.pool is None:
            return
        pool = self.pool
        held = {b for b in range(self.num_blocks) if pool.refcount(b) and pool.is_ready(b)}
        pinned = set(pool.policy.pinned)
        assert pinned == held, \
            f"policy holds {sorted(pinned)} pinned, referenced ready: {sorted(held)}"


TestPinnedBlockPool = PinnedBlockPoolContract.TestCase


# -- deliberately broken allocators: each must fail the contract ---------------------------
# Their own check_invariants is switched off, so the model comparison alone must find the bug.


class FreesLiveBlock(BlockPool):
    """Returns a not-ready block to the empty stack when its refcount drops to 1, not 0."""

    def decref(self, blocks):
        super().decref(blocks)
        for b in set(blocks):
            if self.refcount(b) == 1 and not self.is_ready(b) and b not in self._empty:
                self._empty.append(b)

    def check_invariants(self):
        pass


class KeepsEvictedInIndex(BlockPool):
    """Puts every evicted block back into the prefix index (stale hits)."""

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        self.add_evict_listener(lambda blocks, hashes: self._index.update(zip(hashes, blocks)))

    def check_invariants(self):
        pass


class PartialAllocate(BlockPool):
    """Takes the empty blocks it can before failing an allocation that is too large."""

    def allocate(self, n):
        if n.__class__ is int and n > self.num_free:
            super().allocate(self.num_empty)
        return super().allocate(n)

    def check_invariants(self):
        pass


class SkipsPinOnCommit(BlockPool):
    """Commits without telling the policy that the committed blocks are in use."""

    def commit(self, blocks, hashes, parents=None):
        hook, self._on_pin = self._on_pin, None
        try:
            return super().commit(blocks, hashes, parents)
        finally:
            self._on_pin = hook

    def check_invariants(self):
        pass


class HearsEachEviction(BlockPool):
    """Calls its evict listeners once per evicted block instead of once per allocation."""

    def add_evict_listener(self, listener):
        super().add_evict_listener(
            lambda blocks, hashes: [listener([block], [block_hash]) for block, block_hash in zip(blocks, hashes)])

    def check_invariants(self):
        pass


FIND_BUGS = settings(
    max_examples=500, stateful_step_count=30, deadline=None, database=None, derandomize=True,
    phases=[Phase.generate], suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
)


def contract_for(pool_class):
    class Contract(AllocatorContract):
        def make_allocator(self, num_blocks):
            return pool_class(num_blocks, eviction=LRUPolicy())

    return Contract


@pytest.mark.parametrize(("pool_class", "symptom"), [
    (FreesLiveBlock, r"num_free|handed out block"),
    (KeepsEvictedInIndex, r"index: lookup|lookup\(|commit\("),
    (PartialAllocate, r"raised but changed the allocator"),
    (HearsEachEviction, r"called the evict listener with .*: at most once"),
])
def test_contract_catches_broken_allocator(pool_class, symptom):
    """Each deliberately broken allocator fails the contract with the matching symptom."""
    with pytest.raises(AssertionError, match=symptom):
        run_state_machine_as_test(contract_for(pool_class), settings=FIND_BUGS)


def test_contract_needs_make_allocator():
    """The bare contract refuses to run without an allocator factory."""
    with pytest.raises(NotImplementedError, match="make_allocator"):
        run_state_machine_as_test(AllocatorContract, settings=FIND_BUGS)


def test_contract_catches_a_pool_that_skips_a_pin():
    """A pool that forgets on_pin after commit puts the policy's pins out of step with refcounts."""

    class Contract(PinnedBlockPoolContract):
        def make_allocator(self, num_blocks):
            return SkipsPinOnCommit(num_blocks, eviction=S3FIFOPolicy())

    # Either the invariant sees it, or S3-FIFO refuses the unpin of a block it never saw pinned.
    symptom = "pinned, referenced ready|not pinned"
    with pytest.raises((AssertionError, PoolUsageError), match=symptom):
        run_state_machine_as_test(Contract, settings=FIND_BUGS)


class LRUBlockPoolContract(BlockPoolContract):
    """The pool with LRU, which hears every pin and sets the blocks in use aside at once."""

    @invariant()
    def pins_are_the_referenced_ready_blocks(self):
        """The blocks LRU holds pinned are exactly the referenced ready ones."""
        if self.pool is None:
            return
        pool = self.pool
        held = {b for b in range(self.num_blocks) if pool.refcount(b) and pool.is_ready(b)}
        assert pool.policy.pinned == held, f"LRU holds {sorted(pool.policy.pinned)} pinned, held: {held}"


TestLRUBlockPool = LRUBlockPoolContract.TestCase


def _windowed(contract):
    """``contract`` plus a rule that follows the pool's eviction window and checks it against the candidates."""

    class Windowed(contract):
        window_n = None
        window = frozenset()

        @rule(data=st.data())
        def follow_window(self, data):
            """eviction_window reports exactly the candidates that joined since the previous call."""
            if self.pool is None:
                return
            n = data.draw(st.integers(0, self.num_blocks), label="window n") \
                if self.window_n is None or data.draw(st.booleans(), label="resize") else self.window_n
            entered = self.pool.eviction_window(n)
            current = set(self.pool.eviction_candidates(n))
            previous = self.window if n == self.window_n else frozenset()
            assert set(entered) <= current, f"eviction_window({n}) = {entered}, candidates {current}"
            assert current <= previous | set(entered), (
                f"candidates {sorted(current)} joined unreported: previous {sorted(previous)}, "
                f"entered {entered}")
            for b in range(self.num_blocks):
                assert self.pool.in_eviction_window(b) == (b in current), f"in_eviction_window({b})"
            self.window_n, self.window = n, frozenset(current)

    Windowed.__name__ = f"Windowed{contract.__name__}"
    return Windowed


TestWindowedLRUPool = _windowed(LRUBlockPoolContract).TestCase  # LRU tracks the window itself


class _LFUPoolContract(AllocatorContract):
    def make_allocator(self, num_blocks):
        return BlockPool(num_blocks, eviction=LFUPolicy())


TestWindowedLFUPool = _windowed(_LFUPoolContract).TestCase  # the pool's fallback: candidates again, diffed
