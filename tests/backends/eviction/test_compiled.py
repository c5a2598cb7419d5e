"""Each compiled loop against its pure-Python reference: the same calls leave the same state, byte for byte."""

from __future__ import annotations

import copy
import math
import random
import statistics
import time
from collections import OrderedDict, UserList
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvkit.backends.eviction import _chains, _queue
from kvkit.backends.eviction._chains import FlatChains
from kvkit.backends.eviction._common import any_block
from kvkit.backends.eviction._queue import ParkingQueue, Slots, _SortedKeys
from kvkit.backends.eviction.fifo import FIFOPolicy
from kvkit.backends.eviction.hit_density import HitDensityPolicy, booking, selection
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.eviction.prefix_lru import PrefixLRUPolicy
from kvkit.errors import PoolUsageError
from twin_states import queue_state


@pytest.mark.compiler
def test_the_compiled_booking_was_built() -> None:
    """Where a C compiler is, the install built the booking loops, and the policy runs them by default."""
    assert booking.LOOPS.compiled is not None, "pip install -e . did not build hit_density/_booking.c"
    assert HitDensityPolicy()._booking is booking.LOOPS.compiled


@pytest.mark.compiler
def test_the_compiled_selection_was_built() -> None:
    """Where a C compiler is, the install built the selection rounds, and the policy runs them by default."""
    assert selection.LOOPS.compiled is not None, "pip install -e . did not build hit_density/_selection.c"
    assert HitDensityPolicy()._selection is selection.LOOPS.compiled


@pytest.mark.compiler
def test_the_compiled_chain_loops_were_built() -> None:
    """Where a C compiler is, the install built the chain index's loops, and a chain index runs them."""
    assert _chains.LOOPS.compiled is not None, "pip install -e . did not build eviction/_chains_loops.c"
    assert FlatChains(bytearray())._loops is _chains.LOOPS.compiled


@pytest.mark.compiler
def test_the_compiled_queue_loops_were_built() -> None:
    """Where a C compiler is, the install built the parking queue's loops, and a queue runs them."""
    assert _queue.LOOPS.compiled is not None, "pip install -e . did not build eviction/_queue_loops.c"
    assert ParkingQueue()._loops is _queue.LOOPS.compiled
    assert LRUPolicy()._loops is FlatChains(bytearray())._orphans._loops is _queue.LOOPS.compiled


def _reference(chains: FlatChains) -> FlatChains:
    """``chains``, running the Python references of its batch loops."""
    chains._loops = _chains.LOOPS.reference
    return chains


def _chains_state(chains: FlatChains) -> dict[str, Any]:
    """Every field of a chain index: its arrays byte for byte, its maps with their order, its orphan queue
    and its kept walk."""
    own = chains._own
    walk = chains._walk
    return {
        "parked": bytes(chains.parked),
        "own": None if own is None else list(own.items()),
        "hash": list(chains._hash),
        "block_of": list(chains._block_of.items()),
        "up": bytes(chains._up), "first": bytes(chains._first), "next": bytes(chains._next),
        "prev": bytes(chains._prev),
        "orphan_of": list(chains._orphan_of.items()),
        "waiting": list(chains._waiting.items()),
        "orphans": queue_state(chains._orphans),
        "walk": None if walk is None else (walk.root, list(walk.stack), sorted(walk.held), sorted(walk.victims),
                                           list(walk.skipped)),
    }


def _outcome(call: Any, *args: Any) -> tuple[str, Any]:
    """What ``call(*args)`` returned, or the type and message of the refusal it raised."""
    try:
        result = call(*args)
    except (PoolUsageError, IndexError) as error:  # both twins must raise alike
        return "raised", (type(error), str(error))
    if isinstance(result, tuple):  # add_many's refusal: compared by type and message
        result = (*result[:2], None if result[2] is None else (type(result[2]), str(result[2])))
    return "returned", result


_SIZE = 24


def _evictable(block: int) -> bool:
    return block % 5 != 0


def _tracked_pick(chains: FlatChains, pick: int) -> int:
    """The ``pick``-th tracked block (cyclically), ``pick`` itself past the arrays or where none is tracked."""
    tracked = [b for b in range(_SIZE) if chains.tracks(b)]
    return tracked[pick % len(tracked)] if tracked and pick < _SIZE else pick

# Batches of (block, hash, parent) on a small hash space: chains (a parent named as the batch's previous
# hash), branches (several children of a hash), orphans (a parent not tracked), heads (no parent, or the
# block's own hash), refusals (a tracked block or hash, a block named twice) and ids past the arrays (the
# reference's IndexError); removals of tracked blocks picked by rank (with or without the caller's set,
# some repeated, some past the arrays: refused); pins, unpins, and walks, some with blocks already chosen,
# that run to their end or stop half way (kept, resumed or dropped by the next calls); the orphans among
# a batch of ids, some negative (the reference indexes from the end) or past the arrays (IndexError). Each
# batch comes as lists, tuples or another sequence (the compiled loop hands that to the reference).
_ENTRY = st.tuples(st.integers(0, _SIZE), st.integers(1, 16),
                   st.one_of(st.none(), st.just("previous"), st.just("itself"), st.integers(1, 16),
                             st.integers(1, 4)))  # (siblings)
_KINDS = st.sampled_from([list, tuple, UserList])
_CHAIN_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(_ENTRY, min_size=1, max_size=6), st.booleans(), _KINDS),
    st.tuples(st.just("remove"), st.lists(st.integers(0, _SIZE), max_size=6), st.booleans(), _KINDS),
    st.tuples(st.just("pin"), st.integers(0, _SIZE - 1)),
    st.tuples(st.just("unpin"), st.integers(0, _SIZE - 1)),
    st.tuples(st.just("collect"), st.integers(0, _SIZE - 1), st.integers(1, 12),
              st.lists(st.integers(0, _SIZE - 1), max_size=4)),
    st.tuples(st.just("among"), st.lists(st.integers(-2, _SIZE), max_size=8), _KINDS),
), max_size=60)


@settings(max_examples=400, deadline=None)
@example(ops=[("add", [(3, 1, None), (4, 2, "previous"), (5, 3, "previous")], False, list),
              ("add", [(1, 5, 2), (2, 6, 2)], False, list), ("remove", [4, 1], True, list),
              ("add", [(6, 7, 4), (7, 8, 4)], True, tuple)], shared=False)
@example(ops=[("add", [(0, 1, None), (1, 2, 1), (2, 3, 2), (3, 4, 2)], False, list), ("collect", 0, 2, []),
              ("remove", [3], False, list), ("add", [(5, 5, 2)], False, list), ("remove", [0], False, list)],
         shared=True)
@example(ops=[("add", [(1, 5, 3), (2, 6, 3), (3, 7, 3)], False, list), ("remove", [1], False, list),
              ("add", [(4, 8, 3)], True, list), ("add", [(0, 3, None)], False, list),
              ("remove", [0, 1], True, list), ("remove", [1], False, list)], shared=False)  # sibling orphans
@example(ops=[("add", [(0, 1, None), (1, 2, 1), (2, 3, 1), (3, 4, 1)], False, list), ("remove", [1], False, list),
              ("remove", [2], False, list), ("add", [(4, 5, 1)], False, list)], shared=False)  # siblings leave
@example(ops=[("add", [(0, 1, None), (1, 2, "previous"), (2, 3, "previous"), (3, 4, "previous")], False, list),
              ("collect", 0, 1, []), ("remove", [1], True, tuple)], shared=False)  # a kept walk loses a block
