"""The shared tier (third tier) on the scheduler side: shared hits, fetches, puts, and the tier's health.

A *shared hit* is the leading run of blocks right after the CPU hit whose key
exists for every worker rank (each worker puts and fetches its own shard),
asked in one ``contains`` round trip. Its CPU blocks are allocated at lookup
(one reference each, not ready), fetched by every worker in the step that
loads them, and committed (findable on the CPU tier) only once every worker's
fetch landed. A prefetch (a waiting request's hit) is fetched the same way, in
its own batch that no load reads. Puts go CPU -> shared: ``write-through``
puts what a CPU store committed, ``write-back`` puts the CPU pool's next
eviction candidates ahead of their eviction.

Failure is normal. A failed fetch or put makes the tier *suspect*: a probe (a
tiny put of the codec's ``probe_key`` with each suffix of :data:`PROBE_KEYS`,
under the tenant's prefix, spread over a Cluster's nodes, through the
scheduler's own client) is sent, and only a probe that fails with a transport
error on every key, each sent, turns the tier off (one live node keeps it on: the store
fails the dead nodes' keys itself; keys the store never sent, their deadline passed in
its own queue, are no answer either way: the probe is sent again at the next tick)
for a back-off interval (doubling up to a cap), loudly: ``stats.shared_outages``, one ``RuntimeWarning`` per outage,
``on_shared_state``. While it is off, lookups find nothing there and nothing
is put; when the interval is over, another probe decides. No request waits on
it: a failed fetch makes its request recompute, as a failed load does.

The server's contents are the truth. The hashes this instance put, fetched or
found present are remembered only to skip putting them again (a hit a load
plan declined is recomputed, not put back), and only while there is no
evidence against them: a lookup that finds a remembered hash absent forgets it
and every hash after it in that request (they are recomputed and put again), a
failed fetch (a value missing, refused by its check, or late) forgets its hashes and marks them *refused*: until
a put or fetch of one lands (or ``trust_s`` passes) a lookup that finds it present does not take it as held, and
a CPU hit's check that finds it present takes it as lost, so the block recomputed (or kept in the CPU tier) is
put again over the bad value; an outage forgets everything (the server may
have restarted empty), so does a restart the store found without a failed call (a node that told another
``run_id`` or restart-marker token when its connection was reopened:
:func:`~kvkit.shared.client.store_restarts`, looked at each step and after each ``contains``), and nothing
is remembered longer than ``trust_s``, nor longer than the store keeps a value (its ``ttl_s``:
:func:`~kvkit.shared.client.store_lifetime`), the server's own forgetting.
A CPU hit asks the shared tier too, so blocks an instance keeps only in its
CPU tier are put again once the server lost them: a lookup checks its CPU
hit's hashes that are not remembered (and not queued, in flight, or found lost
less than ``trust_s`` ago), after the hashes it looks up in the same
``contains`` round trip (answered when all of those are present: the store
counts leading keys; else in a second round trip of their own), or alone in
one round trip when it looks up none; present ones are remembered again, from
the first absent one on they are taken as lost (``stats.blocks_found_lost``)
and put again from the CPU tier (write-through; write-back puts them as
eviction candidates, as it puts any block not remembered). A lookup makes at
most two round trips (the second only for such a check, so at most once per
``trust_s`` for a block), none when its CPU hit is remembered and it looks up
nothing, all within the step's budget, and never changes its hit.

Invariants: a hash is offered only if every rank's key was present at its
lookup; a fetched block is findable only after every worker's fetch landed,
and stays referenced until its load completed; no hash has two puts in flight;
no put is skipped for a hash put, fetched or found ``trust_s`` (or the store's ``ttl_s``, if shorter) or longer
ago, or before an outage or a restart the store counted, nor for a hash refused less than ``trust_s`` ago and
neither put nor fetched since;
a CPU-hit hash remembered (or found lost) less than ``trust_s`` ago, and since the last outage, is not checked.
"""

from __future__ import annotations

import enum
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import attrs

