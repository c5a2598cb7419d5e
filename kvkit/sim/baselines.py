"""The field's cache baselines (libCacheSim) on a trace, as a plain block stream.

libCacheSim (the ``libcachesim`` package, extra ``kvkit[libcachesim]``)
simulates classic object caches. Here every block reference of the trace, in
order, is one request for an object of size 1 in a cache of ``capacity``
objects: *plain* counting, a hit whenever the block is cached, whether or not
the blocks before it in its request hit. kvkit's own replays count prefix
hits (:mod:`kvkit.sim.policy_study`), which a block cached after its
request's first miss does not earn, so the two agree exactly only for rules
that never keep a block without its parent (LRU on chains), and a plain
ratio is an upper bound for the same cache contents. With ``prefix=True``
the same caches count as kvkit does: a request's blocks are looked up in
order until the first miss; after it, a cached block is left untouched (not
counted, not promoted) and an uncached one is inserted. ``Belady`` is
libCacheSim's offline optimum, fed each reference's next use.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import numpy as np

from kvkit.errors import BackendUnavailableError, ConfigError
from kvkit.sim.policy_study import HitStats
from kvkit.sim.traces import TraceRequest
from kvkit.validate import check_int

__all__ = ["LIBCACHESIM_POLICIES", "PREFIX", "libcachesim_study"]

LIBCACHESIM_POLICIES = ("LRU", "ARC", "S3FIFO", "LIRS", "WTinyLFU", "LFU", "TwoQ", "Sieve",
                        "Cacheus", "LeCaR", "LHD", "Belady")
"""libCacheSim's policies run by default (class names of the ``libcachesim`` package)."""

PREFIX = "lcs:"
"""What baseline names carry in reports (``lcs:LRU``), apart from kvkit's policies."""

_NEVER = 2**62  # next_access_vtime of a last reference (libCacheSim reads any huge value as never)


def _next_uses(keys: np.ndarray) -> np.ndarray:
    """For each reference, the index of the next reference of the same key (``_NEVER`` if none)."""
    n = len(keys)
    order = np.lexsort((np.arange(n), keys))  # by key, then time
    nxt = np.full(n, _NEVER, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def libcachesim_study(requests: Iterable[TraceRequest], capacities: Iterable[int],
                      policies: Iterable[str] = LIBCACHESIM_POLICIES, *, prefix: bool = False) -> list[HitStats]:
    """Hit counts of libCacheSim's ``policies`` at every capacity, plain unless ``prefix``.

    ``requests`` may be any iterable, :func:`~kvkit.sim.traces.read_trace`'s
    iterator included (read once).

    Each :class:`~kvkit.sim.policy_study.HitStats` names its policy
    ``lcs:<name>``; plain ``hits`` count every reference of a cached block,
    prefix ``hits`` only those in a request's leading run of hits.

    Raises:
        BackendUnavailableError: the ``libcachesim`` package is not installed.
        ConfigError: a bad capacity, or a name that is not a libCacheSim cache
            (the valid defaults are listed); raised before any replay.
    """
    try:
        import libcachesim
    except ImportError:
        raise BackendUnavailableError(
            "libCacheSim baselines need the libcachesim package: pip install 'kvkit[libcachesim]'") from None
    capacities = tuple(dict.fromkeys(check_int("capacity", c, 1) for c in capacities))
    names = tuple(dict.fromkeys(policies))
    bad = [n for n in names if not isinstance(getattr(libcachesim, n, None), type)
           or not issubclass(getattr(libcachesim, n), libcachesim.CacheBase)]
    if bad or not names:
        raise ConfigError(f"not libCacheSim caches: {bad!r}; valid: {', '.join(LIBCACHESIM_POLICIES)}")
    requests = tuple(requests)
    keys = np.fromiter((h for r in requests for h in r.hash_ids), dtype=np.int64)
    pairs = list(zip(keys.tolist(), _next_uses(keys).tolist(), strict=True))
    # Where each request starts in the reference string (prefix counting restarts there).
    starts = set(itertools.accumulate((len(r.hash_ids) for r in requests[:-1]), initial=0))
    results = []
    for name in names:
        for capacity in capacities:
            cache = getattr(libcachesim, name)(cache_size=capacity)
            request = libcachesim.Request()
            get, find = cache.get, cache.find
            start = time.perf_counter()
            hits = 0
            in_prefix = True
            for clock, (key, next_use) in enumerate(pairs):
                request.obj_id, request.clock_time, request.next_access_vtime = key, clock, next_use
                if not prefix:
                    hits += get(request)
                    continue
                if clock in starts:
                    in_prefix = True
                if in_prefix:
                    in_prefix = get(request)
                    hits += in_prefix
                elif find(request, False) is None:  # past the first miss: insert, never count or promote
                    get(request)
            results.append(HitStats(PREFIX + name, capacity, hits, len(pairs), time.perf_counter() - start))
    return results
