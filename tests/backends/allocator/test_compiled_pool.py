"""The pool's compiled loops against its own Python loops: the same calls leave the same state and make the
same policy calls, bad input included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvkit.backends.allocator import BlockPool, loops
from kvkit.backends.eviction.hit_density import HitDensityPolicy
from kvkit.backends.eviction.lfu import LFUPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.interfaces.eviction import EvictionPolicy

_BUILT = pytest.mark.skipif(loops.LOOPS.compiled is None, reason="the compiled loops were not built")

N = 12  # blocks per pool
_HOOKS = ("on_insert", "on_remove", "on_access", "on_pin", "on_unpin", "insert_pinned", "remove_many", "pin_many",
          "unpin_many", "access_many", "select_victims")


@pytest.mark.compiler
def test_the_compiled_loops_were_built() -> None:
    """Where a C compiler is, the install built the pool's loops, and a pool runs them by default."""
    assert loops.LOOPS.compiled is not None, "pip install -e . did not build allocator/_pool_loops.c"
    assert BlockPool(4, eviction=LRUPolicy())._loops is loops.LOOPS.compiled


def _recording(base: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """``base`` with every hook it has logged to ``self.log`` (name and arguments, lists copied) before it runs."""

    def hook(name: str) -> Any:
        def logged(self: Any, *args: Any) -> Any:
            self.log.append((name, *(list(a) if isinstance(a, list) else a for a in args if not callable(a))))
            return getattr(super(cls, self), name)(*args)
        return logged

    cls = type(f"Recording{base.__name__}", (base,), {name: hook(name) for name in _HOOKS if hasattr(base, name)})
    return cls


_POLICIES = {"lru": _recording(LRUPolicy), "lfu": _recording(LFUPolicy), "hit-density": _recording(HitDensityPolicy)}


def _pool(policy: str) -> BlockPool:
    recorder = _POLICIES[policy]()
    recorder.log = []  # type: ignore[attr-defined]
    pool = BlockPool(N, eviction=recorder)
    pool.add_evict_listener(lambda blocks, hashes: recorder.log.append(("evicted", list(blocks), list(hashes))))  # type: ignore[attr-defined]
    return pool


def _state(pool: BlockPool) -> tuple[Any, ...]:
    """The pool's whole state, the policy's calls so far and its order of victims."""
    policy: Any = pool.policy
    pool.check_invariants()
    return (list(pool._ref), list(pool._hash), list(pool._index.items()), list(pool._empty), pool._num_evictable,
            pool._version, len(policy), list(policy.log), pool.eviction_candidates(N))


def _run(pool: BlockPool, op: tuple[Any, ...]) -> Any:
    """The call's result, or its error's type and message."""
    try:
        return getattr(pool, op[0])(*op[1:])
    except Exception as exc:  # noqa: BLE001 (every error is compared)
        return type(exc), str(exc)


# Ids, hashes and parents: mostly plain ints in range, sometimes NumPy integers, and things no pool takes.
_ODD = st.sampled_from([True, np.bool_(False), 1.0, "1", None, 2**70, -1, N, N + 3])
_IDS = st.one_of(st.integers(0, N - 1), st.integers(0, N - 1).map(np.int64), _ODD)
_ID_LISTS = st.one_of(st.lists(st.integers(0, N - 1), max_size=6),  # plain: the compiled loops run
                      st.lists(st.integers(0, N - 1), max_size=6).map(tuple),
                      st.lists(_IDS, max_size=6))
_HASHES = st.one_of(st.integers(0, 20), st.integers(0, 20).map(np.int64), st.sampled_from([True, "h", None]))
_PARENTS = st.one_of(st.none(), st.integers(0, 20), st.integers(0, 20).map(np.int64), st.just("p"))


@st.composite
def _commits(draw: st.DrawFn) -> tuple[Any, ...]:
    """commit: of the blocks held and not ready (``None`` picks them at run time) or of any ids; hashes and
    parents of the same length mostly, plain mostly."""
    blocks = draw(st.one_of(st.none(), _ID_LISTS))
    count = draw(st.integers(0, 6)) if blocks is None else len(blocks)
    hashes = draw(st.one_of(st.lists(st.integers(0, 20), min_size=count, max_size=count),
                            st.lists(_HASHES, min_size=count, max_size=count), st.lists(st.integers(0, 20))))
    parents = draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(0, 20)), min_size=count,
                                                 max_size=count),
                             st.lists(_PARENTS, min_size=count, max_size=count).map(tuple)))
    return ("commit", blocks, hashes, parents)


# Plain calls on the blocks held (picked at run time) come often, so blocks get stored, released and evicted.
_HELD = st.one_of(st.tuples(st.just("allocate"), st.integers(0, 6)),
                  st.tuples(st.just("commit"), st.sampled_from([None, None, "twice"]),
                            st.lists(st.integers(0, 20), min_size=1, max_size=6),
                            st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(0, 20)), min_size=7,
                                                          max_size=7),
                                      st.lists(_PARENTS, min_size=7, max_size=7))),
                  st.tuples(st.just("decref"), st.none()),
                  # a call on the blocks held with one item spoilt: the odd one anywhere in it
                  st.tuples(st.just("spoil"), st.sampled_from(["incref", "decref", "blocks", "hashes", "parents"]),
                            st.one_of(_ODD, st.integers(0, N - 1).map(np.int64), st.sampled_from([2**70, -5])),
                            st.integers(0, 5)),
                  st.tuples(st.just("store"), st.lists(st.integers(0, 30), min_size=1, max_size=8), st.booleans()))
