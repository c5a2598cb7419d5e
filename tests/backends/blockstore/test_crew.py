"""The Valkey link's crew of node threads: every task of a flight runs, and stop() ends every thread started,
even where threads cannot start (a pids limit)."""

from __future__ import annotations

import threading
import time

import pytest

from kvkit.backends.blockstore.link import _Crew


def _crew_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kvkit-valkey-node" and t.is_alive()}


@pytest.mark.parametrize("can_start", [0, 1, 2, 5])
def test_a_flight_runs_every_task_and_stop_ends_every_thread_however_many_can_start(can_start, monkeypatch):
    """With room for ``can_start`` threads of the 4 a 5-task flight asks for, every task still runs once, the
    caller's thread taking those the crew has no thread for; stop() then ends every thread that started."""
    before = _crew_threads()
    start = threading.Thread.start
    started = []

    def limited(thread):
        if thread.name == "kvkit-valkey-node" and len(started) >= can_start:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", limited)
    crew = _Crew()
    ran: list[int] = []
    lock = threading.Lock()

    def task(i):
        def run():
            with lock:
                ran.append(i)
        return run

    for flight in range(3):
        crew.run([task(10 * flight + i) for i in range(5)])
    assert sorted(ran) == [10 * flight + i for flight in range(3) for i in range(5)]
    assert len(started) == min(can_start, 4)
    crew.stop()
    deadline = time.monotonic() + 10
    while _crew_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _crew_threads() - before
