"""Tests for the Mooncake JSONL trace reader and writer."""

import itertools
import json
import math
import os
import tempfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.errors import ConfigError, KVKitError, TraceFileError, TraceFormatError
from kvkit.sim.traces import (
    BUILTIN_TRACES,
    MAX_LINE_BYTES,
    MAX_NESTING,
    TraceRequest,
    read_trace,
    trace_path,
    write_trace,
)

SHARED_TRACE = (Path(__file__).resolve().parents[3]
                / "shared/traces/mooncake_conversation_part1.jsonl")

GOOD = [
    '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}',
    '{"timestamp": 10, "input_length": 1024, "output_length": 0, "hash_ids": [0, 2]}',
]


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


_MISSING = object()


def _line(**fields: object) -> str:
    record = {"timestamp": 20, "input_length": 600, "output_length": 7, "hash_ids": [0, 3]}
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not _MISSING})


MALFORMED = [
    ('{"timestamp": 20, "input_length": ', "<line>"),
    ("[1, 2, 3]", "<line>"),
    ("garbage", "<line>"),
    (_line(timestamp=_MISSING), "timestamp"),
    (_line(input_length=_MISSING), "input_length"),
    (_line(output_length=_MISSING), "output_length"),
    (_line(hash_ids=_MISSING), "hash_ids"),
    (_line(timestamp="20"), "timestamp"),
    (_line(timestamp=True), "timestamp"),
    (_line(timestamp=-1), "timestamp"),
    (_line(timestamp=5), "timestamp"),  # decreases after 10
    ('{"timestamp": NaN, "input_length": 600, "output_length": 7, "hash_ids": [0, 3]}',
     "timestamp"),
    (_line(input_length=-1), "input_length"),
    (_line(input_length=600.0), "input_length"),
    (_line(input_length=True), "input_length"),
    (_line(input_length="600"), "input_length"),
    (_line(output_length=-3), "output_length"),
    (_line(output_length=None), "output_length"),
    (_line(hash_ids="0,3"), "hash_ids"),
    (_line(hash_ids={"0": 3}), "hash_ids"),
    (_line(hash_ids=[0, True]), "hash_ids"),
    (_line(hash_ids=[0, 3.0]), "hash_ids"),
    (_line(hash_ids=[0, None]), "hash_ids"),
    (_line(hash_ids=[0, -3]), "hash_ids"),
    (_line(hash_ids=[0]), "hash_ids"),  # 600 tokens need 2 blocks
    (_line(hash_ids=[0, 3, 4]), "hash_ids"),
]


@pytest.mark.parametrize(("bad", "field"), MALFORMED)
def test_malformed_line_names_file_line_and_field(tmp_path, bad, field):
    """A malformed third line raises one TraceFormatError naming the file, line 3 and the field."""
    path = _write(tmp_path, [*GOOD, bad, GOOD[1]])
    with pytest.raises(TraceFormatError) as info:
        list(read_trace(path))
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), 3, field)
    assert str(err).startswith(f"{path}:3: field {field!r}:")


def test_streaming_yields_good_lines_before_a_bad_one(tmp_path):
    """Requests before a garbage line are yielded before the error is raised."""
    path = _write(tmp_path, [*GOOD, "garbage", *GOOD])
    it = read_trace(path)
    assert [r.line for r in (next(it), next(it))] == [1, 2]
    with pytest.raises(TraceFormatError):
        next(it)


def test_limit_stops_before_later_lines(tmp_path):
    """With a limit, lines past it are never parsed."""
    path = _write(tmp_path, [*GOOD, "garbage"])
    assert len(list(read_trace(path, limit=2))) == 2
    assert list(read_trace(path, limit=0)) == []


def test_parses_fields_and_ignores_extras_and_blank_lines(tmp_path):
    """Fields map onto TraceRequest, extra fields are ignored and blank lines skipped but counted; each request
    carries the block size it was read at."""
    extra = '{"timestamp": 10.5, "input_length": 0, "output_length": 3, "hash_ids": [], "x": 1}'
    path = _write(tmp_path, [GOOD[0], "", "   ", GOOD[1], extra])
    assert list(read_trace(path)) == [
        TraceRequest(0, 1000, 5, (0, 1), 1, 512),
        TraceRequest(10, 1024, 0, (0, 2), 4, 512),
        TraceRequest(10.5, 0, 3, (), 5, 512),
    ]


