"""Bad trace files given to ``kvkit simulate --trace`` and ``kvkit policies --trace``: one line, exit 2."""

from pathlib import Path

import pytest
from click.testing import CliRunner

import kvkit.cli as cli
import kvkit.cli.simulate as simulate_module

_GOOD = b'{"timestamp": 0, "input_length": 20, "output_length": 5, "hash_ids": [1, 2]}\n'

# name -> (file contents, or None for no file; what the one line says)
_BAD_FILES = {
    "empty": (b"", ":0: field '<file>': no requests"),
    "blank": (b"\n   \n", ":2: field '<file>': no requests"),
    "nested": (b"[" * 100_000 + b"\n", ":1: field '<line>': nested 100000 deep, more than MAX_NESTING"),
    "nested later": (_GOOD + b'{"a": ' * 20_000 + b"0" + b"}" * 20_000 + b"\n",
                     ":2: field '<line>': nested 20000 deep"),
    "not utf-8": (_GOOD + b"\xff\xfe\xfd\n", ":2: field '<line>': not UTF-8"),
    "binary": (bytes(range(255, -1, -1)) * 64, ":1: field '<line>': not UTF-8"),
    "nul bytes": (b"\x00" * 4096, ":1: field '<line>': not valid JSON"),
    "bad line after good ones": (_GOOD * 3 + b"garbage\n", ":4: field '<line>': not valid JSON"),
    "missing": (None, ": cannot read the trace: No such file or directory"),
    "repeated hash id": (_GOOD + b'{"timestamp": 1, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 1]}\n',
                         ":2: field 'hash_ids': id 1 appears twice"),
}


def _run(command: str, trace: object, *args: object):
    extra = ["--capacities", "8"] if command == "policies" else []
    return CliRunner().invoke(cli.main, [command, "--trace", str(trace), "--block-size", "16", *extra,
                                         *map(str, args)], terminal_width=200)


def _assert_one_line(result, *parts: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert all(part in lines[0] for part in parts), (parts, lines[0])
    assert "Traceback" not in result.output and result.stdout == ""


@pytest.mark.parametrize("command", ["simulate", "policies"])
@pytest.mark.parametrize("case", sorted(_BAD_FILES))
def test_a_bad_trace_file_is_one_line_and_exit_2(tmp_path, command, case):
    """Every kind of bad trace file prints one error line naming the file (and line), exit 2, no traceback."""
    data, message = _BAD_FILES[case]
    path = tmp_path / "trace.jsonl"
    if data is not None:
        path.write_bytes(data)
    _assert_one_line(_run(command, path), f"{path}{message}")


@pytest.mark.parametrize("command", ["simulate", "policies"])
def test_a_directory_is_one_line_and_exit_2(tmp_path, command):
    """A directory given as the trace is one line naming it."""
    _assert_one_line(_run(command, tmp_path), f"{tmp_path}: cannot read the trace: Is a directory")


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
@pytest.mark.parametrize("command", ["simulate", "policies"])
def test_an_endless_line_is_one_line_and_exit_2(command):
    """``/dev/zero`` stops at the line-length cap with one error line, not a MemoryError."""
    _assert_one_line(_run(command, "/dev/zero"), "/dev/zero:1: field '<line>': longer than MAX_LINE_BYTES")


@pytest.mark.parametrize("command", ["simulate", "policies"])
def test_a_limit_of_zero_is_refused(tmp_path, command):
    """``--limit 0`` would report a replay of nothing: it is a usage error (exit 2)."""
    path = tmp_path / "trace.jsonl"
    path.write_bytes(_GOOD)
    result = _run(command, path, "--limit", 0)
    assert result.exit_code == 2 and "'--limit': 0 is not in the range x>=1" in result.stderr


def test_simulate_checks_the_whole_trace_before_replaying(tmp_path, monkeypatch):
    """A bad last line fails ``simulate`` before any replay starts (the trace is read once up front)."""
    path = tmp_path / "trace.jsonl"
    path.write_bytes(_GOOD * 50 + b"garbage\n")
    replays = []
    monkeypatch.setattr(simulate_module, "simulate", lambda *args, **kwargs: replays.append(args))
    _assert_one_line(_run("simulate", path), f"{path}:51:")
    assert replays == []


@pytest.mark.parametrize("command", ["simulate", "policies"])
def test_a_dot_slash_path_reads_the_file_of_a_built_in_name(tmp_path, monkeypatch, command):
    """``./mooncake-conversation`` is the local file of that name, not the built-in trace."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mooncake-conversation").write_bytes(b"garbage\n")
    _assert_one_line(_run(command, "./mooncake-conversation"), "mooncake-conversation:1: field '<line>'")
