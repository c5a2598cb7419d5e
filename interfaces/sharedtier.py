"""The shared tier's seam: ``BlockCodec`` (keys and framed values) and ``SharedPlan`` (one fetch or put)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvkit.errors import PlanError
from kvkit.interfaces.types import BlockHash, Direction
from kvkit.validate import check_enum, checked

__all__ = ["BlockCodec", "SharedPlan"]


def _ints(value: object) -> tuple[int, ...]:
    out = tuple(value)  # type: ignore[arg-type]
    if not all(v.__class__ is int for v in out):
        raise PlanError(f"SharedPlan: block ids and hashes must be ints, got {list(out)[:8]!r}")
    return out


@attrs.frozen
class SharedPlan:
    """One shared-tier transfer, for every worker to run on its own shard.

    ``direction`` is :attr:`Direction.LOAD` for a *fetch* (the store's values
    into CPU blocks ``blocks``, which are allocated and not ready) and
    :attr:`Direction.STORE` for a *put* (ready CPU blocks into the store).
    ``hashes[i]`` names the content of ``blocks[i]``; each worker derives its
    keys from them and its rank.

    Invariants: ``len(blocks) == len(hashes) >= 1``; every id and hash is an int.
    """

    direction: Direction = attrs.field(converter=checked(check_enum, cls=Direction, label="SharedPlan.",
                                                         error=PlanError))
    blocks: tuple[int, ...] = attrs.field(converter=_ints)
    hashes: tuple[BlockHash, ...] = attrs.field(converter=_ints)

    def __attrs_post_init__(self) -> None:
        if not self.blocks or len(self.blocks) != len(self.hashes):
            raise PlanError(f"SharedPlan needs as many hashes as blocks (at least one), got "
                            f"{len(self.blocks)} blocks and {len(self.hashes)} hashes")

    def __len__(self) -> int:
        return len(self.blocks)


@runtime_checkable
class BlockCodec(Protocol):
    """Names and frames the values a :class:`~kvkit.interfaces.blockstore.BlockStore` holds.

    The one seam between the shared-tier lifecycle (which keys exist, which
    bytes go where) and the value format (header, checksum, namespace): the
    scheduler side derives keys for ``contains``, each worker frames what it
    puts and checks what it gets. A value is ``header + payload``, the header
    exactly ``header_bytes`` long.

    Invariants:
        * ``key`` is a pure function of ``(namespace, block_hash, rank)``: two
          codecs of one namespace agree, two namespaces never share a key.
        * ``check`` is ``True`` only for a header ``seal`` wrote for the same
          ``block_hash``, ``rank`` and payload bytes; anything else (corrupted,
          truncated, foreign) is ``False``, never an exception.
    """

    header_bytes: int

    def key(self, block_hash: BlockHash, rank: int) -> bytes:
        """The store key of ``rank``'s shard of the block ``block_hash``."""
        ...

    def seal(self, header: memoryview, block_hash: BlockHash, rank: int, payload: Sequence[memoryview]) -> None:
        """Write the header of ``payload`` (``rank``'s shard of ``block_hash``) into ``header``."""
        ...

    def check(self, header: memoryview, block_hash: BlockHash, rank: int, payload: Sequence[memoryview]) -> bool:
        """Whether ``header`` and ``payload``, as read back, are a valid value of that shard."""
        ...
