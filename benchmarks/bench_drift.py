"""Hit ratio per window of requests: where a rule wins or loses along a trace (a popularity shift, say).

    python benchmarks/bench_drift.py [--shape few-shot] [--seed 0] [--capacity 4000] [--window 200]
        [--policies hit-density,s3fifo,arc] [--baselines LIRS,S3FIFO]

``--shape`` may move generator parameters (``few-shot@num_templates=1200``, as :func:`kvkit.shape`
reads them). Each column is one rule's prefix hit ratio over the requests of each window. kvkit's rules
replay as ``kvkit policies`` does (per-block stores); libCacheSim's (``--baselines``, needs the
libcachesim extra; empty for none) are counted as kvkit counts (prefix hits, not plain).
A window's hits are those of the first ``k`` requests minus those of the first ``k - window``
(every replay is deterministic and sees no future, so the first ``k`` requests replay alike
in a shorter trace): no second replay loop, at the price of one replay per window end.
"""

from __future__ import annotations

import argparse
import concurrent.futures

import kvkit

_requests: list = []  # the trace, set once per worker process by _init


def _init(requests: list) -> None:
    _requests[:] = requests


def _hits(job: tuple[int, int, str]) -> tuple[tuple[str, int], tuple[int, int]]:
    capacity, end, rule = job
    requests = _requests[:end]
    if rule.startswith("lcs:"):
        stats = kvkit.sim.libcachesim_study(requests, (capacity,), (rule[4:],), prefix=True)[0]
    else:
        stats = kvkit.replay(requests, capacity, rule)
    return (rule, end), (stats.hits, stats.references)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="few-shot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacity", type=int, default=4000)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--policies", default="hit-density,s3fifo,arc")
    parser.add_argument("--baselines", default="LIRS,S3FIFO")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()
    requests = list(kvkit.shape(args.shape, seed=args.seed).requests())
    total = len(requests)
    ends = [*range(args.window, total, args.window), total]
    rules = [*args.policies.split(","), *(f"lcs:{b}" for b in args.baselines.split(",") if b)]
    jobs = [(args.capacity, end, rule) for rule in rules for end in ends]
    with concurrent.futures.ProcessPoolExecutor(args.jobs, initializer=_init, initargs=(requests,)) as pool:
        cumulative = dict(pool.map(_hits, jobs))
    print(f"{args.shape} (seed {args.seed}), {total:,} requests, {args.capacity:,} blocks: "
          f"prefix hit ratio per window of {args.window} requests")
    print(f"{'requests':>11} " + " ".join(f"{r:>12}" for r in rules))
    for start, end in zip([0, *ends], ends, strict=False):
        cells = []
        for rule in rules:
            hits, refs = cumulative[rule, end]
            if start:
                hits, refs = hits - cumulative[rule, start][0], refs - cumulative[rule, start][1]
            cells.append(f"{hits / refs:12.2%}")
        print(f"{start:>5}-{end:<5} " + " ".join(cells))
    print(f"{'all':>11} " + " ".join(
        f"{cumulative[r, total][0] / cumulative[r, total][1]:12.2%}" for r in rules))


if __name__ == "__main__":
    main()
