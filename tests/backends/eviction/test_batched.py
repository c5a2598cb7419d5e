"""A batched policy's batch hooks against its per-block hooks, the reference: same state, same decisions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkit.backends.allocator.pool import BlockPool
from kvkit.backends.eviction._chains import FlatChains
from kvkit.backends.eviction._queue import _SortedKeys
from kvkit.backends.eviction.fifo import FIFOPolicy
from kvkit.backends.eviction.hit_density import REUSE_LEVELS, HitDensityPolicy, booking
from kvkit.backends.eviction.hit_density.density import HitDensityModel
from kvkit.backends.eviction.hit_density.kernels import isotonic
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.errors import ConfigError, PoolUsageError
from kvkit.interfaces.capabilities import BatchedPolicy, batch_hooks

_CLASSES = 3 * len(REUSE_LEVELS)


class PerBlockHitDensity(HitDensityPolicy):
    """Hit density without the batch capability: a pool calls its per-block hooks, one block at a time,
    and it runs the pure-Python booking loops (the batched twin runs the compiled ones, where built)."""

    insert_pinned = pin_many = unpin_many = access_many = remove_many = None  # type: ignore[assignment]

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._booking = booking.LOOPS.reference
        self._ghost_at = {}


class PerBlockLRU(LRUPolicy):
    """LRU without the batch capability."""

    insert_pinned = pin_many = unpin_many = access_many = remove_many = None  # type: ignore[assignment]


class PerBlockFIFO(FIFOPolicy):
    """FIFO without the batch capability."""

    insert_pinned = pin_many = unpin_many = access_many = remove_many = None  # type: ignore[assignment]


# Each batched policy beside its per-block reference, as factories of a pool's policy.
PAIRS = {
    "lru": (LRUPolicy, PerBlockLRU),
    "fifo": (FIFOPolicy, PerBlockFIFO),
    "hit-density": (lambda: HitDensityPolicy(ghost_span=2), lambda: PerBlockHitDensity(ghost_span=2)),
    "hit-density-8": (lambda: HitDensityPolicy(capacity=8, ghost_span=2),
                      lambda: PerBlockHitDensity(capacity=8, ghost_span=2)),
}


@pytest.mark.parametrize("name", PAIRS)
def test_batched_policies_and_their_opt_outs(name: str) -> None:
    batched, per_block = (make() for make in PAIRS[name])
    assert isinstance(batched, BatchedPolicy)
    assert batch_hooks(batched) is batched
    assert batch_hooks(per_block) is None


def test_half_a_batch_capability_is_refused() -> None:
    class Half(HitDensityPolicy):
        remove_many = None  # type: ignore[assignment]

    with pytest.raises(ConfigError, match="remove_many=None"):
        batch_hooks(Half())
    with pytest.raises(ConfigError, match="batch hooks"):
        BlockPool(num_blocks=4, eviction=Half())


def _hash(conversation: int, position: int) -> int:
    return conversation * 1000 + position + 1


def _snapshot(pool: BlockPool) -> tuple[Any, ...]:
    """The pool's next victims and write-back window, and everything the policy's decisions read."""
    policy = pool.policy
    order = (pool.eviction_candidates(pool.num_blocks), pool.eviction_window(3),
             [pool.in_eviction_window(b) for b in range(pool.num_blocks)], len(policy))
    if isinstance(policy, FIFOPolicy):  # the queue's order, its pins, and its side list chunk by chunk
        return (*order, policy.in_order(), policy.pinned, policy._back._chunks, policy._back._maxes)
    assert isinstance(policy, HitDensityPolicy)
    tracked = [b for b in range(pool.num_blocks) if pool.is_ready(b)]
    return (*order,
        tracked,
        [(policy.class_of(b), policy.uses_of(b), policy.density_of(b)) for b in tracked],
        [policy.class_blocks(cls) for cls in range(_CLASSES)],
        policy.pinned, policy.num_ghosts, policy.shifts, len(policy), policy.model.rows,
        policy.model.reuses.tolist(), policy.model.ends.tolist(),
        policy._turnover, policy._evictions, policy._recent, policy._ghost_recent,  # what the ghosts' returns read
    )


_OPS = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, 5), st.integers(0, 8), st.integers(1, 6)),
    st.tuples(st.just("hit"), st.integers(0, 5), st.integers(1, 10)),
    st.tuples(st.just("release"), st.integers(0, 30)),
), max_size=120)


@pytest.mark.parametrize("name", PAIRS)
@settings(max_examples=40, deadline=None)
@given(ops=_OPS, size=st.integers(4, 24))
def test_batch_hooks_match_the_per_block_hooks(name: str, ops: list[tuple[Any, ...]], size: int) -> None:
    """Two pools run the same calls, one telling its policy per call (batched), one per block: every
    answer (victims, hits, commits, write-back windows) and the policies' observable state stay equal."""
    pools = [BlockPool(num_blocks=size, eviction=make()) for make in PAIRS[name]]
    held: list[list[int]] = []  # references taken, released together
    for op in ops:
        if op[0] == "store":
            _, conversation, start, n = op
            if n > pools[0].num_free:
                continue
            hashes = [_hash(conversation, i) for i in range(start, start + n)]
            parents = [_hash(conversation, i - 1) if i else None for i in range(start, start + n)]
            answers = []
            for pool in pools:
                blocks = pool.allocate(n)
                answers.append((blocks, pool.commit(blocks, hashes, parents)))
            assert answers[0] == answers[1]
            held.append(answers[0][0])
        elif op[0] == "hit":
            _, conversation, length = op
            hashes = [_hash(conversation, i) for i in range(length)]
            found = [pool.lookup(hashes) for pool in pools]
            assert found[0] == found[1]
            if found[0]:
                for pool in pools:
                    pool.incref(found[0])
                    pool.touch(found[0])
                held.append(found[0])
        elif held:
            blocks = held.pop(op[1] % len(held))
            for pool in pools:
                pool.decref(blocks)
        assert _snapshot(pools[0]) == _snapshot(pools[1])
    for pool in pools:
        pool.check_invariants()


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 6), rounds=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8)), max_size=12))
def test_hit_density_remove_many_is_remove_one_by_one(capacity: int, rounds: list[tuple[int, int]]) -> None:
    """Removing blocks in one call leaves the same removal statistics (the turnover, each ghost's eviction
    number) as removing them in turn, before and after the pool's size in removals is reached."""
    twins = [HitDensityPolicy(capacity=capacity, ghost_span=2) for _ in range(2)]
    tracked: list[int] = []
    block = 0
    for stored, removed in rounds:
        for _ in range(stored + 1):  # ticks pass between removals: the first removal of a call has a gap
            for policy in twins:
                policy.on_insert(block, block + 1, None)
            tracked.append(block)
            block += 1
        leaving, tracked = tracked[:removed], tracked[removed:]
        batched, one_by_one = twins
        batched.remove_many(leaving)
        for b in leaving:
            one_by_one.on_remove(b)
        assert (batched._turnover, batched._evictions, batched._ghost_at) == \
            (one_by_one._turnover, one_by_one._evictions, one_by_one._ghost_at)
        batched.check_invariants()


