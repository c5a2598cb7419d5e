"""``OffloadManager``: the scheduler side of a CPU offload tier (no tensors).

The manager sits in an engine's scheduler loop. Per request it finds CPU hits
beyond the GPU prefix hit and pins them at lookup, pairs them with the GPU
blocks the engine allocated, asks the store policy what to store, builds one
step plan of loads and stores, and applies the workers' completions: a stored
CPU block becomes findable only when its copy finished on every worker, and
every reference it takes is released exactly once.

One scheduler step, as an engine drives it::

    mgr.add_request(rid, block_hashes, num_prompt_tokens)   # on arrival
    mgr.prefetch(rid, gpu_hit_tokens)                       # optional: it waits for GPU blocks
    extra = mgr.lookup(rid, gpu_hit_tokens)                 # when scheduling it
    plan = mgr.plan_load(rid)                               # optional: what to load, what to recompute
    mgr.on_allocated(rid, block_table, accepted_tokens,     # after allocating
                     recompute_tokens=head_tokens)
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
    :class:`~kvkit.manager.step.CompletionReport` lists the id in ``released`` (the
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

Load plans:
    :meth:`plan_load` asks the manager's :class:`~kvkit.interfaces.plan.LoadPlanner`
    which blocks of the offered hit to load and which to recompute; the engine
    passes its answer to :meth:`on_allocated` (``accepted_tokens``: the head and
    the tail; ``recompute_tokens``: the head). The manager tells the planner
    what each completed load and fetch cost (from the workers' reported
    seconds) and counts what the plans declined and saved (``stats``).

Prefetch:
    :meth:`prefetch` fetches a waiting request's shared-tier hit into CPU
    blocks while it waits for GPU blocks, through the same fetch path as a
    shared hit's load, with no GPU destination: a fetch that lands leaves
    ordinary cached CPU blocks under their hashes (its lookup finds them as
    CPU hits), one that fails leaves nothing (its blocks are recomputed or
    fetched again). No request holds a prefetched block once its fetch is
    planned, so ending a request never waits for its prefetch.

Hashes:
    Block hashes come from the engine (``kvkit.hashing`` or its own) and must
    be the ones it uses for its GPU prefix cache; a request's hash ``i`` names
    the KV of its tokens ``[0, (i + 1) * block_size)``. A CPU block holds every
    KV group's piece of one hash; a block is stored only when every group
    holds it on the GPU: a sliding-window group may have dropped it (a null
    block), and a hit loads such a group's window only, so a request never
    stores the positions of its hit before that window.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import islice

import attrs

from kvkit.driving import DriveLock, driven
from kvkit.errors import ConfigError, KVKitError, PlanError, RequestStateError, UnknownRequestError
from kvkit.interfaces.allocator import BlockAllocator, EvictListener
from kvkit.interfaces.callbacks import OffloadCallback
from kvkit.interfaces.capabilities import EvictionOrder
from kvkit.interfaces.hints import HintAwarePolicy, WorkloadHints
from kvkit.interfaces.plan import HitQuery, HitSource, LoadPlan, LoadPlanner
from kvkit.interfaces.shared import SharedPlan
from kvkit.interfaces.store import StorePolicy
from kvkit.interfaces.types import (
    BlockHash,
    BlockId,
    Direction,
    KVCacheSpec,
    Tier,
    TransferPlan,
    TransferResult,
)
from kvkit.manager.backpressure import Backpressure, WriteGate
from kvkit.manager.ended import EndedRequests
from kvkit.manager.events import Events
from kvkit.manager.hits import CpuHits
from kvkit.manager.requests import (
    Progress,
    Request,
    RequestState,
    accepted_blocks,
    as_count,
    check_hashes,
    check_live,
    check_lookup,
    check_prompt,
    check_request_id,
    check_rows,
    wrong_state,
)
from kvkit.manager.step import CompletionReport, StepPlan
from kvkit.manager.stores import StorePlanner
from kvkit.manager.transfers import Batch, TransferTable
from kvkit.shared.scheduler import SharedTier, SharedTierSpec
from kvkit.stats import Counter as StatCounter
from kvkit.stats import OffloadStats
from kvkit.validate import at_least, int_problem, optional_at_least, plural, quote

try:  # advance's compiled twin, built at install where a C compiler is; without it the Python loop runs alone
    from kvkit.manager._progress import advance as _compiled_advance
except ImportError:
    _compiled_advance = None  # type: ignore[assignment]

__all__ = ["OffloadManager"]

_WAITING, _RUNNING, _ENDED = RequestState.WAITING, RequestState.RUNNING, RequestState.ENDED
_ROWS = (list, tuple)  # the sequence types advance's one-block path takes as they are


def _callbacks(callbacks: Iterable[OffloadCallback]) -> tuple[OffloadCallback, ...]:
    """``OffloadManager.callbacks`` as a tuple (a named converter: mypy's ``attrs`` plugin reads its type)."""
    return tuple(callbacks)


@attrs.define(eq=False)
class OffloadManager:
    """Drives one CPU offload tier from an engine's scheduler loop.

    Args:
        kv: the KV cache shape (block size, groups, bytes per block).
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
        num_gpu_blocks: the engine's GPU pool size, so block ids are checked
            against it (default: ``gpu.num_blocks``; unchecked above when
            neither is known).
        shared: a third tier behind the CPU tier (see
            :mod:`kvkit.shared.scheduler`): lookups continue there after the CPU
            hit, its hits are fetched into CPU blocks and loaded as CPU hits,
            and CPU blocks are put there (write-through or write-back).
        planner: decides per request which hit blocks to load and which to
            recompute (:meth:`plan_load`); ``None`` plans nothing (every
            accepted hit is loaded).
        store_backpressure / put_backpressure: the bounds of the CPU tier's
            stores and of the shared tier's puts (see
            :mod:`kvkit.manager.backpressure`): what a congested tier cannot
            take is dropped (stores) or deferred (puts), never waited for.

    Invariants (:meth:`check_invariants` asserts them):
        * CPU refcount of every block == lookup pins + in-flight transfer
          references held by the manager; with ``gpu``, the manager's GPU
          references are exactly those of in-flight and queued transfers.
        * A stored block is findable only after its copy completed on every
          worker; failed or abandoned stores never become findable.
        * No hash is stored while it is on the CPU tier or in flight.
        * Shared tier: a block is offered only if every worker's key exists;
          a fetched block is findable only once every worker's fetch landed
          and stays referenced until its load completed; a prefetched block
          is referenced by its request until its fetch is planned, then by
          the fetch alone.
        * Loads write CPU hit ``i`` to the GPU block at position
          ``gpu_hit_blocks + i``; only confirmed blocks are stored.
        * Per step: work is O(requests touched + blocks planned), never
          O(all blocks of all requests).

    Threads: every call that changes state holds :attr:`drive_lock` (see
    :mod:`kvkit.driving`), so calls of several threads run one at a time;
    once a stack's ``close`` shut it, they raise ``RequestStateError``. The
    calls made per running request and step (:meth:`append_blocks`,
    :meth:`extend`, :meth:`on_computed`) are the exception: they take no
    lock of their own (the scheduler step's hot path), so an engine loop
    holds the lock around a whole step (``OffloadStack.driving``) to keep
    ``close`` out of them; what they queue is planned only by
    :meth:`build_step`, which holds it.
    """

    kv: KVCacheSpec
    cpu: BlockAllocator
    store: StorePolicy
    gpu: BlockAllocator | None = attrs.field(default=None, kw_only=True)
    world_size: int = attrs.field(default=1, kw_only=True, validator=at_least(1))
    callbacks: tuple[OffloadCallback, ...] = attrs.field(default=(), kw_only=True, converter=_callbacks)
    stats: OffloadStats = attrs.field(factory=OffloadStats, kw_only=True)
    null_block: int = attrs.field(default=-1, kw_only=True)
    num_gpu_blocks: int | None = attrs.field(default=None, kw_only=True, validator=optional_at_least(1))
    shared: SharedTierSpec | None = attrs.field(default=None, kw_only=True)
    planner: LoadPlanner | None = attrs.field(default=None, kw_only=True)
    store_backpressure: Backpressure = attrs.field(factory=Backpressure, kw_only=True)
    put_backpressure: Backpressure = attrs.field(factory=Backpressure, kw_only=True)
    drive_lock: DriveLock = attrs.field(init=False, factory=DriveLock)

    _requests: dict[str, Request] = attrs.field(init=False, factory=dict)
    _ended: EndedRequests = attrs.field(init=False, factory=EndedRequests)
    _dirty: dict[str, Request] = attrs.field(init=False, factory=dict)  # queued stores or load
    _prefetching: dict[str, Request] = attrs.field(init=False, factory=dict)  # prefetch not yet planned
    _events: Events = attrs.field(init=False)
    _hits: CpuHits = attrs.field(init=False)
    _stores: StorePlanner = attrs.field(init=False)
    _transfers: TransferTable = attrs.field(init=False)
    _store_gate: WriteGate = attrs.field(init=False)
    _shared: SharedTier | None = attrs.field(init=False, default=None)
    _epoch: int = attrs.field(init=False, default=0)
    _draining: bool = attrs.field(init=False, default=False)
    _group_bytes: list[int] = attrs.field(init=False)
    _loaded: set[str] = attrs.field(init=False, factory=set)
    _load_failed: set[str] = attrs.field(init=False, factory=set)
    # advance's compiled twin (kvkit/manager/_progress.c: it applies a decode step's items, and stops at the first
    # item of another shape for the Python loop, the reference, to go on); None: the Python loop alone.
    _advance_twin: Callable[..., int] | None = attrs.field(init=False, default=_compiled_advance)
    # The CPU policy's on_hints if it is a HintAwarePolicy (found once, here), else None.
    _hint_sink: Callable[[Sequence[BlockHash], WorkloadHints], None] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        _check_parts(self.kv, self.cpu, self.gpu, self.store, self.callbacks, self.null_block)
        if self.num_gpu_blocks is None and self.gpu is not None:
            self.num_gpu_blocks = self.gpu.num_blocks
        self._events = Events(self.callbacks, self.stats.callback_errors)
        self._hits = CpuHits(self.kv, self.cpu, self.gpu, self.null_block)
        self._stores = StorePlanner(self.cpu, self.gpu, self.store, self.stats, self._ended,
                                    self.null_block, len(self.kv.groups),
                                    _writes_back(self.kv, self.store, self.gpu))
        self._transfers = TransferTable(self.world_size)
        for name in ("store_backpressure", "put_backpressure"):
            if not isinstance(getattr(self, name), Backpressure):
                raise ConfigError(f"{name} must be a Backpressure, got {getattr(self, name)!r}")
        self._store_gate = WriteGate(self.store_backpressure)
        self._group_bytes = [self.kv.kv_parts * len(g.layers) * self.kv.bytes_per_layer_block
                             for g in self.kv.groups]
        if self.shared is not None:
            if not isinstance(self.shared, SharedTierSpec):
                raise ConfigError(f"shared must be a SharedTierSpec or None, got {self.shared!r}")
            self._shared = SharedTier(self.shared, self.cpu, self.world_size, self.stats, self._events,
                                      self.kv.bytes_per_block, WriteGate(self.put_backpressure))
        self.cpu.add_evict_listener(self._evict_listener(Tier.CPU, self.stats.evictions_cpu))
        policy = getattr(self.cpu, "policy", None)
        if isinstance(policy, HintAwarePolicy):
            self._hint_sink = policy.on_hints
        if self.gpu is not None:
            self.gpu.add_evict_listener(self._evict_listener(Tier.GPU, self.stats.evictions_gpu))
        if self.planner is not None and not isinstance(self.planner, LoadPlanner):
            raise ConfigError(f"planner must be a LoadPlanner or None, got {self.planner!r}")

    # -- public state --------------------------------------------------------

    @property
    def drained(self) -> bool:
        """No transfer abandoned by a reset is still in flight (the CPU tier was emptied)."""
        return not self._draining

    @property
    def shared_status(self) -> str | None:
        """The shared tier's state in one line (``"on"``, ``"off (...)"``), or ``None`` without one."""
        return None if self._shared is None else self._shared.status

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
        r = self._requests.get(request_id) if request_id.__class__ is str else None  # a connector's per-step call
        return r if r is not None else self._live(request_id)

    # -- request life --------------------------------------------------------

    @driven
    def add_request(self, request_id: str, block_hashes: Sequence[BlockHash],
                    num_prompt_tokens: int, hints: WorkloadHints | None = None) -> None:
        """Start tracking a request.

        Args:
            request_id: the engine's id; must not be live.
            block_hashes: chained hashes of the prompt's full blocks.
            num_prompt_tokens: prompt length in tokens.
            hints: what the caller knows of the request's future (priority,
                retention, session, kind); passed with the hashes to the CPU
                tier's policy if it is a :class:`~kvkit.interfaces.hints.HintAwarePolicy`,
                else ignored.

        Whatever is raised, the request is not added.

        Raises:
            UnknownRequestError: the id is not a ``str``.
            HashInputError: a hash is not an int (NumPy integers are converted).
            RequestStateError: the id is live, or the counts disagree.
            ConfigError: ``hints`` is neither ``None`` nor a ``WorkloadHints``, or
                the CPU policy's ``on_hints`` raised (its error, if a kvkit one).
        """
        check_request_id(request_id)
        if hints is not None and not isinstance(hints, WorkloadHints):
            raise ConfigError(f"hints must be a WorkloadHints or None, got {hints!r}")
        if request_id in self._requests or self._ended.is_parked(request_id):
            raise RequestStateError(f"request {request_id!r} is already live")
        hashes = check_hashes(request_id, block_hashes)
        n = check_prompt(request_id, hashes, num_prompt_tokens, self.kv.block_size)
        if hints is not None and self._hint_sink is not None:
            self._hear_hints(request_id, hashes, hints)
        self._ended.revive(request_id)
        self._requests[request_id] = Request(request_id, hashes, n)

    def _hear_hints(self, request_id: str, hashes: list[BlockHash], hints: WorkloadHints) -> None:
        """Give the CPU policy the request's hints, before the request exists: a refusal adds nothing."""
        try:
            self._hint_sink(hashes, hints)  # type: ignore[misc]
        except KVKitError:
            raise
        except Exception as exc:  # a user policy's bug: typed, and the request is not added
            raise ConfigError(f"request {request_id!r} not added: the CPU policy's on_hints raised {exc!r} "
                              f"for hints {quote(hints)}") from exc

    def extend(self, request_id: str, new_hashes: Sequence[BlockHash],
               num_tokens: int | None = None) -> None:
        """Append the hashes of blocks that became full (decode), and optionally the token count.

        Blocks already computed become confirmed now.

        Raises:
            UnknownRequestError / RequestStateError: unknown or ended id, or a
                token count below the blocks' tokens.
            HashInputError: a hash is not an int.
        """
        r = (self._requests.get(request_id) if request_id.__class__ is str else None) or self._live(request_id)
        new_hashes = check_hashes(request_id, new_hashes, "new_hashes")
        hashes = r.block_hashes
        num_blocks = len(hashes) + len(new_hashes)
        full = num_blocks * self.kv.block_size
        if num_tokens is not None:
            n = as_count(num_tokens)
            if n is None or n < full:
                raise RequestStateError(
                    f"request {request_id!r}: num_tokens={num_tokens!r} is below its "
                    f"{plural(num_blocks, 'full block')} ({plural(full, 'token')})")
            full = max(full, n)
        hashes.extend(new_hashes)
        if full > r.num_tokens:
            r.num_tokens = full
        if r.state is _RUNNING and r.num_computed_tokens // self.kv.block_size > r.num_confirmed_blocks:
            self._confirm(r)  # computed blocks waited for these hashes

    @driven
    def lookup(self, request_id: str, gpu_hit_tokens: int, *,
               num_tokens: int | None = None) -> int:
        """Tokens available on the CPU (and shared) tier right after the GPU hit; pins them.

        The hit is the longest run of CPU-ready blocks starting exactly at the
        GPU-hit boundary, then (with a shared tier) the leading run of the
        next blocks whose every worker's key the shared store holds, capped so
        at least one of the request's tokens is recomputed. Shared hits get
        CPU blocks now (not ready) and are fetched in the step that loads
        them. Its blocks are pinned (one CPU reference each) until the
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
        bs = self.kv.block_size
        gpu_hit_tokens, r.num_tokens = check_lookup(r, gpu_hit_tokens, num_tokens, bs)
        self._hits.unpin(r)
        self._release_prefetch(r)
        r.revoked = False
        r.plan = None
        self.stats.lookups.add()
        start = gpu_hit_tokens // bs
        stop = min((r.num_tokens - 1) // bs, len(r.block_hashes))
        r.gpu_hit_blocks = start
        hit = self._hits.pin(r, r.block_hashes[start:stop] if not self._draining else ())
        if self._shared is not None and not self._draining:
            first = start + hit
            n = self._shared.find(r.block_hashes[first:stop], r.block_hashes[stop:], r.block_hashes[start:first])
            if first < stop:
                self._shared.reserve(r, first, n)
                hit += len(r.fetch)
                r.offered_blocks = hit
        self._events.emit("on_lookup", request_id, gpu_hit_tokens, hit * bs)
        return hit * bs

    @driven
    def prefetch(self, request_id: str, gpu_hit_tokens: int = 0) -> int:
        """Fetch a waiting request's shared-tier hit into the CPU tier while it waits; tokens to fetch.

        The hit is the leading run of the request's blocks right after the GPU
        hit and the CPU-ready blocks that follow it (and after the blocks its
        last :meth:`lookup` reserved) whose every worker's key the shared store
        holds, capped as :meth:`lookup` caps it; with a planner, only its
        leading blocks that the planner would load if the request were
        scheduled now with nothing computed alongside (a prefix whose fetch
        and load beat recomputing it: a prefetch that has not landed when the
        request is scheduled must not make its first token later; a planner
        that fails is contained as in :meth:`plan_load`, and nothing is
        fetched). Its CPU blocks are allocated now (the request's CPU-ready
        blocks held meanwhile, so they are not the ones evicted) and fetched
        in the next :meth:`build_step`, without a GPU destination; from then
        on the fetch alone references them, and once it lands they are cached
        CPU blocks under their hashes. A second call before that step
        replaces the first's reservation, as does a :meth:`lookup` (which
        reserves the hit itself); ending the request or a :meth:`reset`
        releases it. Without a shared tier, or while a reset drains, nothing
        is fetched.

        Args:
            request_id: a waiting request (added or preempted, not allocated).
            gpu_hit_tokens: tokens the engine's GPU prefix cache holds, a
                multiple of ``block_size``.

        Returns:
            Tokens whose fetch the next step plans (a multiple of ``block_size``).

        Raises:
            UnknownRequestError / RequestStateError: unknown, ended or running
                id, or a GPU hit that is not block aligned or exceeds the
                request (nothing changed).
        """
        r = self._live(request_id)
        if r.state is not _WAITING:
            raise wrong_state(r, "prefetch needs a waiting request")
        bs = self.kv.block_size
        gpu_hit_tokens, num_tokens = check_lookup(r, gpu_hit_tokens, None, bs)
        self._release_prefetch(r)
        shared = self._shared
        if shared is None or self._draining:
            return 0
        hashes, start = r.block_hashes, gpu_hit_tokens // bs
        stop = min((num_tokens - 1) // bs, len(hashes))
        held = self.cpu.lookup(hashes[start:stop]) if start < stop else []
        first = max(start + len(held), r.fetch_start + len(r.fetch) if r.fetch else 0)
        n = shared.find(hashes[first:stop], hashes[stop:]) if first < stop else 0
        n = self._worth_prefetching(start, first - start, n, num_tokens) if n else 0
        if not n:
            return 0
        self.cpu.incref(held)  # the prefetch's allocation must not evict the hit it continues
        try:
            r.prefetch = self.cpu.allocate(min(n, self.cpu.num_free))
        finally:
            self.cpu.decref(held)
        if not r.prefetch:
            return 0
        r.prefetch_start = first
        self._prefetching[request_id] = r
        tokens = len(r.prefetch) * bs
        self._events.emit("on_shared_prefetch", request_id, tokens)
        return tokens

    @driven
    def plan_load(self, request_id: str, *, overlap: bool = True) -> LoadPlan:
        """The planner's answer for the hit the last :meth:`lookup` offered ``request_id``.

        Pass it on to :meth:`on_allocated` as ``accepted_tokens =
        plan.accepted_blocks * block_size`` and ``recompute_tokens =
        plan.compute_blocks * block_size``. Without a planner, or with no hit,
        the whole hit is loaded. A planner that raises or answers something
        that is not a plan for this hit is contained (``stats.planner_errors``,
        one warning) and the whole hit is loaded.

        Args:
            request_id: a waiting request after its lookup.
            overlap: the engine can compute the head of the hit while the
                rest loads; ``False`` asks for a plan that loads a prefix only.

        Raises:
            UnknownRequestError / RequestStateError: unknown, ended or running
                id, or no lookup first.
            ConfigError: ``overlap`` is not a bool.
        """
        r = self._live(request_id)
        if r.state is not _WAITING or r.gpu_hit_blocks is None:
            raise wrong_state(r, "plan_load needs a waiting request after its lookup")
        if overlap.__class__ is not bool:
            raise ConfigError(f"plan_load(overlap={overlap!r}): overlap must be a bool")
        h = r.offered_blocks
        plan = LoadPlan.load_all(h)
        r.plan = None
        if self.planner is None or not h:
            return plan
        query = self._query(r, overlap)
        try:
            answer = self.planner.plan(query)
            if not isinstance(answer, LoadPlan) or answer.hit_blocks != h or (answer.compute_blocks and not overlap):
                raise TypeError(f"plan() answered {answer!r} for a hit of {plural(h, 'block')} (overlap={overlap})")
            plan = answer
            chosen = self.planner.estimate_ms(query, plan)
            loading = self.planner.estimate_ms(query, LoadPlan.load_all(h))
        except Exception as exc:  # noqa: BLE001 - a planner's bug must not wedge the engine
            self._events.contain(self.planner, "plan", exc, self.stats.planner_errors, "planner_errors")
            return LoadPlan.load_all(h)
        saved = loading - chosen if chosen is not None and loading is not None else 0.0
        r.plan = (plan, max(saved, 0.0))
        return plan

    @driven
    def on_allocated(self, request_id: str, gpu_block_ids: Sequence[Sequence[int]],
                     accepted_tokens: int = 0, *, recompute_tokens: int = 0) -> None:
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
            recompute_tokens: the first tokens of the accepted hit that the
                engine computes itself (front to back) while the rest loads
                (a plan's head, see :meth:`plan_load`): their blocks are not
                loaded; the loads start right after them.

        Raises:
            UnknownRequestError / RequestStateError: unknown or ended id, no
                lookup first, a table of the wrong shape, a hit position that
                is missing or null, or more tokens accepted than offered.
        """
        r = self._live(request_id)
        table, ids = check_rows(request_id, gpu_block_ids, len(self.kv.groups), self.num_gpu_blocks,
                                self.null_block)
        if r.state is _RUNNING:
            if accepted_tokens != 0:
                raise RequestStateError(
                    f"request {request_id!r} is already running; accepted_tokens="
                    f"{accepted_tokens!r} must be 0")
            needed = -(-r.num_computed_tokens // self.kv.block_size)
            if min(map(len, table)) < needed:  # its computed KV, and every queued store, stay in it
                raise RequestStateError(
                    f"request {request_id!r}: a replaced block table needs at least {plural(needed, 'block')} per "
                    f"group (its {plural(r.num_computed_tokens, 'computed token')}), got {[len(t) for t in table]}")
            if r.load_pending:  # the load not yet planned reads the new table
                self._hits.check_targets(r, table, r.head_blocks + len(r.pinned) + len(r.fetch), r.head_blocks)
            r.block_table, r.block_ids = table, ids
            return
        bs = self.kv.block_size
        n, head = accepted_blocks(r, accepted_tokens, bs, recompute_tokens)
        assert r.gpu_hit_blocks is not None  # accepted_blocks refuses a request never looked up
        if not r.revoked:
            self._hits.check_targets(r, table, n, head)
        offered_cpu, offered_shared = r.offered_cpu, r.offered_blocks - r.offered_cpu
        self._hits.accept(r, n, head)
        r.unfilled = self._hits.unfilled(r)
        if r.revoked and n > head:
            self._report_load_failed(r)
        if r.load_pending:
            self._dirty[request_id] = r
        r.block_table, r.block_ids = table, ids
        r.state = _RUNNING
        r.epoch = self._epoch
        s = self.stats
        if not r.counted:
            s.scheduled_requests.add()
            s.query_tokens.add(r.num_tokens)
        s.gpu_hit_tokens.add(r.gpu_hit_blocks * bs)
        s.cpu_hit_tokens.add(len(r.pinned) * bs)
        s.hits_declined_cpu.add((offered_cpu - len(r.pinned)) * bs)
        s.hits_declined_shared.add((offered_shared - len(r.fetch)) * bs)
        if r.load_pending:
            s.hit_tokens_overlapped.add(r.head_blocks * bs)
        if r.plan is not None and r.plan[0].accepted_blocks == n and r.plan[0].compute_blocks == head:
            s.plan_saved_ms.add(r.plan[1])
        r.plan = None
        if r.fetch:
            s.shared_hit_tokens.add(len(r.fetch) * bs)
            self._events.emit("on_shared_hit", request_id, len(r.fetch) * bs)

    def append_blocks(self, request_id: str, new_block_ids: Sequence[Sequence[int]]) -> None:
        """Blocks appended to a running request's table, one sequence per KV group (O(new)).

        Raises:
            UnknownRequestError / RequestStateError: unknown, ended or not
                running id, not one sequence per group, or an id that is not an
                int in range or is already in the request's table.
        """
        if new_block_ids is None:  # "no blocks" only inside advance's items; here a table that is not one
            check_rows(request_id, new_block_ids, 1, None, self.null_block, what="appended blocks")
        self._advance(((request_id, new_block_ids, None, None),), "append_blocks")

    def on_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """The KV of the request's first ``num_computed_tokens`` tokens is written (confirmed).

        Only confirmed blocks are ever stored: call this after the forward
        pass that wrote them completed (or was ordered before any store of
        them). Newly confirmed full blocks go to the store policy. A count
        inside a block confirms nothing, so an engine may tell only the steps
        in which a block completes (kvkit's vLLM connector does).
        :meth:`advance` tells a whole step's requests in one call.

        Raises:
            UnknownRequestError / RequestStateError: unknown, ended or not
                running id; a count that decreases or exceeds the block table.
        """
        if num_computed_tokens is None:  # "no count" only inside advance's items
            raise RequestStateError(f"request {request_id!r}: num_computed_tokens=None is not a token count")
        self._advance(((request_id, None, None, num_computed_tokens),), "on_computed")

    def advance(self, progress: Iterable[Progress]) -> None:
        """A whole step's running requests in one call (an engine's per-step hot path).

        For each ``(request_id, new_block_ids, new_hashes, num_computed_tokens)``
        in order, what :meth:`append_blocks`, :meth:`extend` and
        :meth:`on_computed` do with its parts, in that order; a part that is
        ``None`` tells nothing. Each request is looked up once; its item is
        checked whole before any of it applies, so the count may cover the
        blocks the same item appends.

        Raises:
            UnknownRequestError / RequestStateError / HashInputError: as those
                methods, at the first item refused (``RequestStateError`` for an
                item that is not a 4-tuple, or a request that is not running);
                the items before it are applied, it and those after it change
                nothing.
        """
        self._advance(progress, "advance")

    def _advance(self, progress: Iterable[Progress], call: str) -> None:
        """:meth:`advance`, its errors naming ``call``."""
        requests, bs, limit, null = self._requests, self.kv.block_size, self.num_gpu_blocks, self.null_block
        done = 0
        if self._advance_twin is not None and progress.__class__ is list:
            done = self._advance_twin(progress, requests, _RUNNING, bs, limit, null, self._confirm)
            if done == len(progress):
                return
        try:
            items = iter(progress)
        except TypeError:
            raise RequestStateError(f"{call} takes (request_id, new_block_ids, new_hashes, num_computed_tokens) "
                                    f"tuples, got {quote(progress)}") from None
        if done:
            items = islice(items, done, None)
        for item in items:
            try:
                request_id, new_ids, new_hashes, count = item
            except (TypeError, ValueError):
                raise RequestStateError(f"{call} takes (request_id, new_block_ids, new_hashes, "
                                        f"num_computed_tokens) tuples, got {quote(item)}") from None
            r = (requests.get(request_id) if request_id.__class__ is str else None) or self._live(request_id)
            if r.state is not _RUNNING:
                raise wrong_state(r, f"{call} needs a running request")
            table, taken = r.block_table, r.block_ids
            one: BlockId | None = None  # a single decode block: vLLM's ([id],), a list or tuple
            grown: list[list[BlockId]] | None = None
            capacity = len(table[0]) if len(table) == 1 else min(map(len, table))
            if new_ids is not None:
                if (new_ids.__class__ in _ROWS and len(new_ids) == 1 and new_ids[0].__class__ in _ROWS
                        and len(new_ids[0]) == 1 and len(table) == 1):
                    b = new_ids[0][0]
                    if (b.__class__ is int and b not in taken and 0 <= b != null
                            and (limit is None or b < limit)):
                        one = b  # type: ignore[assignment]  # an id, checked (no cast: the hot path)
                        capacity += 1
                if one is None:
                    grown, ids = check_rows(request_id, new_ids, len(table), limit, null, taken,
                                            "appended blocks")
                    capacity = min(len(t) + len(g) for t, g in zip(table, grown))
            fresh = None if new_hashes is None else check_hashes(request_id, new_hashes, "new_hashes")
            n = None
            if count is not None:
                n = count if count.__class__ is int else as_count(count)
                if n is None or n < r.num_computed_tokens or n > capacity * bs:
                    raise RequestStateError(
                        f"request {request_id!r}: num_computed_tokens={count!r} must be in "
                        f"[{r.num_computed_tokens}, {capacity * bs}] (never decreases, within the block table)")
            if one is not None:
                table[0].append(one)
                taken.add(one)
            elif grown is not None:
                for t, g in zip(table, grown):
                    t.extend(g)
                taken |= ids
            if fresh:
                r.block_hashes += fresh
                full = len(r.block_hashes) * bs
                if full > r.num_tokens:
                    r.num_tokens = full
            if n is not None:
                r.num_computed_tokens = n
                if n > r.num_tokens:
                    r.num_tokens = n
            if r.num_computed_tokens // bs > r.num_confirmed_blocks:  # else no block can be newly confirmed
                self._confirm(r)

    @driven
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
            self._queue(r, self._ask("on_finished", r))
        delay = self._end(r)
        self._events.emit("on_request_finished", request_id, False)
        return delay

    @driven
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
        self._events.emit("on_request_finished", request_id, True)
        return delay

    @driven
    def preempt(self, request_id: str, *, load_failed: bool = False) -> bool:
        """The engine preempted a running request and frees its GPU blocks.

        The request stays live as a fresh waiting incarnation (same id and
        hashes, nothing computed); the engine looks it up again when it
        resumes it. ``load_failed``: the engine drops the blocks because the
        request's load failed and schedules the same request again (vLLM's
        asynchronous loads), not a resumed one: its next allocation is not
        counted in ``stats.scheduled_requests`` and ``query_tokens`` again.
        Transfers in flight for the old incarnation complete normally (stores
        commit) or are forgotten (loads: their GPU blocks no longer belong to
        the request, so nothing is reported).

        Without ``gpu`` the stores it had queued are dropped (its blocks go
        now) and no release is reported for the old incarnation.

        Returns:
            ``True`` if transfers in flight still read or write the freed
            blocks: the engine's workers must finish them before the blocks
            are reused (vLLM's ``handle_preemptions``). Never with ``gpu``,
            whose references keep the blocks.

        Raises:
            UnknownRequestError / RequestStateError: unknown, ended or not running id.
            ConfigError: ``load_failed`` is not a bool.
        """
        if load_failed.__class__ is not bool:
            raise ConfigError(f"preempt(load_failed={load_failed!r}): load_failed must be a bool")
        r = self._live(request_id)
        if r.state is not _RUNNING:
            raise wrong_state(r, "only a running request can be preempted")
        delay = self._end(r, preempted=True)
        self._requests[request_id] = r.successor(counted=load_failed)
        self._events.emit("on_request_preempted", request_id)
        return delay

    @driven
    def fail_load(self, request_id: str) -> None:
        """A worker left ``request_id``'s blocks out of its load in flight (their source failed there) while
        the copies carrying them, and other requests' blocks, succeeded.

        When that load completes the request is reported in ``load_failed``
        (``stats.loads_failed``, once however many workers report it) and its
        blocks and bytes count in no loaded stat; the load's other requests
        complete as usual. A worker reports it no later than its own results
        of the load, so the load is still in flight here.

        Raises:
            UnknownRequestError / RequestStateError: unknown or ended id, or no load of it in flight.
        """
        r = self._live(request_id)
        batch = next((b for b in self._transfers.batches() if b.direction is Direction.LOAD and not b.shared
                      and r in b.requests), None)
        if batch is None:
            raise RequestStateError(f"request {request_id!r} has no load in flight to fail")
        if r not in batch.failed:
            batch.failed.append(r)

    # -- steps ---------------------------------------------------------------

    @driven
    def build_step(self) -> StepPlan:
        """Plan this step's loads and stores (one plan per direction and group).

        Loads carry the hits accepted since the last step. Stores carry the
        blocks the policy chose (and, for write-back policies, the GPU pool's
        next eviction candidates), minus hashes the CPU tier holds or has in
        flight; their CPU blocks are allocated now, not ready and not
        findable. If the CPU pool cannot free enough blocks, fewer are stored
        (counted in ``stats.stores_dropped``); the engine is never failed.
        """
        fetch_wait_s = math.inf
        if self._shared is not None:
            fetch_wait_s = self._shared.fetch_wait_s  # before tick() renews the step's deadline
            self._shared.tick()
        fetches, loads = self._plan_loads()
        fetches += self._plan_prefetches()
        stores = self._plan_stores()
        puts = self._plan_puts()
        dirty = self._dirty
        self._dirty = {rid: r for rid, r in dirty.items() if r.store_queue} if self._draining else {}
        return StepPlan(tuple(loads), tuple(stores), tuple(fetches), tuple(puts), fetch_wait_s)

    @driven
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

        Raises:
            PlanError: ``results`` is not an iterable of ``TransferResult``
                (checked before any result is applied).
        """
        results = _check_results(results)
        for batch in self._transfers.completed(results, self.stats, self._events):
            self._complete(batch)
        if self._draining and not self._transfers:
            self._empty_cpu()
        elif not self._draining:
            self._stores.prune()
        report = CompletionReport(frozenset(self._loaded), frozenset(self._load_failed),
                                  self._ended.take_released())
        self._loaded.clear()
        self._load_failed.clear()
        return report

    @driven
    def reset(self, *, force: bool = False) -> bool:
        """Empty the CPU tier, even with transfers in flight.

        From this call on no lookup serves a hit. Every transfer in flight is
        abandoned (a store never commits, a load is reported in
        ``load_failed`` when it completes), every lookup pin and queued
        transfer is released, and requests allocated before the reset never
        store. The CPU pool is reset once the abandoned transfers'
        completions have all arrived (:meth:`apply_completions`); until then
        no store is planned. Transfer ids keep increasing.

        Args:
            force: do not wait for the abandoned transfers (a copy that never
                completes): the CPU tier is emptied now, except the blocks
                they still reference, which stay quarantined (never findable,
                never reused) until their completions arrive; stores and
                hits resume at once (``stats.forced_resets``).

        Returns:
            ``True`` if the CPU tier was emptied now (nothing was in flight, or ``force``).

        Raises:
            ConfigError: ``force`` is not a bool.
        """
        if force.__class__ is not bool:
            raise ConfigError(f"reset(force={force!r}): force must be a bool")
        self._epoch += 1
        self.stats.transfers_abandoned.add(self._transfers.abandon_all())
        for r in self._requests.values():
            if r.load_pending:
                self._report_load_failed(r)
            elif r.pinned:
                r.revoked = True
            self._hits.unpin(r)
            self._release_prefetch(r)
            r.store_queue = []
        self._dirty.clear()
        self._stores.reset()
        if self._shared is not None:
            self._shared.reset()
        self._draining = True
        if not self._transfers:
            self._empty_cpu()
        elif force:
            self.stats.forced_resets.add()
            self._empty_cpu(force=True)
        return not self._draining

    # -- invariants ----------------------------------------------------------

    def cpu_refs_held(self) -> Counter[BlockId]:
        """References the manager holds on CPU blocks: lookup pins and in-flight transfers."""
        held = self._transfers.cpu_refs()
        for r in self._requests.values():
            held.update(r.pinned)
            held.update(r.fetch)
            held.update(r.prefetch)
        return held

    def cpu_blocks_storing(self) -> int:
        """CPU blocks that GPU -> CPU stores in flight write (allocated, not findable yet; abandoned ones too)."""
        return sum(len(b.cpu_blocks) for b in self._transfers.batches()
                   if b.direction is Direction.STORE and not b.shared)

    def gpu_refs_held(self) -> Counter[BlockId]:
        """References the manager holds on GPU blocks (empty without ``gpu``)."""
        held: Counter[BlockId] = Counter()
        if self.gpu is None:
            return held
        for batch in self._transfers.batches():
            held.update(batch.gpu_blocks)
        held.update(self._stores.gpu_refs())
        return held

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the manager or its pools are inconsistent."""
        cpu = self.cpu
        cpu.check_invariants()
        if self.gpu is not None:
            self.gpu.check_invariants()
        held = self.cpu_refs_held()
        for b in map(BlockId, range(cpu.num_blocks)):
            assert cpu.refcount(b) == held[b], (
                f"CPU block {b}: refcount {cpu.refcount(b)} != manager refs {held[b]}")
        if self.gpu is not None:
            for b, n in self.gpu_refs_held().items():
                assert self.gpu.refcount(b) >= n, f"GPU block {b}: refcount < {plural(n, 'manager ref')}"
        holds, inflight = self._transfers.check_invariants(cpu, self._draining)
        self._stores.check_invariants(inflight, holds)
        if self._shared is not None:
            self._shared.check_invariants(self._transfers.batches())
        check_live(self._requests, self._dirty, cpu, self.kv.block_size, holds)
        for rid, r in self._requests.items():
            assert not r.prefetch or self._prefetching.get(rid) is r, f"{rid}: a prefetch the next step misses"
        assert all(self._requests.get(rid) is r for rid, r in self._prefetching.items()), "an ended prefetch"
        self._ended.check_invariants()
        for r in self._ended.parked():
            assert r.holds == holds[id(r)], f"{r.request_id}: holds {r.holds} != {holds[id(r)]}"

    # -- internals -----------------------------------------------------------

    def _live(self, request_id: str) -> Request:
        r = self._requests.get(check_request_id(request_id))
        if r is not None:
            return r
        if request_id in self._ended:
            raise RequestStateError(f"request {request_id!r} already finished or aborted")
        raise UnknownRequestError(f"unknown request id {request_id!r}")

    def _query(self, r: Request, overlap: bool) -> HitQuery:
        """What the planner knows of ``r``'s offered hit: CPU blocks, then shared-tier blocks."""
        assert r.gpu_hit_blocks is not None  # plan_load refuses a request never looked up
        runs = [(src, n) for src, n in ((HitSource.CPU, r.offered_cpu),
                                        (HitSource.SHARED, r.offered_blocks - r.offered_cpu)) if n]
        return HitQuery(block_size=self.kv.block_size, block_bytes=self.kv.bytes_per_block,
                        context_tokens=r.gpu_hit_blocks * self.kv.block_size, runs=runs,
                        num_tokens=r.num_tokens, overlap=overlap)

    def _confirm(self, r: Request) -> None:
        """Re-derive the confirmed blocks; hand the newly confirmed range to the store policy."""
        computed, hashed = r.num_computed_tokens // self.kv.block_size, len(r.block_hashes)
        stop = computed if computed < hashed else hashed
        start = r.num_confirmed_blocks
        if stop > start:
            r.num_confirmed_blocks = stop
            if r.epoch == self._epoch:
                self._queue(r, self._ask("on_computed", r, start, stop))

    def _ask(self, hook: str, *args: object) -> Iterable[int]:
        """The store policy's answer; one that raises or is not int indices means "store nothing"."""
        try:
            answer = getattr(self.store, hook)(*args)
            if answer.__class__ is range:
                return answer
            out = list(answer)
            if not set(map(type, out)) <= {int}:
                raise TypeError(f"block indices must be ints, got {out[:8]!r}")
            return out
        except Exception as exc:  # noqa: BLE001 - a policy's bug must not wedge the manager
            self._events.contain(self.store, hook, exc, self.stats.store_policy_errors, "store_policy_errors")
            return ()

    def _queue(self, r: Request, indices: Iterable[int]) -> None:
        """Queue the policy's choice, keeping only confirmed blocks (invariant 9) that every group holds."""
        confirmed, unfilled, queue = r.num_confirmed_blocks, r.unfilled, r.store_queue
        if indices.__class__ is range and indices.step == 1 and not unfilled:
            start, stop = indices.start, indices.stop
            queue.extend(range(start if start > 0 else 0, stop if stop < confirmed else confirmed))
        else:
            queue.extend(i for i in indices if 0 <= i < confirmed and i not in unfilled)
        if queue:
            self._dirty[r.request_id] = r

    def _report_load_failed(self, r: Request) -> None:
        """Report ``r``'s load failed. The engine recomputes from the GPU-hit boundary, so the computed count
        goes back to it (an engine that counted the hit computed when it scheduled the load reports the
        recomputed blocks again, and they are confirmed and offered to the store policy again); queued stores
        past it are dropped (their KV is not there)."""
        self._load_failed.add(r.request_id)
        self.stats.loads_failed.add()
        if r.gpu_hit_blocks is not None and r.num_computed_tokens > r.gpu_hit_blocks * self.kv.block_size:
            r.num_computed_tokens = r.gpu_hit_blocks * self.kv.block_size
            r.num_confirmed_blocks = min(r.gpu_hit_blocks, len(r.block_hashes))
            r.store_queue = [i for i in r.store_queue if i < r.num_confirmed_blocks]

    def _end(self, r: Request, preempted: bool = False) -> bool:
        """End an incarnation: release pins, detach queued stores, decide the delayed free.

        Returns whether transfers (queued or in flight) still touch its GPU
        blocks while the manager holds no GPU reference on them.
        """
        rid = r.request_id
        self._hits.unpin(r)
        self._release_prefetch(r)
        self._dirty.pop(rid, None)
        self._loaded.discard(rid)  # the engine no longer waits on this incarnation's load
        self._load_failed.discard(rid)
        if preempted and self.gpu is None:
            r.store_queue = []  # its blocks are freed now: only what is in flight may read them
        if r.store_queue:
            self._stores.detach(r, self._draining)
        del self._requests[rid]
        r.state = _ENDED
        touched = self.gpu is None and r.holds > 0
        if not preempted:
            self._ended.end(r, touched)
        return touched

    def _plan_loads(self) -> tuple[list[tuple[int, SharedPlan]], list[tuple[int, TransferPlan]]]:
        """The fetch of the accepted shared hits (if any) and the load of every accepted hit."""
        reqs = [r for r in self._dirty.values() if r.load_pending]
        if not reqs:
            return [], []
        fetches: list[tuple[int, SharedPlan]] = []
        fetched: list[BlockId] = []
        if self._shared is not None and (planned := self._shared.plan_fetches(reqs)) is not None:
            fetches = self._open_shared(*planned)
            fetched = planned[0].cpu_blocks
        batch, src, dst = self._hits.plan(reqs, self._group_bytes)
        batch.fetched = fetched
        return fetches, self._open(batch, src, dst)

    def _plan_prefetches(self) -> list[tuple[int, SharedPlan]]:
        """The fetch of the prefetches asked for since the last step (if any)."""
        if not self._prefetching:
            return []
        reqs, self._prefetching = list(self._prefetching.values()), {}
        assert self._shared is not None  # only a shared tier reserves prefetches
        planned = self._shared.plan_prefetches(reqs)
        return self._open_shared(*planned) if planned else []

    def _worth_prefetching(self, context: int, cpu_blocks: int, shared_blocks: int, num_tokens: int) -> int:
        """How many leading blocks of a shared hit of ``shared_blocks`` (after ``context`` blocks on the GPU, then
        ``cpu_blocks`` on the CPU tier) to prefetch: see :meth:`prefetch`; none if the planner fails."""
        planner = self.planner
        if planner is None:
            return shared_blocks
        bs = self.kv.block_size
        runs = [(src, n) for src, n in ((HitSource.CPU, cpu_blocks), (HitSource.SHARED, shared_blocks)) if n]
        query = HitQuery(block_size=bs, block_bytes=self.kv.bytes_per_block, context_tokens=context * bs, runs=runs,
                         num_tokens=num_tokens, overlap=False)
        try:
            plan = planner.plan(query)
            if not isinstance(plan, LoadPlan) or plan.hit_blocks != query.hit_blocks or plan.compute_blocks:
                raise TypeError(f"plan() answered {plan!r} for a hit of {plural(query.hit_blocks, 'block')} "
                                f"(overlap=False)")
        except Exception as exc:  # noqa: BLE001 - as plan_load
            self._events.contain(planner, "plan", exc, self.stats.planner_errors, "planner_errors")
            return 0
        return min(max(plan.load_blocks - cpu_blocks, 0), shared_blocks)

    def _release_prefetch(self, r: Request) -> None:
        """Release ``r``'s prefetch reservation that no step planned yet."""
        if r.prefetch:
            self.cpu.decref(r.prefetch)  # never committed: the blocks are empty again
            r.prefetch = []
        self._prefetching.pop(r.request_id, None)

    def _plan_puts(self) -> list[tuple[int, SharedPlan]]:
        if self._shared is None or self._draining:
            return []
        planned = self._shared.plan_puts()
        return self._open_shared(*planned) if planned else []

    def _open_shared(self, batch: Batch, plan: SharedPlan) -> list[tuple[int, SharedPlan]]:
        out = self._transfers.open(batch, [plan])
        self.stats.transfers_submitted.add()
        return out

    def _plan_stores(self) -> list[tuple[int, TransferPlan]]:
        if self._draining:
            return []
        planned = self._stores.plan(self._dirty.values(), self._store_gate.budget())
        if not planned:
            return []
        self._store_gate.started(len(planned[0].cpu_blocks))
        return self._open(*planned)

    def _open(self, batch: Batch, src: Sequence[Sequence[int]],
              dst: Sequence[Sequence[int]]) -> list[tuple[int, TransferPlan]]:
        """Turn per-group id lists into plans (empty groups skipped) and track them."""
        out = self._transfers.open(batch, batch.plans(src, dst, self._group_bytes))
        self.stats.transfers_submitted.add(len(out))
        for tid, plan in out:
            self._events.emit("on_transfer_submitted", tid, batch.direction, len(plan))
        return out

    def _complete(self, batch: Batch) -> None:
        """Every transfer of ``batch`` completed: commit or discard, release references."""
        ok = batch.settle(self.cpu, self.gpu, self.stats)
        if ok and batch.committed:  # a CPU store or a fetch made hashes findable
            self._events.emit("on_cpu_stored", batch.committed, batch.committed_parents)
        elif ok and batch.shared and batch.direction is Direction.STORE:
            self._events.emit("on_shared_stored", list(batch.hashes))
        if ok and batch.prefetch:
            self.stats.blocks_prefetched.add(len(batch.committed))
        moved = batch.num_bytes - batch.left_out()[1]
        if ok and batch.direction is Direction.LOAD and batch.seconds > 0 and moved and self.planner is not None:
            self._observe(HitSource.SHARED if batch.shared else HitSource.CPU, moved, batch.seconds)
        if batch.shared:
            assert self._shared is not None, "a shared-tier batch needs the shared tier"
            self._shared.settled(batch, ok)
        elif batch.direction is Direction.STORE:
            self._store_gate.finished(len(batch.cpu_blocks), batch.seconds)
            self._stores.settled(batch)
            if ok and self._shared is not None:
                self._shared.written(batch.committed)
        else:
            for r in batch.requests:
                if r.state is _RUNNING:  # a preempted or ended incarnation no longer cares
                    if ok and r not in batch.failed:
                        self._loaded.add(r.request_id)
                    else:
                        self._report_load_failed(r)
        self._ended.drop_holds(batch.requests)

    def _observe(self, source: HitSource, num_bytes: int, seconds: float) -> None:
        planner = self.planner
        assert planner is not None  # observed only with a planner
        try:
            planner.observe_move(source, num_bytes, seconds)
        except Exception as exc:  # noqa: BLE001 - as plan_load
            self._events.contain(planner, "observe_move", exc, self.stats.planner_errors, "planner_errors")

    def _empty_cpu(self, force: bool = False) -> None:
        dropped = self.cpu.reset(force=True) if force else self.cpu.reset()
        self._draining = False
        self.stats.resets.add()
        self._events.emit("on_reset", dropped)

    def _evict_listener(self, tier: Tier, counter: StatCounter) -> EvictListener:
        """The listener of ``tier``'s evictions: counts them in ``counter``; with callbacks, emits ``on_evict``
        for each."""
        emit = self._events.emit
        if not self._events.callbacks:  # one call per evicting allocation: the count alone

            def count(blocks: Sequence[BlockId], hashes: Sequence[BlockHash]) -> None:
                counter.value += len(blocks)  # Counter.add, inlined

            return count

        def counted(blocks: Sequence[BlockId], hashes: Sequence[BlockHash]) -> None:
            counter.value += len(blocks)
            for block, block_hash in zip(blocks, hashes):
                emit("on_evict", tier, block, block_hash)

        return counted


def _check_parts(spec: object, cpu: object, gpu: object, store: object,
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
    if (problem := int_problem("null_block", null_block)) is not None:
        problems.append(problem)
    if problems:
        raise ConfigError(problems)


def _writes_back(spec: KVCacheSpec, store: StorePolicy, gpu: BlockAllocator | None) -> bool:
    """Whether ``store`` writes back GPU eviction candidates.

    Raises:
        ConfigError: it does, but ``gpu`` is not an
            :class:`~kvkit.interfaces.capabilities.EvictionOrder` (a pool with
            ``eviction_candidates``) or ``spec`` has more than one KV group.
    """
    if store.writeback_target(0, gpu.num_blocks if gpu is not None else 1) <= 0:
        return False
    if not isinstance(gpu, EvictionOrder):
        raise ConfigError(
            f"store policy {store!r} writes back GPU eviction candidates: pass a "
            f"gpu= pool with eviction_candidates(n), got gpu={gpu!r}")
    if len(spec.groups) != 1:
        raise ConfigError(
            f"store policy {store!r} writes back single GPU blocks, which needs a "
            f"spec with one KV group, got {plural(len(spec.groups), 'group')}")
    return True


def _check_results(results: object) -> list[TransferResult]:
    """``results`` as a list, every item a ``TransferResult``; a ``PlanError`` quoting the first that is not."""
    if isinstance(results, (str, bytes)) or not isinstance(results, Iterable):
        raise PlanError(f"apply_completions needs an iterable of TransferResult, got {results!r}")
    out = list(results)
    for i, res in enumerate(out):
        if not isinstance(res, TransferResult):
            raise PlanError(f"apply_completions: results[{i}]={res!r} is not a TransferResult "
                            f"(nothing was applied)")
    return out
