"""Per-request state the offload manager keeps (one record per request incarnation)."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Sequence, Set
from itertools import chain
from typing import Any, cast

import attrs

from kvkit.errors import HashInputError, RequestStateError, UnknownRequestError
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import is_int, plural

__all__ = [
    "Progress",
    "Request",
    "RequestState",
    "accepted_blocks",
    "as_count",
    "check_hashes",
    "check_live",
    "check_lookup",
    "check_prompt",
    "check_request_id",
    "check_rows",
    "wrong_state",
]


Progress = tuple[str, Sequence[Sequence[int]] | None, Sequence[BlockHash] | None, int | None]
"""One running request's step for ``OffloadManager.advance``: ``(request_id, new_block_ids, new_hashes,
num_computed_tokens)``: blocks appended (one sequence per KV group), hashes of blocks that became full,
and its confirmed token count; ``None`` where the step brought nothing of that kind."""


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
        offered_cpu: how many of them are CPU-tier blocks (the rest are shared-tier ones).
        head_blocks: blocks at the start of the accepted hit the engine
            recomputes while the rest of the hit loads; loads start at
            position ``gpu_hit_blocks + head_blocks``.
        plan: the load plan of the last :meth:`~kvkit.manager.OffloadManager.plan_load`
            for this lookup, and its estimated saving in ms (``None`` if none).
        pinned: CPU blocks this request holds one reference on: the offered
            hit before allocation, the accepted hit until its load is planned.
        fetch: CPU blocks allocated (one reference each, not ready) for the
            shared-tier hit right after ``pinned``, from lookup until the
            fetch is planned; ``fetch_start`` is the position of the first.
        prefetch: CPU blocks allocated (one reference each, not ready) for a
            waiting request's prefetch (:meth:`~kvkit.manager.OffloadManager.prefetch`),
            from the call until ``build_step`` plans their fetch (the fetch's
            batch takes the references); ``prefetch_start`` is the position of the first.
        load_pending: ``pinned`` (and ``fetch``) is an accepted hit waiting for ``build_step``.
        revoked: a reset withdrew the offered hit before allocation.
        block_table: the engine's GPU block ids, one list per KV group.
        block_ids: the real (non-null) ids of ``block_table``; each appears once.
        store_queue: block indices the store policy chose, not yet planned.
        unfilled: positions of the accepted hit that a sliding-window group
            does not load (it loads only its window before the hit end): that
            group's blocks there hold no KV, so they are never stored.
        holds: in-flight batches and detached stores that read or write this
            incarnation's GPU blocks.
        delay_free: the engine was told to keep the GPU blocks until released.
        counted: the request was counted in ``scheduled_requests`` and ``query_tokens`` already (an incarnation
            the engine schedules again after its load failed): its allocation is not counted again.

    Invariants: ``num_confirmed_blocks == min(num_computed_tokens // block_size,
    len(block_hashes))``; every queued index is below it and outside ``unfilled``; ``pinned`` is empty
    unless the request is waiting with a lookup or has a load pending; so is ``fetch``;
    ``prefetch`` is empty unless the request is waiting.
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
    offered_cpu: int = 0
    head_blocks: int = 0
    plan: tuple[Any, float] | None = None
    pinned: list[BlockId] = attrs.field(factory=list)
    fetch: list[BlockId] = attrs.field(factory=list)
    fetch_start: int = 0
    prefetch: list[BlockId] = attrs.field(factory=list)
    prefetch_start: int = 0
    load_pending: bool = False
    revoked: bool = False
    block_table: list[list[BlockId]] = attrs.field(factory=list)
    block_ids: set[BlockId] = attrs.field(factory=set)
    store_queue: list[int] = attrs.field(factory=list)
    unfilled: range = range(0)
    holds: int = 0
    delay_free: bool = False
    counted: bool = False

    def successor(self, counted: bool = False) -> Request:
        """A fresh waiting incarnation with the same id, hashes and tokens (after a preemption); ``counted``:
        the same request scheduled again, not a resumed one (see ``counted`` above)."""
        return Request(self.request_id, self.block_hashes,
                       max(self.num_tokens, self.num_computed_tokens), counted=counted)


def as_count(value: object) -> int | None:
    """``value`` as an ``int`` if it is an integer >= 0 (NumPy integers converted; ``bool`` is not), else ``None``."""
    if value.__class__ is int:
        return value if value >= 0 else None
    return int(value) if is_int(value, 0) else None


def check_request_id(request_id: object) -> str:
    """``request_id`` if it is a ``str``; an ``UnknownRequestError`` quoting it otherwise."""
    if not isinstance(request_id, str):
        raise UnknownRequestError(f"request id must be a str, got {request_id!r} "
                                  f"({type(request_id).__name__})")
    return request_id


def wrong_state(r: Request, needs: str) -> RequestStateError:
    """The error for a call ``r``'s state does not allow; ``needs`` says what the call needs."""
    return RequestStateError(f"request {r.request_id!r} is {r.state.value}; {needs}")


