"""Long ``kvkit`` commands show progress on stderr: a bar on a terminal (also with ``--json``); on a pipe nothing, but a
benchmark logs its steps."""

import fcntl
import io
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

_KVKIT = [sys.executable, "-c", "from kvkit.cli import main; main()"]
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

COMMANDS = {
    "simulate": (["simulate", "--limit", "300", "--json"], ["replaying (offload)", "of 300 requests"]),
    "policies": (["policies", "--trace", "mooncake-conversation", "--limit", "300", "--capacities", "50,100",
                  "--policies", "lru", "--json"], ["reading mooncake-conversation", "of 4 replays"]),
    "bench transfer": (["bench", "transfer", "--layers", "2", "--blocks", "4", "--pool-blocks", "8", "--repeat",
                        "1", "--json"], ["of 3 steps", "torch: ", "GB/s, verified"]),
}


def _run_on_a_terminal(args: list[str], timeout: float = 240) -> tuple[str, str]:
    """``kvkit args`` with stderr on a pseudo-terminal: (stdout, everything drawn on the terminal)."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "200"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([*_KVKIT, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=follower, env=env)
    os.close(follower)
    drawn, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the command exited and closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    stdout = proc.communicate(timeout=timeout)[0].decode()
    assert proc.returncode == 0, (stdout, drawn[-2000:])
    return stdout, _ESCAPES.sub("", drawn.decode(errors="replace"))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_progress_is_drawn_on_a_terminal_even_with_json(name):
    """On a terminal stderr shows what runs, N of M, the time elapsed; stdout still holds only the JSON."""
    args, expected = COMMANDS[name]
    stdout, drawn = _run_on_a_terminal(args)
    json.loads(stdout)
    for text in [*expected, " elapsed"]:
        assert text in drawn, (text, drawn[-3000:])


@pytest.mark.parametrize("name", ["policies", "simulate"])
def test_progress_is_silent_on_a_pipe(name):
    """With stderr on a pipe the command writes nothing to it, and the same JSON to stdout."""
    args, _ = COMMANDS[name]
    result = subprocess.run([*_KVKIT, *args], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    json.loads(result.stdout)


def test_bench_transfer_logs_each_step_on_a_pipe():
    """A benchmark that may run for minutes says on stderr, one line each, what starts and what finished."""
    args, _ = COMMANDS["bench transfer"]
    result = subprocess.run([*_KVKIT, *args], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    json.loads(result.stdout)  # stdout holds the JSON alone
    lines = result.stderr.splitlines()
    assert lines[0] == "bench transfer: allocating 8 blocks per tier (step 1 of 3)", lines
    assert "bench transfer: torch (step 3 of 3)" in lines and lines[-1] == "bench transfer: done"
    assert any(line.startswith("bench transfer: torch: ") and line.endswith("GB/s, verified") for line in lines)


def test_bench_transfer_on_cpu_warns_first_and_names_a_quick_run(monkeypatch):
    """Without a CUDA device the default-sized benchmark warns before any work, and says what to type instead."""
    import torch
    from click.testing import CliRunner

    import kvkit.cli as cli
    import kvkit.cli.bench as bench_module

    if torch.cuda.is_available():
        pytest.skip("the warning is for machines without a CUDA device")
    seen = []

    def fake_run(spec, *, on_step, on_result, **options):
        seen.append("work")
        on_step("allocating", 0, 1)
        on_step("done", 1, 1)
        return {"results": []}

    monkeypatch.setattr(bench_module, "run_transfer", fake_run)
    result = CliRunner().invoke(cli.main, ["bench", "transfer", "--json"])
    assert result.exit_code == 0, result.output
    first = result.stderr.splitlines()[0]
    assert first.startswith("warning: no CUDA device") and "5.0 GiB copied per timing" in first
    assert first.endswith("kvkit bench transfer --backend torch --layers 2 --blocks 16 --repeat 1")
    assert json.loads(result.stdout) == {"results": []}
    small = CliRunner().invoke(cli.main, ["bench", "transfer", "--layers", "2", "--blocks", "16", "--repeat", "1",
                                          "--json"])
    assert small.exit_code == 0 and "warning" not in small.stderr


def _drawn(bar, console) -> str:
    for renderable in bar.get_renderables():
        console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("width", [200, 80, 40])
def test_no_name_or_number_is_cut_at_any_width(width):
    """A line too wide for the terminal drops the bar and wraps at spaces; names and numbers stay whole."""
    from rich.console import Console

    from kvkit.cli._progress import _bar

    console = Console(width=width, force_terminal=True, color_system=None, record=True, file=io.StringIO())
    bar = _bar(console, shown=True)
    bar.update(bar.add_task("replaying (offload)", total=262144), completed=131072,
               note="requests, 12,345,678 block refs")
    bar.update(bar.add_task("reading mooncake-conversation"), completed=1200)
    drawn = _drawn(bar, console)
    assert "…" not in drawn and max(map(len, drawn.splitlines())) <= width
    for whole in ("replaying (offload)", "reading mooncake-conversation", "131,072", "262,144", "12,345,678"):
        assert whole in drawn, (whole, drawn)


def test_a_finished_line_stops_its_clock():
    """Once done, a line shows the time its work took, however long the command goes on."""
    from rich.console import Console

    from kvkit.cli._progress import _bar, _Times

    clock = [0.0]
    bar = _bar(Console(file=io.StringIO()), shown=True)
    bar.get_time = lambda: clock[0]
    task = bar.add_task("reading", total=3)
    clock[0] = 5.0
    bar.update(task, completed=3)
    clock[0] = 100.0
    assert _Times().render(bar.tasks[0]).plain == "0:00:05 elapsed"
