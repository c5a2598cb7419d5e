"""Offload statistics: counters that can only grow.

Every figure is a :class:`Counter` whose :meth:`Counter.add` rejects negative
amounts, so no code path can drive a statistic below zero (the resumed-request
hit counter that went negative in the field cannot happen here). Rates and
ratios are derived from the counters, never stored.
"""

from __future__ import annotations

import attrs

__all__ = ["Counter", "OffloadStats"]


@attrs.define
class Counter:
    """A running total that only grows.

    Invariants: ``value >= 0`` and never decreases.
    """

    value: int | float = 0

    def add(self, amount: int | float = 1) -> None:
        """Add ``amount`` (``>= 0``).

        Raises:
            ValueError: ``amount`` is negative or NaN; the counter is unchanged.
        """
        if not amount >= 0:  # also rejects NaN
            raise ValueError(f"a counter only grows; got add({amount!r})")
        self.value += amount

    def __int__(self) -> int:
        return int(self.value)

    def __float__(self) -> float:
        return float(self.value)


def _counter() -> Counter:
    return attrs.field(factory=Counter)


@attrs.define
class OffloadStats:
    """What an :class:`~kvkit.manager.OffloadManager` did, as non-negative counters.

    Hits are counted when the engine commits to them (``on_allocated``), so a
    lookup repeated before allocation is not counted twice.

    Attributes:
        lookups: calls to ``lookup``.
        scheduled_requests: allocations after a lookup (a resumed request counts again; one the engine
            schedules again after its load failed does not: ``preempt(..., load_failed=True)``).
        query_tokens: tokens of those requests when they were scheduled.
        gpu_hit_tokens: tokens the engine found in its own GPU prefix cache.
        cpu_hit_tokens: tokens the engine accepted from the CPU tier.
        blocks_stored / bytes_stored: blocks that became findable on the CPU tier,
            and the bytes their copies moved (every group).
        blocks_loaded / bytes_loaded: CPU blocks loaded back, and the bytes moved.
        stores_deduplicated: store candidates dropped because the CPU tier held the hash.
        stores_in_flight: store candidates dropped because a store of the hash
            was in flight (or came earlier in the same step).
        stores_dropped: store candidates dropped because the CPU tier had no
            free block (the engine is never failed for it).
        evictions_gpu / evictions_cpu: blocks each tier's pool evicted (an
            engine's own GPU pool, as vLLM's, evicts without telling kvkit:
            ``evictions_gpu`` counts only pools kvkit allocates from).
        transfers_submitted / transfers_completed: transfers (one plan each)
            entering a step plan / completing on every worker.
        transfers_failed: transfers some worker reported ``ok=False``.
        transfers_abandoned: transfers in flight at a ``reset`` (never committed).
        loads_failed: requests told to recompute because their load failed or
            was abandoned.
        unknown_completions: results naming a transfer id the manager does not
            know (or a worker rank outside ``[0, world_size)``); ignored.
        duplicate_completions: a second result for a transfer from one worker; ignored.
        transfer_seconds / transfer_bytes: copy time and bytes the workers reported.
        resets: times the CPU tier was emptied.
        forced_resets: resets that did not wait for transfers in flight
            (``reset(force=True)``); their blocks stay quarantined until they report.
        callback_errors: exceptions callbacks raised (each swallowed and reported
            once per callback and hook as a ``RuntimeWarning``).
        store_policy_errors: store-policy calls that raised or answered
            something other than int block indices (treated as "store nothing").
        shared_hit_tokens: tokens the engine accepted from the shared tier
            (fetched into CPU blocks, then loaded like a CPU hit).
        blocks_fetched / bytes_fetched: shared-tier blocks that landed in CPU
            blocks on every worker, and the bytes per worker.
        fetches_failed: blocks of fetches that failed on some worker (a key
            gone, a value that failed its checks, a sick server): their
            requests recompute.
        blocks_prefetched: of ``blocks_fetched``, blocks a prefetch (a waiting
            request's shared-tier hit, ``OffloadManager.prefetch``) landed in
            the CPU tier.
        blocks_put / bytes_put: CPU blocks every worker put into the shared
            tier, and the bytes per worker.
        puts_failed: blocks of puts that failed on some worker.
        puts_skipped: blocks not put because the shared tier was off (backing off).
        blocks_found_lost: CPU-tier blocks a lookup checked (their shared copy no longer
            remembered as held) and took as lost by the shared tier (absent, or after the
            first absent one: a restart, a flush, an eviction); write-through puts them again.
        shared_outages: times the shared tier was turned off after a failure.
        shared_probes / shared_recoveries: probes sent to a suspect or
            backed-off server, and the times it came back on.
        hits_declined_cpu / hits_declined_shared: hit tokens each tier offered
            that were not loaded (recomputed instead: a plan's head, the end
            of the hit it declined, or what the engine did not accept).
        hit_tokens_overlapped: hit tokens recomputed as a plan's head while
            the rest of the hit loaded.
        plan_saved_ms: the load planner's estimate of the prefill time its
            plans saved against loading every hit, summed (ms).
        planner_errors: planner calls that raised or answered no plan for the
            hit (the whole hit was loaded instead).
        stores_backpressured: store candidates dropped because the CPU tier's
            writes were congested or too many were in flight (see
            :mod:`kvkit.manager.backpressure`).
        puts_backpressured: hashes not put into the shared tier because its
            puts were congested and the backlog of deferred puts was full.
    """

    lookups: Counter = _counter()
    scheduled_requests: Counter = _counter()
    query_tokens: Counter = _counter()
    gpu_hit_tokens: Counter = _counter()
    cpu_hit_tokens: Counter = _counter()
    blocks_stored: Counter = _counter()
    bytes_stored: Counter = _counter()
    blocks_loaded: Counter = _counter()
    bytes_loaded: Counter = _counter()
    stores_deduplicated: Counter = _counter()
    stores_in_flight: Counter = _counter()
    stores_dropped: Counter = _counter()
    evictions_gpu: Counter = _counter()
    evictions_cpu: Counter = _counter()
    transfers_submitted: Counter = _counter()
    transfers_completed: Counter = _counter()
    transfers_failed: Counter = _counter()
    transfers_abandoned: Counter = _counter()
    loads_failed: Counter = _counter()
    unknown_completions: Counter = _counter()
    duplicate_completions: Counter = _counter()
    transfer_seconds: Counter = _counter()
    transfer_bytes: Counter = _counter()
    resets: Counter = _counter()
    forced_resets: Counter = _counter()
    callback_errors: Counter = _counter()
    store_policy_errors: Counter = _counter()
    shared_hit_tokens: Counter = _counter()
    blocks_fetched: Counter = _counter()
    bytes_fetched: Counter = _counter()
    fetches_failed: Counter = _counter()
    blocks_prefetched: Counter = _counter()
    blocks_put: Counter = _counter()
    bytes_put: Counter = _counter()
    puts_failed: Counter = _counter()
    puts_skipped: Counter = _counter()
    blocks_found_lost: Counter = _counter()
    shared_outages: Counter = _counter()
    shared_probes: Counter = _counter()
    shared_recoveries: Counter = _counter()
    hits_declined_cpu: Counter = _counter()
    hits_declined_shared: Counter = _counter()
    hit_tokens_overlapped: Counter = _counter()
    plan_saved_ms: Counter = _counter()
    planner_errors: Counter = _counter()
    stores_backpressured: Counter = _counter()
    puts_backpressured: Counter = _counter()

    @property
    def cpu_hit_rate(self) -> float:
        """Fraction of scheduled tokens served by the CPU tier (0 before any request)."""
        q = self.query_tokens.value
        return self.cpu_hit_tokens.value / q if q else 0.0

    @property
    def gpu_hit_rate(self) -> float:
        """Fraction of scheduled tokens served by the GPU prefix cache (0 before any request)."""
        q = self.query_tokens.value
        return self.gpu_hit_tokens.value / q if q else 0.0

    @property
    def shared_hit_rate(self) -> float:
        """Fraction of scheduled tokens served by the shared tier (0 before any request)."""
        q = self.query_tokens.value
        return self.shared_hit_tokens.value / q if q else 0.0

    def as_dict(self) -> dict[str, int | float]:
        """Every counter's value by name, plus the derived hit rates."""
        out = {f.name: getattr(self, f.name).value for f in attrs.fields(type(self))}
        out["cpu_hit_rate"] = self.cpu_hit_rate
        out["gpu_hit_rate"] = self.gpu_hit_rate
        out["shared_hit_rate"] = self.shared_hit_rate
        return out
