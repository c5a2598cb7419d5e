"""Costs that must not grow with the pool: eviction under pins, the manager's step, idle write-back.

Three measurements, each reported as ratios inside one run, so machine load
cancels out:

* **evict**: per built-in eviction policy, the median cost of one evicting
  ``allocate(1)`` on a full ``--blocks``-block pool (default 100k) whose oldest
  blocks are referenced: 1,000 of them, then 90% of the pool. Blocks are
  committed in chains of 16 (the prefix-aware policies see parents). After
  each timed call the block is committed under a fresh hash and released
  (untimed), so the pool stays full. Target: 90%-referenced <= 2x 1k-referenced.
* **step**: per store policy (eager, lazy, selective, never), the median
  ``build_step`` of an ``OffloadManager`` whose GPU pool (``--blocks``, LRU)
  is full of cached blocks and runs ``R`` decoding requests (256 and 4,096):
  each step the engine (untimed) allocates one GPU block per request, which
  evicts cached ones, and commits the block it completed; the manager hears
  ``append_blocks``/``extend``/``on_computed`` per request (``calls_ms``,
  reported apart), then ``build_step`` (the target) and ``apply_completions``
  of the previous step. Each run is repeated (``--repeat``, interleaved so load
  drifts hit all alike) and the lowest median counts. Targets: <= 1 ms at 256;
  4,096 <= 20x 256.
* **idle**: ``build_step`` with the lazy store and no request at all, on GPU
  pools of 1k, 10k and 100k cached blocks whose write-back window is already
  stored. Target: flat in the pool size.

    python benchmarks/bench_scale.py [--blocks 100000] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

from kvkit import ALLOCATOR, EVICTION, STORE, BlockAllocator, KVCacheSpec, OffloadManager, TransferResult

POLICIES = ("lru", "fifo", "lfu", "arc", "s3fifo", "prefix-lru", "hit-density", "opt")
STORES = ("eager", "lazy", "selective", "never")
CHAIN = 16  # blocks per committed chain (a request's prompt)
BS = 16
SPEC = KVCacheSpec(num_layers=32, block_size=BS, num_kv_heads=8, head_dim=128)


def make_pool(num_blocks: int, policy: str = "lru") -> BlockAllocator:
    """A ``BlockPool`` with a fresh registered policy (the optimum gets an empty future)."""
    kwargs = {"references": ()} if policy == "opt" else {}
    return ALLOCATOR.create("pool", num_blocks=num_blocks, eviction=EVICTION.create(policy, **kwargs))


def fill(pool: BlockAllocator, first_hash: int, keep: int = 0) -> tuple[list[int], int]:
    """Commit every block of an empty ``pool`` in chains; release all but the first ``keep``.

    Returns the kept blocks and the next unused hash.
    """
    blocks = pool.allocate(pool.num_blocks)
    hashes = list(range(first_hash, first_hash + len(blocks)))
    parents = [None if i % CHAIN == 0 else hashes[i - 1] for i in range(len(blocks))]
    pool.commit(blocks, hashes, parents)
    pool.decref(blocks[keep:])
    return blocks[:keep], first_hash + len(blocks)


def timed(step: Callable[[], float], budget_s: float, most: int, least: int = 15) -> float:
    """Median of ``step()``'s returned seconds over up to ``most`` calls or ``budget_s`` of them."""
    samples: list[float] = []
    spent = 0.0
    while len(samples) < most and (spent < budget_s or len(samples) < least):
        samples.append(step())
        spent += samples[-1]
    return statistics.median(samples)


def bench_evict(policy: str, num_blocks: int, referenced: int, budget_s: float) -> float:
    """Median seconds of one evicting ``allocate(1)`` with the oldest ``referenced`` blocks held."""
    pool = make_pool(num_blocks, policy)
    _, next_hash = fill(pool, 1, keep=referenced)
    clock = time.perf_counter

    def step() -> float:
        nonlocal next_hash
        start = clock()
        block = pool.allocate(1)
        elapsed = clock() - start
        pool.commit(block, [next_hash])
        pool.decref(block)
        next_hash += 1
        return elapsed

    for _ in range(10):
        step()
    result = timed(step, budget_s, most=400)
    pool.check_invariants()
    return result


def bench_step(store: str, num_blocks: int, num_requests: int, warmup: int, steps: int) -> dict:
    """Median manager time per decode step of ``num_requests`` requests on a full GPU pool."""
    gpu = make_pool(num_blocks)
    cpu = make_pool(num_blocks)
    mgr = OffloadManager(SPEC, cpu, STORE.create(store), gpu=gpu)
    _, next_hash = fill(gpu, 1)
    prompt = 4
    tables: dict[str, list[int]] = {}
    chains: dict[str, list[int]] = {}
    for i in range(num_requests):
        rid = f"r{i}"
        chains[rid] = list(range(next_hash, next_hash + prompt))
        next_hash += prompt
        mgr.add_request(rid, chains[rid], prompt * BS)
        mgr.lookup(rid, 0)
        tables[rid] = gpu.allocate(prompt)
        gpu.commit(tables[rid], chains[rid], [None, *chains[rid][:-1]])
        mgr.on_allocated(rid, [tables[rid]])
        mgr.on_computed(rid, prompt * BS)
    pending = mgr.build_step()
    clock = time.perf_counter
    calls, builds, completes = [], [], []
    for step in range(warmup + steps):
        # Engine work, untimed: a GPU block per request (evicting cached ones) and its hash.
        grow = []
        for rid, table in tables.items():
            block = gpu.allocate(1)
            table += block
            chains[rid].append(next_hash)
            grow.append((rid, [block], [next_hash]))
            next_hash += 1
        tokens = (prompt + step + 1) * BS
        done = [TransferResult(tid) for tid, _ in pending]
        t0 = clock()
        for rid, new_blocks, new_hash in grow:
            mgr.append_blocks(rid, new_blocks)
            mgr.extend(rid, new_hash)
            mgr.on_computed(rid, tokens)
        t1 = clock()
        pending = mgr.build_step()
        t2 = clock()
        mgr.apply_completions(done)
        t3 = clock()
        for rid, new_blocks, new_hash in grow:  # the engine publishes what it computed
            gpu.commit(new_blocks[0], new_hash, [chains[rid][-2]])
        if step >= warmup:
            calls.append(t1 - t0)
            builds.append(t2 - t1)
            completes.append(t3 - t2)
    mgr.check_invariants()
    return {
        "store": store,
        "requests": num_requests,
        "build_ms": round(statistics.median(builds) * 1e3, 3),
        "calls_ms": round(statistics.median(calls) * 1e3, 3),
        "complete_ms": round(statistics.median(completes) * 1e3, 3),
        "blocks_stored": int(mgr.stats.blocks_stored.value),
        "gpu_referenced": gpu.num_blocks - gpu.num_free,
    }


