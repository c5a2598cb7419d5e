"""Model-based test of ``OffloadManager`` driven by a fake engine and fake workers.

The machine owns real GPU and CPU ``BlockPool``s and a fake engine: requests
with shared prefixes and cache salts, GPU prefix hits, lookups, partial
acceptance, chunked prefill, decode, finish, abort, preemption and resets at
random moments. Each of ``WORLD`` workers keeps a "content" value per GPU and
CPU block (the hash whose KV the block holds): compute writes it, a worker
copies it when it *executes* a plan (any time between ``build_step`` and its
report), and results reach the manager late, out of order, duplicated and per
worker. After every rule the invariants (docs/guarantees.md) that apply at this level are
checked against the model; the planted-bug tests at the end prove the checks
catch each failure mode known in the field without the manager's own self-check.

Variants: the eager machine (the manager holds GPU references), the same as an
external engine (no GPU pool: finish/abort delay the free until released, and
a preemption makes the workers finish what touches the freed blocks), and
selective, lazy (write-back) and never store policies.
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter

import attrs
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvkit.backends.allocator import BlockPool
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.backends.eviction.hinted import HintedPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.store import EagerStore, LazyStore, NeverStore, SelectiveStore
from kvkit.errors import KVKitError, OutOfBlocksError
from kvkit.hashing import hash_blocks
from kvkit.interfaces import Direction, KVCacheSpec, TransferResult
from kvkit.interfaces.hints import WorkloadHints
from kvkit.manager import OffloadManager
from kvkit.shared.scheduler import SharedTier, SharedTierSpec
from kvkit.testing.doubles import FailingStore, RaisingCallback
from kvkit.testing.hostile import BAD_CALLS, snapshot

BS = 4  # tokens per block
NUM_GPU, NUM_CPU = 12, 8
WORLD = 2  # workers (tensor-parallel ranks)
MAX_TOKENS = 8 * BS  # prompt plus decode, per request
MAX_LIVE = 5
SALTS = ("a", "b")
BASE = [[f * 1000 + t for t in range(MAX_TOKENS)] for f in range(3)]  # shared prefixes


@attrs.define(eq=False)
class EngineRequest:
    """The fake engine's view of one request."""

    rid: str
    salt: str
    tokens: list[int]
    hashes: list[int] = attrs.field(factory=list)
    running: bool = False
    inc: int = 0  # incarnation: bumped by preemption
    looked_up: bool = False
    hit_blocks: list[int] = attrs.field(factory=list)  # GPU hit held from lookup to allocation
    hit_n: int = 0  # GPU-hit blocks at allocation: the first CPU-hit position
    pins: list[int] = attrs.field(factory=list)  # CPU blocks the manager must hold for it
    load_pending: bool = False  # accepted, not yet in a plan
    revoked: bool = False  # a reset withdrew the offered hit
    awaiting_load: bool = False
    accepted: int = 0  # CPU-hit blocks accepted
    table: list[int] = attrs.field(factory=list)
    computed: int = 0  # tokens whose KV is on the GPU
    confirmed: int = 0  # blocks reported confirmed to the manager
    committed: int = 0  # blocks offered to the GPU prefix cache
    epoch: int = 0
    gpu_cache: bool = True  # the engine offers its blocks to the GPU prefix cache

    def add_tokens(self, tokens: list[int]) -> list[int]:
        """Append tokens; returns the hashes of blocks they completed."""
        self.tokens += tokens
        new = []
        while (len(self.hashes) + 1) * BS <= len(self.tokens):
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else None
            (h,) = hash_blocks(self.tokens[i * BS:(i + 1) * BS], BS, parent=parent,
                               extra_keys=(self.salt,))
            self.hashes.append(h)
            new.append(h)
        return new

    @property
    def pin_start(self) -> int:
        """Position of the first pinned CPU block in the request."""
        return self.hit_n if self.running else len(self.hit_blocks)


@attrs.define(eq=False)
class ModelTransfer:
    """One planned transfer as the fake workers see it."""

    tid: int
    direction: Direction
    src: list[int]
    dst: list[int]
    hashes: list[int]  # store: the hash each source held at plan time
    loads: list[tuple[str, int]]  # load: (request id, incarnation) served
    left_out: set[tuple[str, int]] = attrs.field(factory=set)  # load: those a worker left out (fail_load)
    executed: set[int] = attrs.field(factory=set)
    written: dict[int, dict[int, int]] = attrs.field(factory=dict)  # worker -> {dst: write serial}
    reported: set[int] = attrs.field(factory=set)
    delivered: set[int] = attrs.field(factory=set)
    ok: bool = True
    abandoned: bool = False


