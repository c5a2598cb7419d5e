"""``BlockPool``: the refcounted, prefix-indexed block pool that serves both tiers."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import TypeVar, cast

import attrs
import numpy as np
from typing_extensions import override

from kvkit.backends.allocator import loops as pool_loops
from kvkit.backends.allocator.loops import PoolLoops
from kvkit.errors import (
    ConfigError,
    InsufficientMemoryError,
    OutOfBlocksError,
    PoolUsageError,
    RefcountError,
    UnknownBlockError,
)
from kvkit.interfaces.allocator import EvictListener
from kvkit.interfaces.capabilities import (
    BatchedPolicy,
    EvictionWindow,
    IndexedPolicy,
    WindowedPolicy,
    batch_hooks,
    pin_hooks,
)
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import check_bool, check_int, checked, is_int, plural, quote

__all__ = ["BlockPool"]

_T = TypeVar("_T")
_PARENT_TYPES = {int, type(None)}  # a parent hash as given: an int or None
_INT = {int}
_BYTES_PER_BLOCK = 56  # refcount and hash slots, the empty stack's slot and its id object


def _physical_bytes() -> int | None:
    """This machine's physical memory in bytes (``None`` where unknown): no pool can need more."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _check_count(what: str, n: object) -> int:
    return check_int(f"{what}: n", n, 0, error=PoolUsageError)


def _as_list(values: Iterable[_T], what: str) -> list[_T] | tuple[_T, ...]:
    """``values`` as a list or tuple, safe to iterate twice; numpy arrays become Python ints."""
    if values.__class__ is list or values.__class__ is tuple:
        return values
    if isinstance(values, np.ndarray):
        return values.tolist()
    try:
        return list(values)
    except TypeError:
        raise PoolUsageError(f"{what} must be a sequence, got {quote(values)}") from None
    except (MemoryError, OverflowError):  # e.g. range(10**15): no pool call takes that many
        raise PoolUsageError(f"{what} is too long to hold, got {quote(values)}") from None


def _hash(value: object, rule: str) -> BlockHash:
    """A block hash given as ``value``: an int (a NumPy integer is converted); ``bool`` is no hash."""
    if is_int(value):
        return BlockHash(int(value))
    raise PoolUsageError(f"{rule}, got {quote(value)}")