def bench_idle(num_blocks: int, repeat: int) -> float:
    """Median ``build_step`` of a lazy manager with no requests and its window already stored."""
    gpu = make_pool(num_blocks)
    cpu = make_pool(num_blocks)
    mgr = OffloadManager(SPEC, cpu, STORE.create("lazy"), gpu=gpu)
    fill(gpu, 1)
    for _ in range(3):  # store the window, then let every completion land
        mgr.apply_completions(TransferResult(tid) for tid, _ in mgr.build_step())
    assert not mgr.build_step(), "the write-back window is not stored yet"
    clock = time.perf_counter

    def step() -> float:
        start = clock()
        plan = mgr.build_step()
        elapsed = clock() - start
        assert not plan
        return elapsed

    result = timed(step, budget_s=1.0, most=repeat, least=5)
    mgr.check_invariants()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000, help="pool size for evict and step")
    parser.add_argument("--policies", default=",".join(POLICIES), help="eviction policies to time")
    parser.add_argument("--stores", default=",".join(STORES), help="store policies to time")
    parser.add_argument("--requests", default="256,4096", help="running requests per step run")
    parser.add_argument("--idle-blocks", default="1000,10000,100000", help="GPU pool sizes, idle run")
    parser.add_argument("--budget", type=float, default=1.5, help="seconds of timed calls per evict cell")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps per step run")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per step run")
    parser.add_argument("--repeat", type=int, default=3, help="step runs each; the lowest median counts")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    started = time.perf_counter()
    few, many = 1000, int(0.9 * args.blocks)
    evict = []
    for name in filter(None, args.policies.split(",")):
        low = bench_evict(name, args.blocks, few, args.budget)
        high = bench_evict(name, args.blocks, many, args.budget)
        evict.append({"policy": name, "us_1k_referenced": round(low * 1e6, 2),
                      "us_90pct_referenced": round(high * 1e6, 2), "ratio": round(high / low, 2)})
    counts = [int(n) for n in args.requests.split(",")]
    stores = list(filter(None, args.stores.split(",")))
    best: dict[tuple[str, int], dict] = {}
    for _ in range(args.repeat):
        for name in stores:
            for n in counts:
                row = bench_step(name, args.blocks, n, args.warmup, args.steps)
                if (name, n) not in best or row["build_ms"] < best[name, n]["build_ms"]:
                    best[name, n] = row
    step = []
    for name in stores:
        rows = [best[name, n] for n in counts]
        for row in rows:
            row["vs_first"] = round(row["build_ms"] / rows[0]["build_ms"], 2)
            row["step_ms"] = round(row["calls_ms"] + row["build_ms"] + row["complete_ms"], 3)
            row["step_vs_first"] = round(row["step_ms"] / rows[0]["step_ms"], 2)
        step += rows
    idle = [{"gpu_blocks": int(n), "build_ms": round(bench_idle(int(n), 50) * 1e3, 4)}
            for n in args.idle_blocks.split(",")]
    for row in idle:
        row["vs_first"] = round(row["build_ms"] / idle[0]["build_ms"], 2)
    result = {"blocks": args.blocks, "evict": evict, "step": step, "idle": idle,
              "seconds": round(time.perf_counter() - started, 1), "python": platform.python_version()}
    if args.json:
        print(json.dumps(result))
        return
    print(f"evict: one allocate(1) on a full {args.blocks:,}-block pool (target: ratio <= 2)")
    for row in evict:
        print(f"  {row['policy']:>12}: {row['us_1k_referenced']:>9.2f} us with 1k referenced, "
              f"{row['us_90pct_referenced']:>9.2f} us with {many:,}: {row['ratio']:.2f}x")
    print(f"step: build_step, decoding requests on a full {args.blocks:,}-block GPU pool "
          f"(targets: <= 1 ms at {counts[0]}, <= 20x from {counts[0]} to {counts[-1]})")
    for row in step:
        print(f"  {row['store']:>9} x {row['requests']:>5}: build {row['build_ms']:>8.3f} ms "
              f"({row['vs_first']:.2f}x), per-request calls {row['calls_ms']:.3f} ms, "
              f"completions {row['complete_ms']:.3f} ms, whole step {row['step_ms']:.3f} ms "
              f"({row['step_vs_first']:.2f}x)")
    print("idle: build_step with lazy, nothing to do (target: flat)")
    for row in idle:
        print(f"  {row['gpu_blocks']:>7,} GPU blocks: {row['build_ms']:.4f} ms ({row['vs_first']:.2f}x)")
    print(f"{result['seconds']} s")


if __name__ == "__main__":
    main()
