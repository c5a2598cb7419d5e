"""The hit-density policy's selection rounds: the roots of a selection, one after another.

:func:`select_rounds` is the reference; :data:`LOOPS` holds it and its
compiled twin, the ``_selection`` extension's function of the same contract
(:mod:`~kvkit.backends.twins`). A policy runs the one in its ``_selection``;
the tests drive both on the same calls and compare what they return, the
order of ``chosen`` and the policy's whole state.

:func:`select_rounds` goes on with a selection of ``n`` victims (``n >= 1``)
from what ``chosen`` holds (empty, or the first root's subtree: the caller's
dict, shared with :meth:`~kvkit.backends.eviction._chains.FlatChains.collect`,
that every victim enters in the order chosen). A block is *usable* when it is
not chosen and ``evictable`` says so (asked of each block as it is reached, in
the order below, never of a chosen block); a root with a child to walk is
handed to ``collect(root, evictable, chosen, n)``, which adds its subtree,
descendants first; a root with none (or with one only child, already chosen)
is taken alone, and the first such root of the selection, unless a walk came
before it, calls ``forget_walk()`` as ``collect``'s walk of it would:

* the orphans first, in the order the chain index yields them: each one not
  chosen, not parked and evictable is the next root;
* then the *streams*: each end of each class list walked inwards (stream
  ``2 * class`` from the old end, ``2 * class + 1`` from the young end), each
  headed by its first usable block. The next root is the head of least key
  (density at the policy's clock, last access, block, stream: keys compare as
  tuples, the densities finite); ``verified`` means every list end was found
  evictable in this selection, so an end not chosen heads its stream unasked.
  Once a root is chosen, every stream it headed goes on past it (an
  evictable block of a walked subtree may head a stream too). A root taken
  alone that heads only its own stream starts a *run*: the stream's next
  usable blocks are roots in turn, alone, while ``n`` is not reached, their
  keys stay below the least other head's, they are not the other end's head
  and they have no child to walk; the first that is not heads the stream.

It returns ``list(chosen)`` once ``n`` are chosen, ``None`` when every stream
has run out first. The callbacks must not change the policy or its chain
index (``collect`` adds to ``chosen`` and keeps or drops its walk; the compiled
function holds the per-block arrays' buffers meanwhile, so resizing one raises
``BufferError``); errors they raise propagate, the victims chosen before them
staying in ``chosen``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

from kvkit.backends.eviction._chains import FlatChains
from kvkit.backends.eviction.hit_density.booking import NONE
from kvkit.backends.twins import Twins
from kvkit.interfaces.types import BlockId

if TYPE_CHECKING:
    from kvkit.backends.eviction.hit_density import HitDensityPolicy

__all__ = ["LOOPS", "Selection", "select_rounds"]

_PARKED = FlatChains.PARKED
_EVERY = sys.maxsize  # the upper bound of an age bucket that holds every last access (no model yet)
_Key = tuple[float, int, int, int]


class SelectRounds(Protocol):
    def __call__(self, policy: HitDensityPolicy, n: int, evictable: Callable[[int], bool],
                 chosen: dict[int, None], verified: bool) -> list[BlockId] | None:
        """Choose until ``n`` are chosen: ``list(chosen)``, or ``None`` (module docstring)."""


class Selection(NamedTuple):
    """The selection of one implementation (a function: a policy holding it copies and pickles)."""

    select_rounds: SelectRounds


def select_rounds(policy: HitDensityPolicy, n: int, evictable: Callable[[int], bool],
                  chosen: dict[int, None], verified: bool) -> list[BlockId] | None:
    """The policy's selection from the state ``chosen`` holds (empty, or the first root's subtree);
    ``verified``: every list end was found evictable in this selection (not asked again). Module docstring."""
    p = policy
    where, nxt, prv, last_of, classes = p._where, p._next, p._prev, p._last, p._cls
    chains = p._chains
    clock, table, octave, top = p._clock, p._model.table, p._model.per_octave, p._model.buckets - 1
    first_age = p._model.first_ages
    collect, first_child, sibling, dropped = chains.collect, chains.child_rings, chains.sibling_rings, False
    # The orphans first, in their order: a usable one is the next root.
    orphan_walk = chains.orphans()
    root: int
    if orphan_walk is not None:
        for root in orphan_walk:
            if root in chosen or where[root] == _PARKED or not evictable(root):
                continue
            child = first_child[root]
            if child == NONE or (sibling[child] == child and child in chosen):
                # collect's walk of a usable root with no child, or with one, chosen with its subtree (a
                # chain taken from its tip up), inlined: the root alone
                if not dropped:
                    chains.forget_walk()  # as that walk does
                    dropped = True
                chosen[root] = None
            else:
                collect(root, evictable, chosen, n)
                dropped = True  # a walk left kept ends the selection
            if len(chosen) >= n:
                return cast(list[BlockId], list(chosen))

    # Then the streams: both ends of every class list (stream 2 * class walks from the old end,
    # 2 * class + 1 from the young end). A stream's head is its first block from its end that is
    # usable (evictable, not chosen; listed blocks are never parked), and the next root is the head
    # of least key (density, last access, block, stream): keys are distinct and totally ordered (the
    # densities are finite), so any structure that finds the least one chooses alike. One cursor per
    # stream, kept across the rounds: nothing a round skips can become usable later in it, so each
    # stream is walked at most once and a selection costs O(n + skipped). The heads' keys sit in a
    # heap (a replaced head stays in it, stale, until it surfaces); the streams a round's victims
    # headed move on at once.
    ends = p._ends
    heads: list[_Key | None] = [None] * len(ends)  # per stream, its head
    order: list[_Key] = []

    def advance(stream: int, block: int) -> _Key | None:
        """Walk ``stream`` from ``block`` to its first usable block; make that its head (none: it ends)."""
        links = prv if stream & 1 else nxt
        while block != NONE and (block in chosen or not evictable(block)):
            block = links[block]
        if block == NONE:
            heads[stream] = None
            return None
        last = last_of[block]
        if table is None:
            density = 0.0
        else:  # policy._model.density, inlined: the hot path
            b = ((clock - last + 1) ** octave).bit_length() - 1
            density = table.item(stream >> 1, b if b < top else top)
        heads[stream] = head = (density, last, block, stream)
        return head

    head: _Key | None
    for stream in range(len(ends)):
        block = ends[stream]
        if verified and block != NONE and block not in chosen:
            last = last_of[block]
            heads[stream] = head = (p._model.density(stream >> 1, clock - last), last, block, stream)
        else:
            head = advance(stream, block)
        if head is not None:
            order.append(head)
    heapify(order)
    picked: Sequence[int]
    while len(chosen) < n:
        while order and heads[order[0][3]] is not order[0]:  # replaced: its stream moved on
            heappop(order)
        if not order:
            return None
        root, stream = order[0][2], order[0][3]
        child = first_child[root]
        if child != NONE and not (sibling[child] == child and child in chosen):
            picked = collect(root, evictable, chosen, n)
            dropped = True  # a walk left kept ends the selection
        else:  # the root alone, as in the orphans' loop
            if not dropped:
                chains.forget_walk()
                dropped = True
            chosen[root] = None
            twin = heads[stream ^ 1]  # the other end of the root's class list
            if twin is not None and twin[2] == root:
                picked = (root,)
            else:
                # A run: the root heads its stream alone, so the other streams' heads stay, and
                # the least of them (the rival) bounds how far this stream goes on. Its next usable
                # blocks are roots in turn while their keys stay below the rival's, each taken
                # alone, until one is not (the stream's new head) or is the twin's head or has a
                # child to walk (a round of its own next). A key's density is read again only
                # where its last access leaves the age bucket of the one before (lo < last <= hi).
                heappop(order)
                while order and heads[order[0][3]] is not order[0]:
                    heappop(order)
                rival = order[0] if order else None
                twin_block = NONE if twin is None else twin[2]
                links = prv if stream & 1 else nxt
                cls = stream >> 1
                # The age bucket of the last density read: last accesses in (lo, hi]. None yet; before
                # the first refresh (every density 0) all of them.
                density, lo, hi = 0.0, -1, _EVERY if table is None else -1
                block = links[root]
                while True:
                    if block == NONE:
                        heads[stream] = None
                        break
                    if block in chosen or not evictable(block):
                        block = links[block]
                        continue
                    last = last_of[block]
                    if not lo < last <= hi:
                        assert table is not None
                        b = ((clock - last + 1) ** octave).bit_length() - 1
                        if b < top:
                            density, lo, hi = table.item(cls, b), clock - first_age[b + 1], clock - first_age[b]
                        else:
                            density, lo, hi = table.item(cls, top), -1, clock - first_age[top]
                    if len(chosen) < n and block != twin_block and (
                            rival is None or density < rival[0] or (
                                density == rival[0] and (last, block, stream) < rival[1:])):
                        child = first_child[block]
                        if child == NONE or (sibling[child] == child and child in chosen):
                            chosen[block] = None
                            block = links[block]
                            continue
                    heads[stream] = head = (density, last, block, stream)
                    heappush(order, head)
                    break
                continue
        for block in picked:  # the streams they headed go on past them
            end = 2 * classes[block]  # a listed block heads at most its class list's two ends
            head = heads[end]
            if head is not None and head[2] == block:
                head = advance(end, nxt[block])
                if head is not None:
                    heappush(order, head)
            head = heads[end + 1]
            if head is not None and head[2] == block:
                head = advance(end + 1, prv[block])
                if head is not None:
                    heappush(order, head)
    return cast(list[BlockId], list(chosen))


LOOPS: Twins[Selection] = Twins.load(Selection(select_rounds), "kvkit.backends.eviction.hit_density._selection")
