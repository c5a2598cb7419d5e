"""``kvkit policies``: eviction policies' prefix hit ratios on a trace, against the optimum."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import overload

import click

from kvkit.cli import check_plot_path, shape_option
from kvkit.cli._progress import progress
from kvkit.config import DEFAULTS
from kvkit.sim.baselines import libcachesim_study
from kvkit.sim.policy_study import OPT, STORES, HitStats, PolicyStudy, check_study, study
from kvkit.sim.synthetic import shape
from kvkit.sim.traces import MOONCAKE_BLOCK_SIZE, read_trace
from kvkit.validate import plural

__all__ = ["DEFAULT_TRACE", "policies_command"]

DEFAULT_TRACE = "mooncake-conversation"
"""What ``kvkit policies`` replays without ``--trace`` or ``--shape``: the built-in Mooncake trace."""


@overload
def _split(value: str, what: str) -> list[str]: ...
@overload
def _split(value: None, what: str) -> None: ...
@overload
def _split(value: str | None, what: str) -> list[str] | None: ...
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
@click.option("--trace", "trace_path", default=None,
              # kept as typed (a Path would drop the "./" that makes ./NAME a file, not a built-in trace);
              # the reader reports a missing or unreadable file in one line
              type=click.Path(path_type=str),
              help=f"Mooncake JSONL(.gz) trace to replay, or a built-in one by name [default without --shape: "
                   f"the built-in {DEFAULT_TRACE}].")
@shape_option(f"Replay a synthetic workload shape instead of --trace (blocks of {DEFAULTS.block_size} tokens "
              "unless --block-size is given).")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seed of the --shape workload (another seed draws another trace of the same shape).")
@click.option("--baselines", type=click.Choice(["libcachesim"]), default=None,
              help="Also run libCacheSim's classic policies on the same blocks, counted as "
                   "--counting says (plainly by default: a hit whenever a block is cached, not only "
                   "in a hit prefix); needs the libcachesim extra.")
@click.option("--counting", type=click.Choice(["plain", "prefix"]), default="plain", show_default=True,
              help="How --baselines count hits: plainly (a cached block hits wherever it sits in its "
                   "request), or as kvkit counts (only in a request's leading run of hits).")
@click.option("--stores", type=click.Choice(STORES), default=STORES[0], show_default=True,
              help="How a request's missing blocks enter the pool: one at a time after its hits "
                   "were released (an offload tier's stores; libCacheSim's rules), or all at once "
                   "beside its pinned hits (an engine's prefix cache).")
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
def policies_command(trace_path: str | None, shape_name: str | None, seed: int, baselines: str | None,
                     counting: str, stores: str, capacities: Sequence[int], policy_list: str | None,
                     block_size: int, limit: int | None, jobs: int | None, as_json: bool,
                     plot_path: Path | None) -> None:
    """Compare eviction policies' prefix hit ratios on a trace, as shares of the optimum.

    Replays the trace (without --trace or --shape: the built-in
    mooncake-conversation) through the real block pool once per policy and
    capacity, in parallel. A block hits only while every earlier block of its
    request hit; every block is stored after its request (--stores says how).
    """
    check_plot_path(plot_path)
    if trace_path is not None and shape_name is not None:
        raise click.UsageError("give --trace or --shape, not both")
    if trace_path is None and shape_name is None:
        trace_path = DEFAULT_TRACE  # a first run needs no file: the packaged trace
    ctx = click.get_current_context()
    if trace_path is not None and ctx.get_parameter_source("seed") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError(f"--seed {seed} seeds a --shape workload; a --trace replays as it is")
    if baselines is not None:
        _require_libcachesim()
    elif ctx.get_parameter_source("counting") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError(f"--counting {counting} says how --baselines count; give --baselines libcachesim")
    names, capacities = check_study(capacities, _split(policy_list, "policy names"), slot="--policies")  # first
    if shape_name is not None and ctx.get_parameter_source("block_size") is click.core.ParameterSource.DEFAULT:
        block_size = DEFAULTS.block_size
    if trace_path is not None:
        source = read_trace(trace_path, block_size=block_size, limit=limit)
    else:
        assert shape_name is not None  # without --trace and --shape the default trace was set above
        source = itertools.islice(shape(shape_name, seed=seed, block_size=block_size).requests(), limit)
    label = os.path.basename(trace_path) if trace_path is not None else f"synthetic {shape_name} (seed {seed})"
    start = time.perf_counter()
    with progress() as bar:
        requests = list(bar.track(source, f"reading {label}"))
        task = bar.task("replaying", len(names) * len(capacities))
        result = study(requests, capacities, names, stores=stores, jobs=jobs, on_result=lambda stats: bar.update(
            task, advance=1, note=f"replays, last {stats.policy} @ {plural(stats.capacity, 'block', grouped=True)}"))
    baseline_stats = None if baselines is None else libcachesim_study(requests, capacities, prefix=counting == "prefix")
    seconds = time.perf_counter() - start
    if plot_path is not None:
        from kvkit.cli.plots import policy_figure, save

        save(policy_figure(result, title=_plot_title(result, label, len(requests), block_size, stores)), plot_path)
    references = next(iter(result.stats.values())).references
    if as_json:
        click.echo(json.dumps({
            "trace": str(trace_path) if trace_path is not None else f"synthetic:{shape_name}",
            "seed": None if shape_name is None else seed,
            "block_size": block_size,
            "requests": len(requests),
            "block_references": references,
            "stores": stores,
            "seconds": round(seconds, 3),
            "results": result.results(),
            **({} if baseline_stats is None else {"baselines": {"libcachesim": {
                "counting": counting, "results": {
                    str(c): {s.policy: {"hit_ratio": s.hit_ratio} for s in baseline_stats if s.capacity == c}
                    for c in result.capacities}}}}),
        }, indent=2))
    else:
        _print_table(result, f"{label}: {plural(len(requests), 'request', grouped=True)}, "
                             f"{plural(references, 'block reference', grouped=True)} of "
                             f"{plural(block_size, 'token', grouped=True)}, {stores} stores, {seconds:.1f} s")
        if baseline_stats is not None:
            _print_baselines(baseline_stats, result.capacities, counting)
    if plot_path is not None and not as_json:
        click.echo(f"plot written to {plot_path}")


def _print_table(result: PolicyStudy, title: str) -> None:
    from rich.table import Table

    from kvkit.cli._tables import print_table

    table = Table(title=title)
    table.add_column("policy", no_wrap=True)
    for c in result.capacities:
        table.add_column(f"{plural(c, 'block', grouped=True)}\nhit (of opt)", justify="right", no_wrap=True)
    for i, p in enumerate(result.policies):
        cells = []
        for c in result.capacities:
            share = result.of_opt(p, c)
            cells.append(f"{result.hit_ratio(p, c):6.1%}"
                         + ("" if share is None else f" ({share:4.0%})"))
        table.add_row(p, *cells, end_section=i == len(result.policies) - 2)  # rule above opt
    print_table(table)


def _require_libcachesim() -> None:
    try:
        import libcachesim  # noqa: F401
    except ImportError:
        raise click.UsageError("--baselines libcachesim needs libCacheSim: pip install 'kvkit[libcachesim]'") from None


def _print_baselines(stats: list[HitStats], capacities: tuple[int, ...], counting: str) -> None:
    from rich.table import Table

    from kvkit.cli._tables import print_table

    table = Table(title="libCacheSim, PLAIN block counting (a hit whenever the block is cached, "
                        "not only in a hit prefix): not comparable row for row with kvkit's"
                  if counting == "plain" else
                  "libCacheSim, PREFIX counting (hits only in a request's leading run of hits, as kvkit counts)")
    table.add_column("baseline", no_wrap=True)
    for c in capacities:
        table.add_column(f"{plural(c, 'block', grouped=True)}\n{counting} hit", justify="right", no_wrap=True)
    ratios = {(s.policy, s.capacity): s.hit_ratio for s in stats}
    rows = list(dict.fromkeys(s.policy for s in stats))
    for p in rows:
        table.add_row(p, *(f"{ratios[p, c]:6.1%}" for c in capacities))
    print_table(table)


def _plot_title(result: PolicyStudy, label: str, requests: int, block_size: int, stores: str) -> str:
    """The run a plot shows: the trace or shape, the policies and the capacities."""
    policies = ", ".join(p for p in result.policies if p != OPT)
    capacities = ", ".join(f"{c:,}" for c in result.capacities)
    return (f"{label}: {plural(requests, 'request', grouped=True)}, blocks of {plural(block_size, 'token')}, "
            f"{stores} stores\n{policies} against {OPT}, at {capacities} blocks")
