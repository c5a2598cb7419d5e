"""Parent and child links among a policy's tracked blocks, in flat arrays indexed by block id (private).

A prefix cache hits a block only while its whole chain of parents is cached,
so a block whose parent hash is not tracked (an *orphan*) cannot hit until
that parent returns. Prefix-aware policies use :class:`FlatChains` to evict
orphans first and to evict a block's cached descendants before the block: a
walk yields a root's subtree deepest first, and one that stopped at its count
goes on where it stopped when that provably chooses what a fresh walk would.

The layout is for a pool of millions of blocks: a block's parent (its block
id, or a mark for none or for an orphan, whose parent hash a side map holds
while it is one) and its children (a doubly linked, circular sibling ring)
sit in ``array`` buffers indexed by block id, beside a list of hashes and a
hash-to-block map, not a dict of children per parent. Under a pool that
shares its index and hash list (:meth:`FlatChains.use_index`) those two are
the pool's own, and a tracked block costs four 32-bit slots here. The
children of a tracked parent hang off the parent's block id; those of a hash
not tracked (orphans waiting for it) off that hash in a side map, moved in
O(1) when the hash arrives or leaves. Children keep the order they were
linked in, and orphans the order they became orphans, so walks are
deterministic and survive ``deepcopy``.

A hash is never its own prefix: a block stored under its own hash as its
parent heads its chain (it is no orphan and has no child).

The batch loops, :meth:`FlatChains.add_many`, :meth:`FlatChains.remove_many`
and its check :meth:`FlatChains.distinct_tracked`, the walks of
:meth:`FlatChains.collect` and the orphans among a batch of pins or releases
(:meth:`FlatChains.orphans_among`) run the set of :data:`LOOPS` an index holds
in its ``_loops`` (:mod:`~kvkit.backends.twins`): the compiled
``_chains_loops`` module's functions where that extension was built, else
their Python references (:meth:`FlatChains.add_many_reference`,
:meth:`FlatChains.remove_many_reference`,
:meth:`FlatChains.distinct_tracked_reference`,
:meth:`FlatChains.collect_reference`,
:meth:`FlatChains.orphans_among_reference`), which hold the contract; the tests
drive both on the same calls and compare the whole state, the kept walk
included. An owner's compiled loop may call the set's ``collect`` itself, as
:meth:`FlatChains.collect` does.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple, Protocol, cast

import attrs

from kvkit.backends.eviction._common import already_tracked, any_block, hash_already_tracked, not_tracked
from kvkit.backends.eviction._queue import ParkingQueue
from kvkit.backends.twins import Twins
from kvkit.errors import PoolUsageError
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import plural

__all__ = ["LOOPS", "ChainLoops", "FlatChains"]

_NONE = -1  # no block, in the link arrays
_ORPHAN = -2  # in _up: the parent hash is not tracked (it is in _orphan_of)
_UNTRACKED = -3  # in _up: no block is tracked under this id
_LEFT = -4  # in _up, only within remove_many: its parent left earlier in the call and it leaves later
_INT = {int}


class AddMany(Protocol):
    def __call__(self, chains: FlatChains, owner: object, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
                 parents: Sequence[BlockHash | None],
                 pinned: bool, /) -> tuple[list[int], list[bool], PoolUsageError | None]:
        """:meth:`FlatChains.add_many` of ``chains``."""


class RemoveMany(Protocol):
    def __call__(self, chains: FlatChains, owner: object, blocks: Sequence[BlockId],
                 leaving: frozenset[int] | None, /) -> list[BlockHash]:
        """:meth:`FlatChains.remove_many` of ``chains``."""


class DistinctTracked(Protocol):
    def __call__(self, chains: FlatChains, blocks: Sequence[BlockId], /) -> frozenset[int]:
        """:meth:`FlatChains.distinct_tracked` of ``chains``."""


class Collect(Protocol):
    def __call__(self, chains: FlatChains, root: int, is_evictable: Callable[[int], bool],
                 chosen: dict[int, None], n: int, /) -> list[int]:
        """:meth:`FlatChains.collect` of ``chains``."""


@attrs.define
class _Walk:
    """A :meth:`FlatChains.collect` that stopped at ``n``, kept for the next one from ``root``.

    A fresh walk from ``root`` would first pass again the part this one has
    passed, choosing nothing there as long as its victims are gone, its
    skipped blocks are still skipped and none of its blocks gained a child,
    and then go on exactly from this stack. :meth:`FlatChains.add` and
    :meth:`FlatChains.remove` drop the walk on a new child of a block it
    pushed or on the removal of one that is not its victim;
    :meth:`FlatChains.collect` checks the rest.
    """

    root: int
    stack: list[tuple[int, bool]]  # (block, whether its children are pushed above it)
    held: set[int]  # every block pushed, less its victims removed since (their ids are reused)
    victims: set[int]  # blocks it chose or found chosen, not removed yet
    skipped: list[int]  # blocks it passed as parked or not evictable


@attrs.define
class FlatChains:
    """The chain structure of the tracked blocks: parents, children and orphans.

    ``parked`` is the owner's per-block byte array, ``PARKED`` where a block
    is pinned (shared, read only here). Block ids are ints ``>= 0``; the
    owner grows ``parked`` and calls :meth:`grow` before adding a block
    beyond their end.

    The orphans sit in a :class:`~kvkit.backends.eviction._queue.ParkingQueue`
    in the order they became orphans; the owner reports its pins
    (:meth:`pin`, :meth:`unpin`), so an orphan in use is set aside at once and
    :meth:`orphans` never yields one: a selection meets no pinned orphan,
    however many there are.

    Invariants:
        * A block is tracked where ``_up`` holds no ``_UNTRACKED`` mark.
          ``_hash[b]`` is the hash of tracked block ``b`` and ``_block_of``
          maps each tracked block's hash to it: a list (``None`` where no
          block is tracked) and a map kept here, or the driver's after
          :meth:`use_index`, never written here, which may also hold blocks
          not tracked here (being inserted or removed by the driver's call:
          every lookup checks ``_up``).
        * The sibling ring of a parent hash holds exactly the tracked blocks
          naming it as their parent, in the order they were linked; it hangs
          off ``_first[p]`` when the hash is tracked as block ``p``, else off
          ``_waiting[hash]``; no empty ring is kept.
        * ``_up[b]`` of a tracked block is its parent's block when the parent
          hash is tracked, ``_ORPHAN`` when it is not (the hash is then
          ``_orphan_of[b]``), ``_NONE`` when it has none.
        * ``_orphans`` holds exactly the tracked blocks whose parent hash is
          not ``None`` and not tracked; those parked are pinned there.
        * The kept walk holds only tracked blocks, and since it pushed them
          none has gained a child and none has left but its victims.
    """

    PARKED = 2

    parked: bytearray = attrs.field(repr=False)
    _own: dict[BlockHash, BlockId] | None = attrs.field(factory=dict, init=False, repr=False)  # None: shared
    _hash: list[BlockHash | None] = attrs.field(factory=list, init=False, repr=False)
    # A tracked block's parent: its block, _NONE at the head of a chain, _ORPHAN (the hash in _orphan_of);
    # _UNTRACKED where no block is tracked.
    _up: array = attrs.field(factory=lambda: array("i"), init=False, repr=False)
    _orphan_of: dict[BlockId, BlockHash] = attrs.field(factory=dict, init=False, repr=False)
    _block_of: Mapping[BlockHash, BlockId] = attrs.field(init=False, repr=False,
                                                         default=attrs.Factory(lambda self: self._own, takes_self=True))
    # A tracked block's first child (_NONE: none); its siblings' ring, next and previous.
    _first: array = attrs.field(factory=lambda: array("i"), init=False, repr=False)
    _next: array = attrs.field(factory=lambda: array("i"), init=False, repr=False)
    _prev: array = attrs.field(factory=lambda: array("i"), init=False, repr=False)
    _waiting: dict[BlockHash, int] = attrs.field(factory=dict, init=False, repr=False)
    _orphans: ParkingQueue = attrs.field(factory=ParkingQueue, init=False, repr=False)
    _walk: _Walk | None = attrs.field(default=None, init=False, repr=False)
    # The batch loops it runs (the tests set the references to compare the two).
    _loops: ChainLoops = attrs.field(init=False, eq=False, repr=False, factory=lambda: LOOPS.default())

    def grow(self, size: int) -> None:
        """Make room for block ids below ``size``."""
        more = size - len(self._up)
        if more > 0:
            if self._own is not None:  # else the driver's list covers its ids
                self._hash += [None] * more
            self._up += array("i", [_UNTRACKED]) * more
            links = array("i", [_NONE]) * more
            self._first += links
            self._next += links
            self._prev += links

    def use_index(self, owner: object, index: Mapping[BlockHash, BlockId],
                  hashes: Sequence[BlockHash | None]) -> None:
        """Read the hash-to-block map from ``index`` and each block's hash from ``hashes`` (the driver keeps
        both, an :class:`~kvkit.interfaces.capabilities.IndexedPolicy`'s promise) instead of keeping them here.

        Raises:
            PoolUsageError: a block is tracked already (``owner`` names the policy).
        """
        if self._own is None or self._own:
            state = "already reads one" if self._own is None else f"tracks {plural(len(self._own), 'block')}"
            raise PoolUsageError(f"{type(owner).__name__}.use_index: an index is taken once, before the "
                                 f"first block; it {state}")
        self._own = None
        self._block_of = index
        self._hash = cast(list[BlockHash | None], hashes)  # read only from now on

    # -- membership ----------------------------------------------------------------

    def add(self, owner: object, block: BlockId, block_hash: BlockHash,
            parent: BlockHash | None, pinned: bool = False) -> BlockId | None:
        """Track ``block`` (its id below the grown size); return its parent's block if that is tracked.

        ``pinned``: the owner parks it at once (as :meth:`pin` right after would).

        Raises:
            PoolUsageError: ``block`` or ``block_hash`` is already tracked
                (``owner`` names the policy in the message).
        """
        parent_blocks, _, refusal = self.add_many(owner, (block,), (block_hash,), (parent,), pinned)
        if refusal is not None:
            raise refusal
        return BlockId(parent_blocks[0]) if parent_blocks[0] != _NONE else None

    def add_many(self, owner: object, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
                 parents: Sequence[BlockHash | None],
                 pinned: bool = False) -> tuple[list[int], list[bool], PoolUsageError | None]:
        """:meth:`add` for each block, in order (ids below the grown size), until one is refused.

        Returns, per block added, its parent's block (``-1`` where the parent
        hash is ``None``, the block's own or not tracked) and whether it had
        children the moment it was added (the orphans waiting for its hash);
        then the refusal, ``None`` when every block was added, which the owner
        raises once it has booked those added (a refused block and those
        after it change nothing).
        """
        return self._loops.add_many(self, owner, blocks, hashes, parents, pinned)

    def add_many_reference(self, owner: object, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
                           parents: Sequence[BlockHash | None],
                           pinned: bool = False) -> tuple[list[int], list[bool], PoolUsageError | None]:
        """:meth:`add_many` in Python: the reference of the compiled loop."""
        up, first_of, nxt, prv = self._up, self._first, self._next, self._prev
        waiting, orphans, orphan_of, own, hash_of = self._waiting, self._orphans, self._orphan_of, self._own, \
            self._hash
        lookup, parked, mark, size, walk = self._block_of.get, self.parked, self.PARKED, len(self._up), self._walk
        parent_blocks: list[int] = []
        fresh: list[bool] = []
        last_hash: BlockHash | None = None  # the block added last in this call, and its hash
        last_block = _NONE
        for block, block_hash, parent in zip(blocks, hashes, parents):
            if up[block] != _UNTRACKED:
                return parent_blocks, fresh, already_tracked(owner, block)
            if own is not None:  # (a driver's index maps the hash to this block: no other holds it)
                other = own.get(block_hash)
                if other is not None and up[other] != _UNTRACKED:
                    return parent_blocks, fresh, hash_already_tracked(owner, block, block_hash, other)
                hash_of[block] = block_hash
                own[block_hash] = block
            first = waiting.pop(block_hash, _NONE)
            if first != _NONE:  # its children were orphans: their parent is back
                first_of[block] = first
                child = first
                while True:
                    orphans.remove(BlockId(child))
                    del orphan_of[BlockId(child)]
                    up[child] = block
                    child = nxt[child]
                    if child == first:
                        break
            fresh.append(first != _NONE)
            previous_hash, previous = last_hash, last_block
            last_hash, last_block = block_hash, block
            if parent is None or parent == block_hash:
                up[block] = _NONE
                parent_blocks.append(_NONE)
                continue
            # A chain stored in one call names the block added just before: tracked, no lookup needed.
            parent_block = previous if parent == previous_hash else lookup(parent)
            if parent_block is None or parent_block >= size or up[parent_block] == _UNTRACKED:
                up[block] = _ORPHAN
                orphan_of[block] = parent
                waiting[parent] = self._link(block, waiting.get(parent, _NONE))
                orphans.add(block, pinned or parked[block] == mark)
                parent_blocks.append(_NONE)
                continue
            up[block] = parent_block
            head = first_of[parent_block]
            if head == _NONE:  # self._link, inlined: the hot path
                nxt[block] = prv[block] = first_of[parent_block] = block
            else:
                last = prv[head]
                nxt[last], prv[block], nxt[block], prv[head] = block, last, head, block
            if walk is not None and parent_block in walk.held:
                self._walk = walk = None  # a new child of a block the walk has passed
            parent_blocks.append(parent_block)
        return parent_blocks, fresh, None

    def remove(self, owner: object, block: BlockId) -> BlockHash:
        """Forget ``block`` (its tracked children become orphans); return its hash.

        Raises:
            PoolUsageError: ``block`` is not tracked.
        """
        return self.remove_many(owner, (block,))[0]

    def remove_many(self, owner: object, blocks: Sequence[BlockId],
                    leaving: frozenset[int] | None = None) -> list[BlockHash]:
        """:meth:`remove` for each block, in order; return their hashes.

        A child of a removed block that leaves later in the same call never
        joins the orphans or their rings (it would leave them again at once):
        the orphans that stay, their rings and their order, are those of the
        blocks removed one by one.

        ``leaving``: :meth:`distinct_tracked` of ``blocks``, if the caller has it.

        Raises:
            PoolUsageError: a block is not tracked (those before it are removed).
        """
        return self._loops.remove_many(self, owner, blocks, leaving)

    def remove_many_reference(self, owner: object, blocks: Sequence[BlockId],
                              leaving: frozenset[int] | None = None) -> list[BlockHash]:
        """:meth:`remove_many` in Python: the reference of the compiled loop."""
        hashes, up, own, waiting, first_of = self._hash, self._up, self._own, self._waiting, self._first
        orphans, orphan_of, nxt, prv, parked, mark = self._orphans, self._orphan_of, self._next, self._prev, \
            self.parked, self.PARKED
        if leaving is None:
            leaving = self.distinct_tracked(blocks)
        checked = bool(leaving)  # every block tracked, each named once: none can be refused
        walk = self._walk
        unqueued: list[BlockId] = []  # orphans leaving, taken out of their queue in one call after the loop
        unqueue = unqueued.append if checked else orphans.remove
        removed = []
        for block in blocks:
            if not checked and not self.tracks(block):
                raise not_tracked(owner, block)
            block_hash = hashes[block]
            assert block_hash is not None
            if own is not None:
                hashes[block] = None
                del own[block_hash]
            parent_block, up[block] = up[block], _UNTRACKED
            if parent_block == _ORPHAN:
                parent = orphan_of.pop(block)
                unqueue(block)
                rest = self._unlink(block, waiting[parent])
                if rest == _NONE:
                    del waiting[parent]
                else:
                    waiting[parent] = rest
            elif parent_block >= 0:  # self._unlink from its parent's ring, inlined: the hot path
                after = nxt[block]
                if after == block:
                    first_of[parent_block] = _NONE
                else:
                    before = prv[block]
                    nxt[before], prv[after] = after, before
                    if first_of[parent_block] == block:
                        first_of[parent_block] = after
            first = first_of[block]
            if first != _NONE:
                first_of[block] = _NONE
                if nxt[first] == first and first in leaving:  # an only child, leaving too (a chain's)
                    up[first] = _LEFT
                else:  # the children that stay wait for the hash now, as orphans
                    staying = []
                    left = False
                    child = first
                    while True:
                        if child in leaving:
                            up[child] = _LEFT
                            left = True
                        else:
                            staying.append(child)
                        child = nxt[child]
                        if child == first:
                            break
                    if staying:
                        ring = first
                        if left:  # the ring less the children leaving, in its order
                            ring = _NONE
                            for child in staying:
                                ring = self._link(child, ring)
                        waiting[block_hash] = ring
                        for child in staying:
                            orphans.add(BlockId(child), parked[child] == mark)
                            orphan_of[BlockId(child)] = block_hash
                            up[child] = _ORPHAN
            if walk is not None and block in walk.held:
                if block in walk.victims:
                    walk.victims.remove(block)
                    walk.held.remove(block)  # its id may come back as another block
                else:
                    self._walk = walk = None
            removed.append(block_hash)
        orphans.remove_many(unqueued)
        return removed

    def distinct_tracked(self, blocks: Sequence[BlockId]) -> frozenset[int]:
        """``blocks`` as a set if there are several, distinct and all tracked (a removal of them all cannot
        stop half way), else empty."""
        return self._loops.distinct_tracked(self, blocks)

    def distinct_tracked_reference(self, blocks: Sequence[BlockId]) -> frozenset[int]:
        """:meth:`distinct_tracked` in Python (passes at C speed): the reference of the compiled loop."""
        if len(blocks) < 2:
            return frozenset()
        leaving = frozenset(blocks)
        up = self._up
        if len(leaving) == len(blocks) and set(map(type, leaving)) == _INT and min(leaving) >= 0 \
                and max(leaving) < len(up) and _UNTRACKED not in map(up.__getitem__, leaving):
            return leaving
        return frozenset()

    def _tracked_block(self, block_hash: BlockHash) -> BlockId | None:
        """The tracked block carrying ``block_hash``, or ``None``."""
        block = self._block_of.get(block_hash)
        if block is None or block >= len(self._up) or self._up[block] == _UNTRACKED:
            return None
        return block

    def _link(self, block: int, first: int) -> int:
        """Append ``block`` to the sibling ring starting at ``first`` (``_NONE``: a new ring); return its first."""
        nxt, prv = self._next, self._prev
        if first == _NONE:
            nxt[block] = prv[block] = block
            return block
        last = prv[first]
        nxt[last], prv[block], nxt[block], prv[first] = block, last, first, block
        return first

    def _unlink(self, block: int, first: int) -> int:
        """Take ``block`` out of the sibling ring starting at ``first``; return the ring's first (``_NONE``: empty)."""
        nxt, prv = self._next, self._prev
        after = nxt[block]
        if after == block:
            return _NONE
        before = prv[block]
        nxt[before], prv[after] = after, before
        return after if first == block else first

    # -- queries -------------------------------------------------------------------

    def links(self, block: BlockId) -> tuple[BlockHash | None, BlockHash | None]:
        """A tracked block's hash and its parent hash (``None`` at the head of a chain)."""
        up = self._up[block]
        return self._hash[block], self._hash[up] if up >= 0 else self._orphan_of.get(block)

    def has_children(self, block: BlockId) -> bool:
        """Whether some tracked block names ``block``'s hash as its parent."""
        return self._first[block] != _NONE

    @property
    def child_rings(self) -> array:
        """Per block id, the first child of a tracked block (``-1``: none), for an owner's hot loop: read only."""
        return self._first

    @property
    def sibling_rings(self) -> array:
        """Per block id, the next child in the ring of its parent's children (itself for an only child), read
        where the block is a child of a tracked block (:attr:`child_rings` names the first), for an owner's
        hot loop: read only."""
        return self._next

    def tracks(self, block: BlockId) -> bool:
        """Whether ``block`` is tracked."""
        return block.__class__ is int and 0 <= block < len(self._up) and self._up[block] != _UNTRACKED

    def has_hash(self, block_hash: BlockHash) -> bool:
        """Whether some tracked block carries ``block_hash``."""
        return self._tracked_block(block_hash) is not None

    def children(self, block: BlockId) -> list[BlockId]:
        """A tracked block's tracked children, in the order they were linked."""
        return self._ring(self._first[block])

    def _ring(self, first: int) -> list[BlockId]:
        ring: list[BlockId] = []
        child = first
        while child != _NONE:
            ring.append(BlockId(child))
            child = self._next[child]
            if child == first:
                break
        return ring

    def __len__(self) -> int:
        return len(self._block_of)

    # -- pins and selection ------------------------------------------------------------

    def pin(self, block: BlockId) -> None:
        """The owner parked ``block`` (in use): an orphan is set aside until :meth:`unpin`."""
        self.pin_many((block,))

    def pin_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`pin` for each block, in order."""
        if self._orphan_of:  # else none is an orphan
            self._orphans.pin_many(self._loops.orphans_among(self, blocks))

    def unpin(self, block: BlockId) -> None:
        """The owner released ``block``: an orphan is an orphan in its place again."""
        self.unpin_many((block,))

    def unpin_many(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`unpin` for each block, in order."""
        if self._orphan_of:  # else none is an orphan
            self._orphans.unpin_many(self._loops.orphans_among(self, blocks))

    def orphans_among(self, blocks: Sequence[BlockId]) -> list[BlockId]:
        """The orphans among ``blocks`` (ids below the grown size), in their order."""
        return self._loops.orphans_among(self, blocks)

    def orphans_among_reference(self, blocks: Sequence[BlockId]) -> list[BlockId]:
        """:meth:`orphans_among` in Python: the reference of the compiled loop."""
        up = self._up
        return [block for block in blocks if up[block] == _ORPHAN]

    def orphans(self) -> Iterator[BlockId] | None:
        """Orphans not in use, in the order they became orphans (the index must not change meanwhile);
        ``None`` if no block is an orphan."""
        return self._orphans.walk(any_block) if len(self._orphans) else None

    def forget_walk(self) -> None:
        """Drop the kept walk, as :meth:`collect` from a childless root does: an owner that chooses such a
        root itself (asked as :meth:`collect` would ask) calls this instead."""
        self._walk = None

    def collect(self, root: int, is_evictable: Callable[[int], bool],
                chosen: dict[int, None], n: int) -> list[int]:
        """Add ``root``'s subtree to ``chosen``, descendants before ancestors, until ``n`` are chosen; return
        the blocks added.

        Walks the tracked blocks below ``root`` depth first and appends each
        evictable, not yet chosen block after all of its descendants (post
        order), so a chosen block's evictable descendants are always chosen
        before it. Blocks that may not be evicted are skipped, their subtrees
        are not. Parked blocks (``PARKED`` in ``parked``) are not evictable
        and are skipped without asking ``is_evictable``.

        A walk that stops at ``n`` is kept, and the next call from the same
        root goes on where it stopped if that chooses exactly what a fresh
        walk would: every block it chose has been removed since (the
        selection was carried out), every block it skipped is still parked
        or not evictable (each is asked again), and no block it pushed has
        gained a child or been removed otherwise (:meth:`add` and
        :meth:`remove` drop the walk then). Evicting a chain one victim per
        call thus costs O(1) amortised per victim, plus one question per
        skipped block at each resume, instead of the chain's depth per call.

        A block already in ``chosen`` is not walked below: it was chosen by an
        earlier walk of the same selection, which chose its subtree before it
        (every walk but the last of a selection runs to its end), so a
        selection that moves up a chain root by root walks each block once,
        not once per root above it.
        """
        return self._loops.collect(self, root, is_evictable, chosen, n)

    def collect_reference(self, root: int, is_evictable: Callable[[int], bool],
                          chosen: dict[int, None], n: int) -> list[int]:
        """:meth:`collect` in Python: the reference of the compiled walk."""
        parked, mark = self.parked, self.PARKED
        first = self._first
        if first[root] == _NONE and len(chosen) < n:  # a childless root: its walk is the root alone
            self._walk = None
            if root in chosen or parked[root] == mark or not is_evictable(root):
                return []
            chosen[root] = None
            return [root]
        walk = self._walk
        if walk is None or walk.root != root:  # a fresh walk: one that runs to its end, short
            whole = self._collect_whole(root, is_evictable, chosen, n)
            if whole is not None:
                return whole
        if walk is not None and walk.root == root and not walk.victims and \
                all(parked[b] == mark or not is_evictable(b) for b in walk.skipped):
            stack, held, victims, skipped = walk.stack, walk.held, walk.victims, walk.skipped
        else:  # a fresh walk (a _Walk only if it is kept)
            walk, stack, held, victims, skipped = None, [(root, False)], {root}, set(), []
        prv = self._prev
        pop, push, hold, victim = stack.pop, stack.append, held.add, victims.add
        picked: list[int] = []
        while stack and len(chosen) < n:
            block, expanded = pop()
            if not expanded:
                push((block, True))
                head = first[block]
                if head != _NONE:
                    child = prv[head]  # the last child first: the first one is walked first
                    while True:
                        if child not in held:
                            hold(child)
                            if child in chosen:  # with its subtree, by an earlier walk of this selection
                                victim(child)
                            else:
                                push((child, False))
                        if child == head:
                            break
                        child = prv[child]
            elif block in chosen:
                victim(block)
            elif parked[block] != mark and is_evictable(block):
                chosen[block] = None
                picked.append(block)
                victim(block)
            else:
                skipped.append(block)
        self._walk = None if not stack else walk if walk is not None else _Walk(root, stack, held, victims, skipped)
        return picked

    def _collect_whole(self, root: int, is_evictable: Callable[[int], bool],
                       chosen: dict[int, None], n: int) -> list[int] | None:
        """:meth:`collect`'s fresh walk from ``root`` when it cannot stop before its end; ``None`` otherwise,
        nothing done.

        It lists the blocks that walk pushes, at most ``n - len(chosen)`` (past that it might stop
        early): ``root``, then, below each listed block, its children not chosen (the walk does not
        push those) other than ``root`` (the only block a fresh walk can meet twice, each block
        being in one sibling ring). Listed by a stack that takes each block's last child first (an
        only child at once: a chain is listed in one pass down), they come in the reverse of the
        walk's post order, so read backwards they are that walk's choices: each one not chosen, not
        parked and evictable. No stack entries, held or victim sets are kept for a walk that ends (a
        selection moving up a chain takes each block this way).
        """
        first, nxt = self._first, self._next
        room = n - len(chosen)
        if room < 1:  # the walk stops before its root
            return None
        listed: list[int] = []
        stack = [root]
        pop, push, add = stack.pop, stack.append, listed.append
        pushed = 1
        while stack:
            block = pop()
            while True:
                add(block)
                head = first[block]
                if head == _NONE:
                    break
                if nxt[head] == head:  # an only child: pushed and popped at once
                    if head in chosen or head == root:
                        break
                    pushed += 1
                    if pushed > room:  # the walk might stop before its end
                        return None
                    block = head
                    continue
                child = head
                while True:
                    if child not in chosen and child != root:
                        push(child)
                        pushed += 1
                    child = nxt[child]
                    if child == head:
                        break
                if pushed > room:
                    return None
                break
        self._walk = None
        parked, mark = self.parked, self.PARKED
        picked = []
        for block in reversed(listed):
            if parked[block] != mark and block not in chosen and is_evictable(block):
                chosen[block] = None
                picked.append(block)
        return picked

    # -- checks ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the maps, rings or orphans disagree."""
        tracked: dict[BlockId, BlockHash] = {}
        for b, up in enumerate(self._up):
            if up != _UNTRACKED:
                block_hash = self._hash[b]
                assert block_hash is not None, f"tracked block {b} has no hash"
                tracked[BlockId(b)] = block_hash
        assert self._own is None or sum(h is not None for h in self._hash) == len(tracked), "a hash left behind"
        assert len(tracked) == len(self._block_of), "hash maps differ in size"
        for block, block_hash in tracked.items():
            assert self._block_of[block_hash] == block, f"block {block} hash map disagrees"
        linked: dict[BlockHash, list[BlockId]] = {}
        for block in tracked:
            up = self._up[block]
            parent = self.links(block)[1]
            assert parent != tracked[block], f"block {block} is its own parent"
            assert (up == _ORPHAN) == (block in self._orphan_of), f"block {block} orphan mark"
            assert up in (_NONE, _ORPHAN) or up in tracked, f"the parent of block {block}, block {up}, is not tracked"
            assert up != _NONE or parent is None, f"block {block} lost its parent"
            if parent is not None:
                linked.setdefault(parent, []).append(block)
        rings = {tracked[b]: self.children(b) for b in tracked if self._first[b] != _NONE}
        for block_hash, first in self._waiting.items():
            assert not self.has_hash(block_hash), f"children wait for tracked hash {block_hash}"
            rings[block_hash] = self._ring(first)
        assert {h: sorted(c) for h, c in linked.items()} == {h: sorted(c) for h, c in rings.items()}, \
            "children rings drifted"
        for ring in rings.values():
            assert all(self._next[self._prev[b]] == b for b in ring), "a sibling ring is broken"
        parents = {b: self.links(b)[1] for b in tracked}
        orphans = {b for b, parent in parents.items() if parent is not None and not self.has_hash(parent)}
        assert orphans == self._orphan_of.keys(), "orphan parents drifted"
        assert orphans == set(self._orphans.in_order()), f"orphans {self._orphans.in_order()} != {orphans}"
        assert self._orphans.pinned == {b for b in orphans if self.parked[b] == self.PARKED}, \
            "pinned orphans drifted"
        self._orphans.check_invariants()
        walk = self._walk
        if walk is not None:
            assert walk.stack and walk.stack[0][0] == walk.root, "kept walk lost its root"
            assert all(b in tracked for b in walk.held), "kept walk holds an untracked block"
            assert walk.victims | set(walk.skipped) | {b for b, _ in walk.stack} <= walk.held, \
                "kept walk's blocks not all held"


class ChainLoops(NamedTuple):
    """The loops a :class:`FlatChains` runs, each called with the index first."""

    add_many: AddMany
    remove_many: RemoveMany
    distinct_tracked: DistinctTracked
    collect: Collect
    orphans_among: Callable[[FlatChains, Sequence[BlockId]], list[BlockId]]


LOOPS: Twins[ChainLoops] = Twins.load(ChainLoops(FlatChains.add_many_reference, FlatChains.remove_many_reference,
                                                 FlatChains.distinct_tracked_reference,
                                                 FlatChains.collect_reference,
                                                 FlatChains.orphans_among_reference),
                   "kvkit.backends.eviction._chains_loops")
