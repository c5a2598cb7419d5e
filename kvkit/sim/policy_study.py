"""Replay a trace through the real ``BlockPool`` to compare eviction policies.

Hit semantics (an offload tier's, one request at a time):

* A request references its blocks in order; a block *hits* only while every
  earlier block of the request hit too (the longest cached prefix, as
  :meth:`~kvkit.interfaces.allocator.BlockAllocator.lookup` finds it).
  ``hit_ratio`` is hit block references over all block references.
* ``stores="per-block"`` (the default, a CPU tier's view): the hits are
  pinned, touched and released (their load is over before the request's
  stores begin); then every later block the tier does not hold is stored, in
  order, one block at a time: each gets a fresh block (evicting through the
  policy; any block not in use may go, the request's own hits and its earlier
  stored blocks included) and is committed under its hash with its chain
  parent. A block past the first miss that is still cached stays where it is,
  untouched (nothing needs storing). These are the rules of a classic cache
  simulator fed the request's blocks as objects (libCacheSim counting prefix
  hits: :func:`kvkit.sim.baselines.libcachesim_study` with ``prefix=True``),
  so the same rule scores the same in both, and ``"opt"`` hits at least as
  often as Belady (it also knows the next use of a block left untouched).
* ``stores="per-request"`` (an engine's prefix cache, which must hold a
  request's whole prompt while it runs): the hits stay pinned while every
  other block of the request gets a fresh block at once, so none of the
  request's blocks can evict another; a block past the first miss that is
  still cached stays where it is unless that allocation evicted it. A request
  larger than the pool caches only its first ``capacity`` blocks.
* Either way all references are dropped after the request, and requests run
  one after another, never concurrently.

The offline optimum (``"opt"``) is built from the trace's reference string and
its clock advanced once per block reference, before the lookup.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import attrs

from kvkit.backends.allocator.pool import BlockPool
from kvkit.config import DEFAULTS
from kvkit.errors import ConfigError
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.hints import HintAwarePolicy, WorkloadHints
from kvkit.interfaces.types import BlockHash
from kvkit.registry import EVICTION
from kvkit.sim.traces import TraceRequest
from kvkit.validate import check_int, plural, quote

__all__ = ["OPT", "STORES", "HitStats", "PolicyStudy", "TraceClock", "check_stores", "check_study",
           "default_policies", "replay", "study"]

OPT = "opt"
"""Registry name of the offline optimum, the yardstick of every study."""

STORES = ("per-block", "per-request")
"""How a replay stores a request's missing blocks (see the module docstring); the first is the default."""


@attrs.frozen
class HitStats:
    """Hits of one policy at one capacity over one trace.

    Attributes:
        policy: the policy's registry name (or class name for an instance).
        capacity: blocks in the pool.
        hits: block references that hit (prefix-aware).
        references: all block references of the trace.
        seconds: wall time of the replay.

    Invariants: ``0 <= hits <= references``.
    """

    policy: str
    capacity: int
    hits: int
    references: int
    seconds: float = 0.0

    def __attrs_post_init__(self) -> None:
        assert 0 <= self.hits <= self.references, (self.hits, self.references)

    @property
    def hit_ratio(self) -> float:
        """Hit block references over all block references (0 for an empty trace)."""
        return self.hits / self.references if self.references else 0.0


def _make_policy(name: str, requests: Sequence[TraceRequest], clock: TraceClock | None = None) -> EvictionPolicy:
    """The registered policy ``name`` for ``requests``; one that reads time is built with ``clock`` when given."""
    if name == OPT:
        return EVICTION.create(OPT, slot="policy",
                               references=[h for r in requests for h in r.hash_ids])
    cls = EVICTION.load(name)
    if clock is not None and isinstance(cls, type) and attrs.has(cls) and "clock" in attrs.fields_dict(cls):
        return EVICTION.create(name, slot="policy", clock=clock)
    return EVICTION.create(name, slot="policy")


def check_stores(stores: object) -> str:
    """``stores`` if it is one of :data:`STORES`.

    Raises:
        ConfigError: anything else, quoted.
    """
    if stores not in STORES:
        raise ConfigError(f"stores must be one of {', '.join(STORES)}, got {stores!r}")
    return stores


