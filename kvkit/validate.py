"""Checks of caller input, one place for every component (imports nothing of kvkit but errors and redact).

Two shapes serve every caller:

* predicates and ``*_problem`` functions return ``None`` or a message, for code
  that collects every problem before raising once (``StackConfig``);
  :func:`problem_of` turns any ``check_*`` call into such a message;
* ``check_*`` functions raise a typed :mod:`kvkit.errors` error that quotes the
  value (through :func:`quote`, which never fails and masks secrets, as
  :mod:`kvkit.redact` rules), and :func:`at_least` /
  :func:`optional_at_least` / :func:`real_in` / :func:`one_of` /
  :func:`non_empty_str` / :func:`implements` / :func:`is_callable` /
  :func:`secret_bytes` build ``attrs`` validators from them, :func:`checked` an
  ``attrs`` converter (which also stores the converted value);
* :func:`plural` counts things in a message: ``1 block``, ``2 blocks``, never ``1 blocks``.

:func:`known_keywords` makes a record's unknown keyword argument a
``ConfigError`` naming the valid ones, as a bad value is.

An "int" is an exact integer: ``bool`` is refused (``True`` is not block 1);
NumPy integers are integers (``numbers.Integral``) and are converted to ``int``
by the ``check_*`` functions that return a value. A "bool" is ``True`` or
``False`` (``"yes"`` and ``1`` are not), a "number" a real that is not a bool.
A secret (:func:`check_secret`) is never quoted: messages name its type only.
"""

from __future__ import annotations

import difflib
import enum
import functools
import numbers
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, TypeGuard, TypeVar, cast

import attrs
import numpy as np

from kvkit.errors import ConfigError
from kvkit.redact import redact, redact_text

__all__ = [
    "at_least",
    "check_bool",
    "check_choice",
    "check_enum",
    "check_int",
    "check_int_pair",
    "check_real",
    "check_secret",
    "check_str",
    "checked",
    "did_you_mean",
    "implements",
    "int_problem",
    "is_callable",
    "is_int",
    "known_keywords",
    "non_empty_str",
    "one_of",
    "optional_at_least",
    "plural",
    "problem_of",
    "quote",
    "real_in",
    "secret_bytes",
    "unknown_keywords",
    "unknown_problem",
]

_Validator = Callable[[Any, Any, Any], None]
_E = TypeVar("_E", bound=enum.Enum)
_C = TypeVar("_C", bound=type)
_QUOTE_CHARS = 200


def quote(value: object) -> str:
    """``repr(value)`` for a message, secrets masked (:mod:`kvkit.redact`), cut to 200 characters; never raises."""
    try:
        text = redact_text(repr(redact(value)))
    except Exception:  # noqa: BLE001 - a hostile __repr__, or an int past sys.get_int_max_str_digits()
        size = f" of {value.bit_length()} bits" if isinstance(value, int) else ""
        text = f"<{type(value).__name__}{size}>"
    return text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS - 3] + "..."


def did_you_mean(value: object, valid: Sequence[str]) -> str:
    """A ``"; did you mean 'x'?"`` suffix naming the closest valid name, or ``""`` (``value`` a str only)."""
    close = difflib.get_close_matches(value, list(valid), n=1) if isinstance(value, str) else []
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_problem(name: str, value: object, valid: Sequence[str]) -> str:
    """The message for ``value`` that names none of ``valid``: quoted, the valid names listed, the closest one."""
    return f"{name}={quote(value)}: unknown; valid: {', '.join(valid)}{did_you_mean(value, valid)}"


def unknown_keywords(given: Iterable[str], valid: Sequence[str], owner: str) -> list[str]:
    """One message per keyword of ``given`` that is not in ``valid`` (``owner`` names what takes them)."""
    return [f"{key}: unknown {owner} field; valid: {', '.join(valid)}{did_you_mean(key, valid)}"
            for key in given if key not in valid]


