"""Per-request state the offload manager keeps (one record per request incarnation)."""

from __future__ import annotations

import enum

import attrs

from kvkit.interfaces.types import BlockHash, BlockId

__all__ = ["Request", "RequestState"]


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
