"""The rules of ``kvkit.driving.DriveLock``, on the lock alone."""

import signal
import threading

import pytest

from kvkit.driving import DriveLock, driven
from kvkit.errors import RequestStateError
from kvkit.testing.forked import in_child


class _Part:
    """A part whose calls hold its drive lock."""

    def __init__(self) -> None:
        self.drive_lock = DriveLock()
        self.calls = 0

    @driven
    def call(self) -> int:
        self.calls += 1
        return self.calls


def _held_on_a_thread(drive: DriveLock, body=None):
    """Start a thread that holds ``drive`` until the returned event is set, running ``body`` (if any) inside its
    hold once the event is set; answer (the thread, the event, what body raised or returned)."""
    holding, release, outcome = threading.Event(), threading.Event(), []

    def hold():
        with drive:
            holding.set()
            release.wait(10)
            if body is not None:
                try:
                    outcome.append(body())
                except RequestStateError as exc:
                    outcome.append(exc)

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(10)
    return thread, release, outcome


def test_holds_nest_on_their_thread_and_exclude_other_threads():
    part = _Part()
    with part.drive_lock:
        assert part.call() == 1  # nested: enters at once
        entered = threading.Event()
        other = threading.Thread(target=lambda: (part.call(), entered.set()))
        other.start()
        assert not entered.wait(0.1)  # another thread's hold waits
    other.join(10)
    assert entered.is_set() and part.calls == 2


def test_shut_refuses_every_later_outermost_hold_on_any_thread():
    part = _Part()
    assert part.drive_lock.shut(1.0)
    part.drive_lock.release()
    with pytest.raises(RequestStateError, match="the stack is closed"):
        part.call()
    refused = []

    def other() -> None:
        try:
            part.call()
        except RequestStateError as exc:
            refused.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(10)
    with pytest.raises(RequestStateError):
        part.drive_lock.__enter__()
    assert part.calls == 0 and len(refused) == 1


def test_shut_waits_for_another_threads_step_whose_nested_holds_still_enter():
    part = _Part()
    thread, release, outcome = _held_on_a_thread(part.drive_lock, part.call)
    assert not part.drive_lock.shut(0.05)  # the step still runs: shut gives up, holding nothing
    release.set()  # the step goes on after shut() was called: its nested call enters
    thread.join(10)
    assert outcome == [1]
    assert part.drive_lock.shut(1.0)
    part.drive_lock.release()
    with pytest.raises(RequestStateError):
        part.call()


def test_inside_its_own_hold_the_closer_refuses_what_follows_but_not_shuts_own_calls():
    part = _Part()
    with part.drive_lock:
        assert part.drive_lock.shut(0.0)  # nested in this thread's own hold: at once
        assert part.call() == 1  # inside shut's hold (close's own calls) enters
        part.drive_lock.release()
        with pytest.raises(RequestStateError):
            part.call()  # the rest of the step that closed it


def test_a_child_forked_while_another_thread_held_the_lock_can_hold_it():
    part = _Part()
    thread, release, _ = _held_on_a_thread(part.drive_lock)

    def call() -> int:  # killed by the alarm if the hold blocks
        signal.alarm(10)
        return part.call()

    try:
        assert in_child(call)() == 1
    finally:
        release.set()
        thread.join(10)


def test_the_forking_threads_own_hold_carries_on_in_the_child():
    part = _Part()

    def nested_then_released() -> bool:
        part.call()
        part.drive_lock.lock.release()  # the hold taken before the fork ends here
        return part.drive_lock.lock.acquire(blocking=False)

    with part.drive_lock:
        assert in_child(nested_then_released)() is True
