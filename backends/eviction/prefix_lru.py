"""Prefix-aware LRU: the least recently used chain goes first, from its deepest block up."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable

import attrs
from typing_extensions import override

from kvkit.backends.eviction._chains import ChainIndex
from kvkit.backends.eviction._common import check_count, move_pinned, not_tracked
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["PrefixLRUPolicy"]


@attrs.define
class PrefixLRUPolicy(EvictionPolicy):
    """LRU that never strands a child: descendants go before their ancestors, orphans first.

    A prefix cache hits a block only while every earlier block of the request
    hits, so a block whose parent is gone is dead weight, and evicting a
    parent before its children creates such blocks. Two rules follow:

    * **Orphans first.** A tracked block whose parent hash is not tracked
      cannot hit until the parent returns; the evictable orphans go first,
      in the order they became orphans.
    * **Leaves up.** Otherwise the least recently inserted or hit evictable
      block is the *root* of the next eviction, and its subtree of tracked
      blocks goes deepest first: every victim's evictable descendants are
      victims too, chosen before it. Under prefix hits a descendant is never
      used more recently than its ancestor, so the subtree holds nothing
      newer than its root: close to LRU, with the blocks of one request
      evicted deepest first instead of head first. A walk from the last
      walk's root goes on where that one stopped when this provably
      chooses what a fresh walk would (:meth:`~kvkit.backends.eviction._chains.ChainIndex.collect`),
      so evicting a chain a victim per selection costs O(1) per victim.

    It pays where chains are long against the pool (long system prompts,
    agent sessions), where plain LRU evicts a chain from its head and keeps
    its stranded tail; on short chat chains LRU already evicts whole chains
    in a row and the gain is small. Its rules are shared by
    :class:`~kvkit.backends.eviction.hit_density.HitDensityPolicy`.

    Pinned blocks: with the pin hooks (a pool calls them), a block in use
    leaves the recency list on :meth:`on_pin` and is *parked*, so selections
    never scan it or ask ``is_evictable`` about it; it stays in the chain
    index (its children are no orphans, and the walk below a root passes
    through it to its evictable descendants). On :meth:`on_unpin` it
    re-enters at the recent end, as a block just used. A driver that never
    pins gets the scanning behaviour above.

    Invariants:
        * The recency list and the parked blocks split the tracked blocks.
        * The chain index's invariants (children by parent hash, orphans).
    """

    _order: OrderedDict[BlockId, None] = attrs.field(init=False, factory=OrderedDict)
    # Pinned blocks set aside from the recency list (on_pin), in pin order.
    _parked: dict[BlockId, None] = attrs.field(init=False, factory=dict)
    _chains: ChainIndex = attrs.field(init=False, default=attrs.Factory(
        lambda self: ChainIndex(parked=self._parked), takes_self=True))

    @property
    def pinned(self) -> tuple[BlockId, ...]:
        """Blocks parked by :meth:`on_pin`, in pin order."""
        return tuple(self._parked)

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        self._chains.add(self, block, block_hash, parent)
        self._order[block] = None

    @override
    def on_access(self, block: BlockId) -> None:
        try:
            self._order.move_to_end(block)
        except KeyError:
            if block not in self._parked:  # a parked block re-enters as just used anyway
                raise not_tracked(self, block) from None

    @override
    def on_remove(self, block: BlockId) -> None:
        self._chains.remove(self, block)
        if self._parked.pop(block, False) is False:
            del self._order[block]

    def on_pin(self, block: BlockId) -> None:
        """Park a tracked block in use: out of the recency list, still in the chain index."""
        move_pinned(self, block, ((self._order, self._parked),), pinned=True)
        self._chains.pin(block)

    def on_unpin(self, block: BlockId) -> None:
        """Put a parked block back at the recent end, as a block just used."""
        move_pinned(self, block, ((self._parked, self._order),), pinned=False)
        self._chains.unpin(block)

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        chosen: dict[BlockId, None] = {}
        parked = self._parked
        roots = (b for source in (self._chains.orphans(), self._order) for b in source)
        for root in roots:
            if len(chosen) == n:
                break
            if root not in chosen and root not in parked and is_evictable(root):
                self._chains.collect(root, is_evictable, chosen, n, parked)
        return list(chosen) if len(chosen) == n else None

    @override
    def __len__(self) -> int:
        return len(self._order) + len(self._parked)

    @override
    def check_invariants(self) -> None:
        assert len(self._chains) == len(self), "recency list, parked blocks and chain index differ"
        assert self._parked.keys().isdisjoint(self._order), "a parked block is in the recency list"
        for block in (*self._order, *self._parked):
            assert operator.index(block) >= 0, f"negative tracked block {block!r}"
            assert self._chains.tracks(block), f"block {block} is not in the chain index"
        self._chains.check_invariants()