_OPS = st.lists(st.one_of(
    _HELD, _HELD, _HELD,
    st.tuples(st.just("allocate"), st.one_of(st.integers(0, N + 2), st.sampled_from([-1, True, 2.0]))),
    st.tuples(st.just("incref"), _ID_LISTS),
    st.tuples(st.just("decref"), st.one_of(st.none(), _ID_LISTS)),  # None: the blocks held, at run time
    _commits(),
    st.tuples(st.just("touch"), st.lists(st.integers(0, N - 1), max_size=4)),
    st.tuples(st.just("lookup"), st.lists(st.integers(0, 20), max_size=4)),
    st.tuples(st.just("reset"), st.booleans()),
), min_size=20, max_size=80)


def _bound(op: tuple[Any, ...], reference: BlockPool) -> tuple[Any, ...]:
    """``op`` with the blocks it picks at run time (``None``) chosen from the reference pool's state."""
    if op[0] == "commit" and op[1] in (None, "twice"):  # "twice": the first block named again, last
        held = [b for b in range(N) if reference._ref[b] and reference._hash[b] is None][:len(op[2])]
        hashes = op[2][:len(held)]
        if op[1] == "twice":  # under a hash no other block has
            held, hashes = [*held, *held[:1]], [*hashes, 21]
        return ("commit", held, hashes, None if op[3] is None else op[3][:len(held)])
    if op[0] == "decref" and op[1] is None:
        return ("decref", [b for b in range(N) for _ in range(reference._ref[b])][::2])
    return op


@_BUILT
@settings(max_examples=300, deadline=None)
@example(policy="hit-density", ops=[("allocate", 12), ("commit", None, list(range(12)), None), ("decref", None),
                                    ("decref", None), ("allocate", 5), ("commit", None, [1, 2, 3], [None, 1, 2])])
@example(policy="lru", ops=[("allocate", 3), ("commit", [0, 1, 2], [5, 5, 6], None), ("decref", [0, 1, 1, 2]),
                            ("decref", [0, 1]), ("incref", [0, 2, 2]), ("commit", [1, 1], [7, 8], None)])
@given(policy=st.sampled_from(sorted(_POLICIES)), ops=_OPS)
def test_compiled_pool_is_the_reference(policy: str, ops: list[tuple[Any, ...]]) -> None:
    """Two pools take the same calls, one running the compiled loops and one its own Python loops: after
    every call both returned or raised the same, hold the same refcounts, hashes, index (in order), empty
    stack and counters, and their policies heard the same calls in the same order and agree on victims."""
    compiled, reference = _pool(policy), _pool(policy)
    reference._loops = loops.LOOPS.reference
    for op in ops:
        if op[0] == "spoil":
            _, what, odd, at = op
            call = list(_bound(("commit", None, list(range(6)), [None] * 6) if what in ("blocks", "hashes", "parents")
                               else (what, None), reference))
            if what == "incref":
                call[1] = [b for b in range(N) if reference._ref[b] or reference._hash[b] is not None]
            place = {"incref": 1, "decref": 1, "blocks": 1, "hashes": 2, "parents": 3}[what]
            call[place] = items = list(call[place])
            if items:
                items[at % len(items)] = odd
            calls = [tuple(call)]
        elif op[0] == "store":  # allocate, commit as a chain, release: the blocks become evictable
            _, hashes, release = op
            calls = [("allocate", len(hashes)), ("commit", None, hashes, [None, *hashes[:-1]])]
            calls += [("decref", None)] if release else []
        else:
            calls = [op]
        for call in calls:
            call = _bound(call, reference)
            assert repr(_run(compiled, call)) == repr(_run(reference, call)), call  # repr: ints stay ints
            assert repr(_state(compiled)) == repr(_state(reference)), call


@_BUILT
@pytest.mark.parametrize(("loop", "args"), [
    ("incref", ([1, 1], [5, 6], [0, 2])), ("incref", ([1, 1], [5, 6], [0, -1])),
    ("decref", ([1, 1], [5, 6], [0, 2])), ("decref", ([1, 1], [5, 6], [0, -1])),
    ("commit", ([1, 1], [None, None], {}, [0, 2], [7, 8], None)), ("hand_out", ([0, 0], [0, 2])),
    ("drop", ([5, 6], {5: 0, 6: 1}, [0, 2], [5, 6])), ("drop", ([5, 6], {5: 0, 6: 1}, [-1], [6])),
], ids=str)
def test_an_id_out_of_range_takes_the_python_path(loop: str, args: tuple[Any, ...]) -> None:
    """A compiled loop reads and writes no slot outside the lists: an id past either end returns its sentinel
    (a loop that writes as it goes writes only in range; the Python then raises)."""
    assert loops.LOOPS.compiled is not None
    before = repr(args)
    assert getattr(loops.LOOPS.compiled, loop)(*args) in (None, False)
    if loop == "hand_out":  # it writes 1s as it goes, which the Python loop writes again
        assert args[0] == [1, 0]
    else:
        assert repr(args) == before