class ManagerMachine(RuleBasedStateMachine):
    """Drives an ``OffloadManager`` (GPU pool given, two workers) against a model."""

    manager_cls = OffloadManager
    check_manager = True  # also run the manager's own check_invariants()
    write_through = True  # eager: every confirmed block must be stored (or on CPU), the flush's too
    own_gpu = True  # the manager gets the GPU pool (else: an external engine, delayed free)

    @staticmethod
    def make_store():
        return EagerStore(flush_limit=None)  # the whole flush: the most stores a finish can owe

    @staticmethod
    def make_callbacks():
        return ()

    @staticmethod
    def make_cpu_eviction():
        return LRUPolicy()

    def __init__(self) -> None:
        super().__init__()
        self.spec = KVCacheSpec(num_layers=1, block_size=BS, num_kv_heads=1, head_dim=2)
        self.gpu = BlockPool(NUM_GPU, eviction=LRUPolicy())
        self.cpu = BlockPool(NUM_CPU, eviction=self.make_cpu_eviction())
        self.store = self.make_store()
        self.mgr = self.manager_cls(self.spec, self.cpu, self.store,
                                    gpu=self.gpu if self.own_gpu else None, world_size=WORLD,
                                    num_gpu_blocks=NUM_GPU, callbacks=self.make_callbacks())
        self.delayed: dict[str, list[int]] = {}  # finished ids whose blocks the engine keeps
        self.gpu_content: list[dict] = [{} for _ in range(WORLD)]
        self.cpu_content: list[dict] = [{} for _ in range(WORLD)]
        # Every write to a block's content gets a serial: a copy that fails after it ran
        # leaves garbage only where nothing wrote since (a block the engine reused after
        # the workers finished the copy holds its new owner's KV).
        self.serial: dict[tuple[int, int], int] = {}  # (id of the content dict, block) -> serial
        self.next_serial = 0
        self.store_epoch: dict[int, int] = {}  # CPU block -> epoch of the store that filled it
        self.reqs: dict[str, EngineRequest] = {}
        self.next_rid = 0
        self.next_token = 100_000
        self.epoch = 0
        self.draining = False
        self.transfers: dict[int, ModelTransfer] = {}
        self.outbox: list[TransferResult] = []
        self.pending_fail: set[str] = set()
        self.must_store: dict[int, set[str]] = {}  # hash owed to the CPU tier -> owing requests
        self.evicted_in_build: set[int] = set()
        self.cpu.add_evict_listener(lambda blocks, hashes: self.evicted_in_build.update(hashes))

    # -- helpers -------------------------------------------------------------

    def _pick(self, i: int, pred) -> EngineRequest | None:
        live = [r for r in self.reqs.values() if pred(r)]
        return live[i % len(live)] if live else None

    def _put(self, content: dict, block: int, value: object) -> int:
        content[block] = value
        self.next_serial += 1
        self.serial[(id(content), block)] = self.next_serial
        return self.next_serial

    def _write(self, block: int, value: object) -> None:
        for w in range(WORLD):
            self._put(self.gpu_content[w], block, value)

    def _check_kv(self, r: EngineRequest, first: int, stop: int) -> None:
        """The GPU blocks at positions ``[first, stop)`` hold the request's KV on every worker."""
        for p in range(first, stop):
            for w in range(WORLD):
                got = self.gpu_content[w].get(r.table[p])
                assert got == r.hashes[p], (
                    f"{r.rid} block {p} (GPU {r.table[p]}) on worker {w} holds {got!r}, "
                    f"expected {r.hashes[p]!r}")

    def _engine_free(self, r: EngineRequest, delay: bool, preempted: bool = False) -> None:
        """The engine gives up the request's GPU blocks, now or (delayed free) once released."""
        held = r.table if r.running else r.hit_blocks
        assert not (delay and self.own_gpu), "the manager holds its own GPU refs: never delay"
        if delay and preempted:  # the workers finish what touches the blocks first
            for t in self.transfers.values():
                for w in range(WORLD):
                    if w not in t.executed and w not in t.reported:
                        self._execute(t, w)
        if delay and not preempted:
            self.delayed[r.rid] = held
        elif held:
            self.gpu.decref(held)
        r.table, r.hit_blocks, r.pins, r.running = [], [], [], False
        r.looked_up = r.load_pending = r.awaiting_load = False
        self.pending_fail.discard(r.rid)

    def _compute(self, r: EngineRequest, upto: int) -> None:
        """Write the KV of tokens ``[computed, upto)`` (the forward pass)."""
        self._check_kv(r, 0, min(r.computed // BS, len(r.hashes)))
        for p in range(r.computed // BS, -(-upto // BS)):
            full = (p + 1) * BS <= upto and p < len(r.hashes)
            self._write(r.table[p], r.hashes[p] if full else ("partial", r.rid, upto))
        r.computed = upto

    def _confirm(self, r: EngineRequest) -> None:
        """Mirror the manager's confirmed range; eager must store all of it."""
        stop = min(r.computed // BS, len(r.hashes))
        if self.write_through and r.epoch == self.epoch:
            self._owe(r, r.hashes[r.confirmed:stop])
        r.confirmed = max(r.confirmed, stop)

    def _owe(self, r: EngineRequest, hashes: list[int]) -> None:
        for h in hashes:
            self.must_store.setdefault(h, set()).add(r.rid)

    def _commit_gpu(self, r: EngineRequest) -> None:
        """Offer fully computed blocks to the engine's GPU prefix cache."""
        stop = min(r.computed // BS, len(r.hashes))
        if r.gpu_cache:
            for p in range(r.committed, stop):
                if not self.gpu.is_ready(r.table[p]):
                    self.gpu.commit([r.table[p]], [r.hashes[p]])
        r.committed = max(r.committed, stop)

    def _execute(self, t: ModelTransfer, w: int) -> None:
        """Worker ``w`` runs the copy now, reading the sources as they are now."""
        if t.direction is Direction.STORE:
            src, dst = self.gpu_content[w], self.cpu_content[w]
        else:
            src, dst = self.cpu_content[w], self.gpu_content[w]
        t.written[w] = {d: self._put(dst, d, src.get(s)) for s, d in zip(t.src, t.dst)}
        t.executed.add(w)

    def _inflight_store_hashes(self) -> set[int]:
        return {h for t in self.transfers.values()
                if t.direction is Direction.STORE and not t.abandoned for h in t.hashes}

    # -- requests ------------------------------------------------------------

    @initialize(prompts=st.lists(st.tuples(st.integers(0, len(BASE) - 1), st.sampled_from(SALTS),
                                           st.integers(1, 6 * BS + 2), st.booleans()),
                                 min_size=1, max_size=3),
                turns=st.integers(0, 3))
    def start(self, prompts: list[tuple[int, str, int, bool]], turns: int) -> None:
        """Add a few requests, then run ``turns`` conversation turns to fill the tiers.

        A turn is one whole engine step, then the oldest request finishes and its
        follow-up (the whole conversation so far plus a new question) arrives.
        """
        for family, salt, n_tokens, gpu_cache in prompts:
            self.add(family, salt, n_tokens, gpu_cache)
        for _ in range(turns):
            self.tick(2 * BS, 2)
            if self.reqs:
                r = next(iter(self.reqs.values()))
                self.finish(0, True)
                room = 6 * BS + 2 - len(r.tokens)
                if room > 0:
                    self._add(r.tokens + [t + 500 for t in BASE[0][:min(room, BS + 1)]],
                              r.salt, r.gpu_cache)

    @precondition(lambda self: len(self.reqs) < MAX_LIVE)
    @rule(family=st.integers(0, len(BASE) - 1), salt=st.sampled_from(SALTS),
          n_tokens=st.integers(1, 6 * BS + 2), gpu_cache=st.booleans())
    def add(self, family: int, salt: str, n_tokens: int, gpu_cache: bool) -> None:
        self._add(BASE[family][:n_tokens], salt, gpu_cache)

    def _add(self, tokens: list[int], salt: str, gpu_cache: bool) -> None:
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        r = EngineRequest(rid, salt, [], gpu_cache=gpu_cache)
        r.add_tokens(tokens)
        self.mgr.add_request(rid, r.hashes, len(tokens))
        self.reqs[rid] = r

    @precondition(lambda self: self.gpu.num_free)
    @rule(n=st.integers(1, NUM_GPU))
    def gpu_pressure(self, n: int) -> None:
        """Other work takes and overwrites free GPU blocks (evicting cached prefixes)."""
        blocks = self.gpu.allocate(min(n, self.gpu.num_free))
        for b in blocks:
            self._write(b, ("other", b))
        self.gpu.decref(blocks)

    @precondition(lambda self: any(not r.running for r in self.reqs.values()))
    @rule(i=st.integers(0, 50))
    def lookup(self, i: int) -> None:
        self._lookup(self._pick(i, lambda r: not r.running))

    def _lookup(self, r: EngineRequest) -> None:
        if r.hit_blocks:
            self.gpu.decref(r.hit_blocks)
        ntok = len(r.tokens)
        cap = (ntok - 1) // BS
        r.hit_blocks = self.gpu.lookup(r.hashes[:cap])
        self.gpu.incref(r.hit_blocks)  # the engine holds its GPU hit until it allocates
        hit = len(r.hit_blocks)
        stop = min(cap, len(r.hashes))
        expected = [] if self.draining else self.cpu.lookup(r.hashes[hit:stop])
        got = self.mgr.lookup(r.rid, hit * BS, num_tokens=ntok)
        # Hit semantics (invariant 8): the contiguous CPU run from the GPU-hit boundary, capped.
        assert got == len(expected) * BS, (r.rid, got, expected)
        for b in expected:
            assert self.store_epoch.get(b) == self.epoch, f"hit on CPU block {b} stored before a reset"
        r.pins, r.looked_up, r.revoked = expected, True, False

    @precondition(lambda self: any(r.looked_up and not r.running for r in self.reqs.values()))
    @rule(i=st.integers(0, 50), accept=st.integers(0, 8))
    def allocate(self, i: int, accept: int) -> None:
        self._allocate(self._pick(i, lambda r: r.looked_up and not r.running), accept)

    def _allocate(self, r: EngineRequest, accept: int) -> None:
        offered = len(r.pins) if not r.revoked else r.accepted
        a = min(accept, offered)
        try:
            new = self.gpu.allocate(-(-len(r.tokens) // BS) - len(r.hit_blocks))
        except OutOfBlocksError:
            return  # stays waiting, hit still pinned
        hit = r.hit_n = len(r.hit_blocks)
        r.table, r.hit_blocks = r.hit_blocks + new, []
        self.mgr.on_allocated(r.rid, [r.table], a * BS)
        r.running, r.looked_up = True, False
        r.accepted, r.computed, r.confirmed, r.committed = a, hit * BS, 0, hit
        r.epoch = self.epoch
        r.pins = r.pins[:a]
        r.load_pending = bool(r.pins)
        r.awaiting_load = a > 0
        if r.revoked and a:
            self.pending_fail.add(r.rid)

    @precondition(lambda self: any(r.running and not r.awaiting_load for r in self.reqs.values()))
    @rule(i=st.integers(0, 50), chunk=st.integers(1, 3 * BS))
    def compute(self, i: int, chunk: int) -> None:
        r = self._pick(i, lambda r: r.running and not r.awaiting_load)
        self._step_request(r, chunk)

    def _step_request(self, r: EngineRequest, chunk: int) -> None:
        """One engine step for ``r``: prefill a chunk, or decode one token."""
        if r.computed < len(r.tokens):
            self._compute(r, min(len(r.tokens), r.computed + chunk))
            self.mgr.on_computed(r.rid, r.computed)
            self._confirm(r)
            self._commit_gpu(r)
        if r.computed == len(r.tokens) and len(r.tokens) < MAX_TOKENS:
            if len(r.tokens) % BS == 0:  # the next token needs a block
                try:
                    (b,) = self.gpu.allocate(1)
                except OutOfBlocksError:
                    return
                r.table.append(b)
                self.mgr.append_blocks(r.rid, [[b]])
            self.next_token += 1
            new = r.add_tokens([self.next_token])
            if new:
                self.mgr.extend(r.rid, new, num_tokens=len(r.tokens))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 50), with_progress=st.booleans())
    def finish(self, i: int, with_progress: bool) -> None:
        r = self._pick(i, lambda r: True)
        if with_progress and r.running and not r.awaiting_load and r.computed < len(r.tokens):
            self._compute(r, len(r.tokens))  # the last step and the finish in one call
            delay = self.mgr.finish(r.rid, num_computed_tokens=r.computed)
            self._confirm(r)
        else:
            delay = self.mgr.finish(r.rid)
        if r.running and self.write_through and r.epoch == self.epoch:
            limit = self.store.flush_limit
            self._owe(r, r.hashes[:r.confirmed if limit is None else min(r.confirmed, limit)])  # the flush
        self._engine_free(r, delay)
        del self.reqs[r.rid]

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 50))
    def abort(self, i: int) -> None:
        r = self._pick(i, lambda r: True)
        self._engine_free(r, self.mgr.abort(r.rid))
        del self.reqs[r.rid]

    @precondition(lambda self: any(r.running for r in self.reqs.values()))
    @rule(i=st.integers(0, 50))
    def preempt(self, i: int) -> None:
        r = self._pick(i, lambda r: r.running)
        self._engine_free(r, self.mgr.preempt(r.rid), preempted=True)
        if not self.own_gpu:  # its queued stores went with its blocks
            for h, owners in list(self.must_store.items()):
                owners.discard(r.rid)
                if not owners:
                    del self.must_store[h]
        r.inc += 1
        r.computed = r.confirmed = r.committed = r.accepted = 0

    # -- steps and workers ---------------------------------------------------

    @rule()
    def build_step(self) -> None:
        was_draining = self.draining
        dropped = self.mgr.stats.stores_dropped.value
        expect_wb = set()
        target = self.store.writeback_target(self.gpu.num_free, NUM_GPU)
        if target and not was_draining:
            expect_wb = {self.gpu.block_hash(b) for b in self.gpu.eviction_candidates(target)}
        expected_loads: Counter = Counter()
        loading = []
        for r in self.reqs.values():
            if r.load_pending:
                start = r.hit_n
                # Placement (invariant 7): CPU hit i -> GPU block at position (GPU hit + i).
                expected_loads.update(zip(r.pins, r.table[start:start + len(r.pins)]))
                loading.append(r)
        self.evicted_in_build.clear()
        plan = self.mgr.build_step()
        got_loads = Counter(pair for _, p in plan.loads for pair in zip(p.src.tolist(), p.dst.tolist()))
        assert got_loads == expected_loads, (got_loads, expected_loads)
        for r in loading:
            r.load_pending = False
        if plan.loads:
            ((tid, p),) = plan.loads
            self.transfers[tid] = ModelTransfer(tid, Direction.LOAD, p.src.tolist(), p.dst.tolist(),
                                                [], [(r.rid, r.inc) for r in loading])
            for r in loading:
                r.pins = []  # the references moved to the transfer
        inflight = self._inflight_store_hashes()
        store_srcs = {s for t in self.transfers.values() if t.direction is Direction.STORE
                      and not t.abandoned and len(t.executed | t.reported) < WORLD for s in t.src}
        assert not (plan.stores and was_draining), "a store was planned while draining"
        for tid, p in plan.stores:
            src, dst = p.src.tolist(), p.dst.tolist()
            hashes = []
            for s, d in zip(src, dst):
                values = {self.gpu_content[w].get(s) for w in range(WORLD)}
                assert len(values) == 1 and isinstance(next(iter(values)), int), (
                    f"store of GPU block {s} whose KV is not confirmed: {values!r}")  # invariant 9
                h = values.pop()
                # No double store (invariant 6).
                assert h not in inflight and s not in store_srcs, f"hash {h} / GPU block {s} stored twice"
                assert not self.cpu.lookup([h]), f"hash {h} stored while on the CPU tier"
                assert self.cpu.block_hash(d) is None and self.cpu.refcount(d) == 1, d
                inflight.add(h)
                store_srcs.add(s)
                hashes.append(h)
                self.store_epoch[d] = self.epoch
            self.transfers[tid] = ModelTransfer(tid, Direction.STORE, src, dst, hashes, [])
        # Write-through (and write-back) completeness: nothing owed is silently skipped.
        if not was_draining and self.mgr.stats.stores_dropped.value == dropped:
            ready_or_moving = inflight | self.evicted_in_build
            owed = {h for h in self.must_store.keys() | expect_wb if not self.cpu.lookup([h])}
            missing = owed - ready_or_moving
            assert not missing, f"blocks owed to the CPU tier were not stored: {missing}"
        if not was_draining:
            self.must_store.clear()

    @precondition(lambda self: any(len(t.executed | t.reported) < WORLD
                                   for t in self.transfers.values()))
    @rule(data=st.data())
    def worker_execute(self, data) -> None:
        choices = [(t, w) for t in self.transfers.values() for w in range(WORLD)
                   if w not in t.executed and w not in t.reported]
        t, w = data.draw(st.sampled_from(choices))
        self._execute(t, w)

    @precondition(lambda self: any(len(t.reported) < WORLD for t in self.transfers.values()))
    @rule(data=st.data(), ok=st.integers(0, 7))
    def worker_report(self, data, ok: int) -> None:
        choices = [(t, w) for t in self.transfers.values() for w in range(WORLD)
                   if w not in t.reported]
        t, w = data.draw(st.sampled_from(choices))
        self._report(t, w, ok > 0)

    def _report(self, t: ModelTransfer, w: int, ok: bool) -> None:
        if ok and w not in t.executed:
            self._execute(t, w)
        if not ok:  # a failed copy may leave anything at its destination (when it ran)
            dst = self.cpu_content[w] if t.direction is Direction.STORE else self.gpu_content[w]
            written = t.written.get(w, {})
            for d in t.dst:
                if d not in written or self.serial.get((id(dst), d)) == written[d]:
                    self._put(dst, d, ("garbage", t.tid))
        t.reported.add(w)
        self.outbox.append(TransferResult(t.tid, worker=w, ok=ok))

    @precondition(lambda self: self.outbox)
    @rule(data=st.data())
    def deliver(self, data) -> None:
        order = data.draw(st.permutations(range(len(self.outbox))))
        n = data.draw(st.integers(1, len(order)))
        picked = [self.outbox[i] for i in order[:n]]
        self.outbox = [self.outbox[i] for i in order[n:]]
        extras = data.draw(st.lists(st.sampled_from(["dup", "unknown", "bad_worker"]), max_size=2))
        self._deliver(picked, extras)

    def _deliver(self, picked: list[TransferResult], extras: list[str]) -> None:
        sent = list(picked)
        for kind in extras:
            if kind == "unknown":
                sent.append(TransferResult(self.mgr.next_transfer_id + 1000))
            elif kind == "bad_worker":
                sent.append(TransferResult(picked[0].transfer_id, worker=WORLD))
            else:
                sent.append(picked[0])
        ignored, completed = 0, []
        for res in sent:
            t = self.transfers.get(res.transfer_id)
            if t is None or not 0 <= res.worker < WORLD or res.worker in t.delivered:
                ignored += 1
                continue
            t.delivered.add(res.worker)
            t.ok = t.ok and res.ok
            if len(t.delivered) == WORLD:
                del self.transfers[t.tid]
                completed.append(t)
        stats = self.mgr.stats
        before = stats.unknown_completions.value + stats.duplicate_completions.value
        report = self.mgr.apply_completions(sent)
        after = stats.unknown_completions.value + stats.duplicate_completions.value
        assert after - before == ignored, (after - before, ignored)
        loaded, failed = set(), set(self.pending_fail)
        self.pending_fail.clear()
        for t in completed:
            ok = t.ok and not t.abandoned
            if t.direction is Direction.STORE:
                for d, h in zip(t.dst, t.hashes):
                    # Readiness (invariant 5): findable iff the copy succeeded everywhere.
                    assert self.cpu.block_hash(d) == (h if ok else None), (d, h, ok)
            for rid, inc in t.loads:
                r = self.reqs.get(rid)
                if r is not None and r.inc == inc and r.running:
                    (loaded if ok and (rid, inc) not in t.left_out else failed).add(rid)
        assert report.loaded == loaded and report.load_failed == failed, (report, loaded, failed)
        assert report.released <= self.delayed.keys(), (report.released, self.delayed)
        for rid in report.released:
            self.gpu.decref(self.delayed.pop(rid))
        for rid in loaded:
            r = self.reqs[rid]
            start = r.hit_n
            self._check_kv(r, start, start + r.accepted)  # data integrity (invariant 12)
            r.computed = (start + r.accepted) * BS
            r.awaiting_load = False
        for rid in failed:
            r = self.reqs[rid]
            r.computed = r.hit_n * BS  # recompute what the load should have brought
            r.confirmed = min(r.confirmed, r.hit_n)  # the manager's count goes back to the GPU-hit boundary too
            assert self.mgr.request(rid).num_computed_tokens <= r.computed, "a failed load kept its count"
            r.awaiting_load = False
        if self.draining and not any(t.abandoned for t in self.transfers.values()):
            self.draining = False
            assert self.mgr.drained and self.cpu.num_cached == 0, "drained but the CPU tier is not empty"

    @rule(chunk=st.integers(1, 3 * BS), report=st.integers(0, 2), fail=st.integers(0, 5))
    def tick(self, chunk: int, report: int, fail: int = 1) -> None:
        """A whole engine step: schedule, compute every request, plan, then workers catch up.

        ``report``: 0 leaves the copies for later rules, 1 reports them, 2 also
        delivers. ``fail == 0``: the last worker's copy of the oldest transfer fails.
        """
        for r in [r for r in self.reqs.values() if not r.running]:
            self._lookup(r)
            self._allocate(r, MAX_TOKENS)
        for r in list(self.reqs.values()):
            if r.running and not r.awaiting_load:
                self._step_request(r, chunk)
        self.build_step()
        if report:
            for k, t in enumerate(list(self.transfers.values())):
                for w in range(WORLD):
                    if w not in t.reported:
                        self._report(t, w, bool(fail or k or w < WORLD - 1))
        if report == 2:  # the engine applies completions every step, even with none new
            picked, self.outbox = self.outbox, []
            self._deliver(picked, [])

    @precondition(lambda self: self.transfers or self.cpu.num_cached)
    @rule(force=st.booleans())
    def reset(self, force: bool = False) -> None:
        """A reset; ``force``: do not wait for the copies in flight (their blocks stay quarantined)."""
        emptied = self.mgr.reset(force=force)
        self.epoch += 1
        self.must_store.clear()
        for t in self.transfers.values():
            t.abandoned = True
        for r in self.reqs.values():
            if r.load_pending:
                self.pending_fail.add(r.rid)
                r.load_pending = False
            elif r.pins and not r.running:
                r.revoked = True
                r.accepted = len(r.pins)  # the engine may still accept what it was offered
            r.pins = []
        self.draining = bool(self.transfers) and not force
        assert emptied == (not self.draining) == self.mgr.drained
        if emptied:
            assert self.cpu.num_cached == 0, "reset left blocks findable on the CPU tier"

    @rule(data=st.data())
    def refused_bad_call(self, data) -> None:
        """A buggy engine's call between valid ones raises a kvkit error and changes nothing."""
        roles = {
            "waiting": [r.rid for r in self.reqs.values() if r.looked_up and not r.running],
            "running": [r.rid for r in self.reqs.values()
                        if r.running and self.mgr.request(r.rid).num_computed_tokens > BS],
        }
        usable = sorted(k for k, (needs, _) in BAD_CALLS.items() if all(roles[n] for n in needs))
        name = data.draw(st.sampled_from(usable), label="bad call")
        w, r = (data.draw(st.sampled_from(roles[k] or ["-"]), label=k) for k in ("waiting", "running"))
        before = snapshot(self.mgr)
        try:
            BAD_CALLS[name][1](self.mgr, w, r)
        except KVKitError:
            pass
        else:
            raise AssertionError(f"the bad call {name!r} was accepted")
        assert snapshot(self.mgr) == before, f"{name} changed the manager's state"

    # -- invariants ----------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.check_manager:
            self.mgr.check_invariants()
        else:
            self.cpu.check_invariants()
            self.gpu.check_invariants()
        # Refcount conservation and pinning (invariants 1, 2), from the model alone on the CPU.
        cpu_refs: Counter = Counter()
        for r in self.reqs.values():
            cpu_refs.update(r.pins)
        gpu_moving: Counter = Counter()
        for t in self.transfers.values():
            cpu_refs.update(t.dst if t.direction is Direction.STORE else t.src)
            gpu_moving.update(t.src if t.direction is Direction.STORE else t.dst)
        for b in range(NUM_CPU):
            assert self.cpu.refcount(b) == cpu_refs[b], (
                f"CPU block {b}: refcount {self.cpu.refcount(b)} != model {cpu_refs[b]}")
        engine: Counter = Counter()
        for r in self.reqs.values():
            engine.update(r.table if r.running else r.hit_blocks)
        for blocks in self.delayed.values():
            engine.update(blocks)
        held = self.mgr.gpu_refs_held()
        for b in range(NUM_GPU):
            assert self.gpu.refcount(b) == engine[b] + held[b], (b, engine[b], held[b])
            if self.own_gpu:
                assert held[b] >= gpu_moving[b], f"GPU block {b} moves without a manager reference"
        for t in self.transfers.values():  # in-flight pinning (invariant 2): nobody reuses these
            if len(t.executed | t.reported) < WORLD:
                gpu_side = t.src if t.direction is Direction.STORE else t.dst
                assert all(self.gpu.refcount(b) for b in gpu_side), (
                    f"transfer {t.tid} still to run on a GPU block the engine may reuse")
        # Data integrity (12) and readiness (5) of everything findable.
        for b in range(NUM_CPU):
            h = self.cpu.block_hash(b)
            if h is not None:
                assert all(self.cpu_content[w].get(b) == h for w in range(WORLD)), (b, h)
                assert self.draining or self.store_epoch.get(b) == self.epoch, (
                    f"CPU block {b} stored before a reset is still findable")
        for b in range(NUM_GPU):
            h = self.gpu.block_hash(b)
            if h is not None:
                assert all(self.gpu_content[w].get(b) == h for w in range(WORLD)), (b, h)
        # Pins name the request's own blocks (hit semantics, isolation).
        by_salt: dict[str, set] = {s: set() for s in SALTS}
        for r in self.reqs.values():
            for i, b in enumerate(r.pins):
                assert self.cpu.block_hash(b) == r.hashes[r.pin_start + i], (r.rid, i, b)
            by_salt[r.salt].update(r.table if r.running else r.hit_blocks)
        assert not (by_salt["a"] & by_salt["b"]), "requests with different salts share a block"

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:
            return  # a step already failed; report that failure, not a teardown symptom
        for r in list(self.reqs.values()):
            self._engine_free(r, self.mgr.finish(r.rid))
        self.reqs.clear()
        self.must_store.clear()
        for _ in range(4):
            self.build_step()
            for t in list(self.transfers.values()):
                for w in range(WORLD):
                    if w not in t.reported:
                        self._report(t, w, True)
            picked, self.outbox = self.outbox, []
            self._deliver(picked, [])
        # Lifecycle (11) and conservation (1): nothing pinned, nothing leaks, reset succeeds.
        assert self.mgr.num_requests == 0 and self.mgr.num_in_flight == 0, "state left behind"
        assert not self.delayed, f"never released: {sorted(self.delayed)}"
        assert all(self.cpu.refcount(b) == 0 for b in range(NUM_CPU))
        assert all(self.gpu.refcount(b) == 0 for b in range(NUM_GPU))
        assert self.mgr.reset() is True, "reset after a full drain did not empty the CPU tier"
        assert self.cpu.num_cached == 0, "reset left blocks findable on the CPU tier"
        self.mgr.check_invariants()


TestManagerEager = ManagerMachine.TestCase


class StoreOnceMachine(ManagerMachine):
    """The same model with the default ``EagerStore()``: a finish flushes nothing, each block is stored once."""

    @staticmethod
    def make_store():
        return EagerStore()


class EarlyCountMachine(StoreOnceMachine):
    """The engine counts an accepted hit computed when it schedules the load, as vLLM does its synchronous loads:
    a failed load sets the manager's count back to the GPU-hit boundary, and the engine's recompute is
    confirmed, and owed to the CPU tier, again."""

    def _allocate(self, r: EngineRequest, accept: int) -> None:
        super()._allocate(r, accept)
        if r.running and r.awaiting_load and not r.revoked:
            self.mgr.on_computed(r.rid, (r.hit_n + r.accepted) * BS)
            stop = min(r.hit_n + r.accepted, len(r.hashes))
            if self.write_through and r.epoch == self.epoch:
                self._owe(r, r.hashes[r.confirmed:stop])  # on the CPU tier: its hit
            r.confirmed = max(r.confirmed, stop)

    @precondition(lambda self: any(t.direction is Direction.LOAD and len(t.reported) < WORLD
                                   for t in self.transfers.values()))
    @rule(data=st.data())
    def fail_a_load(self, data) -> None:
        """Every worker yet to report a load reports it failed (its requests recompute)."""
        t = data.draw(st.sampled_from([t for t in self.transfers.values()
                                       if t.direction is Direction.LOAD and len(t.reported) < WORLD]))
        for w in range(WORLD):
            if w not in t.reported:
                self._report(t, w, False)


class BoundedFlushMachine(ManagerMachine):
    """The same model with a finish flush bounded to the history's first two blocks."""

    @staticmethod
    def make_store():
        return EagerStore(flush_limit=2)


class SelectiveMachine(ManagerMachine):
    """The same model with ``SelectiveStore(k=2)`` (no write-through promise)."""

    write_through = False

    @staticmethod
    def make_store():
        return SelectiveStore(k=2)


class LazyMachine(ManagerMachine):
    """The same model with write-back: the GPU's next eviction candidates must be stored."""

    write_through = False

    @staticmethod
    def make_store():
        return LazyStore(watermark=0.25)


class NeverMachine(ManagerMachine):
    """The same model with ``NeverStore``: nothing is ever stored, so no hit is ever served."""

    write_through = False

    @staticmethod
    def make_store():
        return NeverStore()

    @invariant()
    def nothing_stored(self) -> None:
        assert self.cpu.num_cached == 0 and not self.mgr.stats.blocks_stored.value


class LeftOutMachine(ManagerMachine):
    """Workers also leave a request out of loads (``fail_load``), as vLLM's worker does for a request whose
    shared-tier source failed, while the load's transfers may all report ok: that request alone fails. Every
    other load (odd transfer ids) has one request left out, told before any of its results is delivered."""

    def _deliver(self, picked: list[TransferResult], extras: list[str]) -> None:
        for t in self.transfers.values():
            if t.direction is Direction.LOAD and t.tid % 2 and not t.left_out:
                rid, inc = t.loads[t.tid // 2 % len(t.loads)]
                r = self.reqs.get(rid)
                if r is not None and r.inc == inc and r.running:
                    self.mgr.fail_load(rid)
                    t.left_out.add((rid, inc))
        super()._deliver(picked, extras)


class ExternalEngineMachine(ManagerMachine):
    """The same model as an external engine (no GPU pool given): finish and abort delay the free."""

    own_gpu = False


class RaisingCallbackMachine(ManagerMachine):
    """The eager machine with a callback that raises in every hook: the model must not notice."""

    @staticmethod
    def make_callbacks():
        return (RaisingCallback(),)

    def teardown(self) -> None:
        stats = self.mgr.stats  # every lookup's event raised, and was contained
        assert stats.callback_errors.value >= stats.lookups.value
        super().teardown()


class _HintBug(HintedPolicy):
    """A user's hint-aware policy whose handler raises on hints of kind ``"bad"`` (and hears the rest)."""

    def on_hints(self, hashes, hints):
        if hints.kind == "bad":
            raise RuntimeError("hint handler bug")
        super().on_hints(hashes, hints)


class HintMachine(ManagerMachine):
    """A hint-aware CPU policy: hinted adds interleave with the rest; a raising handler refuses the add whole."""

    @staticmethod
    def make_cpu_eviction():
        return _HintBug(base=LRUPolicy)

    @rule(family=st.integers(0, len(BASE) - 1), salt=st.sampled_from(SALTS), n_tokens=st.integers(1, 6 * BS + 2),
          bad_hashes=st.booleans())
    def refused_hinted_add(self, family: int, salt: str, n_tokens: int, bad_hashes: bool) -> None:
        """An add whose hints the policy refuses (a raising handler, or hashes it cannot hear) adds nothing."""
        tokens = BASE[family][:n_tokens]
        r = EngineRequest(f"r{self.next_rid}", salt, [])
        r.add_tokens(tokens)
        before = snapshot(self.mgr)
        hints = WorkloadHints(priority=1) if bad_hashes else WorkloadHints(kind="bad")
        if bad_hashes:  # the handler sees hashes it refuses: a kvkit error, raised before anything changed
            sink = self.mgr._hint_sink
            self.mgr._hint_sink = lambda h, x: HintedPolicy.on_hints(sink.__self__, [*h, 1.5], x)
        try:
            self.mgr.add_request(r.rid, r.hashes, len(tokens), hints=hints)
        except KVKitError:
            pass
        else:
            raise AssertionError("an add whose hints were refused was accepted")
        finally:
            if bad_hashes:
                self.mgr._hint_sink = sink
        assert snapshot(self.mgr) == before, "a refused hinted add changed the manager's state"
        self._add(tokens, salt, False)  # the same id is free: not "already live"


TestManagerStoreOnce = StoreOnceMachine.TestCase
TestManagerBoundedFlush = BoundedFlushMachine.TestCase
TestManagerEarlyCount = EarlyCountMachine.TestCase
TestManagerSelective = SelectiveMachine.TestCase
TestManagerExternalEngine = ExternalEngineMachine.TestCase
TestManagerLazy = LazyMachine.TestCase
TestManagerNever = NeverMachine.TestCase
TestManagerRaisingCallback = RaisingCallbackMachine.TestCase
TestManagerHints = HintMachine.TestCase
TestManagerLeftOut = LeftOutMachine.TestCase


# -- the third tier: two instances sharing one store --------------------------
#
# Two managers (instances) with their own GPU and CPU pools share one store
# (a MemoryStore behind a FailingStore). Each of WORLD fake workers per
# instance runs its step plans in order (fetches, copies, puts) at any time,
# keeping a content value per GPU and CPU block; results reach the manager
# late and per worker. The server drops keys and goes down at random. Checked
# after every rule: a shared hit is offered only where every rank's key
# exists; a fetched block stays referenced until its load ran on every
# worker; a load reported done put the right content on every worker's GPU
# blocks (a vanished, foreign or failed value makes the request recompute).
# A fetch is reported per key (``TransferResult.lost``): a block some worker
# lost must never commit, or a later CPU hit loads the wrong content.

SBS, S_GPU, S_CPU = 4, 16, 6
S_FAMILIES = [[f * 1000 + t for t in range(6 * SBS)] for f in range(3)]


class _Keys:
    """The machine's codec: keys only (the fake workers frame values themselves)."""

    header_bytes = 0
    probe_key = b"probe"

    def key(self, block_hash, rank):
        return b"%d:%d" % (block_hash, rank)

    def seal(self, header, block_hash, rank, payload):
        pass

    def check(self, header, block_hash, rank, payload):
        return True


@attrs.define(eq=False)
class _SharedReq:
    rid: str
    tokens: list[int]
    hashes: list[int]
    table: list[int] = attrs.field(factory=list)
    accepted: int = 0  # blocks loaded from the CPU/shared tiers
    awaiting: bool = False
    computed: bool = False


@attrs.define(eq=False)
class _Instance:
    mgr: OffloadManager
    gpu: BlockPool
    cpu: BlockPool
    queues: list[list]  # per worker: (kind, tid, plan, step) not yet run
    outbox: list = attrs.field(factory=list)
    reqs: dict = attrs.field(factory=dict)
    gpu_content: list[dict] = attrs.field(factory=lambda: [{} for _ in range(WORLD)])
    cpu_content: list[dict] = attrs.field(factory=lambda: [{} for _ in range(WORLD)])
    failed: dict = attrs.field(factory=dict)  # (worker, step) -> CPU blocks whose fetch failed
    step: int = 0


class SharedTierMachine(RuleBasedStateMachine):
    """Drives two managers sharing one store (write-through) against a content model."""

    manager_cls = OffloadManager
    check_manager = True
    write = "write-through"

    def __init__(self) -> None:
        super().__init__()
        self.spec = KVCacheSpec(num_layers=1, block_size=SBS, num_kv_heads=1, head_dim=2)
        self.server = MemoryStore()
        self.store = FailingStore(self.server)
        self.keys = _Keys()
        self.now = 0.0
        self.next_rid = 0
        self.insts = [self._instance() for _ in range(2)]

    def _instance(self) -> _Instance:
        gpu, cpu = BlockPool(S_GPU, eviction=LRUPolicy()), BlockPool(S_CPU, eviction=LRUPolicy())
        shared = SharedTierSpec(store=self.store, codec=self.keys, write=self.write, backoff_s=1.0,
                                clock=lambda: self.now)
        mgr = self.manager_cls(self.spec, cpu, EagerStore(), gpu=gpu, world_size=WORLD, shared=shared)
        return _Instance(mgr, gpu, cpu, [[] for _ in range(WORLD)])

    def _pick(self, inst: _Instance, i: int, pred) -> _SharedReq | None:
        live = [r for r in inst.reqs.values() if pred(r)]
        return live[i % len(live)] if live else None

    @rule(k=st.integers(0, 1), family=st.integers(0, len(S_FAMILIES) - 1), n=st.integers(SBS + 1, 6 * SBS),
          salt=st.sampled_from(SALTS))
    def add(self, k: int, family: int, n: int, salt: str) -> None:
        inst = self.insts[k]
        if len(inst.reqs) >= 4:
            return
        tokens = S_FAMILIES[family][:n]
        hashes = hash_blocks(tokens, SBS, extra_keys=(salt,))
        rid = f"s{self.next_rid}"
        self.next_rid += 1
        inst.mgr.add_request(rid, hashes, n)
        inst.reqs[rid] = _SharedReq(rid, tokens, hashes)

    @rule(k=st.integers(0, 1), i=st.integers(0, 50), accept=st.integers(0, 8))
    def schedule(self, k: int, i: int, accept: int) -> None:
        inst = self.insts[k]
        r = self._pick(inst, i, lambda r: not r.table)
        if r is not None:
            self._schedule(inst, r, accept)

    def _schedule(self, inst: _Instance, r: _SharedReq, accept: int) -> None:
        hit = inst.mgr.lookup(r.rid, 0) // SBS
        view = inst.mgr.request(r.rid)
        for h in r.hashes[view.fetch_start:view.fetch_start + len(view.fetch)]:
            for w in range(WORLD):  # nothing is findable before every rank's put landed
                assert self.server.contains([self.keys.key(h, w)]) == 1, f"shared hit without rank {w}'s key"
        need = -(-len(r.tokens) // SBS)
        if inst.gpu.num_free < need:
            return
        r.table = inst.gpu.allocate(need)
        r.accepted = min(hit, accept)
        inst.mgr.on_allocated(r.rid, [r.table], r.accepted * SBS)
        r.awaiting = r.accepted > 0

    @rule(k=st.integers(0, 1), i=st.integers(0, 50))
    def compute(self, k: int, i: int) -> None:
        inst = self.insts[k]
        r = self._pick(inst, i, lambda r: r.table and not r.awaiting and not r.computed)
        if r is not None:
            self._compute(inst, r)

    def _compute(self, inst: _Instance, r: _SharedReq) -> None:
        for w in range(WORLD):
            for pos in range(r.accepted, len(r.table)):
                inst.gpu_content[w][r.table[pos]] = r.hashes[pos] if pos < len(r.hashes) else ("partial", r.rid)
        inst.mgr.on_computed(r.rid, len(r.tokens))
        r.computed = True

    @rule(k=st.integers(0, 1), i=st.integers(0, 50))
    def finish(self, k: int, i: int) -> None:
        inst = self.insts[k]
        r = self._pick(inst, i, lambda r: True)
        if r is None:
            return
        inst.mgr.finish(r.rid)
        if r.table:
            inst.gpu.decref(r.table)
        del inst.reqs[r.rid]

    @rule(k=st.integers(0, 1))
    def build_step(self, k: int) -> None:
        inst = self.insts[k]
        plan = inst.mgr.build_step()
        inst.step += 1
        items = ([("fetch", tid, p) for tid, p in plan.fetches] + [("copy", tid, p) for tid, p in plan]
                 + [("put", tid, p) for tid, p in plan.puts])
        for q in inst.queues:
            q.extend((kind, tid, p, inst.step) for kind, tid, p in items)

    @rule(k=st.integers(0, 1), w=st.integers(0, WORLD - 1), n=st.integers(1, 4))
    def run(self, k: int, w: int, n: int) -> None:
        inst = self.insts[k]
        for _ in range(n):
            if inst.queues[w]:
                self._run(inst, w, *inst.queues[w].pop(0))

    def _run(self, inst: _Instance, w: int, kind: str, tid: int, plan, step: int) -> None:
        cpu, gpu, store = inst.cpu_content[w], inst.gpu_content[w], self.store
        ok, lost = True, []
        if kind == "fetch":
            bufs = [bytearray(16) for _ in plan.blocks]
            ticket = store.get([self.keys.key(h, w) for h in plan.hashes], [[memoryview(b)] for b in bufs])
            (res,) = store.poll([ticket])
            failed = set()
            for i, (b, h) in enumerate(zip(plan.blocks, plan.hashes)):
                got = int.from_bytes(bufs[i], "little") if i not in res.failed else None
                cpu[b] = got
                if got != h:
                    failed.add(b)
                    lost.append(i)
            inst.failed[w, step] = failed
            ok = len(lost) < len(plan.blocks)  # per key: the blocks that landed commit, unless none did
        elif kind == "put":
            values = [[memoryview(int(cpu.get(b) or 0).to_bytes(16, "little"))] for b in plan.blocks]
            ticket = store.put([self.keys.key(h, w) for h in plan.hashes], values)
            (res,) = store.poll([ticket])
            ok = res.ok
        elif plan.direction is Direction.LOAD:
            for s, d in zip(plan.src.tolist(), plan.dst.tolist()):
                gpu[d] = cpu.get(s)
            ok = not inst.failed.get((w, step), set()) & set(plan.src.tolist())
        else:
            for s, d in zip(plan.src.tolist(), plan.dst.tolist()):
                cpu[d] = gpu.get(s)
        inst.outbox.append(TransferResult(tid, w, ok=ok, lost=lost if ok else ()))

    @rule(k=st.integers(0, 1), data=st.data())
    def deliver(self, k: int, data) -> None:
        inst = self.insts[k]
        if not inst.outbox:
            return
        picked = data.draw(st.lists(st.sampled_from(range(len(inst.outbox))), unique=True, max_size=6))
        results = [inst.outbox[i] for i in sorted(picked)]
        inst.outbox = [res for i, res in enumerate(inst.outbox) if i not in set(picked)]
        self._apply(inst, results)

    def _apply(self, inst: _Instance, results: list[TransferResult]) -> None:
        report = inst.mgr.apply_completions(results)
        for rid in report.loaded:  # integrity: the loaded blocks hold their hashes on every worker
            r = inst.reqs[rid]
            for w in range(WORLD):
                got = [inst.gpu_content[w].get(b) for b in r.table[:r.accepted]]
                assert got == r.hashes[:r.accepted], f"{rid}: worker {w} loaded {got}, not its blocks"
            r.awaiting = False
        for rid in report.load_failed:
            if rid in inst.reqs:
                inst.reqs[rid].accepted, inst.reqs[rid].awaiting = 0, False  # recompute

    @rule(k=st.integers(0, 1), lag=st.integers(-1, WORLD - 1))
    def tick(self, k: int, lag: int) -> None:
        """A whole step: plan, every worker runs everything (worker ``lag`` only its first item), results arrive."""
        inst = self.insts[k]
        self.build_step(k)
        for w in range(WORLD):
            for _ in range(1 if w == lag else len(inst.queues[w])):
                if inst.queues[w]:
                    self._run(inst, w, *inst.queues[w].pop(0))
        results, inst.outbox = inst.outbox, []
        self._apply(inst, results)

    @rule(k=st.integers(0, 1), family=st.integers(0, len(S_FAMILIES) - 1), n=st.integers(SBS + 1, 6 * SBS),
          accept=st.integers(0, 8), vanish=st.booleans(), lag=st.integers(-1, WORLD - 1))
    def serve(self, k: int, family: int, n: int, accept: int, vanish: bool, lag: int) -> None:
        """A request arrives, is scheduled with the hit it accepts, computes and finishes over three ticks.

        With ``vanish`` the server drops the last key of its shared hit between lookup and fetch.
        """
        inst = self.insts[k]
        self.add(k, family, n, SALTS[0])
        r = inst.reqs.get(f"s{self.next_rid - 1}")
        if r is None or r.table:
            return
        self._schedule(inst, r, accept)
        if vanish and r.accepted > 0:
            self.server.drop(self.keys.key(r.hashes[r.accepted - 1], WORLD - 1))
        self.tick(k, lag)
        if r.awaiting:  # a lagging worker has not loaded yet: later rules go on
            return
        if r.table:
            self._compute(inst, r)
            inst.mgr.finish(r.rid)
            inst.gpu.decref(r.table)
            del inst.reqs[r.rid]
        self.tick(k, -1)  # stores
        self.tick(k, -1)  # puts

    @rule(k=st.integers(0, 1), force=st.booleans())
    def reset(self, k: int, force: bool) -> None:
        """An instance empties its CPU tier with fetches, loads and puts in flight (the shared tier keeps its keys)."""
        inst = self.insts[k]
        inst.mgr.reset(force=force)
        for r in inst.reqs.values():
            if not r.table:
                r.accepted = 0

    @rule(i=st.integers(0, 50))
    def server_drops(self, i: int) -> None:
        held = list(self.server._values)
        if held:
            self.server.drop(held[i % len(held)])

    @rule(down=st.booleans())
    def server_state(self, down: bool) -> None:
        self.store.down = down

    @rule(seconds=st.sampled_from([0.5, 2.0, 100.0]))
    def time_passes(self, seconds: float) -> None:
        """The clock moves on; both instances plan twice (a back-off's probe goes out and is answered)."""
        self.now += seconds
        for k in range(len(self.insts)):
            self.build_step(k)
            self.build_step(k)

    @invariant()
    def consistent(self) -> None:
        for inst in self.insts:
            for q in inst.queues:  # a fetched block is held until every worker ran its load
                for kind, _tid, plan, _step in q:
                    if kind == "copy" and plan.direction is Direction.LOAD:
                        assert all(inst.cpu.refcount(b) > 0 for b in plan.src.tolist()), (
                            "a load's CPU source was released before the load ran")
            if self.check_manager:
                inst.mgr.check_invariants()
                assert inst.mgr.shared_status is not None
            self.server.check_invariants()

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:
            return
        self.store.down = False
        for inst in self.insts:
            for rid in list(inst.reqs):
                r = inst.reqs.pop(rid)
                inst.mgr.finish(rid)
                if r.table:
                    inst.gpu.decref(r.table)
            for _ in range(3):
                self.build_step(self.insts.index(inst))
                for w in range(WORLD):
                    while inst.queues[w]:
                        self._run(inst, w, *inst.queues[w].pop(0))
                results, inst.outbox = inst.outbox, []
                self._apply(inst, results)
            assert inst.mgr.num_in_flight == 0 and inst.mgr.num_requests == 0, "state left behind"
            assert all(inst.cpu.refcount(b) == 0 for b in range(S_CPU)), "a CPU block leaked"
            assert all(inst.gpu.refcount(b) == 0 for b in range(S_GPU)), "a GPU block leaked"
            inst.mgr.check_invariants()


class SharedWriteBackMachine(SharedTierMachine):
    """The same with write-back: the CPU tier's next eviction candidates go to the shared tier."""

    write = "write-back"


TestSharedTier = SharedTierMachine.TestCase
TestSharedTierWriteBack = SharedWriteBackMachine.TestCase


# -- planted bugs: the machine must catch each failure mode known in the field ---------
#
# Each plant is a small OffloadManager subclass with one field bug. The machine
# runs with the manager's own check_invariants() off, so only the model's checks
# can catch it. Generation stops at the first failure and nothing is shrunk, so
# a caught bug costs a fraction of a second.

_FIND_BUG = settings(max_examples=1000, phases=[Phase.generate], database=None, derandomize=True,
                     deadline=None, report_multiple_bugs=False)


class _LookupWithoutPin(OffloadManager):
    """vLLM #39702: the CPU hit is found at lookup but not held until allocation."""

    def lookup(self, request_id, gpu_hit_tokens, **kw):
        n = super().lookup(request_id, gpu_hit_tokens, **kw)
        r = self._requests[request_id]
        if r.pinned:
            self.cpu.decref(r.pinned)
            self._late[request_id] = r.pinned
            r.pinned = []
        return n

    def on_allocated(self, request_id, gpu_block_ids, accepted_tokens=0, *, recompute_tokens=0):
        r = self._requests.get(request_id)
        late = self._late.pop(request_id, [])
        if r is not None and late:
            self.cpu.incref(late)  # pinned only now: the block may be gone or reused
            r.pinned = late
        super().on_allocated(request_id, gpu_block_ids, accepted_tokens, recompute_tokens=recompute_tokens)

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        self._late = {}


class _StoresUnconfirmed(OffloadManager):
    """vLLM #45704 at this level: blocks are stored before their KV is confirmed written."""

    def _queue(self, r, indices):
        super()._queue(r, indices)
        r.store_queue.extend(range(r.num_confirmed_blocks, len(r.block_hashes)))
        if r.store_queue:
            self._dirty[r.request_id] = r


class _LeftOutLoaded(OffloadManager):
    """A request a worker left out of a load is reported loaded when the load's transfers succeed."""

    def fail_load(self, request_id):
        pass


class _NoFlushOnFinish(OffloadManager):
    """vLLM #41704: a request finishing in the step its last block completes loses that block."""

    def finish(self, request_id, num_computed_tokens=None):
        r = self._live(request_id)
        r.store_queue = []
        return self._end(r)


class _StaleCursor(OffloadManager):
    """The store cursor starts at the GPU-hit boundary, so evicted prefix blocks are never re-stored."""

    def on_allocated(self, request_id, gpu_block_ids, accepted_tokens=0, *, recompute_tokens=0):
        r = self._requests.get(request_id)
        first = r is not None and r.gpu_hit_blocks is not None and not r.block_table
        super().on_allocated(request_id, gpu_block_ids, accepted_tokens, recompute_tokens=recompute_tokens)
        if first:
            r.num_confirmed_blocks = r.gpu_hit_blocks


class _ResetKeepsHits(OffloadManager):
    """vLLM #57727: reset drains but the CPU tier keeps serving what it held."""

    def _empty_cpu(self, force=False):
        self._draining = False


class _BlindSet(set):
    def __contains__(self, item):
        return False


class _DoubleStore(OffloadManager):
    """Deduplication ignores stores in flight, so one hash is copied twice."""

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        self._stores._inflight = _BlindSet()


class _StoreSourceNotHeld(OffloadManager):
    """A store's GPU source is not held, so the engine may reuse it before the copy runs."""

    def _open(self, batch, src, dst):
        if batch.direction is Direction.STORE and batch.gpu_blocks:
            self.gpu.decref(batch.gpu_blocks)
            batch.gpu_blocks = []
        return super()._open(batch, src, dst)


class _NoDelayedFree(OffloadManager):
    """An external engine is told it may free a finished request's blocks while stores read them."""

    def finish(self, request_id, num_computed_tokens=None):
        super().finish(request_id, num_computed_tokens)
        return False


class _AppendUnchecked(OffloadManager):
    """Appended block ids are trusted: one already in the table corrupts a later store."""

    def append_blocks(self, request_id, new_block_ids):
        r = self.request(request_id)
        taken, r.block_ids = r.block_ids, set()  # the table's ids unseen: a duplicate of one passes
        try:
            super().append_blocks(request_id, new_block_ids)
        finally:
            r.block_ids = taken | r.block_ids


class _HintsAfterAdd(OffloadManager):
    """The request is added before its hints are heard: a raising handler leaves it live."""

    def add_request(self, request_id, block_hashes, num_prompt_tokens, hints=None):
        super().add_request(request_id, block_hashes, num_prompt_tokens)
        if hints is not None and self._hint_sink is not None:
            self._hint_sink(list(block_hashes), hints)


class _PropagatingCallbacks(OffloadManager):
    """A raising callback's exception escapes mid-call, after part of the state changed."""

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        callbacks = self.callbacks

        class Loud(type(self._events)):
            def emit(self, hook, *args):
                for cb in callbacks:
                    getattr(cb, hook)(*args)

        self._events = Loud(callbacks, self.stats.callback_errors)


class _OneRankShared(SharedTier):
    def find(self, hashes, tail=(), held=()):
        keys = [self.spec.codec.key(h, 0) for h in hashes]
        return self.spec.store.contains(keys) if self.available else 0


class _SharedHitOneRank(OffloadManager):
    """A shared hit is offered when rank 0's key exists, before every rank's put landed."""

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        self._shared = _OneRankShared(self.shared, self.cpu, self.world_size, self.stats, self._events,
                                      self.kv.bytes_per_block)


class _FetchedBlockNotHeld(OffloadManager):
    """A load does not hold the blocks a fetch fills, so they may be evicted once the fetch commits."""

    def _plan_loads(self):
        fetches, loads = super()._plan_loads()
        for batch in self._transfers.batches():
            if batch.direction is Direction.LOAD and not batch.shared and batch.fetched:
                fetched = set(batch.fetched)
                self.cpu.decref(batch.fetched)
                batch.cpu_blocks = [b for b in batch.cpu_blocks if b not in fetched]
                batch.fetched = []
        return fetches, loads


class _LostBlockCommitted(OffloadManager):
    """A fetch's blocks a worker reported lost (``TransferResult.lost``) are committed with the others."""

    def _complete(self, batch):
        batch.lost = []
        super()._complete(batch)


def _check_plant_signatures(plant: type) -> None:
    """A plant's overrides take what the real methods take: a call the machine makes must reach the bug.

    Session 3's CI failed when Hypothesis first reached ``reset(force=True)``
    on a plant whose ``_empty_cpu`` lacked ``force``: a ``TypeError``, not the bug.
    """
    for name, method in vars(plant).items():
        real = getattr(plant.__mro__[1], name, None)
        if not callable(method) or real is None or name.startswith("__"):
            continue
        mine = inspect.signature(method).parameters
        if any(p.kind is p.VAR_KEYWORD for p in mine.values()):
            continue
        assert list(mine) == list(inspect.signature(real).parameters), (
            f"{plant.__name__}.{name}{inspect.signature(method)} differs from {inspect.signature(real)}")


@pytest.mark.parametrize(("base", "plant"), [
    (ManagerMachine, _LookupWithoutPin), (ManagerMachine, _StoresUnconfirmed),
    (ManagerMachine, _NoFlushOnFinish), (ManagerMachine, _StaleCursor),
    (ManagerMachine, _ResetKeepsHits), (ManagerMachine, _DoubleStore),
    (ManagerMachine, _StoreSourceNotHeld), (ExternalEngineMachine, _NoDelayedFree),
    (ManagerMachine, _AppendUnchecked), (RaisingCallbackMachine, _PropagatingCallbacks),
    (HintMachine, _HintsAfterAdd), (LeftOutMachine, _LeftOutLoaded),
    (SharedTierMachine, _SharedHitOneRank), (SharedTierMachine, _FetchedBlockNotHeld),
    (SharedTierMachine, _LostBlockCommitted),
], ids=lambda c: c.__name__.strip("_"))
def test_machine_catches_planted_bug(base, plant):
    """The model's checks alone (no manager self-check) catch each planted failure mode."""
    _check_plant_signatures(plant)
    machine = type(f"Buggy{plant.__name__}", (base,), {"manager_cls": plant, "check_manager": False})
    with pytest.raises((AssertionError, KVKitError, RuntimeError)):  # RuntimeError: an escaped callback bug
        run_state_machine_as_test(machine, settings=_FIND_BUG)
