"""Prefix-aware selections on long chains: ``select_victims(1)`` of hit-density and prefix-lru.

A policy tracks ``C`` chains of ``L`` blocks (each inserted head to tail, no
hits). ``again``: one ``select_victims(1)`` whose victim is not removed,
repeated (every call walks from its root to the deepest block). ``evict``:
``select_victims(1)`` and then the victim's removal until every chain is gone,
one victim per call, as a pool evicting under steady pressure; only the
selections are timed.

    python benchmarks/bench_chains.py [--chains 8] [--lengths 64,2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from kvkit import EVICTION


def _policy(name: str, chains: int, length: int):
    policy = EVICTION.create(name)
    for c in range(chains):
        parent = None
        for i in range(length):
            block = c * length + i
            policy.on_insert(block, 1_000_000 + block, parent)
            parent = 1_000_000 + block
    return policy


def _evictable(block: int) -> bool:
    return True


def bench(name: str, chains: int, length: int, repeat: int) -> dict:
    """Microseconds per ``select_victims(1)``: median of ``repeat`` unremoved ones, mean while evicting all."""
    policy = _policy(name, chains, length)
    again = []
    for _ in range(repeat):
        start = time.perf_counter()
        policy.select_victims(1, _evictable)
        again.append(time.perf_counter() - start)
    evict = 0.0
    for _ in range(chains * length):
        start = time.perf_counter()
        victims = policy.select_victims(1, _evictable)
        evict += time.perf_counter() - start
        policy.on_remove(victims[0])
    assert len(policy) == 0
    return {"policy": name, "chains": chains, "length": length,
            "again_us": round(statistics.median(again) * 1e6, 1),
            "evict_us": round(evict / (chains * length) * 1e6, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=8)
    parser.add_argument("--lengths", default="64,2048", help="blocks a chain, one run each")
    parser.add_argument("--repeat", type=int, default=50, help="unremoved selections per run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    rows = [bench(name, args.chains, int(length), args.repeat)
            for name in ("hit-density", "prefix-lru") for length in args.lengths.split(",")]
    if args.json:
        print(json.dumps({"rows": rows, "python": platform.python_version()}))
        return
    print("select_victims(1): again = victim kept (median), evict = victim removed each call (mean)")
    for row in rows:
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