@settings(max_examples=150, deadline=None)
@given(hits=st.lists(st.one_of(st.integers(0, 9), st.sampled_from([-1, 10, 40, 2.0, True, "3"])), max_size=30),
       due=st.integers(1, 24), worn=st.booleans(), leap=st.sampled_from([0, 0, 1 << 45]))
def test_hit_density_access_many_is_access_one_by_one(hits: list[Any], due: int, worn: bool, leap: int) -> None:
    """Hits in one call count as hits one at a time with the reference booking: the same state, a refresh
    falling due inside the call included (``due``: the ticks left until it), reuse counts saturating
    (``worn``: two blocks hit 254 times, one short of the cap), ages in the last age bucket (``leap``: ticks
    passed elsewhere, a refresh due at once). A block not tracked (an id never stored,
    one past the arrays, no int) is refused quoting it, the hits before it counted."""
    twins = [HitDensityPolicy(capacity=2, ghost_span=2) for _ in range(2)]
    twins[1]._booking = booking.LOOPS.reference
    twins[1]._ghost_at = {}
    for policy in twins:
        for block in range(8):  # hash block + 1 under parent hash block (block 0's: 1), a chain head every 4
            policy.on_insert(block, block + 1, block if block % 4 else None)
        policy._grow(12)  # blocks 8 to 11 are in the arrays, never stored
        if worn:
            policy.access_many([0, 5] * 254)
        policy.access_many([block % 8 for block in range(max(0, policy._next_refresh - policy._clock - due))])
        policy._clock += leap
    outcomes = []
    batched, one_by_one = twins
    for call in (lambda: batched.access_many(hits), lambda: [one_by_one.on_access(block) for block in hits]):
        try:
            call()
        except PoolUsageError as error:
            outcomes.append(str(error))
        else:
            outcomes.append(None)
    assert outcomes[0] == outcomes[1]
    seen = [(p._clock, p._reused, p._recent, bytes(p._uses), bytes(p._cls), bytes(p._last),
             [p.class_blocks(c) for c in range(_CLASSES)], p.model.rows, p.model.reuses.tolist(), p._shift._window,
             p._shift._held, p._shift._history.tolist(), list(p._shift._pool), list(p._shift._decayed))
            for p in twins]
    assert seen[0] == seen[1]
    for policy in twins:
        policy.check_invariants()


