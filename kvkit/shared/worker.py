"""``SharedTierWorker``: one worker rank's side of the shared tier (its own shard of every block).

It runs a whole step plan on its rank: the shared-tier fetches first (the
store's values into CPU blocks, waited for and checked), then the copies of
its :class:`~kvkit.worker.engine.TransferEngine`, then the puts (CPU blocks
into the store, asynchronous). Without an engine (a scheduler-only stack, the
simulator) a value is the header alone and copies complete at once, so the
store still sees every key the lifecycle writes. An engine loop of its own
(vLLM's worker) calls the parts instead: :meth:`SharedTierWorker.fetch`
before its loads, :meth:`~SharedTierWorker.put` after, and
:meth:`~SharedTierWorker.take_store_results` when it polls.

A step's load carries every loading request's blocks in one copy per KV
group. A block whose fetch failed on a rank fails the loads that read it
there, and only those: given each loading request's GPU blocks (its
*targets*), the rank runs the copies without the blocks of the requests that
read such a block (:func:`leave_out`), which fail
alone (the engine tells the manager, ``OffloadManager.fail_load``). A copy
that reads such a block for no request named is not run and is reported
failed; a copy that fails as a whole names no block, so it fails every
request it carries.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING

import attrs
import numpy as np

from kvkit.errors import TransferTimeoutError
from kvkit.interfaces.shared import BlockCodec, BlockStore, SharedPlan, StoreResult
from kvkit.interfaces.types import Direction, KVCacheSpec, TransferPlan, TransferResult
from kvkit.validate import check_int, check_real, checked, implements
from kvkit.worker import WAIT_TIMEOUT_S

if TYPE_CHECKING:
    from kvkit.manager.step import StepPlan
    from kvkit.worker.engine import TransferEngine

__all__ = ["SharedTierWorker", "leave_out"]


@attrs.frozen
class Started:
    """Fetches queued by :meth:`SharedTierWorker.start_fetches`: each plan and its store ticket (``None``: it
    failed), and when they were queued (``time.monotonic()``: their waits count from then)."""

    fetches: list[tuple[SharedPlan, int | None]]
    at: float


def leave_out(loads: Sequence[tuple[int, TransferPlan]], bad: Set[int], targets: Mapping[str, frozenset[int]],
              ) -> tuple[tuple[tuple[int, TransferPlan], ...], set[str], frozenset[int]] | None:
    """``loads`` without the blocks of the requests of ``targets`` (each one's GPU blocks) that read a CPU block
    of ``bad`` (a block two requests read names both), those requests and their GPU blocks; ``None`` if such a
    read writes a GPU block none of them names (whose load it breaks is unknown)."""
    broken: set[int] = set()
    for _, plan in loads:
        broken.update(plan.dst[np.isin(plan.src, list(bad))].tolist())
    readers = {rid for rid, blocks in targets.items() if not blocks.isdisjoint(broken)}
    blocks = frozenset().union(*(targets[rid] for rid in readers))
    if not broken <= blocks:
        return None
    sources, dests = list(bad), list(blocks)
    kept = []
    for tid, plan in loads:
        keep = ~(np.isin(plan.src, sources) | np.isin(plan.dst, dests))
        kept.append((tid, attrs.evolve(plan, src=plan.src[keep], dst=plan.dst[keep])))
    return tuple(kept), readers, blocks


def _mirrors(engines: Iterable[TransferEngine]) -> tuple[TransferEngine, ...]:
    """``SharedTierWorker.mirrors`` as a tuple (a named converter: mypy's ``attrs`` plugin reads its type)."""
    return tuple(engines)


@attrs.define(eq=False)
class _Pending:
    ticket: int
    transfer_id: int
    started: float
    num_bytes: int
    buffers: list  # kept alive (and untouched) until the store reports the ticket


@attrs.define(eq=False)
class SharedTierWorker:
    """Runs one rank's step plans, shared-tier transfers included, and reports their results.

    Args:
        spec: the cache shape (bytes per copy for a scheduler-only stack).
        store: the shared store (this rank polls only the tickets its own calls answered).
        codec: keys and value framing, identical on every rank and the scheduler.
        engine: this rank's copy engine, or ``None`` for a scheduler-only stack.
        mirrors: the engines whose CPU mirrors hold a block's payload, in order
            (default: ``engine``'s; vLLM's worker has one engine per KV group,
            and CPU block ``c`` is block ``c`` of every group's mirror).
        rank: this worker's rank (its shard of every block).
        wait_timeout_s: how long a fetch or a drain waits for the store at most.

    Invariants:
        * A fetched value is written into CPU blocks only through the store's
          ``get`` and counts only if its header checks (``codec.check``);
          any other value is a failed block (``invalid_values``), never loaded.
        * A fetch is reported per key: answered in time with some blocks
          failed (missing, invalid, unanswered), it is ``ok`` with those
          blocks' positions in ``TransferResult.lost``; it is failed as a
          whole only when every block failed, or it raised or came late.
        * A load of this step never reads a block whose fetch failed here:
          given the loading requests' targets, it runs without the blocks of
          the requests that read one (:meth:`submit` returns them; they
          fail, the others load); otherwise, or for a read no target names,
          it is reported ``ok=False`` (its bytes are not the block's).
        * Every submitted transfer id is reported exactly once; a fetch the
          store answers after ``wait_timeout_s`` is reported failed.
        * A fetch's or put's ``seconds`` runs from its submission to its
          answer; without a mirror (headers only) it is 0: not measured.
    """

    spec: KVCacheSpec
    store: BlockStore = attrs.field(validator=implements(BlockStore))
    codec: BlockCodec = attrs.field(validator=implements(BlockCodec))
    engine: TransferEngine | None = None
    mirrors: tuple[TransferEngine, ...] = attrs.field(
        kw_only=True, converter=_mirrors,
        default=attrs.Factory(lambda self: () if self.engine is None else (self.engine,), takes_self=True))
    rank: int = attrs.field(default=0, kw_only=True, converter=checked(check_int, minimum=0))  # type: ignore[misc]
    wait_timeout_s: float = attrs.field(default=WAIT_TIMEOUT_S, kw_only=True,
                                        converter=checked(check_real, low=0, low_open=True))  # type: ignore[misc]
    missing_values: int = attrs.field(default=0, init=False)  # keys a server answered without a value (or refused)
    invalid_values: int = attrs.field(default=0, init=False)
    transport_errors: int = attrs.field(default=0, init=False)
    _pending: dict[int, _Pending] = attrs.field(factory=dict, init=False)  # by store ticket
    _ready: list[TransferResult] = attrs.field(factory=list, init=False)
    _tainted: set[int] = attrs.field(factory=set, init=False)  # loads to report failed
    _late: set[int] = attrs.field(factory=set, init=False)  # tickets of fetches that timed out: report failed

    def submit(self, plan: StepPlan, started: Started | None = None,
               targets: Mapping[str, frozenset[int]] | None = None) -> set[str]:
        """Run a :class:`~kvkit.manager.step.StepPlan` on this rank: fetches, loads, stores, puts.

        ``started``: what :meth:`start_fetches` answered for ``plan.fetches``
        (default: they start now). ``targets``: each loading request's GPU
        blocks its hit is loaded into. A load runs without the blocks of the
        requests that read a block whose fetch failed here (missing, invalid,
        or not answered within ``wait_timeout_s`` or ``plan.fetch_wait_s``, the
        shorter, of their start); a copy left with no block is reported done.
        Without ``targets``, or when such a read writes a GPU block no target
        names, every load that reads such a block is reported failed instead.

        Returns:
            The requests left out of the loads here (their loads must fail:
            ``OffloadManager.fail_load``, before the loads' results are applied).
        """
        failed = self.finish_fetches(self.start_fetches(plan.fetches) if started is None else started,
                                     plan.fetch_wait_s)
        loads, left_out = plan.loads, set[str]()
        if failed and targets and (kept := leave_out(loads, failed, targets)) is not None:
            loads, left_out, _ = kept
            failed = set()
        for tid, copy in (*loads, *plan.stores):
            if failed and copy.direction is Direction.LOAD and failed.intersection(copy.src.tolist()):
                self._tainted.add(tid)
            if len(copy):
                self._copy(tid, copy)
            else:  # every block it carried was left out
                self._ready.append(TransferResult(tid, self.rank))
        self.put(plan.puts)
        return left_out

    def fetch(self, fetches: Sequence[tuple[int, SharedPlan]], wait_s: float = math.inf) -> set[int]:
        """Get each fetch's values into its CPU blocks, waited for and checked; the blocks that failed here.

        Never raises for a sick store: a fetch it does not answer within
        ``wait_timeout_s`` (or ``wait_s``, a step's ``fetch_wait_s``, if shorter) fails all its
        blocks (and is reported failed once answered).
        """
        return self.finish_fetches(self.start_fetches(fetches), wait_s)

    def start_fetches(self, fetches: Sequence[tuple[int, SharedPlan]]) -> Started:
        """Queue every fetch's get at once, waiting for none; :meth:`finish_fetches` waits.

        Ranks that share a process start theirs before any of them waits, so
        their fetches run against one deadline, not one after another.
        """
        at = time.monotonic()
        return Started([(plan, self._call(tid, "get", plan)) for tid, plan in fetches], at)

    def finish_fetches(self, started: Started, wait_s: float = math.inf) -> set[int]:
        """Wait for the started fetches until ``wait_timeout_s`` (or ``wait_s``, if shorter) after they started
        and check their values (as :meth:`fetch`); the blocks that failed here."""
        left = started.at + min(self.wait_timeout_s, wait_s) - time.monotonic()
        answered = self._gather({t for _, t in started.fetches if t is not None}, max(0.0, left), keep=True)
        failed: set[int] = set()
        for plan, ticket in started.fetches:
            if ticket is None:
                failed.update(plan.blocks)
            elif ticket not in answered:  # its buffers stay referenced until the store answers, then it fails
                self._late.add(ticket)
                failed.update(plan.blocks)
            else:
                failed |= self._checked(plan, self._pending[ticket], answered[ticket])
        return failed

    def put(self, puts: Sequence[tuple[int, SharedPlan]]) -> None:
        """Queue each put (ready CPU blocks into the store, asynchronous; reported by a later poll)."""
        for tid, plan in puts:
            self._call(tid, "put", plan)

    def take_store_results(self) -> list[TransferResult]:
        """Results of the fetches and puts that finished since the last call (the engines are not polled)."""
        self._collect(0.0)
        out, self._ready = self._ready, []
        return out

    def poll(self) -> list[TransferResult]:
        """Results of everything that finished since the last call (never raises for a sick store)."""
        self._collect(0.0)
        return self._hand_out(self.engine.poll() if self.engine is not None else [])

    def drain_copies(self, timeout: float | None = None) -> list[TransferResult]:
        """Wait for this rank's copies, not for the store; return every result not yet reported.

        What a step calls before compute reads its loads: the fetches were waited
        for already (:meth:`fetch`), and a put still on its way never holds a step
        (the store reports it by its deadline; a later poll hands it out).

        Raises:
            TransferTimeoutError: a copy was still in flight at the deadline (as ``TransferEngine.drain``).
        """
        copies = self.engine.drain(timeout) if self.engine is not None else []
        self._collect(0.0)
        return self._hand_out(copies)

    def drain(self, timeout: float | None = None) -> list[TransferResult]:
        """Wait for every copy and every store ticket in flight; return every result not yet reported.

        Raises:
            TransferTimeoutError: something was still in flight at the deadline
                (it stays in flight; results collected meanwhile come with the next call).
        """
        copies = self.engine.drain(timeout) if self.engine is not None else []
        try:
            self._wait(set(self._pending), self.wait_timeout_s if timeout is None else timeout)
        except TransferTimeoutError:
            self._ready += self._taint(copies)  # reported by the next call
            raise
        return self._hand_out(copies)

    def check_invariants(self) -> None:
        """Assert the bookkeeping: every pending ticket names a distinct transfer."""
        tids = [p.transfer_id for p in self._pending.values()]
        assert len(tids) == len(set(tids)), "two store tickets for one transfer"
        if self.engine is not None:
            self.engine.check_invariants()

    # -- internals ------------------------------------------------------------

    def _payload(self, block: int) -> list[memoryview]:
        """Views of ``block``'s bytes in this rank's CPU mirror, region by region (none without an engine)."""
        return [view for engine in self.mirrors for view in engine.cpu_block_views(block)]

    def _frames(self, plan: SharedPlan, seal: bool) -> tuple[list[bytes], list[list[memoryview]]]:
        codec, rank = self.codec, self.rank
        keys, values = [], []
        for block, block_hash in zip(plan.blocks, plan.hashes):
            payload = self._payload(block)
            header = memoryview(bytearray(codec.header_bytes))
            if seal:
                codec.seal(header, block_hash, rank, payload)
            keys.append(codec.key(block_hash, rank))
            values.append([header, *payload])
        return keys, values

    def _call(self, tid: int, method: str, plan: SharedPlan) -> int | None:
        """Queue a put or get; a client that raises is a failed transfer, reported by the next poll."""
        keys, values = self._frames(plan, seal=method == "put")
        started = time.perf_counter()  # a store that works inside the call spends that time on the transfer too
        try:
            ticket = getattr(self.store, method)(keys, values)
        except Exception:  # noqa: BLE001 - a sick store fails the transfer, never the step
            self.transport_errors += 1
            self._ready.append(TransferResult(tid, self.rank, ok=False))
            return None
        self._pending[ticket] = _Pending(ticket, tid, started, len(plan) * self._bytes_per_block(), values)
        return ticket

    def _checked(self, plan: SharedPlan, pending: _Pending, res: StoreResult) -> set[int]:
        """Check the values the get ``pending`` of ``plan`` answered with ``res``; returns the blocks that failed."""
        bad = set(res.failed)
        self.missing_values += len(bad) - len(res.unanswered) - len(res.unsent or ())  # a server answered those
        codec, rank = self.codec, self.rank
        for i, (block_hash, parts) in enumerate(zip(plan.hashes, pending.buffers)):
            if i not in bad and not codec.check(parts[0], block_hash, rank, parts[1:]):
                self.invalid_values += 1
                bad.add(i)
        self._finish(pending, ok=len(bad) < len(plan), lost=sorted(bad))
        return {plan.blocks[i] for i in bad}

    def _copy(self, tid: int, plan: TransferPlan) -> None:
        if self.engine is not None:
            self.engine.submit(tid, plan)
            return
        num_bytes = len(plan) * self.spec.kv_parts * len(self.spec.groups[plan.group].layers) \
            * self.spec.bytes_per_layer_block
        self._ready.append(TransferResult(tid, self.rank, ok=tid not in self._tainted, num_bytes=num_bytes))
        self._tainted.discard(tid)

    def _bytes_per_block(self) -> int:
        return self.codec.header_bytes + sum(engine.spec.bytes_per_block for engine in self.mirrors)

    def _collect(self, timeout: float, keep: Set[int] = frozenset()) -> dict[int, StoreResult]:
        """Poll the store once for this rank's tickets; finish each reported one but those in ``keep``.

        Returns the reported results by ticket.
        """
        if not self._pending:
            return {}
        try:
            results = self.store.poll(tuple(self._pending), timeout)
        except Exception:  # noqa: BLE001 - nothing came back this time; the tickets stay pending
            self.transport_errors += 1
            return {}
        out = {}
        for res in results:
            pending = self._pending.get(res.ticket)
            if pending is None:  # not one it named (the protocol says it cannot happen): ignored
                continue
            out[res.ticket] = res
            self.transport_errors += res.transport_failed
            if res.ticket not in keep:
                self._finish(pending, ok=res.ok and res.ticket not in self._late)
                self._late.discard(res.ticket)
        return out

    def _gather(self, tickets: set[int], timeout: float, keep: bool = False) -> dict[int, StoreResult]:
        """Poll until every ticket of ``tickets`` is reported or ``timeout`` passed; the ones reported by then.

        ``keep``: the reported ones among ``tickets`` stay pending (their
        caller finishes them); any other ticket reported meanwhile is finished.
        No ticket: nothing is polled (a put in flight never holds a step without fetches).
        """
        if not tickets:
            return {}
        deadline = time.monotonic() + timeout if math.isfinite(timeout) else math.inf
        got: dict[int, StoreResult] = {}
        while True:
            got.update(self._collect(min(0.05, max(0.0, deadline - time.monotonic())),
                                     tickets if keep else frozenset()))
            if tickets <= got.keys() or time.monotonic() >= deadline:
                return {t: got[t] for t in tickets if t in got}

    def _wait(self, tickets: set[int], timeout: float) -> None:
        """Poll until every ticket of ``tickets`` is reported and finished.

        Raises:
            TransferTimeoutError: some were not reported within ``timeout`` (they stay pending).
        """
        got = self._gather(tickets, timeout)
        if len(got) < len(tickets):
            missing = sorted(self._pending[t].transfer_id for t in tickets - got.keys())
            raise TransferTimeoutError(f"worker {self.rank}: the shared store did not answer transfers "
                                       f"{missing} within {timeout:g} s", tuple(missing))

    def _finish(self, pending: _Pending, ok: bool, lost: Sequence[int] = ()) -> None:
        """Report ``pending`` (``lost``: with ``ok``, the positions of its blocks that failed; they move no byte)."""
        del self._pending[pending.ticket]
        # Without a mirror only headers move: their time says nothing of a block's, so none is reported.
        seconds = time.perf_counter() - pending.started if self.mirrors else 0.0
        num_bytes = pending.num_bytes - pending.num_bytes * len(lost) // len(pending.buffers) if ok else 0
        self._ready.append(TransferResult(pending.transfer_id, self.rank, ok=ok, seconds=seconds,
                                          num_bytes=num_bytes, lost=lost if ok else ()))

    def _hand_out(self, copies: list[TransferResult]) -> list[TransferResult]:
        out, self._ready = self._ready, []
        return out + self._taint(copies)

    def _taint(self, copies: list[TransferResult]) -> list[TransferResult]:
        """``copies`` with every load that read a block whose fetch failed here reported failed."""
        out = []
        for res in copies:
            if res.transfer_id in self._tainted:
                self._tainted.discard(res.transfer_id)
                res = TransferResult(res.transfer_id, res.worker, ok=False, seconds=res.seconds,
                                     num_bytes=res.num_bytes)
            out.append(res)
        return out

