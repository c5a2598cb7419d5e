"""Workload hints on the ``mixed`` shape: each base policy alone, and under ``hinted`` with the hints.

    python benchmarks/bench_hints.py [--policies lru,s3fifo,hit-density,adaptive] [--capacities 1000,4000,16000]

Also checks that a policy that does not hear hints replays identically with them.
"""

from __future__ import annotations

import argparse

import kvkit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="lru,s3fifo,hit-density,adaptive")
    parser.add_argument("--capacities", default="1000,4000,16000")
    args = parser.parse_args()
    requests, hints = kvkit.shape("mixed").hinted()
    print(f"mixed: {len(requests):,} requests, {sum(len(r.hash_ids) for r in requests):,} block references")
    for capacity in map(int, args.capacities.split(",")):
        for name in args.policies.split(","):
            base = type(kvkit.EVICTION.create(name))
            clock = kvkit.TraceClock()
            hinted = kvkit.replay(requests, capacity, kvkit.EVICTION.create("hinted", base=base, clock=clock),
                                  hints=hints, clock=clock)
            alone = kvkit.replay(requests, capacity, name)
            assert kvkit.replay(requests, capacity, name, hints=hints).hits == alone.hits, name
            print(f"{capacity:>6,} {name:12s} {alone.hit_ratio:7.2%} -> hinted {hinted.hit_ratio:7.2%}", flush=True)


if __name__ == "__main__":
    main()
