"""Tests for the Mooncake JSONL trace reader and writer."""

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.errors import ConfigError, TraceFormatError
from kvkit.sim.traces import TraceRequest, read_trace, write_trace

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
    """Fields map onto TraceRequest, extra fields are ignored and blank lines skipped but counted."""
    extra = '{"timestamp": 10.5, "input_length": 0, "output_length": 3, "hash_ids": [], "x": 1}'
    path = _write(tmp_path, [GOOD[0], "", "   ", GOOD[1], extra])
    assert list(read_trace(path)) == [
        TraceRequest(0, 1000, 5, (0, 1), 1),
        TraceRequest(10, 1024, 0, (0, 2), 4),
        TraceRequest(10.5, 0, 3, (), 5),
    ]


def test_equal_timestamps_are_accepted(tmp_path):
    """Timestamps may repeat (real traces start many requests at t=0); only decreases are errors."""
    path = _write(tmp_path, [GOOD[0], GOOD[0], GOOD[0]])
    assert [r.timestamp_ms for r in read_trace(path)] == [0, 0, 0]


def test_block_size_sets_expected_id_count(tmp_path):
    """The id count is checked against ceil(input_length / block_size)."""
    path = _write(tmp_path, [_line(input_length=33, hash_ids=[0, 1, 2])])
    assert list(read_trace(path, block_size=16))[0].hash_ids == (0, 1, 2)
    with pytest.raises(TraceFormatError, match="needs 1 blocks of 512"):
        list(read_trace(path))


def test_old_block_tokens_keyword_still_works_and_warns(tmp_path):
    """``read_trace(block_tokens=...)`` (renamed ``block_size``) works for one release, warning at the caller."""
    path = _write(tmp_path, [_line(input_length=33, hash_ids=[0, 1, 2])])
    with pytest.warns(DeprecationWarning, match=r"read_trace\(block_tokens=\.\.\.\) is deprecated") as rec:
        requests = list(read_trace(path, block_tokens=16))
    assert rec[0].filename == __file__ and requests[0].hash_ids == (0, 1, 2)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="disagree"):
        read_trace(path, block_tokens=16, block_size=512)


@pytest.mark.parametrize("kwargs", [{"block_size": 0}, {"block_size": 1.5},
                                    {"limit": -1}, {"limit": 2.0}])
def test_bad_arguments_raise_config_error_at_call(tmp_path, kwargs):
    """Invalid block_size or limit raise ConfigError at the call, before any reading."""
    with pytest.raises(ConfigError):
        read_trace(tmp_path / "does-not-exist.jsonl", **kwargs)


_requests = st.lists(
    st.tuples(st.integers(0, 10_000), st.integers(0, 5000), st.integers(0, 5000),
              st.integers(0, 2**40)),
    max_size=20,
).map(lambda rows: [
    TraceRequest(sum(r[0] for r in rows[: i + 1]), n_in, n_out,
                 tuple(range(first, first + math.ceil(n_in / 512))), i + 1)
    for i, (_, n_in, n_out, first) in enumerate(rows)
])


@given(_requests)
def test_write_then_read_round_trips(requests):
    """Writing requests and reading them back gives the same requests, numbered by line."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        assert write_trace(path, requests) == len(requests)
        assert list(read_trace(path)) == requests


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"shared trace not found at {SHARED_TRACE}")
def test_reads_the_shared_mooncake_trace():
    """The shared Mooncake conversation trace parses fully with 512-token blocks."""
    requests = list(read_trace(SHARED_TRACE))
    assert len(requests) == 6000
    assert requests[0].hash_ids[0] == 0
    assert sum(len(r.hash_ids) for r in requests) == 152_537
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(requests, requests[1:]))
