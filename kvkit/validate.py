"""Checks of caller input, one place for every component (imports nothing of kvkit but errors).

Two shapes serve every caller:

* predicates and ``*_problem`` functions return ``None`` or a message, for code
  that collects every problem before raising once (``StackConfig``);
* ``check_*`` functions raise a typed :mod:`kvkit.errors` error that quotes the
  value (through :func:`quote`, which never fails), and :func:`at_least` /
  :func:`optional_at_least` / :func:`real_in` build ``attrs`` validators from
  them, :func:`checked` an ``attrs`` converter (which also stores the converted value);
* :func:`plural` counts things in a message: ``1 block``, ``2 blocks``, never ``1 blocks``.

An "int" is an exact integer: ``bool`` is refused (``True`` is not block 1);
NumPy integers are integers (``numbers.Integral``) and are converted to ``int``
by the ``check_*`` functions that return a value.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import numpy as np

from kvkit.errors import ConfigError

__all__ = [
    "at_least",
    "check_bool",
    "check_enum",
    "check_int",
    "check_real",
    "checked",
    "int_problem",
    "is_int",
    "optional_at_least",
    "plural",
    "quote",
    "real_in",
]

_Validator = Callable[[Any, Any, Any], None]
_E = TypeVar("_E", bound=enum.Enum)
_QUOTE_CHARS = 200


def quote(value: object) -> str:
    """``repr(value)`` for a message, cut to 200 characters; never raises (a message must not fail)."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__, or an int past sys.get_int_max_str_digits()
        size = f" of {value.bit_length()} bits" if isinstance(value, int) else ""
        text = f"<{type(value).__name__}{size}>"
    return text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS - 3] + "..."


def plural(n: int, noun: str, many: str | None = None, *, grouped: bool = False) -> str:
    """``n`` and ``noun`` for a message: the singular for exactly 1, else ``many`` (default ``noun + "s"``).

    ``grouped`` writes ``n`` with thousands separators (``"1,024 blocks"``).
    """
    number = f"{n:,}" if grouped else str(n)
    return f"{number} {noun if n == 1 else many or noun + 's'}"


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
    return f"{name}={quote(value)}: must be an int{bound}"


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
    if ok:
        try:
            return float(value)
        except OverflowError:  # an int beyond any float, e.g. 10**400
            pass
    lo = "" if low is None else f"{'(' if low_open else '['}{low}"
    hi = "" if high is None else f"{high}{')' if high_open else ']'}"
    where = f" in {lo or '(-inf'}, {hi or 'inf)'}" if (lo or hi) else ""
    raise error(f"{name}={quote(value)}: must be a number{where}")


def check_bool(name: str, value: object, *, error: type[Exception] = ConfigError) -> bool:
    """``value`` as a ``bool`` (a NumPy bool too), or ``error`` quoting it: ``"False"`` and ``0`` are not bools."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise error(f"{name}={quote(value)}: must be a bool (True or False)")


def check_enum(name: str, value: object, cls: type[_E], *, error: type[Exception] = ConfigError) -> _E:
    """The member of ``cls`` that ``value`` is or names by value, or ``error`` listing the valid values."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):  # only strings name members: an unhashable value must not reach the lookup
        member = cls._value2member_map_.get(value)
        if member is not None:
            return member  # type: ignore[return-value]
    raise error(f"{name}={quote(value)}: must be one of {[m.value for m in cls]} (or a {cls.__name__})")


def checked(check: Callable[..., Any], *, label: str = "", optional: bool = False,
            **options: Any) -> attrs.Converter:
    """An ``attrs`` converter: the field becomes ``check(label + name, value, **options)``.

    ``check`` is a ``check_*`` function, so the field holds the converted value
    (a NumPy integer becomes an ``int``); ``optional`` lets ``None`` through.
    """

    def convert(value: object, field: attrs.Attribute) -> Any:
        if optional and value is None:
            return None
        return check(f"{label}{field.name}", value, **options)

    return attrs.Converter(convert, takes_field=True)


def implements(protocol: type, *, label: str = "", what: str | None = None) -> _Validator:
    """An ``attrs`` validator: the field is an instance of ``protocol`` (a class or runtime protocol).

    Raises ``ConfigError`` quoting the value; ``what`` says what is expected
    (default: ``"a <protocol's name>"``), ``label`` prefixes the field's name.
    """

    def validate(inst: object, attribute: Any, value: object) -> None:
        if not isinstance(value, protocol):
            raise ConfigError(f"{label}{attribute.name}={quote(value)}: must be {what or 'a ' + protocol.__name__}")

    return validate


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
