"""The block pool's per-block loops: their contracts, and the compiled twins of ``BlockPool``'s own.

Each :class:`~kvkit.backends.allocator.pool.BlockPool` method's Python loop is
the reference, so :data:`LOOPS`' reference set is ``None``; its compiled set
holds the compiled ``_pool_loops`` module's functions of the same effect, where
that extension was built (:mod:`~kvkit.backends.twins`). A pool runs the twins
held in its ``_loops`` (``None``: its own loops); the tests drive one pool of
each on the same calls and compare the whole state.

Every twin takes the pool's lists and index as they are (refcounts a list of
ints, hashes a list of ints and ``None``, the index a dict from hash to block)
and the call's ids as a list or tuple. A twin that meets anything unusual (an
id or hash that is not a plain ``int``, an id out of range, a block the call
must refuse, a block named twice where that is refused) changes nothing and
returns its sentinel (``None``, or ``False`` where it returns a bool): the
method's Python loop then runs, converting or raising as it does. The policy's
hooks and the evict listeners are never called by a twin: the method calls them
on what the twin returns.

* :attr:`PoolLoops.incref`: every block gains a reference; returns those that
  had none (ready ones: an empty one is refused), in order.
* :attr:`PoolLoops.decref`: every block loses a reference (one with none is
  refused); returns ``(freed, unpinned)``, the blocks whose last reference went,
  not ready and ready, in order.
* :attr:`PoolLoops.commit`: for a batched policy, every block (referenced, not
  ready, named once) takes its hash where the index has no block under it yet
  (index entry, then hash slot); returns ``(result, blocks, hashes, parents)``:
  whether each took it, and the arguments of ``insert_pinned``. Parents are
  ``None`` or ints, else the Python converts them.
* :attr:`PoolLoops.hand_out`: every block's refcount becomes 1.
* :attr:`PoolLoops.drop`: for a batched policy, each victim loses its hash,
  then its index entry under its hash in ``gone`` (``KeyError``, as the
  Python's, where the index lacks it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvkit.backends.twins import Twins, compiled
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["LOOPS", "PoolLoops"]

_Ids = list[BlockId] | tuple[BlockId, ...]


class PoolLoops(NamedTuple):
    """The compiled loops (functions: a pool holding them copies and pickles)."""

    incref: Callable[[list[int], list[BlockHash | None], _Ids], list[BlockId] | None]
    decref: Callable[[list[int], list[BlockHash | None], _Ids], tuple[list[BlockId], list[BlockId]] | None]
    commit: Callable[[list[int], list[BlockHash | None], dict[BlockHash, BlockId], _Ids, Sequence[BlockHash],
                      Sequence[BlockHash | None] | None],
                     tuple[list[bool], list[BlockId], list[BlockHash], list[BlockHash | None]] | None]
    hand_out: Callable[[list[int], list[BlockId]], bool]
    drop: Callable[[list[BlockHash | None], dict[BlockHash, BlockId], list[BlockId], list[BlockHash]], bool]


LOOPS: Twins[PoolLoops | None] = Twins(None, compiled(PoolLoops, "kvkit.backends.allocator._pool_loops"))