@given(ops=_CHAIN_OPS, shared=st.booleans())
def test_compiled_chain_loops_are_the_references(ops: list[tuple[Any, ...]], shared: bool) -> None:
    """Two chain indexes take the same calls, one with the compiled loops, one with the Python references:
    every call returns or raises the same, and after it both hold the same state. ``shared``: each reads a
    driver's index and hash list (:meth:`FlatChains.use_index`), written around the calls as a pool does."""
    twins = [FlatChains(bytearray(_SIZE)), _reference(FlatChains(bytearray(_SIZE)))]
    indexes: list[tuple[dict[int, int], list[int | None]]] = [({}, [None] * _SIZE) for _ in twins]
    for chains, (index, hashes) in zip(twins, indexes):
        if shared:  # read through a view, not a dict: the compiled loop asks it as the reference does
            chains.use_index(None, MappingProxyType(index), hashes)
        chains.grow(_SIZE)
    for op in ops:
        outcomes = []
        for chains, (index, hashes) in zip(twins, indexes):
            if op[0] == "add":
                _, entries, pinned, kind = op
                if shared:  # a pool refuses a block or hash it holds before its policy sees them
                    seen: set[tuple[str, int]] = set()
                    entries = [(b, h, p) for b, h, p in entries if b < _SIZE and hashes[b] is None and h not in index
                               and not seen & {("b", b), ("h", h)} and not seen.update({("b", b), ("h", h)})]
                blocks = [b for b, _, _ in entries]
                block_hashes = [h for _, h, _ in entries]
                parents = [block_hashes[i - 1] if p == "previous" and i else h if p == "itself"
                           else None if p == "previous" else p for i, (_, h, p) in enumerate(entries)]
                if shared:
                    for block, block_hash in zip(blocks, block_hashes):
                        index[block_hash], hashes[block] = block, block_hash
                new = [b for b in blocks if b < _SIZE and not chains.tracks(b)]
                outcomes.append(_outcome(chains.add_many, "owner", kind(blocks), kind(block_hashes), kind(parents),
                                         pinned))
                if pinned:  # the owner parks the blocks added
                    for block in filter(chains.tracks, new):
                        chains.parked[block] = FlatChains.PARKED
            elif op[0] == "remove":
                _, picks, vouched, kind = op
                blocks = [_tracked_pick(chains, pick) for pick in picks]
                if shared:
                    blocks = [b for b in dict.fromkeys(blocks) if chains.tracks(b)]
                leaving = chains.distinct_tracked(blocks) if vouched else None
                outcomes.append(_outcome(chains.remove_many, "owner", kind(blocks), leaving))
                if shared:
                    for block in blocks:
                        del index[hashes[block]]
                        hashes[block] = None
            elif op[0] == "pin":
                if chains.tracks(op[1]) and chains.parked[op[1]] != FlatChains.PARKED:
                    chains.parked[op[1]] = FlatChains.PARKED
                    chains.pin(op[1])
            elif op[0] == "unpin":
                if chains.tracks(op[1]) and chains.parked[op[1]] == FlatChains.PARKED:
                    chains.parked[op[1]] = 0
                    chains.unpin(op[1])
            elif op[0] == "among":
                outcomes.append(_outcome(chains.orphans_among, op[2](op[1])))
            elif chains.tracks(root := _tracked_pick(chains, op[1])):  # some blocks already chosen
                chosen = dict.fromkeys(b for b in (_tracked_pick(chains, pick) for pick in op[3]) if b != root)
                outcomes.append((_outcome(chains.collect, root, _evictable, chosen, op[2]), list(chosen)))
        if outcomes:
            assert outcomes[0] == outcomes[1], op
        assert _chains_state(twins[0]) == _chains_state(twins[1]), op
    for chains in twins:
        chains.check_invariants()


@pytest.mark.skipif(_chains.LOOPS.compiled is None, reason="the compiled loops were not built")
@pytest.mark.parametrize("pinned", [False, True])
def test_compiled_add_many_stopped_by_an_error_leaves_the_orphans_found_before(pinned: bool) -> None:
    """A batch stopped half way by an error (an unhashable parent hash: the reference's TypeError): the
    orphans found before it are in the queue, in their order and with their flags (one parked by its
    owner), one of them no orphan any more (its parent arrived in the batch), one found after that arrival,
    as the reference left them."""
    twins = [FlatChains(bytearray(_SIZE)), _reference(FlatChains(bytearray(_SIZE)))]
    errors = []
    for chains in twins:
        chains.grow(_SIZE)
        chains.add_many("owner", [0], [50], [None])
        chains.parked[2] = FlatChains.PARKED  # the owner holds it in use
        with pytest.raises(TypeError) as raised:
            chains.add_many("owner", [1, 2, 3, 4, 6, 8, 9, 5, 7], [1, 2, 3, 4, 90, 8, 9, 5, 7],
                            [90, 91, 50, 92, None, 94, 8, [6], 93], pinned)
        errors.append(str(raised.value))
    assert errors[0] == errors[1]
    assert _chains_state(twins[0]) == _chains_state(twins[1])
    orphans = twins[0]._orphans
    assert orphans.in_order() == [2, 4, 8]
    assert orphans.pinned == ({2, 4, 8} if pinned else {2})


@pytest.mark.skipif(_chains.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=300, deadline=None)
@example(tracked=[1, 2, 3], blocks=[1, 2, 3], kind=list)
@example(tracked=[1, 2, 3], blocks=[1, 2, 1], kind=tuple)  # named twice
@example(tracked=[1, 2], blocks=[1, True], kind=list)
@example(tracked=[1, 2], blocks=[2, [1]], kind=list)  # unhashable: the reference's TypeError
@given(tracked=st.lists(st.integers(0, _SIZE - 1), unique=True, max_size=_SIZE),
       blocks=st.lists(st.one_of(st.integers(0, _SIZE - 1), st.integers(0, _SIZE - 1),
                                 st.sampled_from([-1, _SIZE, 1 << 70, -(1 << 70), True, 2.0, "x", (3,), [1]])),
                       max_size=8),
       kind=_KINDS)
def test_compiled_distinct_tracked_is_the_reference(tracked: list[int], blocks: list[Any], kind: Any) -> None:
    """The compiled check of a removal's blocks against the reference: several distinct tracked ids or not
    (one named twice, untracked, past the arrays, no int, unhashable; lists, tuples or another sequence):
    the same set, or the same error."""
    chains = FlatChains(bytearray(_SIZE))
    chains.grow(_SIZE)
    chains.add_many("owner", tracked, [block + 100 for block in tracked], [None] * len(tracked))
    assert _chains.LOOPS.compiled is not None
    outcomes = [_outcome_any(loops.distinct_tracked, chains, kind(blocks))
                for loops in (_chains.LOOPS.compiled, _chains.LOOPS.reference)]
    assert outcomes[0] == outcomes[1]


