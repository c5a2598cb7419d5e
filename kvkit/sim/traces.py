"""Request traces in the Mooncake JSONL format: a streaming reader and a writer.

One JSON object a line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

* ``timestamp``: arrival time in milliseconds from the trace start (an int or
  a finite float, ``>= 0``). Timestamps never *decrease*; equal timestamps are
  allowed because real traces have many (several requests arrive at ``t=0``).
* ``input_length`` / ``output_length``: prompt and generated tokens (ints ``>= 0``).
* ``hash_ids``: the prompt's blocks of ``block_size`` tokens as ints ``>= 0``,
  prefix-chained (equal ids at equal positions mean equal prefixes); the last,
  possibly partial, block has an id too, so there are exactly
  ``ceil(input_length / block_size)`` of them, all different (a request
  repeating an id is refused: a block cannot be its own prefix).

Extra fields are allowed and ignored (not kept). Blank lines are skipped; line
numbers count every physical line, so errors point at the right line. Every
int is below ``2**63`` (block ids and counts travel as int64). A file whose
name ends in ``.gz`` is read through gzip.

Built-in traces (:data:`BUILTIN_TRACES`) ship as package data and are read by
name wherever a path is taken: ``read_trace("mooncake-conversation")`` (a file
of that name is read as ``./mooncake-conversation``).

Reading is bounded: a line longer than :data:`MAX_LINE_BYTES` is an error as
soon as that many bytes were read (``/dev/zero`` or a binary file cannot
exhaust memory), a line whose arrays and objects nest deeper than
:data:`MAX_NESTING` is an error before it is parsed (the parser recurses per
level), and so is a file with no request at all. Each is one
:class:`~kvkit.errors.TraceFormatError` naming the file and line; a file that
cannot be opened or read (missing, a directory, no permission) is one
:class:`~kvkit.errors.TraceFileError`.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs
import numpy as np

from kvkit.config import DEFAULTS
from kvkit.errors import ConfigError, TraceFileError, TraceFormatError
from kvkit.validate import check_int, did_you_mean, is_int, plural, quote

__all__ = ["BUILTIN_TRACES", "MAX_LINE_BYTES", "MAX_NESTING", "MOONCAKE_BLOCK_SIZE", "TraceRequest", "read_trace",
           "trace_path", "write_trace"]

BUILTIN_TRACES = {"mooncake-conversation": "mooncake_conversation.jsonl.gz"}
"""Built-in trace name -> its file in ``kvkit/sim/data`` (origin and licence: ``NOTICE.md`` there).

