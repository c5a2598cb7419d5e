"""The scheduler side of kvkit's vLLM connector: vLLM's scheduler calls mapped onto ``OffloadManager``.

vLLM-free: vLLM's ``Request`` objects are read by attribute (``request_id``,
``block_hashes``, ``num_tokens``, ``num_computed_tokens``, ``num_preemptions``)
and its GPU pool through :class:`~kvkit.integrations.vllm.gpu_pool.VllmGpuPool`.
The mapping, per vLLM call:

========================================  =====================================================
vLLM (scheduler process)                  kvkit
========================================  =====================================================
``bind_kv_cache_manager(m)``              the manager is built, holding GPU references in
                                          ``m.block_pool``
``get_num_new_matched_tokens(req, n)``    ``add_request`` (first time) or ``extend``; a request
                                          the manager still runs was preempted: ``preempt``;
                                          then ``lookup(n)`` (pins, replaces an earlier pin)
                                          and ``plan_load(overlap=False)``: the prefix of the
                                          hit worth loading
``update_state_after_alloc(req, b, k)``   ``on_allocated(table, k)``: the rest of the hit is
                                          unpinned, the load enters the next plan (with
                                          asynchronous loads vLLM calls it again, ``k = 0``,
                                          once the load landed: the table is replaced)
``build_connector_meta(out)``             ``preempt`` (``preempted_req_ids``), one ``advance``
                                          with each running request's new blocks, the
                                          hashes of its blocks that filled (its length is
                                          told at its next lookup or its finish) and, where
                                          a block completes, the tokens it holds once this
                                          step ran (with a sliding window ``on_allocated``
                                          with the table vLLM holds now, whose freed blocks
                                          are null and may come back), ``build_step``
                                          -> metadata for every worker
``update_connector_output(out)``          ``fail_load`` (requests a worker left out of its
                                          loads), ``apply_completions`` (the
                                          workers' results); a request whose asynchronous
                                          load failed (vLLM got it in ``failed_recving``,
                                          dropped its blocks and looks it up again) is
                                          offered no hit until vLLM allocated it: vLLM
                                          recomputes it, no second try reads the same bad
                                          value
``request_finished_all_groups(req, b)``   the table as vLLM leaves it where it differs from
                                          kvkit's (blocks out of a window are null), then
                                          ``finish`` (flush) or ``abort``
``reset_cache()``                         ``reset``
========================================  =====================================================

Load plans: vLLM's connector API loads a hit as a prefix of the request's
computed tokens, before any of its compute (``get_num_new_matched_tokens``
answers one count; the scheduler then treats those tokens as computed, and
the worker's ``start_load_kv`` / ``wait_for_layer_load`` only move bytes).
So the planner is asked for plans without a head: it may decline the end of
a hit (a shared-tier run slower than recomputing it) but cannot have the
hit's head recomputed while its tail loads, which would need the scheduler
to compute tokens *before* external ones of the same request. kvkit does not
time vLLM's forward passes: the planner learns compute only from
``options["planner"]["prefill_tokens_per_s"]`` (until then every hit is
loaded), and loads and fetches from the workers' reported times.

Stores belong to the step that computes their blocks: the plan built for a
step stores what that step's forward pass writes, and the workers submit its
stores after that forward pass, so no later callback (vLLM skips
``update_connector_output`` on idle steps) can delay them. The manager holds
a GPU reference on every block a transfer reads or writes until every worker
reported it, so vLLM frees finished, preempted and out-of-window blocks at
once (``request_finished`` is always ``False``) and never reuses one a copy
still touches.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
from typing_extensions import override

from kvkit.config import StackConfig
from kvkit.errors import HashInputError
from kvkit.integrations.vllm.settings import ConnectorSettings
from kvkit.interfaces import BlockAllocator, BlockHash, BlockId, GroupKind, Tier, TransferResult
from kvkit.interfaces.callbacks import OffloadCallback
from kvkit.manager import OffloadManager
from kvkit.manager.requests import Progress, RequestState
from kvkit.manager.step import StepPlan
from kvkit.shared.client import SharedConnection, connect_shared
from kvkit.stats import OffloadStats
from kvkit.validate import is_int, plural

__all__ = ["COPIES", "COUNTERS", "GAUGES", "INFO_KEY", "LOADED_TOKENS_KEY", "RELOADED_TOKENS_KEY", "SchedulerSide",
           "StepOrder", "TierBlock", "TierEvents", "TierRun", "block_hash"]

LOADED_TOKENS_KEY = "kvkit_loaded_tokens"
"""Key, in a finished request's ``kv_transfer_params``, of the prompt tokens kvkit loaded
when vLLM first scheduled it (part of ``RequestOutput.num_cached_tokens``); a load that
failed counts none of its tokens (vLLM recomputed them)."""
RELOADED_TOKENS_KEY = "kvkit_reloaded_tokens"
"""Key of the tokens kvkit loaded when vLLM resumed the request after preemptions (failed loads not counted)."""

GAUGES: tuple[str, ...] = ("gpu_blocks_held", "cpu_blocks_pinned", "transfers_in_flight", "cpu_blocks",
                           "cpu_blocks_used", "cpu_blocks_storing")
"""State :meth:`SchedulerSide.stats_delta` reports beside the counters' increments: GPU block
references kvkit holds, CPU references (lookup pins and transfers), transfers in flight, the CPU
tier's size, its blocks not free (neither empty nor evictable: pinned, in flight or being
written) and its blocks GPU -> CPU stores in flight write."""

INFO_KEY = "info"
"""Key of :meth:`SchedulerSide.stats_delta` holding :attr:`SchedulerSide.info`, sent with the gauges."""

COPIES: tuple[str, ...] = ("load_copies", "store_copies")
"""Keys of :meth:`SchedulerSide.stats_delta` listing the interval's GPU <-> CPU copies, one
``(bytes, seconds)`` pair per copy (one KV group's loads or stores of one step) and worker that
completed it: CPU -> GPU loads and GPU -> CPU stores."""

COUNTERS: tuple[str, ...] = tuple(f.name for f in attrs.fields(OffloadStats))
"""The :class:`~kvkit.stats.OffloadStats` counters :meth:`SchedulerSide.stats_delta` reports increases of."""
_RUNNING = RequestState.RUNNING
_BYTES = {bytes}  # vLLM's block hash type


def block_hash(value: object) -> BlockHash:
    """kvkit's hash of one vLLM block hash: the big-endian integer of its bytes.

    vLLM's hashes are already digests (salted by cache salt and LoRA), so the
    mapping only changes the type; it is deterministic across processes.

    Raises:
        HashInputError: neither ``bytes`` nor a non-negative ``int``.
    """
    if value.__class__ is bytes:  # vLLM's own (a digest): the hot path, no further call
        return int.from_bytes(value, "big")  # type: ignore[return-value]
    if isinstance(value, (bytes, bytearray)):
        return BlockHash(int.from_bytes(value, "big"))
    if is_int(value, 0):
        return BlockHash(int(value))
    raise HashInputError(f"vLLM block hash must be bytes or a non-negative int, got {value!r}")


def block_hashes(values: Sequence[object]) -> list[BlockHash]:
    """:func:`block_hash` of each value: a prompt's hashes in one pass where all are ``bytes`` (vLLM's)."""
    if len(values) > 2 and set(map(type, values)) <= _BYTES:
        from_bytes = int.from_bytes
        return [from_bytes(v, "big") for v in values]  # type: ignore[arg-type, misc]
    return [block_hash(v) for v in values]


@attrs.frozen
class StepOrder:
    """What the scheduler side sends every worker for one step (inside vLLM's metadata).

    Attributes:
        step: increases by one per ``build_connector_meta``.
        plan: the step's loads (before its forward pass, or while it runs
            with asynchronous loads) and stores (after it).
        loading: requests whose hits this step's loads write (those vLLM
            allocated since the last step with a hit it accepted).
        targets: each loading request's GPU blocks its hit is loaded into
            (every group's, null blocks left out), in ``loading``'s order: its
            loads write only those, and no other request's load of the step
            writes one of them (vLLM allocates a loading request fresh
            blocks), so a worker tells whose load a failed source block breaks.
        asynchronous: the loads are asynchronous (``receiving``).
    """

    step: int
    plan: StepPlan
    loading: tuple[str, ...] = ()
    targets: tuple[frozenset[int], ...] = ()
    asynchronous: bool = False

    @property
    def receiving(self) -> tuple[str, ...]:
        """Requests waiting for this step's loads (vLLM's ``WAITING_FOR_REMOTE_KVS``): each worker reports
        them in ``finished_recving`` once every load of the step completed there. Empty with synchronous loads."""
        return self.loading if self.asynchronous else ()


def _backend(stack: StackConfig) -> str:
    """The ``backend`` label of vLLM's ``vllm:simple_kv_offload_info``: ``cpu``, or the shared tier's store
    (``disk`` for a directory, else its URL scheme or class)."""
    if stack.shared is None:
        return "cpu"
    url = stack.shared.url
    if not isinstance(url, str):
        return type(url).__name__
    scheme = url.partition(":")[0]
    return "disk" if scheme == "file" else scheme


@attrs.frozen
class TierBlock:
    """One block a tier stored or removed, with what the scheduler knows of it.

    Attributes:
        block_hash: kvkit's hash of vLLM's block hash.
        parent: the hash before it in its request's chain (``None``: a first
            block, or not known).
        request: vLLM's request that computed it, or ``None`` where no
            running or recently ended request names the hash (a removal, or
            a block written back long after its request ended).
        index: the block's position in ``request`` (its tokens are
            ``[index * block_size, (index + 1) * block_size)``).
    """

    block_hash: BlockHash
    parent: BlockHash | None = None
    request: Any = None
    index: int = 0


@attrs.define
class TierRun:
    """Blocks one tier (``"cpu"`` or ``"shared"``) stored (``stored``) or removed, in the order it happened."""

    tier: str
    stored: bool
    blocks: list[TierBlock]


@attrs.define(eq=False)
class TierEvents(OffloadCallback):
    """The CPU and shared tiers' stores and removals since the last :meth:`take`, described from their requests.

    Stored: hashes that became findable on the CPU tier (a store landed on
    every worker, or a fetch from the shared tier did; a duplicate that lost
    to an equal hash is not), and hashes a put landed in the shared tier.
    Removed: every CPU eviction, and every CPU hash at a reset. The shared
    tier's removals (its server's eviction or expiry) are not observable.

    A stored block is described by the request that computed it (its
    tokens, LoRA, extra keys): every hash of a running request is known
    (:meth:`remember`), and those of ended requests for the latest
    ``keep_ended`` hashes (:meth:`ended`), long enough for their last stores
    to land; a block written back later is described by its hash and parent only.

    Invariants: a CPU hash is reported stored only once its copy is
    findable, and removed only after it was stored; runs keep the order
    things happened in; at most ``keep_ended`` hashes of ended requests are remembered.
    """

    keep_ended: int = 0
    _origins: dict[BlockHash, tuple[Any, int]] = attrs.field(init=False, factory=dict)  # hash -> (request, index)
    _ended: collections.deque[tuple[BlockHash, Any]] = attrs.field(init=False, factory=collections.deque)
    _runs: list[TierRun] = attrs.field(init=False, factory=list)

    def remember(self, request: Any, start: int = 0) -> None:
        """``request`` computes its blocks from position ``start`` on (call as its hashes become known)."""
        for i, h in enumerate(request.block_hashes[start:], start):
            self._origins[block_hash(h)] = (request, i)

    def ended(self, request: Any) -> None:
        """``request`` ended: its blocks stay described while they are among the latest ``keep_ended`` ended ones."""
        self._ended.extend((block_hash(h), request) for h in request.block_hashes)
        while len(self._ended) > self.keep_ended:
            h, r = self._ended.popleft()
            if self._origins.get(h, (None,))[0] is r:  # not a running request's since
                del self._origins[h]

    @override
    def on_cpu_stored(self, hashes: list[BlockHash], parents: list[BlockHash | None]) -> None:
        self._add("cpu", True, [self._describe(h, p) for h, p in zip(hashes, parents, strict=True)])

    @override
    def on_shared_stored(self, hashes: list[BlockHash]) -> None:
        self._add("shared", True, [self._describe(h, None) for h in hashes])

    @override
    def on_evict(self, tier: Tier, block: BlockId, block_hash: BlockHash) -> None:
        if tier is Tier.CPU:
            self._add("cpu", False, [TierBlock(block_hash)])

    def cleared(self, cpu: BlockAllocator) -> None:
        """A reset empties ``cpu``: everything it holds is removed (call before the reset)."""
        self._add("cpu", False, [TierBlock(h) for h in map(cpu.block_hash, map(BlockId, range(cpu.num_blocks)))
                                 if h is not None])

    def take(self) -> list[TierRun]:
        """The runs since the last call."""
        runs, self._runs = self._runs, []
        return runs

    def _describe(self, h: BlockHash, parent: BlockHash | None) -> TierBlock:
        request, index = self._origins.get(h, (None, 0))
        if parent is None and request is not None and index > 0:
            parent = block_hash(request.block_hashes[index - 1])
        return TierBlock(h, parent, request, index)

    def _add(self, tier: str, stored: bool, blocks: list[TierBlock]) -> None:
        if not blocks:
            return
        last = self._runs[-1] if self._runs else None
        if last is not None and last.tier == tier and last.stored is stored:
            last.blocks += blocks
        else:
            self._runs.append(TierRun(tier, stored, blocks))


@attrs.define(eq=False)
class SchedulerSide:
    """Drives an ``OffloadManager`` from vLLM's scheduler-side connector calls.

    Args:
        manager: built over vLLM's GPU pool (``gpu=``, references on every
            transfer's GPU blocks) with ``null_block=0``.
        tables: vLLM's current block table of a request, one list per KV
            group (``KVCacheManager.get_block_ids``); read when a request with
            a sliding-window group grows, because vLLM frees that group's
            blocks outside the window (null in its table) and may hand one
            back to the same request.
        events: the CPU and shared tiers' store and removal log (one of the
            manager's callbacks), or ``None`` when vLLM publishes no KV events.
        async_load: hits load while other requests run: a request with a hit
            waits in vLLM (``WAITING_FOR_REMOTE_KVS``) until the workers report
            it in ``finished_recving`` (and in ``failed_recving`` if its load failed).
        shared: the shared tier's connection (the manager's ``shared`` spec
            is its ``spec``), or ``None`` without one; :meth:`close` closes it.
        info: the values of vLLM's ``vllm:simple_kv_offload_info`` labels
            (``backend``, ``page_cache``, ``lazy_offload``, ``capacity_blocks``).

    Invariants:
        * The requests tracked are exactly those the manager has live.
        * Every request's confirmed blocks are those its last scheduled step
          completes, minus speculative tokens (which vLLM may reject): its
          computed count is told in the step a block completes (a count inside
          a block confirms nothing, so the steps between tell none).
        * A request's loaded-token counts (:data:`LOADED_TOKENS_KEY`) hold the
          tokens of its loads that landed or are in flight, never of one that failed.
    """

    manager: OffloadManager
    tables: Callable[[str], Sequence[Sequence[int]]]
    events: TierEvents | None = None
    async_load: bool = False
    shared: SharedConnection | None = None
    info: tuple[str, ...] = ()
    num_preemptions: int = attrs.field(init=False, default=0)
    _targets: dict[str, frozenset[int]] = attrs.field(init=False, factory=dict)  # loads allocated since the last
    # build: their StepOrder.targets
    _reported: dict[str, float] = attrs.field(init=False, factory=dict)
    _windowed: bool = attrs.field(init=False, default=attrs.Factory(
        lambda self: any(g.kind is GroupKind.SLIDING_WINDOW for g in self.manager.kv.groups), takes_self=True))
    _requests: dict[str, Any] = attrs.field(init=False, factory=dict)
    _loaded_tokens: dict[str, list[int]] = attrs.field(init=False, factory=dict)  # [first, resumed]
    _loading: dict[str, tuple[int, int]] = attrs.field(init=False, factory=dict)  # load in flight: (slot, tokens)
    _failed: set[str] = attrs.field(init=False, factory=set)  # async loads failed: offered nothing until allocated
    _flush_pending: bool = attrs.field(init=False, default=False)  # a request ended since the last build
    _step: int = attrs.field(init=False, default=0)
    _copies: dict[int, list[Any]] = attrs.field(init=False, factory=dict)  # tid -> [COPIES key, reports left]
    _copied: dict[str, list[tuple[int, float]]] = attrs.field(init=False, factory=lambda: {k: [] for k in COPIES})
    copy_totals: dict[str, list[float]] = attrs.field(init=False, factory=lambda: {k: [0, 0.0] for k in COPIES})
    """Per :data:`COPIES` key, ``[bytes, seconds]`` of every copy reported so far (all workers)."""

    @classmethod
    def from_settings(cls, settings: ConnectorSettings, gpu: BlockAllocator,
                      tables: Callable[[str], Sequence[Sequence[int]]], *, events: bool = False) -> SchedulerSide:
        """A manager over ``gpu`` and a CPU pool of ``settings.num_cpu_blocks`` blocks (no copy backend here,
        so the copy's ``options`` are the workers' alone).

        With ``events`` the tiers' stores and removals are logged for :meth:`take_events`.
        With a shared tier the manager looks up GPU -> CPU -> shared (every
        rank's key, one ``contains``) and plans fetches into CPU blocks and puts.
        """
        stack = settings.stack
        options = {slot: kwargs for slot, kwargs in stack.options.items() if slot != "copy"}
        parts = attrs.evolve(stack, copy=None, options=options).resolve()
        cpu = parts.allocator(num_blocks=parts.cpu_blocks, eviction=parts.cpu_eviction)
        log = TierEvents(keep_ended=parts.cpu_blocks) if events else None
        conn = None if (layout := settings.shared_layout) is None else connect_shared(stack, layout=layout)
        manager = OffloadManager(stack.kv, cpu, parts.store, gpu=gpu, world_size=stack.world_size,
                                 null_block=0, callbacks=(log,) if log is not None else (),
                                 shared=None if conn is None else conn.spec, planner=parts.planner)
        return cls(manager, tables, log, settings.async_load, conn,
                   info=(_backend(stack), "false", str(stack.store == "lazy").lower(), str(parts.cpu_blocks)))

    @property
    def idle(self) -> bool:
        """No request tracked, no transfer in flight or still to plan."""
        return not (self._requests or self.busy or self.manager.num_requests)

    @property
    def busy(self) -> bool:
        """Transfers are in flight or an ended request's flush is still to plan: vLLM must keep stepping."""
        return self._flush_pending or self.manager.num_in_flight > 0

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """CPU-tier tokens right after vLLM's own prefix hit worth loading (pinned until allocation).

        Nothing for a request whose asynchronous load failed, until vLLM allocated it again: vLLM recomputes it.
        """
        rid = request.request_id
        failed = rid in self._failed
        if rid not in self._requests:
            self.manager.add_request(rid, block_hashes(request.block_hashes),
                                     request.num_tokens)
            self._requests[rid] = request
            self._loaded_tokens[rid] = [0, 0]
            if self.events is not None:
                self.events.remember(request)
        else:
            if self.manager.request(rid).state is _RUNNING:  # preempted between steps, or its load failed
                if failed:  # vLLM dropped its blocks: a fresh incarnation of the same request, counted once
                    self.manager.preempt(rid, load_failed=True)
                else:
                    self._preempt(rid)
            self._sync(request)
        # A failed request is looked up all the same (the manager allocates only a looked-up request), offered 0.
        if not self.manager.lookup(rid, num_computed_tokens, num_tokens=request.num_tokens) or failed:
            return 0
        return self.manager.plan_load(rid, overlap=False).accepted_blocks * self.manager.kv.block_size

    def allocated(self, request: Any, block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks and accepted ``num_external_tokens`` of the hit."""
        rid = request.request_id
        if rid not in self._requests:  # vLLM admitted it without asking us: nothing to load
            return
        self.manager.on_allocated(rid, [list(row) for row in block_ids], num_external_tokens)
        self._failed.discard(rid)  # admitted without the hit of its failed load
        if num_external_tokens:
            slot = int(getattr(request, "num_preemptions", 0) > 0)
            self._loaded_tokens[rid][slot] += num_external_tokens
            self._loading[rid] = (slot, num_external_tokens)
            start = self.manager.request(rid).gpu_hit_blocks
            assert start is not None, "a request with a hit was looked up"
            hit = slice(start, start - (-num_external_tokens // self.manager.kv.block_size))
            self._targets[rid] = frozenset(b for row in block_ids for b in row[hit] if b != self.manager.null_block)

    def build(self, *, preempted: Iterable[str], new_blocks: Iterable[tuple[str, Sequence[Sequence[int]]]],
              scheduled: Mapping[str, int], speculative: Mapping[str, Sequence[int]] | None = None) -> StepOrder:
        """Plan one step: its loads, and the stores of every block it completes.

        Args:
            preempted: ids vLLM preempted since the last step.
            new_blocks: ``(id, blocks per group)`` appended to running (not
                resumed) requests.
            scheduled: tokens this step computes, per request id (vLLM's
                ``num_scheduled_tokens``; ``num_computed_tokens`` is not advanced yet).
            speculative: draft tokens among them, per id; never confirmed.

        The whole step holds the manager's drive lock (:mod:`kvkit.driving`), its per-request calls included.
        """
        with self.manager.drive_lock:
            return self._build(preempted, new_blocks, scheduled, speculative or {})

    def _build(self, preempted: Iterable[str], new_blocks: Iterable[tuple[str, Sequence[Sequence[int]]]],
               scheduled: Mapping[str, int], drafts: Mapping[str, Sequence[int]]) -> StepOrder:
        manager, requests, bs = self.manager, self._requests, self.manager.kv.block_size
        live = manager.request
        for rid in preempted:
            if rid in requests and live(rid).state is _RUNNING:
                self._preempt(rid)

        windowed = self._windowed  # vLLM nulls blocks that left the window: its whole table is told

        def retable(rid: str) -> None:
            manager.on_allocated(rid, [list(row) for row in self.tables(rid)])

        rows_of = dict(new_blocks)
        progress: list[Progress] = []
        for rid, n in scheduled.items():  # the per-request hot path: the manager's state looked up once each
            request = requests.get(rid)
            if request is None:
                continue
            r = live(rid)
            if r.state is not _RUNNING:
                continue
            rows = rows_of.pop(rid, None)
            if rows is not None and windowed:
                retable(rid)
                rows = None
            known, hashes = len(r.block_hashes), request.block_hashes
            fresh = None
            if len(hashes) > known:  # blocks filled (its length waits for its next lookup or its finish)
                fresh = block_hashes(hashes[known:])
                if self.events is not None:
                    self.events.remember(request, known)
            done: int | None = request.num_computed_tokens + n - len(drafts.get(rid, ()))
            if done // bs <= r.num_computed_tokens // bs:  # no block completes: the count confirms nothing
                done = None
            if rows is not None or fresh is not None or done is not None:
                progress.append((rid, rows, fresh, done))
        for rid, rows in rows_of.items():  # new blocks of a request not scheduled (vLLM sends none)
            if rid in requests and live(rid).state is _RUNNING:
                if windowed:
                    retable(rid)
                else:
                    progress.append((rid, rows, None, None))
        manager.advance(progress)
        self._step += 1
        self._flush_pending = False  # build_step plans every detached store
        order = StepOrder(self._step, self.manager.build_step(), tuple(self._targets),
                          tuple(self._targets.values()), self.async_load)
        world = self.manager.world_size
        self._copies.update((tid, ["load_copies", world]) for tid, _ in order.plan.loads)
        self._copies.update((tid, ["store_copies", world]) for tid, _ in order.plan.stores)
        self._targets.clear()  # their loads are this step's (allocation and build share one schedule call)
        return order

    def completed(self, results: Iterable[TransferResult], failed_loads: Iterable[str] = ()) -> None:
        """Apply the workers' transfer results (GPU and CPU references of finished copies drop).

        ``failed_loads``: requests a worker left out of its loads
        (a source block of theirs failed there) while the copies carrying them
        succeeded; they fail when their load completes (``OffloadManager.fail_load``),
        the other requests of the step load. A worker reports them with or
        before its results of that load. A request's failed load no longer
        counts in its loaded tokens; with asynchronous loads its next lookup
        offers nothing (:meth:`matched_tokens`).

        Each worker's successful GPU <-> CPU copy is listed under its
        :data:`COPIES` key for :meth:`stats_delta` and counted in :attr:`copy_totals`.
        """
        results = list(results)
        for rid in set(failed_loads):
            if rid in self._requests:  # one that ended meanwhile needs nothing
                self.manager.fail_load(rid)
        report = self.manager.apply_completions(results)
        for rid in report.loaded:
            self._loading.pop(rid, None)
        for rid in report.load_failed:
            slot, tokens = self._loading.pop(rid, (0, 0))
            if rid in self._loaded_tokens:
                self._loaded_tokens[rid][slot] -= tokens
            if self.async_load:
                self._failed.add(rid)
        for res in results:
            copy = self._copies.get(res.transfer_id)
            if copy is None:
                continue
            copy[1] -= 1
            if not copy[1]:
                del self._copies[res.transfer_id]
            if res.ok and res.seconds > 0:
                self._copied[copy[0]].append((res.num_bytes, res.seconds))
                total = self.copy_totals[copy[0]]
                total[0] += res.num_bytes
                total[1] += res.seconds

    def stats_delta(self) -> dict[str, Any]:
        """Since the last call: each counter's increase (those that moved), the :data:`COPIES` completed
        (those with any), and, if anything moved, :data:`GAUGES`."""
        now = self.manager.stats.as_dict()
        delta: dict[str, Any] = {k: now[k] - self._reported.get(k, 0) for k in COUNTERS
                                 if now[k] != self._reported.get(k, 0)}
        self._reported = now
        for key, copies in self._copied.items():
            if copies:
                delta[key] = copies
                self._copied[key] = []
        if delta:
            m, cpu = self.manager, self.manager.cpu
            delta |= {"gpu_blocks_held": sum(m.gpu_refs_held().values()),
                      "cpu_blocks_pinned": sum(m.cpu_refs_held().values()), "transfers_in_flight": m.num_in_flight,
                      "cpu_blocks": cpu.num_blocks, "cpu_blocks_used": cpu.num_blocks - cpu.num_free,
                      "cpu_blocks_storing": m.cpu_blocks_storing(), INFO_KEY: self.info}
        return delta

    def summary(self) -> str:
        """One line on what kvkit did so far: hits per tier, blocks moved, copy bandwidth, failures."""
        s = self.manager.stats
        copied, seconds = (sum(t[i] for t in self.copy_totals.values()) for i in (0, 1))
        gbps = f"{copied / seconds / 1e9:.2f} GB/s" if seconds else "n/a"
        return (f"kvkit: {plural(int(s.scheduled_requests), 'request', grouped=True)} over "
                f"{plural(int(s.query_tokens), 'token', grouped=True)}; hits GPU {s.gpu_hit_rate:.1%}, CPU "
                f"{s.cpu_hit_rate:.1%}, shared {s.shared_hit_rate:.1%}; CPU tier stored "
                f"{plural(int(s.blocks_stored), 'block', grouped=True)}, loaded {int(s.blocks_loaded):,}, evicted "
                f"{int(s.evictions_cpu):,}; copies {copied / 1e6:,.1f} MB at {gbps}; shared tier fetched "
                f"{int(s.blocks_fetched):,}, put {int(s.blocks_put):,}; failed transfers "
                f"{int(s.transfers_failed):,}, loads recomputed {int(s.loads_failed):,}")

    def take_events(self) -> list[TierRun]:
        """The tiers' runs of blocks stored and removed since the last call."""
        return self.events.take() if self.events is not None else []

    def finished(self, request: Any, block_ids: Sequence[Sequence[int]], *,
                 aborted: bool) -> tuple[bool, dict[str, int] | None]:
        """The request ended; returns (``False``: vLLM frees its blocks now, kv_transfer_params).

        ``block_ids`` is its table as vLLM leaves it: blocks vLLM already
        freed (out of a sliding window) are null there, so the flush never
        reads them.
        """
        rid = request.request_id
        if rid not in self._requests:
            return False, None
        r = self.manager.request(rid)
        rows = [list(v) for v in block_ids]
        if r.state is _RUNNING and any(v != own[:len(v)] for v, own in zip(rows, r.block_table)):
            # vLLM's rows (nulls out of a sliding window) may stop at its computed tokens: keep the rest of ours
            self.manager.on_allocated(rid, [[*v, *own[len(v):]] for v, own in zip(rows, r.block_table)])
        self._sync(request)
        delay = self.manager.abort(rid) if aborted else self.manager.finish(rid)
        assert not delay, "with vLLM's GPU pool the manager never delays a free"
        del self._requests[rid]
        if self.events is not None:
            self.events.ended(request)
        self._flush_pending = True
        self._loading.pop(rid, None)
        self._failed.discard(rid)
        first, resumed = self._loaded_tokens.pop(rid)
        return False, {LOADED_TOKENS_KEY: first, RELOADED_TOKENS_KEY: resumed}

    def reset(self) -> bool:
        """Empty the CPU tier (after in-flight copies drain); serves no hit from now on."""
        if self.events is not None:
            self.events.cleared(self.manager.cpu)
        self.manager.reset()
        return True

    def close(self) -> None:
        """Close the shared store if this side opened it (vLLM's ``shutdown``)."""
        if self.shared is not None and self.shared.owned:
            self.shared.store.close()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if this side or its manager is inconsistent."""
        self.manager.check_invariants()
        assert self.manager.num_requests == len(self._requests), (
            self.manager.num_requests, sorted(self._requests))
        for rid in self._requests:
            self.manager.request(rid)  # raises if the manager does not have it live
        assert self._loaded_tokens.keys() == self._requests.keys()
        assert self._loading.keys() <= self._requests.keys() and self._failed <= self._requests.keys()
        assert all(n >= 0 for counts in self._loaded_tokens.values() for n in counts)

    def _preempt(self, rid: str) -> None:
        self.manager.preempt(rid)
        self.num_preemptions += 1

    def _sync(self, request: Any) -> None:
        """Tell the manager about blocks that became full and the request's length; nothing when neither grew.
        A running request's length matters only to its next lookup (after a preemption) and its finish, which
        sync it first (each step tells its filled blocks alone)."""
        r = self.manager.request(request.request_id)
        known, hashes, num_tokens = len(r.block_hashes), request.block_hashes, request.num_tokens
        if len(hashes) == known and num_tokens <= r.num_tokens:
            return
        self.manager.extend(request.request_id, block_hashes(hashes[known:]), num_tokens)
        if self.events is not None and len(hashes) > known:
            self.events.remember(request, known)
