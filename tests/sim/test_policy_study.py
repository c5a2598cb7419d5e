"""Tests for the policy study: trace replay through the real pool, and ``kvkit policies``."""

import json

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

import kvkit.cli as cli
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.errors import ConfigError
from kvkit.sim.policy_study import OPT, default_policies, replay, study
from kvkit.sim.synthetic import SyntheticWorkload, generate
from kvkit.sim.traces import TraceRequest, write_trace

small_workloads = st.builds(
    SyntheticWorkload,
    seed=st.integers(0, 2**32),
    num_conversations=st.integers(1, 12),
    block_size=st.just(16),
    num_system_prompts=st.integers(1, 3),
    system_prompt_tokens=st.just((0, 160)),
    max_turns=st.integers(1, 6),
    user_tokens_mean=st.floats(8, 80),
    output_tokens_mean=st.floats(8, 80),
    think_time_mean_s=st.floats(0.1, 60),
)


def _trace(*chains: tuple[int, ...]) -> list[TraceRequest]:
    return [TraceRequest(i, 16 * len(c), 1, c, i + 1) for i, c in enumerate(chains)]


def test_hits_count_only_the_cached_prefix():
    """A block hits only while every earlier block of its request hit."""
    trace = _trace((0, 1, 2), (0, 1, 3), (9, 1, 2))
    stats = replay(trace, 100, "lru", check_invariants=True)
    # request 2 hits 0 and 1; request 3 hits nothing: 1 and 2 are cached but 9 is not
    assert (stats.hits, stats.references) == (2, 9)
    assert stats.hit_ratio == pytest.approx(2 / 9)


def test_misses_are_cached_after_their_request():
    """Every block of a request is in the pool afterwards, so a repeat hits in full."""
    stats = replay(_trace((5, 6, 7), (5, 6, 7)), 3, "fifo", check_invariants=True)
    assert (stats.hits, stats.references) == (3, 6)


def test_request_larger_than_the_pool_caches_its_first_blocks_per_request():
    """Stored per request, one longer than the pool caches only its first `capacity` blocks, raising nothing."""
    stats = replay(_trace((0, 1, 2, 3, 4), (0, 1, 2, 3, 4)), 2, "lru", stores="per-request", check_invariants=True)
    assert stats.hits == 2


@pytest.mark.parametrize(("policy", "hits"), [("lru", 0), (OPT, 1)])
def test_per_block_stores_let_a_request_evict_its_own_blocks(policy, hits):
    """Stored block by block, a long request's later blocks may push out its earlier ones.

    LRU keeps the last two (orphans: nothing hits); the optimum keeps block 0
    (each later block must enter, so it replaces the one before it).
    """
    stats = replay(_trace((0, 1, 2, 3, 4), (0, 1, 2, 3, 4)), 2, policy, check_invariants=True)
    assert stats.hits == hits


def test_per_block_stores_release_the_hits_first():
    """Per block, a request's hits are released before its stores, so the stores may evict them.

    Pool of 2: the second request hits block 0, then stores 5 and 6. Per request,
    0 stays pinned beside one new block (the pool can hold only one); per block
    LRU evicts 0's neighbour 1 for 5, then 0 for 6.
    """
    trace = _trace((0, 1), (0, 5, 6), (0, 1))
    assert replay(trace, 2, "lru", check_invariants=True).hits == 1
    assert replay(trace, 2, "lru", stores="per-request", check_invariants=True).hits == 2


@pytest.mark.parametrize("stores", ["per-bloc", None, 1])
def test_bad_stores_is_a_config_error(stores):
    """An unknown ``stores`` raises ConfigError quoting it, before any replay."""
    with pytest.raises(ConfigError, match=f"stores must be one of per-block, per-request, got {stores!r}"):
        replay(_trace((0,)), 4, stores=stores)
    with pytest.raises(ConfigError, match="stores must be"):
        study(_trace((0,)), [4], ["lru"], stores=stores, jobs=1)