def problem_of(check: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """``None`` if ``check(*args, **kwargs)`` passes, else the message of the ``ConfigError`` it raised."""
    try:
        check(*args, **kwargs)
    except ConfigError as exc:
        return "; ".join(exc.problems)
    return None


def plural(n: int, noun: str, many: str | None = None, *, grouped: bool = False) -> str:
    """``n`` and ``noun`` for a message: the singular for exactly 1, else ``many`` (default ``noun + "s"``).

    ``grouped`` writes ``n`` with thousands separators (``"1,024 blocks"``).
    """
    number = f"{n:,}" if grouped else str(n)
    return f"{number} {noun if n == 1 else many or noun + 's'}"


def is_int(value: object, minimum: int | None = None) -> TypeGuard[int | numbers.Integral]:
    """``value`` is an integer (not a ``bool``), at least ``minimum`` when given."""
    # the common case first: the ABC check costs ~10x more
    if value.__class__ is not int and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
        return False
    return minimum is None or not value < minimum  # typeshed's Integral orders only by < and <=


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
    if is_int(value, minimum):
        return int(value)
    raise error(int_problem(name, value, minimum))


def check_real(name: str, value: object, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False,
               error: type[Exception] = ConfigError) -> float:
    """``value`` as a ``float`` in the given range, or ``error`` quoting it (NaN is refused)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value
    number = cast(float, value)  # read only when ``ok``: a Real (typeshed's Real does not order against floats)
    if ok and low is not None:
        ok = number > low if low_open else number >= low
    if ok and high is not None:
        ok = number < high if high_open else number <= high
    if ok:
        try:
            return float(number)
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


def check_str(name: str, value: object, *, error: type[Exception] = ConfigError) -> str:
    """``value`` if it is a non-empty ``str``, else ``error`` quoting it."""
    if isinstance(value, str) and value:
        return value
    raise error(f"{name}={quote(value)}: must be a non-empty str")


def check_choice(name: str, value: object, choices: Collection[str], *,
                 error: type[Exception] = ConfigError) -> str:
    """``value`` if it is one of ``choices`` (strings), else ``error`` listing them (and the closest one)."""
    if isinstance(value, str) and value in choices:
        return value
    raise error(unknown_problem(name, value, list(choices)))


def check_int_pair(name: str, value: object, minimum: int = 0, *,
                   error: type[Exception] = ConfigError) -> tuple[int, int]:
    """``value`` as ``(low, high)``: two ints with ``minimum <= low <= high``, or ``error`` quoting it."""
    if (isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(v) for v in value)
            and minimum <= value[0] <= value[1]):
        return int(value[0]), int(value[1])
    raise error(f"{name}={quote(value)}: must be (low, high), two ints with {minimum} <= low <= high")


def check_secret(name: str, value: object, *, error: type[Exception] = ConfigError) -> bytes:
    """``value`` if it is non-empty ``bytes``, else ``error`` naming its type only: a secret is never quoted."""
    if isinstance(value, bytes) and value:
        return value
    got = "empty bytes" if isinstance(value, bytes) else f"a {type(value).__name__}"
    raise error(f"{name}: must be non-empty bytes, got {got} (the value is not shown: it is a secret)")


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
    mypy's ``attrs`` plugin reads only named functions as converters, so a
    field using this one carries ``# type: ignore[misc]``.
    """

    def convert(value: object, field: attrs.Attribute) -> Any:
        if optional and value is None:
            return None
        return check(f"{label}{field.name}", value, **options)

    return attrs.Converter(convert, takes_field=True)


def implements(protocol: type, *, label: str = "", what: str | None = None, optional: bool = False) -> _Validator:
    """An ``attrs`` validator: the field is an instance of ``protocol`` (a class or runtime protocol).

    A class is refused even where it has the protocol's methods: the field
    holds an instance. Raises ``ConfigError`` quoting the value; ``what`` says
    what is expected (default: ``"a <protocol's name> instance"``), ``label``
    prefixes the field's name; ``optional`` lets ``None`` through.
    """

    def validate(inst: object, attribute: Any, value: object) -> None:
        if optional and value is None:
            return
        if isinstance(value, type) or not isinstance(value, protocol):
            raise ConfigError(f"{label}{attribute.name}={quote(value)}: must be "
                              f"{what or 'a ' + protocol.__name__ + ' instance'}")

    return validate


def is_callable(*, label: str = "", what: str = "callable") -> _Validator:
    """An ``attrs`` validator: the field is callable (``what`` says what is expected, e.g. "a policy class")."""

    def validate(inst: object, attribute: Any, value: object) -> None:
        if not callable(value):
            raise ConfigError(f"{label}{attribute.name}={quote(value)}: must be {what}")

    return validate


def one_of(choices: Collection[str], *, label: str = "", optional: bool = False) -> _Validator:
    """An ``attrs`` validator: the field is one of ``choices``, as :func:`check_choice` checks it."""

    def validate(inst: object, attribute: Any, value: object) -> None:
        if not (optional and value is None):
            check_choice(f"{label}{attribute.name}", value, choices)

    return validate


def non_empty_str(*, label: str = "", optional: bool = False) -> _Validator:
    """An ``attrs`` validator: the field is a non-empty ``str`` (or ``None`` if ``optional``)."""

    def validate(inst: object, attribute: Any, value: object) -> None:
        if not (optional and value is None):
            check_str(f"{label}{attribute.name}", value)

    return validate


def secret_bytes(*, label: str = "", optional: bool = False) -> _Validator:
    """An ``attrs`` validator: the field is a secret, as :func:`check_secret` checks it (never quoted)."""

    def validate(inst: object, attribute: Any, value: object) -> None:
        if not (optional and value is None):
            check_secret(f"{label}{attribute.name}", value)

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
            high_open: bool = False, label: str = "", optional: bool = False,
            error: type[Exception] = ConfigError) -> _Validator:
    """An ``attrs`` validator: the field is a number in the range, as :func:`check_real` checks it.

    ``high=math.inf, high_open=True`` also refuses infinity; ``optional`` lets ``None`` through.
    """

    def validate(inst: object, attribute: Any, value: object) -> None:
        if not (optional and value is None):
            check_real(f"{label}{attribute.name}", value, low=low, high=high, low_open=low_open,
                       high_open=high_open, error=error)

    return validate


def known_keywords(cls: _C) -> _C:
    """Class decorator (above ``attrs``'): an unknown keyword argument is a ``ConfigError``, not a ``TypeError``.

    The error names each unknown keyword with the valid ones and the closest
    one, and also lists what the known keywords' own checks refuse (a record
    that raises ``ConfigError`` listing every problem keeps doing so). The
    signature stays the record's own (``inspect.signature`` follows ``__wrapped__``).
    """
    init: Callable[..., None] = cls.__dict__["__init__"]
    valid = [a.alias for a in attrs.fields(cls) if a.init]
    known = frozenset(valid)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        if known.issuperset(kwargs):
            init(self, *args, **kwargs)
            return
        unknown = [key for key in kwargs if key not in known]
        problems = unknown_keywords(unknown, valid, cls.__name__)
        try:
            init(self, *args, **{key: value for key, value in kwargs.items() if key not in unknown})
        except ConfigError as exc:
            problems += exc.problems
        except TypeError:  # a required keyword is missing too: the unknown one was probably meant for it
            pass
        raise ConfigError(problems)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls
