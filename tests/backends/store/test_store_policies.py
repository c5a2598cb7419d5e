"""The built-in store policies: what each one answers, and how it validates its options.

The rules every policy keeps are checked by the store policy contract (``test_contract.py``).
"""

from __future__ import annotations

import math
import re
from collections import Counter

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.backends.store import EagerStore, LazyStore, NeverStore, SelectiveStore
from kvkit.errors import ConfigError
from kvkit.registry import STORE


@attrs.define
class View:
    """A minimal ``RequestView``."""

    request_id: str
    block_hashes: list[int]
    num_confirmed_blocks: int = 0


@pytest.mark.parametrize(("name", "cls"), [("eager", EagerStore), ("lazy", LazyStore),
                                       ("selective", SelectiveStore), ("never", NeverStore)])
def test_registry_names_load_each_policy(name, cls):
    """The store registry's built-in names load these classes."""
    assert STORE.load(name) is cls


@given(start=st.integers(0, 50), length=st.integers(0, 50))
def test_eager_stores_the_confirmed_range_once_unless_told_to_flush(start, length):
    """Eager answers exactly the newly confirmed range; on finish nothing by default (each block is stored once),
    every confirmed block with ``flush_limit=None``."""
    stop = start + length
    view = View("r", list(range(stop)), stop)
    for policy, flushed in ((EagerStore(), []), (EagerStore(flush_limit=None), list(range(stop)))):
        assert list(policy.on_computed(view, start, stop)) == list(range(start, stop))
        assert list(policy.on_finished(view)) == flushed
        assert policy.writeback_target(0, 100) == 0


@given(confirmed=st.integers(0, 60), limit=st.integers(0, 80), start=st.integers(0, 60))
def test_eager_s_flush_limit_bounds_the_finish_to_the_history_s_head(confirmed, limit, start):
    """With ``flush_limit`` the finish answers the first ``min(confirmed, limit)`` blocks; progress is unchanged."""
    view = View("r", list(range(confirmed)), confirmed)
    policy = EagerStore(flush_limit=limit)
    assert list(policy.on_finished(view)) == list(range(min(confirmed, limit)))
    stop = max(start, confirmed)
    assert list(policy.on_computed(view, start, stop)) == list(range(start, stop))


@pytest.mark.parametrize("bad", [-1, True, 1.5, "32", [32]])
def test_eager_refuses_a_flush_limit_that_is_no_count(bad):
    """A flush limit that is not an int >= 0 (or None) is a ConfigError quoting it, through the registry too."""
    for make in (lambda: EagerStore(flush_limit=bad), lambda: STORE.create("eager", flush_limit=bad)):
        with pytest.raises(ConfigError, match=re.escape(f"flush_limit={bad!r}")):
            make()


def test_eager_keeps_no_cursor():
    """A range starting at 0 again (a new request over the same prefix) is answered again."""
    policy = EagerStore()
    view = View("r", [1, 2, 3], 3)
    assert list(policy.on_computed(view, 0, 3)) == [0, 1, 2]
    assert list(policy.on_computed(View("s", [1, 2, 3], 3), 0, 3)) == [0, 1, 2]


@given(watermark=st.floats(0.0001, 1.0), blocks=st.integers(1, 100_000), free=st.integers(0, 10))
def test_lazy_target_is_the_watermark_of_the_gpu_pool(watermark, blocks, free):
    """Lazy keeps ``ceil(watermark * gpu_blocks)`` candidates stored ahead and nothing on progress."""
    policy = LazyStore(watermark)
    target = policy.writeback_target(free, blocks)
    assert target == math.ceil(watermark * blocks) and 1 <= target <= blocks
    view = View("r", [1, 2], 2)
    assert not list(policy.on_computed(view, 0, 2)) and not list(policy.on_finished(view))


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), True, "0.5", None])
def test_lazy_rejects_a_bad_watermark(bad):
    """A watermark outside (0, 1] or not a number is a ConfigError quoting it."""
    with pytest.raises(ConfigError, match="watermark"):
        LazyStore(bad)


@pytest.mark.parametrize("field", ["k", "max_tracked"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_selective_rejects_bad_options(field, bad):
    """``k`` and ``max_tracked`` must be positive ints; the error quotes the value."""
    with pytest.raises(ConfigError, match=field):
        SelectiveStore(**{field: bad})


def test_selective_stores_from_the_kth_distinct_request():
    """A hash is stored once ``k`` distinct requests confirmed it; one request never counts twice."""
    policy = SelectiveStore(k=2)
    a = View("a", [10, 11], 2)
    assert list(policy.on_computed(a, 0, 2)) == []
    assert list(policy.on_computed(a, 0, 2)) == []  # a again (after a preemption)
    assert list(policy.on_finished(a)) == []
    b = View("b", [10, 12], 2)
    assert list(policy.on_computed(b, 0, 2)) == [0]
    assert list(policy.on_finished(a)) == [0]  # the flush catches the shared block
    assert policy.count(10) == 2 and policy.count(12) == 1 and policy.count(99) == 0
    policy.check_invariants()


def test_selective_with_k1_behaves_like_eager():
    """``k=1`` stores every confirmed block at once."""
    view = View("r", [1, 2, 3], 3)
    assert list(SelectiveStore(k=1).on_computed(view, 0, 3)) == [0, 1, 2]


@given(sightings=st.lists(st.tuples(st.sampled_from("abcd"), st.lists(st.integers(0, 6),
                                                                       max_size=4)),
                          max_size=30),
       k=st.integers(1, 4))
def test_selective_matches_a_counter_of_distinct_requests(sightings, k):
    """Against a model that counts distinct consecutive requests per hash, answers agree."""
    policy = SelectiveStore(k=k)
    count: Counter = Counter()
    last: dict = {}
    for rid, hashes in sightings:
        view = View(rid, hashes, len(hashes))
        chosen = list(policy.on_computed(view, 0, len(hashes)))
        expected = []
        for i, h in enumerate(hashes):
            if last.get(h) != rid:
                count[h] += 1
                last[h] = rid
            if count[h] >= k:
                expected.append(i)
        assert chosen == expected
    policy.check_invariants()


def test_selective_forgets_the_oldest_hashes_beyond_max_tracked():
    """At most ``max_tracked`` hashes are remembered, the oldest first-seen dropped first."""
    policy = SelectiveStore(k=2, max_tracked=3)
    policy.on_computed(View("a", [1, 2, 3, 4, 5], 5), 0, 5)
    assert [policy.count(h) for h in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 1]
    policy.check_invariants()


def test_never_stores_nothing():
    """Never answers nothing, ever."""
    policy = NeverStore()
    view = View("r", [1, 2], 2)
    assert not list(policy.on_computed(view, 0, 2)) and not list(policy.on_finished(view))
    assert policy.writeback_target(0, 10) == 0
