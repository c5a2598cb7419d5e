"""A policy's margin to the best other rule on any set of workloads, point by point.

    python benchmarks/bench_margin.py [--policy hit-density] [--workloads chat,agent,rag,few-shot,mixed]
        [--seeds 3,4,5] [--capacities 1000,4000,16000] [--others lru,arc,...]
        [--baselines ARC,S3FIFO,...] [--block-size 16] [--jobs N] [--json PATH]
    python benchmarks/bench_margin.py --sets T,A,B,S,L,X [--policy ...] [--jobs N] [--json PATH]

A workload is a shape name, optionally with generator parameters moved from their defaults:
``few-shot@drift_every=400`` or ``rag@document_skew=1.2;docs_per_request=6`` (as
:func:`kvkit.shape` reads them), or ``trace:NAME`` for a Mooncake-format trace file or built-in trace
(512-token blocks, shown as block size 0; ``--seeds`` and ``--block-size`` do not apply to it).
Each (workload, seed, capacity) is a *point*;
its *margin* is the policy's prefix hit ratio minus (the best of the ``--others`` kvkit rules and
the libCacheSim ``--baselines``, all counted by prefix, minus 0.5 points). The condition holds
where every margin is >= 0. Rules built on the policy (``adaptive``, ``hinted``) and the offline
optima are not among the others by default. kvkit's rules replay as ``kvkit policies`` does.
``--block-size`` draws the shapes in blocks of that many tokens (an engine's block size): the same
prompts in fewer, larger blocks, so pools of a given size hold more of them.

``--sets`` replaces the workload, seed, capacity and block-size options with named grids (:data:`SETS`):
the 250 points BENCHMARKS.md scores the default on (T: the shared trace and the shapes at seeds 0-2;
A: seeds 3-5; B: one generator parameter moved; S: pools of 100-500 blocks; L: 128- and 512-token
blocks; X: popularity that holds still). All six take about 10 minutes on 16 cores, an hour or more
on 2. ``--json`` writes every point's hit ratios, each rule's, for later comparison.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re

import kvkit

_TOLERANCE = 0.5  # points
_TRACE = "trace:"
_SIZES = (1000, 4000, 16000)
_SHARED = f"{_TRACE}mooncake-conversation"
SETS: dict[str, tuple[tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...], int], ...]] = {
    # name: grids of (workloads, seeds, capacities, block size)
    "T": (((_SHARED,), (0,), _SIZES, 0), (kvkit.sim.SHAPES, (0, 1, 2), _SIZES, 16)),  # a trace: its own blocks
    "A": ((kvkit.sim.SHAPES, (3, 4, 5), _SIZES, 16),),
    "B": ((("few-shot@drift_every=400", "few-shot@template_skew=0.8", "few-shot@template_skew=1.3",
            "few-shot@num_templates=1200", "rag@document_skew=0.6", "rag@document_skew=1.2",
            "rag@docs_per_request=6", "agent@num_system_prompts=16", "agent@tool_latency_mean_s=12.0",
            "chat@think_time_mean_s=120.0", "chat@num_system_prompts=32", "mixed@think_time_mean_s=120.0"),
           (0,), _SIZES, 16),),
    "S": (((_SHARED,), (0,), (100, 250, 500), 0), (kvkit.sim.SHAPES, (0, 1), (100, 250, 500), 16)),
    "L": ((kvkit.sim.SHAPES, (0, 1), (100, 250, 500, 1000), 512), (kvkit.sim.SHAPES, (0, 1), (250, 1000, 4000), 128)),
    "X": (((("rag@docs_per_request=1;num_requests=8000;num_documents=3000;document_tokens=(2000,12000);"
             "instruction_tokens=0;follow_up_probability=0.2"),
            "few-shot@drift_every=100000;num_requests=12000;num_templates=2000;template_tokens=(2000,16000)",
            "chat@num_conversations=2000;num_system_prompts=40"), (0, 1), (500, 2000, 8000), 512),),
}
"""The named grids of ``--sets``, as BENCHMARKS.md defines them (250 points in all)."""


def _split(text: str) -> tuple[str, ...]:
    """The comma-separated items of ``text``; a comma inside brackets, as in a tuple-valued field
    (``rag@document_tokens=(2000,12000)``), belongs to its item."""
    return tuple(filter(None, re.split(r",(?![^()\[\]]*[)\]])", text)))


def _requests(workload: str, seed: int, block_size: int) -> list:
    """The requests of a shape (drawn at ``seed`` in ``block_size``-token blocks) or of a ``trace:`` workload."""
    if workload.startswith(_TRACE):
        return list(kvkit.read_trace(workload[len(_TRACE):]))
    return list(kvkit.shape(workload, seed=seed, block_size=block_size).requests())


def points(sets: tuple[str, ...]) -> list[tuple[str, str, int, int, int]]:
    """Every (set, workload, seed, block size, capacity) of the named sets, in order.

    Raises:
        ConfigError: a name that is not in :data:`SETS` (the valid ones are listed).
    """
    bad = [name for name in sets if name not in SETS]
    if bad or not sets:
        raise kvkit.errors.ConfigError(f"unknown sets {bad!r}; valid: {', '.join(SETS)}")
    return [(name, w, seed, block_size, c) for name in sets for workloads, seeds, capacities, block_size in SETS[name]
            for w in workloads for seed in seeds for c in capacities]


def _point(job: tuple[str, str, int, int, int, str, tuple[str, ...], tuple[str, ...]]) -> dict:
    group, workload, seed, block_size, capacity, policy, others, baselines = job
    requests = _requests(workload, seed, block_size)
    ratios = {rule: kvkit.replay(requests, capacity, rule).hit_ratio for rule in (policy, *others)}
    if baselines:
        study = kvkit.sim.libcachesim_study(requests, (capacity,), baselines, prefix=True)
        ratios |= {s.policy: s.hit_ratio for s in study}
    return {"set": group, "workload": workload, "seed": seed, "block_size": block_size, "capacity": capacity,
            "hit_ratio": {rule: 100 * ratio for rule, ratio in ratios.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="hit-density")
    parser.add_argument("--sets", default=None, help=f"named grids instead of the four options below: {','.join(SETS)}")
    parser.add_argument("--workloads", default=",".join(kvkit.sim.SHAPES))
    parser.add_argument("--seeds", default="3,4,5")
    parser.add_argument("--capacities", default="1000,4000,16000")
    parser.add_argument("--block-size", type=int, default=kvkit.config.DEFAULTS.block_size, help="tokens per block")
    parser.add_argument("--others", default=None,
                        help="kvkit rules [default: every registered one but the policy, adaptive and opt]")
    parser.add_argument("--baselines", default=",".join(p for p in kvkit.sim.LIBCACHESIM_POLICIES if p != "Belady"),
                        help="libCacheSim policies (needs the libcachesim extra; empty for none)")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--json", default=None, help="write every point's hit ratios to this file")
    args = parser.parse_args()
    others = tuple(p for p in kvkit.sim.default_policies() if p not in (args.policy, "adaptive", kvkit.sim.OPT)) \
        if args.others is None else _split(args.others)
    baselines = _split(args.baselines)
    if not others and not baselines:
        parser.error(f"--others {args.others!r} and --baselines {args.baselines!r} leave no rule to compare against")
    try:  # a bad set, workload name, field or block size fails here, quoted, not inside a worker
        if args.sets is not None:
            grid = points(_split(args.sets))
        else:
            grid = [("", w, *((0, 0) if w.startswith(_TRACE) else (int(seed), args.block_size)), int(c))
                    for w in _split(args.workloads) for seed in _split(args.seeds) for c in _split(args.capacities)]
            grid = list(dict.fromkeys(grid))  # a trace is one draw whatever the seeds
        for workload in {w for _, w, _, _, _ in grid}:
            if workload.startswith(_TRACE):
                next(iter(kvkit.read_trace(workload[len(_TRACE):], limit=1)), None)
            else:
                kvkit.shape(workload, block_size=args.block_size)
    except (kvkit.errors.ConfigError, kvkit.errors.TraceFileError, kvkit.errors.TraceFormatError) as error:
        parser.error(str(error))
    try:  # a path that cannot be written fails now, not after an hour of replays
        out = open(args.json, "w") if args.json else None  # noqa: SIM115 - closed once written, below
    except OSError as error:
        parser.error(f"--json {args.json!r}: {error.strerror}")
    jobs = [(*point, args.policy, others, baselines) for point in grid]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(_point, jobs))
    if out is not None:
        with out:
            json.dump({"policy": args.policy, "tolerance": _TOLERANCE, "points": results}, out, indent=1)
    print(f"{'set':<3} {'workload':<36} {'seed':>4} {'blocks':>7} {args.policy:>12} {'best other':<24} {'margin':>7}")
    margins: dict[str, list[float]] = {}
    for point in results:
        ratios = dict(point["hit_ratio"])
        mine = ratios.pop(args.policy)
        best = max(ratios, key=ratios.__getitem__)
        margin = mine - (ratios[best] - _TOLERANCE)
        margins.setdefault(point["set"], []).append(margin)
        print(f"{point['set']:<3} {point['workload'][:36]:<36} {point['seed']:>4} {point['capacity']:>7,} "
              f"{mine:>11.2f}% {ratios[best]:>8.2f}% {best:<14} {margin:>+7.2f}{'  missed' if margin < 0 else ''}")
    summary = [(name, found) for name, found in margins.items() if name] if args.sets else []
    for name, found in [*summary, ("all", [m for point in margins.values() for m in point])]:
        label = f"set {name}" if name != "all" else args.policy
        print(f"{label}: met {sum(m >= 0 for m in found)} of {len(found)} points; "
              f"worst margin {min(found):+.2f}, summed {sum(found):+.2f}")


if __name__ == "__main__":
    main()
