"""Parent and child links among a policy's tracked blocks (private).

A prefix cache hits a block only while its whole chain of parents is cached,
so a block whose parent hash is not tracked (an *orphan*) cannot hit until
that parent returns. Prefix-aware policies use :class:`ChainIndex` to evict
orphans first and to evict a block's cached descendants before the block.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator

import attrs

from kvkit.backends.eviction._common import already_tracked, any_block, hash_already_tracked, not_tracked
from kvkit.backends.eviction._queue import ParkingQueue
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["ChainIndex"]


@attrs.define
class _Walk:
    """A :meth:`ChainIndex.collect` that stopped at ``n``, kept for the next one from ``root``.

    A fresh walk from ``root`` would first pass again the part this one has
    passed, choosing nothing there as long as its victims are gone, its
    skipped blocks are still skipped and none of its blocks gained a child,
    and then go on exactly from this stack. :meth:`ChainIndex.add` and
    :meth:`ChainIndex.remove` drop the walk on a new child of a block it
    pushed or on the removal of one that is not its victim; :meth:`resumes`
    checks the rest.
    """

    root: BlockId
    stack: list[tuple[BlockId, bool]]  # (block, whether its children are pushed above it)
    held: set[BlockId]  # every block pushed, less its victims removed since (their ids are reused)
    victims: set[BlockId]  # blocks it chose or found chosen, not removed yet
    skipped: list[BlockId]  # blocks it passed as parked or not evictable

    def resumes(self, root: BlockId, is_evictable: Callable[[BlockId], bool],
                parked: Container[BlockId]) -> bool:
        """Whether going on from ``root`` chooses what a fresh walk would: victims gone, skipped still skipped."""
        return root == self.root and not self.victims and \
            all(b in parked or not is_evictable(b) for b in self.skipped)


@attrs.define
class ChainIndex:
    """The chain structure of the tracked blocks: parents, children and orphans.

    Children are kept by their parent's *hash*, so a block inserted before its
    parent (or after its parent was evicted and before it returns) is linked as
    soon as the parent hash is tracked again. Everything iterated is
    insertion-ordered (dicts and lists, never sets), so walks are
    deterministic and survive ``deepcopy``.

    The orphans sit in a :class:`~kvkit.backends.eviction._queue.ParkingQueue`
    in the order they became orphans; the owning policy reports its pins
    (:meth:`pin`, :meth:`unpin`), so an orphan in use is set aside at once and
    :meth:`orphans` never yields one: a selection meets no pinned orphan,
    however many there are. ``parked`` is the owner's container of pinned
    blocks (shared, read only here).

    Invariants:
        * ``_hash`` and ``_block_of`` are inverse maps of the tracked blocks.
        * ``_children[h]`` holds exactly the tracked blocks whose parent hash is
          ``h``, and is never empty.
        * ``_orphans`` holds exactly the tracked blocks whose parent hash is
          not ``None`` and not tracked; those in ``parked`` are pinned there.
        * The walk kept by :meth:`collect`, if any, holds only tracked
          blocks, and since it pushed them none has gained a child and none
          has left the index but its victims (which leave the walk too).
    """

    _hash: dict[BlockId, BlockHash] = attrs.field(factory=dict, init=False)
    _parent: dict[BlockId, BlockHash | None] = attrs.field(factory=dict, init=False)
    _block_of: dict[BlockHash, BlockId] = attrs.field(factory=dict, init=False)
    _children: dict[BlockHash, dict[BlockId, None]] = attrs.field(factory=dict, init=False)
    _orphans: ParkingQueue = attrs.field(factory=ParkingQueue, init=False)
    _walk: _Walk | None = attrs.field(default=None, init=False)
    parked: Container[BlockId] = attrs.field(default=(), repr=False)

    def add(self, owner: object, block: BlockId, block_hash: BlockHash,
            parent: BlockHash | None) -> BlockId | None:
        """Track ``block``; return its parent's block if that is tracked.

        Raises:
            PoolUsageError: ``block`` or ``block_hash`` is already tracked
                (``owner`` names the policy in the message).
        """
        if block in self._hash:
            raise already_tracked(owner, block)
        if block_hash in self._block_of:
            raise hash_already_tracked(owner, block, block_hash, self._block_of[block_hash])
        self._hash[block] = block_hash
        self._parent[block] = parent
        self._block_of[block_hash] = block
        orphans = self._orphans
        for child in self._children.get(block_hash, ()):
            orphans.remove(child)  # its parent is back
        if parent is None:
            return None
        self._children.setdefault(parent, {})[block] = None
        parent_block = self._block_of.get(parent)
        if parent_block is None:
            orphans.add(block, pinned=block in self.parked)
        elif self._walk is not None and parent_block in self._walk.held:
            self._walk = None  # a new child of a block the walk has passed
        return parent_block

    def remove(self, owner: object, block: BlockId) -> BlockHash:
        """Forget ``block`` (its cached children become orphans); return its hash.

        Raises:
            PoolUsageError: ``block`` is not tracked.
        """
        block_hash = self._hash.pop(block, None)
        if block_hash is None:
            raise not_tracked(owner, block)
        parent = self._parent.pop(block)
        orphans, parked = self._orphans, self.parked
        if parent is not None and parent not in self._block_of:  # asked first: a hash may name itself its parent
            orphans.remove(block)
        del self._block_of[block_hash]
        if parent is not None:
            siblings = self._children[parent]
            del siblings[block]
            if not siblings:
                del self._children[parent]
        for child in self._children.get(block_hash, ()):
            orphans.add(child, pinned=child in parked)
        walk = self._walk
        if walk is not None and block in walk.held:
            if block in walk.victims:
                walk.victims.remove(block)
                walk.held.remove(block)  # its id may come back as another block
            else:
                self._walk = None
        return block_hash

    def tracks(self, block: BlockId) -> bool:
        """Whether ``block`` is tracked."""
        return block in self._hash

    def has_hash(self, block_hash: BlockHash) -> bool:
        """Whether some tracked block carries ``block_hash``."""
        return block_hash in self._block_of

    def links(self, block: BlockId) -> tuple[BlockHash, BlockHash | None]:
        """A tracked block's hash and its parent hash (``None`` at the head of a chain)."""
        return self._hash[block], self._parent[block]

    def has_children(self, block: BlockId) -> bool:
        """Whether some tracked block names ``block``'s hash as its parent."""
        return self._hash[block] in self._children

    def pin(self, block: BlockId) -> None:
        """The owner parked ``block`` (in use): an orphan is set aside until :meth:`unpin`."""
        parent = self._parent[block]
        if parent is not None and parent not in self._block_of:
            self._orphans.pin(block)

    def unpin(self, block: BlockId) -> None:
        """The owner released ``block``: an orphan is an orphan in its place again."""
        parent = self._parent[block]
        if parent is not None and parent not in self._block_of:
            self._orphans.unpin(block)

    def orphans(self) -> Iterator[BlockId]:
        """Orphans not in use, in the order they became orphans (the index must not change meanwhile)."""
        return self._orphans.walk(any_block)

    def __len__(self) -> int:
        return len(self._hash)

    def collect(self, root: BlockId, is_evictable: Callable[[BlockId], bool],
                chosen: dict[BlockId, None], n: int, parked: Container[BlockId] = ()) -> None:
        """Add ``root``'s subtree to ``chosen``, descendants before ancestors, until ``n`` are chosen.

        Walks the tracked blocks below ``root`` depth first and appends each
        evictable, not yet chosen block after all of its descendants (post
        order), so a chosen block's evictable descendants are always chosen
        before it. Blocks that may not be evicted are skipped, their subtrees
        are not. Blocks in ``parked`` (set aside by a policy's pin hooks) are
        not evictable and are skipped without asking ``is_evictable``.

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
        walk = self._walk
        if walk is None or not walk.resumes(root, is_evictable, parked):
            walk = _Walk(root, [(root, False)], {root}, set(), [])
        children, hashes = self._children, self._hash
        stack, held, victims, skipped = walk.stack, walk.held, walk.victims, walk.skipped
        while stack and len(chosen) < n:
            block, expanded = stack.pop()
            if not expanded:
                stack.append((block, True))
                for child in reversed(children.get(hashes[block], ())):
                    if child not in held:  # a hash cycle (impossible for content hashes) can't loop
                        held.add(child)
                        if child in chosen:  # with its subtree, by an earlier walk of this selection
                            victims.add(child)
                        else:
                            stack.append((child, False))
            elif block in chosen or (block not in parked and is_evictable(block)):
                chosen[block] = None
                victims.add(block)
            else:
                skipped.append(block)
        self._walk = walk if stack else None

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the maps disagree."""
        assert len(self._hash) == len(self._block_of) == len(self._parent), "maps differ in size"
        for block, block_hash in self._hash.items():
            assert self._block_of[block_hash] == block, f"block {block} hash map disagrees"
        linked: dict[BlockHash, dict[BlockId, None]] = {}
        for block, parent in self._parent.items():
            if parent is not None:
                linked.setdefault(parent, {})[block] = None
        assert {h: set(c) for h, c in linked.items()} == \
            {h: set(c) for h, c in self._children.items()}, "children map drifted"
        orphans = {b for b, p in self._parent.items() if p is not None and p not in self._block_of}
        assert orphans == set(self._orphans.in_order()), f"orphans {self._orphans.in_order()} != {orphans}"
        assert self._orphans.pinned == {b for b in orphans if b in self.parked}, "pinned orphans drifted"
        self._orphans.check_invariants()
        walk = self._walk
        if walk is not None:
            assert walk.stack and walk.stack[0][0] == walk.root, "kept walk lost its root"
            assert walk.held <= self._hash.keys(), f"kept walk holds untracked {walk.held - self._hash.keys()}"
            assert walk.victims | set(walk.skipped) | {b for b, _ in walk.stack} <= walk.held, \
                "kept walk's blocks not all held"