def replay(requests: Sequence[TraceRequest], capacity: int,
           policy: str | EvictionPolicy = DEFAULTS.cpu_eviction, *, stores: str = STORES[0],
           check_invariants: bool = False,
           hints: Sequence[WorkloadHints | None] | None = None, clock: TraceClock | None = None) -> HitStats:
    """Replay ``requests`` through a ``BlockPool`` of ``capacity`` blocks; count prefix hits.

    Args:
        requests: the trace, in time order.
        capacity: blocks in the pool.
        policy: a registered eviction policy name, or a fresh instance that
            tracks no blocks. An instance with an ``observe(hash)`` method
            (the offline optimum) is told every block reference before its lookup.
        stores: ``"per-block"`` or ``"per-request"`` (see the module docstring).
        check_invariants: check the pool and policy after every request (slow; tests).
        hints: one per request (or ``None``), told with its hashes to a
            :class:`~kvkit.interfaces.hints.HintAwarePolicy` before its lookup,
            as :meth:`~kvkit.manager.manager.OffloadManager.add_request` does.
        clock: set to each request's timestamp (seconds) before its lookup;
            a policy that reads time (retention hints) is built with it: a
            policy given by name that has a ``clock`` field gets this one.

    Raises:
        ConfigError: unknown policy name, bad capacity or ``stores``, or ``hints`` not one per request.
    """
    capacity = check_int("capacity", capacity, 1)
    per_block = check_stores(stores) == STORES[0]
    name = policy if isinstance(policy, str) else type(policy).__name__
    if clock is not None and not isinstance(clock, TraceClock):
        raise ConfigError(f"clock={quote(clock)}: must be a TraceClock or None")
    instance = _make_policy(policy, requests, clock) if isinstance(policy, str) else policy
    pool = BlockPool(capacity, eviction=instance)
    observe: Callable[[int], None] | None = getattr(instance, "observe", None)
    lookup, incref, touch = pool.lookup, pool.incref, pool.touch
    allocate, commit, decref = pool.allocate, pool.commit, pool.decref
    hits = references = 0
    start = time.perf_counter()
    if hints is not None and len(hints) != len(requests):
        raise ConfigError(f"hints must be one per request: {len(hints)} for {plural(len(requests), 'request')}")
    hear = instance.on_hints if hints is not None and isinstance(instance, HintAwarePolicy) else None
    told: Sequence[WorkloadHints | None] = hints if hints is not None else ()
    for i, request in enumerate(requests):
        hashes = cast("tuple[BlockHash, ...]", request.hash_ids)  # a trace's ids are the blocks' hashes
        if clock is not None:
            clock.now = request.timestamp_ms / 1000
        if hear is not None and (hint := told[i]) is not None:
            hear(hashes, hint)
        if observe is not None:
            for h in hashes:
                observe(h)
        hit = lookup(hashes)
        n_hit = len(hit)
        incref(hit)
        touch(hit)
        if per_block:
            decref(hit)
            for at in range(n_hit, len(hashes)):
                if not lookup(hashes[at:at + 1]):  # a block the tier still holds needs no store
                    new = allocate(1)
                    commit(new, hashes[at:at + 1], (hashes[at - 1] if at else None,))
                    decref(new)
        else:
            stop = min(len(hashes), capacity)  # hits are cached, so n_hit <= stop
            if stop > n_hit:
                new = allocate(stop - n_hit)
                parents = hashes[n_hit - 1:stop - 1] if n_hit else (None, *hashes[:stop - 1])
                commit(new, hashes[n_hit:stop], parents)
                decref(new)
            decref(hit)
        hits += n_hit
        references += len(hashes)
        if check_invariants:
            pool.check_invariants()
    return HitStats(name, capacity, hits, references, time.perf_counter() - start)


