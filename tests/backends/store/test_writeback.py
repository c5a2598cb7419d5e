"""Lazy write-back examines only what changed, and still keeps every next GPU eviction candidate stored."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvkit.backends.allocator import BlockPool
from kvkit.backends.eviction.lfu import LFUPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.store import LazyStore
from kvkit.interfaces import KVCacheSpec, TransferResult
from kvkit.manager import OffloadManager

SPEC = KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=1, head_dim=2)


class CountingPool(BlockPool):
    """A pool that counts how often the whole candidate list is taken (the O(window) path)."""

    full_takes = 0

    def eviction_candidates(self, n):
        type(self).full_takes += 1
        return super().eviction_candidates(n)


def lazy_manager(gpu_blocks=16, cpu_blocks=64, watermark=0.5, gpu_policy=LRUPolicy, pool=BlockPool):
    gpu = pool(gpu_blocks, eviction=gpu_policy())
    cpu = BlockPool(cpu_blocks, eviction=LRUPolicy())
    return OffloadManager(SPEC, cpu, LazyStore(watermark=watermark), gpu=gpu)


def cache(gpu, hashes):
    """Commit fresh GPU blocks under ``hashes`` and release them: cached, evictable (as after a request)."""
    blocks = gpu.allocate(len(hashes))
    gpu.commit(blocks, hashes)
    gpu.decref(blocks)
    return blocks


def settle(mgr, plan, ok=True):
    return mgr.apply_completions([TransferResult(tid, ok=ok) for tid, _ in plan])


def stored_blocks(plan):
    return [b for _, p in plan.stores for b in p.src.tolist()]


def test_an_idle_step_takes_nothing_again():
    """Once the window is stored, build_step neither walks the candidates nor plans a store."""
    CountingPool.full_takes = 0
    mgr = lazy_manager(pool=CountingPool)
    cache(mgr.gpu, list(range(100, 112)))
    settle(mgr, mgr.build_step())  # the first pass takes the whole window: 8 blocks
    assert mgr.stats.blocks_stored.value == 8
    settle(mgr, mgr.build_step())  # the stored blocks came back into the window: nothing owed
    taken = CountingPool.full_takes
    for _ in range(5):
        assert not mgr.build_step()
    assert CountingPool.full_takes == taken
    mgr.check_invariants()


def test_only_blocks_that_joined_the_window_are_offered():
    """A block released into the window is stored alone; the window's other blocks are not looked at again."""
    mgr = lazy_manager(gpu_blocks=8, watermark=0.5)
    blocks = cache(mgr.gpu, [100, 101, 102, 103, 104])
    settle(mgr, mgr.build_step())
    settle(mgr, mgr.build_step())
    assert not mgr.build_step()
    deduplicated = mgr.stats.stores_deduplicated.value
    mgr.gpu.incref([blocks[0]])  # a hit pins the oldest: block 4 joins the window of 4
    plan = mgr.build_step()
    assert stored_blocks(plan) == [blocks[4]]
    assert mgr.stats.stores_deduplicated.value == deduplicated  # nothing else was re-examined
    settle(mgr, plan)
    mgr.check_invariants()


def test_a_block_whose_copy_left_the_cpu_tier_is_stored_again():
    """A CPU eviction of a window block's hash makes the block owed again, at the next step."""
    mgr = lazy_manager(gpu_blocks=8, cpu_blocks=4, watermark=0.25)  # a window of 2, a CPU tier of 4
    window = cache(mgr.gpu, [100, 101])
    settle(mgr, mgr.build_step())
    assert len(mgr.cpu.lookup([100])) == 1
    # Fill the CPU tier with other content (an eager request elsewhere): LRU evicts 100 and 101.
    other = mgr.cpu.allocate(4)
    mgr.cpu.commit(other, [900, 901, 902, 903])
    mgr.cpu.decref(other)
    assert not mgr.cpu.lookup([100])
    plan = mgr.build_step()
    assert sorted(stored_blocks(plan)) == sorted(window)
    settle(mgr, plan)
    mgr.check_invariants()


def test_a_failed_store_is_offered_again():
    """A write-back copy that failed leaves its block uncovered: the next step stores it again."""
    mgr = lazy_manager(gpu_blocks=8, watermark=0.25)
    window = cache(mgr.gpu, [100, 101])
    plan = mgr.build_step()
    assert sorted(stored_blocks(plan)) == sorted(window)
    settle(mgr, plan, ok=False)
    again = mgr.build_step()
    assert sorted(stored_blocks(again)) == sorted(window)
    settle(mgr, again)
    assert not mgr.build_step()


def test_stores_dropped_for_want_of_cpu_room_are_offered_again():
    """When the CPU tier cannot take the whole window, the rest is stored once room returns."""
    mgr = lazy_manager(gpu_blocks=16, cpu_blocks=2, watermark=0.25)  # a window of 4
    held = mgr.cpu.allocate(2)  # the CPU tier is full of in-flight work: no room at all
    cache(mgr.gpu, [100, 101, 102, 103])
    assert not mgr.build_step() and mgr.stats.stores_dropped.value == 4
    mgr.cpu.decref(held)
    plan = mgr.build_step()
    assert len(stored_blocks(plan)) == 2  # as many as fit
    settle(mgr, plan)
    mgr.check_invariants()


