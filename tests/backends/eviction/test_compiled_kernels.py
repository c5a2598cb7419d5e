"""The refresh's compiled kernels (the density model's and the census) against their references: the same
inputs give the same bits."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvkit.backends.eviction.hit_density as hit_density
from kvkit.backends.eviction.hit_density import HitDensityPolicy, census, kernels
from kvkit.backends.eviction.hit_density.density import HitDensityModel

_BUILT = pytest.mark.skipif(kernels.LOOPS.compiled is None or census.LOOPS.compiled is None,
                            reason="the compiled kernels were not built")
# Counts near the largest float overflow the reference's sums to inf, and ``0 * inf`` is NaN: numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered",
                                        "ignore:divide by zero encountered")


@pytest.mark.compiler
def test_the_compiled_kernels_were_built() -> None:
    """Where a C compiler is, the install built the kernels, and a model runs them by default."""
    assert kernels.LOOPS.compiled is not None, "pip install -e . did not build hit_density/_kernels.c"
    assert HitDensityModel(3)._loops is kernels.LOOPS.compiled
    assert HitDensityPolicy().model._loops is kernels.LOOPS.compiled
    assert census.LOOPS.compiled is not None, "pip install -e . did not build hit_density/_census.c"
    assert HitDensityPolicy()._census is census.LOOPS.compiled


REFERENCED = "the reference ran"


def _run(module: Any, name: str, *args: Any) -> Any:
    """The compiled function ``name`` of ``module``'s twins on ``args``, or :data:`REFERENCED` where it ran
    the reference instead (the module's function of that name, patched meanwhile to say so)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, name, lambda *_: REFERENCED)
        return getattr(module.LOOPS.compiled, name)(*args)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal to the last bit (signed zeros and NaNs included)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# Counts of every scale: none, tiny (subnormal), fractional (decayed), whole, huge (sums may overflow to inf).
_COUNTS = st.one_of(st.sampled_from([0.0, 0.0, 0.0, 5e-324, 1e-300, 0.25, 1.0, 3.0, 1e300, 1.7e308,
                                     float(np.finfo(np.float64).max)]),
                    st.floats(0, 1e6), st.integers(0, 50).map(float))


@st.composite
def _histograms(draw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(reuses, events, widths, fades)`` in the kernel's contract: rows of any evidence (none, one bucket,
    many), events at least the reuses, the widths and fades of a model or drawn."""
    rows = draw(st.integers(1, 5))
    if draw(st.booleans()):
        model = HitDensityModel(1, per_octave=draw(st.integers(1, 3)))
        buckets, widths, fades = model.buckets, model._widths, model._fades
        seen = draw(st.integers(1, 12))  # the evidence of a trace: young ages only
    else:
        buckets = seen = draw(st.integers(1, 12))
        widths = np.array(draw(st.lists(st.one_of(st.floats(1e-300, 1e12), st.sampled_from([0.0, 1.0])),
                                        min_size=buckets, max_size=buckets)))
        fades = np.array(draw(st.lists(st.floats(0, 1), min_size=buckets, max_size=buckets)))
    reuses, events = np.zeros((rows, buckets)), np.zeros((rows, buckets))
    for r in range(rows):
        for b in draw(st.lists(st.integers(0, seen - 1), max_size=seen, unique=True)):
            reused, ended = draw(_COUNTS), draw(_COUNTS)
            reuses[r, b] = reused
            events[r, b] = reused + ended if reused + ended < np.inf else reused  # finite (the sums may not be)
    return reuses, events, widths, fades


@_BUILT
@settings(max_examples=400, deadline=None)
@example(case=(np.zeros((2, 3)), np.zeros((2, 3)), np.ones(3), np.ones(3)))  # no evidence at all
@example(case=(np.array([[1.0]]), np.array([[1.0]]), np.array([2.0]), np.array([1.0])))  # one bucket, all reused
@example(case=(np.array([[0.0, 1.0]]), np.array([[0.0, 3.0]]), np.array([1.0, 1.0]), np.array([1.0, 0.5])))
@given(case=_histograms())
def test_compiled_densities_are_the_reference(case: tuple[np.ndarray, ...]) -> None:
    """Within its contract the compiled kernel computes every table the reference does, to the last bit."""
    reuses, events, widths, fades = case
    expected = kernels.densities(reuses, events, widths, fades, np.full(reuses.shape, np.nan))
    got = _run(kernels, "densities", reuses, events, widths, fades, np.full(reuses.shape, np.nan))
    assert got is not REFERENCED, "declined an input in its contract"
    assert _same(got, expected)


@_BUILT
@pytest.mark.parametrize("spoil", [lambda r, e: r.__setitem__((0, 1), np.nan),
                                   lambda r, e: e.__setitem__((1, 0), np.inf),
                                   lambda r, e: e.__setitem__((0, 2), -1.0),
                                   lambda r, e: r.__setitem__((1, 1), -0.0),
                                   lambda r, e: e.__setitem__((0, 3), -0.0),
                                   lambda r, e: r.__setitem__((1, 2), 9.0)])  # more reuses than events
def test_compiled_densities_decline_counts_outside_their_contract(spoil: Any) -> None:
    """A count that is not a number, infinite, negative or -0.0, or reuses above their events: the compiled
    kernel writes nothing and runs the reference."""
    reuses, events = np.array([[2.0, 1.0, 0.0, 1.0], [1.0, 0.0, 4.0, 0.0]]), np.full((2, 4), 5.0)
    spoil(reuses, events)
    widths, fades = np.ones(4), np.array([1.0, 0.5, 0.25, 0.125])
    out = np.full((2, 4), 7.0)
    assert _run(kernels, "densities", reuses, events, widths, fades, out) is REFERENCED
    assert (out == 7.0).all()
    expected = kernels.densities(reuses, events, widths, fades, np.empty((2, 4)))
    assert kernels.LOOPS.compiled is not None
    assert _same(kernels.LOOPS.compiled.densities(reuses, events, widths, fades, out), expected)


@_BUILT
@pytest.mark.parametrize("args", [
    (np.ones((2, 3)), np.ones((2, 3)), np.ones(3), np.ones(3), np.empty((2, 4))),  # out of another shape
    (np.ones((2, 3)), np.ones((3, 3)), np.ones(3), np.ones(3), np.empty((2, 3))),  # events of another shape
    (np.ones((2, 3)), np.ones((2, 3)), np.ones(2), np.ones(3), np.empty((2, 3))),  # too few widths
    (np.ones((2, 3)), np.ones((2, 3)), np.ones(3), np.ones(4), np.empty((2, 3))),  # more fades than buckets
    (np.ones((2, 3), np.float32), np.ones((2, 3)), np.ones(3), np.ones(3), np.empty((2, 3))),  # not float64
    (np.ones((3, 2)).T, np.ones((2, 3)), np.ones(3), np.ones(3), np.empty((2, 3))),  # not C-contiguous
    (np.ones(3), np.ones(3), np.ones(3), np.ones(3), np.empty(3)),  # one dimension
    ([[1.0]], [[1.0]], [1.0], [1.0], np.empty((1, 1))),  # not arrays
    (np.ones((2, 3)), np.ones((2, 3)), np.ones(3), np.ones(3), np.ones((2, 3))[:, ::-1]),  # out not contiguous
    (np.ones((2, 0)), np.ones((2, 0)), np.ones(0), np.ones(0), np.empty((2, 0))),  # no buckets
])
def test_compiled_densities_decline_arrays_outside_their_contract(args: tuple[Any, ...]) -> None:
    """Arrays of another type, shape or layout: nothing written, the reference runs."""
    out = args[-1]
    before = np.array(out, copy=True)
    assert _run(kernels, "densities", *args) is REFERENCED
    assert _same(np.asarray(out), before)


# Values and weights of every scale; zeros make columns of no evidence, tiny weights means of one row's.
_VALUES = st.one_of(st.sampled_from([0.0, 5e-324, 1e-300, 1.0, 1e300]), st.floats(0, 1e9))
_WEIGHTS = st.one_of(st.sampled_from([0.0, 0.0, 5e-324, 1e-300, 0.5, 1.0, 3.0, 1e300]), st.floats(0, 1e6))


@_BUILT
@settings(max_examples=400, deadline=None)
@example(values=np.array([[2.0, 1.0], [1.0, 2.0]]), weights=np.zeros((2, 2)))  # all-zero columns
@example(values=np.array([[3.0, 0.0], [1.0, 0.0], [2.0, 5.0]]), weights=np.array([[1.0, 0.0], [2.0, 0.0],
                                                                                    [0.0, 1.0]]))
@given(values=st.tuples(st.integers(1, 8), st.integers(1, 6)).flatmap(
    lambda shape: st.lists(_VALUES, min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]).map(
        lambda cells: np.array(cells).reshape(shape))),
    weights=st.lists(_WEIGHTS, min_size=48, max_size=48).map(np.array))
def test_compiled_isotonic_is_the_reference(values: np.ndarray, weights: np.ndarray) -> None:
    """Every fit the reference makes, the compiled kernel makes to the last bit (or declines, where a mean
    is ``0 / 0`` or the array has one column, and the reference runs)."""
    weights = weights[:values.size].reshape(values.shape)
    expected = kernels.isotonic(values, weights)
    got = _run(kernels, "isotonic", values, weights, np.full(values.shape, np.nan))
    totals = weights.sum(axis=0)
    if values.shape[1] > 1 and not np.signbit(weights).any() and ((totals == 0) | (1e-9 * totals > 0)).all():
        # every weight positive once 1e-9 of its column's total (or 1e-9) is added: every mean a number
        assert got is not REFERENCED, "declined an input in its contract"
    if got is not REFERENCED:
        assert _same(got, expected)
    assert kernels.LOOPS.compiled is not None
    assert _same(kernels.LOOPS.compiled.isotonic(values, weights, np.empty_like(values)), expected)


@_BUILT
@settings(max_examples=100, deadline=None)
@given(shape=st.tuples(st.integers(1, 8), st.integers(2, 200)),
       cells=st.lists(st.tuples(_VALUES, _WEIGHTS), min_size=1, max_size=48))
def test_compiled_isotonic_of_many_columns_is_the_reference(shape: tuple[int, int],
                                                            cells: list[tuple[float, float]]) -> None:
    """Arrays as wide as a model's chains side by side (the kernel fits its columns a block at a time):
    the reference's bits, or declined where the reference's means are not all numbers."""
    values, weights = (np.resize(np.array(column), shape) for column in zip(*cells))
    expected = kernels.isotonic(values, weights)
    got = _run(kernels, "isotonic", values, weights, np.full(shape, np.nan))
    if got is not REFERENCED:
        assert _same(got, expected)
    else:
        assert not (expected == expected).all() or np.signbit(weights).any() or np.signbit(values).any() \
            or not ((values >= 0) & (weights >= 0)).all(), "declined an input in its contract"


def _spoiled(row: int, column: int, value: float, weight: float) -> tuple[np.ndarray, np.ndarray]:
    values, weights = np.array([[3.0, 1.0], [1.0, 2.0], [2.0, 0.0]]), np.array([[0.0, 1.0], [2.0, 0.0], [1.0, 1.0]])
    values[row, column], weights[row, column] = value, weight
    return values, weights


@_BUILT
@pytest.mark.parametrize(("case", "declined"), [
    (_spoiled(0, 1, np.nan, 1.0), True), (_spoiled(1, 0, -2.0, 1.0), True), (_spoiled(2, 1, -0.0, 1.0), True),
    (_spoiled(1, 1, 2.0, -1.0), True), (_spoiled(0, 0, 3.0, -0.0), True), (_spoiled(2, 0, 2.0, np.nan), True),
    (_spoiled(0, 0, np.inf, 0.0), False),  # inf over the column's 1e-9 share: an inf mean, a number
    ((np.array([[np.inf, 1.0], [1.0, 1.0]]), np.array([[0.0, 1.0], [1e-320, 1.0]])), True),  # 1e-9 of 1e-320 is 0
])
def test_compiled_isotonic_declines_values_outside_its_contract(case: tuple[np.ndarray, np.ndarray],
                                                                declined: bool) -> None:
    """A value or weight negative, -0.0 or not a number, or a mean that is not a number (``inf * 0``): the
    compiled kernel writes nothing and runs the reference."""
    values, weights = case
    out = np.full(values.shape, 7.0)
    assert (_run(kernels, "isotonic", values, weights, out) is REFERENCED) == declined
    assert (out == 7.0).all() == declined
    assert kernels.LOOPS.compiled is not None
    with np.errstate(all="ignore"):
        assert _same(kernels.LOOPS.compiled.isotonic(values, weights, out), kernels.isotonic(values, weights))


@_BUILT
def test_compiled_isotonic_declines_one_column_and_other_shapes() -> None:
    """One column (numpy sums it pairwise, not row after row), mismatched shapes, other types: the reference
    runs."""
    assert _run(kernels, "isotonic", np.ones((9, 1)), np.ones((9, 1)), np.empty((9, 1))) is REFERENCED
    assert _run(kernels, "isotonic", np.ones((2, 3)), np.ones((3, 3)), np.empty((2, 3))) is REFERENCED
    assert _run(kernels, "isotonic", np.ones((2, 3)), np.ones((2, 3)), np.empty((2, 2))) is REFERENCED
    assert _run(kernels, "isotonic", np.ones((2, 3)), np.ones((2, 3), np.float32), np.empty((2, 3))) is REFERENCED
    assert _run(kernels, "isotonic", np.ones((0, 3)), np.ones((0, 3)), np.empty((0, 3))) is REFERENCED
    assert kernels.LOOPS.compiled is not None
    with pytest.raises(TypeError):
        kernels.LOOPS.compiled.isotonic(np.ones((2, 3)), np.ones((2, 3)))


@_BUILT
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), classes=st.integers(1, 22), per_octave=st.integers(1, 4),
       min_samples=st.integers(1, 64), chained=st.booleans())
def test_compiled_model_refreshes_as_the_reference(seed: int, classes: int, per_octave: int, min_samples: int,
                                                   chained: bool) -> None:
    """Two models, one on each kernels, record the same events and refresh with the same census (sparse rows
    pooled, chains fitted): after every refresh their tables are the same bits."""
    rng = np.random.default_rng(seed)
    monotone = (tuple(range(0, classes, 3)), tuple(range(1, classes, 3))) if chained else ()
    twins = [HitDensityModel(classes, per_octave=per_octave, min_samples=min_samples, monotone=monotone)
             for _ in range(2)]
    twins[1]._loops = kernels.LOOPS.reference
    for _ in range(6):
        n = int(rng.integers(0, 300))
        cls, ages = rng.integers(0, classes, n), (rng.pareto(0.7, n) * 10).astype(np.int64)
        reused = rng.random(n) < 0.4
        live = int(rng.integers(0, 100))
        live_cls, live_ages = rng.integers(0, classes, live), (rng.pareto(0.7, live) * 10).astype(np.int64)
        weights = None if rng.random() < 0.5 else rng.choice([1.0, 2.5, 1e-300, 1e200], live)
        keep = float(rng.choice([0.0, 0.5, 0.99, 1.0]))
        for model in twins:
            for c, age in zip(cls[reused].tolist(), ages[reused].tolist()):
                model.record_reuse(c, age)
            model.record_ends(cls[~reused].tolist(), ages[~reused].tolist())
            model.refresh(live_cls, live_ages, keep, weights)
        assert twins[0].table is not None and twins[1].table is not None
        assert _same(twins[0].table, twins[1].table)
        assert twins[0].rows == twins[1].rows


def _hash(conversation: int, position: int) -> int:
    return conversation * 1000 + position + 1


@_BUILT
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, 9), st.integers(0, 12), st.integers(1, 40)),
    st.tuples(st.just("hit"), st.integers(0, 9), st.integers(1, 12), st.integers(1, 6)),
    st.tuples(st.just("evict"), st.integers(1, 30)),
), max_size=80), capacity=st.sampled_from([None, 8, 32]), limit=st.sampled_from([1 << 18, 1, 3, 16]))
def test_compiled_policy_refreshes_as_the_reference(ops: list[tuple[Any, ...]], capacity: int | None,
                                                    limit: int) -> None:
    """Two policies take the same calls, one counting its census and refreshing its model compiled, one with
    the references (small census limits sample the census): after every call both hold the same density
    table and choose the same victims."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hit_density, "_CENSUS_LIMIT", limit)
        _drive_twins(ops, capacity)


def _drive_twins(ops: list[tuple[Any, ...]], capacity: int | None) -> None:
    twins = [HitDensityPolicy(capacity=capacity) for _ in range(2)]
    twins[1].model._loops, twins[1]._census = kernels.LOOPS.reference, census.LOOPS.reference
    free, block_of = list(range(300)), {}
    for op in ops:
        if op[0] == "store":
            _, conversation, start, n = op
            hashes = [h for h in (_hash(conversation, i) for i in range(start, start + n)) if h not in block_of]
            for block_hash in hashes[:len(free)]:
                block = free.pop()
                block_of[block_hash] = block
                parent = block_hash - 1 if block_hash % 1000 != 1 else None
                for policy in twins:
                    policy.on_insert(block, block_hash, parent)
        elif op[0] == "hit":
            _, conversation, length, times = op
            hit = [block_of[h] for h in (_hash(conversation, i) for i in range(length)) if h in block_of]
            for policy in twins:
                policy.access_many(hit * times)
        else:
            chosen = [policy.select_victims(op[1], lambda block: True) for policy in twins]
            assert chosen[0] == chosen[1]
            if chosen[0]:
                for policy in twins:
                    policy.remove_many(chosen[0])
                gone = set(chosen[0])
                for block_hash in [h for h, block in block_of.items() if block in gone]:
                    del block_of[block_hash]
                free += chosen[0]
        tables = [policy.model.table for policy in twins]
        assert (tables[0] is None) == (tables[1] is None)
        if tables[0] is not None and tables[1] is not None:
            assert _same(tables[0], tables[1])
    for policy in twins:
        policy.check_invariants()


@pytest.mark.parametrize("per_octave", range(1, 9))
def test_the_census_buckets_are_the_models_at_every_bucket_edge(per_octave: int) -> None:
    """At each bucket's first age and the age before it (the only ages where a floating-point log could
    round across an edge), :meth:`~.HitDensityModel.buckets_of` is the integer :meth:`~.HitDensityModel.bucket`
    the compiled census computes from :attr:`~.HitDensityModel.first_ages`."""
    model = HitDensityModel(1, per_octave=per_octave)
    ages = sorted({a + d for a in model.first_ages for d in (-1, 0, 1) if a + d >= 0} | {2**62, 2**63 - 2})
    assert model.buckets_of(np.array(ages, np.int64)).tolist() == [model.bucket(a) for a in ages]


@st.composite
def _censuses(draw: Any) -> tuple[Any, ...]:
    """A census's arguments in the compiled count's contract: live bytes over ids, classes of the model, last
    accesses at most the clock (ages at bucket edges, huge, zero), turns and limits that sample or not."""
    model = HitDensityModel(draw(st.integers(1, 9)), per_octave=draw(st.integers(1, 4)))
    clock = draw(st.one_of(st.integers(0, 5_000), st.just(2**63 - 1)))
    ages = st.one_of(st.integers(0, clock), st.sampled_from([a for a in model.first_ages if a <= clock]),
                     st.sampled_from([max(a - 1, 0) for a in model.first_ages if a <= clock]), st.just(clock))
    groups = []
    for _ in range(2):
        n = draw(st.integers(0, 40))
        live = bytearray(draw(st.lists(st.sampled_from([0, 1, 2, 255]), min_size=n, max_size=n)))
        classes = bytearray(draw(st.lists(st.integers(0, model.classes - 1), min_size=n, max_size=n)))
        lasts = array("q", [clock - age for age in draw(st.lists(ages, min_size=n, max_size=n))])
        groups += [live, classes, lasts]
    turn, limit = draw(st.integers(0, 7)), draw(st.sampled_from([1, 2, 3, 7, 1 << 18]))
    return (*groups, clock, turn, limit, model)


@_BUILT
@settings(max_examples=400, deadline=None)
@example(args=(bytearray(), bytearray(), array("q"), bytearray(), bytearray(), array("q"), 0, 1, 1,
               HitDensityModel(2)))  # nothing live
@example(args=(bytearray([1]), bytearray([1]), array("q", [-(2**63 - 1)]), bytearray(), bytearray(), array("q"), 0, 1,
               1, HitDensityModel(2)))  # the largest age, from a negative access
@given(args=_censuses())
def test_compiled_census_is_the_reference(args: tuple[Any, ...]) -> None:
    """Within its contract the compiled census counts every histogram the reference does, to the last bit."""
    model = args[-1]
    expected = census.read(*args, np.full((model.classes, model.buckets), np.nan))
    got = _run(census, "read", *args, np.full((model.classes, model.buckets), np.nan))
    assert got is not REFERENCED, "declined a census in its contract"
    assert _same(got, expected)


def _census_args(**change: Any) -> list[Any]:
    """A census of two tracked blocks and two ghosts (one live each), with the given arguments changed."""
    model = HitDensityModel(3)
    args = dict(where=bytearray([1, 0, 2]), classes=bytearray([2, 0, 1]), lasts=array("q", [5, 0, 9]),
                ghost_live=bytearray([0, 1]), ghost_classes=bytearray([0, 1]), ghost_lasts=array("q", [0, 3]),
                clock=10, turn=1, limit=4, model=model, out=np.full((model.classes, model.buckets), 7.0))
    args.update(change)
    return list(args.values())


@_BUILT
@pytest.mark.parametrize("change", [
    dict(classes=bytearray([2, 0, 3])),  # a class the model has not
    dict(lasts=array("q", [5, 0, 11])),  # accessed after the clock
    dict(ghost_lasts=array("q", [0, -(2**63)])),  # an age past the int64 range
    dict(where=bytearray([1, 0, 2, 1])),  # a live id past the classes and last accesses
    # ... where the memory past them holds a valid class and access (views of longer arrays)
    dict(where=bytearray([1, 0, 2, 1]), classes=np.array([2, 0, 1, 0], np.uint8)[:3],
         lasts=np.array([5, 0, 9, 3])[:3]),
    dict(ghost_live=bytearray([0, 1, 1]), ghost_classes=bytearray([0, 1, 0]),  # past the last accesses only
         ghost_lasts=np.array([0, 3, 1])[:2]),
    dict(ghost_live=bytearray([0, 1, 1]), ghost_classes=np.array([0, 1, 0], np.uint8)[:2],
         ghost_lasts=np.array([0, 3, 1])),  # past the classes only
    dict(limit=0),  # the reference divides by it
    dict(turn=-1), dict(clock=2**64), dict(clock=10.0),
    dict(lasts=array("i", [5, 0, 9])), dict(lasts=[5, 0, 9]), dict(where=array("h", [1, 0, 2])),
    dict(out=np.zeros((3, 4))), dict(out=np.zeros((2, 160))), dict(out=np.zeros((3, 160), np.float32)),
    dict(model=HitDensityModel(4)), dict(model=object()),
])
def test_compiled_census_declines_what_is_outside_its_contract(change: dict[str, Any]) -> None:
    """Outside its contract the compiled census writes nothing and runs the reference, which gives the same
    histogram or raises as it does."""
    args = _census_args(**change)
    out = args[-1]
    before = out.copy()
    assert _run(census, "read", *args) is REFERENCED
    assert _same(out, before)
    assert census.LOOPS.compiled is not None
    try:
        expected: Any = census.read(*_census_args(**change))
    except Exception as error:  # noqa: BLE001 - whichever the reference raises, the compiled raises too
        with pytest.raises(type(error)):
            census.LOOPS.compiled.read(*args)
    else:
        assert _same(census.LOOPS.compiled.read(*args), expected)


@_BUILT
def test_compiled_census_takes_its_arguments() -> None:
    """Too few arguments: a TypeError, as calling the reference so would raise."""
    assert census.LOOPS.compiled is not None
    with pytest.raises(TypeError):
        census.LOOPS.compiled.read(*_census_args()[:-1])
