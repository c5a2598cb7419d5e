"""The ``kvkit`` command: lazy subcommands, ``kvkit list``, and one-line errors."""

import importlib.metadata
import json

import click
import pytest
from click.testing import CliRunner

import kvkit.cli as cli
import kvkit.registry as registry_module
from kvkit.errors import ConfigError, PlanError
from kvkit.registry import ENTRY_POINT_GROUP, REGISTRIES, Registry


@click.command()
@click.option("--many", is_flag=True)
def boom_command(many):
    """Fail with a kvkit error."""
    raise ConfigError(["first bad thing", "second bad thing"]) if many else PlanError("plan\nis bad")


@pytest.fixture
def runner():
    """A click runner."""
    return CliRunner()


def test_list_table_names_every_component(runner):
    """`kvkit list` exits 0 and shows every registered name of every kind."""
    result = runner.invoke(cli.main, ["list"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for kind, reg in REGISTRIES.items():
        assert kind in result.stdout
        assert all(name in result.stdout for name in reg.names())


def test_list_json_schema(runner):
    """`kvkit list --json` maps kind -> name -> {available, target[, reason]} for exactly the six kinds."""
    result = runner.invoke(cli.main, ["list", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {"eviction", "store", "copy", "allocator", "shared", "planner"}
    for kind, entries in report.items():
        assert sorted(entries) == REGISTRIES[kind].names()
        for name, entry in entries.items():
            assert isinstance(entry["available"], bool)
            assert entry["target"] == REGISTRIES[kind].target(name)
            assert ("reason" in entry) == (not entry["available"])
            assert set(entry) <= {"available", "target", "reason"}


def test_list_survives_bad_entry_points(runner, monkeypatch):
    """Broken third-party entry points are warned about on stderr; the listing still succeeds."""
    entries = [importlib.metadata.EntryPoint(name=n, value=v, group=ENTRY_POINT_GROUP) for n, v in [
        ("eviction.ghost", "kvkit_no_such_plugin:Policy"), ("bogus", "x:y"), ("store.bad", "???")]]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: entries)
    fresh = {kind: Registry(kind, reg.protocol, reg.label) for kind, reg in REGISTRIES.items()}
    monkeypatch.setattr(registry_module, "REGISTRIES", fresh)
    result = runner.invoke(cli.main, ["list", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["eviction"]["ghost"]["available"] is False
    assert "kvkit_no_such_plugin" in report["eviction"]["ghost"]["reason"]
    assert "'bogus'" in result.stderr and "'store.bad'" in result.stderr


def test_help_does_not_import_commands(runner, monkeypatch):
    """`kvkit --help` and `kvkit list` never import other commands' modules."""
    monkeypatch.setitem(cli.COMMANDS, "ghost", "kvkit_no_such_command_module:ghost")
    result = runner.invoke(cli.main, ["--help"])
    assert result.exit_code == 0, result.output
    assert "ghost" in result.stdout and "List every registered component" in result.stdout
    assert runner.invoke(cli.main, ["list", "--json"]).exit_code == 0


def test_list_probes_every_backend_without_importing_torch():
    """Without a CUDA driver, `kvkit list` answers for every copy backend without loading torch (seconds of CPU)."""
    import subprocess
    import sys

    from kvkit.backends.copy._driver import driver_problem

    if driver_problem() is None:
        pytest.skip("with a CUDA driver the GPU backends' probes ask torch for a device")
    code = ("import sys; from kvkit.cli import main\n"
            "try:\n    main(['list', '--json'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    report = json.loads(result.stdout)
    assert report["copy"]["torch"]["available"] and not report["copy"]["cuda-dma"]["available"]
    assert "no CUDA driver" in report["copy"]["cuda-dma"]["reason"]
    assert result.stderr.splitlines()[-1] == "False", result.stderr


def test_a_lazy_module_imports_on_first_use_and_then_is_the_module():
    import types

    from kvkit._lazy import lazy_module

    namespace: dict = {}
    namespace["json"] = lazy_module("json", namespace)
    assert "imported on first use" in repr(namespace["json"])
    assert namespace["json"].dumps([1]) == "[1]"
    assert namespace["json"] is json and isinstance(namespace["json"], types.ModuleType)


@pytest.mark.parametrize(("args", "expected"), [
    (["boom"], "Error: plan is bad"),
    (["boom", "--many"], "Error: 2 configuration problems: first bad thing; second bad thing"),
])
def test_kvkit_errors_are_one_line_exit_2(runner, monkeypatch, args, expected):
    """A KVKitError from any subcommand prints one clean stderr line and exits 2, no traceback."""
    monkeypatch.setitem(cli.COMMANDS, "boom", f"{__name__}:boom_command")
    result = runner.invoke(cli.main, args)
    assert result.exit_code == 2
    assert result.stderr.strip() == expected
    assert "Traceback" not in result.output


def test_kvkit_errors_wrapper_standalone():
    """kvkit_errors turns a KVKitError into a ClickException with exit code 2 outside main too."""
    with pytest.raises(cli.KVKitUsageError) as info, cli.kvkit_errors():
        raise ConfigError("x=1: bad")
    assert info.value.exit_code == 2 and info.value.message == "x=1: bad"


def test_unknown_command_is_a_usage_error(runner):
    """An unknown subcommand exits 2 naming it."""
    result = runner.invoke(cli.main, ["lsit"])
    assert result.exit_code == 2 and "lsit" in result.stderr