def test_a_reset_owes_the_whole_window_again():
    """After the CPU tier is emptied, every window block is stored again."""
    mgr = lazy_manager(gpu_blocks=8, watermark=0.25)
    window = cache(mgr.gpu, [100, 101])
    settle(mgr, mgr.build_step())
    settle(mgr, mgr.build_step())
    assert mgr.reset() is True
    plan = mgr.build_step()
    assert sorted(stored_blocks(plan)) == sorted(window)


class _Windowless:
    """A pool with eviction_candidates but no eviction window (a third-party EvictionOrder)."""

    eviction_window = in_eviction_window = None  # blocked: not an EvictionWindow

    def __init__(self, num_blocks, eviction):
        self._pool = BlockPool(num_blocks, eviction=eviction)

    def __getattr__(self, name):
        return getattr(self._pool, name)


def test_a_pool_without_a_window_has_its_whole_window_offered_every_step():
    """With a plain EvictionOrder pool the planner takes the candidates every step, as before."""
    mgr = lazy_manager(gpu_blocks=8, watermark=0.25, pool=_Windowless)
    cache(mgr.gpu, [100, 101])
    settle(mgr, mgr.build_step())
    deduplicated = mgr.stats.stores_deduplicated.value
    assert not mgr.build_step()
    assert mgr.stats.stores_deduplicated.value > deduplicated  # examined (and found stored) again


class WriteBackMachine(RuleBasedStateMachine):
    """After every step, every GPU eviction candidate it began with is on the CPU tier or in flight.

    The engine side caches blocks, hits (pins and touches) and releases them,
    and allocates (evicting); stores complete or fail; the CPU tier is small,
    so stored hashes leave it. Exceptions the check allows, as the manager's
    own machine does: stores dropped for want of CPU room, and hashes the CPU
    tier evicted during the step itself.
    """

    gpu_policy = LRUPolicy

    @initialize(watermark=st.sampled_from([0.25, 0.5, 1.0]))
    def create(self, watermark):
        self.mgr = lazy_manager(gpu_blocks=12, cpu_blocks=6, watermark=watermark, gpu_policy=self.gpu_policy)
        self.evicted_cpu: set[int] = set()
        self.mgr.cpu.add_evict_listener(lambda blocks, hashes: self.evicted_cpu.update(hashes))
        self.next_hash = 100
        self.held: list[int] = []  # GPU references the engine holds
        self.pending = []

    @precondition(lambda self: self.mgr.gpu.num_free)
    @rule(n=st.integers(1, 3))
    def cache_blocks(self, n):
        gpu = self.mgr.gpu
        n = min(n, gpu.num_free)
        blocks = gpu.allocate(n)
        gpu.commit(blocks, list(range(self.next_hash, self.next_hash + n)))
        self.next_hash += n
        gpu.decref(blocks)

    @rule(pick=st.integers(0, 11))
    def hit(self, pick):
        gpu = self.mgr.gpu
        ready = [b for b in range(gpu.num_blocks) if gpu.is_ready(b)]
        if ready:
            block = ready[pick % len(ready)]
            gpu.incref([block])
            gpu.touch([block])
            self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 11))
    def release(self, pick):
        self.mgr.gpu.decref([self.held.pop(pick % len(self.held))])

    @rule(ok=st.booleans())
    def step(self, ok):
        mgr = self.mgr
        done, self.pending = self.pending, []
        settle_plan = [TransferResult(tid, ok=ok) for tid, _ in done]
        mgr.apply_completions(settle_plan)
        dropped = mgr.stats.stores_dropped.value
        target = mgr.store.writeback_target(mgr.gpu.num_free, mgr.gpu.num_blocks)
        window = {mgr.gpu.block_hash(b) for b in mgr.gpu.eviction_candidates(target)}
        self.evicted_cpu.clear()
        plan = mgr.build_step()  # its own stores pin sources: blocks past them join the window later
        self.pending = list(plan.stores)
        if mgr.stats.stores_dropped.value != dropped:
            return
        in_flight = set(mgr._stores._inflight)
        missing = {h for h in window if not mgr.cpu.lookup([h])} - in_flight - self.evicted_cpu
        assert not missing, f"window hashes {sorted(missing)} neither on the CPU tier nor in flight"

    @invariant()
    def consistent(self):
        self.mgr.check_invariants()


TestWriteBackLRU = WriteBackMachine.TestCase


class LFUWriteBackMachine(WriteBackMachine):
    gpu_policy = LFUPolicy  # not windowed: the pool re-derives its window when it changed


TestWriteBackLFU = LFUWriteBackMachine.TestCase


@pytest.mark.parametrize("blocks", [1000, 10000])
def test_idle_step_cost_does_not_grow_with_the_pool(blocks):
    """Idle write-back work is O(1): the same number of pool calls at any pool size."""
    mgr = lazy_manager(gpu_blocks=blocks, cpu_blocks=blocks, watermark=0.25)
    cache(mgr.gpu, list(range(1, blocks + 1)))
    for _ in range(3):
        settle(mgr, mgr.build_step())
    calls = []
    lookup = mgr.cpu.lookup
    mgr.cpu.lookup = lambda hashes: calls.append(hashes) or lookup(hashes)
    assert not mgr.build_step()
    assert calls == []
