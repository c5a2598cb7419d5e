"""BlockPool + LRUPolicy against a minimal OrderedDict LRU cache on the same operations.

A seeded generator writes a trace of request starts and finishes before any
timing. Each start looks up the request's hash chain, pins the hits (incref,
touch), allocates blocks for the misses (evicting under pressure) and commits
them; each finish releases every block. Both caches replay the same trace;
an operation is one call (lookup, incref, touch, allocate, commit, decref).

``--memory``: host memory per block instead. Each side runs in a fresh
process: it fills a ``--memory-blocks`` pool (1,000,000) with committed,
released blocks (chains of 16, ``--hash-bits``-bit hashes, 4,096 at a time
as a manager's steps store them), then evicts a quarter of it (allocate,
commit under new hashes, release), and reports
the process's resident-set growth over its state right before, divided by
the pool size: every per-block structure of the pool and its policy
(ghosts of the evicted quarter included); the hash objects are made before
the measurement starts, as a caller holds them, on both sides. Sides:
kvkit's pool with each ``--policies`` policy, and, where vLLM imports, the
seed's CPU-tier structure (vLLM's ``BlockPool``, whose blocks its simple
offload scheduler uses as the CPU tier) filled the same way, its hashes
bytes of the same width.

    python benchmarks/bench_pool.py [--ops N] [--json]
    python benchmarks/bench_pool.py --memory [--policies hit-density,lru] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import OrderedDict

import numpy as np

from kvkit import ALLOCATOR, EVICTION, BlockAllocator

CALLS_PER_START = 5  # lookup, incref, touch, allocate, commit
CALLS_PER_FINISH = 1  # decref
_BATCH = 4096  # blocks --memory commits and releases at once (a step's stores)


def lru_pool(num_blocks: int) -> BlockAllocator:
    """kvkit's block pool with the LRU policy, the pool under test."""
    return ALLOCATOR.create("pool", num_blocks=num_blocks, eviction=EVICTION.create("lru"))


class MinimalLRUCache:
    """The least code that does the same logical work: no validation, no policy object.

    Unreferenced cached blocks sit in one OrderedDict in release order (the
    next victim first); referenced blocks leave it.
    """

    __slots__ = ("evictions", "free", "hash_of", "index", "lru", "refs")

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.index: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def lookup(self, hashes):
        get, found = self.index.get, []
        for h in hashes:
            b = get(h)
            if b is None:
                break
            found.append(b)
        return found

    def incref(self, blocks):
        refs, lru = self.refs, self.lru
        for b in blocks:
            if not refs[b]:
                del lru[b]
            refs[b] += 1

    def touch(self, blocks):
        lru = self.lru
        for b in blocks:
            if b in lru:
                lru.move_to_end(b)

    def allocate(self, n):
        free, refs = self.free, self.refs
        take = min(n, len(free))
        blocks = free[len(free) - take:]
        del free[len(free) - take:]
        if take < n:
            popitem, hash_of, index = self.lru.popitem, self.hash_of, self.index
            for _ in range(n - take):
                b = popitem(last=False)[0]
                del index[hash_of[b]]
                hash_of[b] = None
                blocks.append(b)
            self.evictions += n - take
        for b in blocks:
            refs[b] = 1
        return blocks

    def commit(self, blocks, hashes):
        index, hash_of = self.index, self.hash_of
        for b, h in zip(blocks, hashes):
            if h not in index:
                index[h] = b
                hash_of[b] = h

    def decref(self, blocks):
        refs, hash_of, lru, free = self.refs, self.hash_of, self.lru, self.free
        for b in blocks:
            r = refs[b] - 1
            refs[b] = r
            if not r:
                if hash_of[b] is None:
                    free.append(b)
                else:
                    lru[b] = None


