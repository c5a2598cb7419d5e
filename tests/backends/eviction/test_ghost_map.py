"""The compiled ghost map (hit density's block hash -> eviction number) keeps a dict's contract."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvkit.backends.eviction.hit_density import booking

GhostMap: Any = booking.LOOPS.compiled.ghost_map if booking.LOOPS.compiled is not None else None
pytestmark = pytest.mark.skipif(GhostMap is None, reason="the compiled loops were not built")


class Clash:
    """A key whose hash is one of a few values, so keys share home slots and probe runs wrap the table;
    equal to another exactly when their names are."""

    def __init__(self, name: int, hash_value: int) -> None:
        self.name, self.hash_value = name, hash_value

    def __hash__(self) -> int:
        return self.hash_value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Clash) and other.name == self.name

    def __repr__(self) -> str:
        return f"Clash({self.name}, {self.hash_value})"


# Keys: block hashes of every size (small ints, 64-bit, 256-bit digests), and clashing keys whose hashes
# pile up on a few slots (including -1, which Python's hash turns into -2, and -2 itself).
_KEYS = st.one_of(
    st.integers(-3, 40),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**256 - 1),
    st.builds(Clash, st.integers(0, 30), st.sampled_from([0, 1, 8, 2**61 - 1, -1, -2, 2**63 - 1])),
)
_VALUES = st.integers(-(2**63), 2**63 - 1)


class GhostMapAgainstDict(RuleBasedStateMachine):
    """Every operation on a GhostMap and on a dict of the same entries: the same answers, the same
    refusals, the same entries after it."""

    def __init__(self) -> None:
        super().__init__()
        self.map, self.model = GhostMap(), {}
        self.known: list[Any] = []  # keys put in, some since removed: lookups of present and absent keys

    def _key(self, data: st.DataObject) -> Any:
        if self.known and data.draw(st.booleans()):
            return data.draw(st.sampled_from(self.known))
        return data.draw(_KEYS)

    @rule(data=st.data(), value=_VALUES)
    def set(self, data: st.DataObject, value: int) -> None:
        key = self._key(data)
        self.map[key] = value
        self.model[key] = value
        self.known.append(key)

    @rule(data=st.data(), default=st.sampled_from([None, -7, "no default"]))
    def pop(self, data: st.DataObject, default: Any) -> None:
        key = self._key(data)
        if default == "no default":
            expected = self.model.pop(key, KeyError)
            if expected is KeyError:
                with pytest.raises(KeyError):
                    self.map.pop(key)
            else:
                assert self.map.pop(key) == expected
        else:
            assert self.map.pop(key, default) == self.model.pop(key, default)

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        key = self._key(data)
        if key in self.model:
            del self.model[key]
            del self.map[key]
        else:
            with pytest.raises(KeyError):
                del self.map[key]

    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        key = self._key(data)
        assert (key in self.map) == (key in self.model)
        assert self.map.get(key) == self.model.get(key)
        assert self.map.get(key, -5) == self.model.get(key, -5)
        if key in self.model:
            assert self.map[key] == self.model[key]
        else:
            with pytest.raises(KeyError):
                self.map[key]

    @rule(entries=st.lists(st.tuples(_KEYS, _VALUES), max_size=40), as_dict=st.booleans())
    def update(self, entries: list[tuple[Any, int]], as_dict: bool) -> None:
        self.map.update(dict(entries) if as_dict else iter(entries))
        self.model.update(entries)
        self.known.extend(key for key, _ in entries)

    @rule(data=st.data(), bad=st.sampled_from([1.5, "3", None, 2**63, -(2**63) - 1]))
    def refuse_a_value(self, data: st.DataObject, bad: Any) -> None:
        """A value that is no int of 64 bits is refused and changes nothing (a present key keeps its value)."""
        key = self._key(data)
        with pytest.raises((TypeError, OverflowError)):
            self.map[key] = bad

    @rule()
    def refuse_an_unhashable_key(self) -> None:
        with pytest.raises(TypeError):
            self.map[[1, 2]] = 1
        with pytest.raises(TypeError):
            self.map.pop({}, None)

    @rule()
    def copies(self) -> None:
        """A pickled or deep-copied map is an equal, separate map."""
        for twin in (pickle.loads(pickle.dumps(self.map)), copy.deepcopy(self.map), GhostMap(self.map)):
            assert type(twin) is GhostMap and twin == self.model and twin == self.map
            twin[10**30] = 1
            assert (10**30 in self.map) == (10**30 in self.model)

    @invariant()
    def same_entries(self) -> None:
        assert len(self.map) == len(self.model)
        assert dict(self.map.items()) == self.model
        assert sorted(map(repr, self.map)) == sorted(map(repr, self.model))
        assert self.map == self.model and (self.map != self.model) is False
        assert sorted(self.map.values()) == sorted(self.model.values())


TestGhostMapAgainstDict = GhostMapAgainstDict.TestCase
TestGhostMapAgainstDict.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_a_table_emptied_shrinks_and_one_filled_grows_within_four_slots_an_entry() -> None:
    """The table never holds more than four slots per entry of its peak, and gives back memory when emptied."""
    ghost = GhostMap()
    empty = ghost.__sizeof__()
    for key in range(10_000):
        ghost[key * 2**70] = key
    peak = ghost.__sizeof__()
    assert peak - empty <= 4 * 10_000 * 24
    for key in range(10_000):
        del ghost[key * 2**70]
    assert len(ghost) == 0 and ghost.__sizeof__() - empty <= 8 * 24


def test_a_comparison_that_changes_the_map_or_raises_is_refused() -> None:
    """A key whose == changes the map mid-lookup is refused (RuntimeError), as is one whose == raises (its
    error): the map stays a valid map with its entries."""
    ghost = GhostMap()

    class Meddler(Clash):
        __hash__ = Clash.__hash__

        def __eq__(self, other: object) -> bool:
            ghost[object()] = 0  # a new key: the table changes under the lookup
            return False

    class Raiser(Clash):
        __hash__ = Clash.__hash__

        def __eq__(self, other: object) -> bool:
            raise ValueError("no comparison")

    ghost[Clash(1, 5)] = 1
    with pytest.raises(RuntimeError, match="changed while a key was compared"):
        ghost.get(Meddler(2, 5))
    with pytest.raises(ValueError, match="no comparison"):
        ghost[Raiser(3, 5)] = 3
    assert ghost[Clash(1, 5)] == 1 and len(ghost) == 2


def test_the_policy_keeps_its_ghosts_in_the_map_of_its_booking() -> None:
    from kvkit.backends.eviction.hit_density import HitDensityPolicy

    assert type(HitDensityPolicy()._ghost_at) is GhostMap
    assert booking.LOOPS.reference.ghost_map is dict
