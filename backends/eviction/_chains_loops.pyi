from collections.abc import Callable, Sequence

from kvkit.backends.eviction._chains import FlatChains
from kvkit.errors import PoolUsageError
from kvkit.interfaces.types import BlockHash, BlockId

def add_many(chains: FlatChains, owner: object, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
             parents: Sequence[BlockHash | None],
             pinned: bool) -> tuple[list[int], list[bool], PoolUsageError | None]: ...
def remove_many(chains: FlatChains, owner: object, blocks: Sequence[BlockId],
                leaving: frozenset[int] | None) -> list[BlockHash]: ...
def collect(chains: FlatChains, root: int, is_evictable: Callable[[int], bool], chosen: dict[int, None],
            n: int) -> list[int]: ...