def make_trace(num_ops: int, seed: int, *, num_docs: int = 400, doc_blocks: int = 64,
               max_tail: int = 16, concurrency: int = 16) -> list[tuple[int, list[int] | None]]:
    """Request starts ``(rid, chain)`` and finishes ``(rid, None)`` worth ``num_ops`` calls.

    Chains share prefixes of Zipf-popular documents and end in fresh blocks, so
    the pool sees prefix hits, partial hits and steady eviction pressure.
    """
    rng = np.random.default_rng(seed)
    doc_hashes = rng.integers(1, 2**62, size=(num_docs, doc_blocks)).tolist()
    popularity = 1.0 / np.arange(1, num_docs + 1) ** 0.8
    popularity /= popularity.sum()
    next_fresh, next_rid, ops = 2**62, 0, 0
    trace: list[tuple[int, list[int] | None]] = []
    active: list[int] = []
    while ops < num_ops:
        if active and (len(active) >= concurrency or rng.random() < 0.5):
            rid = active.pop(int(rng.integers(len(active))))
            trace.append((rid, None))
            ops += CALLS_PER_FINISH
            continue
        doc = int(rng.choice(num_docs, p=popularity))
        prefix = int(rng.integers(1, doc_blocks + 1))
        tail = int(rng.integers(0, max_tail + 1))
        chain = doc_hashes[doc][:prefix] + list(range(next_fresh, next_fresh + tail))
        next_fresh += tail
        trace.append((next_rid, chain))
        active.append(next_rid)
        next_rid += 1
        ops += CALLS_PER_START
    return trace


def replay(cache, trace) -> tuple[float, int, int]:
    """Run ``trace`` on ``cache``; return (seconds, calls, hit blocks)."""
    lookup, incref, touch = cache.lookup, cache.incref, cache.touch
    allocate, commit, decref = cache.allocate, cache.commit, cache.decref
    held: dict[int, list[int]] = {}
    calls = hit_blocks = 0
    start = time.perf_counter()
    for rid, chain in trace:
        if chain is None:
            decref(held.pop(rid))
            calls += 1
            continue
        hits = lookup(chain)
        incref(hits)
        touch(hits)
        num_hits = len(hits)
        new = allocate(len(chain) - num_hits)
        commit(new, chain[num_hits:])
        held[rid] = hits + new
        hit_blocks += num_hits
        calls += CALLS_PER_START
    seconds = time.perf_counter() - start
    for blocks in held.values():
        decref(blocks)
    return seconds, calls, hit_blocks


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _chains(hashes: list[int]) -> list[int | None]:
    return [None if i % 16 == 0 else hashes[i - 1] for i in range(len(hashes))]


def memory_child(side: str, num_blocks: int, hash_bits: int) -> dict:
    """Resident bytes per block of one side's full pool after evicting a quarter (in this fresh process)."""
    quarter = num_blocks // 4
    rng = np.random.default_rng(0)
    first = rng.integers(1, 2**hash_bits - 1, size=num_blocks, dtype=np.uint64).tolist()
    second = rng.integers(1, 2**hash_bits - 1, size=quarter, dtype=np.uint64).tolist()
    if side == "seed":
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        width = hash_bits // 8
        first_keys = [make_block_hash_with_group_id(h.to_bytes(width, "big"), 0) for h in first]
        second_keys = [make_block_hash_with_group_id(h.to_bytes(width, "big"), 0) for h in second]
        del first, second
        start = _rss_bytes()
        pool = BlockPool(num_gpu_blocks=num_blocks + 1, enable_caching=True, hash_block_size=16)  # +1: null block

        def fill(keys: list) -> None:
            for i in range(0, len(keys), _BATCH):
                blocks = pool.get_new_blocks(len(keys[i:i + _BATCH]))  # evicts the least recently freed
                for block, key in zip(blocks, keys[i:i + _BATCH]):
                    pool._insert_block_hash(key, block, num_tokens=16)  # as the seed's store completion does
                pool.free_blocks(blocks)

        fill(first_keys)
        fill(second_keys)
        assert pool.get_num_free_blocks() == num_blocks
    else:
        from kvkit import ALLOCATOR, EVICTION

        start = _rss_bytes()
        pool = ALLOCATOR.create("pool", num_blocks=num_blocks, eviction=EVICTION.create(side))
        for hashes in (first, second):
            parents = _chains(hashes)
            for i in range(0, len(hashes), _BATCH):  # a step's stores at a time, as a manager commits them
                blocks = pool.allocate(len(hashes[i:i + _BATCH]))
                pool.commit(blocks, hashes[i:i + _BATCH], parents[i:i + _BATCH])
                pool.decref(blocks)
        assert pool.num_free == num_blocks
    grown = _rss_bytes() - start
    return {"side": side, "blocks": num_blocks, "bytes_per_block": round(grown / num_blocks, 1)}


