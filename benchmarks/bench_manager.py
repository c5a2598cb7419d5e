"""OffloadManager scheduler-side cost: one decode step of many requests, and one long lookup.

Step: ``R`` running requests each complete one block per step (decode at one
block per step, the heaviest steady load) with eager write-through stores on.
The engine tells every request's next block, its hash and its computed count
in one ``advance``, then calls one ``build_step`` and one ``apply_completions`` of the previous step's transfers
(every worker done).
The CPU pool is smaller than everything stored, so allocations evict. The time
counted is the manager's, pool calls it makes included; the engine's own GPU
allocations are made before timing. ``p90_ms`` is wall time (includes the OS
preempting the process on a loaded machine); ``cpu_p90_ms`` is this process's
CPU time over the same step.

Lookup: a waiting request with a prompt of ``B`` blocks of 16 tokens whose
prefix is on the CPU tier; one ``lookup`` (finds, pins and touches the hit),
for a full hit and for a miss. The pins are released untimed.

    python benchmarks/bench_manager.py [--requests 64,128,256,512] [--blocks 512,2048,8192]
        [--cpu-eviction lru,hit-density] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from kvkit import ALLOCATOR, EVICTION, STORE, BlockAllocator, KVCacheSpec, OffloadManager, TransferResult

BS = 16
SPEC = KVCacheSpec(num_layers=32, block_size=BS, num_kv_heads=8, head_dim=128)


def pool(num_blocks: int, eviction: str = "lru") -> BlockAllocator:
    """kvkit's block pool with the named eviction policy (LRU: the GPU tier's default)."""
    return ALLOCATOR.create("pool", num_blocks=num_blocks, eviction=EVICTION.create(eviction))


def bench_step(num_requests: int, steps: int, warmup: int, prompt_blocks: int = 4,
               cpu_eviction: str = "lru") -> dict:
    """Median and p90 manager time per step with ``num_requests`` requests adding a block each."""
    total = num_requests * (prompt_blocks + warmup + steps + 1)
    gpu = pool(total + 16)
    cpu = pool(max(1024, total // 2), cpu_eviction)  # smaller than all stored: steady eviction
    mgr = OffloadManager(SPEC, cpu, STORE.create("eager"), gpu=gpu)
    next_hash = 1
    tables = {}
    for i in range(num_requests):
        rid = f"r{i}"
        hashes = list(range(next_hash, next_hash + prompt_blocks))
        next_hash += prompt_blocks
        mgr.add_request(rid, hashes, prompt_blocks * BS)
        mgr.lookup(rid, 0)
        tables[rid] = gpu.allocate(prompt_blocks + warmup + steps + 1)
        mgr.on_allocated(rid, [tables[rid][:prompt_blocks]])
        mgr.on_computed(rid, prompt_blocks * BS)
    pending = mgr.build_step()
    times, cpu_times = [], []
    for step in range(warmup + steps):
        # Engine work, untimed: the next block id and hash of every request.
        grow = [(rid, [[tables[rid][prompt_blocks + step]]], [next_hash + k])
                for k, rid in enumerate(tables)]
        next_hash += num_requests
        tokens = (prompt_blocks + step + 1) * BS
        done = [TransferResult(tid) for tid, _ in pending]
        start, cpu_start = time.perf_counter(), time.process_time()
        mgr.advance([(rid, new_blocks, new_hash, tokens) for rid, new_blocks, new_hash in grow])
        pending = mgr.build_step()
        mgr.apply_completions(done)
        elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
        if step >= warmup:
            times.append(elapsed)
            cpu_times.append(cpu_elapsed)
    mgr.check_invariants()
    stats = mgr.stats
    return {
        "requests": num_requests,
        "cpu_eviction": cpu_eviction,
        "steps": steps,
        "median_ms": round(statistics.median(times) * 1e3, 3),
        "p90_ms": round(sorted(times)[int(0.9 * len(times))] * 1e3, 3),
        "cpu_p90_ms": round(sorted(cpu_times)[int(0.9 * len(cpu_times))] * 1e3, 3),
        "us_per_request": round(statistics.median(times) / num_requests * 1e6, 2),
        "blocks_stored": int(stats.blocks_stored.value),
        "cpu_evictions": int(stats.evictions_cpu.value),
    }


def bench_lookup(num_blocks: int, repeat: int) -> dict:
    """Median time of one lookup over ``num_blocks`` hashes: a full CPU hit and a miss."""
    gpu = pool(2 * num_blocks + 8)
    cpu = pool(num_blocks + 8)
    mgr = OffloadManager(SPEC, cpu, STORE.create("eager"), gpu=gpu)
    hashes = list(range(1, num_blocks + 1))
    ntok = num_blocks * BS
    mgr.add_request("seed", hashes, ntok)
    mgr.lookup("seed", 0)
    mgr.on_allocated("seed", [gpu.allocate(num_blocks)])
    mgr.on_computed("seed", ntok)
    mgr.apply_completions(TransferResult(tid) for tid, _ in mgr.build_step())
    assert len(cpu.lookup(hashes)) == num_blocks
    out = {"blocks": num_blocks, "tokens": ntok}
    for case, chain in (("hit", hashes), ("miss", [h + 10**9 for h in hashes])):
        times = []
        for i in range(repeat):
            rid = f"{case}{i}"
            mgr.add_request(rid, chain, ntok)
            start = time.perf_counter()
            got = mgr.lookup(rid, 0)
            times.append(time.perf_counter() - start)
            assert got == ((num_blocks - 1) * BS if case == "hit" else 0)
            mgr.abort(rid)
        out[f"{case}_us"] = round(statistics.median(times) * 1e6, 1)
    mgr.check_invariants()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="64,128,256,512", help="running requests per step run")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--cpu-eviction", default="lru",
                        help="CPU pool's eviction policies for the step runs, comma-separated (one run each)")
    parser.add_argument("--blocks", default="512,1024,2048,4096,8192", help="prompt blocks per lookup run")
    parser.add_argument("--repeat", type=int, default=50, help="lookups per case")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = {
        "step": [bench_step(int(n), args.steps, args.warmup, cpu_eviction=policy)
                 for policy in args.cpu_eviction.split(",") for n in args.requests.split(",")],
        "lookup": [bench_lookup(int(b), args.repeat) for b in args.blocks.split(",")],
        "python": platform.python_version(),
    }
    if args.json:
        print(json.dumps(result))
        return
    print("step: requests each adding one block, eager stores (target <= 1 ms at 256)")
    for row in result["step"]:
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))
    print("lookup: 16-token blocks, pinning the hit (target <= 200 us at 2048 blocks)")
    for row in result["lookup"]:
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