``mooncake-conversation``: the first 6,000 requests of the Mooncake (FAST '25)
conversation trace, Apache-2.0; 512-token blocks (:data:`MOONCAKE_BLOCK_SIZE`).
"""

_DATA = Path(__file__).resolve().with_name("data")

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per block of the published Mooncake traces (the default of :func:`read_trace`)."""

MAX_LINE_BYTES = 16 * 2**20
"""Longest trace line :func:`read_trace` accepts, in bytes (16 MiB, newline excluded).

A Mooncake line is a few KiB; 16 MiB holds the ids of a million-token prompt at
16-token blocks, and bounds what one line can make the reader buffer.
"""

MAX_NESTING = 32
"""Deepest nesting of JSON arrays and objects a trace line may have (a record nests 2 deep).

Checked before parsing, so a line of 100,000 brackets is one error on every
Python version, never a ``RecursionError`` (or a parse that depends on the stack).
"""

_INT_LIMIT = 2**63
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')  # brackets inside strings do not nest
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def _nesting(raw: bytes) -> int:
    """Deepest nesting of arrays and objects in one JSON line (vectorised: lines can be 16 MiB)."""
    chars = np.frombuffer(_JSON_STRING.sub(b'""', raw), np.uint8)
    steps = np.isin(chars, _OPEN).astype(np.int64) - np.isin(chars, _CLOSE)
    return int(np.cumsum(steps).max(initial=0))


@attrs.frozen(slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time in milliseconds from the trace start.
        input_length: prompt tokens.
        output_length: generated tokens.
        hash_ids: one prefix-chained id per prompt block (the last may be partial).
        line: 1-based line of the request in its file (or its position in a
            generated trace).
        block_size: tokens per block ``hash_ids`` were cut at (the reader's
            ``block_size``, a generator's); a simulation takes its block size from it.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int
    block_size: int = DEFAULTS.block_size


def _parse(path: str, line: int, text: str, block_size: int,
           previous_ms: float) -> TraceRequest:
    """Parse and validate one non-blank line."""
    try:
        record = json.loads(text)
    except ValueError as exc:  # the column only: JSON's own "line 1" would sit beside the file's line
        why = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise TraceFormatError(path, line, "<line>", f"not valid JSON ({why}): {text[:80]!r}") from None
    if not isinstance(record, dict):
        raise TraceFormatError(path, line, "<line>", f"expected a JSON object, got {text[:80]!r}")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in record:
            raise TraceFormatError(path, line, name, "missing")

    stamp = record["timestamp"]
    if type(stamp) not in (int, float) or not math.isfinite(stamp) or not 0 <= stamp < _INT_LIMIT:
        raise TraceFormatError(path, line, "timestamp",
                               f"expected a finite number >= 0 (ms), got {quote(stamp)}")
    if stamp < previous_ms:
        raise TraceFormatError(path, line, "timestamp",
                               f"decreases: {stamp!r} after {previous_ms!r}")
    input_length = record["input_length"]
    if not is_int(input_length, 0) or input_length >= _INT_LIMIT:  # is_int refuses a JSON `true`
        raise TraceFormatError(path, line, "input_length",
                               f"expected an int in [0, 2**63), got {quote(input_length)}")
    output_length = record["output_length"]
    if not is_int(output_length, 0) or output_length >= _INT_LIMIT:
        raise TraceFormatError(path, line, "output_length",
                               f"expected an int in [0, 2**63), got {quote(output_length)}")

    ids = record["hash_ids"]
    if type(ids) is not list:
        raise TraceFormatError(path, line, "hash_ids", f"expected a list of ints, got {quote(ids)}")
    if not all(type(x) is int for x in ids):
        bad = next(x for x in ids if type(x) is not int)
        raise TraceFormatError(path, line, "hash_ids", f"expected ints, got {quote(bad)}")
    if ids and min(ids) < 0:
        raise TraceFormatError(path, line, "hash_ids", f"expected ids >= 0, got {quote(min(ids))}")
    if ids and max(ids) >= _INT_LIMIT:
        raise TraceFormatError(path, line, "hash_ids", f"expected ids below 2**63, got {quote(max(ids))}")
    if len(set(ids)) != len(ids):  # a block cannot be its own prefix: the engine would map one block twice
        seen: set[int] = set()
        repeated = next(x for x in ids if x in seen or seen.add(x))  # type: ignore[func-returns-value]
        raise TraceFormatError(path, line, "hash_ids",
                               f"id {quote(repeated)} appears twice: every block of a prompt has its own id")
    expected = -(-input_length // block_size)
    if len(ids) != expected:
        raise TraceFormatError(
            path, line, "hash_ids",
            f"has {plural(len(ids), 'id')} but input_length={input_length} needs "
            f"{plural(expected, 'block')} of {plural(block_size, 'token')}",
        )
    return TraceRequest(stamp, input_length, output_length, tuple(ids), line, block_size)


def read_trace(path: str | os.PathLike[str], *, block_size: int = MOONCAKE_BLOCK_SIZE,
               limit: int | None = None) -> Iterator[TraceRequest]:
    """Stream the requests of a Mooncake JSONL trace, one line at a time.

    The file is read lazily: a malformed line raises only when the iteration
    reaches it, after every request before it was yielded.

    Args:
        path: the JSONL file (gzip-compressed if its name ends in ``.gz``), or
            the name of a built-in trace (:data:`BUILTIN_TRACES`).
        block_size: tokens per block the trace's ``hash_ids`` were cut at.
        limit: stop after this many requests (``None``: read to the end).

    Raises:
        ConfigError: ``path``, ``block_size`` or ``limit`` is invalid (at the call).
        TraceFormatError: a line is malformed, longer than :data:`MAX_LINE_BYTES`
            or nested deeper than :data:`MAX_NESTING`, or the file holds no
            request; names the file and line (and the field).
        TraceFileError: the file cannot be opened or read (an ``OSError``;
            raised on the first ``next``).
    """
    check_int("block_size", block_size, 1)
    if limit is not None:
        check_int("limit", limit, 0)
    # Validate arguments eagerly; only the file reading is lazy.
    return _stream(trace_path(path), block_size, limit)


def _path(path: object) -> str:
    """``path`` as a ``str``, or ``ConfigError`` (``open`` would raise a bare ``TypeError``/``ValueError``)."""
    try:
        name = os.fsdecode(path)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"path={quote(path)}: must be a str or an os.PathLike") from None
    if "\x00" in name:
        raise ConfigError(f"path={name!r}: contains a NUL character")
    return name


def trace_path(trace: str | os.PathLike[str]) -> str:
    """The file a trace argument names: a built-in trace's packaged file, else ``trace`` itself.

    Only a ``str`` that is exactly a built-in name names a built-in trace:
    ``./NAME``, any text with a separator and any ``os.PathLike`` (a
    ``Path`` drops a leading ``./``) are paths, read from the file system.

    Raises:
        ConfigError: ``trace`` is not a str or an os.PathLike, or holds a NUL.
    """
    name = _path(trace)
    builtin = BUILTIN_TRACES.get(name) if isinstance(trace, str) else None
    return str(_DATA / builtin) if builtin is not None else name


def _missing_hint(path: str) -> str:
    """What to say when ``path`` does not exist: the built-in names (a bare word may have meant one)."""
    names = list(BUILTIN_TRACES)
    return f"; built-in traces: {', '.join(names)}{did_you_mean(os.path.basename(path), names)}"


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw line)`` of every physical line, each read with the length cap."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:  # decoded per line, so a bad byte is reported at its line
            line = 0
            while raw := f.readline(MAX_LINE_BYTES + 1):  # never buffers more than the cap
                line += 1
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    raise TraceFormatError(path, line, "<line>",
                                           f"longer than MAX_LINE_BYTES ({MAX_LINE_BYTES} bytes): "
                                           f"not a JSONL trace? starts {raw[:16]!r}")
                yield line, raw
    except FileNotFoundError as exc:
        raise TraceFileError(path, f"cannot read the trace: {exc.strerror}{_missing_hint(path)}") from exc
    except (OSError, EOFError, zlib.error) as exc:  # gzip: a bad header is an OSError, bad data the others
        raise TraceFileError(path, f"cannot read the trace: {getattr(exc, 'strerror', None) or exc}") from exc


def _stream(path: str, block_size: int, limit: int | None) -> Iterator[TraceRequest]:
    if limit == 0:
        return
    count = line = 0
    previous_ms: float = 0
    for line, raw in _lines(path):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceFormatError(path, line, "<line>",
                                   f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        text = text.rstrip("\r\n")  # one physical line, so a parse error is at a column of it
        if not text.strip():
            continue
        # Counting brackets is cheap; only a line with many of them is scanned for its depth.
        if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and (depth := _nesting(raw)) > MAX_NESTING:
            raise TraceFormatError(path, line, "<line>", f"nested {depth} deep, more than MAX_NESTING "
                                   f"({MAX_NESTING}; a record nests 2 deep): {text[:40]!r}")
        request = _parse(path, line, text, block_size, previous_ms)
        previous_ms = request.timestamp_ms
        yield request
        count += 1
        if count == limit:
            return
    if count == 0:  # an empty trace would "replay" into a report of zeros
        what = plural(line, "blank line") if line else "no lines"
        raise TraceFormatError(path, line, "<file>", f"no requests: the file has {what}")


def write_trace(path: str | os.PathLike[str], requests: Iterable[TraceRequest]) -> int:
    """Write ``requests`` as a Mooncake JSONL trace; returns how many were written.

    The ``line`` and ``block_size`` of each request are not written (the
    format has no field for them): reading the file back numbers the requests
    by their line in it, and takes the block size :func:`read_trace` is given.

    Raises:
        ConfigError: ``path`` is invalid, or an item is not a :class:`TraceRequest`
            of JSON-serialisable fields (the requests before it are written).
        TraceFileError: the file cannot be opened or written (an ``OSError``).
    """
    name = _path(path)
    try:
        items = iter(requests)
    except TypeError:
        raise ConfigError(f"requests={quote(requests)}: must be an iterable of TraceRequest") from None
    count = 0
    try:
        with open(name, "w", encoding="utf-8") as f:  # opened only once the arguments passed
            for r in items:
                if not isinstance(r, TraceRequest):
                    raise ConfigError(f"requests[{count}]={quote(r)}: must be a TraceRequest")
                try:
                    text = json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                       "output_length": r.output_length, "hash_ids": list(r.hash_ids)})
                except (TypeError, ValueError):
                    raise ConfigError(f"requests[{count}]={quote(r)}: fields are not JSON numbers") from None
                f.write(text)
                f.write("\n")
                count += 1
    except OSError as exc:
        raise TraceFileError(name, f"cannot write the trace: {exc.strerror or exc}") from exc
    return count
