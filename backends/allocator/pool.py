"""``BlockPool``: the refcounted, prefix-indexed block pool that serves both tiers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat

import attrs
import numpy as np
from typing_extensions import override

from kvkit.errors import (
    ConfigError,
    OutOfBlocksError,
    PoolUsageError,
    RefcountError,
    UnknownBlockError,
)
from kvkit.interfaces.allocator import EvictListener
from kvkit.interfaces.capabilities import EvictionOrder, pin_hooks
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import at_least, check_int

__all__ = ["BlockPool"]


def _check_count(what: str, n: object) -> int:
    return check_int(f"{what}: n", n, 0, error=PoolUsageError)


def _as_list(values: object, what: str) -> list | tuple:
    """``values`` as a list or tuple, safe to iterate twice; numpy arrays become Python ints."""
    if values.__class__ is list or values.__class__ is tuple:
        return values
    if isinstance(values, np.ndarray):
        return values.tolist()
    try:
        return list(values)
    except TypeError:
        raise PoolUsageError(f"{what} must be a sequence, got {values!r}") from None


@attrs.define(eq=False)
class BlockPool(EvictionOrder):
    """A pool of ``num_blocks`` slots with refcounts, a prefix index and pluggable eviction.

    Per-block state is two flat lists indexed by block id (refcount, hash); the
    prefix index is one ``dict`` from hash to block; empty ids sit on a stack
    whose top is the smallest id, so fresh pools and blocks released in order
    hand out ascending runs of consecutive ids. Every call validates all its
    arguments before it changes anything, and costs O(1) per block plus the
    eviction policy's work.

    Args:
        num_blocks: slots in the pool (fixed).
        eviction: policy that picks victims among evictable blocks (required:
            the pool has no default; ``kvkit.build`` chooses one from
            ``StackConfig.cpu_eviction``). It must track no blocks yet. If it is a
            :class:`~kvkit.interfaces.capabilities.PinAwarePolicy` when the
            pool is built, the pool calls ``on_pin`` when a ready block's
            refcount goes 0 -> 1 and right after committing a block (always
            referenced then), and ``on_unpin`` when a ready block's refcount
            goes 1 -> 0.

    Raises:
        ConfigError: ``num_blocks`` is not a positive int; ``eviction`` is
            missing, not an ``EvictionPolicy``, already tracks blocks, or has
            half a pair of pin hooks.

    Invariants: those of :class:`~kvkit.interfaces.allocator.BlockAllocator`
    and :class:`~kvkit.interfaces.capabilities.EvictionOrder`;
    the policy tracks exactly the ready blocks; ``num_evictable`` counts
    ready blocks with refcount 0; with pin hooks, the policy's pinned blocks
    are exactly the ready blocks with references.
    """

    num_blocks: int = attrs.field(validator=at_least(1), on_setattr=attrs.setters.frozen)
    _policy: EvictionPolicy = attrs.field(default=None, alias="eviction", repr=False,
                                          on_setattr=attrs.setters.frozen)
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
                f"eviction policy {self._policy!r} already tracks {len(self._policy)} blocks"
            )
        hooks = pin_hooks(self._policy)
        if hooks is not None:
            self._on_pin, self._on_unpin = hooks
        n = self.num_blocks
        self._ref = [0] * n
        self._hash = [None] * n
        self._empty = list(range(n - 1, -1, -1))
        ref, hashes = self._ref, self._hash  # the lists are only ever mutated in place

        def is_evictable(block: BlockId) -> bool:
            return not ref[block] and hashes[block] is not None

        self._is_evictable = is_evictable

    # -- sizes ---------------------------------------------------------------

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
        return UnknownBlockError(f"block id {block!r} is out of range [0, {self.num_blocks})")

    def _check_id(self, block: BlockId) -> None:
        try:
            if block < 0:
                raise IndexError
            self._ref[block]
        except (IndexError, TypeError):
            raise self._unknown(block) from None

    # -- allocation ----------------------------------------------------------

    @override
    def allocate(self, n: int) -> list[BlockId]:
        if n.__class__ is not int or n < 0:
            n = _check_count("allocate", n)
        ref, empty = self._ref, self._empty
        num_empty = len(empty)
        if n <= num_empty:
            start = num_empty - n
            blocks = empty[start:]
            del empty[start:]
            blocks.reverse()
            for b in blocks:
                ref[b] = 1
            return blocks
        need = n - num_empty
        if need > self._num_evictable:
            raise OutOfBlocksError(
                f"cannot allocate {n} blocks: {self.num_free} free ({num_empty} empty, "
                f"{self._num_evictable} evictable) of {self.num_blocks}"
            )
        victims = self._policy.select_victims(need, self._is_evictable)
        if victims is None:
            raise OutOfBlocksError(
                f"cannot allocate {n} blocks: policy {type(self._policy).__name__} "
                f"found fewer than {need} evictable of {self._num_evictable}"
            )
        evicted = self._evict(victims, need)
        blocks = empty[::-1]
        empty.clear()
        blocks += victims
        for b in blocks:
            ref[b] = 1
        for listener in self._listeners:
            for b, h in evicted:
                listener(b, h)
        return blocks

    def _evict(self, victims: list[BlockId], need: int) -> list[tuple[BlockId, BlockHash]]:
        """Drop ``victims`` from the index and the policy; sorts them to coalesce runs."""
        hashes, is_evictable = self._hash, self._is_evictable
        # A policy bug here would break invariant 10, so check before changing anything.
        assert len(victims) == need and len(set(victims)) == need, (
            f"policy returned {victims!r} for {need} victims"
        )
        assert all(map(is_evictable, victims)), f"policy chose a non-evictable block: {victims!r}"
        victims.sort()
        index, on_remove = self._index, self._policy.on_remove
        evicted = []
        for b in victims:
            h = hashes[b]
            hashes[b] = None
            del index[h]
            on_remove(b)
            evicted.append((b, h))
        self._num_evictable -= need
        return evicted

    # -- references ----------------------------------------------------------

    @override
    def incref(self, blocks: Sequence[BlockId]) -> None:
        blocks = _as_list(blocks, "blocks")
        ref, hashes = self._ref, self._hash
        try:
            for b in blocks:
                if b < 0:
                    raise IndexError
                if not ref[b] and hashes[b] is None:
                    raise RefcountError(f"cannot incref empty block {b!r} (no content)")
        except (IndexError, TypeError):
            raise self._unknown(b) from None
        pinned, on_pin = 0, self._on_pin
        for b in blocks:
            r = ref[b]
            if not r:
                pinned += 1  # was evictable (validated: not empty)
                if on_pin is not None:
                    on_pin(b)
            ref[b] = r + 1
        self._num_evictable -= pinned

    @override
    def decref(self, blocks: Sequence[BlockId]) -> None:
        blocks = _as_list(blocks, "blocks")
        ref = self._ref
        zeroed = []
        done = 0
        try:
            for b in blocks:
                if b < 0:
                    raise IndexError
                r = ref[b]
                if not r:
                    raise RefcountError(f"cannot decref block {b!r}: refcount would go below 0")
                ref[b] = r - 1
                if r == 1:
                    zeroed.append(b)
                done += 1
        except (IndexError, TypeError, RefcountError) as exc:
            for b_done in blocks[:done]:  # roll back: failing calls change nothing
                ref[b_done] += 1
            if isinstance(exc, RefcountError):
                raise
            raise self._unknown(b) from None
        hashes, freed, on_unpin = self._hash, [], self._on_unpin
        for b in zeroed:
            if hashes[b] is None:
                freed.append(b)  # not ready: partial content is worthless
            elif on_unpin is not None:
                on_unpin(b)
        self._num_evictable += len(zeroed) - len(freed)
        if freed:
            freed.reverse()  # released in order -> handed out again in order
            self._empty += freed

    @override
    def refcount(self, block: BlockId) -> int:
        self._check_id(block)
        return self._ref[block]

    # -- prefix index --------------------------------------------------------

    @override
    def commit(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
               parents: Sequence[BlockHash | None] | None = None) -> list[bool]:
        blocks, hashes = _as_list(blocks, "blocks"), _as_list(hashes, "hashes")
        if parents is not None:
            parents = _as_list(parents, "parents")
        n = len(blocks)
        if len(hashes) != n or (parents is not None and len(parents) != n):
            raise PoolUsageError(
                f"commit needs equal lengths, got {n} blocks, {len(hashes)} hashes"
                + ("" if parents is None else f", {len(parents)} parents")
            )
        ref, block_hash = self._ref, self._hash
        try:
            for b, h in zip(blocks, hashes):
                if b < 0:
                    raise IndexError
                if not ref[b]:
                    raise RefcountError(f"cannot commit unreferenced block {b!r}")
                if block_hash[b] is not None:
                    raise PoolUsageError(f"block {b!r} is already ready (hash {block_hash[b]!r})")
                if h.__class__ is not int:
                    raise PoolUsageError(f"block hashes must be ints, got {h!r}")
        except (IndexError, TypeError):
            raise self._unknown(b) from None
        if n > 1 and len(set(blocks)) != n:
            raise PoolUsageError(f"commit names a block twice: {list(blocks)!r}")
        if parents is None:
            parents = repeat(None)
        else:
            for p in parents:
                if p is not None and p.__class__ is not int:
                    raise PoolUsageError(f"parent hashes must be ints or None, got {p!r}")
        setdefault, on_insert = self._index.setdefault, self._policy.on_insert
        on_pin = self._on_pin
        result = []
        for b, h, p in zip(blocks, hashes, parents):
            # The block is not ready, so it can only already sit under h if we just put it there.
            if setdefault(h, b) == b:
                block_hash[b] = h
                on_insert(b, h, p)
                if on_pin is not None:
                    on_pin(b)  # committed blocks are referenced: in use from the start
                result.append(True)
            else:
                result.append(False)  # the first block keeps the hash; this one stays not ready
        return result

    @override
    def lookup(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        get = self._index.get
        found = []
        try:
            for h in hashes:
                b = get(h)
                if b is None:
                    break
                found.append(b)
        except TypeError:  # not iterable, or an unhashable element
            raise PoolUsageError(f"lookup needs a sequence of hashes, got {hashes!r}") from None
        return found

    @override
    def touch(self, blocks: Sequence[BlockId]) -> None:
        """Tell the eviction policy each ready block was hit, in order; others are skipped."""
        blocks = _as_list(blocks, "blocks")
        ref = self._ref
        try:
            for b in blocks:
                if b < 0:
                    raise IndexError
                ref[b]
        except (IndexError, TypeError):
            raise self._unknown(b) from None
        hashes, on_access = self._hash, self._policy.on_access
        for b in blocks:
            if hashes[b] is not None:
                on_access(b)

    @override
    def block_hash(self, block: BlockId) -> BlockHash | None:
        self._check_id(block)
        return self._hash[block]

    def is_ready(self, block: BlockId) -> bool:
        """Whether ``block`` is ready (has a hash and is findable).

        Raises:
            UnknownBlockError: ``block`` is out of range.
        """
        self._check_id(block)
        return self._hash[block] is not None

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

    # -- lifecycle -----------------------------------------------------------

    @override
    def add_evict_listener(self, listener: EvictListener) -> None:
        """Call ``listener(block, hash)`` after every eviction (not on :meth:`reset`).

        Listeners run once :meth:`allocate` has finished changing the pool, so
        they see a consistent state.
        """
        if not callable(listener):
            raise PoolUsageError(f"an evict listener must be callable, got {listener!r}")
        self._listeners.append(listener)

    @override
    def reset(self) -> int:
        """Forget every cached block (the policy is told; evict listeners are not).

        Returns:
            How many ready blocks were dropped.

        Raises:
            RefcountError: some block is still referenced; nothing changed.
        """
        ref = self._ref
        if any(ref):
            held = [b for b, r in enumerate(ref) if r]
            raise RefcountError(
                f"cannot reset: {len(held)} blocks still referenced, e.g. {held[:8]!r}"
            )
        dropped = len(self._index)
        on_remove = self._policy.on_remove
        for b in self._index.values():
            on_remove(b)
        self._index.clear()
        n = self.num_blocks
        self._hash[:] = [None] * n
        self._empty[:] = range(n - 1, -1, -1)
        self._num_evictable = 0
        return dropped

    @override
    def check_invariants(self) -> None:
        n, ref, hashes, index = self.num_blocks, self._ref, self._hash, self._index
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
            f"policy tracks {len(self._policy)} blocks, {len(index)} are ready"
        )
        self._policy.check_invariants()
