from collections.abc import Sequence

from kvkit.interfaces.types import BlockHash, BlockId

def incref(ref: list[int], hashes: list[BlockHash | None],
           blocks: list[BlockId] | tuple[BlockId, ...]) -> list[BlockId] | None: ...

def decref(ref: list[int], hashes: list[BlockHash | None],
           blocks: list[BlockId] | tuple[BlockId, ...]) -> tuple[list[BlockId], list[BlockId]] | None: ...

def commit(ref: list[int], hashes: list[BlockHash | None], index: dict[BlockHash, BlockId],
           blocks: list[BlockId] | tuple[BlockId, ...], block_hashes: Sequence[BlockHash],
           parents: Sequence[BlockHash | None] | None,
           ) -> tuple[list[bool], list[BlockId], list[BlockHash], list[BlockHash | None]] | None: ...

def hand_out(ref: list[int], blocks: list[BlockId]) -> bool: ...

def drop(hashes: list[BlockHash | None], index: dict[BlockHash, BlockId], victims: list[BlockId],
         gone: list[BlockHash]) -> bool: ...
