"""The popularity-shift test of hit density: its exact tail, its false alarms, its power."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.backends.eviction.hit_density import REUSE_LEVELS, HitDensityPolicy
from kvkit.backends.eviction.hit_density.shift import ShiftTest, lower_tail
from kvkit.errors import ConfigError
from kvkit.sim.policy_study import replay
from kvkit.sim.traces import TraceRequest

LEVELS = len(REUSE_LEVELS)


@given(weights=st.lists(st.floats(0, 1), min_size=1, max_size=7).filter(lambda w: sum(w) > 0.01),
       n=st.integers(1, 12), total=st.integers(-2, 90))
def test_lower_tail_is_the_n_fold_convolution_of_the_draws(weights, n, total):
    """P(sum of n draws <= total) equals the direct n-fold convolution, summed up to total."""
    q = np.array(weights) / sum(weights)
    pmf = np.ones(1)
    for _ in range(n):
        pmf = np.convolve(pmf, q)
    assert lower_tail(q, n, total) == pytest.approx(pmf[:max(total + 1, 0)].sum(), abs=1e-12)


def _windows(test: ShiftTest, rng: np.random.Generator, q: np.ndarray, count: int, runs: int) -> int:
    """Feed ``count`` windows of ``runs`` draws from ``q``; return how many were declared shifts."""
    fired = 0
    for _ in range(count):
        for level in rng.choice(len(q), size=runs, p=q):
            test.note(int(level))
        fired += test.check(keep=7 / 8)
        test.check_invariants()
    return fired


@pytest.mark.parametrize("runs", [3, 20, 200])
def test_a_stationary_stream_is_rarely_declared_a_shift(runs):
    """Windows drawn from one distribution, 8 streams of 500: alarms near alpha = 1e-3 per window (at most
    3 alpha: the history is an estimate from about 8 windows, which makes the test a little liberal)."""
    fired = 0
    for seed in range(8):
        rng = np.random.default_rng(seed)
        fired += _windows(ShiftTest(LEVELS), rng, rng.dirichlet(np.ones(LEVELS)), 500, runs)
    assert fired <= 3 * 1e-3 * 8 * 500


def test_a_window_that_falls_down_the_ranking_is_a_shift_and_restarts_the_history():
    """After windows reused at the top levels, a window reused at the bottom is a shift, at once;
    the history restarts, so the next windows are not tested until it holds min_runs runs again."""
    rng = np.random.default_rng(0)
    test = ShiftTest(LEVELS)
    top = np.array([0.02, 0.02, 0.02, 0.04, 0.1, 0.3, 0.5])
    assert _windows(test, rng, top, 40, 20) == 0
    bottom = np.array([0.4, 0.3, 0.2, 0.05, 0.03, 0.01, 0.01])
    assert _windows(test, rng, bottom, 1, 20) == 1 and test.shifts == 1
    assert _windows(test, rng, bottom, 1, 20) == 0  # 20 runs of history < min_runs: not tested


def test_one_run_at_a_rare_level_is_not_a_shift():
    """A history of runs all at the top level, then a window with one run at level 0: not significant,
    since Laplace's pseudo-runs keep an unseen level unlikely rather than impossible."""
    test = ShiftTest(LEVELS)
    for _ in range(60):
        for _ in range(6):
            test.note(LEVELS - 1)
        assert not test.check(keep=7 / 8)
    for level in (LEVELS - 1,) * 5 + (0,):
        test.note(level)
    assert not test.check(keep=7 / 8)


def _note(test: ShiftTest, levels: list[int]) -> None:
    for level in levels:
        test.note(level)


def _settled() -> ShiftTest:
    """A test whose history is 40 windows of 20 runs, half at the top level and half one below."""
    test = ShiftTest(LEVELS)
    for _ in range(40):
        _note(test, [LEVELS - 1] * 10 + [LEVELS - 2] * 10)
        assert not test.check(keep=7 / 8)
    return test


# A window a little low: alone p ~ 1e-2 (no shift at alpha = 1e-3), two pooled ~ 5e-4, three ~ 3e-5.
_LOW = [LEVELS - 4] * 2 + [LEVELS - 2] * 17 + [LEVELS - 1]


