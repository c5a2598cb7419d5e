"""``InFlight``: every handle reported once, in order, after its event and its host work."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.backends.copy._inflight import InFlight
from kvkit.errors import PlanError


class _Event:
    """A stand-in for ``torch.cuda.Event`` whose completion the test decides."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_inflight_reports_each_handle_once_in_order():
    """A later copy finishing first is held back until every earlier one finished."""
    events = [_Event(), _Event(), _Event()]
    inflight = InFlight()
    assert [inflight.issue(e) for e in events] == [0, 1, 2]
    events[1].done = True
    assert inflight.poll() == []
    events[0].done = True
    assert inflight.poll() == [0, 1]
    inflight.wait(2)
    assert inflight.poll() == [2] and inflight.poll() == []
    inflight.check_invariants()
    with pytest.raises(PlanError, match="unknown copy handle 3"):
        inflight.wait(3)


@given(st.lists(st.booleans(), min_size=1, max_size=8), st.data())
def test_then_runs_once_before_its_handle_and_order_holds(already_done, data):
    """Handles (some issued already finished) are reported in order, each after its ``then`` ran once."""
    inflight, ran, reported = InFlight(), [], []
    events = [None if done else _Event() for done in already_done]
    for i, event in enumerate(events):
        assert inflight.issue(event, then=lambda i=i: ran.append(i)) == i
    for i in data.draw(st.permutations(range(len(events)))):
        if events[i] is not None:
            events[i].done = True
        got = inflight.poll()
        assert all(h in ran for h in got), (got, ran)
        reported += got
        inflight.check_invariants()
    inflight.wait(len(events) - 1)
    reported += inflight.poll()
    assert reported == ran == list(range(len(events)))


def test_a_finished_handle_waits_behind_an_earlier_one():
    """An already-finished handle issued behind a pending one is not reported before it."""
    inflight, first = InFlight(), _Event()
    inflight.issue(first)
    inflight.issue(None)
    assert inflight.poll() == []
    first.done = True
    assert inflight.poll() == [0, 1]


class _Broken(_Event):
    """An event whose query and synchronize raise, as after a device error."""

    def query(self):
        raise RuntimeError("device lost")

    def synchronize(self):
        raise RuntimeError("device lost")


def test_an_event_that_raises_leaves_its_handle_pending():
    """poll and wait propagate an event's error and keep its handle (reported once the event answers)."""
    inflight, event = InFlight(), _Broken()
    inflight.issue(event)
    for call in (inflight.poll, lambda: inflight.wait(0)):
        with pytest.raises(RuntimeError, match="device lost"):
            call()
        assert len(inflight) == 1
    event.__class__ = _Event
    event.done = True
    assert inflight.poll() == [0]
    inflight.check_invariants()


def test_a_raising_then_still_reports_its_handle():
    """A ``then`` that raises propagates once; its handle (the host work ran) comes back from the next poll, once."""
    inflight, event = InFlight(), _Event()
    inflight.issue(event, then=lambda: 1 / 0)
    inflight.issue(None)
    event.done = True
    with pytest.raises(ZeroDivisionError):
        inflight.poll()
    assert inflight.poll() == [0, 1] and inflight.poll() == []
    inflight.check_invariants()


class _Clock:
    """A stand-in for a stream clock: its seconds, or an error when read."""

    def __init__(self, seconds):
        self.value = seconds

    def elapsed_time(self, end):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value * 1e3


def test_inflight_answers_a_timed_copys_own_seconds_after_the_poll_that_reports_it():
    """Seconds come with the poll that reports the handle, only until the next poll; untimed or unreadable: None."""
    from kvkit.backends.copy._inflight import StreamClock

    events = [_Event(), _Event(), _Event()]
    inflight = InFlight()
    clock = StreamClock()
    clock.start(_Clock(0.25))
    clock.stop(None)
    broken = StreamClock()
    broken.start(_Clock(RuntimeError("context lost")))
    broken.stop(None)
    handles = [inflight.issue(events[0], clock=clock), inflight.issue(events[1]),
               inflight.issue(events[2], clock=broken), inflight.issue(clock=1.5)]
    assert inflight.poll() == [] and inflight.seconds(handles[0]) is None
    for e in events:
        e.done = True
    assert inflight.poll() == handles
    assert [inflight.seconds(h) for h in handles] == [0.25, None, None, 1.5]
    assert inflight.poll() == [] and inflight.seconds(handles[0]) is None