@given(small_workloads, st.sampled_from(default_policies()))
def test_unbounded_pool_hits_every_repeat(workload, policy):
    """With room for every block, each policy hits exactly the repeated block references."""
    trace = list(generate(workload))
    distinct = len({b for r in trace for b in r.hash_ids})
    stats = replay(trace, distinct + 1, policy)
    assert stats.hits == stats.references - distinct


@given(small_workloads, st.integers(1, 120), st.sampled_from(["per-block", "per-request"]))
def test_optimum_beats_every_policy_on_plain_references(workload, capacity, stores):
    """Belady's optimum hits at least as often as every other policy where hits are plain references.

    Each block reference is its own one-block request, so the prefix hit rule
    and request-wide pins drop out and Belady's MIN is optimal (under the
    prefix rule it is not: a tiny pool that keeps a chain's head can beat it).
    """
    plain = [TraceRequest(i, 16, 1, (h,), i + 1)
             for i, h in enumerate(h for r in generate(workload) for h in r.hash_ids)]
    hits = {p: replay(plain, capacity, p, stores=stores, check_invariants=True).hits for p in default_policies()}
    assert all(hits[OPT] >= h for h in hits.values()), hits


def test_under_the_prefix_rule_the_optimum_is_no_bound():
    """LIRS beats Belady's MIN at 4 blocks on a chat workload whose system prompts a tiny pool cannot hold."""
    workload = SyntheticWorkload(seed=4364, num_conversations=4, block_size=16, num_system_prompts=3,
                                 system_prompt_tokens=(0, 160), max_turns=6, user_tokens_mean=8.0,
                                 output_tokens_mean=8.0, think_time_mean_s=1.0)
    trace = list(generate(workload))
    assert replay(trace, 4, "lirs").hits > replay(trace, 4, OPT).hits


def test_replay_accepts_a_policy_instance():
    """An instance is used as given and reported under its class name."""
    stats = replay(_trace((0, 1), (0, 1)), 4, LRUPolicy())
    assert (stats.policy, stats.hits) == ("LRUPolicy", 2)


@pytest.mark.parametrize("capacity", [0, -5, 2.5, True])
def test_bad_capacity_is_a_config_error(capacity):
    """A capacity that is not a positive int raises ConfigError quoting it."""
    with pytest.raises(ConfigError, match="capacity"):
        replay(_trace((0,)), capacity)


def test_study_rejects_unknown_policies_before_replaying():
    """Unknown policy names raise one ConfigError listing the valid names."""
    with pytest.raises(ConfigError, match=r"valid: .*lru"):
        study(_trace((0,)), [4], ["lru", "belady-ish"], jobs=1)


def test_study_shares_against_the_optimum_in_parallel_and_serially():
    """Results hold every policy (the optimum added) at every capacity, the same with 1 or 2 workers."""
    trace = list(generate(SyntheticWorkload(num_conversations=15, seed=3)))
    serial = study(trace, [40, 160], ["lru", "arc"], jobs=1)
    parallel = study(trace, [40, 160], ["lru", "arc"], jobs=2)
    assert serial.policies == ("lru", "arc", OPT)
    results = serial.results()
    assert results == parallel.results()
    assert set(results) == {"40", "160"}
    for per_policy in results.values():
        assert per_policy[OPT]["of_opt"] == 1.0
        for entry in per_policy.values():
            assert set(entry) == {"hit_ratio", "of_opt"}
            assert 0 <= entry["of_opt"] <= 1
            assert entry["of_opt"] == pytest.approx(entry["hit_ratio"] / per_policy[OPT]["hit_ratio"])


@pytest.fixture
def trace_file(tmp_path):
    """A small synthetic trace at 16-token blocks, written as JSONL."""
    path = tmp_path / "synthetic.jsonl"
    write_trace(path, generate(SyntheticWorkload(num_conversations=12, seed=7)))
    return path


