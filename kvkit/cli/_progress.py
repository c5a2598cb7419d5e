"""Progress of long ``kvkit`` commands: one look for all of them, on stderr, only on a terminal.

A bar shows what runs, ``N of M`` steps, the time elapsed and an estimate of
the time left. It is drawn whenever stderr is a terminal, whatever goes to
stdout (tables or ``--json``), and is silent otherwise (a pipe, a file, a
test runner): nothing of it ever reaches stdout, and it leaves no trace once
the command ends (transient), except the lines given to :meth:`Progress.note`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

import attrs
import rich.progress
from rich.console import Console
from rich.text import Text
from typing_extensions import override

__all__ = ["Progress", "progress"]

T = TypeVar("T")


class _Steps(rich.progress.ProgressColumn):
    """``1,200 of 1,518`` (``1,200`` while the total is unknown), then the task's ``note`` field."""

    @override
    def render(self, task: rich.progress.Task) -> Text:
        done = f"{int(task.completed):,}" + ("" if task.total is None else f" of {int(task.total):,}")
        note = task.fields.get("note", "")
        return Text(f"{done} {note}".rstrip(), style="progress.download", no_wrap=True, overflow="ellipsis")


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


class _Times(rich.progress.ProgressColumn):
    """``0:00:12 elapsed, ~0:00:30 left`` (the estimate from the recent rate, once there is one)."""

    @override
    def render(self, task: rich.progress.Task) -> Text:
        left = task.time_remaining
        estimate = "" if left is None or task.finished else f", ~{_clock(left)} left"
        return Text(f"{_clock(task.elapsed or 0)} elapsed{estimate}", style="progress.elapsed", no_wrap=True)


@attrs.define
class Progress:
    """The bar of one command; every method is a no-op when it is not shown."""

    bar: rich.progress.Progress
    shown: bool

    def task(self, description: str, total: int | None = None) -> rich.progress.TaskID:
        """A new line of the bar: ``total`` steps (``None``: unknown), none done."""
        return self.bar.add_task(description, total=total)

    def update(self, task: rich.progress.TaskID, **changes: object) -> None:
        """``rich.progress.Progress.update`` (``completed=``, ``advance=``, ``total=``, ``description=``, ``note=``)."""
        self.bar.update(task, **changes)  # type: ignore[arg-type]

    def track(self, items: Iterable[T], description: str) -> Iterator[T]:
        """Yield ``items``, counted on a line of their own (trace reading, for one), then mark it done."""
        task = self.task(description)
        done = 0
        for item in items:
            yield item
            done += 1
            self.bar.update(task, completed=done)
        self.bar.update(task, total=done)  # finished: the spinner stops, the bar is full

    def note(self, message: str) -> None:
        """A line above the bar that stays after it is gone (e.g. a result as it finishes)."""
        if self.shown:
            self.bar.console.print(message, highlight=False)


@contextlib.contextmanager
def progress() -> Iterator[Progress]:
    """The command's :class:`Progress` on stderr, shown only if stderr is a terminal."""
    console = Console(stderr=True)
    shown = sys.stderr.isatty() and console.is_terminal
    columns = (rich.progress.SpinnerColumn(), rich.progress.TextColumn("{task.description}"),
               rich.progress.BarColumn(), _Steps(), _Times())
    with rich.progress.Progress(*columns, console=console, transient=True, disable=not shown) as bar:
        yield Progress(bar, shown)
