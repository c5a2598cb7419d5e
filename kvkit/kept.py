"""Secrets read from where they are kept: an environment variable or a file, never a config or a command line.

A deployment keeps passwords and HMAC secrets out of what is logged or on a command line (vLLM's
``kv_connector_extra_config``, a store URL in a CLI's arguments) by naming where each process
reads them: ``*_env`` (an environment variable's name) or ``*_file`` (a path). Rules:

* an ``env`` source is an environment variable's name (letters, digits and ``_``, not starting with a
  digit), set and non-empty in this process; the secret is its bytes as they are;
* a ``file`` source is a path (a string or path-like) to a readable regular file of at most
  :data:`FILE_MAX` bytes; the secret is its bytes with one trailing newline (``\\n`` or ``\\r\\n``)
  dropped, and must not be empty;
* the secret is a :class:`~kvkit.redact.SecretBytes` from its read on (its repr is ``'***'``, in a
  traceback's frame locals too);
* messages name the variable or the file, never what it holds; a source that is no string, or an
  ``env`` source that is no variable's name (the secret written there by mistake), is not shown
  (its type is); nor is a ``file`` source that names nothing there and is a relative path not
  starting with ``./`` or ``../`` (the secret written there by mistake, ``password_file=hunter2``):
  a path that exists, or an absolute or explicitly relative one, is shown;
* a file that keeps a secret (this module's, or a TLS private key) and that its group or others may read
  is read all the same, with one ``UserWarning`` naming it (:func:`warn_exposed`), as ssh and libpq
  refuse such files.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Literal

from kvkit.errors import ConfigError
from kvkit.redact import SecretBytes
from kvkit.warn import warn

__all__ = ["FILE_MAX", "read_kept", "warn_exposed"]

FILE_MAX = 1 << 16
"""The most bytes a file that keeps a secret may hold (a password or an HMAC secret is tens of bytes)."""

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
        return SecretBytes(os.fsencode(text))  # the variable's bytes as they are, UTF-8 or not
    problem: str | None = None  # an OSError names the path, the secret perhaps: raised below without it as context
    try:
        kept, mode = _small_file(source)
    except OSError as exc:
        problem = f"cannot be read: {exc.strerror or type(exc).__name__}"
    except ValueError as exc:
        problem = str(exc)
    if problem is not None:
        raise ConfigError(f"{_file_named(label, source)}: {problem}")
    data = SecretBytes(kept.removesuffix(b"\n").removesuffix(b"\r"))
    if not data:
        raise ConfigError(f"{label}={source!r}: the file is empty")
    warn_exposed(label, source, mode)
    return data


def _file_named(label: str, path: str) -> str:
    """``label`` with the file ``path`` that cannot be read: shown if it is a path (see the module's rule)."""
    if os.path.isabs(path) or path.startswith(("./", "../")) or os.path.lexists(path):
        return f"{label}={path!r}"
    return (f"{label} (a relative path naming no file; not shown: it may be the secret itself, which is never "
            f"taken from a config; give the file's absolute path)")


def warn_exposed(label: str, path: str, mode: int) -> None:
    """Warn once per read (a ``UserWarning`` naming ``label`` and ``path``, never what the file holds) when the
    file at ``path``, whose ``st_mode`` is ``mode``, keeps a secret that its group or others may read."""
    readers = [who for who, bit in (("its group", stat.S_IRGRP), ("others", stat.S_IROTH)) if mode & bit]
    if readers:
        warn(f"{label}={path!r}: the file keeps a secret but {' and '.join(readers)} may read it (mode "
             f"{stat.S_IMODE(mode):04o}); let only its owner read it (chmod 600 {path!r}): ssh and libpq refuse "
             f"such files", UserWarning)


def _small_file(path: str) -> tuple[bytes, int]:
    """The bytes of the regular file at ``path`` (a symlink to one included) of at most :data:`FILE_MAX` bytes,
    and its ``st_mode``; ``ValueError`` saying what else it is, ``OSError`` when it cannot be read.

    Every process of a deployment reads it, so a FIFO (opening it waits for a writer, and its bytes go to one
    reader) or a device (``/dev/zero`` never ends) is refused without waiting or reading; so is a file larger
    than any secret (the wrong path).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # opening a FIFO never waits
    try:  # closed on every path: fdopen itself refuses a directory, leaving the descriptor open
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError("not a regular file (each process reads it whole: a FIFO or a device would wait or "
                             "never end)")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = SecretBytes(file.read(FILE_MAX + 1))
    finally:
        os.close(fd)
    if len(data) > FILE_MAX:
        raise ValueError(f"holds more than {FILE_MAX} bytes, far more than a secret (the wrong file?)")
    return data, mode
