"""Helpers shared by the built-in eviction policies (private)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from itertools import islice
from typing import TYPE_CHECKING

import attrs

from kvkit.errors import PoolUsageError
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import check_int, quote

__all__ = [
    "LearnsCapacity",
    "already_tracked",
    "any_block",
    "bad_id",
    "check_count",
    "define_policy",
    "hash_already_tracked",
    "move_pinned",
    "not_tracked",
    "pin_mismatch",
    "take_evictable",
]

_ABSENT = object()

define_policy = functools.partial(attrs.define, on_setattr=attrs.setters.NO_OP)
"""``attrs.define`` for a policy class: its arguments are validated when it is built, and attribute
writes take no hook. attrs would otherwise route every write of any attribute of a class with a
validated field through a Python ``__setattr__`` (about 1 us each, several per reference: 12% of
hit density's time in a manager step)."""


def _capacity(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        check_int(f"{type(inst).__name__}.{attribute.name}", value, 1)


@define_policy
class LearnsCapacity:
    """Base of the policies that size their state by the pool: ARC, S3-FIFO, hit density.

    The ``EvictionPolicy`` protocol does not tell a policy its pool's size, so
    such a policy takes it as ``capacity`` or learns it as the most blocks it
    ever tracked at once, which reaches the pool's size once the pool has
    filled. On each insert a subclass reports how many blocks it tracks with
    the new one (:meth:`_learn`); it reads the size in use as :attr:`c`.

    Args:
        capacity: the pool's size in blocks, or ``None`` to learn it.

    Raises:
        ConfigError: ``capacity`` is neither ``None`` nor an int >= 1 (quoted).

    Invariants: the learned mark never decreases and is at least the blocks
    tracked now (:meth:`_check_capacity`); ``c`` is ``capacity`` when given.
    """

    capacity: int | None = attrs.field(default=None, validator=_capacity)
    _high_water: int = attrs.field(default=0, init=False)

    @property
    def c(self) -> int:
        """Capacity in use: the one given, else the most blocks tracked at once."""
        return self.capacity if self.capacity is not None else self._high_water

    def _learn(self, tracked: int) -> None:
        """Note that the policy tracks ``tracked`` blocks now."""
        if tracked > self._high_water:
            self._high_water = tracked

    if TYPE_CHECKING:
        def __len__(self) -> int:
            """Blocks tracked now: the subclass's count."""

    def _check_capacity(self) -> None:
        """The invariant above, for the subclass's ``check_invariants``."""
        assert self._high_water >= len(self), "high-water mark below the tracked count"


def check_count(n: int) -> None:
    """Reject a victim count that is not an int in ``[0, sys.maxsize]`` (no pool holds more blocks)."""
    check_int("select_victims: n", n, 0, error=PoolUsageError)
    if n > sys.maxsize:
        raise PoolUsageError(f"select_victims: n={quote(n)}: must be at most {sys.maxsize}")


def already_tracked(policy: object, block: BlockId) -> PoolUsageError:
    """The error for inserting a block ``policy`` already tracks."""
    return PoolUsageError(f"block {block!r} is already tracked by {type(policy).__name__}")


def bad_id(policy: object, block: object) -> PoolUsageError:
    """The error for a block id that is no int >= 0, which a policy's flat per-block state cannot index."""
    return PoolUsageError(f"{type(policy).__name__}: block ids are ints >= 0, got {quote(block)}")


def hash_already_tracked(policy: object, block: BlockId, block_hash: BlockHash,
                         holder: BlockId) -> PoolUsageError:
    """The error for inserting ``block`` under a hash ``policy`` already tracks for ``holder``."""
    return PoolUsageError(f"hash {block_hash!r} of block {block!r} is already tracked by block "
                          f"{holder!r} in {type(policy).__name__}")


def not_tracked(policy: object, block: BlockId) -> PoolUsageError:
    """The error for a call naming a block ``policy`` does not track."""
    return PoolUsageError(f"block {block!r} is not tracked by {type(policy).__name__}")


def pin_mismatch(policy: object, block: BlockId, pinned: bool) -> PoolUsageError:
    """The error for pinning a block ``policy`` holds pinned, or unpinning one it holds unpinned."""
    call, state = ("on_pin", "already pinned") if pinned else ("on_unpin", "not pinned")
    return PoolUsageError(
        f"{call}({block!r}): block {block!r} is {state} in {type(policy).__name__}")


def move_pinned(policy: object, block: BlockId, moves: Iterable[tuple[dict, dict]], *, pinned: bool) -> None:
    """Move ``block`` and its value from the first ``(source, target)`` source holding it to its target.

    The one step of every policy's ``on_pin`` (``pinned=True``: sources are the
    evictable containers) and ``on_unpin`` (the reverse).

    Raises:
        PoolUsageError: ``block`` already sits in a target (pinned twice, or
            unpinned while not pinned), or in no container at all.
    """
    moves = tuple(moves)
    for source, target in moves:
        value = source.pop(block, _ABSENT)
        if value is not _ABSENT:
            target[block] = value
            return
    if any(block in target for _, target in moves):
        raise pin_mismatch(policy, block, pinned=pinned)
    raise not_tracked(policy, block)


def take_evictable(candidates: Iterable[BlockId], n: int,
                   is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
    """The first ``n`` evictable blocks of ``candidates`` in order, or ``None`` if fewer exist.

    Consumes ``candidates`` lazily, so the cost is the blocks skipped plus ``n``.
    """
    victims = list(islice(filter(is_evictable, candidates), n))
    return victims if len(victims) == n else None


def any_block(block: BlockId) -> bool:
    """The ``is_evictable`` of a caller that holds no block in use: every block may go."""
    return True