# No on_setattr hooks: attrs would route every attribute write through a Python __setattr__,
# several times slower, and the pool writes its counters on every call.
@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)
class BlockPool(EvictionWindow):
    """A pool of ``num_blocks`` slots with refcounts, a prefix index and pluggable eviction.

    Per-block state is two flat lists indexed by block id (refcount, hash); the
    prefix index is one ``dict`` from hash to block; empty ids sit on a stack
    whose top is the smallest id, so fresh pools and blocks released in order
    hand out ascending runs of consecutive ids. Every call validates all its
    arguments before it changes anything, and costs O(1) per block plus the
    eviction policy's work.

    Caller input: block ids are ints in ``[0, num_blocks)`` (a NumPy integer
    is converted; ``bool`` is refused: ``True`` is not block 1), else
    :class:`~kvkit.errors.UnknownBlockError`; hashes and parents are ints
    likewise, else :class:`~kvkit.errors.PoolUsageError`; a refused call
    changes nothing.

    Args:
        num_blocks: slots in the pool (fixed).
        eviction: policy that picks victims among evictable blocks (required:
            the pool has no default; ``kvkit.build`` chooses one from
            ``StackConfig.cpu_eviction``). It must track no blocks yet. If it is a
            :class:`~kvkit.interfaces.capabilities.PinAwarePolicy` when the
            pool is built, the pool calls ``on_pin`` when a ready block's
            refcount goes 0 -> 1 and right after committing a block (always
            referenced then), and ``on_unpin`` when a ready block's refcount
            goes 1 -> 0, for every block: a policy that sets the blocks in
            use aside as it hears of them never meets one in a selection. If
            it is also a :class:`~kvkit.interfaces.capabilities.BatchedPolicy`,
            each pool call tells it its blocks in one batch call per hook.
            If it is an :class:`~kvkit.interfaces.capabilities.IndexedPolicy`,
            the pool hands it the prefix index and the hash list when it is
            built (a block's hash and entry are set before the policy hears
            of its insert and cleared after it hears of its removal), so the
            two keep one copy.

    Raises:
        ConfigError: ``num_blocks`` is not a positive int; ``eviction`` is
            missing, not an ``EvictionPolicy``, already tracks blocks, or has
            half a pair of pin hooks.
        InsufficientMemoryError: the per-block state of ``num_blocks`` slots
            (about 56 bytes a block) exceeds this machine's physical memory
            (checked before allocating), or its allocation fails; nothing is kept.

    Write-back windows (:meth:`eviction_window`): a policy that is a
    :class:`~kvkit.interfaces.capabilities.WindowedPolicy` (and has the pin
    hooks) tracks them itself in O(change); for any other the pool takes the
    candidates again when something changed since the previous call and
    reports the difference.

    The per-block loops of ``allocate``, ``incref``, ``decref``, ``commit``
    and eviction run compiled where the extension was built (``loops.py``:
    the contracts), each method's Python loop otherwise; a compiled loop
    leaves anything unusual to the Python, which raises every error.

    Invariants: those of :class:`~kvkit.interfaces.allocator.BlockAllocator`
    and :class:`~kvkit.interfaces.capabilities.EvictionWindow`;
    the policy tracks exactly the ready blocks; ``num_evictable`` counts
    ready blocks with refcount 0; with pin hooks, the policy's pinned blocks
    are exactly the ready blocks with references.
    """

    _num_blocks: int = attrs.field(alias="num_blocks", converter=checked(check_int, minimum=1))  # type: ignore[misc]
    _policy: EvictionPolicy = attrs.field(default=None, alias="eviction", repr=False)
    _ref: list[int] = attrs.field(init=False, repr=False)
    _hash: list[BlockHash | None] = attrs.field(init=False, repr=False)
    _index: dict[BlockHash, BlockId] = attrs.field(init=False, repr=False, factory=dict)
    _empty: list[BlockId] = attrs.field(init=False, repr=False)  # top (end) = smallest id
    _num_evictable: int = attrs.field(init=False, repr=False, default=0)
    _listeners: list[EvictListener] = attrs.field(init=False, repr=False, factory=list)
    _is_evictable: Callable[[BlockId], bool] = attrs.field(init=False, repr=False)
    # The policy's pin hooks, or None: decided once, so a policy without them costs nothing.
    _on_pin: Callable[[BlockId], None] | None = attrs.field(init=False, repr=False, default=None)
    _on_unpin: Callable[[BlockId], None] | None = attrs.field(init=False, repr=False, default=None)
    _batch: BatchedPolicy | None = attrs.field(init=False, repr=False, default=None)  # decided once, likewise
    # Write-back windows: the policy when it tracks them, else the last window taken and when.
    _windowed: WindowedPolicy | None = attrs.field(init=False, repr=False, default=None)
    _version: int = attrs.field(init=False, repr=False, default=0)  # bumped by each call that may reorder
    _window_n: int = attrs.field(init=False, repr=False, default=-1)
    _window_version: int = attrs.field(init=False, repr=False, default=-1)
    _window: dict[BlockId, BlockHash | None] = attrs.field(init=False, repr=False, factory=dict)
    # The compiled twins of the per-block loops (loops.py), or None: the methods' own Python loops run.
    _loops: PoolLoops | None = attrs.field(init=False, repr=False, factory=pool_loops.LOOPS.default)

    def __attrs_post_init__(self) -> None:
        if self._policy is None:
            raise ConfigError(
                "BlockPool needs an eviction policy, got eviction=None; hint: pass one, e.g. "
                "eviction=LRUPolicy() from kvkit.backends.eviction.lru (kvkit.build chooses it "
                "from StackConfig.cpu_eviction / gpu_eviction)")
        if not isinstance(self._policy, EvictionPolicy):
            raise ConfigError(f"eviction must be an EvictionPolicy, got {self._policy!r}")
        if len(self._policy):
            raise ConfigError(
                f"eviction policy {self._policy!r} already tracks {plural(len(self._policy), 'block')}"
            )
        hooks = pin_hooks(self._policy)
        if hooks is not None:
            self._on_pin, self._on_unpin = hooks
            self._batch = batch_hooks(self._policy)
            if isinstance(self._policy, WindowedPolicy):
                self._windowed = self._policy
        n = self._num_blocks
        need, physical = n * _BYTES_PER_BLOCK, _physical_bytes()
        if physical is not None and need > physical:  # refused before allocating anything
            raise InsufficientMemoryError(
                f"BlockPool(num_blocks={n}): its per-block state needs about {need} bytes of host "
                f"memory, more than this machine has ({physical} bytes); nothing was allocated")
        try:
            self._ref = [0] * n
            self._hash = [None] * n
            self._empty = cast(list[BlockId], list(range(n - 1, -1, -1)))
            if isinstance(self._policy, IndexedPolicy):  # it may size its per-block state now
                # A hash and its entry go in before on_insert and out after on_remove.
                self._policy.use_index(self._index, self._hash, n)
        except (MemoryError, OverflowError):
            raise InsufficientMemoryError(
                f"BlockPool(num_blocks={n}): cannot allocate its per-block state, about "
                f"{n * _BYTES_PER_BLOCK} bytes of host memory; nothing was kept") from None
        ref, hashes = self._ref, self._hash  # the lists are only ever mutated in place

        def is_evictable(block: BlockId) -> bool:
            return not ref[block] and hashes[block] is not None

        self._is_evictable = is_evictable

    # -- sizes ---------------------------------------------------------------

    @property
    @override
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    @override
    def num_free(self) -> int:
        return len(self._empty) + self._num_evictable

    @property
    def num_empty(self) -> int:
        """Blocks with no content and no reference."""
        return len(self._empty)

    @property
    def num_evictable(self) -> int:
        """Ready blocks with refcount 0 (cached, reclaimable)."""
        return self._num_evictable

    @property
    def num_cached(self) -> int:
        """Ready blocks (findable by :meth:`lookup`), referenced or not."""
        return len(self._index)

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy this pool consults."""
        return self._policy

    # -- errors --------------------------------------------------------------

    def _unknown(self, block: object) -> UnknownBlockError:
        kind = "" if is_int(block) else " (block ids are ints; bool is not one)"
        return UnknownBlockError(f"block id {quote(block)} is out of range [0, {self._num_blocks}){kind}")

    def _id(self, block: object) -> BlockId:
        """``block`` as an int id in range (a NumPy integer is converted), else ``UnknownBlockError``."""
        if block.__class__ is not int:
            if not is_int(block):
                raise self._unknown(block)
            block = int(block)
        if not 0 <= block < self._num_blocks:
            raise self._unknown(block)
        return BlockId(block)

    def _ids(self, blocks: list[BlockId] | tuple[BlockId, ...]) -> list[BlockId]:
        """Every id of ``blocks`` checked and converted (the slow path: some id is not a plain int in range)."""
        return [self._id(b) for b in blocks]

    # -- allocation ----------------------------------------------------------

    @override
    def allocate(self, n: int) -> list[BlockId]:
        if n.__class__ is not int or n < 0:
            n = _check_count("allocate", n)
        empty = self._empty
        num_empty = len(empty)
        if n <= num_empty:
            start = num_empty - n
            blocks = empty[start:]
            del empty[start:]
            blocks.reverse()
            self._hand_out(blocks)
            return blocks
        need = n - num_empty
        if need > self._num_evictable:
            raise OutOfBlocksError(
                f"cannot allocate {plural(n, 'block')}: {self.num_free} free ({num_empty} empty, "
                f"{self._num_evictable} evictable) of {self._num_blocks}"
            )
        victims = self._policy.select_victims(need, self._is_evictable)
        if victims is None:
            raise OutOfBlocksError(
                f"cannot allocate {plural(n, 'block')}: policy {type(self._policy).__name__} "
                f"found fewer than {need} evictable of {self._num_evictable}"
            )
        gone = self._evict(victims, need)
        self._version += 1
        blocks = empty[::-1]
        empty.clear()
        blocks += victims
        self._hand_out(blocks)
        for listener in self._listeners:
            listener(victims, gone)
        return blocks

    def _hand_out(self, blocks: list[BlockId]) -> None:
        """Every block's refcount becomes 1."""
        loops = self._loops
        if loops is None or not loops.hand_out(self._ref, blocks):
            ref = self._ref
            for b in blocks:
                ref[b] = 1

    def _evict(self, victims: list[BlockId], need: int) -> list[BlockHash]:
        """Drop ``victims`` from the index and the policy, sorting them to coalesce runs; their hashes, in order."""
        hashes = self._hash
        # A policy bug here would break invariant 10, so check before changing anything (C-level
        # passes over the victims: evictable means unreferenced and ready).
        assert len(victims) == need and len(set(victims)) == need, (
            f"policy returned {victims!r} for {need} victims"
        )
        victims.sort()
        gone = cast(list[BlockHash], list(map(hashes.__getitem__, victims)))
        assert not any(map(self._ref.__getitem__, victims)) and None not in gone, \
            f"policy chose a non-evictable block: {victims!r}"
        index, batch = self._index, self._batch
        if batch is not None:
            batch.remove_many(victims)  # the policy hears of each block before its hash and entry go
            loops = self._loops
            if loops is None or not loops.drop(hashes, index, victims, gone):
                for b, h in zip(victims, gone):
                    hashes[b] = None
                    del index[h]
        else:
            on_remove = self._policy.on_remove
            for b, h in zip(victims, gone):
                on_remove(b)  # before its hash and entry go: an IndexedPolicy reads them
                hashes[b] = None
                del index[h]
        self._num_evictable -= need
        return gone

    # -- references ----------------------------------------------------------

    @override
    def incref(self, blocks: Sequence[BlockId]) -> None:
        blocks = _as_list(blocks, "blocks")
        ref, hashes, loops = self._ref, self._hash, self._loops
        pinned = None if loops is None else loops.incref(ref, hashes, blocks)
        if pinned is None:
            pinned = self._incref(blocks)
        if pinned:
            self._num_evictable -= len(pinned)
            self._version += 1
            batch = self._batch
            self._tell(pinned, self._on_pin, None if batch is None else batch.pin_many)

    def _incref(self, blocks: list[BlockId] | tuple[BlockId, ...]) -> list[BlockId]:
        """incref's loop: every block gains a reference; those that had none, in order."""
        ref, hashes = self._ref, self._hash
        pinned = []  # were evictable
        done = 0
        try:
            for b in blocks:
                if b.__class__ is not int or b < 0:
                    raise IndexError
                r = ref[b]  # IndexError past the end
                if not r:
                    if hashes[b] is None:
                        raise RefcountError(f"cannot incref empty block {b!r} (no content)")
                    pinned.append(b)
                ref[b] = r + 1
                done += 1
        except (IndexError, RefcountError) as exc:
            for b_done in blocks[:done]:  # roll back: failing calls change nothing
                ref[b_done] -= 1
            if isinstance(exc, RefcountError):
                raise
            return self._incref(self._ids(blocks))  # converts NumPy ids, or raises quoting the bad one
        return pinned

    @staticmethod
    def _tell(blocks: list[BlockId], hook: Callable[[BlockId], None] | None,
              many: Callable[[list[BlockId]], None] | None) -> None:
        """The policy's batch hook ``many`` on ``blocks`` if it has one, else its ``hook`` on each in order."""
        if many is not None:
            many(blocks)
        elif hook is not None:
            for b in blocks:
                hook(b)

    @override
    def decref(self, blocks: Sequence[BlockId]) -> None:
        blocks = _as_list(blocks, "blocks")
        loops = self._loops
        released = None if loops is None else loops.decref(self._ref, self._hash, blocks)
        freed, unpinned = self._decref(blocks) if released is None else released
        if unpinned:
            batch = self._batch
            self._tell(unpinned, self._on_unpin, None if batch is None else batch.unpin_many)
        self._num_evictable += len(unpinned)
        self._version += 1
        if freed:
            freed.reverse()  # released in order -> handed out again in order
            self._empty += freed

    def _decref(self, blocks: list[BlockId] | tuple[BlockId, ...]) -> tuple[list[BlockId], list[BlockId]]:
        """decref's loop: every block loses a reference; those that lost their last, not ready and ready."""
        ref, hashes = self._ref, self._hash
        freed: list[BlockId] = []  # not ready (or dropped by a forced reset): its content is worthless
        unpinned: list[BlockId] = []
        done = 0
        try:
            for b in blocks:
                if b.__class__ is not int or b < 0:
                    raise IndexError
                r = ref[b]  # IndexError past the end
                if r == 1:
                    ref[b] = 0
                    if hashes[b] is None:
                        freed.append(b)
                    else:
                        unpinned.append(b)
                elif r:
                    ref[b] = r - 1
                else:
                    raise RefcountError(f"cannot decref block {b!r}: refcount would go below 0")
                done += 1
        except (IndexError, RefcountError) as exc:
            for b_done in blocks[:done]:  # roll back: failing calls change nothing
                ref[b_done] += 1
            if isinstance(exc, RefcountError):
                raise
            return self._decref(self._ids(blocks))  # converts NumPy ids, or raises quoting the bad one
        return freed, unpinned

    @override
    def refcount(self, block: BlockId) -> int:
        return self._ref[self._id(block)]

    # -- prefix index --------------------------------------------------------

    @override
    def commit(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
               parents: Sequence[BlockHash | None] | None = None) -> list[bool]:
        blocks, hashes = _as_list(blocks, "blocks"), _as_list(hashes, "hashes")
        if parents is not None:
            parents = _as_list(parents, "parents")
        count = len(blocks)
        if len(hashes) != count or (parents is not None and len(parents) != count):
            raise PoolUsageError(
                f"commit needs equal lengths, got {plural(count, 'block')}, {plural(len(hashes), 'hash', 'hashes')}"
                + ("" if parents is None else f", {plural(len(parents), 'parent')}")
            )
        batch, loops = self._batch, self._loops
        taken = None if batch is None or loops is None else loops.commit(
            self._ref, self._hash, self._index, blocks, hashes, parents)
        result, added, added_hashes, added_parents = self._commit(blocks, hashes, parents) if taken is None else taken
        if batch is not None and added:
            batch.insert_pinned(added, added_hashes, added_parents)
        self._version += 1  # a policy may order by inserts (hit density's clock)
        return result

    def _commit(self, blocks: list[BlockId] | tuple[BlockId, ...], hashes: list[BlockHash] | tuple[BlockHash, ...],
                parents: list[BlockHash | None] | tuple[BlockHash | None, ...] | None,
                ) -> tuple[list[bool], list[BlockId], list[BlockHash], list[BlockHash | None]]:
        """commit's loops: checks, then each block takes its hash unless taken; whether it did, and the batch.

        A policy without batch hooks hears of each block as it takes its hash (the batch is then empty).
        """
        ref, block_hash = self._ref, self._hash
        try:
            for b, h in zip(blocks, hashes):
                if b.__class__ is not int or b < 0 or h.__class__ is not int:
                    raise IndexError
                if not ref[b]:  # ref[b]: IndexError past the end
                    raise RefcountError(f"cannot commit unreferenced block {b!r}")
                if block_hash[b] is not None:
                    raise PoolUsageError(f"block {b!r} is already ready (hash {quote(block_hash[b])})")
        except IndexError:  # an id or hash to convert, or to refuse quoting it
            return self._commit(self._ids(blocks), [_hash(h, "block hashes must be ints") for h in hashes],
                                parents)
        if len(blocks) > 1 and len(set(blocks)) != len(blocks):
            raise PoolUsageError(f"commit names a block twice: {quote(list(blocks))}")
        parent_of: Iterable[BlockHash | None] = repeat(None) if parents is None else parents
        if parents is not None and not set(map(type, parents)) <= _PARENT_TYPES:  # checked at C speed
            parent_of = [None if p is None else _hash(p, "parent hashes must be ints or None") for p in parents]
        setdefault, batch = self._index.setdefault, self._batch
        on_insert, on_pin = (self._policy.on_insert, self._on_pin) if batch is None else (None, None)
        result: list[bool] = []
        added: tuple[list[BlockId], list[BlockHash], list[BlockHash | None]] = ([], [], [])
        for b, h, p in zip(blocks, hashes, parent_of):
            # The block is not ready, so it can only already sit under h if we just put it there.
            if setdefault(h, b) == b:
                block_hash[b] = h
                if on_insert is None:
                    added[0].append(b)
                    added[1].append(h)
                    added[2].append(p)
                else:
                    on_insert(b, h, p)
                    if on_pin is not None:
                        on_pin(b)  # committed blocks are referenced: in use from the start
                result.append(True)
            else:
                result.append(False)  # the first block keeps the hash; this one stays not ready
        return (result, *added)

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Per hash, in order, whether a ready block carries it: ``bool(lookup([h]))`` for each, in one pass
        (:class:`~kvkit.interfaces.capabilities.BatchedLookup`); pure.

        Every hash must be an int (a NumPy integer is converted), else ``PoolUsageError``.
        """
        try:
            if set(map(type, hashes)) <= _INT:
                return list(map(self._index.__contains__, hashes))
            return [_hash(h, "lookup hashes must be ints") in self._index for h in hashes]
        except TypeError:  # not iterable
            raise PoolUsageError(f"contains_many needs a sequence of hashes, got {quote(hashes)}") from None

    @override
    def lookup(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Blocks of the longest ready prefix of ``hashes``; pure.

        Every hash it reads (the prefix found and the first miss) must be an
        int (a NumPy integer is converted), else ``PoolUsageError``: hashes past
        the first miss are not read.
        """
        get = self._index.get
        found = []
        try:
            for h in hashes:
                b = get(h if h.__class__ is int else _hash(h, "lookup hashes must be ints"))
                if b is None:
                    break
                found.append(b)
        except TypeError:  # not iterable
            raise PoolUsageError(f"lookup needs a sequence of hashes, got {quote(hashes)}") from None
        return found

    @override
    def touch(self, blocks: Sequence[BlockId]) -> None:
        """Tell the eviction policy each ready block was hit, in order; others are skipped."""
        blocks = _as_list(blocks, "blocks")
        n = self._num_blocks
        for b in blocks:
            if b.__class__ is not int or not 0 <= b < n:
                blocks = self._ids(blocks)
                break
        hashes, batch = self._hash, self._batch
        self._tell([b for b in blocks if hashes[b] is not None], self._policy.on_access,
                   None if batch is None else batch.access_many)
        self._version += 1

    @override
    def block_hash(self, block: BlockId) -> BlockHash | None:
        if block.__class__ is int and 0 <= block < self._num_blocks:  # the hot path: write-back asks per block
            return self._hash[block]
        return self._hash[self._id(block)]

    def is_ready(self, block: BlockId) -> bool:
        """Whether ``block`` is ready (has a hash and is findable).

        Raises:
            UnknownBlockError: ``block`` is not an id of this pool.
        """
        return self._hash[self._id(block)] is not None

    @override
    def eviction_candidates(self, n: int) -> list[BlockId]:
        """The next up-to-``n`` blocks the policy would evict now, next victim first.

        Evicts nothing (a policy whose selection updates internal state, such as
        CLOCK bits, updates it as a real selection would).

        Raises:
            PoolUsageError: ``n`` is not a non-negative int.
        """
        k = min(_check_count("eviction_candidates", n), self._num_evictable)
        if not k:
            return []
        victims = self._policy.select_victims(k, self._is_evictable)
        assert victims is not None, f"policy found < {k} of {self._num_evictable} evictable"
        return victims

    @override
    def eviction_window(self, n: int) -> list[BlockId]:
        """The blocks that joined the next ``n`` eviction candidates since the previous call.

        O(change) with a :class:`~kvkit.interfaces.capabilities.WindowedPolicy`;
        otherwise ``[]`` at once when nothing changed since the previous call
        with this ``n``, else O(n) (the candidates taken again, the difference
        reported in eviction order).

        Raises:
            PoolUsageError: ``n`` is not a non-negative int.
        """
        n = _check_count("eviction_window", n)
        if self._windowed is not None:
            self._windowed.watch(n)
            entered = self._windowed.entered()
            if n == self._window_n:
                return entered
            self._window_n = n
            return self.eviction_candidates(n)
        if n == self._window_n and self._version == self._window_version:
            return []
        candidates = self.eviction_candidates(n)
        previous = self._window if n == self._window_n else {}
        hashes = self._hash
        self._window = {b: hashes[b] for b in candidates}  # a block evicted and committed again is new
        self._window_n, self._window_version = n, self._version
        return [b for b in candidates if previous.get(b) != hashes[b]]

    @override
    def in_eviction_window(self, block: BlockId) -> bool:
        """Whether ``block`` is one of the next ``n`` candidates, ``n`` of the latest :meth:`eviction_window`.

        Raises:
            UnknownBlockError: ``block`` is not an id of this pool.
        """
        block = self._id(block)
        if self._windowed is not None:
            return self._windowed.in_window(block)
        return block in self._window

    # -- lifecycle -----------------------------------------------------------

    @override
    def add_evict_listener(self, listener: EvictListener) -> None:
        """Call ``listener(blocks, hashes)`` after every evicting :meth:`allocate` (not on :meth:`reset`).

        One call per allocation, with every block it evicted, ascending, and
        their hashes. Listeners run once :meth:`allocate` has finished changing
        the pool, so they see a consistent state.
        """
        if not callable(listener):
            raise PoolUsageError(f"an evict listener must be callable, got {listener!r}")
        self._listeners.append(listener)

    @override
    def reset(self, *, force: bool = False) -> int:
        """Forget every cached block (the policy is told; evict listeners are not).

        Args:
            force: also while blocks are referenced: every ready block leaves
                the index and loses its hash at once (never findable again);
                a referenced one keeps its references and becomes empty when
                the last goes (as a not-ready block does), an unreferenced one
                is empty now. Not-ready blocks are untouched.

        Returns:
            How many ready blocks were dropped.

        Raises:
            RefcountError: without ``force``, some block is still referenced; nothing changed.
            PoolUsageError: ``force`` is not a bool.
        """
        force = check_bool("reset: force", force, error=PoolUsageError)
        ref, hashes, index = self._ref, self._hash, self._index
        if not force and any(ref):
            held = [b for b, r in enumerate(ref) if r]
            raise RefcountError(
                f"cannot reset: {plural(len(held), 'block')} still referenced, e.g. {held[:8]!r}; "
                f"hint: reset(force=True) drops them when released"
            )
        dropped = len(index)
        on_remove = self._policy.on_remove
        for b in index.values():
            on_remove(b)  # a pin-aware policy forgets a pinned block too: it is no longer tracked
            hashes[b] = None
        index.clear()
        # Empty: every unreferenced block (the referenced ones follow when released).
        ids = range(self._num_blocks - 1, -1, -1)
        self._empty[:] = cast(Iterable[BlockId], [b for b in ids if not ref[b]] if force else ids)
        self._num_evictable = 0
        self._version += 1
        return dropped

    @override
    def check_invariants(self) -> None:
        n, ref, hashes, index = self._num_blocks, self._ref, self._hash, self._index
        assert len(ref) == len(hashes) == n, (len(ref), len(hashes), n)
        assert min(ref) >= 0, f"negative refcount at block {ref.index(min(ref))}"
        empty = set(self._empty)
        assert len(empty) == len(self._empty), "an id is on the empty stack twice"
        expected = {b for b in range(n) if not ref[b] and hashes[b] is None}
        assert empty == expected, f"empty stack {sorted(empty)} != empty blocks {sorted(expected)}"
        ready = [b for b in range(n) if hashes[b] is not None]
        assert len(index) == len(ready), f"{len(index)} indexed != {len(ready)} ready"
        for h, b in index.items():
            assert hashes[b] == h, f"block {b} indexed under {h!r} carries {hashes[b]!r}"
        evictable = sum(1 for b in ready if not ref[b])
        assert evictable == self._num_evictable, (evictable, self._num_evictable)
        assert len(self._policy) == len(index), (
            f"policy tracks {plural(len(self._policy), 'block')}, {len(index)} ready"
        )
        self._policy.check_invariants()