# Walks over a forest of tracked blocks (each block's parent an earlier block or none, the last ids free):
# collections from a root with some blocks chosen already, most of them stopping at their count (kept),
# then the selection carried out (its picks leave) and the next from the same root, blocks turned
# evictable or not, parked or not, new
# children under a block, and a predicate that raises at its k-th question, so kept walks resume, are
# dropped or restart, and one left half way by an error is compared as it stands.
_WALK_OPS = st.lists(st.one_of(
    st.tuples(st.just("collect"), st.integers(0, _SIZE - 1), st.integers(0, 8),
              st.lists(st.integers(0, _SIZE - 1), max_size=3)),
    st.tuples(st.just("again"), st.integers(0, 4)),
    st.tuples(st.just("again"), st.integers(0, 4)),
    st.tuples(st.just("evict"), st.booleans()),
    st.tuples(st.just("evict"), st.booleans()),
    st.tuples(st.just("flip"), st.integers(0, _SIZE - 1)),
    st.tuples(st.just("flip"), st.just(-1)),  # every block's answer turned
    st.tuples(st.just("park"), st.integers(0, _SIZE - 1)),
    st.tuples(st.just("raise"), st.integers(1, 8)),
    st.tuples(st.just("add"), st.integers(0, _SIZE - 1)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@example(parents=list(range(_SIZE - 4)), ops=[("again", 4), ("evict", True), ("flip", -1), ("again", 2)])  # one
# chain: the walk kept skipped block 16, evictable at the next walk, which starts afresh
@example(parents=list(range(_SIZE - 4)), ops=[("again", 4), ("evict", True), ("raise", 2), ("again", 2),
                                              ("again", 3)])  # a resumed walk stopped by an error, resumed
@example(parents=[2, *range(1, _SIZE - 4)], ops=[("again", 3), ("evict", True), ("again", 30)])  # blocks 0 and 1
# each other's parent, a chain below 1: walks from 0 meet it again as a child
@given(parents=st.lists(st.integers(0, _SIZE), min_size=_SIZE - 4, max_size=_SIZE - 4), ops=_WALK_OPS)
def test_compiled_collect_is_the_reference(parents: list[int], ops: list[tuple[Any, ...]]) -> None:
    """Two chain indexes take the same walks, one with the compiled collect, one with the reference: each
    walk returns or raises the same, chooses the same blocks in the same order, asks the predicate about
    the same blocks in the same order, and leaves the same state, the kept walk included."""
    twins = [FlatChains(bytearray(_SIZE)), _reference(FlatChains(bytearray(_SIZE)))]
    # Parent hash p (block p - 1) an earlier block's, but block 0's any block's: a cycle through it where
    # that block descends from it.
    entries = [(b, b + 1, (p if b == 0 else p % (b + 1)) or None) for b, p in enumerate(parents)]
    for chains in twins:
        chains.grow(_SIZE)
        chains.add_many("owner", [b for b, _, _ in entries], [h for _, h, _ in entries], [p for _, _, p in entries])
    refused: set[int] = set()
    raise_at: int | None = None
    picked: list[Any] = [[], []]
    next_hash, root, more, already, stopped = 100, 0, 0, [], False
    for op in ops:
        if op[0] == "flip":
            refused ^= {op[1]}
        elif op[0] == "raise":
            raise_at = op[1]
        elif op[0] == "collect":
            root, more = _tracked_pick(twins[0], op[1]), op[2]
            already = [b for b in (_tracked_pick(twins[0], pick) for pick in op[3]) if b != root]
        elif op[0] == "again":  # the next selection from the last root, nothing chosen yet
            more, already = op[1], []
        outcomes = []
        for k, chains in enumerate(twins):
            if op[0] in ("collect", "again") and chains.tracks(root):
                chosen = dict.fromkeys(already)
                log: list[int] = []

                def evictable(block: int, log: list[int] = log, at: int | None = raise_at,
                              turned: frozenset[int] = frozenset(refused)) -> bool:
                    log.append(block)
                    if len(log) == at:
                        raise ValueError(f"asked about block {block}")
                    return not (block % 4 == 0) ^ (block in turned) ^ (-1 in turned)  # every fourth refused

                try:
                    picked[k] = chains.collect(root, evictable, chosen, len(chosen) + more)
                    outcome: Any = picked[k]
                except ValueError as error:
                    picked[k], outcome, stopped = [], str(error), True
                outcomes.append((outcome, list(chosen), log))
            elif op[0] == "evict":  # the selection carried out: its picks leave (or all but the last)
                leaving = [b for b in picked[k][:len(picked[k]) - (not op[1])] if chains.tracks(b)]
                chains.remove_many("owner", leaving, chains.distinct_tracked(leaving))
                for block in leaving:
                    chains.parked[block] = 0
            elif op[0] == "park" and chains.tracks(op[1]):
                parked = chains.parked[op[1]] == FlatChains.PARKED
                chains.parked[op[1]] = 0 if parked else FlatChains.PARKED
                (chains.unpin if parked else chains.pin)(op[1])
            elif op[0] == "add" and chains.tracks(parent := _tracked_pick(chains, op[1])):
                free = [b for b in range(_SIZE) if not chains.tracks(b)]
                if free:
                    chains.add("owner", free[0], next_hash, chains.links(parent)[0])
        if op[0] in ("collect", "again"):
            raise_at = None
        elif op[0] == "add":
            next_hash += 1
        if outcomes:
            assert outcomes[0] == outcomes[1], op
        assert _chains_state(twins[0]) == _chains_state(twins[1]), op
    if not stopped:  # a walk an error stopped is kept as it stood
        for chains in twins:
            chains.check_invariants()


def _evicting_selection_cost(policy: Any, chains: int, length: int) -> float:
    """The median CPU time of ``select_victims(1)`` while ``chains`` chains of ``length`` blocks (each inserted
    head to tail) are evicted a victim per call, each victim removed before the next selection."""
    for c in range(chains):
        parent = None
        for i in range(length):
            policy.on_insert(c * length + i, 1_000_000 + c * length + i, parent)
            parent = 1_000_000 + c * length + i
    costs = []
    for _ in range(chains * length):
        start = time.process_time_ns()
        victims = policy.select_victims(1, any_block)
        costs.append(time.process_time_ns() - start)
        policy.on_remove(victims[0])
    return statistics.median(costs)


@pytest.mark.skipif(_chains.LOOPS.compiled is None, reason="the compiled loops were not built")
@pytest.mark.parametrize("policy", [HitDensityPolicy, PrefixLRUPolicy])
def test_compiled_walks_evict_a_chain_in_constant_time_per_victim(policy: Any) -> None:
    """Chains evicted a victim per call: a selection costs about the same whether the chains hold 64 blocks or
    4,096 (the kept walk resumes where it stopped, its stack never reloaded), within 3x; a cost that grew with the
    depth would be 64x."""
    short = _evicting_selection_cost(policy(), 4, 64)
    deep = _evicting_selection_cost(policy(), 4, 4096)
    assert deep <= 3 * short, f"{policy.__name__}: {deep} ns a selection at depth 4,096 against {short} at 64"


def _state(policy: HitDensityPolicy) -> dict[str, Any]:
    """Every field of the policy the booking reads or writes, and what its decisions read."""
    fields = ("_where", "_cls", "_uses", "_last", "_key", "_next", "_prev", "_ends", "_dirty", "_recent",
              "_ghost_recent", "_ghost_key", "_ghost_cls", "_ghost_uses", "_ghost_last", "_ghost_live",
              "_ghost_at", "_ghost_base", "_clock", "_tracked", "_tip", "_reused", "_turnover", "_evictions",
              "_high_water", "_next_refresh", "_last_removal", "_ghost_oldest")
    state = {name: getattr(policy, name) for name in fields}
    state["_ghost_at"] = dict(state["_ghost_at"])  # a GhostMap with the compiled booking, a dict with the reference
    state["_last"], state["_key"], state["_next"], state["_prev"], state["_ghost_last"], state["_ghost_key"] = (
        bytes(state[name]) for name in ("_last", "_key", "_next", "_prev", "_ghost_last", "_ghost_key"))
    model = policy.model
    state["model"] = (model.rows, model.reuses.tolist(), model.ends.tolist())
    shift = policy._shift
    state["shift"] = (shift.shifts, shift._window, shift._held, shift._scale,
                      shift._history.tolist(), shift._pool, shift._decayed)
    state["chains"] = _chains_state(policy._chains)
    return state


def _run_references(policy: HitDensityPolicy) -> None:
    """``policy`` runs the reference booking loops from now on, its ghost map a dict with the same entries."""
    policy._booking = booking.LOOPS.reference
    policy._ghost_at = dict(policy._ghost_at)


def _hash(conversation: int, position: int) -> int:
    return conversation * 1000 + position + 1


# Stores of chain pieces (listed one block at a time, or parked as a batch), hits, pins, unpins and evictions.
_OPS = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, 6), st.integers(0, 12), st.integers(1, 40), st.booleans()),
    st.tuples(st.just("hit"), st.integers(0, 6), st.integers(1, 12), st.integers(1, 6)),
    st.tuples(st.just("unpin"), st.integers(0, 40)),
    st.tuples(st.just("pin"), st.integers(0, 12)),
    st.tuples(st.just("evict"), st.integers(1, 30)),
), max_size=80)


@pytest.mark.skipif(booking.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=150, deadline=None)
@example(ops=[("store", 0, 0, 4, False), ("hit", 0, 4, 6), ("evict", 4), ("store", 0, 0, 4, True)], capacity=16,
         span=2.0)  # a chain hit six times, evicted and stored again: its ghost's reuses climb past 3
