"""Prefix-aware LRU: the least recently used chain goes first, from its deepest block up."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import cast

import attrs
from typing_extensions import override

from kvkit.backends.eviction._chains import FlatChains
from kvkit.backends.eviction._common import bad_id, check_count, move_pinned, not_tracked
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
      chooses what a fresh walk would (:meth:`~kvkit.backends.eviction._chains.FlatChains.collect`),
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

    Layout: the chain links sit in
    :class:`~kvkit.backends.eviction._chains.FlatChains`, flat arrays indexed
    by block id, so block ids are ints ``>= 0`` (a negative id is refused with
    ``PoolUsageError``, nothing changed) and the arrays span the largest id
    inserted (grown by doubling).

    Invariants:
        * The recency list and the parked blocks split the tracked blocks.
        * ``_marks[b]`` is ``FlatChains.PARKED`` exactly for the parked blocks.
        * The chain index's invariants (children by parent hash, orphans).
    """

    _order: OrderedDict[BlockId, None] = attrs.field(init=False, factory=OrderedDict)
    # Pinned blocks set aside from the recency list (on_pin), in pin order.
    _parked: dict[BlockId, None] = attrs.field(init=False, factory=dict)
    # FlatChains.PARKED at a parked block's id, 0 elsewhere: the chain index reads the pins here.
    _marks: bytearray = attrs.field(init=False, factory=bytearray, repr=False)
    _chains: FlatChains = attrs.field(init=False, default=attrs.Factory(
        lambda self: FlatChains(self._marks), takes_self=True))

    @property
    def pinned(self) -> tuple[BlockId, ...]:
        """Blocks parked by :meth:`on_pin`, in pin order."""
        return tuple(self._parked)

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        if block.__class__ is not int or block < 0:
            raise bad_id(self, block)
        marks = self._marks
        if block >= len(marks):  # at least doubling: amortised O(1) per block
            size = max(block + 1, 2 * len(marks), 1024)
            marks += bytes(size - len(marks))  # in place: the chain index reads the same bytes
            self._chains.grow(size)
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
        else:
            self._marks[block] = 0

    def on_pin(self, block: BlockId) -> None:
        """Park a tracked block in use: out of the recency list, still in the chain index."""
        move_pinned(self, block, ((self._order, self._parked),), pinned=True)
        self._marks[block] = FlatChains.PARKED
        self._chains.pin(block)

    def on_unpin(self, block: BlockId) -> None:
        """Put a parked block back at the recent end, as a block just used."""
        move_pinned(self, block, ((self._parked, self._order),), pinned=False)
        self._marks[block] = 0
        self._chains.unpin(block)

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        chosen: dict[int, None] = {}  # the chain index walks plain ints: the ids it reads from its arrays
        evictable = cast("Callable[[int], bool]", is_evictable)
        parked = self._parked
        roots = (b for source in (self._chains.orphans() or (), self._order) for b in source)
        for root in roots:
            if len(chosen) == n:
                break
            if root not in chosen and root not in parked and is_evictable(root):
                self._chains.collect(root, evictable, chosen, n)
        return cast("list[BlockId]", list(chosen)) if len(chosen) == n else None

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
        assert self._chains.parked is self._marks, "the chain index reads other pin marks"
        assert {BlockId(b) for b, mark in enumerate(self._marks) if mark} == self._parked.keys(), \
            "pin marks and parked blocks differ"
        self._chains.check_invariants()