from kvkit.errors import ConfigError
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.capabilities import EvictionOrder
from kvkit.interfaces.shared import SHARED_WRITES, BlockCodec, BlockStore, SharedPlan, StoreResult
from kvkit.interfaces.types import BlockHash, BlockId, Direction
from kvkit.manager.backpressure import WriteGate
from kvkit.manager.events import Events
from kvkit.manager.requests import Request
from kvkit.manager.transfers import Batch
from kvkit.redact import redact_text
from kvkit.shared.client import store_deadline, store_lifetime, store_restarts
from kvkit.stats import OffloadStats
from kvkit.validate import (
    check_real,
    checked,
    implements,
    is_callable,
    known_keywords,
    one_of,
    optional_at_least,
    plural,
)
from kvkit.warn import warn

__all__ = ["SharedState", "SharedTier", "SharedTierSpec"]

PROBE_KEYS = tuple(b":%d" % i for i in range(64))
"""The suffixes of the keys a probe writes after the codec's ``probe_key`` (no block key looks like
them): 64 hash slots under any prefix, so every node of a Cluster of a few nodes holds one but for odds
of about 5 * 0.8**64 (3e-6) at five nodes."""


_LABEL = "SharedTierSpec."


@known_keywords
@attrs.frozen(kw_only=True)
class SharedTierSpec:
    """How a manager uses a shared tier.

    Attributes:
        store: the shared store (``contains``, and probes whose results the scheduler collects by ticket).
        codec: turns (block hash, rank) into keys, identically on every worker.
        write: one of :data:`SHARED_WRITES`.
        writeback_blocks: with ``write-back``, how many of the CPU pool's next
            eviction candidates are kept put (default: a quarter of the pool).
        backoff_s / max_backoff_s: the first back-off interval after a failure,
            and its cap (each failed retry doubles it).
        trust_s: how long a hash put, fetched or found is taken to be still held
            (not put again) without being looked up again; then it may be put again.
            A store whose values expire (``ttl_s``, :func:`~kvkit.shared.client.store_lifetime`)
            bounds it: nothing is taken to be held longer than the store keeps it.
        lookup_budget_s: how long one step may wait on the store in all (the
            store's deadline of one call: :func:`~kvkit.shared.client.connect_shared`
            passes a store's ``request_timeout_s``): its lookups wait on
            ``contains`` until it is spent, each lookup given what is left of it
            (then the step's further lookups find nothing there, and a hit found
            by the lookup that spent it is not taken: no time is left to fetch
            it), and the fetches of a store with a deadline get what the lookups
            left (``StepPlan.fetch_wait_s``). However many requests a step looks
            up through a slow link, it waits on the shared tier about one
            deadline in all (lookups and fetches together, plus the scheduling
            of the calls).
        clock: seconds, monotonic (tests pass a fake one).
    """

    store: BlockStore = attrs.field(validator=implements(BlockStore, label=_LABEL))
    codec: BlockCodec = attrs.field(validator=implements(BlockCodec, label=_LABEL))
    write: str = attrs.field(default="write-through", validator=one_of(SHARED_WRITES, label=_LABEL))
    writeback_blocks: int | None = attrs.field(default=None, validator=optional_at_least(1, label=_LABEL))
    backoff_s: float = attrs.field(default=1.0, converter=checked(check_real, low=0, low_open=True, label=_LABEL))  # type: ignore[misc]
    max_backoff_s: float = attrs.field(default=60.0, converter=checked(check_real, low=0, low_open=True,  # type: ignore[misc]
                                                                       label=_LABEL))
    trust_s: float = attrs.field(default=60.0, converter=checked(check_real, low=0, low_open=True, label=_LABEL))  # type: ignore[misc]
    lookup_budget_s: float = attrs.field(default=2.0, converter=checked(check_real, low=0, low_open=True,  # type: ignore[misc]
                                                                        label=_LABEL))
    clock: Callable[[], float] = attrs.field(default=time.monotonic, validator=is_callable(label=_LABEL))


class SharedState(enum.Enum):
    """The shared tier's health as the scheduler sees it."""

    ON = "on"  # serving
    SUSPECT = "suspect"  # serving; a failure was seen and a probe is out (or sent again next tick: none asked)
    OFF = "off"  # backing off: no lookups, no puts
    RETRY = "retry"  # off; the probe that ends the back-off is out (or sent again next tick: none asked)