def _run(*args):
    return CliRunner().invoke(cli.main, ["policies", *map(str, args)], terminal_width=200)


def test_cli_json_schema(trace_file):
    """`kvkit policies --json` prints the trace and {capacity: {policy: {hit_ratio, of_opt}}}."""
    result = _run("--trace", trace_file, "--block-size", 16, "--capacities", "30,300",
                  "--policies", "lru,s3fifo", "--jobs", 1, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["trace"] == str(trace_file)
    assert report["block_size"] == 16 and "block_tokens" not in report
    assert report["stores"] == "per-block"
    assert set(report["results"]) == {"30", "300"}
    for per_policy in report["results"].values():
        assert set(per_policy) == {"lru", "s3fifo", OPT}
        assert per_policy[OPT] == {"hit_ratio": per_policy[OPT]["hit_ratio"], "of_opt": 1.0}


def test_cli_stores_choose_the_replay(trace_file):
    """--stores per-request replays as an engine's prefix cache: the JSON says so and its ratios are replay()'s."""
    args = ("--trace", trace_file, "--block-size", 16, "--capacities", "30", "--policies", "lru", "--jobs", 1, "--json")
    reports = {stores: json.loads(_run(*args, "--stores", stores).stdout) for stores in ("per-block", "per-request")}
    requests = list(generate(SyntheticWorkload(num_conversations=12, seed=7)))
    for stores, report in reports.items():
        assert report["stores"] == stores
        assert report["results"]["30"]["lru"]["hit_ratio"] == replay(requests, 30, "lru", stores=stores).hit_ratio


def test_cli_table_and_plot(trace_file, tmp_path):
    """Without --json a table names every policy, and --plot writes a PNG."""
    plot = tmp_path / "hits.png"
    result = _run("--trace", trace_file, "--block-size", 16, "--capacities", "50",
                  "--jobs", 1, "--plot", plot)
    assert result.exit_code == 0, result.output
    assert all(p in result.stdout for p in default_policies())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("args", "message"), [
    (["--capacities", "10,x"], "positive block counts"),
    (["--capacities", "0"], "positive block counts"),
    (["--policies", "lru,nope"], "--policies='nope': unknown eviction policy"),
    (["--block-size", "512"], "field 'hash_ids'"),  # the file uses 16-token blocks
    (["--stores", "per-blok"], "'per-blok' is not one of 'per-block', 'per-request'"),
])
def test_cli_bad_input_is_one_line_error(trace_file, args, message):
    """Bad options or a trace at the wrong block size exit 2 with a one-line error, no traceback."""
    defaults = {"--block-size": "16", "--jobs": "1"}
    defaults.update(dict(zip(args[::2], args[1::2])))
    result = _run("--trace", trace_file, *[x for kv in defaults.items() for x in kv])
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output




def test_a_policy_named_for_replay_reads_the_trace_clock():
    """``hinted`` given by name is built with the replay's TraceClock: the same hits as an instance given it."""
    from kvkit.backends.eviction.hinted import HintedPolicy
    from kvkit.interfaces.hints import WorkloadHints
    from kvkit.sim.policy_study import TraceClock, replay
    from kvkit.sim.synthetic import shape

    requests = list(shape("chat@num_conversations=30").requests())
    hints = [WorkloadHints(ttl_s=20.0) if i % 2 else WorkloadHints(priority=-1) for i in range(len(requests))]
    by_name_clock = TraceClock()
    by_name = replay(requests, 64, "hinted", hints=hints, clock=by_name_clock)
    given_clock = TraceClock()
    given = replay(requests, 64, HintedPolicy(clock=given_clock), hints=hints, clock=given_clock)
    assert (by_name.hits, by_name.references) == (given.hits, given.references)
    with pytest.raises(ConfigError, match=r"clock=5: must be a TraceClock"):
        replay(requests, 64, "hinted", clock=5)
