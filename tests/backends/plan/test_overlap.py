"""The default load planner: its estimates, and plans that never lose to loading everything or to recompute."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkit.backends.plan import ComputeEstimate, LoadAllPlanner, MoveEstimate, OverlapPlanner
from kvkit.errors import PlanError
from kvkit.interfaces.plan import HitQuery, HitSource, LoadPlan, LoadPlanner

CPU, SHARED = HitSource.CPU, HitSource.SHARED


def _planner(cpu_gbps=25.0, cpu_lat_ms=0.0, shared_gbps=2.0, shared_lat_ms=0.0, tokens_per_s=20_000.0,
             ns_per_pair=0.0, pass_ms=0.0, head_factor=None) -> OverlapPlanner:
    """A planner fed exact observations of the given costs (several sizes, so latency and slope separate);
    with ``head_factor``, heads observed beside their loads too, that many times slower than a pass alone."""
    p = OverlapPlanner()
    for n in (1, 4, 16, 64):
        size = n * 2**20
        p.observe_move(CPU, size, cpu_lat_ms * 1e-3 + size / (cpu_gbps * 1e9))
        p.observe_move(SHARED, size, shared_lat_ms * 1e-3 + size / (shared_gbps * 1e9))
    for tokens, context in ((16, 0), (256, 512), (1024, 0), (64, 4096), (2048, 2048)):
        pairs = tokens * (context + (tokens + 1) / 2)
        seconds = pass_ms * 1e-3 + tokens / tokens_per_s + ns_per_pair * 1e-9 * pairs
        p.observe_compute(tokens, context, seconds)
        if head_factor is not None:
            p.observe_compute(tokens, context, head_factor * seconds, beside_loads=True)
    return p


def _query(runs, context=0, tail_tokens=100, bs=16, overlap=True, block_bytes=2 * 2**20) -> HitQuery:
    hit = sum(n for _, n in runs)
    return HitQuery(block_size=bs, block_bytes=block_bytes, context_tokens=context, runs=runs,
                    num_tokens=context + hit * bs + tail_tokens, overlap=overlap)


def test_estimates_recover_exact_costs():
    """Observations of an exact model give back its bandwidth, latency and prefill speed."""
    est = _planner(cpu_gbps=25, cpu_lat_ms=0.5, shared_gbps=2, shared_lat_ms=3, ns_per_pair=0.01,
                   pass_ms=2.0).estimates()
    assert est["cpu_gbps"] == pytest.approx(25, rel=1e-6) and est["cpu_latency_ms"] == pytest.approx(0.5, rel=1e-6)
    assert est["shared_gbps"] == pytest.approx(2, rel=1e-6) and est["shared_latency_ms"] == pytest.approx(3)
    assert est["prefill_tokens_per_s"] == pytest.approx(20_000, rel=1e-6)
    assert est["prefill_ns_per_pair"] == pytest.approx(0.01, rel=1e-6)
    assert est["prefill_latency_ms"] == pytest.approx(2.0, rel=1e-6)
    assert est["cpu_samples"] == 4 and est["prefill_samples"] == 5


def test_move_estimate_ignores_a_minority_of_outliers():
    """A quarter of the window wildly slow (copies that queued behind others) leaves the fit where it was."""
    m = MoveEstimate(window=32)
    for i in range(24):
        size = (1 + i % 6) * 2**20
        m.observe(size, 1e-4 + size / 10e9)
    for i in range(8):
        m.observe((1 + i % 6) * 2**20, 1.0)  # 1 s each: outliers
    latency, per_byte = m.fit()
    assert 1 / per_byte == pytest.approx(10e9, rel=0.05) and latency == pytest.approx(1e-4, abs=5e-5)


def test_estimates_keep_a_bounded_window_and_follow_a_change():
    """Only the last ``window`` observations count: a link that became slower is seen within a window."""
    m = MoveEstimate(window=8)
    for size in range(1, 100):
        m.observe(size * 1000, size * 1000 / 10e9)
    for size in range(1, 9):
        m.observe(size * 1000, size * 1000 / 1e9)
    assert m.samples == 8 and 1e-9 / m.fit()[1] == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf])
def test_unusable_observations_are_ignored(bad):
    """Zero, negative, NaN or infinite figures are dropped, never raised on."""
    m, c = MoveEstimate(), ComputeEstimate()
    m.observe(bad, 1.0)
    m.observe(1000, bad)
    c.observe(bad, 0, 1.0)
    c.observe(10, 0, bad)
    c.observe(10, bad if bad != 0 else -1, 1.0)
    assert m.samples == 0 and c.samples == 0 and m.fit() is None and c.fit() is None


def test_a_fixed_cost_per_forward_pass_is_not_taken_for_slow_tokens():
    """Short passes (a suffix of a few tokens) and long ones: their fixed cost is a latency, not a token rate."""
    c = ComputeEstimate()
    for tokens in (16, 16, 16, 768, 512, 16, 1024):
        c.observe(tokens, 0, 0.5 + tokens / 1000)  # 0.5 s a pass, 1,000 tokens/s
    assert c.seconds(1000, 0) == pytest.approx(1.5) and c.as_dict()["tokens_per_s"] == pytest.approx(1000)


def test_compute_estimate_uses_the_engines_figure_until_it_observes():
    """A prior prefill speed answers until the first observation replaces it."""
    c = ComputeEstimate(prior_tokens_per_s=1000.0)
    assert c.seconds(100, 0) == pytest.approx(0.1)
    c.observe(100, 0, 1.0)
    assert c.seconds(100, 0) == pytest.approx(1.0)


def test_without_estimates_the_hit_is_loaded_or_probed():
    """No compute estimate yet: load everything. A source without an estimate: load one block of it (a probe)."""
    p = OverlapPlanner()
    q = _query([(CPU, 4), (SHARED, 8)])
    assert p.plan(q) == LoadPlan.load_all(12) and p.estimate_ms(q, p.plan(q)) is None
    p.observe_compute(100, 0, 0.01)
    p.observe_move(CPU, 1000, 1e-6)
    assert p.plan(q) == LoadPlan(11, 1, 12)  # the shared tier is still unknown: its last block, with the head
    assert p.plan(_query([(CPU, 4), (SHARED, 8)], overlap=False)) == LoadPlan(0, 1, 12)
    assert p.estimate_ms(q, p.plan(q)) is None


def _one_size_planner(probe_share=0.1):
    """Compute known exactly (20,000 tokens/s, 50 ms a pass); each link seen once, moving one 2 MiB block with
    2 ms of latency (a one-block probe): 1 GB/s per byte as far as a one-size estimate can tell, 25 GB/s true."""
    p = OverlapPlanner(probe_share=probe_share)
    for tokens, context in ((16, 0), (256, 512), (1024, 0), (2048, 2048)):
        p.observe_compute(tokens, context, 0.05 + tokens / 20_000)
    for source in (CPU, SHARED):
        p.observe_move(source, 2 * 2**20, 2e-3 + 2 * 2**20 / 25e9)
    return p


def test_a_one_size_estimate_is_probed_with_the_tail_that_lands_while_the_head_computes():
    """A link seen at one size only: the plan loads the longest tail that lands beside the head by that
    (pessimistic) estimate, no dearer by the model than ``probe_share`` over the best; once a second size is seen,
    latency and bandwidth come apart and the plan loads more; a probe that would teach nothing is not made."""
    q = _query([(SHARED, 200)], tail_tokens=16)
    p = _one_size_planner()
    best = min(p.estimate_ms(q, LoadPlan(k, e - k, 200)) for e in range(201) for k in range(e + 1))
    probe = p.plan(q)
    assert probe.accepted_blocks == 200 and probe.load_blocks > 1
    model = p.estimate_ms(q, probe)
    assert model <= best * 1.1 + 1e-9
    head = p.head_seconds(probe.compute_blocks * 16, 0)
    assert p.move_seconds(SHARED, probe.load_blocks * q.block_bytes) <= head  # lands while the head computes
    for source in (CPU, SHARED):  # what the probe's moves take on the true links
        size = probe.load_blocks * q.block_bytes
        p.observe_move(source, size, 2e-3 + size / 25e9)
    assert p.estimates()["shared_gbps"] == pytest.approx(25, rel=1e-6)
    assert p.plan(q).load_blocks > probe.load_blocks
    assert _one_size_planner(probe_share=0).plan(q) == LoadPlan(0, 0, 200)  # the best plan, by the model
    assert _one_size_planner().plan(_query([(SHARED, 200)], tail_tokens=16, overlap=False)).compute_blocks == 0
    tiny = _query([(SHARED, 1)], tail_tokens=16)  # the only tail is the one block already seen: nothing to learn
    assert _one_size_planner().plan(tiny) == _one_size_planner(probe_share=0).plan(tiny)


def test_a_slow_tier_is_loaded_from_the_back_while_the_head_computes():
    """A tier slower than recompute still helps: load its tail while computing its head."""
    p = _planner(shared_gbps=0.5)
    q = _query([(SHARED, 100)])
    plan = p.plan(q)
    assert 0 < plan.compute_blocks < 100 and plan.accepted_blocks == 100
    assert p.estimate_ms(q, plan) < min(p.estimate_ms(q, LoadPlan.load_all(100)),
                                        p.estimate_ms(q, LoadPlan(0, 0, 100)))


def test_heads_slowed_by_their_loads_are_planned_at_their_own_speed():
    """Heads observed beside their step's loads are what a head costs (not a pass alone): 1.5 times slower, the
    plan computes fewer head blocks, or none where overlapping no longer beats recomputing alone; recompute keeps
    the speed of a pass alone."""
    q = _query([(SHARED, 100)])
    alone, slowed = _planner(shared_gbps=2.0), _planner(shared_gbps=2.0, head_factor=1.5)
    assert 0 < slowed.plan(q).compute_blocks < alone.plan(q).compute_blocks
    assert slowed.head_seconds(1024, 0) == pytest.approx(1.5 * alone.compute_seconds(1024, 0), rel=1e-6)
    assert slowed.compute_seconds(1024, 0) == pytest.approx(alone.compute_seconds(1024, 0), rel=1e-6)
    assert slowed.estimate_ms(q, LoadPlan(0, 0, 100)) == pytest.approx(alone.estimate_ms(q, LoadPlan(0, 0, 100)))
    assert slowed.estimates()["head_samples"] == 5 and alone.estimates()["head_samples"] == 0
    assert _planner(shared_gbps=0.5).plan(q).compute_blocks > 0
    assert _planner(shared_gbps=0.5, head_factor=1.5).plan(q) == LoadPlan(0, 0, 100)


def test_heads_of_one_size_give_a_slowdown_that_holds_at_every_size():
    """Heads of nearly one size (as a serving engine's are) with a little noise: the planner reads how many times
    slower than a pass alone they run, and plans a head of any other size at that factor."""
    import random

    p = _planner(tokens_per_s=57_000, pass_ms=57.0, ns_per_pair=1.05)
    rng = random.Random(0)
    for _ in range(8):
        tokens = rng.randint(19_800, 20_200)
        p.observe_compute(tokens, 0, 1.3 * p.compute_seconds(tokens, 0) * rng.uniform(0.97, 1.03), beside_loads=True)
    for tokens, context in ((512, 0), (5_000, 1_000), (30_000, 0)):
        assert p.head_seconds(tokens, context) == pytest.approx(1.3 * p.compute_seconds(tokens, context), rel=0.04)
    assert p.estimates()["head_slowdown"] == pytest.approx(1.3, rel=0.04) and p.estimates()["head_samples"] == 8


def test_without_overlap_a_slow_tier_is_declined_and_a_fast_one_loaded():
    """An engine that loads a prefix only: the CPU part is kept, a shared part slower than compute declined."""
    p = _planner(shared_gbps=0.5)
    assert p.plan(_query([(CPU, 10), (SHARED, 50)], overlap=False)) == LoadPlan(0, 10, 60)
    assert _planner(shared_gbps=50).plan(_query([(CPU, 10), (SHARED, 50)], overlap=False)) == LoadPlan(0, 60, 60)


def test_a_latency_above_the_whole_recompute_declines_the_hit():
    """A tier whose fixed latency alone exceeds recomputing the hit is not used at all."""
    p = _planner(shared_lat_ms=1000)
    assert p.plan(_query([(SHARED, 4)])) == LoadPlan(0, 0, 4)


def test_load_all_planner_loads_everything_and_estimates_nothing():
    """The baseline planner: every hit loaded, no estimate."""
    p = LoadAllPlanner()
    q = _query([(CPU, 3), (SHARED, 2)])
    assert isinstance(p, LoadPlanner) and p.plan(q) == LoadPlan.load_all(5) and p.estimate_ms(q, p.plan(q)) is None


@pytest.mark.parametrize("kwargs", [
    {"compute_blocks": 3, "load_blocks": 3, "hit_blocks": 5},
    {"compute_blocks": -1, "load_blocks": 0, "hit_blocks": 5},
    {"compute_blocks": True, "load_blocks": 0, "hit_blocks": 5},
])
def test_a_plan_outside_its_hit_is_refused(kwargs):
    """A plan is validated where it is made, quoting the bad count."""
    with pytest.raises(PlanError):
        LoadPlan(**kwargs)


def test_a_query_must_leave_a_token_to_compute():
    """The hit never reaches the prompt's end: one token is always computed."""
    with pytest.raises(PlanError, match="at least one token"):
        HitQuery(block_size=16, block_bytes=1, context_tokens=0, runs=[(CPU, 2)], num_tokens=32)
    with pytest.raises(PlanError, match="source"):
        HitQuery(block_size=16, block_bytes=1, context_tokens=0, runs=[("disk", 2)], num_tokens=64)


_costs = st.fixed_dictionaries({
    "cpu_gbps": st.floats(0.5, 100), "cpu_lat_ms": st.floats(0, 5), "shared_gbps": st.floats(0.05, 100),
    "shared_lat_ms": st.floats(0, 50), "tokens_per_s": st.floats(500, 100_000), "ns_per_pair": st.floats(0, 0.5),
    "pass_ms": st.floats(0, 20), "head_factor": st.none() | st.floats(1, 4)})
_runs = st.lists(st.tuples(st.sampled_from([CPU, SHARED]), st.integers(1, 12)), min_size=0, max_size=3)


@settings(max_examples=300, deadline=None)
@given(costs=_costs, runs=_runs, context=st.integers(0, 64), tail=st.integers(1, 600),
       bs=st.sampled_from([1, 16, 256]), overlap=st.booleans())
def test_the_plan_is_never_slower_than_any_other_by_its_own_estimates(costs, runs, context, tail, bs, overlap):
    """No plan is faster by the planner's own estimate than loading the whole hit or recomputing it, and no
    (head, tail end) a brute force tries beats it by more than one block's compute and load."""
    p = _planner(**costs)
    q = _query(runs, context=context * bs, tail_tokens=tail, bs=bs, overlap=overlap)
    plan = p.plan(q)
    h = q.hit_blocks
    assert plan.hit_blocks == h and (overlap or plan.compute_blocks == 0)
    chosen = p.estimate_ms(q, plan)
    others = [LoadPlan(k, e - k, h) for e in range(h + 1) for k in (range(e + 1) if overlap else (0,))]
    best = min(p.estimate_ms(q, o) for o in others)
    whole = min(p.estimate_ms(q, LoadPlan.load_all(h)), p.estimate_ms(q, LoadPlan(0, 0, h)))
    assert chosen <= whole * (1 + 1e-9) + 1e-9
    at = q.context_tokens + h * bs
    block = 1e3 * (max(p.compute_seconds(bs, at), p.head_seconds(bs, at)) + p.move_seconds(SHARED, q.block_bytes)
                   + p.move_seconds(CPU, q.block_bytes))  # one block's compute (as a head or not), fetch and copy
    assert chosen <= best * (1 + 1e-9) + block + 1e-9


@pytest.mark.parametrize("kwargs", [{"window": 1}, {"prefill_tokens_per_s": 0}, {"prefill_tokens_per_s": "fast"},
                                    {"prefill_tokens_per_s": math.inf}, {"probe_share": -0.1},
                                    {"probe_share": math.inf}, {"probe_share": "some"}])
def test_bad_planner_options_are_refused(kwargs):
    from kvkit.errors import ConfigError

    with pytest.raises(ConfigError):
        OverlapPlanner(**kwargs)
