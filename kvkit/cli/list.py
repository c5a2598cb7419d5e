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


def _reason(entry: dict[str, Any]) -> str:
    """The entry's reason without its own target in front (the table shows the target just above it)."""
    reason, target = entry["reason"], entry["target"]
    return reason[len(target):].lstrip(":. ") if reason.startswith(target) else reason


def _print_table(report: dict[str, dict[str, dict[str, Any]]]) -> None:
    """One table per kind, so names and targets fit 80 columns whole (only reasons wrap, at spaces)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for kind, entries in report.items():
        table = Table(title=f"{kind} ({len(entries)})", title_justify="left", box=box.SIMPLE_HEAD,
                      pad_edge=False)
        table.add_column("name", no_wrap=True)
        table.add_column("here", no_wrap=True)  # runs on this machine; a short header leaves targets room
        table.add_column("target / reason", overflow="fold")
        for name, entry in entries.items():
            mark = "[green]yes[/]" if entry["available"] else "[red]no[/]"
            detail = entry["target"] + (f"\n[dim]{_reason(entry)}[/]" if "reason" in entry else "")
            table.add_row(name, mark, detail)
        console.print(table)