def _chains_view(chains: FlatChains, size: int) -> tuple[Any, ...]:
    tracked = [b for b in range(size) if chains.tracks(b)]
    walk = chains.orphans()
    return (tracked, [chains.links(b) for b in tracked], [chains.children(b) for b in tracked],
            [] if walk is None else list(walk))


@settings(max_examples=200, deadline=None)
@given(parents=st.lists(st.integers(-1, 30), min_size=2, max_size=30), data=st.data())
def test_chains_remove_many_is_remove_one_by_one(parents: list[int], data: st.DataObject) -> None:
    """Removing blocks in one call leaves the chain index exactly as removing them in turn, orphans'
    order included, though a child leaving with its parent never joins the orphans in between."""
    size = len(parents)
    twins = [FlatChains(bytearray(size)) for _ in range(2)]
    for chains in twins:
        chains.grow(size)
        for block, parent in enumerate(parents):  # block b's hash is b + 1; parent -1: a chain's head
            chains.add(None, block, block + 1, None if parent < 0 else parent % (size + 3) + 1)
    leaving = data.draw(st.lists(st.sampled_from(range(size)), unique=True, min_size=2))
    batched, one_by_one = twins
    assert batched.remove_many(None, leaving) == [one_by_one.remove(None, b) for b in leaving]
    assert _chains_view(batched, size) == _chains_view(one_by_one, size)
    batched.check_invariants()
    for chains in twins:  # the hashes back: the orphans that waited for them rejoin in their rings' order
        for block in leaving:
            chains.add(None, block, block + 1, None)
    assert _chains_view(batched, size) == _chains_view(one_by_one, size)
    batched.check_invariants()


@settings(max_examples=200, deadline=None)
@given(links=st.lists(st.tuples(st.integers(0, 40), st.integers(-2, 40)), min_size=1, max_size=30),
       pinned=st.booleans())
def test_chains_add_many_is_add_one_by_one(links: list[tuple[int, int]], pinned: bool) -> None:
    """Adding blocks in one call leaves the chain index exactly as adding them in turn and reports, per
    block, its parent's block and whether it had children right after its own add; it stops at the first
    block refused (a block or hash tracked already), refusing it as add does."""
    size = 41
    twins = [FlatChains(bytearray(size)) for _ in range(2)]
    for chains in twins:
        chains.grow(size)
    batched, one_by_one = twins
    blocks = [block for block, _ in links]
    hashes = [block % 13 + 1 for block in blocks]  # hashes repeat: some adds are refused
    parents = [None if parent < 0 else (parent % 13 + 1 if parent % 2 else hashes[0]) for _, parent in links]
    parent_blocks, fresh, refusal = batched.add_many(None, blocks, hashes, parents, pinned)
    expected: list[tuple[int, bool]] = []
    error: PoolUsageError | None = None
    for block, block_hash, parent in zip(blocks, hashes, parents):
        try:
            parent_block = one_by_one.add(None, block, block_hash, parent, pinned)
        except PoolUsageError as refused:
            error = refused
            break
        expected.append((-1 if parent_block is None else parent_block, one_by_one.has_children(block)))
    assert str(refusal) == str(error)
    assert list(zip(parent_blocks, fresh)) == expected
    for chains in twins:  # the owner's marks of the blocks it parked as they entered
        for block in blocks[:len(expected)]:
            chains.parked[block] = FlatChains.PARKED if pinned else 0
    assert _chains_view(batched, size) == _chains_view(one_by_one, size)
    batched.check_invariants()