@example(ops=[("store", 0, 0, 4, True), ("store", 1, 0, 2, True), ("store", 0, 0, 6, True)], capacity=16,
         span=2.0)  # a chain continued after another store: its last block, a leaf by then, becomes a parent
@given(ops=_OPS, capacity=st.sampled_from([None, 4, 16]), span=st.sampled_from([1.0, 2.0]))
def test_compiled_booking_is_the_reference(ops: list[tuple[Any, ...]], capacity: int | None, span: float) -> None:
    """Two policies take the same calls, one running the compiled booking loops, one the reference.
    Small capacities refresh the model inside a batch (the booking stops and resumes), and evicted chains
    stored again hit the ghost: after every call both hold the same state, and make the same choices."""
    twins = [HitDensityPolicy(capacity=capacity, ghost_span=span) for _ in range(2)]
    _run_references(twins[1])
    _drive(twins, ops, _state)


# Stores, a few hits (reuses that a refresh has not yet cleared) and evictions of many blocks at once.
_REMOVAL_OPS = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, 6), st.integers(0, 12), st.integers(1, 40), st.just(False)),
    st.tuples(st.just("hit"), st.integers(0, 6), st.integers(1, 12), st.integers(1, 2)),
    st.tuples(st.just("evict"), st.integers(1, 40)),
), max_size=60)


@pytest.mark.skipif(booking.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=150, deadline=None)
@example(ops=[("store", 0, 0, 12, False), ("hit", 0, 12, 2), ("evict", 12), ("store", 0, 0, 12, False),
              ("evict", 3), ("evict", 9)], capacity=2, span=1.0, ghost_bytes=1 << 20)  # reused, evicted
@example(ops=[("store", 0, 0, 30, False), ("evict", 1), ("evict", 29), ("store", 1, 0, 30, False), ("evict", 30)],
         capacity=4, span=1.5, ghost_bytes=192 * 5)  # many at once: the turnover's three steps; the byte bound
@given(ops=_REMOVAL_OPS, capacity=st.sampled_from([None, 2, 4, 16]), span=st.sampled_from([1.0, 1.5, 3.0]),
       ghost_bytes=st.sampled_from([192 * 3, 192 * 40, 1 << 20]))
def test_compiled_removals_are_the_reference(ops: list[tuple[Any, ...]], capacity: int | None, span: float,
                                             ghost_bytes: int) -> None:
    """Removals of many blocks at once, from small pools whose ghosts soon pass their span (in pools or in
    bytes), after hits that left reuses since the last refresh: the compiled booking and the reference leave
    the same state after every call."""
    twins = [HitDensityPolicy(capacity=capacity, ghost_span=span, ghost_bytes=ghost_bytes) for _ in range(2)]
    _run_references(twins[1])
    _drive(twins, ops, _state)


@pytest.mark.skipif(booking.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=150, deadline=None)
@example(ops=[("store", 0, 0, 8, False), ("evict", 2)], picks=[0, 1, 2], reuses=[2, 0, 1], c=16, gap=1 << 60,
         stray=None)  # the gap times the capacity passes 64 bits
@example(ops=[("store", 0, 0, 8, False)], picks=[3, 4], reuses=[1, 1], c=1, gap=0, stray=-1)
@example(ops=[("store", 0, 0, 8, False)], picks=[5], reuses=[], c=3, gap=0, stray="end")  # just past the arrays
@example(ops=[("store", 0, 0, 8, False), ("evict", 2)], picks=[3, 4], reuses=[], c=0, gap=0, stray=None)  # no pool
@given(ops=_OPS, picks=st.lists(st.integers(0, 199), max_size=40, unique=True),
       reuses=st.lists(st.integers(0, 3), max_size=40), c=st.integers(0, 40), gap=st.sampled_from([0, 5, 1 << 60]),
       stray=st.sampled_from([None, -1, "end", 1 << 70, "x"]))
def test_book_removals_is_the_reference(ops: list[tuple[Any, ...]], picks: list[int], reuses: list[int], c: int,
                                        gap: int, stray: Any) -> None:
    """book_removals on two copies of one policy: any blocks (with reuses since the last refresh, 0 among
    them), any capacity (0, out of contract, runs the reference), a gap whose ticks times the capacity pass
    64 bits, and a block id outside the arrays ("end": just past them) or no int (the compiled function runs
    the reference then): the same state, the same refusal."""
    setup = [HitDensityPolicy(capacity=16) for _ in range(2)]
    _drive(setup, ops, _state)
    policy = setup[0]
    picks = [block for block in picks if block < len(policy._where)]
    policy._recent.update(zip(picks, reuses))
    policy._clock += gap
    if stray == "end":
        stray = len(policy._where)
    blocks: list[Any] = [*picks, stray] if stray is not None else picks
    twins = [copy.deepcopy(policy) for _ in range(2)]
    _run_references(twins[1])
    outcomes = [_outcome_any(books.book_removals, twin, blocks, c)
                for books, twin in zip((booking.LOOPS.compiled, booking.LOOPS.reference), twins)]
    assert outcomes[0] == outcomes[1]
    assert _state(twins[0]) == _state(twins[1])


@pytest.mark.skipif(booking.LOOPS.compiled is None, reason="the compiled loops were not built")
@pytest.mark.parametrize("one_call", [True, False])
def test_hashes_of_one_key_share_a_ghost(one_call: bool) -> None:
    """Two hashes of one key (Python hashes -1 and -2 alike, and n and n + 2**61 - 1) share a ghost: the one
    evicted later replaces the other, in one removal call or two, and a store of either takes it back. The
    compiled booking and the reference keep the same state, and every invariant holds."""
    twins = [HitDensityPolicy(capacity=8) for _ in range(2)]
    _run_references(twins[1])
    pairs = [(-1, -2), (5, 5 + 2**61 - 1)]
    for policy in twins:
        for block, block_hash in enumerate(h for pair in pairs for h in pair):
            policy.on_insert(block, block_hash, None)
        if one_call:
            policy.remove_many([0, 2, 1, 3])
        else:
            policy.remove_many([0, 2])
            policy.remove_many([1, 3])
        policy.check_invariants()
        assert policy.num_ghosts == 2 and sum(policy._ghost_live) == 2
        assert [g for g, alive in enumerate(policy._ghost_live) if alive] == [2, 3]  # the later of each key
        policy.on_insert(4, -1, None)  # the ghost of -2 (key -2) comes back as -1's reuse
        policy.check_invariants()
        assert policy.num_ghosts == 1 and policy.uses_of(4) >= 1
    assert _state(twins[0]) == _state(twins[1])


@pytest.mark.skipif(booking.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=150, deadline=None)
@example(ops=[("store", 0, 0, 12, False), ("hit", 0, 12, 2), ("evict", 12)], lo=2, width=7, past=0,
         reused=[3, 5])
@example(ops=[("store", 0, 0, 6, False), ("evict", 6)], lo=4, width=9, past=90, reused=[])  # clipped: the reference
@example(ops=[("store", 0, 0, 6, False), ("evict", 6)], lo=0, width=9, past=1, reused=[])  # one past the end
@given(ops=_REMOVAL_OPS, lo=st.integers(0, 60), width=st.integers(0, 60), past=st.sampled_from([0, 0, 0, 1, -9]),
       reused=st.lists(st.integers(0, 60), max_size=8))
