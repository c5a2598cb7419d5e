"""``OffloadManager``: the scheduler side of a CPU offload tier (no tensors).

The manager sits in an engine's scheduler loop. Per request it finds CPU hits
beyond the GPU prefix hit and pins them at lookup, pairs them with the GPU
blocks the engine allocated, asks the store policy what to store, builds one
step plan of loads and stores, and applies the workers' completions: a stored
CPU block becomes findable only when its copy finished on every worker, and
every reference it takes is released exactly once.

One scheduler step, as an engine drives it::

    mgr.add_request(rid, block_hashes, num_prompt_tokens)   # on arrival
    extra = mgr.lookup(rid, gpu_hit_tokens)                 # when scheduling it
    mgr.on_allocated(rid, block_table, accepted_tokens)     # after allocating
    mgr.append_blocks(rid, new_block_ids)                   # a running request grew
    plan = mgr.build_step()                                 # -> workers
    mgr.on_computed(rid, num_computed_tokens)               # after the forward pass
    mgr.extend(rid, new_block_hashes)                       # decode filled blocks
    report = mgr.apply_completions(worker_results)          # loaded / released
    mgr.finish(rid)  /  mgr.abort(rid)  /  mgr.preempt(rid)

GPU blocks and the delayed free:
    With ``gpu`` (kvkit's reference engine, the simulator) the manager takes
    its own GPU-pool reference on every store source and load destination
    while the transfer is in flight (and on the sources of stores still
    queued when a request ends), so the engine frees a finished, aborted or
    preempted request's blocks at once and ``finish``/``abort``/``preempt``
    return ``False``. Without ``gpu`` (external engines such as vLLM)
    ``finish``/``abort`` return ``True`` when queued or in-flight transfers
    still touch the request's GPU blocks: the engine keeps them until a
    :class:`~kvkit.step.CompletionReport` lists the id in ``released`` (the
    connector's ``request_finished -> True`` / ``get_finished`` handshake);
    ``preempt`` returns ``True`` when transfers in flight touch them, and the
    workers must finish those before the blocks are reused.

Reset:
    :meth:`reset` abandons every transfer in flight (stores will never
    commit; loads are reported failed), releases every lookup pin and queued
    transfer, and from that moment serves no hit. The CPU pool itself is
    emptied as soon as the abandoned transfers' completions have arrived
    (:attr:`drained`); until then no store is planned either. Requests that
    computed KV before the reset never store it afterwards.

Hashes:
    Block hashes come from the engine (``kvkit.hashing`` or its own) and must
    be the ones it uses for its GPU prefix cache; a request's hash ``i`` names
    the KV of its tokens ``[0, (i + 1) * block_size)``. A CPU block holds every
    KV group's piece of one hash; a block is stored only when every group
    still has it on the GPU (a sliding-window group may have dropped it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from kvkit._transfers import Batch, Outcome, TransferTable
from kvkit.errors import ConfigError, RequestStateError, UnknownRequestError
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.callbacks import OffloadCallback
from kvkit.interfaces.store import StorePolicy
from kvkit.interfaces.types import (
    BlockHash,
    BlockId,
    Direction,
    GroupKind,
    KVCacheSpec,
    TransferPlan,
    TransferResult,
)
from kvkit.request import Request, RequestState
from kvkit.stats import OffloadStats
from kvkit.step import CompletionReport, StepPlan

__all__ = ["OffloadManager"]

_WAITING, _RUNNING, _ENDED = RequestState.WAITING, RequestState.RUNNING, RequestState.ENDED
_REMEMBER_ENDED = 1 << 16  # ended ids remembered to tell "already finished" from "unknown"

# A store resolved to GPU blocks: (hash, parent hash, GPU id per group, owner, GPU refs held).
_Resolved = tuple[BlockHash, "BlockHash | None", tuple[int, ...], "Request | None", bool]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_world_size(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"world_size must be a positive int, got {value!r}")


@attrs.define(eq=False)
class OffloadManager:
    """Drives one CPU offload tier from an engine's scheduler loop.

    Args:
        spec: the KV cache shape (block size, groups, bytes per block).
        cpu: the CPU tier's block pool (its size is the single source of truth
            for the CPU mirror the workers allocate).
        store: the store policy.
        gpu: the engine's GPU block pool, when it is a ``BlockAllocator``
            (reference engine, simulator): enables GPU reference holding and
            write-back stores. ``None`` for external engines.
        world_size: workers that must each report a transfer before it completes.
        callbacks: observers; every hook is called at its event.
        stats: counters to add to (a fresh :class:`OffloadStats` by default).
        null_block: the id that marks a missing block in the engine's block
            tables (``-1``; vLLM's null block is ``0``).

    Invariants (DESIGN §4; :meth:`check_invariants` asserts them):
        * CPU refcount of every block == lookup pins + in-flight transfer
          references held by the manager; with ``gpu``, the manager's GPU
          references are exactly those of in-flight and queued transfers.
        * A stored block is findable only after its copy completed on every
          worker; failed or abandoned stores never become findable.
        * No hash is stored while it is on the CPU tier or in flight.
        * Loads write CPU hit ``i`` to the GPU block at position
          ``gpu_hit_blocks + i``; only confirmed blocks are stored.
        * Per step: work is O(requests touched + blocks planned), never
          O(all blocks of all requests).
    """

    spec: KVCacheSpec
    cpu: BlockAllocator
    store: StorePolicy
    gpu: BlockAllocator | None = attrs.field(default=None, kw_only=True)
    world_size: int = attrs.field(default=1, kw_only=True, validator=_check_world_size)
    callbacks: tuple[OffloadCallback, ...] = attrs.field(default=(), kw_only=True, converter=tuple)
    stats: OffloadStats = attrs.field(factory=OffloadStats, kw_only=True)
    null_block: int = attrs.field(default=-1, kw_only=True)

    _requests: dict[str, Request] = attrs.field(init=False, factory=dict)
    _ended: dict[str, Request] = attrs.field(init=False, factory=dict)  # delayed free pending
    _recently_ended: dict[str, None] = attrs.field(init=False, factory=dict)
    _dirty: dict[str, Request] = attrs.field(init=False, factory=dict)  # queued stores or load
    _detached: list[_Resolved] = attrs.field(init=False, factory=list)
    _inflight_hashes: set[BlockHash] = attrs.field(init=False, factory=set)
    _transfers: TransferTable = attrs.field(init=False)
    _epoch: int = attrs.field(init=False, default=0)
    _draining: bool = attrs.field(init=False, default=False)
    _writeback: bool = attrs.field(init=False, default=False)
    _group_bytes: list[int] = attrs.field(init=False)
    _loaded: set[str] = attrs.field(init=False, factory=set)
    _load_failed: set[str] = attrs.field(init=False, factory=set)
    _released: set[str] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        problems = []
        if not isinstance(self.spec, KVCacheSpec):
            problems.append(f"spec must be a KVCacheSpec, got {self.spec!r}")
        for name, pool in (("cpu", self.cpu), ("gpu", self.gpu)):
            if (pool is not None or name == "cpu") and not isinstance(pool, BlockAllocator):
                problems.append(f"{name} must be a BlockAllocator, got {pool!r}")
        if not isinstance(self.store, StorePolicy):
            problems.append(f"store must be a StorePolicy, got {self.store!r}")
        bad = [c for c in self.callbacks if not isinstance(c, OffloadCallback)]
        if bad:
            problems.append(f"callbacks must be OffloadCallback instances, got {bad!r}")
        if isinstance(self.null_block, bool) or not isinstance(self.null_block, int):
            problems.append(f"null_block must be an int, got {self.null_block!r}")
        if problems:
            raise ConfigError(problems)
        gpu_blocks = self.gpu.num_blocks if self.gpu is not None else 1
        self._writeback = self.store.writeback_target(0, gpu_blocks) > 0
        if self._writeback:
            if self.gpu is None or not hasattr(self.gpu, "eviction_candidates"):
                raise ConfigError(
                    f"store policy {self.store!r} writes back GPU eviction candidates: pass a "
                    f"gpu= pool with eviction_candidates(n), got gpu={self.gpu!r}")
            if len(self.spec.groups) != 1:
                raise ConfigError(
                    f"store policy {self.store!r} writes back single GPU blocks, which needs a "
                    f"spec with one KV group, got {len(self.spec.groups)} groups")
        self._transfers = TransferTable(self.world_size)
        self._group_bytes = [2 * len(g.layers) * self.spec.bytes_per_layer_block
                             for g in self.spec.groups]
        self.cpu.add_evict_listener(self._on_cpu_evict)
        if self.gpu is not None:
            self.gpu.add_evict_listener(self._on_gpu_evict)

    # -- public state --------------------------------------------------------

    @property
    def drained(self) -> bool:
        """No transfer abandoned by a reset is still in flight (the CPU tier was emptied)."""
        return not self._draining

    @property
    def num_requests(self) -> int:
        """Live requests (added, not ended)."""
        return len(self._requests)

    @property
    def num_in_flight(self) -> int:
        """Transfers planned and not yet completed on every worker."""
        return len(self._transfers)

    @property
    def next_transfer_id(self) -> int:
        """The id the next planned transfer gets (ids only increase)."""
        return self._transfers.next_id

    def request(self, request_id: str) -> Request:
        """The live state of ``request_id`` (read it, do not change it).

        Raises:
            UnknownRequestError / RequestStateError: unknown, or already ended.
        """
        return self._live(request_id)

    # -- request life --------------------------------------------------------

    def add_request(self, request_id: str, block_hashes: Sequence[BlockHash],
                    num_prompt_tokens: int) -> None:
        """Start tracking a request.

        Args:
            request_id: the engine's id; must not be live.
            block_hashes: chained hashes of the prompt's full blocks.
            num_prompt_tokens: prompt length in tokens.

        Raises:
            RequestStateError: the id is live, or the counts disagree.
        """
        if request_id in self._requests or request_id in self._ended:
            raise RequestStateError(f"request {request_id!r} is already live")
        hashes = list(block_hashes)
        bs = self.spec.block_size
        if not _is_count(num_prompt_tokens) or len(hashes) > num_prompt_tokens // bs:
            raise RequestStateError(
                f"request {request_id!r}: {len(hashes)} full-block hashes need at least "
                f"{len(hashes) * bs} prompt tokens, got num_prompt_tokens={num_prompt_tokens!r}")
        self._recently_ended.pop(request_id, None)
        self._requests[request_id] = Request(request_id, hashes, num_prompt_tokens)

    def extend(self, request_id: str, new_hashes: Sequence[BlockHash],
               num_tokens: int | None = None) -> None:
        """Append the hashes of blocks that became full (decode), and optionally the token count.

        Blocks already computed become confirmed now.

        Raises:
            UnknownRequestError / RequestStateError: unknown or ended id, or a
                token count below the blocks' tokens.
        """
        r = self._requests.get(request_id) or self._live(request_id)
        hashes = r.block_hashes
        num_blocks = len(hashes) + len(new_hashes)
        full = num_blocks * self.spec.block_size
        if num_tokens is not None:
            if not _is_count(num_tokens) or num_tokens < full:
                raise RequestStateError(
                    f"request {request_id!r}: num_tokens={num_tokens!r} is below its "
                    f"{num_blocks} full blocks ({full} tokens)")
            full = max(full, num_tokens)
        hashes.extend(new_hashes)
        if full > r.num_tokens:
            r.num_tokens = full
        if r.state is _RUNNING:
            self._confirm(r)

    def lookup(self, request_id: str, gpu_hit_tokens: int, *,
               num_tokens: int | None = None) -> int:
        """Tokens available on the CPU tier right after the GPU hit; pins them.

        The hit is the longest run of CPU-ready blocks starting exactly at the
        GPU-hit boundary, capped so at least one of the request's tokens is
        recomputed. Its blocks are pinned (one CPU reference each) until the
        engine allocates (:meth:`on_allocated`), the request ends, or a later
        lookup replaces this one, so nothing can evict them in between. The
        lookup records no use: the blocks the engine accepts are touched (for
        the CPU eviction policy) at :meth:`on_allocated`. While a reset
        drains, every lookup answers 0.

        Args:
            request_id: a waiting request.
            gpu_hit_tokens: tokens the engine's GPU prefix cache holds, a
                multiple of ``block_size``.
            num_tokens: the request's current length if the manager's view
                is stale (default: prompt, confirmed or hashed tokens).

        Returns:
            Extra tokens, a multiple of ``block_size``.

        Raises:
            UnknownRequestError / RequestStateError: unknown, ended or running
                id, or a hit that is not block aligned or exceeds the request.
        """
        r = self._live(request_id)
        if r.state is not _WAITING:
            raise RequestStateError(
                f"request {request_id!r} is {r.state.value}; lookup needs a waiting request")
        bs = self.spec.block_size
        ntok = r.num_tokens
        if num_tokens is not None:
            if not _is_count(num_tokens):
                raise RequestStateError(f"request {request_id!r}: bad num_tokens={num_tokens!r}")
            ntok = max(ntok, num_tokens)
        if not _is_count(gpu_hit_tokens) or gpu_hit_tokens % bs or gpu_hit_tokens > ntok:
            raise RequestStateError(
                f"request {request_id!r}: gpu_hit_tokens={gpu_hit_tokens!r} must be a multiple of "
                f"block_size={bs} in [0, {ntok}]")
        r.num_tokens = ntok
        self._unpin(r)
        r.revoked = False
        self.stats.lookups.add()
        start = gpu_hit_tokens // bs
        stop = min((r.num_tokens - 1) // bs, len(r.block_hashes))
        blocks: list[BlockId] = []
        if stop > start and not self._draining:
            blocks = self.cpu.lookup(r.block_hashes[start:stop])
            if blocks:
                self.cpu.incref(blocks)
        r.gpu_hit_blocks = start
        r.offered_blocks = len(blocks)
        r.pinned = blocks
        for cb in self.callbacks:
            cb.on_lookup(request_id, gpu_hit_tokens, len(blocks) * bs)
        return len(blocks) * bs

    def on_allocated(self, request_id: str, gpu_block_ids: Sequence[Sequence[int]],
                     accepted_tokens: int = 0) -> None:
        """The engine allocated GPU blocks; plan the load of the accepted CPU hit.

        First call after :meth:`lookup` (waiting request): ``accepted_tokens``
        (a block-aligned prefix of the offered hit; the rest is unpinned now)
        are loaded into the GPU blocks at positions ``gpu_hit_blocks + i`` of
        each group (for a sliding-window group only the positions inside the
        window before the hit end; the others may be ``null_block``). The load
        enters the next :meth:`build_step`. If a reset revoked the hit, the
        request is reported in ``load_failed`` instead.

        Later calls (running request) replace the block table, e.g. when the
        engine dropped blocks; ``accepted_tokens`` must then be 0. To add
        blocks, :meth:`append_blocks` is cheaper.

        Args:
            request_id: the request.
            gpu_block_ids: the request's whole block table, one sequence of
                GPU block ids per KV group.
            accepted_tokens: CPU-hit tokens the engine uses.

        Raises:
            UnknownRequestError / RequestStateError: unknown or ended id, no
                lookup first, a table of the wrong shape, a hit position that
                is missing or null, or more tokens accepted than offered.
        """
        r = self._live(request_id)
        table = self._check_table(request_id, gpu_block_ids)
        if r.state is _RUNNING:
            if accepted_tokens != 0:
                raise RequestStateError(
                    f"request {request_id!r} is already running; accepted_tokens="
                    f"{accepted_tokens!r} must be 0")
            if r.load_pending:  # the load not yet planned reads the new table
                self._check_load_targets(r, table, len(r.pinned))
            r.block_table = table
            return
        if r.gpu_hit_blocks is None:
            raise RequestStateError(f"request {request_id!r}: on_allocated before lookup")
        bs = self.spec.block_size
        if (not _is_count(accepted_tokens) or accepted_tokens % bs
                or accepted_tokens > r.offered_blocks * bs):
            raise RequestStateError(
                f"request {request_id!r}: accepted_tokens={accepted_tokens!r} must be a multiple of "
                f"{bs} in [0, {r.offered_blocks * bs}] (the offered hit)")
        n = accepted_tokens // bs
        if not r.revoked:
            self._check_load_targets(r, table, n)
        keep, drop = r.pinned[:n], r.pinned[n:]
        if drop:
            self.cpu.decref(drop)
        if keep:
            self.cpu.touch(keep)  # a use, for the CPU eviction policy: only what is loaded
        if r.revoked and n:
            self._report_load_failed(r)
        r.pinned = keep
        r.load_pending = bool(keep)
        if keep:
            self._dirty[request_id] = r
        r.block_table = table
        r.state = _RUNNING
        r.epoch = self._epoch
        s = self.stats
        s.scheduled_requests.add()
        s.query_tokens.add(r.num_tokens)
        s.hit_tokens_gpu.add(r.gpu_hit_blocks * bs)
        s.hit_tokens_cpu.add(len(keep) * bs)

    def append_blocks(self, request_id: str, new_block_ids: Sequence[Sequence[int]]) -> None:
        """Blocks appended to a running request's table, one sequence per KV group (O(new)).

        Raises:
            UnknownRequestError / RequestStateError: unknown, ended or not
                running id, or not one sequence per group.
        """
        r = self._requests.get(request_id) or self._live(request_id)
        if r.state is not _RUNNING:
            raise RequestStateError(
                f"request {request_id!r} is {r.state.value}; append_blocks needs a running request")
        if len(new_block_ids) != len(r.block_table):
            raise RequestStateError(
                f"request {request_id!r}: need one block list per group ({len(r.block_table)}), "
                f"got {len(new_block_ids)}")
        for row, new in zip(r.block_table, new_block_ids):
            row.extend(new)

    def on_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """The KV of the request's first ``num_computed_tokens`` tokens is written (confirmed).

        Only confirmed blocks are ever stored: call this after the forward
        pass that wrote them completed (or was ordered before any store of
        them). Newly confirmed full blocks go to the store policy.

        Raises:
            UnknownRequestError / RequestStateError: unknown, ended or not
                running id; a count that decreases or exceeds the block table.
        """
        r = self._requests.get(request_id) or self._live(request_id)
        if r.state is not _RUNNING:
            raise RequestStateError(
                f"request {request_id!r} is {r.state.value}; on_computed needs a running request")
        table = r.block_table
        capacity = (len(table[0]) if len(table) == 1 else min(map(len, table))) * self.spec.block_size
        if (num_computed_tokens.__class__ is not int or num_computed_tokens < r.num_computed_tokens
                or num_computed_tokens > capacity):
            raise RequestStateError(
                f"request {request_id!r}: num_computed_tokens={num_computed_tokens!r} must be in "
                f"[{r.num_computed_tokens}, {capacity}] (never decreases, within the block table)")
        r.num_computed_tokens = num_computed_tokens
        if num_computed_tokens > r.num_tokens:
            r.num_tokens = num_computed_tokens
        self._confirm(r)

    def finish(self, request_id: str, num_computed_tokens: int | None = None) -> bool:
        """The request finished; flush its stores (policy ``on_finished``) and end it.

        Args:
            request_id: a live request.
            num_computed_tokens: its final confirmed progress, if not yet
                reported (the last step's blocks are then flushed too).

        Returns:
            ``True`` if the engine must keep the request's GPU blocks until a
            report lists it in ``released`` (never with ``gpu``).

        Raises:
            UnknownRequestError: unknown id.
            RequestStateError: already finished or aborted.
        """
        r = self._live(request_id)
        if num_computed_tokens is not None:
            self.on_computed(request_id, num_computed_tokens)
        if r.state is _RUNNING and r.epoch == self._epoch:
            self._queue(r, self.store.on_finished(r))
        delay = self._end(r)
        for cb in self.callbacks:
            cb.on_request_finished(request_id, False)
        return delay

    def abort(self, request_id: str) -> bool:
        """The request was aborted: end it without the finish flush.

        Stores already chosen still run (their data is confirmed). Returns
        what :meth:`finish` returns.

        Raises:
            UnknownRequestError: unknown id.
            RequestStateError: already finished or aborted.
        """
        r = self._live(request_id)
        delay = self._end(r)
        for cb in self.callbacks:
            cb.on_request_finished(request_id, True)
        return delay

    def preempt(self, request_id: str) -> bool:
        """The engine preempted a running request and frees its GPU blocks.

        The request stays live as a fresh waiting incarnation (same id and
        hashes, nothing computed); the engine looks it up again when it
        resumes it. Transfers in flight for the old incarnation complete
        normally (stores commit) or are forgotten (loads: their GPU blocks
        no longer belong to the request, so nothing is reported).

        Without ``gpu`` the stores it had queued are dropped (its blocks go
        now) and no release is reported for the old incarnation.

        Returns:
            ``True`` if transfers in flight still read or write the freed
            blocks: the engine's workers must finish them before the blocks
            are reused (vLLM's ``handle_preemptions``). Never with ``gpu``,
            whose references keep the blocks.

        Raises:
            UnknownRequestError / RequestStateError: unknown, ended or not running id.
        """
        r = self._live(request_id)
        if r.state is not _RUNNING:
            raise RequestStateError(
                f"request {request_id!r} is {r.state.value}; only a running request can be preempted")
        delay = self._end(r, preempted=True)
        self._requests[request_id] = r.successor()
        for cb in self.callbacks:
            cb.on_request_preempted(request_id)
        return delay

    # -- steps ---------------------------------------------------------------

    def build_step(self) -> StepPlan:
        """Plan this step's loads and stores (one plan per direction and group).

        Loads carry the hits accepted since the last step. Stores carry the
        blocks the policy chose (and, for write-back policies, the GPU pool's
        next eviction candidates), minus hashes the CPU tier holds or has in
        flight; their CPU blocks are allocated now, not ready and not
        findable. If the CPU pool cannot free enough blocks, fewer are stored
        (counted in ``stats.stores_dropped``); the engine is never failed.
        """
        loads = self._plan_loads()
        stores = self._plan_stores()
        dirty = self._dirty
        self._dirty = {rid: r for rid, r in dirty.items() if r.store_queue} if self._draining else {}
        return StepPlan(tuple(loads), tuple(stores))

    def apply_completions(self, results: Iterable[TransferResult]) -> CompletionReport:
        """Apply worker results; a transfer completes when all ``world_size`` workers reported it.

        A completed store commits its CPU blocks (findable from now), a
        failed or abandoned one discards them; a completed load releases its
        CPU pins. GPU references held for a transfer are dropped. Results for
        unknown transfer ids (or worker ranks) and repeated results from one
        worker are counted in ``stats`` and otherwise ignored.

        Returns:
            Requests whose loads finished or failed, and ended requests whose
            GPU blocks the engine may free now (including those that became
            free since the last call for other reasons).
        """
        stats, callbacks = self.stats, self.callbacks
        for res in results:
            outcome, t = self._transfers.report(res)
            if outcome is Outcome.UNKNOWN:
                stats.unknown_completions.add()
                continue
            if outcome is Outcome.DUPLICATE:
                stats.duplicate_completions.add()
                continue
            stats.transfer_seconds.add(res.seconds)
            stats.transfer_bytes.add(res.num_bytes)
            if outcome is Outcome.PENDING:
                continue
            batch = t.batch
            stats.transfers_completed.add()
            if not t.ok:
                stats.transfers_failed.add()
                batch.ok = False
            for cb in callbacks:
                cb.on_transfer_completed(t.transfer_id, batch.direction, t.num_blocks,
                                         t.ok and not batch.abandoned)
            if not batch.pending:
                self._complete(batch)
        if self._draining and not self._transfers:
            self._empty_cpu()
        elif self._detached and not self._draining:
            self._prune_detached()
        report = CompletionReport(frozenset(self._loaded), frozenset(self._load_failed),
                                  frozenset(self._released))
        self._loaded.clear()
        self._load_failed.clear()
        self._released.clear()
        return report

    def reset(self) -> bool:
        """Empty the CPU tier, even with transfers in flight.

        From this call on no lookup serves a hit. Every transfer in flight is
        abandoned (a store never commits, a load is reported in
        ``load_failed``), every lookup pin and queued transfer is released,
        and requests allocated before the reset never store. The CPU pool is
        reset once the abandoned transfers' completions have all arrived
        (:meth:`apply_completions`); until then no store is planned.
        Transfer ids keep increasing.

        Returns:
            ``True`` if the CPU tier was emptied now (nothing was in flight).
        """
        self._epoch += 1
        abandoned = 0
        for batch in self._transfers.batches():
            if not batch.abandoned:
                batch.abandoned = True
                abandoned += batch.pending
        self.stats.transfers_abandoned.add(abandoned)
        self._inflight_hashes.clear()
        for r in self._requests.values():
            if r.load_pending:
                self._report_load_failed(r)
            elif r.pinned:
                r.revoked = True
            self._unpin(r)
            r.store_queue = []
        self._dirty.clear()
        detached, self._detached = self._detached, []
        self._unhold(detached)
        for entry in detached:
            self._drop_hold(entry[3])
        self._draining = True
        if not self._transfers:
            self._empty_cpu()
        return not self._draining

    # -- invariants ----------------------------------------------------------

    def cpu_refs_held(self) -> Counter[BlockId]:
        """References the manager holds on CPU blocks: lookup pins and in-flight transfers."""
        held: Counter[BlockId] = Counter()
        for r in self._requests.values():
            held.update(r.pinned)
        for batch in self._transfers.batches():
            held.update(batch.cpu_blocks)
        return held

    def gpu_refs_held(self) -> Counter[BlockId]:
        """References the manager holds on GPU blocks (empty without ``gpu``)."""
        held: Counter[BlockId] = Counter()
        if self.gpu is None:
            return held
        for batch in self._transfers.batches():
            held.update(batch.gpu_blocks)
        for _, _, ids, _, was_held in self._detached:
            if was_held:
                held.update(ids)
        return held

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the manager or its pools are inconsistent."""
        cpu, bs = self.cpu, self.spec.block_size
        cpu.check_invariants()
        if self.gpu is not None:
            self.gpu.check_invariants()
        held = self.cpu_refs_held()
        for b in range(cpu.num_blocks):
            assert cpu.refcount(b) == held[b], (
                f"CPU block {b}: refcount {cpu.refcount(b)} != manager refs {held[b]}")
        if self.gpu is not None:
            for b, n in self.gpu_refs_held().items():
                assert self.gpu.refcount(b) >= n, f"GPU block {b}: refcount < {n} manager refs"
        batches = self._transfers.batches()
        holds: Counter[int] = Counter()
        inflight: list[BlockHash] = []
        for batch in batches:
            assert batch.pending > 0, "a batch in the table has no pending transfer"
            for r in batch.requests:
                holds[id(r)] += 1
            if batch.direction is Direction.STORE:
                assert all(cpu.block_hash(b) is None for b in batch.cpu_blocks), (
                    "an in-flight store's CPU block is findable before completion")
                if not batch.abandoned:
                    inflight += batch.hashes
            else:
                assert all(cpu.block_hash(b) is not None for b in batch.cpu_blocks), (
                    "an in-flight load's source is not ready")
            assert not self._draining or batch.abandoned, "a transfer was planned during a drain"
        assert len(inflight) == len(set(inflight)), "a hash has two stores in flight"
        assert set(inflight) == self._inflight_hashes, "in-flight hash set != uncommitted stores"
        for entry in self._detached:
            holds[id(entry[3])] += 1
        for rid, r in self._requests.items():
            assert r.request_id == rid and r.state is not _ENDED, (rid, r.state)
            assert r.num_confirmed_blocks == min(r.num_computed_tokens // bs,
                                                 len(r.block_hashes)), rid
            assert all(0 <= i < r.num_confirmed_blocks for i in r.store_queue), rid
            assert not r.store_queue or rid in self._dirty, f"{rid}: queued stores not dirty"
            assert not r.pinned or r.state is _WAITING or r.load_pending, rid
            assert all(cpu.block_hash(b) is not None for b in r.pinned), f"{rid}: pin not ready"
            assert r.holds == holds[id(r)], f"{rid}: holds {r.holds} != {holds[id(r)]}"
        for rid, r in self._ended.items():
            assert r.state is _ENDED and r.delay_free and r.holds == holds[id(r)] > 0, rid

    # -- internals -----------------------------------------------------------

    def _live(self, request_id: str) -> Request:
        r = self._requests.get(request_id)
        if r is not None:
            return r
        if request_id in self._ended or request_id in self._recently_ended:
            raise RequestStateError(f"request {request_id!r} already finished or aborted")
        raise UnknownRequestError(f"unknown request id {request_id!r}")

    def _check_table(self, request_id: str, table: Sequence[Sequence[int]]) -> list[list[int]]:
        if len(table) != len(self.spec.groups):
            raise RequestStateError(
                f"request {request_id!r}: need one block list per KV group "
                f"({len(self.spec.groups)}), got {len(table)}")
        return [list(row) for row in table]

    def _load_span(self, g: int, start: int, stop: int) -> int:
        """First block position of ``[start, stop)`` that group ``g`` must load."""
        group = self.spec.groups[g]
        if group.kind is GroupKind.FULL:
            return start
        bs = self.spec.block_size
        return max(start, stop - group.blocks_needed(stop * bs, bs))

    def _check_load_targets(self, r: Request, table: list[list[int]], n: int) -> None:
        start, stop = r.gpu_hit_blocks, r.gpu_hit_blocks + n
        for g, row in enumerate(table):
            first = self._load_span(g, start, stop)
            targets = row[first:stop]
            if len(targets) != stop - first or self.null_block in targets:
                raise RequestStateError(
                    f"request {r.request_id!r}: group {g} needs GPU blocks at positions "
                    f"[{first}, {stop}) for its CPU hit, got {row[first:stop]!r}")

    def _confirm(self, r: Request) -> None:
        """Re-derive the confirmed blocks; hand the newly confirmed range to the store policy."""
        computed, hashed = r.num_computed_tokens // self.spec.block_size, len(r.block_hashes)
        stop = computed if computed < hashed else hashed
        start = r.num_confirmed_blocks
        if stop > start:
            r.num_confirmed_blocks = stop
            if r.epoch == self._epoch:
                self._queue(r, self.store.on_computed(r, start, stop))

    def _queue(self, r: Request, indices: Iterable[int]) -> None:
        """Queue the policy's choice, keeping only confirmed blocks (invariant 9)."""
        confirmed = r.num_confirmed_blocks
        if isinstance(indices, range) and indices.step == 1:
            r.store_queue.extend(range(max(indices.start, 0), min(indices.stop, confirmed)))
        else:
            r.store_queue.extend(i for i in indices if 0 <= i < confirmed)
        if r.store_queue:
            self._dirty[r.request_id] = r

    def _unpin(self, r: Request) -> None:
        if r.pinned:
            self.cpu.decref(r.pinned)
            r.pinned = []
        r.load_pending = False

    def _report_load_failed(self, r: Request) -> None:
        self._load_failed.add(r.request_id)
        self.stats.loads_failed.add()

    def _resolve(self, r: Request, indices: Iterable[int], held: bool) -> list[_Resolved]:
        """Map block indices to (hash, parent, GPU ids per group); drop those a group lacks."""
        hashes, table, null = r.block_hashes, r.block_table, self.null_block
        out = []
        for i in indices:
            ids = tuple(row[i] for row in table)
            if null not in ids:
                out.append((hashes[i], hashes[i - 1] if i else None, ids, r, held))
        return out

    def _end(self, r: Request, preempted: bool = False) -> bool:
        """End an incarnation: release pins, detach queued stores, decide the delayed free.

        Returns whether transfers (queued or in flight) still touch its GPU
        blocks while the manager holds no GPU reference on them.
        """
        rid = r.request_id
        self._unpin(r)
        self._dirty.pop(rid, None)
        self._loaded.discard(rid)  # the engine no longer waits on this incarnation's load
        self._load_failed.discard(rid)
        if preempted and self.gpu is None:
            r.store_queue = []  # its blocks are freed now: only what is in flight may read them
        if r.store_queue:
            # Drop what the CPU tier holds now (only a store's allocation evicts, so
            # it is still there at the next build): a long request's flush would
            # otherwise hold GPU references on blocks that are never copied. Stores
            # in flight are deduplicated at build time, once their outcome is known;
            # while a reset drains, the CPU tier's contents are doomed.
            held, hashes, lookup = self.gpu is not None, r.block_hashes, self.cpu.lookup
            queue = list(dict.fromkeys(r.store_queue))  # the flush repeats queued blocks
            if self._draining:
                needed = queue
            else:  # one prefix lookup settles the (usually stored) head of a flush
                ready = len(lookup(hashes[:r.num_confirmed_blocks]))
                needed = [i for i in queue if i >= ready and not lookup((hashes[i],))]
            self.stats.stores_deduplicated.add(len(queue) - len(needed))
            entries = self._resolve(r, needed, held)
            r.store_queue = []
            if held:
                self.gpu.incref([g for e in entries for g in e[2]])
            self._detached += entries
            r.holds += len(entries)
        del self._requests[rid]
        r.state = _ENDED
        touched = self.gpu is None and r.holds > 0
        if not preempted:
            r.delay_free = touched
            if touched:
                self._ended[rid] = r
            else:
                self._remember_ended(rid)
        return touched

    def _remember_ended(self, rid: str) -> None:
        self._recently_ended[rid] = None
        if len(self._recently_ended) > _REMEMBER_ENDED:
            del self._recently_ended[next(iter(self._recently_ended))]

    def _drop_hold(self, r: Request | None) -> None:
        if r is None:
            return
        r.holds -= 1
        if not r.holds and r.state is _ENDED and r.delay_free:
            rid = r.request_id
            self._released.add(rid)
            if self._ended.get(rid) is r:
                del self._ended[rid]
                self._remember_ended(rid)

    def _plan_loads(self) -> list[tuple[int, TransferPlan]]:
        reqs = [r for r in self._dirty.values() if r.load_pending]
        if not reqs:
            return []
        groups = range(len(self.spec.groups))
        src: list[list[BlockId]] = [[] for _ in groups]
        dst: list[list[int]] = [[] for _ in groups]
        cpu_blocks: list[BlockId] = []
        for r in reqs:
            blocks, start = r.pinned, r.gpu_hit_blocks
            stop = start + len(blocks)
            for g in groups:
                first = self._load_span(g, start, stop)
                src[g] += blocks[first - start:]
                dst[g] += r.block_table[g][first:stop]
            cpu_blocks += blocks
            r.pinned = []  # the pins move to the batch
            r.load_pending = False
            r.holds += 1
        gpu_blocks = [b for row in dst for b in row] if self.gpu is not None else []
        if gpu_blocks:
            self.gpu.incref(gpu_blocks)
        batch = Batch(Direction.LOAD, cpu_blocks, gpu_blocks, reqs)
        return self._open(batch, src, dst)

    def _plan_stores(self) -> list[tuple[int, TransferPlan]]:
        if self._draining:
            return []
        detached, self._detached = self._detached, []
        cands = list(detached)
        for r in self._dirty.values():
            if r.store_queue:
                cands += self._resolve(r, r.store_queue, False)
                r.store_queue = []
        if self._writeback:
            cands += self._writeback_candidates()
        # Deduplicate against the CPU tier, stores in flight and this step (invariant 6).
        inflight, cpu_lookup = self._inflight_hashes, self.cpu.lookup
        chosen, skipped = [], []
        for c in cands:
            if c[0] in inflight or cpu_lookup((c[0],)):
                skipped.append(c)
            else:
                inflight.add(c[0])
                chosen.append(c)
        self.stats.stores_deduplicated.add(len(skipped))
        free = self.cpu.num_free
        if len(chosen) > free:  # store fewer, never fail the engine
            for c in chosen[free:]:
                inflight.discard(c[0])
            skipped += chosen[free:]
            self.stats.stores_dropped.add(len(chosen) - free)
            del chosen[free:]
        cpu_blocks = self.cpu.allocate(len(chosen)) if chosen else []
        gpu = self.gpu
        self._unhold(skipped)
        if gpu is not None:
            fresh = [g for c in chosen if not c[4] for g in c[2]]
            if fresh:
                gpu.incref(fresh)
        owners = list({id(c[3]): c[3] for c in chosen if c[3] is not None}.values())
        for r in owners:
            r.holds += 1
        for c in detached:  # after the batch's hold, so an owner is released only when done
            self._drop_hold(c[3])
        if not chosen:
            return []
        groups = range(len(self.spec.groups))
        src = [[c[2][g] for c in chosen] for g in groups]
        batch = Batch(Direction.STORE, cpu_blocks,
                      [b for row in src for b in row] if gpu is not None else [], owners,
                      hashes=[c[0] for c in chosen], parents=[c[1] for c in chosen])
        return self._open(batch, src, [cpu_blocks for _ in groups])

    def _unhold(self, entries: list[_Resolved]) -> None:
        """Drop the GPU references held for store candidates that will not be copied."""
        held = [g for e in entries if e[4] for g in e[2]]
        if held:
            self.gpu.decref(held)

    def _prune_detached(self) -> None:
        """Drop ended requests' queued stores whose hash reached the CPU tier meanwhile.

        Releases their GPU blocks (and a delayed free) now rather than at the next step.
        """
        lookup = self.cpu.lookup
        keep, gone = [], []
        for e in self._detached:
            (gone if lookup((e[0],)) else keep).append(e)
        if gone:
            self._detached = keep
            self.stats.stores_deduplicated.add(len(gone))
            self._unhold(gone)
            for e in gone:
                self._drop_hold(e[3])

    def _writeback_candidates(self) -> list[_Resolved]:
        """The GPU pool's next eviction candidates, as store candidates (write-back)."""
        gpu = self.gpu
        target = self.store.writeback_target(gpu.num_free, gpu.num_blocks)
        block_hash = gpu.block_hash
        return [(block_hash(b), None, (b,), None, False)
                for b in gpu.eviction_candidates(target)] if target > 0 else []

    def _open(self, batch: Batch, src: list[list[int]],
              dst: list[list[int]]) -> list[tuple[int, TransferPlan]]:
        """Turn per-group id lists into plans (empty groups skipped) and track them."""
        plans = []
        for g, (s, d) in enumerate(zip(src, dst)):
            if s:
                plans.append(TransferPlan(np.array(s, dtype=np.int64),
                                          np.array(d, dtype=np.int64), batch.direction, g))
                batch.num_bytes += len(s) * self._group_bytes[g]
        assert plans, "a batch with blocks must copy at least one group"
        out = self._transfers.open(batch, plans)
        self.stats.transfers_submitted.add(len(out))
        for cb in self.callbacks:
            for tid, plan in out:
                cb.on_transfer_submitted(tid, batch.direction, len(plan))
        return out

    def _complete(self, batch: Batch) -> None:
        """Every transfer of ``batch`` completed: commit or discard, release references."""
        ok = batch.ok and not batch.abandoned
        cpu, stats = self.cpu, self.stats
        if batch.direction is Direction.STORE:
            if not batch.abandoned:
                self._inflight_hashes.difference_update(batch.hashes)
            if ok:
                stats.blocks_stored.add(sum(cpu.commit(batch.cpu_blocks, batch.hashes,
                                                       batch.parents)))
                stats.bytes_stored.add(batch.num_bytes)
        else:
            if ok:
                stats.blocks_loaded.add(len(batch.cpu_blocks))
                stats.bytes_loaded.add(batch.num_bytes)
            for r in batch.requests:
                if r.state is _RUNNING:  # a preempted or ended incarnation no longer cares
                    if ok:
                        self._loaded.add(r.request_id)
                    else:
                        self._report_load_failed(r)
        cpu.decref(batch.cpu_blocks)  # a committed block becomes evictable, a discarded one empty
        if batch.gpu_blocks:
            self.gpu.decref(batch.gpu_blocks)
        for r in batch.requests:
            self._drop_hold(r)

    def _empty_cpu(self) -> None:
        dropped = self.cpu.reset()
        self._draining = False
        self.stats.resets.add()
        for cb in self.callbacks:
            cb.on_reset(dropped)

    def _on_cpu_evict(self, block: BlockId, block_hash: BlockHash) -> None:
        self.stats.evictions_cpu.add()
        for cb in self.callbacks:
            cb.on_evict("cpu", block, block_hash)

    def _on_gpu_evict(self, block: BlockId, block_hash: BlockHash) -> None:
        self.stats.evictions_gpu.add()
        for cb in self.callbacks:
            cb.on_evict("gpu", block, block_hash)
