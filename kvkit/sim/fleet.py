"""Many engine instances behind a router: a trace through N real stacks, with and without a shared tier.

Each instance is a :class:`~kvkit.sim.simulator.Simulator` (its own GPU and
CPU tiers, manager and clock); a router sends every request of the trace to
one of them, in arrival order. With a shared tier all instances use one
store, so a prefix one instance computed and put is a shared hit for the
others; without one (``shared=None``) they are isolated and each recomputes
what the others already computed. :func:`compare_fleets` runs both on the
same trace.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kvkit.errors import ConfigError
from kvkit.sim.simulator import SimConfig, SimResult, Simulator
from kvkit.sim.traces import TraceRequest

__all__ = ["ROUTERS", "FleetResult", "compare_fleets", "simulate_fleet"]

ROUTERS = ("round-robin", "session")
"""``round-robin``: request ``i`` goes to instance ``i % N``. ``session``: by the hash of its second
block (its first if it has one): the turns of one conversation share their leading blocks and meet
on one instance, while a system prompt every request shares (the first block) does not pin them all
to one."""

_SUMMED = ("requests", "skipped_requests", "queued_requests", "prompt_tokens", "block_references",
           "gpu_hit_tokens", "cpu_hit_tokens", "shared_hit_tokens", "computed_tokens", "overlapped_tokens",
           "declined_cpu", "declined_shared", "blocks_stored", "blocks_loaded", "evictions_gpu", "evictions_cpu",
           "leaked_blocks")


@attrs.frozen
class FleetResult:
    """What N instances measured together (sums of their :class:`SimResult` s, TTFT of every request).

    Attributes:
        router: one of :data:`ROUTERS`.
        shared: whether the instances shared a tier.
        instances: each instance's result.
    """

    router: str
    shared: bool
    instances: tuple[SimResult, ...]

    def total(self, figure: str) -> int:
        """The sum of ``figure`` (a ``SimResult`` count such as ``"shared_hit_tokens"``) over instances."""
        return sum(getattr(r, figure) for r in self.instances)

    def stat(self, counter: str) -> int | float:
        """The sum of one manager counter (an ``OffloadStats`` name such as ``"shared_outages"``) over instances."""
        return sum(r.stats[counter] for r in self.instances)

    @property
    def ttft_ms(self) -> array:
        """Modelled TTFT of every request of every instance."""
        out = array("d")
        for r in self.instances:
            out.extend(r.ttft_ms)
        return out

    def ttft_summary(self) -> dict[str, float]:
        """Percentiles (p50, p90, p99) and mean of the modelled TTFT of all requests, in ms."""
        import numpy as np

        ttft = np.frombuffer(self.ttft_ms, dtype=np.float64) if len(self.ttft_ms) else np.zeros(1)
        out = {f"p{q}": round(float(np.percentile(ttft, q)), 3) for q in (50, 90, 99)}
        out["mean"] = round(float(ttft.mean()), 3)
        return out

    def as_dict(self) -> dict[str, Any]:
        """Totals, the TTFT summary and each instance's figures (its load planner's estimates too), JSON-ready."""
        return {"router": self.router, "shared": self.shared, "instances": len(self.instances),
                **{f: self.total(f) for f in _SUMMED}, "ttft_model_ms": self.ttft_summary(),
                **{c: self.stat(c) for c in _SHARED_COUNTERS},
                "per_instance": [{**{f: getattr(r, f) for f in _SUMMED}, "planner": dict(r.planner)}
                                 for r in self.instances]}


_SHARED_COUNTERS = ("blocks_put", "puts_failed", "blocks_fetched", "blocks_prefetched", "fetches_failed",
                    "shared_outages", "shared_recoveries")


def _route(router: str, n: int) -> Callable[[int, TraceRequest], int]:
    if router == "round-robin":
        return lambda i, req: i % n
    return lambda i, req: hash(req.hash_ids[min(1, len(req.hash_ids) - 1)] if req.hash_ids else i) % n


def simulate_fleet(requests: Iterable[TraceRequest], config: SimConfig, *, instances: int,
                   router: str = "round-robin",
                   progress: Callable[[int, int], None] | None = None) -> FleetResult:
    """Replay ``requests`` through ``instances`` simulators built from ``config``, routed by ``router``.

    ``config.stack.shared`` is given to every instance: one ``BlockStore``
    instance (or a URL) for a fleet that shares a tier, ``None`` for isolated ones.

    Raises:
        ConfigError: ``instances`` is not an int >= 1, or an unknown ``router``.
    """
    if instances.__class__ is not int or instances < 1:
        raise ConfigError(f"instances={instances!r}: must be an int >= 1")
    if router not in ROUTERS:
        raise ConfigError(f"router={router!r}: unknown; valid: {', '.join(ROUTERS)}")
    sims = [Simulator(config) for _ in range(instances)]
    route = _route(router, instances)
    read = refs = 0
    try:
        for i, request in enumerate(requests):
            sims[route(i, request)].feed(request)
            read += 1
            refs += len(request.hash_ids)
            if progress is not None and not read % 256:
                progress(read, refs)
    except BaseException:
        for sim in sims:
            sim.abort()
        raise
    if progress is not None:
        progress(read, refs)
    return FleetResult(router, config.stack.shared is not None, tuple(sim.close() for sim in sims))


def compare_fleets(requests: Callable[[], Iterable[TraceRequest]], config: SimConfig, *, instances: int,
                   router: str = "round-robin", shared: Any = None) -> tuple[FleetResult, FleetResult]:
    """The same trace through ``instances`` isolated instances, then through as many sharing one tier.

    Args:
        requests: called once per run, each time a fresh iterable of the trace.
        config: the instances' configuration (its ``shared`` slot is replaced).
        shared: the store the second run shares (default: a fresh in-process
            :class:`~kvkit.backends.blockstore.memory.MemoryStore`), or a URL.

    Returns:
        ``(isolated, sharing)``.
    """
    from kvkit.backends.blockstore.memory import MemoryStore

    isolated = simulate_fleet(requests(), config.replace(shared=None), instances=instances, router=router)
    store = MemoryStore() if shared is None else shared
    sharing = simulate_fleet(requests(), config.replace(shared=store), instances=instances, router=router)
    return isolated, sharing
