"""Checks of caller input, one place for every component (imports nothing of kvkit but errors).

Two shapes serve every caller:

* predicates and ``*_problem`` functions return ``None`` or a message, for code
  that collects every problem before raising once (``StackConfig``);
* ``check_*`` functions raise a typed :mod:`kvkit.errors` error that quotes the
  value, and :func:`at_least` / :func:`optional_at_least` / :func:`real_in`
  build ``attrs`` validators from them.

An "int" is an exact integer: ``bool`` is refused (``True`` is not block 1);
NumPy integers are integers (``numbers.Integral``) and are converted to ``int``
by the ``check_*`` functions that return a value.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from kvkit.errors import ConfigError

__all__ = [
    "at_least",
    "check_int",
    "check_real",
    "int_problem",
    "is_int",
    "optional_at_least",
    "real_in",
]

_Validator = Callable[[Any, Any, Any], None]


def is_int(value: object, minimum: int | None = None) -> bool:
    """``value`` is an integer (not a ``bool``), at least ``minimum`` when given."""
    if value.__class__ is not int:  # the common case first: the ABC check costs ~10x more
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            return False
    return minimum is None or value >= minimum


def int_problem(name: str, value: object, minimum: int | None = None) -> str | None:
    """``None`` if ``value`` is an int >= ``minimum``, else the message quoting it."""
    if is_int(value, minimum):
        return None
    bound = "" if minimum is None else f" >= {minimum}"
    return f"{name}={value!r}: must be an int{bound}"


def check_int(name: str, value: object, minimum: int | None = None, *,
              error: type[Exception] = ConfigError) -> int:
    """``value`` as an ``int``, or ``error`` quoting it when it is not an int >= ``minimum``."""
    if value.__class__ is int and (minimum is None or value >= minimum):
        return value  # the hot path: pools check every count
    problem = int_problem(name, value, minimum)
    if problem is not None:
        raise error(problem)
    return int(value)


def check_real(name: str, value: object, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False,
               error: type[Exception] = ConfigError) -> float:
    """``value`` as a ``float`` in the given range, or ``error`` quoting it (NaN is refused)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        where = f" in {lo or '(-inf'}, {hi or 'inf)'}" if (lo or hi) else ""
        raise error(f"{name}={value!r}: must be a number{where}")
    return float(value)


def at_least(minimum: int, *, label: str = "", error: type[Exception] = ConfigError) -> _Validator:
    """An ``attrs`` validator: the field is an int >= ``minimum``; ``label`` prefixes the name."""

    def validate(inst: object, attribute: Any, value: object) -> None:
        check_int(f"{label}{attribute.name}", value, minimum, error=error)

    return validate


def optional_at_least(minimum: int, *, label: str = "",
                      error: type[Exception] = ConfigError) -> _Validator:
    """Like :func:`at_least`, but ``None`` is allowed too."""

    def validate(inst: object, attribute: Any, value: object) -> None:
        if value is not None:
            check_int(f"{label}{attribute.name}", value, minimum, error=error)

    return validate


def real_in(*, low: float | None = None, high: float | None = None, low_open: bool = False,
            high_open: bool = False, label: str = "", error: type[Exception] = ConfigError) -> _Validator:
    """An ``attrs`` validator: the field is a number in the range, as :func:`check_real` checks it.

    ``high=math.inf, high_open=True`` also refuses infinity.
    """

    def validate(inst: object, attribute: Any, value: object) -> None:
        check_real(f"{label}{attribute.name}", value, low=low, high=high, low_open=low_open,
                   high_open=high_open, error=error)

    return validate