def test_forget_ghosts_is_the_reference(ops: list[tuple[Any, ...]], lo: int, width: int, past: int,
                                        reused: list[int]) -> None:
    """forget_ghosts on two copies of one policy whose ghosts have reuses since the last refresh: a range
    of indexes, inside the ghost arrays or one the slices would clip (that one runs the reference): the same
    state (the model's recorded ends included), the same return."""
    setup = [HitDensityPolicy(capacity=16, ghost_span=40.0) for _ in range(2)]
    _drive(setup, ops, _state)
    policy = setup[0]
    live = [key for key, alive in zip(policy._ghost_key, policy._ghost_live) if alive]
    policy._ghost_recent.update((live[i % len(live)], i + 1) for i in reused if live)
    lo = min(lo, len(policy._ghost_key))
    hi = min(lo + width, len(policy._ghost_key)) + past  # past 0: inside the ghost arrays
    twins = [copy.deepcopy(policy) for _ in range(2)]
    _run_references(twins[1])
    outcomes = [_outcome_any(books.forget_ghosts, twin, lo, hi)
                for books, twin in zip((booking.LOOPS.compiled, booking.LOOPS.reference), twins)]
    assert outcomes[0] == outcomes[1]
    assert _state(twins[0]) == _state(twins[1])


@pytest.mark.skipif(booking.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=200, deadline=None)
@example(ops=[("store", 0, 2, 6, False)], picks=[0, 1, 0, 2], pinning=True, stray=None, at=0)  # orphans, a repeat
@example(ops=[("store", 0, 0, 6, True)], picks=[0, 1, 2], pinning=False, stray="x", at=2)
@example(ops=[("store", 0, 0, 6, True), ("unpin", 3)], picks=[0, 1, 5], pinning=False, stray=None, at=0)
@given(ops=_OPS, picks=st.lists(st.integers(0, 60), max_size=8), pinning=st.booleans(),
       stray=st.sampled_from([None, -1, "end", "untracked", 1 << 70, "x", True, 2.0]), at=st.integers(0, 8))
def test_book_pins_is_the_reference(ops: list[tuple[Any, ...]], picks: list[int], pinning: bool, stray: Any,
                                    at: int) -> None:
    """pin_many or unpin_many on three copies of one policy (orphans among its blocks), with the compiled
    booking, the reference, and the reference's per-block hooks: any tracked blocks, listed or parked, some
    named twice, and a stray id (past the arrays, untracked, no int) at any place: the same refusal at the
    same block, the blocks before it moved (the chain index's orphan pins too), the same state."""
    setup = [HitDensityPolicy(capacity=16) for _ in range(2)]
    _drive(setup, ops, _state)
    policy = setup[0]
    tracked = [b for b in range(len(policy._where)) if policy._where[b]]
    blocks: list[Any] = [tracked[pick % len(tracked)] for pick in picks] if tracked else []
    if stray is not None:
        untracked = next(b for b in range(len(policy._where) + 1) if b == len(policy._where) or not policy._where[b])
        stray = {"end": len(policy._where), "untracked": untracked}.get(stray, stray)
        blocks.insert(min(at, len(blocks)), stray)
    twins = [copy.deepcopy(policy) for _ in range(3)]
    for twin in twins[1:]:
        _run_references(twin)

    def one_by_one(policy: HitDensityPolicy, blocks: list[Any]) -> None:
        for block in blocks:
            (policy.on_pin if pinning else policy.on_unpin)(block)

    outcomes = [_outcome_any(call, twin, blocks) for call, twin in
                zip((HitDensityPolicy.pin_many if pinning else HitDensityPolicy.unpin_many,) * 2 + (one_by_one,),
                    twins)]
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert _state(twins[0]) == _state(twins[1]) == _state(twins[2])
    for twin in twins:
        twin.check_invariants()


# Stores (listed one block at a time, or parked as a batch; chains, and orphans where a piece starts past
# its conversation's head), hits, pins, unpins, removals of tracked blocks picked by rank, and selections:
# through select_victims (its victims evicted or not), or select_rounds called with some tracked blocks
# already chosen and verified or not; each with an evictable predicate that refuses every m-th block and
# the parked ones (or, changing its mind, every third question), or raises at its k-th question.
_STORE = st.tuples(st.just("store"), st.integers(0, 80), st.sampled_from([0, 0, 0, 0, 1, 5]),
                   st.sampled_from([1, 1, 1, 1, 2, 3, 12, 40]), st.sampled_from([False, False, False, True]))
_HIT = st.tuples(st.just("hit"), st.integers(0, 80), st.integers(1, 12), st.integers(1, 6))
_SELECTION = st.tuples(st.sampled_from(["evict", "evict", "victims", "rounds", "verified"]), st.integers(1, 40),
                       st.sampled_from([1, 1, 2, 3, 5, 8, 0]), st.sampled_from([None, None, None, 0, 3, 20]),
                       st.lists(st.integers(0, 199), max_size=3))
_SELECT_OPS = st.lists(st.one_of(
    _STORE, _STORE, _STORE, _STORE, _HIT, _HIT, _SELECTION, _SELECTION,
    st.tuples(st.just("age"), st.sampled_from([100, 5000, 1 << 40, 1 << 60])),
    st.tuples(st.just("pin"), st.integers(0, 12)),
    st.tuples(st.just("unpin"), st.integers(0, 40)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 199), min_size=1, max_size=4)),
), min_size=10, max_size=80)


class _AskedError(Exception):
    """The predicate's refusal to answer."""


def _refuses(every: int, parked: list[int]) -> Any:
    """Whether the predicate of ``every`` refuses a block: every ``every``-th block id (1: none), and the parked."""
    refused = set(parked)
    return lambda block: block in refused or (every > 1 and block % every == 1)


def _predicate(refuses: Any, every: int, raise_at: int | None, log: list[int]) -> Any:
    """An evictable predicate that logs each block asked: false where ``refuses``, and where ``every`` is 0
    at every third question (a block refused once may be taken later), raising ``_AskedError`` at its
    ``raise_at``-th question (counted from 0; ``None``: never)."""
    def evictable(block: int) -> bool:
        if len(log) == raise_at:
            raise _AskedError(block)
        log.append(block)
        return not refuses(block) and (every or len(log) % 3)
    return evictable


def _select(policy: HitDensityPolicy, op: tuple[Any, ...], parked: list[int], tracked: list[int]) -> Any:
    """One selection of ``op`` on ``policy``: what it returned or raised, the chosen blocks in order, the
    blocks asked."""
    how, n, every, raise_at, picks = op
    log: list[int] = []
    refuses = _refuses(every, parked)
    evictable = _predicate(refuses, every, raise_at, log)
    chosen: dict[int, None] = {}
    try:
        if how in ("evict", "victims"):
            outcome: Any = ("returned", policy.select_victims(n, evictable))
        else:  # "verified" as select_victims finds it: every list end evictable (else a root may never go)
            verified = how == "verified" and every and not any(refuses(end) for end in policy._ends if end != -1)
            chosen.update(dict.fromkeys(tracked[pick % len(tracked)] for pick in picks if tracked))
            outcome = ("returned", policy._selection.select_rounds(policy, n, evictable, chosen, verified))
    except _AskedError as error:
        outcome = ("raised", error.args)
    return outcome, list(chosen), log


@pytest.mark.skipif(selection.LOOPS.compiled is None, reason="the compiled selection was not built")
@settings(max_examples=300, deadline=None)
@example(ops=[("store", 0, 0, 30, False), ("hit", 0, 6, 3), ("store", 1, 0, 40, False), ("store", 2, 3, 20, False),
              ("hit", 2, 12, 2), ("store", 3, 0, 30, False), ("evict", 25, 1, None, []),
              ("victims", 30, 3, None, [])], capacity=4)  # runs, walks and orphans after refreshes
@given(ops=_SELECT_OPS, capacity=st.sampled_from([None, 4, 16]))
def test_compiled_selection_is_the_reference(ops: list[tuple[Any, ...]], capacity: int | None) -> None:
    """Two policies take the same calls, one selecting through the compiled rounds, one through the
    reference. Small capacities refresh the model often (densities differ by class and age bucket): every
    selection returns or raises the same, leaves the same blocks chosen in the same order, asks the
    predicate about the same blocks in the same order, and leaves the same state (the chain index's kept
    walk included)."""
    _drive_selections(ops, capacity)


def _workload(rng: random.Random, length: int) -> list[tuple[Any, ...]]:
    """``length`` operations of ``_SELECT_OPS``'s kinds, most of them stores of a block or two of many
    conversations (leaves: the runs of a class list) and hits (reuse levels, refreshes), then evictions."""
    ops: list[tuple[Any, ...]] = []
    for _ in range(length):
        kind = rng.choices(["store", "hit", "select", "pin", "unpin", "remove", "age"], [10, 4, 4, 1, 1, 1, 1])[0]
        if kind == "store":
            ops.append(("store", rng.randrange(120), rng.choice([0, 0, 0, 1, 5]), rng.choice([1, 1, 1, 2, 3, 12]),
                        rng.random() < 0.1))
        elif kind == "hit":
            ops.append(("hit", rng.randrange(120), rng.randrange(1, 8), rng.randrange(1, 4)))
        elif kind == "select":
            ops.append((rng.choice(["evict", "evict", "evict", "victims", "rounds", "verified"]), rng.randrange(1, 60),
                        rng.choice([1, 1, 1, 2, 5, 0]), rng.choice([None] * 8 + [0, 7, 40]),
                        [rng.randrange(200) for _ in range(rng.randrange(3))]))
        elif kind == "pin":
            ops.append(("pin", rng.randrange(12)))
        elif kind == "unpin":
            ops.append(("unpin", rng.randrange(40)))
        elif kind == "remove":
            ops.append(("remove", [rng.randrange(200) for _ in range(rng.randrange(1, 4))]))
        else:
            ops.append(("age", rng.choice([100, 5000, 1 << 40])))
    return ops


@pytest.mark.skipif(selection.LOOPS.compiled is None, reason="the compiled selection was not built")
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), capacity=st.sampled_from([4, 16, 64]))
def test_compiled_selection_under_a_workload_is_the_reference(seed: int, capacity: int) -> None:
    """As the test above, on a longer workload of many short conversations whose pool stays full: class
    lists with long runs of leaves, selections of many victims at once, densities refreshed often."""
    _drive_selections(_workload(random.Random(seed), 400), capacity)


def _odd(policy: HitDensityPolicy, oddity: str) -> tuple[Any, Any, bool]:
    """Make ``policy`` (or the call's arguments) odd as ``oddity`` says: the count, ``chosen`` and ``verified``."""
    n: Any = 9
    chosen: Any = {}
    verified: Any = False
    table = policy._model._table
    if "density" in oddity or "table" in oddity:
        n = len(policy)  # past the orphans: the streams read the table
    if oddity == "clock past 64 bits":
        policy._clock += 1 << 64
    elif oddity == "a NaN density":
        table[:, :] = math.nan
    elif oddity in ("NaN densities of a listed class", "NaN densities of an empty class"):
        ends = policy._ends
        listed = [ends[2 * c] != -1 or ends[2 * c + 1] != -1 for c in range(len(ends) // 2)]
        table[listed.index(oddity.endswith("listed class")), :] = math.nan
    elif oddity == "an int density":
        policy._model._table = table.astype(np.int64)
    elif oddity == "a table too short":
        policy._model._table = table[:, :-1].copy()
    elif oddity == "a table not contiguous":
        policy._model._table = np.asfortranarray(table)
    elif oddity == "a bool count":
        n = True
    elif oddity == "a dict subclass":
        chosen = OrderedDict()
    elif oddity == "verified an int":
        verified = 1
    return n, chosen, verified


@pytest.mark.skipif(selection.LOOPS.compiled is None, reason="the compiled selection was not built")
@pytest.mark.parametrize("oddity", ["clock past 64 bits", "a NaN density", "NaN densities of a listed class",
                                    "NaN densities of an empty class", "an int density", "a table too short",
                                    "a table not contiguous",
                                    "a bool count", "a dict subclass", "verified an int"])
def test_compiled_selection_runs_the_reference_on_odd_state(oddity: str) -> None:
    """A state the policy never keeps, or arguments select_victims never passes: the compiled rounds run
    the reference, which returns or raises as it does, with the same blocks chosen and the same state."""
    setup = [HitDensityPolicy(capacity=4) for _ in range(2)]
    _drive_selections_on(setup, _workload(random.Random(7), 120))
    assert setup[0].model.table is not None
    outcomes, states = [], []
    for rounds in (selection.LOOPS.compiled, selection.LOOPS.reference):
        policy = copy.deepcopy(setup[0])
        n, chosen, verified = _odd(policy, oddity)
        log: list[int] = []
        evictable = _predicate(_refuses(1, []), 1, None, log)  # every end evictable: verified may be true
        outcome = _outcome_any(rounds.select_rounds, policy, n, evictable, chosen, verified)
        outcomes.append((outcome, list(chosen), log))
        states.append(_state(policy))
    assert outcomes[0] == outcomes[1]
    assert states[0] == states[1]


@attrs.define
class _World:
    """What two twins driven alike hold: free block ids, each tracked hash's block, the blocks parked."""

    free: list[int] = attrs.Factory(lambda: list(range(200)))
    block_of: dict[int, int] = attrs.Factory(dict)  # hash -> its tracked block
    parked: list[int] = attrs.Factory(list)

    def apply(self, twins: list[Any], op: tuple[Any, ...]) -> bool:
        """Run a store, hit, pin or unpin on both twins, through their batch hooks where they have them
        (hit density), else block by block (prefix-LRU, FIFO); ``False`` for any other op."""
        if op[0] == "store":
            _, conversation, start, n, pinned = op
            hashes = [h for h in (_hash(conversation, i) for i in range(start, start + n)) if h not in self.block_of]
            hashes = hashes[:len(self.free)]
            parents = [h - 1 if h % 1000 != 1 else None for h in hashes]
            blocks = [self.free.pop() for _ in hashes]
            self.block_of.update(zip(hashes, blocks))
            for policy in twins:
                if pinned and hasattr(policy, "insert_pinned"):
                    policy.insert_pinned(blocks, hashes, parents)
                else:
                    for block, block_hash, parent in zip(blocks, hashes, parents):
                        policy.on_insert(block, block_hash, parent)
                        if pinned:
                            policy.on_pin(block)
            if pinned:
                self.parked += blocks
        elif op[0] == "hit":
            _, conversation, length, times = op  # hit often: reuse counts climb past the first levels
            hit = [self.block_of[h] for h in (_hash(conversation, i) for i in range(length)) if h in self.block_of]
            for policy in twins:
                if hasattr(policy, "access_many"):
                    policy.access_many(hit * times)
                else:
                    for block in hit * times:
                        policy.on_access(block)
        elif op[0] == "pin":
            pinning = [block for block in self.block_of.values() if block not in self.parked][:op[1]]
            for policy in twins:
                if hasattr(policy, "pin_many"):
                    policy.pin_many(pinning)
                else:
                    for block in pinning:
                        policy.on_pin(block)
            self.parked += pinning
        elif op[0] == "unpin":
            leaving, self.parked = self.parked[:op[1]], self.parked[op[1]:]
            for policy in twins:
                if hasattr(policy, "unpin_many"):
                    policy.unpin_many(leaving)
                else:
                    for block in leaving:
                        policy.on_unpin(block)
        else:
            return False
        return True

    def remove(self, twins: list[Any], gone: list[int]) -> None:
        """Remove ``gone`` from both twins (in one call where they batch) and from the world."""
        for policy in twins:
            if hasattr(policy, "remove_many"):
                policy.remove_many(gone)
            else:
                for block in gone:
                    policy.on_remove(block)
        left = set(gone)
        for block_hash in [h for h, block in self.block_of.items() if block in left]:
            del self.block_of[block_hash]
        self.parked = [block for block in self.parked if block not in left]
        self.free += gone


def _drive_selections(ops: list[tuple[Any, ...]], capacity: int | None) -> None:
    """Run ``ops`` on two policies, the second selecting through the reference; after each, both agree."""
    twins = [HitDensityPolicy(capacity=capacity) for _ in range(2)]
    twins[1]._selection = selection.LOOPS.reference
    _drive_selections_on(twins, ops)


def _drive_selections_on(twins: list[HitDensityPolicy], ops: list[tuple[Any, ...]]) -> None:
    """Run ``ops`` on ``twins``; after each, they agree (what selections return, choose and ask, and the state)."""
    world = _World()
    for op in ops:
        if world.apply(twins, op):
            pass
        elif op[0] == "age":  # time passes without a reference: ages past the last bucket's first age
            for policy in twins:
                if policy._clock < 1 << 61:
                    policy._clock += op[1]
        else:
            tracked = sorted(world.block_of.values())
            if op[0] == "remove":
                gone = list(dict.fromkeys(tracked[pick % len(tracked)] for pick in op[1] if tracked))
            else:
                outcomes = [_select(policy, op, world.parked, tracked) for policy in twins]
                assert outcomes[0] == outcomes[1], op
                result = outcomes[0][0]
                gone = result[1] if op[0] == "evict" and result[0] == "returned" and result[1] else []
            if gone:
                world.remove(twins, gone)
        assert _state(twins[0]) == _state(twins[1]), op
    for policy in twins:
        policy.check_invariants()


def _outcome_any(call: Any, *args: Any) -> tuple[str, Any]:
    """What ``call(*args)`` returned, or the type and message of any exception it raised."""
    try:
        return "returned", call(*args)
    except Exception as error:  # noqa: BLE001 (both twins must raise alike)
        return "raised", (type(error), str(error))


@settings(max_examples=100, deadline=None)
@given(ops=_OPS, capacity=st.sampled_from([None, 4, 16]))
def test_hit_density_on_compiled_chain_loops_is_the_reference(ops: list[tuple[Any, ...]],
                                                              capacity: int | None) -> None:
    """Two hit-density policies, one's chain index on the compiled loops, one's on the references: stores
    (one block at a time or a parked batch), hits, unpins and evictions leave the same state."""
    twins = [HitDensityPolicy(capacity=capacity), HitDensityPolicy(capacity=capacity)]
    _reference(twins[1]._chains)
    _drive(twins, ops, _state)


def _prefix_lru_state(policy: PrefixLRUPolicy) -> dict[str, Any]:
    return {"order": list(policy._order), "parked": list(policy._parked), "marks": bytes(policy._marks),
            "chains": _chains_state(policy._chains)}


@settings(max_examples=100, deadline=None)
@given(ops=_OPS)
def test_prefix_lru_on_compiled_chain_loops_is_the_reference(ops: list[tuple[Any, ...]]) -> None:
    """Two prefix-LRU policies, one's chain index on the compiled loops, one's on the references (each
    insert and removal a batch of one): the same calls leave the same state."""
    twins = [PrefixLRUPolicy(), PrefixLRUPolicy()]
    _reference(twins[1]._chains)
    _drive(twins, ops, _prefix_lru_state)


def _drive(twins: list[Any], ops: list[tuple[Any, ...]], state: Any) -> None:
    """Run ``ops`` on both policies (stores, hits, pins, unpins, evictions: :class:`_World`); after each,
    ``state`` of both agrees."""
    world = _World()
    for op in ops:
        if not world.apply(twins, op):
            unpinned = set(range(200)).difference(world.parked).__contains__
            chosen = [policy.select_victims(op[1], unpinned) for policy in twins]
            assert chosen[0] == chosen[1]
            if chosen[0]:
                world.remove(twins, chosen[0])
        assert state(twins[0]) == state(twins[1])
    for policy in twins:
        policy.check_invariants()


# -- the parking queue ------------------------------------------------------------------------------------

_Q = 12  # block ids on a queue's slots at first; ids past them make the slots grow
_BLOCK = st.one_of(st.integers(0, _Q - 1), st.sampled_from([-1, _Q + 2]))
_QUEUE_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 1), _BLOCK, st.booleans()),
    st.tuples(st.just("add_many"), st.integers(0, 1), st.lists(_BLOCK, max_size=5),
              st.lists(st.one_of(st.booleans(), st.booleans(), st.sampled_from([0, 1, None])), max_size=5), _KINDS),
    st.tuples(st.just("add_pinned_many"), st.integers(0, 1), st.lists(_BLOCK, max_size=5), _KINDS),
    st.tuples(st.just("pin"), st.integers(0, 1), _BLOCK),
    st.tuples(st.just("pin_many"), st.integers(0, 1), st.lists(_BLOCK, max_size=5), _KINDS),
    st.tuples(st.just("unpin"), st.integers(0, 1), _BLOCK),
    st.tuples(st.just("unpin_many"), st.integers(0, 1), st.lists(_BLOCK, max_size=5), _KINDS),
    st.tuples(st.just("remove"), st.integers(0, 1), _BLOCK),
    st.tuples(st.just("remove_many"), st.integers(0, 1), st.lists(_BLOCK, max_size=5), _KINDS),
    st.tuples(st.just("touch"), st.integers(0, 1), _BLOCK),
    st.tuples(st.just("touch_many"), st.integers(0, 1), st.lists(_BLOCK, max_size=5), _KINDS),
    st.tuples(st.just("watch"), st.integers(0, 1), st.integers(0, 3)),
    st.tuples(st.just("entered"), st.integers(0, 1)),
    st.tuples(st.just("first"), st.integers(0, 1), st.integers(-1, 6), st.booleans()),
), max_size=60)


