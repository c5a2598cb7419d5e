"""The ``kvkit`` command line.

Subcommands are looked up by name in :data:`COMMANDS` and imported only when
run, so ``kvkit --help`` and ``kvkit list`` stay fast and never pull in the
torch-heavy modules behind other commands. kvkit errors reach the user as one
line on stderr and exit code 2, never a traceback (:func:`kvkit_errors`).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from kvkit.errors import ConfigError, KVKitError

__all__ = ["COMMANDS", "KVKitUsageError", "kvkit_errors", "list_command", "main"]

COMMANDS: dict[str, str] = {
    "bench": "kvkit.bench_transfer:bench_group",
    "list": "kvkit.cli:list_command",
    "policies": "kvkit.commands.policies:policies_command",
    "simulate": "kvkit.commands.simulate:simulate_command",
}
"""Subcommand name -> ``"module:attr"`` of its click command (imported on use)."""


class KVKitUsageError(click.ClickException):
    """A kvkit error shown as ``Error: <one line>`` on stderr, exit code 2."""

    exit_code = 2


def _one_line(exc: KVKitError) -> str:
    if isinstance(exc, ConfigError) and len(exc.problems) > 1:
        return f"{len(exc.problems)} configuration problems: " + "; ".join(exc.problems)
    return " ".join(str(exc).split())


@contextlib.contextmanager
def kvkit_errors() -> Iterator[None]:
    """Turn a :class:`~kvkit.errors.KVKitError` raised inside into :class:`KVKitUsageError`.

    ``main`` wraps every subcommand in it; use it directly only to run a
    command object outside ``main``.
    """
    try:
        yield
    except KVKitError as exc:
        raise KVKitUsageError(_one_line(exc)) from exc


def _first_doc_line(target: str) -> str:
    """First docstring line of ``target``'s function, read from source without importing it."""
    module, _, attr = target.partition(":")
    try:
        spec = importlib.util.find_spec(module)
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (ImportError, AttributeError, TypeError, OSError, SyntaxError, ValueError):
        return ""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == attr:
            return (ast.get_docstring(node) or "").strip().partition("\n")[0]
    return ""


class _LazyGroup(click.Group):
    """A group whose subcommands come from :data:`COMMANDS`, imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing help must not import the commands; read their docstrings instead.
        rows = [(name, _first_doc_line(COMMANDS[name])) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        with kvkit_errors():
            return super().invoke(ctx)


@click.group(cls=_LazyGroup)
@click.version_option(package_name="kvkit")
def main() -> None:
    """Compose, drive, explore and prove CPU offload tiers for paged KV caches."""


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_command(as_json: bool) -> None:
    """List every registered component and whether it runs on this machine."""
    from kvkit.registry import REGISTRIES, entry_point_problems

    report = {
        kind: {name: _entry(registry, name) for name in registry.names()}
        for kind, registry in REGISTRIES.items()
    }
    for problem in entry_point_problems():
        click.echo(f"warning: {problem}", err=True)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    _print_table(report)


def _entry(registry: Any, name: str) -> dict[str, Any]:
    reason = registry.why_unavailable(name)
    entry: dict[str, Any] = {"available": reason is None, "target": registry.target(name)}
    if reason is not None:
        entry["reason"] = reason
    return entry


def _print_table(report: dict[str, dict[str, dict[str, Any]]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvkit components")
    for column in ("kind", "name", "available", "target / reason"):
        table.add_column(column, overflow="fold")
    for kind, entries in report.items():
        for i, (name, entry) in enumerate(entries.items()):
            mark = "[green]yes[/]" if entry["available"] else "[red]no[/]"
            detail = entry["target"] + (f"\n[dim]{entry['reason']}[/]" if "reason" in entry else "")
            table.add_row(kind if i == 0 else "", name, mark, detail, end_section=i == len(entries) - 1)
    Console().print(table)
