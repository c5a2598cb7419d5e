"""``AllocatorContract``: the Hypothesis state machine every ``BlockAllocator`` must pass.

Join it in three lines::

    class MyPoolContract(AllocatorContract):
        def make_allocator(self, num_blocks):
            return MyPool(num_blocks)

    TestMyPool = MyPoolContract.TestCase

Each step runs one operation on the allocator and on a trivial model (a
``Counter`` of references, a ``dict`` from ready block to hash and its inverse,
the prefix index) and compares the two. Evictions are the policy's choice, so
the model learns them from the allocator's evict listener and checks that
each was allowed. Failing calls must raise the documented error and change
nothing: out-of-range ids, ids that are no ints (``True``, ``1.0``, ``"1"``),
hashes that are no ints, references the pool cannot take. NumPy integers
are accepted as the ints they hold. ``reset(force=True)`` drops every cached
block while some are referenced; those empty when released. Checks raise
``AssertionError`` explicitly, so they survive ``-O``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from numbers import Integral
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvkit.errors import KVKitError, OutOfBlocksError, PoolUsageError, RefcountError, UnknownBlockError
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.capabilities import BatchedLookup
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import plural

__all__ = ["AllocatorContract"]

# A small universe of hashes, so commits collide (duplicates) and lookups hit.
HASHES: tuple[BlockHash, ...] = tuple(
    BlockHash(h) for h in (0, 1, 2, 3, 5, 8, 2**64 + 13, 2**128 - 1)
)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class AllocatorContract(RuleBasedStateMachine):
    """Model-based contract of :class:`~kvkit.interfaces.allocator.BlockAllocator`.

    Subclasses implement :meth:`make_allocator`; ``max_blocks`` bounds the
    pool sizes tried (small pools reach eviction and exhaustion quickly).
    """

    max_blocks = 8

    def make_allocator(self, num_blocks: int) -> BlockAllocator:
        """A fresh, empty allocator of ``num_blocks`` slots under test."""
        raise NotImplementedError("subclass AllocatorContract and implement make_allocator")

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockAllocator | None = None
        self.num_blocks = 0
        self.refs: Counter[BlockId] = Counter()  # references held per block (no zero entries)
        self.hash_of: dict[BlockId, BlockHash] = {}  # ready block -> hash
        self.index: dict[BlockHash, BlockId] = {}  # hash -> ready block
        self.evicted: list[tuple[list[BlockId], list[BlockHash]]] = []  # the evict listener's calls

    @property
    def _live(self) -> BlockAllocator:
        """The allocator under test (made by :meth:`create`, the first step)."""
        if self.pool is None:
            raise AssertionError("no allocator before the create step")
        return self.pool

    # -- model queries ---------------------------------------------------------

    def _empty(self) -> list[BlockId]:
        return [b for b in map(BlockId, range(self.num_blocks)) if not self.refs[b] and b not in self.hash_of]

    def _evictable(self) -> list[BlockId]:
        return [b for b in self.hash_of if not self.refs[b]]

    def _not_ready_referenced(self) -> list[BlockId]:
        return [b for b in sorted(self.refs) if b not in self.hash_of]

    def _references(self) -> list[BlockId]:
        return sorted(self.refs.elements())

    def _bad_ids(self) -> st.SearchStrategy[Any]:
        """Ids the pool must refuse: out of range, or no int at all (``True`` is not block 1)."""
        return st.sampled_from([-1, self.num_blocks, self.num_blocks + 7, 2**70, True, False,
                                np.bool_(True), 1.0, "1", None, (1,)])

    def _snapshot(self) -> tuple:
        pool = self._live
        blocks = list(map(BlockId, range(self.num_blocks)))
        return (
            pool.num_free,
            tuple(pool.refcount(b) for b in blocks),
            tuple(pool.block_hash(b) for b in blocks),
            tuple(tuple(pool.lookup([h])) for h in HASHES),
        )

    def _fails_atomically(self, errors: type[BaseException] | tuple, call: Callable[[], object],
                          what: str) -> None:
        """``call`` must raise one of ``errors`` and leave the allocator unchanged."""
        before = self._snapshot()
        try:
            call()
        except errors:
            pass
        except Exception as exc:  # a raw TypeError, IndexError...: bad input must get a kvkit error
            raise AssertionError(f"{what} should raise {errors!r} but raised {exc!r}") from exc
        else:
            raise AssertionError(f"{what} should raise {errors!r} but returned")
        after = self._snapshot()
        _expect(after == before, f"{what} raised but changed the allocator: {before} -> {after}")
        _expect(not self.evicted, f"{what} raised but evicted {self.evicted}")

    # -- setup -----------------------------------------------------------------

    @initialize(data=st.data())
    def create(self, data: st.DataObject) -> None:
        """Build an empty allocator of a random small size and listen to its evictions."""
        self.num_blocks = data.draw(st.integers(1, self.max_blocks), label="num_blocks")
        self.pool = self.make_allocator(self.num_blocks)
        _expect(isinstance(self.pool, BlockAllocator),
                f"{self.pool!r} does not implement BlockAllocator")
        self.pool.add_evict_listener(lambda blocks, hashes: self.evicted.append((list(blocks), list(hashes))))

    # -- allocation ------------------------------------------------------------

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        """Allocate up to capacity + 2 blocks; beyond what is free it must fail atomically."""
        n = data.draw(st.integers(1, self.num_blocks + 2), label="n")
        free = len(self._empty()) + len(self._evictable())
        if n > free:
            self._fails_atomically(OutOfBlocksError, lambda: self._live.allocate(n),
                                   f"allocate({n}) with {free} free")
        else:
            self._allocate(n)

    def _allocate(self, n: int) -> list[BlockId]:
        """Allocate ``n`` free blocks and check the choice, the evictions and the model."""
        empty, evictable = self._empty(), self._evictable()
        blocks = self._live.allocate(n)
        _expect(len(blocks) == n and len(set(blocks)) == n,
                f"allocate({n}) returned {blocks!r}: wrong length or duplicates")
        for b in blocks:
            _expect(isinstance(b, Integral) and 0 <= int(b) < self.num_blocks,
                    f"allocate({n}) returned id {b!r} outside [0, {self.num_blocks})")
            _expect(not self.refs[b],
                    f"allocate({n}) handed out block {b} that holds {plural(self.refs[b], 'reference')}")
            _expect(b in empty or b in evictable,
                    f"allocate({n}) handed out block {b}, which was neither empty nor evictable")
        calls, self.evicted = self.evicted, []
        _expect(len(calls) <= 1 and all(len(bs) == len(hs) > 0 for bs, hs in calls),
                f"allocate({n}) called the evict listener with {calls!r}: at most once, with equal, "
                "non-empty lists of blocks and hashes")
        evicted = {b: h for bs, hs in calls for b, h in zip(bs, hs)}
        _expect(len(evicted) == max(0, n - len(empty)),
                f"allocate({n}) with {plural(len(empty), 'empty block')} evicted {sorted(evicted)}; "
                "empty blocks must go first, and only as many evictions as needed")
        _expect(set(evicted) == set(blocks) & set(evictable),
                f"allocate({n}) evicted {sorted(evicted)} but handed out {blocks!r}")
        for b, h in evicted.items():
            _expect(h == self.hash_of[b],
                    f"evict listener reported block {b} with {h!r}, it had {self.hash_of[b]!r}")
            del self.index[self.hash_of.pop(b)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def _allocate_invalid(self, data: st.DataObject) -> None:
        """A negative count is a ValueError and changes nothing."""
        n = data.draw(st.sampled_from([-1, -5]))
        self._fails_atomically(ValueError, lambda: self._live.allocate(n), f"allocate({n})")

    # -- references ------------------------------------------------------------

    @precondition(lambda self: self.refs or self.hash_of)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        """Add references to referenced or ready blocks (repeats allowed)."""
        live = sorted(set(self.refs) | set(self.hash_of))
        blocks = data.draw(st.lists(st.sampled_from(live), max_size=6), label="blocks")
        self._live.incref(self._maybe_numpy(data, blocks))
        self.refs.update(blocks)

    def _incref_invalid(self, data: st.DataObject) -> None:
        """An empty or out-of-range block fails the whole incref, changing nothing."""
        live = sorted(set(self.refs) | set(self.hash_of))
        blocks: list[Any] = data.draw(st.lists(st.sampled_from(live), max_size=4) if live else st.just([]))
        empty = self._empty()
        error: type[KVKitError]
        if bool(empty) and data.draw(st.booleans()):
            bad, error = data.draw(st.sampled_from(empty)), RefcountError
        else:
            bad, error = data.draw(self._bad_ids()), UnknownBlockError
        blocks.insert(data.draw(st.integers(0, len(blocks))), bad)
        self._fails_atomically(error, lambda: self._live.incref(blocks), f"incref({blocks!r})")

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def decref(self, data: st.DataObject) -> None:
        """Drop some of the references held (each at most as often as it is held)."""
        references = data.draw(st.permutations(self._references()), label="order")
        blocks = references[: data.draw(st.integers(0, len(references)), label="count")]
        self._decref(blocks)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        """Pin a referenced block and drop the pin: the other references keep it intact."""
        block = data.draw(st.sampled_from(sorted(self.refs)), label="block")
        self._live.incref([block])
        _expect(self._live.refcount(block) == self.refs[block] + 1,
                f"incref([{block}]) left refcount {self._live.refcount(block)}")
        self._live.decref([block])

    @precondition(lambda self: self.refs)
    @rule()
    def release_all(self) -> None:
        """Drop every reference in one call (makes reset legal)."""
        blocks = self._references()
        self._decref(blocks)

    def _maybe_numpy(self, data: st.DataObject, blocks: list[BlockId]) -> Any:
        """``blocks`` as given, as a NumPy array, or as a list of NumPy integers (all valid ids)."""
        form = data.draw(st.sampled_from(["list", "array", "scalars"]), label="id form")
        if form == "array":
            return np.asarray(blocks, dtype=np.int64)
        return [np.int32(b) for b in blocks] if form == "scalars" else blocks

    def _decref(self, blocks: list[BlockId]) -> None:
        self._live.decref(blocks)
        self.refs.subtract(blocks)
        self.refs = +self.refs  # drop zero entries: not-ready ones are empty again
        _expect(not self.evicted, f"decref({blocks!r}) evicted {self.evicted}")

    def _decref_invalid(self, data: st.DataObject) -> None:
        """A reference too many or an out-of-range id fails the whole decref, changing nothing."""
        references = data.draw(st.permutations(self._references()))
        blocks: list[Any] = references[: data.draw(st.integers(0, len(references)))]
        error: type[KVKitError]
        if data.draw(st.booleans()):
            # One more release of some block than the call can take.
            block = BlockId(data.draw(st.integers(0, self.num_blocks - 1)))
            blocks += [block] * (self.refs[block] - blocks.count(block) + 1)
            error = RefcountError
        else:
            blocks.insert(data.draw(st.integers(0, len(blocks))), data.draw(self._bad_ids()))
            error = UnknownBlockError
        self._fails_atomically(error, lambda: self._live.decref(blocks), f"decref({blocks!r})")

    # -- prefix index ----------------------------------------------------------

    @precondition(lambda self: self._not_ready_referenced())
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """Make referenced, not-ready blocks ready; a hash already indexed keeps its block."""
        blocks = data.draw(st.lists(st.sampled_from(self._not_ready_referenced()), min_size=1,
                                    unique=True), label="blocks")
        self._commit(data, blocks)

    def _commit(self, data: st.DataObject, blocks: list[BlockId]) -> None:
        """Commit ``blocks`` under hashes drawn from the small universe, with or without parents."""
        hashes = data.draw(st.lists(st.sampled_from(HASHES), min_size=len(blocks),
                                    max_size=len(blocks)), label="hashes")
        parents = [None, *hashes[:-1]] if data.draw(st.booleans(), label="parents") else None
        result = self._live.commit(blocks, hashes, parents)
        expected = []
        for b, h in zip(blocks, hashes):
            expected.append(h not in self.index)
            if expected[-1]:
                self.index[h] = b
                self.hash_of[b] = h
        _expect(list(result) == expected,
                f"commit({blocks!r}, {hashes!r}) returned {result!r}, expected {expected!r}")

    @precondition(lambda self: self._empty() or self._evictable())
    @rule(data=st.data())
    def request(self, data: st.DataObject) -> None:
        """A request's whole life in one step: allocate, commit, release (caches its blocks)."""
        free = len(self._empty()) + len(self._evictable())
        blocks = self._allocate(data.draw(st.integers(1, free), label="n"))
        self._commit(data, blocks)
        self._decref(blocks)

    def _reset_invalid(self, data: st.DataObject) -> None:
        """Reset is refused while any block is referenced, and changes nothing."""
        if self.refs:
            self._fails_atomically(RefcountError, self._live.reset,
                                   f"reset() with references {dict(self.refs)}")

    def _commit_invalid(self, data: st.DataObject) -> None:
        """Committing a ready, unreferenced or unknown block, or unequal lengths, fails."""
        blocks = data.draw(st.lists(st.sampled_from(self._not_ready_referenced()), unique=True,
                                    max_size=3) if self._not_ready_referenced() else st.just([]))
        choices = ["unknown", "lengths"]
        if self.hash_of:
            choices.append("ready")
        if self._empty():
            choices.append("unreferenced")
        kind = data.draw(st.sampled_from(choices), label="kind")
        error: type[BaseException] = ValueError
        if kind == "unknown":
            blocks.append(data.draw(self._bad_ids()))
            error = UnknownBlockError
        elif kind == "ready":
            blocks.append(data.draw(st.sampled_from(sorted(self.hash_of))))
        elif kind == "unreferenced":
            blocks.append(data.draw(st.sampled_from(self._empty())))
            error = RefcountError
        hashes = list(HASHES[: len(blocks) + (kind == "lengths")])
        self._fails_atomically(error, lambda: self._live.commit(blocks, hashes),
                               f"commit({blocks!r}, {hashes!r}) [{kind}]")

    def _hashes_invalid(self, data: st.DataObject) -> None:
        """A hash that is no int (``True`` is not hash 1) fails commit and lookup, changing nothing."""
        bad: Any = data.draw(st.sampled_from([True, np.bool_(False), 1.0, "1", None, b"1", [1]]), label="bad hash")
        where = data.draw(st.sampled_from(["commit", "parent", "lookup"] if bad is not None
                                          else ["commit", "lookup"]), label="where")  # None: no parent
        chain = [*data.draw(st.lists(st.sampled_from(HASHES), max_size=2)), bad]
        if where == "lookup":
            if all(h in self.index for h in chain[:-1]):  # only the hashes read are checked
                self._fails_atomically(PoolUsageError, lambda: self._live.lookup(chain),
                                       f"lookup({chain!r})")
            return
        blocks = self._not_ready_referenced()[:len(chain)]
        if len(blocks) < len(chain):
            return
        hashes, parents = (chain, None) if where == "commit" else (list(HASHES[:len(chain)]), chain)
        self._fails_atomically(PoolUsageError, lambda: self._live.commit(blocks, hashes, parents),
                               f"commit({blocks!r}, {hashes!r}, {parents!r})")

    @rule(data=st.data())
    def invalid_call(self, data: st.DataObject) -> None:
        """A call with bad arguments raises the documented error and changes nothing."""
        # One rule for all of them, so valid operations keep most of the steps.
        check = data.draw(st.sampled_from([
            self._allocate_invalid, self._incref_invalid, self._decref_invalid,
            self._commit_invalid, self._reset_invalid, self._hashes_invalid, self._getter_invalid,
        ]))
        check(data)

    def _getter_invalid(self, data: st.DataObject) -> None:
        """refcount, block_hash, touch, allocate and reset refuse what is no id, count or flag."""
        bad = data.draw(self._bad_ids(), label="bad id")
        call = data.draw(st.sampled_from(["refcount", "block_hash", "touch"]), label="call")
        args = ([bad],) if call == "touch" else (bad,)
        self._fails_atomically(UnknownBlockError, lambda: getattr(self.pool, call)(*args),
                               f"{call}{args!r}")
        count: Any = data.draw(st.sampled_from([True, 1.5, "2", None]), label="bad count")
        self._fails_atomically(KVKitError, lambda: self._live.allocate(count), f"allocate({count!r})")
        flag: Any = data.draw(st.sampled_from([1, "yes", None]), label="bad force")
        self._fails_atomically(KVKitError, lambda: self._live.reset(force=flag), f"reset(force={flag!r})")

    @rule(chain=st.lists(st.sampled_from(HASHES), max_size=6))
    def lookup(self, chain: list[BlockHash]) -> None:
        """Lookup returns the blocks of the longest ready prefix and changes nothing."""
        expected = []
        for h in chain:
            if h not in self.index:
                break
            expected.append(self.index[h])
        before = self._snapshot()
        found = self._live.lookup(chain)
        _expect(list(found) == expected, f"lookup({chain!r}) = {found!r}, expected {expected!r}")
        _expect(self._snapshot() == before, f"lookup({chain!r}) changed the allocator")

    @rule(hashes=st.lists(st.sampled_from(HASHES), max_size=6), as_numpy=st.booleans())
    def contains_many(self, hashes: list[BlockHash], as_numpy: bool) -> None:
        """A :class:`~kvkit.interfaces.capabilities.BatchedLookup` pool: ``contains_many`` agrees with a
        lookup per hash (NumPy integers read as ints), changes nothing, and refuses a hash that is no int."""
        pool = self._live
        if not isinstance(pool, BatchedLookup):
            return
        asked: list[Any] = [np.uint64(h) if as_numpy and h < 2**64 else h for h in hashes]
        before = self._snapshot()
        found = pool.contains_many(asked)
        expected = [h in self.index for h in hashes]
        _expect(list(found) == expected, f"contains_many({hashes!r}) = {found!r}, expected {expected!r}")
        _expect(self._snapshot() == before, f"contains_many({hashes!r}) changed the allocator")
        spoilt: list[Any] = [*hashes, "h"]
        self._fails_atomically(PoolUsageError, lambda: pool.contains_many(spoilt), f"contains_many({spoilt!r})")

    @precondition(lambda self: self.hash_of)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        """Touching ready blocks changes no refcount, hash or index entry."""
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.hash_of)), max_size=4))
        before = self._snapshot()
        self._live.touch(blocks)
        _expect(self._snapshot() == before, f"touch({blocks!r}) changed the allocator")

    # -- lifecycle -------------------------------------------------------------

    # Only with something cached: a reset wipes the state the other rules built up.
    @precondition(lambda self: self.hash_of and not self.refs)
    @rule()
    def reset(self) -> None:
        """Reset drops every cached block and reports how many."""
        dropped = self._live.reset()
        _expect(dropped == len(self.hash_of),
                f"reset() returned {dropped}, {plural(len(self.hash_of), 'block')} cached")
        for blocks, hashes in self.evicted:  # listeners may, but need not, hear of reset drops
            for b, h in zip(blocks, hashes, strict=True):
                _expect(self.hash_of.get(b) == h, f"reset reported ({b}, {h!r}), which was not cached")
        self.evicted.clear()
        self.hash_of.clear()
        self.index.clear()

    @precondition(lambda self: self.hash_of or self.refs)
    @rule()
    def force_reset(self) -> None:
        """A forced reset drops every cached block, referenced or not; the referenced keep their references."""
        dropped = self._live.reset(force=True)
        _expect(dropped == len(self.hash_of),
                f"reset(force=True) returned {dropped}, {plural(len(self.hash_of), 'block')} cached")
        self.evicted.clear()  # listeners may, but need not, hear of reset drops
        self.hash_of.clear()  # referenced ones are not ready now: they empty when released
        self.index.clear()

    # -- after every step ------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        """Refcounts, hashes, free count and the index equal the model's."""
        pool = self.pool
        if pool is None:
            return
        pool.check_invariants()
        _expect(not self.evicted, f"evictions outside allocate: {self.evicted}")
        _expect(pool.num_blocks == self.num_blocks,
                f"num_blocks changed: {pool.num_blocks} != {self.num_blocks}")
        for b in map(BlockId, range(self.num_blocks)):
            _expect(pool.refcount(b) == self.refs[b],
                    f"block {b}: refcount {pool.refcount(b)}, model {self.refs[b]}")
            _expect(pool.block_hash(b) == self.hash_of.get(b),
                    f"block {b}: hash {pool.block_hash(b)!r}, model {self.hash_of.get(b)!r}")
        free = len(self._empty()) + len(self._evictable())
        _expect(pool.num_free == free,
                f"num_free {pool.num_free}, model {free} (empty + ready with refcount 0)")
        for h in HASHES:
            expected = [self.index[h]] if h in self.index else []
            found = pool.lookup([h])
            _expect(list(found) == expected,
                    f"index: lookup([{h!r}]) = {found!r}, model {expected!r}")