def _queues(shared: bool, loops: _queue.QueueLoops) -> list[ParkingQueue]:
    """One queue alone on its slots, or two sharing theirs (wide states), on ``loops``."""
    if shared:
        slots = Slots(shared=True)
        queues = [ParkingQueue.of("owner", slots), ParkingQueue.of("owner", slots)]
    else:
        queues = [ParkingQueue.of("owner")]
    for queue in queues:
        queue._slots.grow(_Q - 1)
        queue._loops = loops
    return queues


def _no_minus_one(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pin's block, or a batch's blocks, with -1 read as an id past the slots."""
    if isinstance(args[0], list):
        return ([_Q + 2 if b == -1 else b for b in args[0]], *args[1:])
    return (_Q + 2 if args[0] == -1 else args[0],)


def _queues_state(queues: list[ParkingQueue]) -> list[dict[str, Any]]:
    return [queue_state(queue) for queue in queues]


@pytest.mark.skipif(_queue.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=400, deadline=None)
@example(ops=[("add", 0, 1, False), ("add", 0, 2, False), ("pin_many", 0, [1, 2], list),
              ("unpin_many", 0, [2, 1], list), ("first", 0, 3, True)], shared=False)  # a release out of order
@example(ops=[("add", 0, 1, False), ("watch", 0, 1), ("pin", 0, 1), ("watch", 0, 0),
              ("unpin_many", 0, [1], tuple), ("remove_many", 0, [1], list)], shared=False)  # an edge past a pin
@example(ops=[("add", 0, 0, False), ("add", 0, 1, False), ("watch", 0, 1), ("remove_many", 0, [0], list)],
         shared=False)  # the window's last block leaves
@example(ops=[("add", 0, 0, True), ("watch", 0, 1), ("unpin_many", 0, [0], list)], shared=False)  # it joins
@example(ops=[("add", 0, 0, False), ("add", 0, 1, False), ("watch", 0, 1), ("pin_many", 0, [0], list)],
         shared=False)  # the window moves on
@example(ops=[("add", 0, 0, False), ("first", 0, 0, True)], shared=False)  # none asked: the pending block waits
@example(ops=[("add", 0, 0, False), ("add", 0, 1, False), ("add", 0, 2, False), ("first", 0, 2, True)],
         shared=False)  # the first block is not evictable: the walk asks again
@example(ops=[("watch", 0, 1), ("add_pinned_many", 0, [0], list)], shared=False)  # it joins, then leaves
@example(ops=[("add", 0, 0, True), ("pin_many", 0, [0], list)], shared=True)  # pinned twice: refused
@example(ops=[("add_many", 0, [0, 1, 2, 3], [False, True, False, False], list), ("first", 0, 4, True)],
         shared=False)  # unpinned and pinned alike, each unpinned one linked by the next
@example(ops=[("add", 0, 5, False), ("add_many", 0, [1, 5, 2, _Q + 2], [True, False, 1, False], tuple),
              ("first", 0, 4, True)], shared=True)  # a tracked block refused, those before it added
@example(ops=[("watch", 0, 2), ("add_many", 0, [0, 1, 2], [False, True, False], list)], shared=False)  # watched
@example(ops=[("add_many", 0, [0, 1, 2], [True, False], UserList)], shared=False)  # two flags: two blocks
@example(ops=[("add", 0, 0, False), ("add", 0, 1, True), ("add", 0, 2, False), ("add", 0, 2, True),
              ("first", 0, 3, True)], shared=True)  # a pending block linked first, a tracked one refused
@example(ops=[("add", 0, 0, False), ("add", 0, 1, True), ("add", 0, 2, False), ("watch", 0, 1),
              ("touch_many", 0, [2, 1, 0, 2, 5], list), ("first", 0, 3, True)], shared=True)  # listed, parked,
@example(ops=[("add", 0, 0, False), ("add", 0, 1, False), ("touch_many", 0, [0, 0, 1], tuple),  # watched, absent
              ("pin", 0, 1), ("unpin_many", 0, [1], list), ("touch_many", 0, [1, 0], list)], shared=False)
@given(ops=_QUEUE_OPS, shared=st.booleans())
def test_compiled_queue_loops_are_the_references(ops: list[tuple[Any, ...]], shared: bool) -> None:
    """Two sets of queues take the same calls, one running the compiled loops, one the references (a single
    ``add`` is the set's own, the method in the references): every call returns or raises the same, and
    after it both hold the same state (the slot arrays, the side list chunk by chunk, stamps, the clock, the
    window). Batches come as lists, tuples or another sequence (the compiled loop hands that to the
    reference); watched windows, ids past the slots, refusals, odd ids and flags other than bools run the
    references' general cases."""
    _run_queue_twins(ops, shared)


@pytest.mark.skipif(_queue.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=300, deadline=None)
@example(ops=[("add_many", 0, list(range(10)), [False] * 10, list), ("pin_many", 0, list(range(10)), list),
              ("unpin_many", 0, list(range(9, -1, -1)), list), ("first", 0, 6, True), ("first", 0, 6, False),
              ("remove_many", 0, [3, 5, 9], list), ("pin_many", 0, [0, 7, 8], tuple), ("first", 0, 6, True)],
         shared=False, chunk=2)  # released youngest first: nine keys into the side list's first chunk, split twice
@given(ops=_QUEUE_OPS, shared=st.booleans(), chunk=st.sampled_from([1, 2]))
def test_compiled_queue_loops_split_and_empty_side_list_chunks_as_the_references(
        ops: list[tuple[Any, ...]], shared: bool, chunk: int) -> None:
    """As :func:`test_compiled_queue_loops_are_the_references` with side-list chunks of one or two keys: the
    compiled loops split full chunks, drop empty ones and merge walks across chunks as the references do."""
    default, _SortedKeys.chunk = _SortedKeys.chunk, chunk
    try:
        _run_queue_twins(ops, shared)
    finally:
        _SortedKeys.chunk = default


@pytest.mark.skipif(_queue.LOOPS.compiled is None, reason="the compiled loops were not built")
def test_compiled_queue_loops_past_a_clock_of_2_to_the_31_are_the_references() -> None:
    """Side-list keys of stamps past 2**31 exceed a long long: once the clock passes it the compiled loops leave the
    side list to the references, keys of earlier stamps included, and both twins stay alike."""
    twins = [_queues(False, _queue.LOOPS.compiled), _queues(False, _queue.LOOPS.reference)]
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("add_many", ([0, 1, 2, 3], [False] * 4)), ("pin_many", ([0, 1, 2, 3],)), ("unpin_many", ([3, 0],)),
        ("reserve", (2**31,)), ("add_many", ([4, 5, 6], [False] * 3)), ("pin_many", ([4, 5, 6],)),
        ("unpin_many", ([6, 4, 1],)), ("first", (5, _evictable)), ("first", (9, any_block)),
        ("remove_many", ([0, 4],)), ("pin_many", ([1, 6],)), ("first", (9, any_block)), ("unpin_many", ([1, 2],)),
        ("remove_many", ([1, 2, 3, 5, 6],)), ("first", (9, any_block)),
    ]
    for name, args in calls:
        outcomes = [_outcome(getattr(queues[0], name), *args) for queues in twins]
        assert outcomes[0] == outcomes[1], name
        assert _queues_state(twins[0]) == _queues_state(twins[1]), name
    for queues in twins:
        queues[0].check_invariants()


def _run_queue_twins(ops: list[tuple[Any, ...]], shared: bool) -> None:
    assert _queue.LOOPS.compiled is not None
    twins = [_queues(shared, _queue.LOOPS.compiled), _queues(shared, _queue.LOOPS.reference)]
    for op in ops:
        outcomes = []
        for queues in twins:
            queue = queues[op[1] % len(queues)]
            name, args = op[0], op[2:]
            if name in ("pin", "pin_many"):  # (ParkingQueue.pin(-1) with no block pending parks the last
                args = _no_minus_one(args)       # slot: a quirk of the reference's per-block pin, run by both)
            if name in ("add_pinned_many", "pin_many", "unpin_many", "remove_many", "touch_many"):
                args = (args[1](args[0]),)
            elif name == "add_many":  # blocks and their flags, paired to the shorter's end
                args = (args[2](args[0]), args[2](args[1]))
            elif name == "first":
                args = (args[0], _evictable if args[1] else any_block)
            call = getattr(queue._loops, name) if name == "add" else getattr(queue, name)
            outcomes.append(_outcome(call, queue, *args) if name == "add" else _outcome(call, *args))
        assert outcomes[0] == outcomes[1], op
        assert _queues_state(twins[0]) == _queues_state(twins[1]), op
    for queues in twins:
        for queue in queues:
            queue.check_invariants()


def _fifo_state(policy: FIFOPolicy) -> dict[str, Any]:
    return queue_state(policy)


@pytest.mark.skipif(_queue.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=100, deadline=None)
@given(ops=_OPS, kind=st.sampled_from([LRUPolicy, FIFOPolicy]))
def test_lru_and_fifo_on_compiled_queue_loops_are_the_references(ops: list[tuple[Any, ...]],
                                                                 kind: type[FIFOPolicy]) -> None:
    """Two LRU (or FIFO) policies, one's queue on the compiled loops, one's on the references: stores (a
    pinned batch or one block at a time), hits, pins, unpins and evictions leave the same state."""
    twins = [kind(), kind()]
    twins[1]._loops = _queue.LOOPS.reference
    _drive(twins, ops, _fifo_state)


@pytest.mark.skipif(_queue.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=100, deadline=None)
@given(ops=_OPS, capacity=st.sampled_from([None, 4, 16]))
def test_hit_density_on_compiled_queue_loops_is_the_reference(ops: list[tuple[Any, ...]],
                                                              capacity: int | None) -> None:
    """Two hit-density policies whose orphan queues differ only in their loops (compiled, references):
    the same calls leave the same state, the orphans' included."""
    twins = [HitDensityPolicy(capacity=capacity), HitDensityPolicy(capacity=capacity)]
    twins[1]._chains._orphans._loops = _queue.LOOPS.reference
    _drive(twins, ops, _state)


@pytest.mark.skipif(_queue.LOOPS.compiled is None, reason="the compiled loops were not built")
@settings(max_examples=100, deadline=None)
@given(ops=_OPS)
def test_prefix_lru_on_compiled_queue_loops_is_the_reference(ops: list[tuple[Any, ...]]) -> None:
    """Two prefix-LRU policies whose orphan queues differ only in their loops: the same calls leave the
    same state."""
    twins = [PrefixLRUPolicy(), PrefixLRUPolicy()]
    twins[1]._chains._orphans._loops = _queue.LOOPS.reference
    _drive(twins, ops, _prefix_lru_state)
