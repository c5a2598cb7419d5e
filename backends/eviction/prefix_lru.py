"""Prefix-aware LRU: the least recently used chain goes first, from its deepest block up."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable

import attrs
from typing_extensions import override

from kvkit.backends.eviction._chains import ChainIndex
from kvkit.backends.eviction._common import check_count, not_tracked
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
      evicted deepest first instead of head first.

    It pays where chains are long against the pool (long system prompts,
    agent sessions), where plain LRU evicts a chain from its head and keeps
    its stranded tail; on short chat chains LRU already evicts whole chains
    in a row and the gain is small. Its rules are shared by
    :class:`~kvkit.backends.eviction.hit_density.HitDensityPolicy`.

    Invariants:
        * The recency list holds exactly the tracked blocks.
        * The chain index's invariants (children by parent hash, orphans).
    """

    _order: OrderedDict[BlockId, None] = attrs.field(init=False, factory=OrderedDict)
    _chains: ChainIndex = attrs.field(init=False, factory=ChainIndex)

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
            raise not_tracked(self, block) from None

    @override
    def on_remove(self, block: BlockId) -> None:
        self._chains.remove(self, block)
        del self._order[block]

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        chosen: dict[BlockId, None] = {}
        roots = (b for source in (self._chains.orphans(), self._order) for b in source)
        for root in roots:
            if len(chosen) == n:
                break
            if root not in chosen and is_evictable(root):
                self._chains.collect(root, is_evictable, chosen, n)
        return list(chosen) if len(chosen) == n else None

    @override
    def __len__(self) -> int:
        return len(self._order)

    @override
    def check_invariants(self) -> None:
        assert len(self._chains) == len(self._order), "recency list and chain index differ"
        for block in self._order:
            assert operator.index(block) >= 0, f"negative tracked block {block!r}"
            assert self._chains.tracks(block), f"block {block} is not in the chain index"
        self._chains.check_invariants()
