"""A malformed ``put``/``get`` is refused, typed, before any ticket is issued or any value changes, in every
built-in store: the buffers are checked with the keys, not while the call is carried out."""

from __future__ import annotations

import pytest

from kvkit.backends.blockstore.disk import DiskStore
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.backends.blockstore.valkey import ValkeyStore
from kvkit.errors import ConfigError


@pytest.fixture(params=["memory", "disk", "valkey"])
def store(request, tmp_path):
    if request.param == "memory":
        made = MemoryStore()
    elif request.param == "disk":
        made = DiskStore(tmp_path, 1 << 20)
    else:
        server = request.getfixturevalue("valkey_server")
        server.call(b"FLUSHALL")
        made = ValkeyStore([("127.0.0.1", server.port)], request_timeout_s=5.0)
    yield made
    made.close()


def _open_tickets(store) -> int:
    """Tickets the store issued and has not finished."""
    return store._tickets.outstanding


def _strided() -> memoryview:
    return memoryview(bytearray(8))[::2]


@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize(("bad", "match"), [
    ([_strided()], "contiguous"),
    ([5], r"\[5\]"),
    (5, "got 5 "),
    (["text"], r"\['text'\]"),
], ids=["not contiguous", "not a buffer", "not a list", "a str"])
def test_bad_buffers_after_a_good_key_are_refused_before_any_ticket(store, op, bad, match):
    """The second key's buffers are bad: ``ConfigError`` quoting them, no ticket left open, the first key's
    value not written; the store serves the next call."""
    first = [memoryview(bytearray(b"v" * 4))]
    with pytest.raises(ConfigError, match=match):
        getattr(store, op)([b"first", b"second"], [first, bad])
    assert _open_tickets(store) == 0
    assert store.contains([b"first"]) == 0
    (result,) = store.poll([store.put([b"first"], [first])], 5.0)
    assert result.ok, result
    assert _open_tickets(store) == 0
    store.check_invariants()
