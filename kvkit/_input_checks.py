"""Checks of what callers hand :class:`~kvkit.manager.OffloadManager`: its parts and per-call input.

Each check raises a typed error from :mod:`kvkit.errors` quoting the bad value
and changes nothing, so a rejected call leaves the manager as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvkit.errors import ConfigError, RequestStateError
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.callbacks import OffloadCallback
from kvkit.interfaces.store import StorePolicy
from kvkit.interfaces.types import BlockHash, KVCacheSpec
from kvkit.request import Request, RequestState

__all__ = ["accepted_blocks", "check_lookup", "check_parts", "check_prompt", "check_table",
           "check_world_size", "is_count", "writes_back", "wrong_state"]


def is_count(value: object) -> bool:
    """``value`` is an ``int >= 0`` (a ``bool`` is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_world_size(inst: object, attribute: attrs.Attribute, value: object) -> None:
    """attrs validator: ``world_size`` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"world_size must be a positive int, got {value!r}")


def check_parts(spec: object, cpu: object, gpu: object, store: object,
                callbacks: Sequence[object], null_block: object) -> None:
    """Raise one ``ConfigError`` naming every part of the wrong type."""
    problems = []
    if not isinstance(spec, KVCacheSpec):
        problems.append(f"spec must be a KVCacheSpec, got {spec!r}")
    for name, pool in (("cpu", cpu), ("gpu", gpu)):
        if (pool is not None or name == "cpu") and not isinstance(pool, BlockAllocator):
            problems.append(f"{name} must be a BlockAllocator, got {pool!r}")
    if not isinstance(store, StorePolicy):
        problems.append(f"store must be a StorePolicy, got {store!r}")
    bad = [c for c in callbacks if not isinstance(c, OffloadCallback)]
    if bad:
        problems.append(f"callbacks must be OffloadCallback instances, got {bad!r}")
    if isinstance(null_block, bool) or not isinstance(null_block, int):
        problems.append(f"null_block must be an int, got {null_block!r}")
    if problems:
        raise ConfigError(problems)


def writes_back(spec: KVCacheSpec, store: StorePolicy, gpu: BlockAllocator | None) -> bool:
    """Whether ``store`` writes back GPU eviction candidates.

    Raises:
        ConfigError: it does, but ``gpu`` has no ``eviction_candidates`` or
            ``spec`` has more than one KV group.
    """
    if store.writeback_target(0, gpu.num_blocks if gpu is not None else 1) <= 0:
        return False
    if gpu is None or not hasattr(gpu, "eviction_candidates"):
        raise ConfigError(
            f"store policy {store!r} writes back GPU eviction candidates: pass a "
            f"gpu= pool with eviction_candidates(n), got gpu={gpu!r}")
    if len(spec.groups) != 1:
        raise ConfigError(
            f"store policy {store!r} writes back single GPU blocks, which needs a "
            f"spec with one KV group, got {len(spec.groups)} groups")
    return True


def wrong_state(r: Request, needs: str) -> RequestStateError:
    """The error for a call ``r``'s state does not allow; ``needs`` says what the call needs."""
    return RequestStateError(f"request {r.request_id!r} is {r.state.value}; {needs}")


def check_prompt(request_id: str, hashes: list[BlockHash], num_prompt_tokens: object,
                 block_size: int) -> None:
    """The prompt holds at least the tokens of its full-block hashes."""
    bs = block_size
    if not is_count(num_prompt_tokens) or len(hashes) > num_prompt_tokens // bs:
        raise RequestStateError(
            f"request {request_id!r}: {len(hashes)} full-block hashes need at least "
            f"{len(hashes) * bs} prompt tokens, got num_prompt_tokens={num_prompt_tokens!r}")


def check_lookup(r: Request, gpu_hit_tokens: object, num_tokens: object, block_size: int) -> int:
    """The request's length for a lookup of waiting ``r``, after checking the GPU hit against it."""
    request_id, bs = r.request_id, block_size
    if r.state is not RequestState.WAITING:
        raise wrong_state(r, "lookup needs a waiting request")
    ntok = r.num_tokens
    if num_tokens is not None:
        if not is_count(num_tokens):
            raise RequestStateError(f"request {request_id!r}: bad num_tokens={num_tokens!r}")
        ntok = max(ntok, num_tokens)
    if not is_count(gpu_hit_tokens) or gpu_hit_tokens % bs or gpu_hit_tokens > ntok:
        raise RequestStateError(
            f"request {request_id!r}: gpu_hit_tokens={gpu_hit_tokens!r} must be a multiple of "
            f"block_size={bs} in [0, {ntok}]")
    return ntok


def check_table(request_id: str, table: Sequence[Sequence[int]],
                num_groups: int) -> list[list[int]]:
    """A copy of the engine's block table, one list per KV group."""
    if len(table) != num_groups:
        raise RequestStateError(
            f"request {request_id!r}: need one block list per KV group "
            f"({num_groups}), got {len(table)}")
    return [list(row) for row in table]


def accepted_blocks(r: Request, accepted_tokens: object, block_size: int) -> int:
    """Blocks of the hit offered to waiting ``r`` that the engine accepts."""
    request_id, bs = r.request_id, block_size
    if r.gpu_hit_blocks is None:
        raise RequestStateError(f"request {request_id!r}: on_allocated before lookup")
    if (not is_count(accepted_tokens) or accepted_tokens % bs
            or accepted_tokens > r.offered_blocks * bs):
        raise RequestStateError(
            f"request {request_id!r}: accepted_tokens={accepted_tokens!r} must be a multiple of "
            f"{bs} in [0, {r.offered_blocks * bs}] (the offered hit)")
    return accepted_tokens // bs
