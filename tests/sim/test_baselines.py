"""libCacheSim baselines: plain and prefix counting, agreement with kvkit's LRU, clear errors."""

from __future__ import annotations

import pytest

from kvkit.errors import BackendUnavailableError, ConfigError
from kvkit.sim.baselines import libcachesim_study
from kvkit.sim.policy_study import replay
from kvkit.sim.synthetic import SyntheticWorkload
from kvkit.sim.traces import TraceRequest

pytest.importorskip("libcachesim")

REQUESTS = list(SyntheticWorkload(num_conversations=80, block_size=64).requests())


def test_prefix_lru_agrees_with_kvkit_lru_on_chains() -> None:
    """On chat chains LRU never keeps a child without its parent: both countings equal kvkit's replay."""
    plain, prefix = (libcachesim_study(REQUESTS, [150], ["LRU"], prefix=p)[0] for p in (False, True))
    assert plain.hits == prefix.hits == replay(REQUESTS, 150, "lru").hits
    assert plain.policy == "lcs:LRU"


@pytest.mark.parametrize("capacity", [20, 60, 150])
@pytest.mark.parametrize(("kvkit", "lcs"), [("lru", "LRU"), ("fifo", "FIFO"), ("opt", "Belady")])
def test_per_block_replay_is_libcachesim_prefix_counting(kvkit, lcs, capacity) -> None:
    """kvkit's default replay runs libCacheSim's rules: the same rule scores the same.

    The optimum hits at least as often as Belady (up to 3.5% more at 20 blocks):
    it also knows the next use of a block left untouched after a miss, which
    libCacheSim's Belady never hears of.
    """
    requests = list(SyntheticWorkload(num_conversations=60, block_size=16, seed=3).requests())
    ours = replay(requests, capacity, kvkit)
    theirs = libcachesim_study(requests, [capacity], [lcs], prefix=True)[0]
    assert ours.references == theirs.references
    if kvkit == "opt":
        assert theirs.hits <= ours.hits
    else:
        assert ours.hits == theirs.hits


@pytest.mark.parametrize("capacity", [20, 60, 150, 1000])
def test_kvkit_lirs_scores_as_libcachesim_lirs(capacity) -> None:
    """kvkit's LIRS learns the pool's size, libCacheSim's is told it: its provisional LIR blocks
    stand for the first HIR ones, so the two agree. Not to the block: on a hit to a resident HIR
    block outside the stack libCacheSim also demotes an LIR block and evicts one, which the
    paper does not and a policy driven by a pool cannot (11 hits of 47,846 references at 150)."""
    requests = list(SyntheticWorkload(num_conversations=60, block_size=16, seed=3).requests())
    ours = replay(requests, capacity, "lirs")
    theirs = libcachesim_study(requests, [capacity], ["LIRS"], prefix=True)[0]
    assert abs(ours.hits - theirs.hits) <= ours.references / 1000


def test_an_iterator_of_requests_is_read_once() -> None:
    """A trace read lazily (``read_trace``'s iterator) scores as the same requests in a list."""
    listed = libcachesim_study(REQUESTS, [60], ["LRU", "ARC"], prefix=True)
    streamed = libcachesim_study(iter(REQUESTS), [60], ["LRU", "ARC"], prefix=True)
    assert [(s.policy, s.hits, s.references) for s in streamed] == [(s.policy, s.hits, s.references) for s in listed]


def test_plain_counting_counts_blocks_cached_after_a_miss() -> None:
    """A cached block after its request's first miss is a plain hit, never a prefix hit."""
    requests = [TraceRequest(0, 32, 1, (1, 2), 1), TraceRequest(1, 16, 1, (3,), 2),
                TraceRequest(2, 32, 1, (4, 2), 3)]
    plain, prefix = (libcachesim_study(requests, [8], ["LRU"], prefix=p)[0] for p in (False, True))
    assert (plain.hits, prefix.hits) == (1, 0)


def test_belady_bounds_every_baseline() -> None:
    """libCacheSim's offline optimum hits at least as often as each online baseline."""
    stats = {s.policy: s.hits for s in libcachesim_study(REQUESTS, [150])}
    assert stats["lcs:Belady"] == max(stats.values())


def test_unknown_baseline_is_refused_before_any_replay() -> None:
    """A name that is not a libCacheSim cache is quoted, with the valid names."""
    with pytest.raises(ConfigError, match=r"'Nope'.*LRU, ARC"):
        libcachesim_study(REQUESTS, [10], ["LRU", "Nope"])


def test_missing_package_is_a_clear_error(without_libcachesim) -> None:
    """Without the extra the study says which package and extra to install."""
    with pytest.raises(BackendUnavailableError, match=r"kvkit\[libcachesim\]"):
        libcachesim_study(REQUESTS, [10])
