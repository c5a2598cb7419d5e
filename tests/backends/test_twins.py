"""Which set of loops a new object runs: the compiled one where it was built, unless the references are asked for."""

from typing import NamedTuple

import pytest

from kvkit.backends import twins
from kvkit.backends.twins import Twins, compiled


class _Pair(NamedTuple):
    first: object
    second: object


def test_compiled_reads_the_functions_named_as_the_fields() -> None:
    from kvkit.backends.eviction._queue import QueueLoops

    built = compiled(QueueLoops, "kvkit.backends.eviction._queue_loops")
    if built is None:
        pytest.skip("the compiled loops were not built")
    from kvkit.backends.eviction import _queue_loops

    assert type(built) is QueueLoops
    assert built == tuple(getattr(_queue_loops, name) for name in QueueLoops._fields)


def test_a_module_not_built_has_no_compiled_set() -> None:
    assert compiled(_Pair, "kvkit.backends.no_such_extension") is None
    loops = Twins.load(_Pair(len, abs), "kvkit.backends.no_such_extension")
    assert loops == Twins(_Pair(len, abs), None)
    assert loops.default() is loops.reference


def test_the_default_is_the_compiled_set_unless_the_references_are_preferred(monkeypatch) -> None:
    loops = Twins(_Pair(len, abs), _Pair(min, max))
    assert loops.default() is loops.compiled
    monkeypatch.setattr(twins, "PREFER_COMPILED", False)
    assert loops.default() is loops.reference
