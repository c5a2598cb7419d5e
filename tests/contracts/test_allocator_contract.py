"""BlockPool passes the allocator contract, and the contract catches broken allocators."""

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvkit.backends.allocator import BlockPool
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.testing import AllocatorContract


class BlockPoolContract(AllocatorContract):
    def make_allocator(self, num_blocks):
        return BlockPool(num_blocks, eviction=LRUPolicy())


TestBlockPool = BlockPoolContract.TestCase


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
        self.add_evict_listener(lambda block, block_hash: self._index.update({block_hash: block}))

    def check_invariants(self):
        pass


class PartialAllocate(BlockPool):
    """Takes the empty blocks it can before failing an allocation that is too large."""

    def allocate(self, n):
        if n > self.num_free:
            super().allocate(self.num_empty)
        return super().allocate(n)

    def check_invariants(self):
        pass


FIND_BUGS = settings(
    max_examples=500, stateful_step_count=30, deadline=None, database=None, derandomize=True,
    phases=[Phase.generate], suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
)


def contract_for(pool_class):
    class Contract(AllocatorContract):
        def make_allocator(self, num_blocks):
            return pool_class(num_blocks)

    return Contract


@pytest.mark.parametrize(("pool_class", "symptom"), [
    (FreesLiveBlock, r"num_free|handed out block"),
    (KeepsEvictedInIndex, r"index: lookup|lookup\(|commit\("),
    (PartialAllocate, r"raised but changed the allocator"),
])
def test_contract_catches_broken_allocator(pool_class, symptom):
    """Each deliberately broken allocator fails the contract with the matching symptom."""
    with pytest.raises(AssertionError, match=symptom):
        run_state_machine_as_test(contract_for(pool_class), settings=FIND_BUGS)


def test_contract_needs_make_allocator():
    """The bare contract refuses to run without an allocator factory."""
    with pytest.raises(NotImplementedError, match="make_allocator"):
        run_state_machine_as_test(AllocatorContract, settings=FIND_BUGS)