def test_equal_timestamps_are_accepted(tmp_path):
    """Timestamps may repeat (real traces start many requests at t=0); only decreases are errors."""
    path = _write(tmp_path, [GOOD[0], GOOD[0], GOOD[0]])
    assert [r.timestamp_ms for r in read_trace(path)] == [0, 0, 0]


def test_block_size_sets_expected_id_count(tmp_path):
    """The id count is checked against ceil(input_length / block_size)."""
    path = _write(tmp_path, [_line(input_length=33, hash_ids=[0, 1, 2])])
    assert next(iter(read_trace(path, block_size=16))).hash_ids == (0, 1, 2)
    with pytest.raises(TraceFormatError, match="needs 1 block of 512 tokens"):
        list(read_trace(path))


@pytest.mark.parametrize("kwargs", [{"block_size": 0}, {"block_size": 1.5},
                                    {"limit": -1}, {"limit": 2.0}])
def test_bad_arguments_raise_config_error_at_call(tmp_path, kwargs):
    """Invalid block_size or limit raise ConfigError at the call, before any reading."""
    with pytest.raises(ConfigError):
        read_trace(tmp_path / "does-not-exist.jsonl", **kwargs)


@pytest.mark.parametrize(("path", "message"), [(5, "path=5: must be a str or an os.PathLike"),
                                               (None, "path=None"), ("a\x00b", "contains a NUL")])
def test_a_path_that_is_no_path_is_a_config_error_at_call(path, message):
    """A path of the wrong type or with a NUL raises ConfigError at the call, not a bare TypeError/ValueError."""
    with pytest.raises(ConfigError, match=message):
        read_trace(path)
    with pytest.raises(ConfigError, match=message):
        write_trace(path, [])


# --- bad input files: each is one error naming the file (and line), read with bounded memory -------------------


