from collections.abc import Sequence

from kvkit.backends.eviction._chains import FlatChains
from kvkit.errors import PoolUsageError
from kvkit.interfaces.types import BlockHash, BlockId

def add_many(chains: FlatChains, owner: object, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
             parents: Sequence[BlockHash | None],
             pinned: bool) -> tuple[list[int], list[bool], PoolUsageError | None]: ...
def remove_many(chains: FlatChains, owner: object, blocks: Sequence[BlockId],
                leaving: frozenset[int] | None) -> list[BlockHash]: ...