@attrs.define(eq=False)
class SharedTier:
    """Finds shared hits, plans fetches and puts, and tracks the shared tier's health.

    Args:
        spec: the store, codec, write mode and back-off.
        cpu: the CPU tier's pool (the staging area of every fetch and put).
        world_size: workers, each with its own shard (key) of every block.
        stats / events: the manager's counters and callback dispatcher.
        block_bytes: bytes one worker moves per block.
        gate: backpressure on puts (:mod:`kvkit.manager.backpressure`): puts
            it holds back wait for a later step, at most ``cpu.num_blocks``
            of them (beyond, the oldest are dropped: ``stats.puts_backpressured``).
    """

    spec: SharedTierSpec
    cpu: BlockAllocator
    world_size: int
    stats: OffloadStats
    events: Events
    block_bytes: int
    gate: WriteGate = attrs.field(factory=WriteGate)
    _state: SharedState = attrs.field(init=False, default=SharedState.ON)
    _interval: float = attrs.field(init=False, default=0.0)
    _until: float = attrs.field(init=False, default=0.0)
    _probe: int | None = attrs.field(init=False, default=None)
    _reason: str = attrs.field(init=False, default="")
    _queued: dict[BlockHash, None] = attrs.field(init=False, factory=dict)  # write-through, in order
    _flying: set[BlockHash] = attrs.field(init=False, factory=set)  # puts in flight
    _known: OrderedDict[BlockHash, float] = attrs.field(init=False, factory=OrderedDict)  # put/fetched/found -> when
    _lost: OrderedDict[BlockHash, float] = attrs.field(init=False, factory=OrderedDict)  # CPU hit found absent -> when
    _refused: OrderedDict[BlockHash, float] = attrs.field(init=False, factory=OrderedDict)  # fetch failed -> when
    _known_cap: int = attrs.field(init=False, default=0)
    _trust_s: float = attrs.field(init=False, default=0.0)  # spec.trust_s, or the store's ttl_s if shorter
    _restarts: int = attrs.field(init=False, default=0)  # the store's restarts count when last looked at
    _writeback: int = attrs.field(init=False, default=0)
    _lookup_spent: float = attrs.field(init=False, default=0.0)  # seconds this step's lookups waited on contains

    def __attrs_post_init__(self) -> None:
        self._interval = self.spec.backoff_s
        self._known_cap = 4 * self.cpu.num_blocks
        self._trust_s = min(self.spec.trust_s, store_lifetime(self.spec.store) or math.inf)
        self._restarts = store_restarts(self.spec.store)
        if self.spec.write == "write-back":
            if not isinstance(self.cpu, EvictionOrder):
                raise ConfigError(f"shared.write='write-back' puts the CPU pool's next eviction candidates: "
                                  f"the CPU pool must have eviction_candidates(n), got {self.cpu!r}")
            self._writeback = self.spec.writeback_blocks or max(1, self.cpu.num_blocks // 4)

    # -- health ---------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether lookups and puts use the tier now."""
        return self._state in (SharedState.ON, SharedState.SUSPECT)

    @property
    def status(self) -> str:
        """One line for status output: the state, and while off the reason and the time to the next probe."""
        if self._state is SharedState.OFF:
            wait = max(0.0, self._until - self.spec.clock())
            return f"off (backing off {self._interval:g} s, next probe in {wait:.1f} s): {self._reason}"
        if self._state is SharedState.RETRY:
            return f"off (probing): {self._reason}"
        return self._state.value

    @property
    def fetch_wait_s(self) -> float:
        """What this step's deadline (``spec.lookup_budget_s``) left its fetches after its lookups (0 once spent);
        ``inf`` for a store without a deadline of its own (:func:`~kvkit.shared.client.store_deadline`: its
        fetches take what its medium takes, as long as the workers' ``wait_timeout_s``)."""
        if store_deadline(self.spec.store) is None:
            return math.inf
        return max(0.0, self.spec.lookup_budget_s - self._lookup_spent)

    def tick(self) -> None:
        """Once per step: read the probe's answer, or send the probe that ends a back-off or that the last one
        left to send again; renew the lookup budget.

        A probe a server answered on any key (stored, or refused: ``-OOM``, ``-READONLY``) turns the tier on; one
        whose every key was sent and no server answered (``StoreResult.unanswered``) turns it off; one no server
        answered with keys never sent (``StoreResult.unsent``: queued in the store's own client past the deadline)
        asked no server: it decides nothing, and the probe is sent again at the next tick.
        """
        self._lookup_spent = 0.0
        self._restarted()
        if self._probe is not None:
            for res in self._poll(self._probe):
                self._probe = None
                unanswered, unsent = len(res.unanswered), len(res.unsent or ())
                if unanswered + unsent < len(PROBE_KEYS):  # a server answered: refusals keep it on
                    self._turn_on()
                elif not unsent:  # sent, and no server answered
                    self._turn_off(res.error)
        elif self._state in (SharedState.SUSPECT, SharedState.RETRY):  # the last probe asked no server
            self._send_probe()
        elif self._state is SharedState.OFF and self.spec.clock() >= self._until:
            self._state = SharedState.RETRY
            self._send_probe()

    def suspect(self, reason: str) -> None:
        """A shared transfer failed: probe the server (the tier keeps serving until the probe fails)."""
        if self._state is SharedState.ON:
            self._state, self._reason = SharedState.SUSPECT, reason
            self._send_probe()

    def _send_probe(self) -> None:
        self.stats.shared_probes.add()
        try:
            keys = [self.spec.codec.probe_key + suffix for suffix in PROBE_KEYS]
            self._probe = self.spec.store.put(keys, [[memoryview(b"1")]] * len(keys))
        except Exception as exc:  # noqa: BLE001 - a sick client is a failed probe, never a failed step
            self._probe = None
            self._turn_off(f"transport: probe raised {exc!r}")

    def _poll(self, ticket: int) -> list[StoreResult]:
        try:
            return self.spec.store.poll((ticket,), 0.0)
        except Exception as exc:  # noqa: BLE001 - as above
            self._probe = None
            self._turn_off(f"transport: poll raised {exc!r}")
            return []

    def _restarted(self) -> bool:
        """Whether the store found a server that may have lost what it held since this was last asked (a restart
        no failed call revealed: :func:`~kvkit.shared.client.store_restarts`); if so, forget what was remembered."""
        restarts = store_restarts(self.spec.store)
        if restarts == self._restarts:
            return False
        self._restarts = restarts
        self._forget()
        return True

    def _forget(self) -> None:
        """Forget every hash remembered as held or found lost: the server may have come back empty."""
        self._known.clear()
        self._lost.clear()  # their puts may have gone to the server that is gone, or were skipped: check again

    def _turn_off(self, reason: str) -> None:
        reason = redact_text(reason)  # shown in the warning, the status line and to callbacks
        self._forget()
        if self._state in (SharedState.ON, SharedState.SUSPECT):  # a new outage: say so once
            self._interval = self.spec.backoff_s
            self.stats.shared_outages.add()
            warn(f"kvkit shared tier is off for {self._interval:g} s (then probed again, backing off "
                 f"up to {self.spec.max_backoff_s:g} s): {reason}; requests are served from the GPU "
                 f"and CPU tiers meanwhile", RuntimeWarning)
            self.events.emit("on_shared_state", False, reason)
        else:  # a failed retry: wait longer
            self._interval = min(self.spec.max_backoff_s, 2 * self._interval)
        self._state, self._reason = SharedState.OFF, reason
        self._until = self.spec.clock() + self._interval

    def _turn_on(self) -> None:
        if self._state is SharedState.RETRY:
            self.stats.shared_recoveries.add()
            self.events.emit("on_shared_state", True, "probe succeeded")
        self._state, self._reason, self._interval = SharedState.ON, "", self.spec.backoff_s

    # -- hits and fetches -------------------------------------------------------

    def find(self, hashes: Sequence[BlockHash], tail: Sequence[BlockHash] = (),
             held: Sequence[BlockHash] = ()) -> int:
        """Length of the leading run of ``hashes`` whose key exists for every rank (one round trip; see ``held``).

        ``tail``: the request's hashes after ``hashes`` (recomputed, never looked up). The
        hashes found are remembered as held (not put again however the request's plan uses
        them); those from the first one found absent on, and the tail, are forgotten as put: the
        request recomputes them, and they are put again. A hash refused (its fetch failed since
        it was last put or fetched) is not remembered when found: its value there is bad, and
        the block is put again over it. Once this step's lookups have
        waited ``spec.lookup_budget_s`` on the store, nothing is asked (and nothing forgotten);
        each lookup gets what is left of it (``contains``'s ``timeout_s``), and the one that spent
        it answers 0: no time is left this step to fetch what it found.

        ``held``: the request's CPU hit right before ``hashes``. Those of them not remembered as
        held by the server (never confirmed, lapsed past ``trust_s``, forgotten by an outage), not
        queued or in flight, and not found lost less than ``trust_s`` ago are checked too, never
        changing the answer: after ``hashes`` in the same round trip, answered when every one of
        ``hashes`` is found (``contains`` counts leading keys), else in a second round trip of
        their own; alone when ``hashes`` is empty. A check cut short by the budget is not taken
        as an answer. Those found are remembered again;
        from the first one found absent on, and those found present but refused, they are taken as
        lost (``stats.blocks_found_lost``):
        write-through queues their puts from the CPU tier, write-back leaves them to its candidates.
        """
        if not self.available or self._lookup_spent >= self.spec.lookup_budget_s:
            return 0
        self._restarted()
        stale = self._unconfirmed(held)
        if not hashes and not stale:
            return 0
        asked = len(stale)
        leading = self._ask([*hashes, *stale])
        if leading is None:
            return 0
        if self._restarted():  # found while answering: the CPU hit's hashes remembered until now are checked too
            stale = self._unconfirmed(held)  # a superset of those asked, in the same order
        found = min(len(hashes), leading)
        if found:
            refused = self._fresh(self._refused)
            self._remember(h for h in hashes[:found] if h not in refused)
        known = self._known
        if known and found < len(hashes):
            for h in (*hashes[found:], *tail):
                known.pop(h, None)
        if stale:
            present = leading - found if found == len(hashes) and asked == len(stale) else self._ask(stale)
            if present is not None and self._lookup_spent < self.spec.lookup_budget_s:
                self._confirm_held(stale, present)
        return found if self._lookup_spent < self.spec.lookup_budget_s else 0

    def _ask(self, hashes: Sequence[BlockHash]) -> int | None:
        """How many of ``hashes`` lead with every rank's key present (one ``contains`` within what is left of
        the step's budget); ``None`` if the store raised (the tier is then suspect) or no budget is left."""
        budget = self.spec.lookup_budget_s - self._lookup_spent
        if budget <= 0:
            return None
        key, ranks = self.spec.codec.key, range(self.world_size)
        start = self.spec.clock()
        try:
            n = self.spec.store.contains([key(h, rank) for h in hashes for rank in ranks], timeout_s=budget)
        except Exception as exc:  # noqa: BLE001 - the protocol says it answers 0; a buggy one must not wedge us
            self.suspect(f"transport: contains raised {exc!r}")
            return None
        finally:
            self._lookup_spent += self.spec.clock() - start
        return n // self.world_size if n.__class__ is int and n > 0 else 0

    def _unconfirmed(self, held: Sequence[BlockHash]) -> list[BlockHash]:
        """The hashes of ``held`` a lookup checks: not remembered as held, queued, in flight or recently lost."""
        known, lost, queued, flying = self._fresh(self._known), self._fresh(self._lost), self._queued, self._flying
        return [h for h in held if h not in known and h not in lost and h not in queued and h not in flying]

    def _confirm_held(self, stale: list[BlockHash], present: int) -> None:
        """The server holds the first ``present`` of ``stale`` (CPU-tier blocks): remember them, but for those
        refused (their value there is bad); those and the rest are lost."""
        refused = self._fresh(self._refused)
        held = stale[:present]
        self._remember(h for h in held if h not in refused)
        lost = [h for h in held if h in refused] + stale[present:]
        if lost:
            self.stats.blocks_found_lost.add(len(lost))
            self._note(self._lost, lost)
            self.written(lost)

    def reserve(self, r: Request, start: int, n: int) -> None:
        """Allocate CPU blocks (one reference each, not ready) for the ``n`` shared hits of ``r`` at ``start``."""
        n = min(n, self.cpu.num_free)
        r.fetch = self.cpu.allocate(n) if n else []
        r.fetch_start = start

    def plan_fetches(self, reqs: Iterable[Request]) -> tuple[Batch, SharedPlan] | None:
        """One fetch batch for the accepted shared hits of ``reqs``.

        Each request's reservation moves to the batch, and the request pins
        the same blocks once more for its load (``pinned`` grows by them), so
        a block is referenced until both its fetch and its load completed.
        """
        runs = []
        for r in reqs:
            if r.fetch:
                runs.append((r, r.fetch_start, r.fetch))
                self.cpu.incref(r.fetch)
                r.pinned = r.pinned + r.fetch
                r.fetch = []
        return self._fetch_batch(runs, prefetch=False)

    def plan_prefetches(self, reqs: Iterable[Request]) -> tuple[Batch, SharedPlan] | None:
        """One fetch batch for the prefetches of ``reqs`` (waiting requests): each reservation moves to the
        batch, which holds the blocks' only reference; once it lands they are ordinary cached CPU blocks."""
        runs = []
        for r in reqs:
            if r.prefetch:
                runs.append((r, r.prefetch_start, r.prefetch))
                r.prefetch = []
        return self._fetch_batch(runs, prefetch=True)

    def _fetch_batch(self, runs: list[tuple[Request, int, list[BlockId]]],
                     prefetch: bool) -> tuple[Batch, SharedPlan] | None:
        """A fetch batch of ``(request, position, blocks)`` runs: block ``i`` of a run gets the request's hash
        at ``position + i``."""
        blocks: list[BlockId] = []
        hashes: list[BlockHash] = []
        parents: list[BlockHash | None] = []
        for r, start, run in runs:
            stop = start + len(run)
            hashes += r.block_hashes[start:stop]
            parents += [r.block_hashes[i - 1] if i else None for i in range(start, stop)]
            blocks += run
        if not blocks:
            return None
        batch = Batch(Direction.LOAD, blocks, [], [], hashes=hashes, parents=parents,
                      num_bytes=len(blocks) * self.block_bytes, shared=True, prefetch=prefetch)
        return batch, SharedPlan(Direction.LOAD, blocks, hashes)

    # -- puts -----------------------------------------------------------------

    def written(self, hashes: Iterable[BlockHash]) -> None:
        """A CPU store committed ``hashes``: queue them for the shared tier (write-through)."""
        if self.spec.write == "write-through":
            self._queued.update(dict.fromkeys(hashes))

    def plan_puts(self) -> tuple[Batch, SharedPlan] | None:
        """This step's put batch: queued hashes (write-through) or the CPU pool's next victims (write-back).

        Skips hashes in flight, put or fetched before, or gone from the CPU
        tier; while the tier is off nothing is put (``stats.puts_skipped``).
        """
        queued, self._queued = self._queued, {}
        cands: list[BlockHash | None] = list(queued)
        if self._writeback:  # only with an EvictionOrder pool (checked when built)
            block_hash = self.cpu.block_hash
            cands += [block_hash(b) for b in cast(EvictionOrder, self.cpu).eviction_candidates(self._writeback)]
        flying, known, lookup = self._flying, self._fresh(self._known), self.cpu.lookup
        hashes, blocks = [], []
        for h in dict.fromkeys(cands):
            if h is None or h in flying or h in known:
                continue
            found = lookup((h,))
            if found:
                hashes.append(h)
                blocks.append(found[0])
        if not hashes:
            return None
        if not self.available:
            self.stats.puts_skipped.add(len(hashes))
            return None
        budget = self.gate.budget()
        if len(hashes) > budget:  # congested: the rest waits for a later step, within a bounded backlog
            keep = int(budget)
            self._defer(hashes[keep:])
            hashes, blocks = hashes[:keep], blocks[:keep]
            if not hashes:
                return None
        self.gate.started(len(hashes))
        self.cpu.incref(blocks)
        flying.update(hashes)
        batch = Batch(Direction.STORE, blocks, [], [], hashes=hashes,
                      num_bytes=len(blocks) * self.block_bytes, shared=True)
        return batch, SharedPlan(Direction.STORE, blocks, hashes)

    # -- completion, reset, checks --------------------------------------------

    def _defer(self, hashes: list[BlockHash]) -> None:
        """Queue held-back puts again (write-through), keeping the newest ``cpu.num_blocks``."""
        if self.spec.write != "write-through":
            return  # write-back offers the CPU pool's next victims again at the next step
        backlog = dict.fromkeys(hashes) | self._queued
        over = len(backlog) - self.cpu.num_blocks
        if over > 0:
            self.stats.puts_backpressured.add(over)
            backlog = dict.fromkeys(list(backlog)[over:])
        self._queued = backlog

    def settled(self, batch: Batch, ok: bool) -> None:
        """A shared batch completed on every worker (``ok``: it landed and no reset abandoned it).

        A fetch that landed but for its ``lost`` blocks settles key by key: the
        blocks that landed as a fetch that landed, the lost ones as a failed
        fetch of their own (``on_shared_fetch`` once for each part).
        """
        put = batch.direction is Direction.STORE
        if put:
            self.gate.finished(len(batch.hashes), batch.seconds)
        if put and not batch.abandoned:  # an abandoned one's hashes were forgotten by the reset
            self._flying.difference_update(batch.hashes)
        landed, failed = (batch.hashes, []) if ok else ([], batch.hashes)
        if ok and batch.lost:
            landed, failed = batch.intact(batch.hashes), [batch.hashes[i] for i in batch.lost]
        for h in landed:
            self._refused.pop(h, None)
        self._remember(landed)
        if failed and not batch.abandoned:
            (self.stats.puts_failed if put else self.stats.fetches_failed).add(len(failed))
            for h in failed:
                self._known.pop(h, None)
            if not put:
                self._note(self._refused, failed)
            self.suspect(f"a shared-tier {'put' if put else 'fetch'} of {plural(len(failed), 'block')} failed")
        event = "on_shared_put" if put else "on_shared_fetch"
        for part, landed_ok in ((landed, True), (failed, False)):
            if part:
                self.events.emit(event, len(part), landed_ok)

    def reset(self) -> None:
        """Forget queued puts and puts in flight (a reset abandons them)."""
        self._queued.clear()
        self._flying.clear()

    def check_invariants(self, batches: Iterable[Batch]) -> None:
        """Check the puts in flight against the batches in flight."""
        flying: list[BlockHash] = []
        for b in batches:
            if b.shared and b.direction is Direction.STORE and not b.abandoned:
                flying += b.hashes
        assert len(flying) == len(set(flying)), "a hash has two shared puts in flight"
        assert set(flying) == self._flying, "shared in-flight set != uncommitted puts"
        for name, memory in (("known", self._known), ("lost", self._lost), ("refused", self._refused)):
            assert len(memory) <= self._known_cap, f"the {name}-hash memory outgrew its cap"
            times = list(memory.values())
            assert times == sorted(times), f"the {name}-hash memory is not in the order it was noted"

    def _remember(self, hashes: Iterable[BlockHash]) -> None:
        self._note(self._known, hashes)

    def _note(self, memory: OrderedDict[BlockHash, float], hashes: Iterable[BlockHash]) -> None:
        """Note ``hashes`` in ``memory`` as of now (newest last), keeping the newest ``4 * cpu.num_blocks``."""
        now = self.spec.clock()
        for h in hashes:
            memory[h] = now
            memory.move_to_end(h)
        while len(memory) > self._known_cap:
            memory.popitem(last=False)

    def _fresh(self, memory: OrderedDict[BlockHash, float]) -> OrderedDict[BlockHash, float]:
        """``memory``, its hashes noted ``trust_s`` or longer ago forgotten first."""
        while memory and self._expired(next(iter(memory.values()))):
            memory.popitem(last=False)
        return memory

    def _expired(self, when: float) -> bool:
        """Whether a hash noted at ``when`` lapsed: ``spec.trust_s`` ago, or as long ago as the store keeps a value."""
        return self.spec.clock() - when >= self._trust_s
