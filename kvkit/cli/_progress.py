"""Progress of long ``kvkit`` commands: one look for all of them, on stderr, never on stdout.

On a terminal a bar shows what runs, ``N of M`` steps, the time elapsed and an
estimate of the time left, whatever goes to stdout (tables or ``--json``); it
leaves no trace once the command ends (transient), except the lines given to
:meth:`Progress.note`. A finished line's time stops: it shows how long that
work took. No name or number is ever cut: a terminal too narrow for the bar's
columns gets each line as words that wrap, without the bar.

Off a terminal (a pipe, a file, a test runner) progress is silent, unless the
command asks for a log (``progress(log=True)``, for runs that take minutes):
then :meth:`Progress.log` and :meth:`Progress.note` lines go to stderr as
plain text, one per step.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

import attrs
import rich.progress
from rich.console import Console, RenderableType
from rich.table import Column
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
        return Text(f"{done} {note}".rstrip(), style="progress.download")


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


class _Times(rich.progress.ProgressColumn):
    """``0:00:12 elapsed, ~0:00:30 left`` (the estimate from the recent rate, once there is one).

    A finished task shows the time it took, frozen when it finished.
    """

    @override
    def render(self, task: rich.progress.Task) -> Text:
        if task.finished:
            return Text(f"{_clock(task.finished_time or 0)} elapsed", style="progress.elapsed")
        left = task.time_remaining
        estimate = "" if left is None else f", ~{_clock(left)} left"
        return Text(f"{_clock(task.elapsed or 0)} elapsed{estimate}", style="progress.elapsed")


class _Bar(rich.progress.Progress):
    """Columns on one line when their words fit whole beside a bar; otherwise each task as wrapping words."""

    _MIN_BAR = 10  # narrower than this, the bar is dropped rather than a name or a number cut
    _GAPS = 5  # the spinner and the spaces between the five columns

    def _words(self, task: rich.progress.Task) -> list[Text]:
        return [Text(task.description), *(c.render(task) for c in self.columns if isinstance(c, _Steps | _Times))]

    @override
    def get_renderables(self) -> Iterable[RenderableType]:
        tasks = [t for t in self.tasks if t.visible]
        words = [self._words(t) for t in tasks]
        need = sum(max(w[i].cell_len for w in words) for i in range(3)) + self._GAPS + self._MIN_BAR if words else 0
        if not words or need <= self.console.width:
            yield self.make_tasks_table(self.tasks)
            return
        for line in words:
            yield Text(" ").join(line)


@attrs.define
class Progress:
    """The bar of one command; every method is a no-op when nothing is shown."""

    bar: rich.progress.Progress
    shown: bool
    logs: bool = False

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
        self.bar.update(task, total=done)  # finished: the spinner and the clock stop, the bar is full

    def note(self, message: str) -> None:
        """A line that stays: above the bar on a terminal, a line of the log off one."""
        if self.shown:
            self.bar.console.print(message, highlight=False)
        elif self.logs:
            self.bar.console.print(message, highlight=False, soft_wrap=True)

    def log(self, message: str) -> None:
        """A line of the log off a terminal (on one, the bar already says it)."""
        if self.logs and not self.shown:
            self.bar.console.print(message, highlight=False, soft_wrap=True)


def _bar(console: Console, *, shown: bool) -> _Bar:
    """The bar's columns on ``console``, drawn only if ``shown``."""
    whole = Column(no_wrap=True)  # names and numbers: a line that cannot hold them falls back to words
    columns = (rich.progress.SpinnerColumn(), rich.progress.TextColumn("{task.description}", table_column=whole),
               rich.progress.BarColumn(), _Steps(table_column=whole), _Times(table_column=whole))
    return _Bar(*columns, console=console, transient=True, disable=not shown)


@contextlib.contextmanager
def progress(*, log: bool = False) -> Iterator[Progress]:
    """The command's :class:`Progress` on stderr: a bar on a terminal; off one, the log if ``log``, else nothing."""
    console = Console(stderr=True)
    shown = sys.stderr.isatty() and console.is_terminal
    with _bar(console, shown=shown) as bar:
        yield Progress(bar, shown, log)
