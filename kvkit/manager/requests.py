"""Per-request state the offload manager keeps (one record per request incarnation)."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence

import attrs

from kvkit.errors import RequestStateError
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import is_int

__all__ = [
    "Request",
    "RequestState",
    "accepted_blocks",
    "check_live",
    "check_lookup",
    "check_prompt",
    "check_table",
    "is_count",
    "wrong_state",
]


class RequestState(enum.Enum):
    """Where a request incarnation is in its life, as the manager sees it."""

    WAITING = "waiting"  # added, or resumed after a preemption: no GPU blocks known
    RUNNING = "running"  # allocated: the manager knows its GPU block table
    ENDED = "ended"  # finished, aborted or preempted; kept while transfers touch its blocks


@attrs.define(eq=False)
class Request:
    """One incarnation of an engine request (implements ``RequestView``).

    A preemption ends an incarnation and starts a fresh one under the same
    id, so transfers still in flight for the old one (which point at GPU
    blocks the engine already gave up) never touch the new one's state.

    Attributes:
        request_id: the engine's id.
        block_hashes: chained hashes of the full blocks known so far (grows).
        num_tokens: tokens the request holds (prompt and output); caps hits
            so at least one token is recomputed.
        state: see :class:`RequestState`.
        epoch: the manager's reset epoch when the incarnation was allocated;
            only incarnations of the current epoch store (KV computed before a
            reset is never written to the emptied tier).
        num_computed_tokens: tokens whose KV the engine confirmed written.
        num_confirmed_blocks: full blocks with a hash and confirmed KV.
        gpu_hit_blocks: the GPU prefix hit of the last lookup, in blocks
            (``None`` before any lookup of this incarnation).
        offered_blocks: CPU blocks the last lookup offered.
        pinned: CPU blocks this request holds one reference on: the offered
            hit before allocation, the accepted hit until its load is planned.
        load_pending: ``pinned`` is an accepted hit waiting for ``build_step``.
        revoked: a reset withdrew the offered hit before allocation.
        block_table: the engine's GPU block ids, one list per KV group.
        store_queue: block indices the store policy chose, not yet planned.
        holds: in-flight batches and detached stores that read or write this
            incarnation's GPU blocks.
        delay_free: the engine was told to keep the GPU blocks until released.

    Invariants: ``num_confirmed_blocks == min(num_computed_tokens // block_size,
    len(block_hashes))``; every queued index is below it; ``pinned`` is empty
    unless the request is waiting with a lookup or has a load pending.
    """

    request_id: str
    block_hashes: list[BlockHash]
    num_tokens: int
    state: RequestState = RequestState.WAITING
    epoch: int = 0
    num_computed_tokens: int = 0
    num_confirmed_blocks: int = 0
    gpu_hit_blocks: int | None = None
    offered_blocks: int = 0
    pinned: list[BlockId] = attrs.field(factory=list)
    load_pending: bool = False
    revoked: bool = False
    block_table: list[list[int]] = attrs.field(factory=list)
    store_queue: list[int] = attrs.field(factory=list)
    holds: int = 0
    delay_free: bool = False

    def successor(self) -> Request:
        """A fresh waiting incarnation with the same id, hashes and tokens (after a preemption)."""
        return Request(self.request_id, self.block_hashes,
                       max(self.num_tokens, self.num_computed_tokens))


def is_count(value: object) -> bool:
    """``value`` is an ``int >= 0`` (a ``bool`` is not)."""
    return is_int(value, 0)


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


def check_live(requests: dict[str, Request], dirty: dict[str, Request], cpu: BlockAllocator,
               block_size: int, holds: Counter[int]) -> None:
    """Check each live request's fields against each other, the CPU pool and ``holds``."""
    bs = block_size
    for rid, r in requests.items():
        assert r.request_id == rid and r.state is not RequestState.ENDED, (rid, r.state)
        assert r.num_confirmed_blocks == min(r.num_computed_tokens // bs,
                                             len(r.block_hashes)), rid
        assert all(0 <= i < r.num_confirmed_blocks for i in r.store_queue), rid
        assert not r.store_queue or rid in dirty, f"{rid}: queued stores not dirty"
        assert not r.pinned or r.state is RequestState.WAITING or r.load_pending, rid
        assert all(cpu.block_hash(b) is not None for b in r.pinned), f"{rid}: pin not ready"
        assert r.holds == holds[id(r)], f"{rid}: holds {r.holds} != {holds[id(r)]}"