_ENDS = st.lists(st.tuples(st.integers(0, 1), st.sampled_from([0, 7, 1 << 20, 1 << 40])), max_size=300)


@settings(max_examples=100, deadline=None)
@given(before=_ENDS, ends=_ENDS, keep=st.floats(0.05, 1.0))
def test_model_batched_ends_are_ends_in_turn(before: list[tuple[int, int]], ends: list[tuple[int, int]],
                                            keep: float) -> None:
    """The hit-density model's batch of ended blocks adds exactly what one call per block adds, bit for
    bit, on histograms a refresh left fractional (adding ``k`` ones in turn is not adding ``k``)."""
    models = [HitDensityModel(3) for _ in range(2)]
    for model in models:
        for cls, age in before:
            model.record_end(cls, age)
        model.refresh(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), keep=keep)
    batched, one_by_one = models
    batched.record_ends([c for c, _ in ends], [a for _, a in ends])
    for cls, age in ends:
        one_by_one.record_end(cls, age)
    assert batched.ends.tobytes() == one_by_one.ends.tobytes()


@settings(max_examples=50, deadline=None)
@given(events=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 20_000), st.booleans()), min_size=1,
                       max_size=300))
def test_model_fits_disjoint_chains_together_as_one_by_one(events: list[tuple[int, int, bool]]) -> None:
    """Disjoint monotone chains of one length, fitted in one call, give the table each chain fitted alone
    gives, bit for bit; overlapping chains are fitted one after another, as listed."""
    chains = ((0, 2, 4), (1, 3, 5))
    models = [HitDensityModel(7, min_samples=1, monotone=monotone)
              for monotone in (chains, (), ((0, 2, 4), (4, 5, 6)))]
    free = models[1]
    for cls, age, reused in events:
        for model in models:
            (model.record_reuse if reused else model.record_end)(cls, age)
    at_risk = np.cumsum((free.reuses + free.ends)[:, ::-1], axis=1)[:, ::-1]
    for model in models:
        model.refresh(np.zeros(0, np.int64), np.zeros(0, np.int64), keep=1.0)
    assert free.table is not None
    alone, after = free.table.copy(), free.table.copy()
    for chain in map(list, chains):
        alone[chain] = isotonic(free.table[chain], at_risk[chain])
    assert models[0].table is not None and models[0].table.tobytes() == alone.tobytes()
    for chain in ([0, 2, 4], [4, 5, 6]):
        after[chain] = isotonic(after[chain], at_risk[chain])
    assert models[2].table is not None and models[2].table.tobytes() == after.tobytes()


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 6 * _SortedKeys.chunk), min_size=1, max_size=4 * _SortedKeys.chunk), st.data())
def test_side_list_remove_many_is_remove_one_by_one(keys: set[int], data: st.DataObject) -> None:
    """Removing a batch leaves the side list's chunks and maxima exactly as removing its keys one at a time."""
    ordered = sorted(keys)
    gone = data.draw(st.lists(st.sampled_from(ordered), unique=True))
    lists = [_SortedKeys(), _SortedKeys()]
    for side in lists:
        for key in data.draw(st.permutations(ordered)) if side is lists[0] else ordered:
            side.add(key)
    lists[1]._chunks = [list(c) for c in lists[0]._chunks]
    lists[1]._maxes = list(lists[0]._maxes)
    lists[0].remove_many(list(gone))
    for key in gone:
        lists[1].remove(key)
    assert lists[0]._chunks == lists[1]._chunks and lists[0]._maxes == lists[1]._maxes
    assert list(lists[0]) == [k for k in ordered if k not in set(gone)]