def check_hashes(request_id: str, hashes: object, what: str = "block_hashes") -> list[BlockHash]:
    """``hashes`` as a new list of ``int`` block hashes (NumPy integers converted).

    Raises:
        HashInputError: not an iterable of integers (``bool``, ``str``, floats,
            ``None``... are refused), quoting the first bad element.
    """
    if hashes.__class__ is list:  # the usual argument: no ABC check
        out = hashes.copy()
    elif isinstance(hashes, (str, bytes)) or not isinstance(hashes, Iterable):
        raise HashInputError(f"request {request_id!r}: {what} must be a sequence of int hashes, "
                             f"got {hashes!r}")
    else:
        out = list(hashes)
    for h in out:  # the common case: plain ints (a loop that stops at the first other one beats set(map(type)))
        if h.__class__ is not int:
            break
    else:
        return out
    for i, h in enumerate(out):
        if h.__class__ is not int:
            if not is_int(h):
                raise HashInputError(f"request {request_id!r}: {what}[{i}]={h!r} is not an int "
                                     f"block hash ({type(h).__name__})")
            out[i] = int(h)
    return out


def check_prompt(request_id: str, hashes: list[BlockHash], num_prompt_tokens: object,
                 block_size: int) -> int:
    """The prompt's token count, after checking it holds the tokens of its full-block hashes."""
    bs, n = block_size, as_count(num_prompt_tokens)
    if n is None or len(hashes) > n // bs:
        raise RequestStateError(
            f"request {request_id!r}: num_prompt_tokens={num_prompt_tokens!r} is below the "
            f"{plural(len(hashes) * bs, 'prompt token')} of its "
            f"{plural(len(hashes), 'full-block hash', 'full-block hashes')}")
    return n


def check_lookup(r: Request, gpu_hit_tokens: object, num_tokens: object,
                 block_size: int) -> tuple[int, int]:
    """``(gpu_hit_tokens, request length)`` for a lookup of waiting ``r``, both checked."""
    request_id, bs = r.request_id, block_size
    if r.state is not RequestState.WAITING:
        raise wrong_state(r, "lookup needs a waiting request")
    ntok = r.num_tokens
    if num_tokens is not None:
        n = as_count(num_tokens)
        if n is None:
            raise RequestStateError(f"request {request_id!r}: num_tokens={num_tokens!r} must be an "
                                    f"int >= 0")
        ntok = max(ntok, n)
    hit = as_count(gpu_hit_tokens)
    if hit is None or hit % bs or hit > ntok:
        raise RequestStateError(
            f"request {request_id!r}: gpu_hit_tokens={gpu_hit_tokens!r} must be a multiple of "
            f"block_size={bs} in [0, {ntok}]")
    return hit, ntok


