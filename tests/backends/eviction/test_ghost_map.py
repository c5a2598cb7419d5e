"""The compiled ghost map (hit density's ghost key -> eviction number) keeps a dict's contract for int keys."""

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


# Keys: what the ghost keys a block hash by (Python's hash: an int of 64 bits, never -1), small ones and ones
# at the ends of the range; a few keys drawn again and again so probe runs form and wrap the table.
_KEYS = st.one_of(
    st.integers(-3, 40).filter(lambda key: key != -1),
    st.integers(-(2**63), 2**63 - 1).filter(lambda key: key != -1),
    st.sampled_from([0, -2, 2**61 - 1, 2**63 - 1, -(2**63), 2**62, 8, 16, 24]),
)
# What is no key: absent to every lookup, refused by every store.
_NOT_KEYS = st.sampled_from([-1, 2**63, -(2**63) - 1, 2**256, 1.5, "3", None, (1, 2), b"k"])
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

    @rule(bad=_NOT_KEYS, value=_VALUES)
    def refuse_what_is_no_key(self, bad: Any, value: int) -> None:
        """What is no int of 64 bits other than -1 is absent to every lookup and refused by every store
        (quoted), changing nothing."""
        assert bad not in self.map and self.map.get(bad, -5) == -5 and self.map.pop(bad, -6) == -6
        for lookup in (self.map.__getitem__, self.map.pop, self.map.__delitem__):
            with pytest.raises(KeyError):
                lookup(bad)
        with pytest.raises(ValueError if isinstance(bad, int) else TypeError, match="GhostMap keys are ints"):
            self.map[bad] = value
        with pytest.raises((TypeError, ValueError)):
            self.map.update([(bad, value)])

    @rule()
    def copies(self) -> None:
        """A pickled or deep-copied map is an equal, separate map."""
        for twin in (pickle.loads(pickle.dumps(self.map)), copy.deepcopy(self.map), GhostMap(self.map)):
            assert type(twin) is GhostMap and twin == self.model and twin == self.map
            twin[10**15] = 1
            assert (10**15 in self.map) == (10**15 in self.model)

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
    """The table never holds more than four 16-byte slots per entry of its peak, and gives back memory when
    emptied."""
    ghost = GhostMap()
    empty = ghost.__sizeof__()
    for key in range(10_000):
        ghost[key * 2**40] = key
    peak = ghost.__sizeof__()
    assert peak - empty <= 4 * 10_000 * 16
    for key in range(10_000):
        del ghost[key * 2**40]
    assert len(ghost) == 0 and ghost.__sizeof__() - empty <= 8 * 16


def test_the_policy_keeps_its_ghosts_in_the_map_of_its_booking() -> None:
    from kvkit.backends.eviction.hit_density import HitDensityPolicy

    assert type(HitDensityPolicy()._ghost_at) is GhostMap
    assert booking.LOOPS.reference.ghost_map is dict
