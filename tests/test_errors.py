"""Typed errors: each is a KVKitError and the built-in a caller would catch."""

import pytest

from kvkit import errors
from kvkit.errors import (
    BackendUnavailableError,
    ConfigError,
    KVKitError,
    OutOfBlocksError,
    PlanError,
    RefcountError,
    RequestStateError,
    SpecMismatchError,
    TraceFormatError,
    UnknownBlockError,
    UnknownRequestError,
)

MATCHING_BUILTIN = {
    OutOfBlocksError: MemoryError,
    RefcountError: ValueError,
    UnknownBlockError: IndexError,
    UnknownRequestError: KeyError,
    RequestStateError: RuntimeError,
    ConfigError: ValueError,
    SpecMismatchError: ValueError,
    PlanError: ValueError,
    BackendUnavailableError: RuntimeError,
    TraceFormatError: ValueError,
}

ALL_ERRORS = [getattr(errors, name) for name in errors.__all__ if name != "KVKitError"]


@pytest.mark.parametrize(("error", "builtin"), MATCHING_BUILTIN.items(), ids=lambda e: e.__name__)
def test_error_subclasses_kvkit_and_its_builtin(error, builtin):
    """Each error subclasses KVKitError and its matching built-in exception."""
    assert issubclass(error, KVKitError) and issubclass(error, builtin)


@pytest.mark.parametrize("error", ALL_ERRORS, ids=lambda e: e.__name__)
def test_every_exported_error_has_a_builtin_base(error):
    """Every exported error, including ones added later, is a KVKitError and a specific built-in."""
    builtins = [b for b in error.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
    assert issubclass(error, KVKitError) and builtins, error.__mro__


def test_config_error_formats_one_or_many_problems():
    """One problem is the message; several are counted and listed; both are caught as ValueError."""
    assert str(ConfigError("x=1: bad")) == "x=1: bad"
    many = ConfigError(["a=1: bad", "b=2: worse"])
    assert many.problems == ["a=1: bad", "b=2: worse"]
    assert str(many) == "2 configuration problems:\n  - a=1: bad\n  - b=2: worse"
    with pytest.raises(ValueError, match="2 configuration problems"):
        raise many


def test_unknown_request_error_message_is_not_repr_quoted():
    """UnknownRequestError prints its message, not KeyError's repr of it."""
    assert str(UnknownRequestError("request 'r1' is unknown")) == "request 'r1' is unknown"
    assert str(UnknownRequestError()) == ""


def test_trace_format_error_names_file_line_and_field():
    """TraceFormatError keeps and prints path, line and field."""
    exc = TraceFormatError("t.jsonl", 7, "hash_ids", "expected a list, got 3")
    assert (exc.path, exc.line, exc.field) == ("t.jsonl", 7, "hash_ids")
    assert str(exc) == "t.jsonl:7: field 'hash_ids': expected a list, got 3"
