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
  ``ceil(input_length / block_size)`` of them.

Extra fields are allowed and ignored (not kept). Blank lines are skipped; line
numbers count every physical line, so errors point at the right line.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator

import attrs

from kvkit._renamed import renamed_keywords
from kvkit.errors import TraceFormatError
from kvkit.validate import check_int, is_int

__all__ = ["MOONCAKE_BLOCK_SIZE", "TraceRequest", "read_trace", "write_trace"]

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per block of the published Mooncake traces (the default of :func:`read_trace`)."""


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
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int


def _parse(path: str, line: int, text: str, block_size: int,
           previous_ms: float) -> TraceRequest:
    """Parse and validate one non-blank line."""
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise TraceFormatError(path, line, "<line>", f"not valid JSON ({exc}): {text[:80]!r}") from None
    if not isinstance(record, dict):
        raise TraceFormatError(path, line, "<line>", f"expected a JSON object, got {text[:80]!r}")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in record:
            raise TraceFormatError(path, line, name, "missing")

    stamp = record["timestamp"]
    if type(stamp) not in (int, float) or not math.isfinite(stamp) or stamp < 0:
        raise TraceFormatError(path, line, "timestamp",
                               f"expected a finite number >= 0 (ms), got {stamp!r}")
    if stamp < previous_ms:
        raise TraceFormatError(path, line, "timestamp",
                               f"decreases: {stamp!r} after {previous_ms!r}")
    input_length = record["input_length"]
    if not is_int(input_length, 0):  # refuses a JSON `true`, which Python reads as an int
        raise TraceFormatError(path, line, "input_length", f"expected an int >= 0, got {input_length!r}")
    output_length = record["output_length"]
    if not is_int(output_length, 0):
        raise TraceFormatError(path, line, "output_length",
                               f"expected an int >= 0, got {output_length!r}")

    ids = record["hash_ids"]
    if type(ids) is not list:
        raise TraceFormatError(path, line, "hash_ids", f"expected a list of ints, got {ids!r}")
    if not all(type(x) is int for x in ids):
        bad = next(x for x in ids if type(x) is not int)
        raise TraceFormatError(path, line, "hash_ids", f"expected ints, got {bad!r}")
    if ids and min(ids) < 0:
        raise TraceFormatError(path, line, "hash_ids", f"expected ids >= 0, got {min(ids)!r}")
    expected = -(-input_length // block_size)
    if len(ids) != expected:
        raise TraceFormatError(
            path, line, "hash_ids",
            f"has {len(ids)} ids but input_length={input_length} needs {expected} "
            f"blocks of {block_size} tokens",
        )
    return TraceRequest(stamp, input_length, output_length, tuple(ids), line)


@renamed_keywords(block_tokens="block_size")
def read_trace(path: str | os.PathLike[str], *, block_size: int = MOONCAKE_BLOCK_SIZE,
               limit: int | None = None) -> Iterator[TraceRequest]:
    """Stream the requests of a Mooncake JSONL trace, one line at a time.

    The file is read lazily: a malformed line raises only when the iteration
    reaches it, after every request before it was yielded.

    Args:
        path: the JSONL file.
        block_size: tokens per block the trace's ``hash_ids`` were cut at
            (``block_tokens=`` is its deprecated old name).
        limit: stop after this many requests (``None``: read to the end).

    Raises:
        ConfigError: ``block_size`` or ``limit`` is invalid (at the call).
        TraceFormatError: a line is malformed; names the file, line and field.
        OSError: the file cannot be opened (raised on the first ``next``).
    """
    check_int("block_size", block_size, 1)
    if limit is not None:
        check_int("limit", limit, 0)
    # Validate arguments eagerly; only the file reading is lazy.
    return _stream(os.fspath(path), block_size, limit)


def _stream(path: str, block_size: int, limit: int | None) -> Iterator[TraceRequest]:
    if limit == 0:
        return
    count = 0
    previous_ms: float = 0
    with open(path, "rb") as f:  # decoded per line, so a bad byte is reported at its line
        for line, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(path, line, "<line>",
                                       f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            if not text.strip():
                continue
            request = _parse(path, line, text, block_size, previous_ms)
            previous_ms = request.timestamp_ms
            yield request
            count += 1
            if count == limit:
                return


def write_trace(path: str | os.PathLike[str], requests: Iterable[TraceRequest]) -> int:
    """Write ``requests`` as a Mooncake JSONL trace; returns how many were written.

    The ``line`` of each request is not written: reading the file back numbers
    the requests by their line in it.
    """
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }))
            f.write("\n")
            count += 1
    return count
