"""A compiled loop that fails to allocate leaves its object as its reference leaves it at that point.

Rules:

* A ``MemoryError`` raised by a compiled parking-queue loop's own code (its side-list changes included; not
  by Python code it calls back: the reference's per-block methods) leaves the queue exactly as the reference run on the
  blocks the loop had finished leaves it (a block left pending, linked: the same order): the scalars it
  had changed (length, head, tail, cut, pending, clock) are written back beside the slots it wrote, so
  the invariants hold and every later call returns and changes what it does on a reference-run queue.
* A compiled block-pool loop that counts references (``incref``, ``decref``) and fails to allocate
  changes no refcount, as its Python loop rolls back a failing call.

Each case fails the ``k``-th allocation of one call, for ``k`` = 1, 2, ... until the call allocates
fewer times and succeeds (``_testcapi.set_nomemory``), so every allocation the call makes is failed
once. Block ids, counts and the clock lie past CPython's cached small ints, so writing one allocates
too. Python code a loop calls back is the reference's own and makes no promise under a failed
allocation: a ``MemoryError`` whose traceback passes through a Python frame is only counted.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvkit.backends.allocator import loops as pool_loops
from kvkit.backends.allocator.pool import BlockPool
from kvkit.backends.eviction import _queue
from kvkit.backends.eviction._common import any_block
from kvkit.backends.eviction._queue import ParkingQueue, Slots, _SortedKeys
from kvkit.errors import PoolUsageError
from twin_states import queue_state

_testcapi = pytest.importorskip("_testcapi", reason="CPython's _testcapi fails allocations on demand")

_F = 300  # the first block id: ids and the clock past the small ints CPython caches (-5..256)
_N = 300  # blocks entered
_TOP = 1023  # the slots hold ids up to this one
_PAST = _TOP + 200  # an id past the slots: the per-block reference grows them


def _prepared(pending: bool, side: bool, shared: bool) -> ParkingQueue:
    """A queue of ``_N`` blocks from ``_F``: every third parked and the youngest, the rest listed; two parked
    blocks released out of order (in the side list) if ``side``; one block left pending if ``pending``; the
    second queue on shared slots (states of 8 bytes) if ``shared``, else alone on its slots."""
    if shared:
        slots = Slots(shared=True)
        ParkingQueue.of("other", slots)
        queue = ParkingQueue.of("owner", slots)
    else:
        queue = ParkingQueue.of("owner")
    queue._loops = _queue.LOOPS.reference
    queue._slots.grow(_TOP)
    queue.reserve(_F)
    for block in range(_F, _F + _N):
        queue.add(block)
    queue.pin_many([*range(_F, _F + _N, 3), _F + _N - 1])
    if side:
        queue.unpin_many([_F + 150, _F + 90])
    if pending:
        queue.add(_F + 400)
    assert (queue._pending != -1) is pending and bool(queue._back) is side
    return queue


def _linked(queue: ParkingQueue) -> ParkingQueue:
    """``queue`` with its pending block linked (it is the youngest: the order is unchanged)."""
    if queue._pending != -1:
        queue._flush()
    return queue


def _outcome(call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "returned", call(*args)
    except PoolUsageError as error:
        return "raised", (type(error), str(error))


def _odd(block: int) -> bool:
    return block % 2 == 1


def _fail_allocation(k: int, call: Callable[..., Any], *args: Any) -> tuple[Any, MemoryError | None]:
    """Run ``call(*args)`` with its ``k``-th allocation failing: what it returned, or the ``MemoryError`` it
    raised."""
    collecting = gc.isenabled()
    gc.disable()  # a collection in the window would shift the allocations counted
    try:
        _testcapi.set_nomemory(k, k + 1)
        try:
            result = call(*args)
        finally:
            _testcapi.remove_mem_hooks()
    except MemoryError as error:
        return None, error
    finally:
        if collecting:
            gc.enable()
    return result, None


# (loop, its arguments after the queue, a block pending, blocks in the side list, on shared slots)
_CASES = [
    ("add", (_F + 500, False), True, False, False),  # the pending block linked, the new one left pending
    ("add", (_F + 500, True), False, False, False),  # an entry: length and clock only
    ("add", (_F + 500, False), False, True, True),  # an entry left pending
    ("add_pinned_many", ([_F + 500, _F + 501, _F + 502],), True, False, False),
    ("add_pinned_many", ([_F + 500, _PAST, _F + 501],), False, True, False),  # past the slots: the reference's add
    ("add_many", ([_F + 500, _F + 501, _F + 502], [False, True, False]), True, False, False),  # each its own flag
    ("add_many", ([_F + 500, _PAST, _F + 501], [True, False, True]), False, True, True),  # past the slots: add's
    ("pin_many", ([_F + 400, _F + 1, _F + 2, _F + 4],), True, False, False),  # the pending block first
    ("pin_many", ([_F + 1, _F + 2, _F + 150, _F + 4],), True, True, False),  # a side-list block leaves it
    ("pin_many", ([_F + 150, _F + 90, _F + 1],), False, True, True),  # the side list emptied
    ("unpin_many", ([_F + _N - 1, _F + 3, _F + 6],), False, True, False),  # linked at the end, then the side list
    ("unpin_many", ([_F + 3, _F + _N - 1, _F + 6],), True, False, True),  # the pending block linked first
    ("remove_many", ([_F + 1, _F + 3, _F + 2, _F + 150, _F + 4],), True, True, False),  # listed, parked, side list
    ("remove_many", ([_F + 1, _F + 3, _F + _N - 2],), False, False, True),
    ("remove_many", ([_F + 90, _F + 150, _F + 1],), False, True, False),  # the side list emptied
    ("touch_many", ([_F + 1, _F + 3, _F + 2, _F + 4, _F + _N - 1],), True, False, False),  # listed, parked
    ("touch_many", ([_F + 1, _F + 150, _F + 4],), False, True, True),  # a side-list block: the reference's touch
    ("first", (5, _odd), True, False, False),  # some not evictable: the walk
    ("first", (5, any_block), True, False, True),  # the list's head
    ("first", (5, _odd), True, True, False),  # a side list: the merged walk
]


_Calls = list[tuple[str, tuple[Any, ...]]]


def _candidates(base: ParkingQueue, name: str, args: tuple[Any, ...]) -> list[tuple[_Calls, ParkingQueue]]:
    """The reference-run queues a failed call may leave, each with the calls that finish the call from there:
    ``base`` itself (the call not begun), the whole call (``add``: one block) and, for a batch, the call on
    each prefix of its blocks (and of ``add_many``'s flags), and ``add_pinned_many``'s blocks added, not yet
    pinned (its reference: an add then a pin)."""
    out: list[tuple[_Calls, ParkingQueue]] = [([(name, args)], copy.deepcopy(base))]
    if name == "add":
        queue = copy.deepcopy(base)
        queue.add(*args)
        out.append(([], queue))
    if name in ("add", "first"):
        return out
    blocks: Sequence[int] = args[0]
    for j in range(len(blocks) + 1):
        queue = copy.deepcopy(base)
        getattr(queue, name)(*(list(arg[:j]) for arg in args))  # add_many: its flags cut alike
        out.append(([(name, tuple(list(arg[j:]) for arg in args))], queue))
        if name == "add_pinned_many" and j < len(blocks):
            queue = copy.deepcopy(queue)
            queue.add(blocks[j])
            out.append(([("pin", (blocks[j],)), (name, (list(blocks[j + 1:]),))], queue))
    return out


def _go_on(twins: list[ParkingQueue], rest: _Calls) -> None:
    """``rest``, then more calls, on both queues (the compiled one first): the same outcomes, the same state
    after each."""
    calls: _Calls = [
        *rest, ("first", (1000, any_block)), ("add", (_F + 600, False)), ("add", (_F + 601, True)),
        ("add_pinned_many", ([_F + 602, _F + 603],)), ("pin_many", ([_F + 4, _F + 5, _F + 7],)),
        ("unpin_many", (sorted(twins[0].pinned, reverse=True),)),
        ("remove_many", ([_F + 10, _F + 11, _F + 13, _F + 600],)), ("first", (10, _odd)),
        ("first", (1000, any_block)),
    ]
    for call, args in calls:
        outcomes = [_outcome(getattr(queue, call), *args) for queue in twins]
        assert outcomes[0] == outcomes[1], (call, args)
        assert queue_state(twins[0]) == queue_state(twins[1]), (call, args)
    for queue in twins:
        queue.check_invariants()


@pytest.mark.skipif(_queue.LOOPS.compiled is None, reason="the compiled loops were not built")
# A walk the failure cut short is closed as it is collected, where its MemoryError can only be reported.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(("name", "args", "pending", "side", "shared"), _CASES)
@pytest.mark.parametrize("chunk", [_SortedKeys.chunk, 1])
def test_a_failed_allocation_leaves_the_queue_as_the_reference_leaves_the_blocks_done(
        name: str, args: tuple[Any, ...], pending: bool, side: bool, shared: bool, chunk: int) -> None:
    """Every allocation of one compiled call failed in turn: where the loop's own code raised, the queue is
    a reference-run queue's after the call's first blocks (or before the call), and goes on as that one.
    Side-list chunks of one key (split past two) make each side-list change split or drop a chunk."""
    default, _SortedKeys.chunk = _SortedKeys.chunk, chunk
    try:
        _fail_each_allocation(name, args, pending, side, shared)
    finally:
        _SortedKeys.chunk = default


def _fail_each_allocation(name: str, args: tuple[Any, ...], pending: bool, side: bool, shared: bool) -> None:
    compiled = _queue.LOOPS.compiled
    assert compiled is not None
    base = _prepared(pending, side, shared)
    candidates = [(rest, queue_state(_linked(copy.deepcopy(queue))), queue)
                  for rest, queue in _candidates(base, name, args)]
    own = 0
    for k in range(1, 10_000):
        queue = copy.deepcopy(base)
        queue._loops = compiled
        result, error = _fail_allocation(k, getattr(compiled, name), queue, *args)
        if error is None:
            break
        assert type(error) is MemoryError, k
        if error.__traceback__ is not None and error.__traceback__.tb_next is not None:
            continue  # raised in Python code the loop called back: the reference's own
        own += 1
        state = queue_state(_linked(queue))
        found = [(rest, reference) for rest, reference_state, reference in candidates if reference_state == state]
        assert found, f"allocation {k}: the queue is no reference-run queue's after a prefix of the call"
        queue.check_invariants()
        rest, reference = found[-1]
        _go_on([queue, _linked(copy.deepcopy(reference))], rest)
    else:
        pytest.fail("the call never ran without a failed allocation")
    assert own, "no allocation of the loop's own failed"
    # as few allocations failing as the call makes: it runs whole, as the reference runs it
    reference = copy.deepcopy(base)
    assert result == getattr(_queue.LOOPS.reference, name)(reference, *args)
    assert queue_state(queue) == queue_state(reference)


# -- the block pool's counting loops ------------------------------------------------------------------------

_B = 40  # blocks: counts 0 (ready, or empty where the hash is None), 1, or past the small ints


def _pool_lists() -> tuple[list[int], list[int | None]]:
    ref = [0 if b % 4 == 0 else 1 if b % 4 == 1 else 300 + b for b in range(_B)]
    hashes: list[int | None] = [None if b % 8 == 1 else 1000 + b for b in range(_B)]
    return ref, hashes


def _pool_reference(name: str, ref: list[int], hashes: list[int | None], blocks: list[int]) -> Any:
    """``BlockPool``'s own loop ``name`` (the reference) on the lists, as a pool holding them runs it."""
    pool = SimpleNamespace(_ref=ref, _hash=hashes)
    return getattr(BlockPool, "_" + name)(pool, blocks)


_POOL_CASES = [
    ("incref", [b for b in range(_B) if b % 8 != 1]),  # ready blocks pinned, counts raised past the small ints
    ("decref", [b for b in range(_B) if b % 4 != 0]),  # last references (freed, unpinned), counts lowered
]


@pytest.mark.skipif(pool_loops.LOOPS.compiled is None, reason="the compiled loops were not built")
@pytest.mark.parametrize(("name", "blocks"), _POOL_CASES)
def test_a_failed_allocation_in_a_pool_loop_changes_no_refcount(name: str, blocks: list[int]) -> None:
    """Every allocation of one compiled pool loop failed in turn: the refcounts are as before the call, and
    the call that allocates unhindered returns and changes what the pool's own loop does."""
    compiled = pool_loops.LOOPS.compiled
    assert compiled is not None
    loop = getattr(compiled, name)
    before, hashes = _pool_lists()
    failed = 0
    for k in range(1, 10_000):
        ref = list(before)
        result, error = _fail_allocation(k, loop, ref, hashes, blocks)
        if error is None:
            break
        assert type(error) is MemoryError, k
        failed += 1
        assert ref == before, f"allocation {k}: a failed call changed refcounts"
    else:
        pytest.fail("the call never ran without a failed allocation")
    assert failed, "no allocation failed"
    expected = list(before)
    assert result == _pool_reference(name, expected, list(hashes), blocks)
    assert ref == expected
