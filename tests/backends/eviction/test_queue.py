"""ParkingQueue's flat bookkeeping: its sorted side list past one chunk, shared slots, copies."""

from __future__ import annotations

import copy
import pickle
import random
from bisect import bisect_left, bisect_right

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkit.backends.eviction._common import any_block
from kvkit.backends.eviction._queue import ParkingQueue, Slots, _SortedKeys
from kvkit.errors import PoolUsageError


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(1, 6 * _SortedKeys.chunk))
def test_sorted_keys_agree_with_a_sorted_list(seed, size):
    """Adds and removes across many chunks: order, neighbours and maximum as a plain sorted list has them."""
    rng = random.Random(seed)
    keys, model = _SortedKeys(), []
    for key in rng.sample(range(10 * size), size):
        keys.add(key)
        model.insert(bisect_left(model, key), key)
    for key in rng.sample(model, size // 2):
        keys.remove(key)
        model.remove(key)
    assert list(keys) == model and len(keys) == len(model) and bool(keys) == bool(model)
    for probe in rng.choices(range(-1, 10 * size + 1), k=20):
        i, j = bisect_right(model, probe), bisect_left(model, probe)
        assert keys.after(probe) == (model[i] if i < len(model) else None)
        assert keys.before(probe) == (model[j - 1] if j else None)
    if model:
        assert keys.max == model[-1]


def test_blocks_released_out_of_order_come_back_in_entry_order_past_a_chunk():
    """Thousands of blocks released in random order (the side list splits chunks) are walked in entry order."""
    rng = random.Random(7)
    queue = ParkingQueue()
    n = 5 * _SortedKeys.chunk
    for b in range(n):
        queue.add(b, True)  # positional, as hit density's chain index calls it
    released = rng.sample(range(n), n - 10)
    for b in released:
        queue.unpin(b)
    queue.watch(3)
    queue.check_invariants()
    assert queue.first(n, any_block) == sorted(released)
    for b in sorted(released)[:100]:  # evicted from the old end
        queue.remove(b)
    queue.check_invariants()
    assert queue.first(5, any_block) == sorted(released)[100:105]
    for other in (copy.deepcopy(queue), pickle.loads(pickle.dumps(queue))):
        other.check_invariants()
        assert other.first(n, any_block) == queue.first(n, any_block)


def test_queues_sharing_slots_hold_disjoint_blocks():
    """Two queues on one Slots: each sees only its own blocks, and neither takes a block the other holds."""
    slots = Slots(shared=True)
    first, second = ParkingQueue.of("policy", slots), ParkingQueue.of("policy", slots)
    first.add(3)
    second.add(5, pinned=True)
    assert 3 in first and 3 not in second and 5 in second and 5 not in first
    with pytest.raises(PoolUsageError, match="block 3 is already tracked"):
        second.add(3)
    with pytest.raises(PoolUsageError, match="block 5 is not tracked"):
        first.unpin(5)
    second.add(first.remove(3) or 4)
    assert first.first(2, any_block) == [] and second.first(2, any_block) == [4]
    first.check_invariants()
    second.check_invariants()


@pytest.mark.parametrize("pin", ["pin", "pin_many"])
@pytest.mark.parametrize("block", [-1, True, 1.0])
def test_pinning_no_block_of_the_queue_is_refused_and_changes_nothing(block, pin):
    """An id that is no block of the queue (the no-block mark -1; a bool or a float equal to the block entered
    last) is refused, whether or not that block is still unlinked, and the queue stays as it was."""
    for pending in (False, True):
        queue = ParkingQueue()
        for b in (2, 3, 0, 1):  # block 1 entered last
            queue.add(b)
        if not pending:
            queue.pin(1)  # nothing left unlinked
        before = (bytes(queue._slots.state), queue.in_order(), queue.pinned)
        with pytest.raises(PoolUsageError):
            getattr(queue, pin)(block if pin == "pin" else [block])
        queue.check_invariants()
        assert (bytes(queue._slots.state), queue.in_order(), queue.pinned) == before
