"""``in_child(work)``: run a function in a child forked now, and collect what it answered.

For tests of what a process inherits through ``os.fork`` (a store, a stack): the child runs ``work()``,
writes what it returned as JSON (or ``"raised <type>: <message>"`` for anything it raised) to a pipe and
exits at once, without running the parent's exit handlers; the caller's thread goes on meanwhile.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

__all__ = ["in_child"]


def in_child(work: Callable[[], object]) -> Callable[[], object]:
    """Fork now and run ``work()`` in the child; answer a waiter for its outcome (which also reaps the child)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe and exits at once
        try:
            answer: object = work()
        except BaseException as exc:  # noqa: BLE001 - anything it raised is reported
            answer = f"raised {type(exc).__name__}: {exc}"
        os.write(write, json.dumps(answer).encode())
        os._exit(0)
    os.close(write)

    def outcome() -> object:
        with os.fdopen(read) as pipe:
            text = pipe.read()
        os.waitpid(child, 0)
        return json.loads(text)

    return outcome