def _queue_view(policy: FIFOPolicy) -> tuple[Any, ...]:
    """Everything a queue policy's later answers depend on: order, pins, side list chunks, window, pending block."""
    return (policy.in_order(), sorted(policy.pinned), policy._back._chunks, policy._back._maxes, policy._pending,
            policy._head, policy._tail, policy._count, policy._edge, policy._cut, list(policy._entered), len(policy))


_QUEUE_OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.booleans()),  # a new block, pinned at once or not
    st.tuples(st.just("pin"), st.lists(st.integers(0, 63), max_size=12), st.booleans()),  # and a bad block?
    st.tuples(st.just("unpin"), st.integers(0, 63)),
    st.tuples(st.just("access"), st.integers(0, 63)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 63), min_size=1, max_size=6), st.booleans()),
    st.tuples(st.just("watch"), st.integers(0, 4)),
), max_size=150)


def _errors_of(many: Any, one: Any, blocks: list[int]) -> list[str]:
    """The messages of the errors a batch hook and the per-block hook, called on ``blocks`` in turn, raise."""
    errors = []
    try:
        many(blocks)
    except PoolUsageError as exc:
        errors.append(str(exc))
    try:
        for block in blocks:
            one(block)
    except PoolUsageError as exc:
        errors.append(str(exc))
    return errors


@pytest.mark.parametrize("policy_class", [LRUPolicy, FIFOPolicy])
@settings(max_examples=150, deadline=None)
@given(ops=_QUEUE_OPS)
def test_queue_batches_are_calls_one_by_one(policy_class: type[FIFOPolicy], ops: list[tuple[Any, ...]]) -> None:
    """Pins and removals of listed, side-listed and just-inserted blocks, in batches, leave the queue (side
    list chunks, watched window and noted entries included) exactly as pinning or removing them one at a
    time; a bad block raises the same error with the blocks before it pinned or removed."""
    batched, single = policy_class(), policy_class()
    pinned: set[int] = set()
    tracked: list[int] = []
    # A start with a side list: eight blocks, two pinned and the older one released out of order.
    prelude: list[tuple[Any, ...]] = [("insert", False)] * 8 + [("pin", [2, 5], False), ("unpin", 0)]
    for op in prelude + ops:
        if op[0] == "insert":
            block = next(b for b in range(64) if b not in tracked) if len(tracked) < 64 else None
            if block is None:
                continue
            for policy in (batched, single):
                policy.on_insert(block, block + 1000, None)
                if op[1]:
                    policy.on_pin(block)
            tracked.append(block)
            if op[1]:
                pinned.add(block)
        elif op[0] == "pin":
            free = [b for b in tracked if b not in pinned]
            wanted = list(dict.fromkeys(free[i % len(free)] for i in op[1])) if free else []
            if op[2]:  # a pinned block, or one never tracked, ends the batch
                wanted.append(next(iter(pinned)) if pinned else 99)
            errors = _errors_of(batched.pin_many, single.on_pin, wanted)
            assert len(errors) in (0, 2) and len(set(errors)) <= 1
            pinned = {b for b in tracked if b in batched.pinned}
        elif op[0] == "remove" and tracked:  # a batch of listed, parked and side-listed blocks
            wanted = list(dict.fromkeys(tracked[i % len(tracked)] for i in op[1]))
            if op[2]:  # a block never tracked ends the batch
                wanted.append(99)
            errors = _errors_of(batched.remove_many, single.on_remove, wanted)
            assert len(errors) == op[2] * 2 and len(set(errors)) <= 1
            tracked = [b for b in tracked if b not in wanted]
            pinned -= set(wanted)
        elif tracked:
            block = tracked[op[1] % len(tracked)] if op[0] != "watch" else None
            if op[0] == "unpin" and pinned:
                block = sorted(pinned)[op[1] % len(pinned)]  # released out of order: often to the side list
                for policy in (batched, single):
                    policy.on_unpin(block)
                pinned.discard(block)
            elif op[0] == "access":
                for policy in (batched, single):
                    policy.on_access(block)
            elif op[0] == "watch":
                for policy in (batched, single):
                    policy.watch(op[1])
        assert _queue_view(batched) == _queue_view(single)
    batched.check_invariants()