def test_low_windows_short_of_significance_are_pooled_until_they_are_a_shift():
    """Each low window alone is not a shift; held out of the history and pooled, the third is, at the
    excursion's third spent level (alpha * 6 / (9 pi^2))."""
    alone = _settled()
    _note(alone, _LOW)
    assert not alone.check(keep=7 / 8) and alone.in_excursion
    test = _settled()
    for fired in (False, False, True):
        _note(test, _LOW)
        assert test.check(keep=7 / 8) is fired
        test.check_invariants()
    assert test.shifts == 1 and not test.in_excursion


def test_a_window_that_no_longer_looks_low_releases_the_held_ones_into_the_history():
    """A held low window, then one at the top: both join the history in order (each scaling it by keep)."""
    test = _settled()
    before = test._history.copy()
    _note(test, _LOW)
    assert not test.check(keep=7 / 8) and test.in_excursion
    _note(test, [LEVELS - 1] * 20)
    assert not test.check(keep=7 / 8) and not test.in_excursion
    low = np.bincount(_LOW, minlength=LEVELS)
    np.testing.assert_allclose(test._history, (before * 7 / 8 + low) * 7 / 8 + np.eye(LEVELS)[-1] * 20)
    test.check_invariants()


def test_an_excursion_is_no_longer_than_the_history_s_memory():
    """At keep = 1/2 the history remembers about 2 windows, so two held windows are released even though
    their pool still looks low and is not yet significant."""
    test = _settled()
    _note(test, _LOW)
    assert not test.check(keep=1 / 2) and test.in_excursion
    _note(test, _LOW)
    assert not test.check(keep=1 / 2) and not test.in_excursion and test.shifts == 0


def test_alpha_zero_never_declares_a_shift():
    rng = np.random.default_rng(1)
    test = ShiftTest(LEVELS, alpha=0)
    _windows(test, rng, np.eye(LEVELS)[-1], 40, 20)
    assert _windows(test, rng, np.eye(LEVELS)[0], 5, 20) == 0


@pytest.mark.parametrize("kwargs", [{"levels": 0}, {"levels": 7, "alpha": 1.0}, {"levels": 7, "alpha": -0.1},
                                    {"levels": 7, "min_runs": 0}])
def test_bad_shift_test_settings_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        ShiftTest(**kwargs)


def _era_trace(seed: int, eras: int, per_era: int, templates: int, blocks: int) -> list[TraceRequest]:
    """Requests for one of ``templates`` chains of ``blocks`` blocks (Zipf popularity, ranks reshuffled
    each era), each followed by a block of its own."""
    rng = np.random.default_rng(seed)
    weights = 1 / np.arange(1, templates + 1)
    requests = []
    for _ in range(eras):
        ranks = rng.permutation(templates)
        for t in rng.choice(templates, size=per_era, p=weights / weights.sum()):
            chain = tuple(10_000 * (int(ranks[t]) + 1) + b for b in range(blocks))
            requests.append(TraceRequest(len(requests), 16 * (blocks + 1), 1, (*chain, -1 - len(requests)),
                                         len(requests) + 1))
    return requests


def test_hit_density_restarts_its_counts_right_after_each_reshuffle():
    """Templates whose popularity is reshuffled every 800 requests: one shift declared within 100
    requests after each reshuffle and none elsewhere (a replay's first k requests replay alike in a
    shorter trace), and more hits than with the test off; with the popularity held still, none."""
    trace = _era_trace(0, eras=4, per_era=800, templates=400, blocks=4)
    shifts = []
    for end in (800, 900, 1600, 1700, 2400, 2500, 3200):
        policy = HitDensityPolicy()
        replay(trace[:end], 400, policy)
        shifts.append(policy.shifts)
    assert shifts == [0, 1, 1, 2, 2, 3, 3]
    off = HitDensityPolicy(shift_alpha=0)
    assert replay(trace, 400, off).hits < replay(trace, 400, HitDensityPolicy()).hits and off.shifts == 0
    still = HitDensityPolicy()
    replay(_era_trace(0, eras=1, per_era=3200, templates=400, blocks=4), 400, still)
    assert still.shifts == 0
