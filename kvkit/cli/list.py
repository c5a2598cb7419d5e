"""``kvkit list``: every registered component and whether it runs here."""

from __future__ import annotations

import json
from typing import Any

import click

__all__ = ["list_command"]


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
