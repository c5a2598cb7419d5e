"""Results belong to the caller that submitted them: a poll reports only the tickets it names, and at most
``max_waiting`` finished results wait (one more abandons the oldest), in every built-in store."""

from __future__ import annotations

import threading
import time

import pytest

from kvkit.backends.blockstore._common import TicketBox
from kvkit.backends.blockstore.disk import DiskStore
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.backends.blockstore.valkey import ValkeyStore
from kvkit.errors import ConfigError


@pytest.fixture(params=["memory", "disk", "valkey"])
def make_store(request, tmp_path):
    """A factory of stores that finish their work in submission order (one I/O thread), to reason about waiting."""
    stores = []

    def make(**kwargs):
        if request.param == "memory":
            store = MemoryStore(**kwargs)
        elif request.param == "disk":
            store = DiskStore(tmp_path / f"kv{len(stores)}", 1 << 20, threads=1, **kwargs)
        else:
            server = request.getfixturevalue("valkey_server")
            server.call(b"FLUSHALL")
            store = ValkeyStore([("127.0.0.1", server.port)], request_timeout_s=5.0, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def _put(store, i: int) -> int:
    return store.put([b"kvkit:waiting:%d" % i], [[memoryview(b"v" * (i + 1))]])


def _check_the_oldest_are_abandoned(store) -> None:
    """With max_waiting=2, five results nobody polls leave only the newest two waiting."""
    tickets = [_put(store, i) for i in range(5)]
    (last,) = store.poll([tickets[-1]], 5.0)  # work finishes in order: every earlier ticket finished first
    assert last.ok and last.ticket == tickets[-1]
    assert [r.ticket for r in store.poll(tickets)] == [tickets[3]], "the oldest three were not abandoned"
    store.check_invariants()


def test_results_nobody_collects_are_bounded_the_oldest_abandoned(make_store):
    """At most max_waiting results wait; each one more abandons the one that waited longest (never reported)."""
    _check_the_oldest_are_abandoned(make_store(max_waiting=2))


def test_a_caller_that_polls_as_it_submits_never_loses_a_result(make_store):
    """Another caller abandons every ticket; the one that polls its own still gets each of them, once."""
    store = make_store(max_waiting=2)
    for i in range(8):
        _put(store, 100 + i)  # abandoned by its caller
        mine = _put(store, i)
        got = store.poll([mine], 5.0)
        assert [r.ticket for r in got] == [mine] and got[0].ok
        assert store.poll([mine]) == []  # reported once
    store.check_invariants()


def test_a_poll_reports_only_the_tickets_it_names(make_store):
    """Two callers of one store: each poll reports its own tickets; the other's wait for it."""
    store = make_store()
    a, b = _put(store, 1), _put(store, 2)
    assert [r.ticket for r in store.poll([a], 5.0)] == [a]
    assert store.poll([a, 10**9]) == []  # already reported; never issued
    assert [r.ticket for r in store.poll([b], 5.0)] == [b]
    store.check_invariants()


class _KeepsEveryResult(MemoryStore):
    """A store whose results never leave unless named: abandoned ones pile up."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._tickets = _Unbounded(self.max_waiting)


class _Unbounded(TicketBox):
    def _keep(self, result):
        self._done[result.ticket] = result


def test_the_bound_check_catches_a_store_where_abandoned_results_pile_up():
    """The check above can fail: a store keeping every result is caught."""
    with pytest.raises(AssertionError):
        _check_the_oldest_are_abandoned(_KeepsEveryResult(max_waiting=2))


def test_a_poll_waits_only_for_the_tickets_it_names():
    """Another caller's result does not end a wait; a poll naming nothing open returns at once."""
    box = TicketBox()
    mine, other = box.issue(1), box.issue(1)
    box.report(other)
    start = time.monotonic()
    assert box.poll([mine], 0.2) == []
    assert time.monotonic() - start >= 0.19
    start = time.monotonic()
    assert box.poll([other + 1, -5], 5.0) == []  # nothing named is open: no wait
    assert time.monotonic() - start < 1.0
    threading.Timer(0.05, box.report, (mine, [0], "boom")).start()
    (res,) = box.poll([mine], 5.0)
    assert res.ticket == mine and res.failed == (0,) and res.error == "boom"
    assert [r.ticket for r in box.poll({other})] == [other]
    assert box.waiting == box.outstanding == box.abandoned == 0


def test_fail_open_finishes_every_open_ticket_for_its_owner():
    """close fails open tickets; each waits for the poll naming it."""
    box = TicketBox()
    tickets = [box.issue(n) for n in (1, 2)]
    box.fail_open("closed")
    box.report(tickets[0])  # finished already: dropped
    assert [(r.ticket, r.failed) for r in box.poll(tickets[1:])] == [(tickets[1], (0, 1))]
    assert [(r.ticket, r.error) for r in box.poll(tickets)] == [(tickets[0], "closed")]


@pytest.mark.parametrize("tickets", [7, "12", None, [1, "2"], [1.0]])
def test_a_poll_of_something_not_a_collection_of_tickets_is_refused(tickets):
    """poll(7) is a ConfigError quoting it, not a TypeError."""
    with pytest.raises(ConfigError, match="tickets must be a collection of ints") as info:
        MemoryStore().poll(tickets)
    assert repr(tickets) in str(info.value)


@pytest.mark.parametrize(("cls", "args"), [(MemoryStore, ()), (DiskStore, ("/tmp/kvkit-never", 1))])
def test_max_waiting_must_be_positive(cls, args):
    """max_waiting is validated like every store setting."""
    with pytest.raises(ConfigError, match="max_waiting"):
        cls(*args, max_waiting=0)
