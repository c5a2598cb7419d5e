"""Command-line flags for configuration slots, derived from :class:`~kvkit.config.StackConfig`.

A slot's flag is its name with dashes (``cpu_eviction`` -> ``--cpu-eviction``),
parses to the type its :data:`~kvkit.config.TEXT` metadata names, and is
described by the first sentence of the slot's entry in ``StackConfig``'s
docstring. A flag left out passes nothing, so the config's own default
applies (shown in the help); the config validates what is given, and
:func:`flag_errors` names the flags in its messages.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import attrs
import click

from kvkit.config import TEXT, StackConfig
from kvkit.errors import ConfigError

__all__ = ["flag", "flag_errors", "slot_help", "slot_options"]

F = TypeVar("F", bound=Callable[..., Any])

_ENTRY = re.compile(r"^    (\w+): (.*)$")
_MARKUP = re.compile(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`|``([^`]+)``|\*([^*]+)\*")


def flag(slot: str) -> str:
    """The command-line flag of ``slot``."""
    return "--" + slot.replace("_", "-")


def slot_help(slot: str) -> str:
    """The first sentence of ``slot``'s entry in ``StackConfig``'s docstring, without reST markup."""
    entries: dict[str, str] = {}
    name = None
    section = (inspect.getdoc(StackConfig) or "").partition("Attributes:\n")[2].partition("\n\n")[0]
    for line in section.splitlines():
        match = _ENTRY.match(line)
        if match:
            name = match[1]
            entries[name] = match[2]
        elif name is not None:
            entries[name] += " " + line.strip()
    text = _MARKUP.sub(lambda m: next(g for g in m.groups() if g), entries[slot])
    sentence = text.split(". ")[0].rstrip(".")
    return sentence[:1].upper() + sentence[1:] + "."


def slot_options(slots: Iterable[str], defaults: Mapping[str, Any]) -> Callable[[F], F]:
    """One flag per slot of ``slots`` that has a text form; ``defaults`` are shown in the help.

    The command receives each as a keyword named after the slot, ``None`` when left out.
    """
    fields = attrs.fields_dict(StackConfig)
    options = []
    for slot in slots:
        kind = fields[slot].metadata.get(TEXT)
        if kind is None:
            continue
        default = defaults.get(slot)
        shown = "" if default is None else f"  [default: {default}]"
        options.append(click.option(flag(slot), slot, type=kind, default=None, help=slot_help(slot) + shown))

    def decorate(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


@contextlib.contextmanager
def flag_errors(slots: Collection[str]) -> Iterator[None]:
    """Re-raise a ``ConfigError`` raised inside with each of ``slots`` spelled as its flag (``--gpu-blocks=0``)."""
    names = re.compile(r"\b(" + "|".join(map(re.escape, slots)) + r")\b") if slots else None
    try:
        yield
    except ConfigError as exc:
        if names is None:
            raise
        raise ConfigError([names.sub(lambda m: flag(m[1]), p) for p in exc.problems]) from exc
