"""``kvkit policies``: eviction policies' prefix hit ratios on a trace, against the optimum."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import click

from kvkit.cli import renamed_flag
from kvkit.sim.policy_study import OPT, HitStats, PolicyStudy, study
from kvkit.sim.traces import MOONCAKE_BLOCK_SIZE, read_trace

__all__ = ["policies_command", "save_plot"]


def _split(value: str | None, what: str) -> list[str] | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise click.BadParameter(f"expected a comma-separated list of {what}, got {value!r}")
    return items


def _capacities(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    items = _split(value, "positive ints")
    try:
        capacities = [int(v) for v in items]
    except ValueError:
        capacities = []
    if not capacities or min(capacities) <= 0:
        raise click.BadParameter(f"expected positive block counts like 1000,4000, got {value!r}")
    return capacities


@click.command("policies")
@click.option("--trace", "trace_path", required=True,
              type=click.Path(path_type=Path),  # the reader reports a missing or unreadable file in one line
              help="Mooncake JSONL trace to replay.")
@click.option("--capacities", default="1000,4000,16000", show_default=True,
              callback=_capacities, help="Pool sizes in blocks, comma-separated.")
@click.option("--policies", "policy_list", default=None,
              help="Eviction policies, comma-separated [default: every registered one; "
                   "the optimum 'opt' is always added].")
@click.option("--block-size", default=MOONCAKE_BLOCK_SIZE, show_default=True,
              type=click.IntRange(min=1), help="Tokens per block of the trace's hash_ids.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Replay only the first N requests.")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Worker processes [default: one per CPU].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--plot", "plot_path", default=None,
              type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="Write a PNG of hit ratio against capacity per policy.")
@renamed_flag("--block-tokens", "--block-size", type=click.IntRange(min=1))  # hidden and warning, one release
def policies_command(trace_path: Path, capacities: list[int], policy_list: str | None,
                     block_size: int, limit: int | None, jobs: int | None, as_json: bool,
                     plot_path: Path | None) -> None:
    """Compare eviction policies' prefix hit ratios on a trace, as shares of the optimum.

    Replays the trace through the real block pool once per policy and
    capacity, in parallel. A block hits only while every earlier block of its
    request hit; every block is cached after its request. The JSON report's
    "block_tokens" repeats "block_size" for one release.
    """
    if plot_path is not None:
        _require_matplotlib()
    policies = _split(policy_list, "policy names")
    start = time.perf_counter()
    requests = list(read_trace(trace_path, block_size=block_size, limit=limit))
    with _progress(enabled=not as_json) as on_result:
        result = study(requests, capacities, policies, jobs=jobs, on_result=on_result)
    seconds = time.perf_counter() - start
    if plot_path is not None:
        save_plot(result, plot_path, title=trace_path.name)
    references = next(iter(result.stats.values())).references
    if as_json:
        click.echo(json.dumps({
            "trace": str(trace_path),
            "block_size": block_size,
            "block_tokens": block_size,  # deprecated duplicate of block_size, kept one release
            "requests": len(requests),
            "block_references": references,
            "seconds": round(seconds, 3),
            "results": result.results(),
        }, indent=2))
    else:
        _print_table(result, f"{trace_path.name}: {len(requests)} requests, {references} block "
                             f"references of {block_size} tokens, {seconds:.1f} s")
    if plot_path is not None and not as_json:
        click.echo(f"plot written to {plot_path}")


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.UsageError("--plot needs matplotlib: pip install 'kvkit[plot]'") from None


@contextlib.contextmanager
def _progress(*, enabled: bool) -> Iterator[Callable[[HitStats], None]]:
    """A transient progress line on stderr (only on a terminal), advanced once per result."""
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True,
                  disable=not (enabled and sys.stderr.isatty())) as progress:
        task = progress.add_task("replaying", total=None)
        yield lambda stats: progress.update(
            task, advance=1, description=f"{stats.policy} @ {stats.capacity} blocks")


def _print_table(result: PolicyStudy, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("policy")
    for c in result.capacities:
        table.add_column(f"{c} blocks\nhit (of opt)", justify="right")
    for i, p in enumerate(result.policies):
        cells = []
        for c in result.capacities:
            share = result.of_opt(p, c)
            cells.append(f"{result.hit_ratio(p, c):6.1%}"
                         + ("" if share is None else f" ({share:4.0%})"))
        table.add_row(p, *cells, end_section=i == len(result.policies) - 2)  # rule above opt
    Console().print(table)


def save_plot(result: PolicyStudy, path: str | Path, *, title: str = "") -> None:
    """Write a PNG of each policy's hit ratio against capacity (the optimum dashed)."""
    # Figure + Agg canvas, not pyplot: no global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = list(result.capacities)
    for p in result.policies:
        style = {"color": "black", "linestyle": "--"} if p == OPT else {}
        ax.plot(xs, [result.hit_ratio(p, c) for c in xs], marker="o", label=p, **style)
    if len(xs) > 1 and max(xs) / min(xs) >= 10:
        ax.set_xscale("log")
    ax.set_xlabel("pool capacity (blocks)")
    ax.set_ylabel("prefix hit ratio")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title(title or "eviction policies")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