def _write_bytes(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    return path


def _format_error(path: object) -> TraceFormatError:
    with pytest.raises(TraceFormatError) as info:
        list(read_trace(path))
    return info.value


@pytest.mark.parametrize("data", [b"", b"\n", b"  \n\t\n\n", b"\r\n"])
def test_a_trace_without_requests_is_an_error_naming_the_file(tmp_path, data):
    """An empty or blank file is one TraceFormatError naming the file, not a replay of nothing."""
    path = _write_bytes(tmp_path, data)
    err = _format_error(path)
    assert (err.path, err.field, err.line) == (str(path), "<file>", data.count(b"\n"))
    assert "no requests" in str(err)


@pytest.mark.parametrize(("data", "line"), [
    (b"[" * 100_000, 1),
    (GOOD[0].encode() + b"\n" + b'{"x": ' * 50_000 + b"1" + b"}" * 50_000 + b"\n", 2),
    (GOOD[0].encode() + b"\n" + b"[" * 5_000 + b"]" * 5_000, 2),
])
def test_deeply_nested_lines_are_one_error_at_their_line(tmp_path, data, line):
    """JSON nested deeper than MAX_NESTING is a TraceFormatError at its line, never a RecursionError."""
    path = _write_bytes(tmp_path, data)
    err = _format_error(path)
    assert (err.line, err.field) == (line, "<line>") and f"more than MAX_NESTING ({MAX_NESTING}" in str(err)


def test_nesting_up_to_the_cap_parses_and_brackets_in_strings_do_not_count(tmp_path):
    """An extra field nested MAX_NESTING deep (record included) is read; brackets inside strings never nest."""
    deep = "[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1)
    strings = json.dumps("[{" * 5000 + '\\"')
    path = _write(tmp_path, [GOOD[0][:-1] + f', "deep": {deep}, "s": {strings}}}',
                             GOOD[1][:-1] + f', "deeper": [{deep}]}}'])
    it = read_trace(path)
    assert next(it).hash_ids == (0, 1)
    with pytest.raises(TraceFormatError, match=f"nested {MAX_NESTING + 1} deep") as info:
        next(it)
    assert info.value.line == 2


def test_a_deeply_nested_hash_id_is_quoted_briefly(tmp_path):
    """A nested hash id within the cap is refused with a short quote of it."""
    deep = "[" * 20 + "]" * 20
    path = _write_bytes(tmp_path, f'{{"timestamp": 0, "input_length": 1, "output_length": 1, '
                                  f'"hash_ids": [{deep}]}}'.encode())
    err = _format_error(path)
    assert err.field == "hash_ids" and "expected ints, got [[[[" in str(err)


def test_a_line_over_the_cap_is_an_error_without_reading_further(tmp_path):
    """A line longer than MAX_LINE_BYTES raises at its line; a line of exactly the cap is parsed normally."""
    padded = GOOD[0][:-1] + ", " + '"pad": "' + "x" * (MAX_LINE_BYTES - len(GOOD[0]) - 11) + '"}'
    assert len(padded) == MAX_LINE_BYTES
    path = _write_bytes(tmp_path, (padded + "\n" + padded + "x\n").encode())
    it = read_trace(path)
    assert next(it).hash_ids == (0, 1)
    with pytest.raises(TraceFormatError, match=f"longer than MAX_LINE_BYTES \\({MAX_LINE_BYTES} bytes\\)") as info:
        next(it)
    assert info.value.line == 2


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_an_endless_line_is_an_error_not_a_memory_error():
    """``/dev/zero`` is one endless line: the cap ends the read with a TraceFormatError at line 1."""
    tracemalloc.start()
    try:
        err = _format_error("/dev/zero")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (err.path, err.line) == ("/dev/zero", 1) and "longer than MAX_LINE_BYTES" in str(err)
    assert peak < 3 * MAX_LINE_BYTES, peak


@pytest.mark.parametrize(("data", "problem"), [
    (bytes(range(255, -1, -1)) * 8, "not UTF-8"),
    (b"\x7fELF\x02\x01\x01" + b"\x00" * 64, "not valid JSON"),
    (b"\x00" * 1000, "not valid JSON"),
    (GOOD[0].encode() + b"\n\xff\xfe\n", "not UTF-8"),
])
def test_binary_and_non_utf8_files_are_one_format_error(tmp_path, data, problem):
    """A binary or non-UTF-8 file is a TraceFormatError at the first line that is no JSON text."""
    err = _format_error(_write_bytes(tmp_path, data))
    assert problem in str(err) and err.field == "<line>"


@pytest.mark.parametrize("field", ["input_length", "output_length", "hash_ids", "timestamp"])
def test_ints_beyond_int64_are_refused(tmp_path, field):
    """Counts, ids and timestamps of 2**63 or more are refused: they travel as int64 later."""
    value = [0, 2**63] if field == "hash_ids" else 2**63
    err = _format_error(_write_bytes(tmp_path, _line(**{field: value}).encode()))
    assert err.field == field


def test_missing_files_and_directories_are_trace_file_errors(tmp_path):
    """A missing file or a directory raises TraceFileError (an OSError and a KVKitError) naming the path."""
    for path in (tmp_path / "missing.jsonl", tmp_path):
        with pytest.raises(TraceFileError, match=f"^{tmp_path}.*: cannot read the trace: ") as info:
            list(read_trace(path))
        assert isinstance(info.value, OSError) and isinstance(info.value, KVKitError)
        assert info.value.path == str(path) and isinstance(info.value.__cause__, OSError)
    with pytest.raises(TraceFileError, match="cannot write the trace: "):
        write_trace(tmp_path, [])


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_an_unreadable_file_is_a_trace_file_error(tmp_path):
    """A file without read permission raises TraceFileError naming it."""
    path = _write(tmp_path, GOOD)
    path.chmod(0)
    with pytest.raises(TraceFileError, match="Permission denied"):
        list(read_trace(path))


@pytest.mark.parametrize("requests", [5, [1], [TraceRequest(0, 1, 1, (object(),), 1)]])
def test_write_trace_refuses_what_is_no_trace_request(tmp_path, requests):
    """Items that are not TraceRequests of JSON numbers raise ConfigError, not a bare TypeError."""
    with pytest.raises(ConfigError, match=r"must be a|not JSON numbers"):
        write_trace(tmp_path / "out.jsonl", requests)


_requests = st.lists(
    st.tuples(st.integers(0, 10_000), st.integers(0, 5000), st.integers(0, 5000),
              st.integers(0, 2**40)),
    max_size=20,
).map(lambda rows: [
    TraceRequest(sum(r[0] for r in rows[: i + 1]), n_in, n_out,
                 tuple(range(first, first + math.ceil(n_in / 512))), i + 1, 512)
    for i, (_, n_in, n_out, first) in enumerate(rows)
])


@given(_requests)
def test_write_then_read_round_trips(requests):
    """Writing requests and reading them back gives the same requests, numbered by line (none: an error)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        assert write_trace(path, requests) == len(requests)
        if not requests:
            with pytest.raises(TraceFormatError, match="no requests"):
                list(read_trace(path))
            return
        assert list(read_trace(path)) == requests


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"shared trace not found at {SHARED_TRACE}")
def test_reads_the_shared_mooncake_trace():
    """The shared Mooncake conversation trace parses fully with 512-token blocks."""
    requests = list(read_trace(SHARED_TRACE))
    assert len(requests) == 6000
    assert requests[0].hash_ids[0] == 0
    assert sum(len(r.hash_ids) for r in requests) == 152_537
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(requests))


# sha256 of the shared file the built-in trace was made from (kvkit/sim/data/NOTICE.md repeats it)
_BUILTIN_SHA256 = "68ce4e4b4bed6c423efce345f1e575af03d80327f05611395eedaa1065a46427"


def test_the_builtin_trace_is_the_published_lines_byte_for_byte():
    """The packaged mooncake-conversation file decompresses to exactly the shared trace's bytes (its sha256)."""
    import gzip
    import hashlib

    data = gzip.decompress(Path(trace_path("mooncake-conversation")).read_bytes())
    assert hashlib.sha256(data).hexdigest() == _BUILTIN_SHA256
    assert _BUILTIN_SHA256 in (Path(trace_path("mooncake-conversation")).parent / "NOTICE.md").read_text()


def test_the_builtin_trace_reads_by_name():
    """read_trace("mooncake-conversation") yields its 6,000 requests at 512-token blocks, numbered by line."""
    requests = list(read_trace("mooncake-conversation"))
    assert len(requests) == 6000 and sum(len(r.hash_ids) for r in requests) == 152_537
    assert [r.line for r in requests[:3]] == [1, 2, 3]
    assert set(BUILTIN_TRACES) == {"mooncake-conversation"}


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"shared trace not found at {SHARED_TRACE}")
def test_the_builtin_trace_equals_the_shared_file():
    """Reading the built-in trace gives the same requests as reading the file it was made from."""
    assert list(read_trace("mooncake-conversation")) == list(read_trace(SHARED_TRACE))