def bench_memory(policies: list[str], num_blocks: int, hash_bits: int) -> dict:
    """Every side, each in a fresh process of this script, one after another."""
    sides = list(policies)
    try:
        import vllm.v1.core.block_pool  # noqa: F401
        sides.append("seed")
    except Exception:  # noqa: BLE001 - any import failure: no seed here
        pass
    rows = {}
    for side in sides:
        out = subprocess.run([sys.executable, __file__, "--memory-child", side, "--memory-blocks", str(num_blocks),
                              "--hash-bits", str(hash_bits)], capture_output=True, text=True, check=True,
                             env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
        rows[side] = json.loads(out.stdout.strip().splitlines()[-1])["bytes_per_block"]
    result = {"blocks": num_blocks, "hash_bits": hash_bits, "bytes_per_block": rows}
    if "seed" in rows:
        result["ratio_to_seed"] = {side: round(b / rows["seed"], 2) for side, b in rows.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="resident bytes per block instead of speed")
    parser.add_argument("--memory-blocks", type=int, default=1_000_000, help="pool size of --memory")
    parser.add_argument("--policies", default="hit-density,lru", help="kvkit policies of --memory, comma-separated")
    parser.add_argument("--hash-bits", type=int, default=64, choices=(64, 128, 256), help="hash width of --memory")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--ops", type=int, default=1_000_000, help="pool calls to replay")
    parser.add_argument("--blocks", type=int, default=4096, help="pool capacity in blocks")
    parser.add_argument("--repeat", type=int, default=3, help="runs each; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.memory_blocks, args.hash_bits)))
        return
    if args.memory:
        result = bench_memory([p for p in args.policies.split(",") if p], args.memory_blocks, args.hash_bits)
        result["python"] = platform.python_version()
        print(json.dumps(result) if args.json else "\n".join(f"{k:>16}: {v}" for k, v in result.items()))
        return

    trace = make_trace(args.ops, args.seed)
    pool_runs, cache_runs = [], []
    for _ in range(args.repeat):  # interleaved, so drift hits both alike
        pool_runs.append(replay(lru_pool(args.blocks), trace))
        cache_runs.append(replay(MinimalLRUCache(args.blocks), trace))

    # One untimed run per side to count evictions and check the pool's invariants.
    evictions = []
    pool = lru_pool(args.blocks)
    pool.add_evict_listener(lambda blocks, hashes: evictions.extend(blocks))
    replay(pool, trace)
    pool.check_invariants()
    assert pool.num_free == args.blocks
    cache = MinimalLRUCache(args.blocks)
    replay(cache, trace)

    pool_s, calls, pool_hits = min(pool_runs)
    cache_s, _, cache_hits = min(cache_runs)
    blocks = sum(len(chain) for _, chain in trace if chain is not None)
    result = {
        "ops": calls,
        "requests": sum(1 for _, chain in trace if chain is not None),
        "blocks_requested": blocks,
        "pool_blocks": args.blocks,
        "pool_s": round(pool_s, 4),
        "cache_s": round(cache_s, 4),
        "ratio": round(pool_s / cache_s, 3),
        "pool_us_per_op": round(pool_s / calls * 1e6, 3),
        "cache_us_per_op": round(cache_s / calls * 1e6, 3),
        "pool_ns_per_block": round(pool_s / blocks * 1e9, 1),
        "cache_ns_per_block": round(cache_s / blocks * 1e9, 1),
        "pool_hit_rate": round(pool_hits / blocks, 4),
        "cache_hit_rate": round(cache_hits / blocks, 4),
        "pool_evictions": len(evictions),
        "cache_evictions": cache.evictions,
        "python": platform.python_version(),
    }
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>18}: {value}")
    print(f"{'target':>18}: ratio <= 2.5 -> {'met' if result['ratio'] <= 2.5 else 'MISSED'}")


if __name__ == "__main__":
    main()
