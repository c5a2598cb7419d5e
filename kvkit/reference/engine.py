"""A small reference engine loop that drives an ``OffloadStack`` the way a real engine does.

The simulator, the tests and the examples reuse it. Per :meth:`ReferenceEngine.step`:

1. apply the workers' completions (stores become findable, loads land),
   as again at the end of the step;
2. schedule waiting requests in arrival order: GPU prefix hit, then the
   manager's CPU lookup (pinned) and load plan (which hit blocks to load,
   which to recompute: :meth:`~kvkit.manager.OffloadManager.plan_load`), then
   GPU allocation, then ``on_allocated``; with a shared tier (and
   ``prefetch_waiting``), each request added since the last step that this
   step leaves waiting has its shared-tier hit prefetched into the CPU tier
   (:meth:`ReferenceEngine.prefetch`), so it is a CPU hit when it is scheduled;
3. run the manager's step plan on every worker, and wait for this step's
   loads (compute reads them; with ``layered`` compute waits for each layer
   instead, and the loads' results are awaited after it); a shared-tier
   fetch (a prefetch's too) is waited for at most until the store's
   deadline (then it is a miss, recomputed), a shared-tier put never. A
   plan with a *head* (hit blocks recomputed instead of loaded) overlaps:
   the step plan runs on a background thread while the compute writes each
   head, front to back, from the GPU hit alone; then the engine waits for
   the loads;
4. compute the scheduled prefills through the engine's
   :class:`~kvkit.interfaces.PrefillCompute`
   (by default :class:`SyntheticCompute`: write each block's KV as a
   deterministic function of its hash and check every loaded block's bytes;
   ``kvkit.integrations.hf`` runs a real model instead), publish the full
   blocks in the GPU prefix cache, and confirm progress to the manager.

A request's load fails alone when a block it reads failed to fetch from the
shared tier (missing, refused by its check, or not answered within the
worker's ``wait_timeout_s``, or a fetch that failed as a whole): each rank
runs the step's copies without that request's blocks and the engine tells
the manager (``OffloadManager.fail_load``), so the step's other requests keep
their hits and load them in the same copies; a block two requests read fails
both. A CPU->GPU copy that fails as a whole names no block, so it fails every
request it carries: whose bytes it landed is unknown. A request whose load
failed recomputes its whole hit after the head (never from its first failed
block: it was left out of the copies, or the copy failed, so none of its
loaded blocks can be trusted); the manager never stores what a failed load
wrote, and the recompute overwrites it before anything reads it. The others
compute on their loaded blocks, every one of them checked by the default
compute. :attr:`StepReport.load_failed` names the requests whose load failed.

Requests are prefill-only: the caller decides when one finishes (the
simulator models decode time); a caller that decoded tokens and holds their
KV may :meth:`~ReferenceEngine.extend` a running request by them, whose full
blocks are then cached and stored as a prompt's. With more than one KV group the GPU prefix
cache is off (hits come from the CPU tier only), which keeps the loop small.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import attrs
from typing_extensions import override

from kvkit.driving import DriveLock, driven
from kvkit.errors import OutOfBlocksError, RequestStateError, UnknownRequestError
from kvkit.interfaces import BlockHash, BlockId, Direction, HeadCompute, PrefillCompute, TransferResult
from kvkit.interfaces.hints import WorkloadHints
from kvkit.manager.step import StepPlan
from kvkit.stack import OffloadStack
from kvkit.validate import check_bool, checked, implements, plural

__all__ = ["EngineRequest", "PrefillCompute", "ReferenceEngine", "StepReport", "SyntheticCompute"]


@attrs.define(eq=False)
class EngineRequest:
    """The engine's side of one request.

    Attributes:
        request_id: unique id.
        block_hashes: chained hashes of the prompt's full blocks.
        num_tokens: prompt length in tokens.
        table: GPU block ids, one list per KV group (empty while waiting).
        gpu_hit_tokens: tokens served by the GPU prefix cache.
        head_tokens: hit tokens right after the GPU hit that the engine
            recomputes while the rest of the hit loads (a load plan's head).
        cpu_hit_tokens: tokens loaded from the CPU tier (shared-tier hits
            included), right after the head.
        prefetched: the block positions whose shared-tier hit
            :meth:`ReferenceEngine.prefetch` fetched while it waited (``None``:
            never prefetched).
    """

    request_id: str
    block_hashes: list[BlockHash]
    num_tokens: int
    table: list[list[BlockId]] = attrs.field(factory=list)
    gpu_hit_tokens: int = 0
    head_tokens: int = 0
    cpu_hit_tokens: int = 0
    prefetched: range | None = None

    @property
    def running(self) -> bool:
        """Whether the request holds GPU blocks."""
        return bool(self.table)


@attrs.frozen
class StepReport:
    """What one step did: requests it prefilled, data errors it found, and the requests among ``scheduled``
    whose load failed (each recomputed its whole hit after its head; a load's other requests kept theirs)."""

    scheduled: tuple[EngineRequest, ...] = ()
    integrity_errors: int = 0
    load_failed: frozenset[str] = frozenset()


@attrs.define(eq=False)
class SyntheticCompute(HeadCompute):
    """Writes each block's KV as a deterministic function of its content and checks loaded blocks.

    The stand-in for a model in tests and the simulator: a reused block whose
    bytes differ from what was written for its hash counts as an integrity error.
    """

    @override
    def prefill(self, engine: ReferenceEngine, request: EngineRequest, first_block: int) -> int:
        """Check blocks from the GPU-hit boundary to ``first_block``, then write the rest."""
        bs = engine.stack.config.kv.block_size
        errors = self._verify(engine, request, request.gpu_hit_tokens // bs, first_block)
        self._write(engine, request, first_block)
        return errors

    @override
    def prefill_head(self, engine: ReferenceEngine, request: EngineRequest, start: int, stop: int) -> None:
        """Write blocks ``[start, stop)``."""
        self._write(engine, request, start, stop)

    @staticmethod
    def _write(engine: ReferenceEngine, req: EngineRequest, first: int, stop: int | None = None) -> None:
        """Write the KV of blocks ``first..stop`` (the recomputed ones) on every worker."""
        for g, row in enumerate(req.table):
            blocks = row[first:stop]
            keys = [_key(req, i) for i in range(first, first + len(blocks))]
            for worker in engine.stack.workers:
                _fill(worker, g, blocks, keys)

    @staticmethod
    def _verify(engine: ReferenceEngine, req: EngineRequest, start: int, stop: int) -> int:
        """Count loaded blocks ``start..stop`` whose bytes differ from what was written for them."""
        errors = 0
        kv = engine.stack.config.kv
        for g, row in enumerate(req.table):
            lo = max(start, stop - kv.groups[g].blocks_needed(stop * kv.block_size, kv.block_size))
            blocks = row[lo:stop]
            keys = [_key(req, i) for i in range(lo, stop)]
            for layer in kv.groups[g].layers:  # layered loads: read each layer once it landed
                engine.wait_layer(layer)
            for worker in engine.stack.workers:
                errors += _mismatches(worker, g, blocks, keys)
        return errors


@attrs.define(eq=False)
class ReferenceEngine:
    """Drives ``stack`` like an engine's scheduler and workers (see the module docstring).

    Args:
        stack: the offload stack; with workers it moves real bytes.
        compute: writes the recomputed KV of each scheduled prefill (only
            with workers); the default writes and verifies synthetic bytes.
        layered: the step's loads run layer by layer and compute starts
            before they landed: the compute calls :meth:`wait_layer` before it
            reads a layer's reused blocks. The loads' results are awaited after
            compute, before anything is published or confirmed; a request whose
            load failed is computed again without its CPU hit.
        prefetch_waiting: with a shared tier, prefetch the shared-tier hit of
            every request a step leaves waiting (once, in the step after it was
            added; default on). Off, only :meth:`prefetch` does.

    Load plans with a head (:attr:`overlaps`) need a :class:`~kvkit.interfaces.HeadCompute`,
    and no ``layered`` unless the stack has a shared tier (with one, a step's
    loads are never layered: it fetches into the CPU tier, then loads whole);
    otherwise the engine asks the manager for plans that load a prefix of the
    hit only.

    Invariants: a request holds exactly one GPU reference on each block of
    its table while running; with the default compute every loaded block's
    bytes are checked; no block is published or confirmed computed before
    the loads it was computed from landed.
    """

    stack: OffloadStack
    integrity_errors: int = 0
    compute: PrefillCompute = attrs.field(factory=SyntheticCompute, kw_only=True, validator=implements(
        PrefillCompute, what="a PrefillCompute (with a prefill method)"))
    layered: bool = attrs.field(default=False, kw_only=True, converter=checked(check_bool),  # type: ignore[misc]
                                on_setattr=attrs.setters.convert)
    prefetch_waiting: bool = attrs.field(default=True, kw_only=True, converter=checked(check_bool),  # type: ignore[misc]
                                         on_setattr=attrs.setters.convert)
    _step_loads: set[int] = attrs.field(factory=set, init=False)  # layered loads compute may still wait for
    _beside: bool = attrs.field(default=False, init=False)  # heads computing while the step's loads run
    _arrived: list[EngineRequest] = attrs.field(factory=list, init=False)  # added since the last step
    _waiting: deque[EngineRequest] = attrs.field(factory=deque, init=False)
    _requests: dict[str, EngineRequest] = attrs.field(factory=dict, init=False)

    @property
    def drive_lock(self) -> DriveLock:
        """The stack's drive lock (:meth:`OffloadStack.driving`): each call that drives the stack holds it throughout,
        so the stack's ``close`` from another thread waits for a step to end, and a call after it raises
        ``RequestStateError``."""
        return self.stack.driving()

    @property
    def overlaps(self) -> bool:
        """Whether a hit's head can be recomputed while its tail loads (see the class docstring)."""
        return isinstance(self.compute, HeadCompute) and (not self.layered or bool(self.stack.shared_workers))

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled."""
        return len(self._waiting)

    @property
    def running(self) -> list[EngineRequest]:
        """Requests that hold GPU blocks."""
        return [r for r in self._requests.values() if r.running]

    @driven
    def add_request(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int,
                    hints: WorkloadHints | None = None) -> None:
        """Queue a prefill of ``num_tokens`` tokens whose full blocks hash to ``block_hashes``.

        ``hints`` reach the CPU tier's policy as in :meth:`OffloadManager.add_request
        <kvkit.manager.OffloadManager.add_request>`; a refused add queues nothing.
        """
        if request_id in self._requests:
            raise RequestStateError(f"request {request_id!r} is already in the engine")
        kv = self.stack.config.kv
        need = -(-num_tokens // kv.block_size) * len(kv.groups)
        if need > self.stack.gpu.num_blocks:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {plural(need, 'GPU block')} ({plural(num_tokens, 'token')}), more than "
                f"the whole GPU pool of {self.stack.gpu.num_blocks}")
        self.stack.manager.add_request(request_id, block_hashes, num_tokens, hints=hints)
        req = EngineRequest(request_id, list(block_hashes), num_tokens)
        self._requests[request_id] = req
        self._waiting.append(req)
        if self.prefetch_waiting and self.stack.manager.shared is not None:
            self._arrived.append(req)

    @driven
    def step(self) -> StepReport:
        """Run one engine step (see the module docstring)."""
        self._apply(self._poll())
        scheduled = self._schedule()
        arrived, self._arrived = self._arrived, []
        for req in arrived:
            if req.prefetched is None and not req.running and self._requests.get(req.request_id) is req:
                self.prefetch(req.request_id)
        plan = self.stack.manager.build_step()
        heads = [r for r in scheduled if r.head_tokens] if self.stack.workers else []
        targets = self._targets(scheduled) if self.stack.shared_workers and plan.loads else {}  # only a rank reads them
        if heads and (plan.loads or plan.fetches):
            with ThreadPoolExecutor(1, thread_name_prefix="kvkit-loads") as pool:
                submitted = pool.submit(self._run_loads, plan, targets)  # the loads run while the heads compute
                self._beside = True
                try:
                    self._compute_heads(heads)
                finally:
                    self._beside = False
                    left_out = submitted.result()
        else:
            left_out = self._submit(plan, targets)
            self._compute_heads(heads)
        for rid in sorted(left_out):  # before any result of the step's load is applied
            self.stack.manager.fail_load(rid)
        errors, failed = self._compute(scheduled, plan)
        self._apply(self._poll())  # copies that already finished count from now on
        return StepReport(tuple(scheduled), errors, failed)

    @driven
    def extend(self, request_id: str, new_hashes: Sequence[BlockHash], num_tokens: int,
               write: Callable[[EngineRequest, int], None]) -> None:
        """A running request grew to ``num_tokens`` tokens (decoded), ``new_hashes`` its new full blocks' hashes.

        Its table grows by the GPU blocks the new tokens need (told to the
        manager with ``new_hashes``), ``write(request, start)`` writes the KV
        of tokens ``start..num_tokens`` into the table, then the new full
        blocks are published on the GPU tier (one KV group) and confirmed to
        the manager, whose store policy takes them as it takes a prompt's
        (the partial last block, unhashed, is never stored). If the GPU pool
        lacks free blocks once finished transfers are applied, nothing changes.

        Raises:
            RequestStateError: the request is not running, ``num_tokens`` is
                below its tokens, or ``new_hashes`` are not the hashes of the
                full blocks ``num_tokens`` adds.
            OutOfBlocksError: the GPU pool has too few free blocks (nothing changed).
        """
        req = self._requests.get(request_id)
        if req is None or not req.running:
            raise RequestStateError(f"request {request_id!r} is not running; only a running request can be extended")
        bs, groups = self.stack.config.kv.block_size, len(self.stack.config.kv.groups)
        if num_tokens < req.num_tokens or len(req.block_hashes) + len(new_hashes) != num_tokens // bs:
            added = plural(len(new_hashes), "new hash", "new hashes")
            raise RequestStateError(
                f"request {request_id!r}: num_tokens={num_tokens!r} with {added}; it holds "
                f"{plural(req.num_tokens, 'token')} and {plural(len(req.block_hashes), 'full block')}")
        need = -(-num_tokens // bs) - len(req.table[0])
        if self.stack.gpu.num_free < need * groups:
            self.drain()  # stores in flight hold blocks of finished requests
            if self.stack.gpu.num_free < need * groups:
                raise OutOfBlocksError(f"request {request_id!r} needs {plural(need * groups, 'more GPU block')} for "
                                       f"{plural(num_tokens, 'token')}, {self.stack.gpu.num_free} free")
        new = self.stack.gpu.allocate(need * groups)
        rows = [new[g * need:(g + 1) * need] for g in range(groups)]
        for row, more in zip(req.table, rows, strict=True):
            row.extend(more)
        manager = self.stack.manager
        manager.append_blocks(request_id, rows)
        manager.extend(request_id, new_hashes, num_tokens)
        start, published = req.num_tokens, len(req.block_hashes)
        req.block_hashes.extend(new_hashes)
        req.num_tokens = num_tokens
        write(req, start)
        if groups == 1:
            hi = len(req.block_hashes)
            parents = [req.block_hashes[i - 1] if i else None for i in range(published, hi)]
            self.stack.gpu.commit(req.table[0][published:hi], req.block_hashes[published:hi], parents)
        manager.on_computed(request_id, num_tokens)

    @driven
    def prefetch(self, request_id: str) -> int:
        """Prefetch a waiting request's shared-tier hit beyond its GPU hit into the CPU tier (in the next step).

        See :meth:`OffloadManager.prefetch <kvkit.manager.OffloadManager.prefetch>`;
        the positions go to the request's ``prefetched``.

        Returns:
            Tokens whose fetch the next step runs.

        Raises:
            UnknownRequestError: an unknown request.
            RequestStateError: a running request (nothing changed).
        """
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(f"unknown request {request_id!r}")
        if req.running:
            raise RequestStateError(f"request {request_id!r} is running; only a waiting request is prefetched")
        stack, bs = self.stack, self.stack.config.kv.block_size
        hit = stack.gpu.lookup(req.block_hashes[: (req.num_tokens - 1) // bs]) if len(stack.config.kv.groups) == 1 \
            else []
        tokens = stack.manager.prefetch(request_id, len(hit) * bs)
        start = stack.manager.request(request_id).prefetch_start if tokens else 0
        req.prefetched = range(start, start + tokens // bs)
        return tokens

    @driven
    def finish(self, request_id: str) -> None:
        """The request is done: flush its stores, release its GPU blocks."""
        req = self._take(request_id)
        self.stack.manager.finish(request_id)
        self._release(req)

    @driven
    def abort(self, request_id: str) -> None:
        """Drop the request, waiting or running, without the finish flush."""
        req = self._take(request_id)
        self.stack.manager.abort(request_id)
        self._release(req)

    @driven
    def preempt(self, request_id: str) -> None:
        """Free a running request's GPU blocks and put it back at the head of the queue."""
        req = self._requests.get(request_id)
        if req is None or not req.running:
            raise RequestStateError(f"request {request_id!r} is not running; only a running request can be preempted")
        self.stack.manager.preempt(request_id)
        self._release(req)
        req.gpu_hit_tokens = req.head_tokens = req.cpu_hit_tokens = 0
        self._waiting.appendleft(req)

    @driven
    def reset_cpu_tier(self) -> None:
        """Empty the CPU tier now, even with transfers in flight (no hit is served after this)."""
        self.stack.manager.reset()

    @property
    def beside_loads(self) -> bool:
        """Whether the compute running now runs beside the step's loads and fetches (a plan's heads)."""
        return self._beside

    @property
    def layered_loads(self) -> bool:
        """Whether the compute running now waits on this step's loads layer by layer (its time includes theirs)."""
        return bool(self._step_loads)

    def wait_layer(self, layer: int) -> None:
        """Before compute reads ``layer``'s reused blocks: this step's loads of it landed (on the device if it can)."""
        if self._step_loads:
            for worker in self.stack.workers:
                worker.wait_layer(layer, transfers=self._step_loads)

    @driven
    def drain(self) -> None:
        """Wait for every transfer in flight and apply the results."""
        self._apply(self._drain())

    def leaked_blocks(self) -> int:
        """Blocks still referenced in either pool although no request runs and nothing is in flight."""
        gpu, cpu = self.stack.gpu, self.stack.cpu
        held = sum(1 for b in map(BlockId, range(gpu.num_blocks)) if gpu.refcount(b))
        held += sum(1 for b in map(BlockId, range(cpu.num_blocks)) if cpu.refcount(b))
        return held - sum(sum(map(len, r.table)) for r in self.running)

    # -- internals ------------------------------------------------------------

    def _take(self, request_id: str) -> EngineRequest:
        req = self._requests.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(f"unknown request {request_id!r}")
        if not req.running:
            self._waiting.remove(req)
        return req

    def _release(self, req: EngineRequest) -> None:
        for row in req.table:
            self.stack.gpu.decref(row)
        req.table = []

    def _schedule(self) -> list[EngineRequest]:
        """Admit waiting requests in order until the GPU pool is full."""
        scheduled = []
        while self._waiting:
            req = self._waiting[0]
            if not self._admit(req):
                break
            self._waiting.popleft()
            scheduled.append(req)
        return scheduled

    def _admit(self, req: EngineRequest) -> bool:
        stack, bs = self.stack, self.stack.config.kv.block_size
        groups = len(stack.config.kv.groups)
        hit: list[BlockId] = []
        if groups == 1:  # at least one token is always recomputed
            hit = stack.gpu.lookup(req.block_hashes[: (req.num_tokens - 1) // bs])
        stack.gpu.incref(hit)  # held before anything below can evict it
        total = -(-req.num_tokens // bs)
        need = total - len(hit)
        if stack.gpu.num_free < need + (groups - 1) * total:
            stack.gpu.decref(hit)  # refused before the CPU lookup pins (and touches) anything
            return False
        head = accepted = stack.manager.lookup(req.request_id, len(hit) * bs)
        if accepted:  # a plan that loads nothing is one forward pass over everything after the GPU hit
            plan = stack.manager.plan_load(req.request_id, overlap=self.overlaps)
            head, accepted = (plan.compute_blocks * bs, plan.accepted_blocks * bs) if plan.load_blocks else (0, 0)
        new = stack.gpu.allocate(need + (groups - 1) * total)
        stack.gpu.touch(hit)
        table = [hit + new[:need]]
        table += [new[need + g * total: need + (g + 1) * total] for g in range(groups - 1)]
        req.table = table
        req.gpu_hit_tokens, req.head_tokens, req.cpu_hit_tokens = len(hit) * bs, head, accepted - head
        stack.manager.on_allocated(req.request_id, table, accepted, recompute_tokens=head)
        return True

    def _compute_heads(self, heads: list[EngineRequest]) -> None:
        """Write each request's head (hit blocks recomputed instead of loaded), front to back."""
        if not heads:
            return
        compute, kv = self.compute, self.stack.config.kv
        assert isinstance(compute, HeadCompute) and kv is not None  # heads are planned only with one
        bs = kv.block_size
        for req in heads:
            start = req.gpu_hit_tokens // bs
            compute.prefill_head(self, req, start, start + req.head_tokens // bs)

    def _targets(self, scheduled: list[EngineRequest]) -> dict[str, frozenset[int]]:
        """Each scheduled request's GPU blocks that its CPU hit is loaded into (every KV group's)."""
        bs = self.stack.config.kv.block_size
        out: dict[str, frozenset[int]] = {}
        for req in scheduled:
            if req.cpu_hit_tokens:
                lo = (req.gpu_hit_tokens + req.head_tokens) // bs
                out[req.request_id] = frozenset(b for row in req.table for b in row[lo:lo + req.cpu_hit_tokens // bs])
        return out

    def _submit(self, plan: StepPlan, targets: dict[str, frozenset[int]]) -> set[str]:
        """Run ``plan`` on every worker; the requests a rank left out of the loads (a block they read failed to
        fetch there: :meth:`SharedTierWorker.submit <kvkit.shared.worker.SharedTierWorker.submit>`)."""
        left_out: set[str] = set()
        if self.stack.shared_workers:  # each rank runs its fetches, copies and puts in order
            started = [shared.start_fetches(plan.fetches) for shared in self.stack.shared_workers]
            for shared, fetches in zip(self.stack.shared_workers, started):  # every rank's fetches share a deadline
                left_out |= shared.submit(plan, fetches, targets)
            return left_out
        for tid, p in plan:
            for worker in self.stack.workers:
                worker.submit(tid, p, layered=self.layered and p.direction is Direction.LOAD)
        return left_out

    def _run_loads(self, plan: StepPlan, targets: dict[str, frozenset[int]]) -> set[str]:
        """Submit ``plan`` and wait for its loads on this thread, so their completion times are their own; as
        :meth:`_submit`."""
        left_out = self._submit(plan, targets)
        loads = {tid for tid, _ in plan.loads}
        for worker in self.stack.workers:
            worker.wait(loads)
        return left_out

    def _poll(self) -> list[TransferResult]:
        return [r for w in (self.stack.shared_workers or self.stack.workers) for r in w.poll()]

    def _drain(self) -> list[TransferResult]:
        return [r for w in (self.stack.shared_workers or self.stack.workers) for r in w.drain()]

    def _wait_loads(self) -> list[TransferResult]:
        """Every copy of the step landed (the loads compute reads); the shared store's puts are not waited for."""
        if self.stack.shared_workers:
            return [r for w in self.stack.shared_workers for r in w.drain_copies()]
        return [r for w in self.stack.workers for r in w.drain()]

    def _apply(self, results: list[TransferResult]) -> frozenset[str]:
        """Hand results to the manager; returns requests whose load failed (to recompute)."""
        return self.stack.manager.apply_completions(results).load_failed

    def _compute(self, scheduled: list[EngineRequest], plan: StepPlan) -> tuple[int, frozenset[str]]:
        """Compute the scheduled prefills (a request whose load failed without its CPU hit) and confirm them;
        the integrity errors found and the scheduled requests whose load failed."""
        stack, bs = self.stack, self.stack.config.kv.block_size
        failed: frozenset[str] = frozenset()
        layered = self.layered and bool(plan.loads) and bool(stack.workers) and not stack.shared_workers
        if layered:  # compute waits per layer; the results come after it
            self._step_loads = {tid for tid, _ in plan.loads}
        elif plan.loads:  # compute reads the loaded blocks: wait for them
            failed = self._apply(self._wait_loads() if stack.workers or stack.shared_workers
                                 else _instant(plan, stack))
        if not stack.workers and not stack.shared_workers and plan.stores:
            self._apply(_instant(plan, stack, Direction.STORE))
        found: dict[str, int] = {}  # integrity errors per request
        if stack.workers:
            for req in scheduled:
                if req.request_id in failed:  # the CPU hit never arrived: recompute it
                    req.cpu_hit_tokens = 0
                first = (req.gpu_hit_tokens + req.head_tokens + req.cpu_hit_tokens) // bs
                found[req.request_id] = self.compute.prefill(self, req, first)
        if layered:
            for worker in stack.workers:
                worker.wait(self._step_loads)
            self._step_loads = set()
            failed |= self._apply(self._poll())
            for req in scheduled:
                if req.request_id in failed:  # computed on a load that failed: discard it, compute without the hit
                    req.cpu_hit_tokens = 0
                    found[req.request_id] = self.compute.prefill(self, req, (req.gpu_hit_tokens
                                                                             + req.head_tokens) // bs)
        errors = sum(found.values())
        for req in scheduled:
            if len(stack.config.kv.groups) == 1:  # publish the new full blocks on the GPU tier
                lo, hi = req.gpu_hit_tokens // bs, req.num_tokens // bs
                parents = [req.block_hashes[i - 1] if i else None for i in range(lo, hi)]
                stack.gpu.commit(req.table[0][lo:hi], req.block_hashes[lo:hi], parents)
        stack.manager.advance([(req.request_id, None, None, req.num_tokens) for req in scheduled])
        self.integrity_errors += errors
        return errors, frozenset(r.request_id for r in scheduled if r.request_id in failed)


def _key(req: EngineRequest, index: int) -> int:
    """The content key of block ``index``: its hash (a partial last block is unique to the request)."""
    if index < len(req.block_hashes):
        return int(req.block_hashes[index])
    return hash((req.request_id, index))


def _pattern(keys: Sequence[int], region: int, piece_bytes: int):
    """Deterministic bytes ``[len(keys), piece_bytes]`` for blocks with content ``keys``."""
    import torch

    k = torch.tensor([key % (1 << 61) for key in keys], dtype=torch.int64)
    pos = torch.arange(piece_bytes, dtype=torch.int64)
    mixed = k[:, None] * 0x9E3779B1 + pos[None, :] * 0x85EBCA77 + region * 0xC2B2AE3D
    return ((mixed ^ (mixed >> 29)) & 0xFF).to(torch.uint8)


def _group_regions(worker, group: int):
    return [(i, r) for i, r in enumerate(worker.regions) if r.group == group]


def _fill(worker, group: int, blocks: Sequence[int], keys: Sequence[int]) -> None:
    import torch

    if not blocks:
        return
    idx = torch.tensor(list(blocks), dtype=torch.int64)
    for i, region in _group_regions(worker, group):
        view = region.gpu.view(region.gpu.shape[0], -1).view(torch.uint8)
        view[idx.to(view.device)] = _pattern(keys, i, region.piece_bytes).to(view.device)


def _mismatches(worker, group: int, blocks: Sequence[int], keys: Sequence[int]) -> int:
    import torch

    if not blocks:
        return 0
    idx = torch.tensor(list(blocks), dtype=torch.int64)
    bad = torch.zeros(len(blocks), dtype=torch.bool)
    for i, region in _group_regions(worker, group):
        view = region.gpu.view(region.gpu.shape[0], -1).view(torch.uint8)
        got = view[idx.to(view.device)].cpu()
        bad |= (got != _pattern(keys, i, region.piece_bytes)).any(dim=1)
    return int(bad.sum())


def _instant(plan: StepPlan, stack: OffloadStack,
             direction: Direction = Direction.LOAD) -> list[TransferResult]:
    """Results of a scheduler-only stack: every transfer completes on every worker at once."""
    kv = stack.config.kv
    return [TransferResult(tid, rank, num_bytes=len(p) * kv.kv_parts * len(kv.groups[p.group].layers)
                           * kv.bytes_per_layer_block)
            for tid, p in (plan.loads if direction is Direction.LOAD else plan.stores)
            for rank in range(stack.config.world_size)]