def test_a_plain_path_is_never_taken_for_a_builtin_name(tmp_path, monkeypatch):
    """A path that spells a built-in name with a folder (./mooncake-conversation) reads that file."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, GOOD).rename(tmp_path / "mooncake-conversation")
    assert len(list(read_trace("./mooncake-conversation", block_size=512))) == 2


def test_a_gzip_file_reads_like_the_plain_one(tmp_path):
    """A trace file whose name ends in .gz is decompressed on the fly; its errors still name the line."""
    import gzip

    plain = _write(tmp_path, GOOD)
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert list(read_trace(packed, block_size=512)) == list(read_trace(plain, block_size=512))
    packed.write_bytes(gzip.compress(plain.read_bytes() + b"garbage\n"))
    with pytest.raises(TraceFormatError, match=r"trace\.jsonl\.gz:3: field '<line>': not valid JSON"):
        list(read_trace(packed, block_size=512))


@pytest.mark.parametrize("data", [b"not gzip at all\n", b"\x1f\x8b\x08\x00" + b"\x00" * 6 + b"\xff" * 40])
def test_a_broken_gzip_file_is_one_trace_file_error(tmp_path, data):
    """A .gz trace that is not gzip, or whose data is corrupt, is a TraceFileError naming it."""
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(data)
    with pytest.raises(TraceFileError, match=r"bad\.jsonl\.gz: cannot read the trace"):
        list(read_trace(path))


def test_a_missing_file_lists_the_builtin_traces(tmp_path):
    """A trace that does not exist says which built-in names there are, and the closest one."""
    with pytest.raises(TraceFileError, match="built-in traces: mooncake-conversation; did you mean "
                                             "'mooncake-conversation'"):
        list(read_trace("mooncake-conversaton"))


@pytest.mark.parametrize(("bad", "column"), [("[1, 2", 6), ('{"timestamp": 0,', 17), ("{} x", 4)])
def test_bad_json_names_the_file_line_and_a_column_only(tmp_path, bad, column):
    """A malformed line shows the file's line and JSON's reason with its column, never JSON's own line."""
    path = _write(tmp_path, [GOOD[0], bad])
    with pytest.raises(TraceFormatError) as info:
        list(read_trace(path, block_size=512))
    message = str(info.value)
    assert message.startswith(f"{path}:2: field '<line>': not valid JSON (")
    assert f"at column {column})" in message and "line 1" not in message and "line 2" not in message