@attrs.define
class TraceClock:
    """Trace time in seconds (what :func:`replay` last set); call it for the time."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


HINTED = "hinted"
"""Registry name of the hint-aware policy: without hints it replays exactly as its base."""


def default_policies() -> list[str]:
    """Every registered eviction policy but ``hinted`` (its base's twin on a trace), the optimum last."""
    return [n for n in EVICTION.names() if n not in (OPT, HINTED)] + [OPT]


@attrs.frozen
class PolicyStudy:
    """Hit ratios of several policies at several capacities over one trace.

    Invariants: one :class:`HitStats` per (policy, capacity) pair, the
    optimum's included.
    """

    policies: tuple[str, ...]
    capacities: tuple[int, ...]
    stats: dict[tuple[str, int], HitStats]

    def hit_ratio(self, policy: str, capacity: int) -> float:
        """``policy``'s hit ratio at ``capacity``."""
        return self.stats[policy, capacity].hit_ratio

    def of_opt(self, policy: str, capacity: int) -> float | None:
        """``policy``'s hit ratio as a share of the optimum's (``None`` if the optimum hits nothing)."""
        best = self.hit_ratio(OPT, capacity)
        return self.hit_ratio(policy, capacity) / best if best else None

    def results(self) -> dict[str, dict[str, dict[str, float | None]]]:
        """``{"<capacity>": {"<policy>": {"hit_ratio": h, "of_opt": s}}}`` (JSON-ready)."""
        return {
            str(c): {p: {"hit_ratio": self.hit_ratio(p, c), "of_opt": self.of_opt(p, c)}
                     for p in self.policies}
            for c in self.capacities
        }


_worker_requests: Sequence[TraceRequest] = ()


def _init_worker(requests: Sequence[TraceRequest]) -> None:
    global _worker_requests
    _worker_requests = requests


def _replay_in_worker(policy: str, capacity: int, stores: str) -> HitStats:
    return replay(_worker_requests, capacity, policy, stores=stores)


def check_study(capacities: Iterable[int], policies: Iterable[str] | None = None, *,
                slot: str = "policy") -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The policies (the optimum last) and capacities, duplicates dropped, that :func:`study` replays.

    ``slot`` names the policies where an error quotes them (a CLI passes its flag).

    Raises:
        ConfigError: an unknown policy or a bad capacity (every bad policy at once).
    """
    capacities = tuple(dict.fromkeys(check_int("capacity", c, 1) for c in capacities))
    if not capacities:
        raise ConfigError("a policy study needs at least one capacity, got none")
    names = list(dict.fromkeys(default_policies() if policies is None else policies))
    problems = [p for p in (EVICTION.check(n, slot=slot) for n in names) if p is not None]
    if problems:
        raise ConfigError(problems)
    return (*(n for n in names if n != OPT), OPT), capacities


def study(requests: Sequence[TraceRequest], capacities: Iterable[int],
          policies: Iterable[str] | None = None, *, stores: str = STORES[0], jobs: int | None = None,
          on_result: Callable[[HitStats], None] | None = None) -> PolicyStudy:
    """Replay ``requests`` for every (policy, capacity) pair, in parallel processes.

    Args:
        requests: the trace, in time order.
        capacities: pool sizes in blocks.
        policies: registered eviction policy names (default: all of them);
            the optimum is always added, since every ratio is shared against it.
        stores: how each replay stores a request's missing blocks (:data:`STORES`).
        jobs: worker processes (default: one per CPU, at most one per pair);
            ``1`` replays in this process. Each worker receives the trace once.
        on_result: called in this process as each replay finishes.

    Raises:
        ConfigError: an unknown policy, a bad capacity, ``stores`` or ``jobs``;
            raised before any replay starts.
    """
    names, capacities = check_study(capacities, policies)
    check_stores(stores)
    # The optimum is usually the slowest replay, and big pools are slower: start those first.
    pairs = sorted(((p, c) for p in names for c in capacities),
                   key=lambda pc: (pc[0] != OPT, -pc[1]))
    if jobs is None:
        jobs = min(os.cpu_count() or 1, len(pairs))
    check_int("jobs", jobs, 1)
    stats: dict[tuple[str, int], HitStats] = {}

    def record(s: HitStats) -> None:
        stats[s.policy, s.capacity] = s
        if on_result is not None:
            on_result(s)

    if jobs == 1:
        for p, c in pairs:
            record(replay(requests, c, p, stores=stores))
    else:
        with concurrent.futures.ProcessPoolExecutor(
                jobs, initializer=_init_worker, initargs=(requests,)) as pool:
            futures = [pool.submit(_replay_in_worker, p, c, stores) for p, c in pairs]
            for future in concurrent.futures.as_completed(futures):
                record(future.result())
    return PolicyStudy(names, capacities, stats)
