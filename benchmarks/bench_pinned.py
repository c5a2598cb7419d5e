"""Eviction cost in a ``BlockPool`` whose blocks are mostly pinned by running requests.

A seeded generator writes a trace of request starts and finishes, before any
timing, that keeps a fixed share of the pool (``--pinned``, default 90%)
referenced: a request starts only while the blocks of all running requests
(shared prefixes counted once) stay within that share, else a random running
request finishes first. Each start looks up its hash chain, pins the hits
(incref, touch), allocates the misses (evicting under pressure) and commits
them; each finish releases its blocks. The trace does not depend on the policy,
so every policy replays the same calls and pins the same blocks.

Each policy runs twice where it has pin hooks: with them (the pool tells it
``on_pin``/``on_unpin``) and without (a subclass that opts out, so it skips
pinned blocks by scanning, as every policy did before the hooks). Times are the
whole replay and the time inside ``allocate`` (where victims are selected), each
as a ratio to LRU's in the same run.

    python benchmarks/bench_pinned.py [--requests N] [--pinned 0.9] [--policies lru,s3fifo] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import Counter

import numpy as np

from kvkit import ALLOCATOR, EVICTION, BlockAllocator, EvictionPolicy
from kvkit.interfaces import PinAwarePolicy


def make_trace(num_requests: int, seed: int, *, num_blocks: int, pinned: float,
               num_docs: int = 200, doc_blocks: int = 32,
               max_tail: int = 16) -> list[tuple[int, list[int] | None]]:
    """Starts ``(rid, chain)`` and finishes ``(rid, None)`` that keep ``pinned`` of the pool held.

    Chains are a prefix of a Zipf-popular document plus fresh blocks, so the
    pool sees prefix hits and steady eviction under pressure.
    """
    rng = np.random.default_rng(seed)
    doc_hashes = rng.integers(1, 2**62, size=(num_docs, doc_blocks)).tolist()
    popularity = 1.0 / np.arange(1, num_docs + 1) ** 0.8
    popularity /= popularity.sum()
    budget = int(pinned * num_blocks)
    next_fresh = 2**62
    trace: list[tuple[int, list[int] | None]] = []
    active: dict[int, list[int]] = {}
    held: Counter[int] = Counter()  # hash -> running requests holding it
    for rid in range(num_requests):
        doc = int(rng.choice(num_docs, p=popularity))
        prefix = int(rng.integers(1, doc_blocks + 1))
        tail = int(rng.integers(1, max_tail + 1))
        chain = doc_hashes[doc][:prefix] + list(range(next_fresh, next_fresh + tail))
        next_fresh += tail
        while active and len(held) + sum(h not in held for h in chain) > budget:
            done = list(active)[int(rng.integers(len(active)))]
            trace.append((done, None))
            held.subtract(active.pop(done))
            held += Counter()  # drop hashes no running request holds
        trace.append((rid, chain))
        active[rid] = chain
        held.update(chain)
    trace += [(rid, None) for rid in active]
    return trace


def replay(pool: BlockAllocator, trace) -> tuple[float, float, int, int, int]:
    """Run ``trace`` on ``pool``; return (seconds, seconds in allocate, calls, hits, evictions)."""
    lookup, incref, touch = pool.lookup, pool.incref, pool.touch
    allocate, commit, decref = pool.allocate, pool.commit, pool.decref
    clock = time.perf_counter
    held: dict[int, list[int]] = {}
    calls = hit_blocks = 0
    in_allocate = 0.0
    evictions = [0]
    pool.add_evict_listener(lambda blocks, hashes: evictions.__setitem__(0, evictions[0] + len(blocks)))
    start = clock()
    for rid, chain in trace:
        if chain is None:
            decref(held.pop(rid))
            calls += 1
            continue
        hits = lookup(chain)
        incref(hits)
        touch(hits)
        num_hits = len(hits)
        t0 = clock()
        new = allocate(len(chain) - num_hits)
        in_allocate += clock() - t0
        commit(new, chain[num_hits:], [None, *chain][num_hits:-1])
        held[rid] = hits + new
        hit_blocks += num_hits
        calls += 5
    seconds = clock() - start
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks, "the trace left blocks referenced"
    return seconds, in_allocate, calls, hit_blocks, evictions[0]


def variants(name: str) -> list[tuple[str, type[EvictionPolicy]]]:
    """``(label, policy class)`` for ``name``: with its pin hooks, and without if it has them."""
    cls = EVICTION.load(name)
    if not issubclass(cls, PinAwarePolicy):
        return [(name, cls)]
    hookless = type(f"Hookless{cls.__name__}", (cls,), {"on_pin": None, "on_unpin": None})
    return [(f"{name} (no hooks)", hookless), (name, cls)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000, help="requests in the trace")
    parser.add_argument("--blocks", type=int, default=4096, help="pool capacity in blocks")
    parser.add_argument("--pinned", type=float, default=0.9,
                        help="share of the pool running requests keep referenced")
    parser.add_argument("--policies", default="lru,s3fifo",
                        help="comma-separated registered eviction policies (lru always runs)")
    parser.add_argument("--repeat", type=int, default=3, help="runs each; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not 0 < args.pinned < 1:
        parser.error(f"--pinned must lie strictly between 0 and 1, got {args.pinned!r}")

    names = ["lru", *(n for n in args.policies.split(",") if n and n != "lru")]
    runs = [v for name in names for v in variants(name)]
    trace = make_trace(args.requests, args.seed, num_blocks=args.blocks, pinned=args.pinned)
    best: dict[str, tuple[float, float, int, int, int]] = {}
    for _ in range(args.repeat):  # interleaved, so drift hits all alike
        for label, cls in runs:
            result = replay(ALLOCATOR.create("pool", num_blocks=args.blocks, eviction=cls()), trace)
            if label not in best or result[0] < best[label][0]:
                best[label] = result
    lru_s, lru_alloc = best["lru"][0], best["lru"][1]
    blocks = sum(len(chain) for _, chain in trace if chain is not None)
    rows = []
    for label, (seconds, in_alloc, _calls, hits, evicted) in best.items():
        rows.append({
            "policy": label,
            "total_s": round(seconds, 4),
            "allocate_s": round(in_alloc, 4),
            "us_per_eviction": round(in_alloc / max(evicted, 1) * 1e6, 3),
            "total_vs_lru": round(seconds / lru_s, 3),
            "allocate_vs_lru": round(in_alloc / lru_alloc, 3),
            "hit_rate": round(hits / blocks, 4),
            "evictions": evicted,
        })
    result = {
        "pool_blocks": args.blocks,
        "pinned_share": args.pinned,
        "requests": args.requests,
        "calls": best["lru"][2],
        "blocks_requested": blocks,
        "python": platform.python_version(),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.blocks} blocks, {args.pinned:.0%} pinned, {args.requests} requests, "
          f"{result['calls']} calls, fastest of {args.repeat}")
    header = ["policy", "total s", "allocate s", "us/eviction", "total/LRU", "allocate/LRU",
              "hit rate", "evictions"]
    table = [[r["policy"], f"{r['total_s']:.3f}", f"{r['allocate_s']:.3f}",
              f"{r['us_per_eviction']:.2f}", f"{r['total_vs_lru']:.2f}x",
              f"{r['allocate_vs_lru']:.2f}x", f"{r['hit_rate']:.2%}", f"{r['evictions']:,}"]
             for r in rows]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))


if __name__ == "__main__":
    main()
