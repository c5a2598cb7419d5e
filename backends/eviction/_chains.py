"""Parent and child links among a policy's tracked blocks (private).

A prefix cache hits a block only while its whole chain of parents is cached,
so a block whose parent hash is not tracked (an *orphan*) cannot hit until
that parent returns. Prefix-aware policies use :class:`ChainIndex` to evict
orphans first and to evict a block's cached descendants before the block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterator

import attrs

from kvkit.backends.eviction._common import already_tracked, hash_already_tracked, not_tracked
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["ChainIndex"]


@attrs.define
class ChainIndex:
    """The chain structure of the tracked blocks: parents, children and orphans.

    Children are kept by their parent's *hash*, so a block inserted before its
    parent (or after its parent was evicted and before it returns) is linked as
    soon as the parent hash is tracked again. Every map is insertion-ordered
    (dicts, never sets), so walks are deterministic and survive ``deepcopy``.

    Invariants:
        * ``_hash`` and ``_block_of`` are inverse maps of the tracked blocks.
        * ``_children[h]`` holds exactly the tracked blocks whose parent hash is
          ``h``, and is never empty.
        * ``_orphans`` holds exactly the tracked blocks whose parent hash is
          not ``None`` and not tracked.
    """

    _hash: dict[BlockId, BlockHash] = attrs.field(factory=dict, init=False)
    _parent: dict[BlockId, BlockHash | None] = attrs.field(factory=dict, init=False)
    _block_of: dict[BlockHash, BlockId] = attrs.field(factory=dict, init=False)
    _children: dict[BlockHash, dict[BlockId, None]] = attrs.field(factory=dict, init=False)
    _orphans: OrderedDict[BlockId, None] = attrs.field(factory=OrderedDict, init=False)

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
        for child in self._children.get(block_hash, ()):
            self._orphans.pop(child, None)  # its parent is back
        if parent is None:
            return None
        self._children.setdefault(parent, {})[block] = None
        parent_block = self._block_of.get(parent)
        if parent_block is None:
            self._orphans[block] = None
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
        del self._block_of[block_hash]
        self._orphans.pop(block, None)
        if parent is not None:
            siblings = self._children[parent]
            del siblings[block]
            if not siblings:
                del self._children[parent]
        for child in self._children.get(block_hash, ()):
            self._orphans[child] = None
        return block_hash

    def tracks(self, block: BlockId) -> bool:
        """Whether ``block`` is tracked."""
        return block in self._hash

    def has_hash(self, block_hash: BlockHash) -> bool:
        """Whether some tracked block carries ``block_hash``."""
        return block_hash in self._block_of

    def has_children(self, block: BlockId) -> bool:
        """Whether some tracked block names ``block``'s hash as its parent."""
        return self._hash[block] in self._children

    def orphans(self) -> Iterator[BlockId]:
        """Orphans, in the order they became orphans."""
        return iter(self._orphans)

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
        """
        children, hashes = self._children, self._hash
        stack: list[tuple[BlockId, bool]] = [(root, False)]
        seen: set[BlockId] = set()  # a hash cycle (impossible for content hashes) can't loop
        while stack and len(chosen) < n:
            block, expanded = stack.pop()
            if expanded:
                if block not in chosen and block not in parked and is_evictable(block):
                    chosen[block] = None
            elif block not in seen:
                seen.add(block)
                stack.append((block, True))
                below = children.get(hashes[block])
                if below:
                    stack += [(c, False) for c in reversed(below)]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the maps disagree."""
        assert len(self._hash) == len(self._block_of) == len(self._parent), "maps differ in size"
        for block, block_hash in self._hash.items():
            assert self._block_of[block_hash] == block, f"block {block} hash map disagrees"
        linked = {}
        for block, parent in self._parent.items():
            if parent is not None:
                linked.setdefault(parent, {})[block] = None
        assert {h: set(c) for h, c in linked.items()} == \
            {h: set(c) for h, c in self._children.items()}, "children map drifted"
        orphans = {b for b, p in self._parent.items() if p is not None and p not in self._block_of}
        assert orphans == set(self._orphans), f"orphans {set(self._orphans)} != {orphans}"
