"""Issue 18's condition on any set of workloads: a policy against the best other rule, point by point.

    python benchmarks/bench_margin.py [--policy hit-density] [--workloads chat,agent,rag,few-shot,mixed]
        [--seeds 3,4,5] [--capacities 1000,4000,16000] [--others lru,arc,...]
        [--baselines ARC,S3FIFO,...] [--block-size 16] [--jobs N]

A workload is a shape name, optionally with generator parameters moved from their defaults:
``few-shot@drift_every=400`` or ``rag@document_skew=1.2;docs_per_request=6`` (as
:func:`kvkit.shape` reads them). Each (workload, seed, capacity) is a *point*;
its *margin* is the policy's prefix hit ratio minus (the best of the ``--others`` kvkit rules and
the libCacheSim ``--baselines``, all counted by prefix, minus 0.5 points). The condition holds
where every margin is >= 0. Rules built on the policy (``adaptive``, ``hinted``) and the offline
optima are not among the others by default. kvkit's rules replay as ``kvkit policies`` does.
``--block-size`` draws the shapes in blocks of that many tokens (an engine's block size): the same
prompts in fewer, larger blocks, so pools of a given size hold more of them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import re

import kvkit

_TOLERANCE = 0.5  # points


def _split(text: str) -> tuple[str, ...]:
    """The comma-separated items of ``text``; a comma inside brackets, as in a tuple-valued field
    (``rag@document_tokens=(2000,12000)``), belongs to its item."""
    return tuple(filter(None, re.split(r",(?![^()\[\]]*[)\]])", text)))


def _point(job: tuple[str, int, int, int, str, tuple[str, ...], tuple[str, ...]]) -> tuple[tuple[str, int, int], dict]:
    workload, seed, block_size, capacity, policy, others, baselines = job
    requests = list(kvkit.shape(workload, seed=seed, block_size=block_size).requests())
    ratios = {rule: kvkit.replay(requests, capacity, rule).hit_ratio for rule in (policy, *others)}
    if baselines:
        ratios |= {s.policy: s.hit_ratio for s in kvkit.libcachesim_study(requests, (capacity,), baselines, prefix=True)}
    return (workload, seed, capacity), {rule: 100 * ratio for rule, ratio in ratios.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="hit-density")
    parser.add_argument("--workloads", default=",".join(kvkit.SHAPES))
    parser.add_argument("--seeds", default="3,4,5")
    parser.add_argument("--capacities", default="1000,4000,16000")
    parser.add_argument("--others", default=None,
                        help="kvkit rules [default: every registered one but the policy, adaptive and opt]")
    parser.add_argument("--baselines", default=",".join(p for p in kvkit.LIBCACHESIM_POLICIES if p != "Belady"),
                        help="libCacheSim policies (needs the libcachesim extra; empty for none)")
    parser.add_argument("--block-size", type=int, default=kvkit.DEFAULTS.block_size, help="tokens per block")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()
    others = tuple(p for p in kvkit.default_policies() if p not in (args.policy, "adaptive", kvkit.OPT)) \
        if args.others is None else _split(args.others)
    baselines = _split(args.baselines)
    try:  # a bad workload name, field or block size fails here, quoted, not inside a worker
        for workload in _split(args.workloads):
            kvkit.shape(workload, block_size=args.block_size)
    except kvkit.errors.ConfigError as error:
        parser.error(str(error))
    jobs = [(w, int(seed), args.block_size, int(c), args.policy, others, baselines)
            for w in _split(args.workloads) for seed in _split(args.seeds) for c in _split(args.capacities)]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        points = dict(pool.map(_point, jobs))
    print(f"{'workload':<36} {'seed':>4} {'blocks':>7} {args.policy:>12} {'best other':<24} {'margin':>7}")
    margins = []
    for (workload, seed, capacity), ratios in points.items():
        mine = ratios.pop(args.policy)
        best = max(ratios, key=ratios.__getitem__)
        margin = mine - (ratios[best] - _TOLERANCE)
        margins.append(margin)
        print(f"{workload:<36} {seed:>4} {capacity:>7,} {mine:>11.2f}% {ratios[best]:>8.2f}% {best:<14} "
              f"{margin:>+7.2f}{'  missed' if margin < 0 else ''}")
    print(f"{args.policy}: met {sum(m >= 0 for m in margins)} of {len(margins)} points; "
          f"worst margin {min(margins):+.2f}, summed {sum(margins):+.2f}")


if __name__ == "__main__":
    main()
