"""Secrets read from where they are kept: an environment variable or a file, never a config or a command line.

A deployment keeps passwords and HMAC secrets out of what is logged or on a command line (vLLM's
``kv_connector_extra_config``, a store URL in a CLI's arguments) by naming where each process
reads them: ``*_env`` (an environment variable's name) or ``*_file`` (a path). Rules:

* an ``env`` source is an environment variable's name (letters, digits and ``_``, not starting with a
  digit), set and non-empty in this process; the secret is its bytes as they are;
* a ``file`` source is a path (a string or path-like) to a readable file; the secret is its bytes
  with one trailing newline (``\\n`` or ``\\r\\n``) dropped, and must not be empty;
* messages name the variable or the file, never what it holds; a source that is no string, or an
  ``env`` source that is no variable's name (the secret written there by mistake), is not shown
  (its type is).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from kvkit.errors import ConfigError

__all__ = ["SOURCE_KINDS", "read_kept"]

SOURCE_KINDS = ("env", "file")
"""The places a secret may be kept, as the suffixes of the options that name them (``secret_env``)."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def read_kept(label: str, source: object, kind: Literal["env", "file"]) -> bytes:
    """The secret kept in the environment variable ``source`` names (``kind="env"``) or the file at its path.

    Raises:
        ConfigError: starting with ``label`` (the option, e.g. ``"password_env"``); it names the
            variable or the file (never what it holds) and says what is wrong: a source that is
            no non-empty string, no variable's name, unset, empty, or unreadable.
    """
    if kind == "file" and isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source:  # its type only: it may be the secret itself
        shown = "=''" if source == "" else f" (a {type(source).__name__})"
        raise ConfigError(f"{label}{shown}: must be a non-empty string (an environment variable's name or a "
                          f"file's path)")
    if kind == "env":
        if _ENV_NAME.fullmatch(source) is None:
            raise ConfigError(f"{label}: not an environment variable's name (letters, digits and '_'; not shown: "
                              f"it may be the secret itself, which is never taken from a config)")
        text = os.environ.get(source)
        if not text:
            raise ConfigError(f"{label}={source!r}: the environment variable {source} is "
                              f"{'empty' if text == '' else 'not set'} in this process")
        return os.fsencode(text)  # the variable's bytes as they are, UTF-8 or not
    try:
        data = Path(source).read_bytes().removesuffix(b"\n").removesuffix(b"\r")
    except OSError as exc:
        raise ConfigError(f"{label}={source!r}: cannot be read: {exc.strerror or type(exc).__name__}") from None
    if not data:
        raise ConfigError(f"{label}={source!r}: the file is empty")
    return data