def check_rows(request_id: str, rows: object, num_groups: int, num_blocks: int | None,
               null_block: int, taken: Set[BlockId] | None = None,
               what: str = "block table") -> tuple[list[list[BlockId]], set[BlockId]]:
    """``rows`` (one sequence of GPU block ids per KV group) as fresh lists of ``int``, and the set of their
    real ids (the null block left out).

    Every id is an integer (NumPy integers converted; ``bool`` refused) in
    ``[0, num_blocks)`` (``>= 0`` when the pool size is unknown) or the
    engine's ``null_block``; no real block appears twice, nor in ``taken``
    (the request's blocks so far).

    Raises:
        RequestStateError: a bad shape or id, quoting it; nothing is changed.
    """
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise RequestStateError(f"request {request_id!r}: {what} must hold one sequence of GPU block ids "
                                f"per KV group, got {rows!r}")
    rows = list(rows)
    if len(rows) != num_groups:
        raise RequestStateError(
            f"request {request_id!r}: need one block list per KV group ({num_groups}) in the {what}, "
            f"got {len(rows)}")
    out: list[list[BlockId]] = []
    for g, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not isinstance(row, Iterable):
            raise RequestStateError(f"request {request_id!r}: {what} group {g} must be a sequence of "
                                    f"GPU block ids, got {row!r}")
        ids = list(row)
        if not set(map(type, ids)) <= _INT:  # plain ints, the common case: one pass at C speed
            ids = [_block_id(request_id, what, g, i, b) for i, b in enumerate(ids)]
        out.append(ids)
    flat: Sequence[int] = out[0] if len(out) == 1 else list(chain.from_iterable(out))
    if not flat:
        return out, set()
    low, high, null = min(flat), max(flat), null_block
    if (low < 0 and low != null) or (num_blocks is not None and high >= num_blocks and high != null):
        bad = next(b for b in flat if b != null and (b < 0 or (num_blocks is not None and b >= num_blocks)))
        limit = "" if num_blocks is None else f" < {num_blocks}"
        raise RequestStateError(f"request {request_id!r}: GPU block id {bad!r} in the {what} is out of "
                                f"range (0 <= id{limit}, or null_block={null})")
    nulls = flat.count(null)
    distinct = set(flat)
    clash = taken is not None and not distinct.isdisjoint(taken)  # ``taken`` never holds the null block
    if clash or len(distinct) - (1 if nulls else 0) != len(flat) - nulls:
        seen = set[int](taken or ()) - {null}
        for dup in flat:  # the first real id met before (in ``taken`` or earlier in ``flat``)
            if dup != null and dup in seen:
                break
            seen.add(dup)
        raise RequestStateError(f"request {request_id!r}: GPU block id {dup!r} appears twice in the "
                                f"request's block table")
    distinct.discard(null)
    return out, cast(set[BlockId], distinct)


_INT = {int}


def _block_id(request_id: str, what: str, g: int, i: int, b: object) -> BlockId:
    if not is_int(b):
        raise RequestStateError(f"request {request_id!r}: {what} group {g} position {i}: GPU block id "
                                f"{b!r} is not an int ({type(b).__name__})")
    return BlockId(int(b))


def accepted_blocks(r: Request, accepted_tokens: object, block_size: int,
                    recompute_tokens: object = 0) -> tuple[int, int]:
    """``(accepted, recomputed)`` blocks of the hit offered to waiting ``r``: the prefix the engine
    keeps, and the head of it the engine recomputes instead of loading."""
    request_id, bs = r.request_id, block_size
    if r.gpu_hit_blocks is None:
        raise RequestStateError(f"request {request_id!r}: on_allocated before lookup")
    n = as_count(accepted_tokens)
    if n is None or n % bs or n > r.offered_blocks * bs:
        raise RequestStateError(
            f"request {request_id!r}: accepted_tokens={accepted_tokens!r} must be a multiple of "
            f"{bs} in [0, {r.offered_blocks * bs}] (the offered hit)")
    k = as_count(recompute_tokens)
    if k is None or k % bs or k > n:
        raise RequestStateError(
            f"request {request_id!r}: recompute_tokens={recompute_tokens!r} must be a multiple of "
            f"{bs} in [0, {n}] (the accepted hit)")
    return n // bs, k // bs


def check_live(requests: dict[str, Request], dirty: dict[str, Request], cpu: BlockAllocator,
               block_size: int, holds: Counter[int]) -> None:
    """Check each live request's fields against each other, the CPU pool and ``holds``."""
    bs = block_size
    for rid, r in requests.items():
        assert r.request_id == rid and r.state is not RequestState.ENDED, (rid, r.state)
        assert r.num_confirmed_blocks == min(r.num_computed_tokens // bs,
                                             len(r.block_hashes)), rid
        assert all(0 <= i < r.num_confirmed_blocks and i not in r.unfilled for i in r.store_queue), rid
        assert not r.store_queue or rid in dirty, f"{rid}: queued stores not dirty"
        assert not r.pinned or r.state is RequestState.WAITING or r.load_pending, rid
        assert all(cpu.block_hash(b) is not None for b in r.pinned), f"{rid}: pin not ready"
        assert not r.fetch or r.state is RequestState.WAITING or r.load_pending, rid
        assert all(cpu.block_hash(b) is None for b in r.fetch), f"{rid}: a block to fetch is findable"
        assert not r.prefetch or r.state is RequestState.WAITING, f"{rid}: a running request holds a prefetch"
        assert all(cpu.block_hash(b) is None for b in r.prefetch), f"{rid}: a block to prefetch is findable"
        assert r.holds == holds[id(r)], f"{rid}: holds {r.holds} != {holds[id(r)]}"
