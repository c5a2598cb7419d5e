from collections.abc import Sequence

from kvkit.backends.eviction.hit_density import HitDensityPolicy
from kvkit.interfaces.types import BlockHash, BlockId

def book_inserts(policy: HitDensityPolicy, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
                 parents: Sequence[BlockHash | None], parent_blocks: Sequence[int], had_children: Sequence[bool],
                 mark: int, start: int, class_of: bytes) -> int: ...

def book_accesses(policy: HitDensityPolicy, blocks: Sequence[BlockId], start: int, class_of: bytes) -> int: ...

def book_marks(policy: HitDensityPolicy, blocks: Sequence[BlockId], mark: int) -> None: ...

def book_removals(policy: HitDensityPolicy, blocks: Sequence[BlockId], block_hashes: Sequence[BlockHash],
                  c: int) -> None: ...

def forget_ghosts(policy: HitDensityPolicy, lo: int, hi: int) -> None: ...
