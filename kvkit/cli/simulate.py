"""``kvkit simulate``: replay a trace through a real offload stack, with and without offload."""

from __future__ import annotations

import functools
import json
import os
import resource
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import click

from kvkit.cli import check_plot_path, shape_option
from kvkit.cli._fleet import run_fleets
from kvkit.cli._progress import Progress, progress
from kvkit.cli._slots import flag_errors, slot_options
from kvkit.config import DEFAULTS
from kvkit.sim.fleet import ROUTERS
from kvkit.sim.simulator import STACK_SLOTS, CostModel, SimConfig, SimResult, describe_effect, simulate, tier_effect
from kvkit.sim.synthetic import shape
from kvkit.sim.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, read_trace
from kvkit.validate import plural

if TYPE_CHECKING:
    from rich.progress import TaskID

__all__ = ["describe_run", "simulate_command"]

_COST = CostModel()  # the cost model's defaults have one home: CostModel
_SLOTS = tuple(slot for slot in STACK_SLOTS if slot != "shared")  # --shared is the fleet's store (below)
_DEFAULT_STACK = SimConfig().stack


@click.command("simulate")
@click.option("--trace", "trace_path", default=None,
              # kept as typed (a Path would drop the "./" that makes ./NAME a file, not a built-in trace);
              # the reader reports a missing or unreadable file in one line
              type=click.Path(path_type=str),
              help="Mooncake JSONL(.gz) trace, or a built-in one by name: mooncake-conversation "
                   "[default: the synthetic multi-turn chat workload].")
@slot_options(_SLOTS, {slot: getattr(_DEFAULT_STACK, slot) for slot in _SLOTS})
@click.option("--block-size", default=None, type=click.IntRange(min=1),
              help=f"Tokens per block [default: {DEFAULTS.block_size} for the synthetic workload, "
                   f"{MOONCAKE_BLOCK_SIZE} (Mooncake) for --trace].")
@click.option("--verify", is_flag=True,
              help="Move real bytes (torch backend, CPU tensors) and check every loaded block.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the synthetic workload.")
@shape_option("Synthetic workload shape instead of --trace [default: chat].")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="Replay only the first N requests.")
@click.option("--prefill-tokens-per-s", default=_COST.prefill_tokens_per_s, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Cost model: prefill speed.")
@click.option("--pcie-gbps", default=_COST.pcie_gbps, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Cost model: CPU->GPU load GB/s.")
@click.option("--decode-ms-per-token", default=_COST.decode_ms_per_token, show_default=True,
              type=click.FloatRange(min=0), help="Cost model: time per generated token.")
@click.option("--no-baseline", is_flag=True,
              help="Skip the run without offload (store 'never'); not with --instances or --shared.")
@click.option("--instances", default=1, show_default=True, type=click.IntRange(min=1),
              help="Engine instances behind a router; above 1 compares isolated instances with "
                   "instances sharing a third tier.")
@click.option("--router", default="round-robin", show_default=True, type=click.Choice(ROUTERS),
              help="How --instances share the requests.")
@click.option("--shared", "shared_url", default=None,
              help="The shared tier's store URL (e.g. valkey://127.0.0.1:6379/0; a password as "
                   "?password_env=VAR or ?password_file=PATH keeps it off the command line) [default with "
                   "--instances: an in-process store].")
@click.option("--shared-gbps", default=_COST.shared_gbps, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Cost model: shared tier -> CPU fetch GB/s.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--plot", "plot_path", default=None,
              type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="Write a PNG: modelled TTFT CDF and prompt tokens by tier, with and without offload "
                   "(with --instances: isolated instances against instances sharing a tier).")
def simulate_command(trace_path: str | None, block_size: int | None, verify: bool, seed: int,
                     shape_name: str | None, limit: int | None, prefill_tokens_per_s: float, pcie_gbps: float,
                     decode_ms_per_token: float, no_baseline: bool, instances: int, router: str,
                     shared_url: str | None, shared_gbps: float, as_json: bool, plot_path: Path | None,
                     **slots: Any) -> None:
    """Replay a trace through a real offload stack and model time to first token.

    Every request goes through the reference engine loop, both block pools,
    the offload manager and the chosen policies; a cost model (prefill
    tokens/s, PCIe GB/s, decode ms/token) turns computed and loaded tokens
    into a modelled TTFT. The same trace is replayed without offload to
    compare. See kvkit.sim.simulator for the time model.
    """
    check_plot_path(plot_path)
    if trace_path is not None and shape_name is not None:
        raise click.UsageError("give --trace or --shape, not both")
    if no_baseline and (instances > 1 or shared_url is not None):
        raise click.UsageError("--no-baseline skips the run without offload, which --instances and --shared do not "
                               "make: they compare isolated instances with instances sharing a tier")
    if block_size is None:
        block_size = MOONCAKE_BLOCK_SIZE if trace_path is not None else DEFAULTS.block_size
    with flag_errors(_SLOTS):  # every bad slot is reported before any work, by its flag
        config = SimConfig(
            verify=verify, **{slot: value for slot, value in slots.items() if value is not None},
            cost=CostModel(prefill_tokens_per_s=prefill_tokens_per_s, pcie_gbps=pcie_gbps,
                           decode_ms_per_token=decode_ms_per_token, shared_gbps=shared_gbps))
    workload = _Workload(trace_path, block_size, seed, limit, shape_name or "chat")
    if instances > 1 or shared_url is not None:
        run_fleets(workload, config, instances=instances, router=router, shared_url=shared_url, as_json=as_json,
                   plot_path=plot_path)
        return
    start = time.perf_counter()
    runs = [("offload", config)]
    if not no_baseline and config.stack.store != "never":
        runs.append(("no offload", config.replace(store="never", verify=False)))
    results = []
    with progress() as bar:
        total = workload.size(bar)
        for label, cfg in runs:
            task = bar.task(f"replaying ({label})", total)
            results.append(simulate(workload.requests(), cfg, progress=functools.partial(_report, bar, task)))
    offload, baseline = results[0], (results[1] if len(results) > 1 else None)
    wall = time.perf_counter() - start
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    if plot_path is not None:
        from kvkit.cli.plots import save, sim_figure

        save(sim_figure(offload, baseline, title=describe_run(workload.describe(), offload.config)), plot_path)
    if as_json:
        report = offload.as_dict()
        report["config"].update(workload.as_dict())
        if baseline is not None:
            report["baseline"] = {k: v for k, v in baseline.as_dict().items() if k != "config"}
            report["cpu_tier"] = _effect(baseline, offload)
        report["wall_s"] = round(wall, 3)
        report["peak_rss_mib"] = round(peak_rss_mib, 1)
        click.echo(json.dumps(report, indent=2))
        return
    _print_report(offload, baseline, workload, wall, peak_rss_mib)
    if plot_path is not None:
        click.echo(f"plot written to {plot_path}")


@attrs.frozen
class _Workload:
    """The requests to replay: a trace file (read again for each run) or a synthetic workload shape."""

    path: str | None
    block_size: int
    seed: int
    limit: int | None
    shape: str = "chat"

    def requests(self) -> Iterable[TraceRequest]:
        if self.path is not None:
            return read_trace(self.path, block_size=self.block_size, limit=self.limit)
        from itertools import islice

        return islice(shape(self.shape, seed=self.seed, block_size=self.block_size).requests(), self.limit)

    def size(self, bar: Progress) -> int:
        """Requests to replay, read (and checked: a bad trace fails before any run) on a line of ``bar``."""
        what = "generating" if self.path is None else "reading"
        return sum(1 for _ in bar.track(self.requests(), f"{what} {self.describe()}"))

    def describe(self) -> str:
        if self.path is not None:
            return os.path.basename(self.path)
        return f"synthetic {self.shape} (seed {self.seed})"

    def as_dict(self) -> dict[str, Any]:
        return {"trace": str(self.path) if self.path is not None else "synthetic",
                "seed": None if self.path is not None else self.seed, "limit": self.limit,
                "shape": None if self.path is not None else self.shape}


def _effect(baseline: SimResult, offload: SimResult) -> dict[str, Any]:
    """The CPU tier's effect on the modelled TTFT (see :func:`~kvkit.sim.simulator.tier_effect`)."""
    def summary(r: SimResult) -> dict[str, float]:
        return {"mean": round(r.ttft_mean_ms, 3), **r.ttft_percentiles()}

    return tier_effect(summary(baseline), summary(offload), served=offload.cpu_hit_tokens,
                       declined=offload.declined_cpu)


def _share(part: float, whole: float) -> str:
    return f" ({part / whole:.1%})" if whole else ""


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"


def _rows(r: SimResult) -> list[tuple[str, str]]:
    ttft = r.ttft_percentiles()
    rows = [
        ("requests", f"{r.requests:,}"),
        ("prompt tokens", f"{r.prompt_tokens:,}"),
        ("hit tokens, GPU tier", f"{r.gpu_hit_tokens:,}{_share(r.gpu_hit_tokens, r.prompt_tokens)}"),
        ("hit tokens, CPU tier", f"{r.cpu_hit_tokens:,}{_share(r.cpu_hit_tokens, r.prompt_tokens)}"),
        ("computed tokens", f"{r.computed_tokens:,}{_share(r.computed_tokens, r.prompt_tokens)}"),
        ("  of which overlapping loads", f"{r.overlapped_tokens:,}{_share(r.overlapped_tokens, r.prompt_tokens)}"),
        ("hits declined, CPU tier", f"{r.declined_cpu:,}"),
        ("blocks stored / loaded", f"{r.blocks_stored:,} / {r.blocks_loaded:,}"),
        ("bytes stored / loaded", f"{_gib(r.bytes_stored)} / {_gib(r.bytes_loaded)}"),
        ("evictions GPU / CPU", f"{r.evictions_gpu:,} / {r.evictions_cpu:,}"),
        *((f"modelled TTFT {q}", f"{v:,.1f} ms") for q, v in ttft.items()),
        ("modelled TTFT mean", f"{r.ttft_mean_ms:,.1f} ms"),
        ("queued for GPU blocks", f"{r.queued_requests:,}"),
        ("leaked blocks", str(r.leaked_blocks)),
        ("block refs / s", f"{r.block_refs_per_s:,.0f}"),
    ]
    if r.skipped_requests:
        rows.insert(1, ("skipped (larger than the GPU pool)", f"{r.skipped_requests:,}"))
    if r.integrity_errors is not None:
        rows.append(("integrity errors (--verify)", str(r.integrity_errors)))
    return rows


def _print_report(offload: SimResult, baseline: SimResult | None, workload: _Workload,
                  wall: float, peak_rss_mib: float) -> None:
    from rich.table import Table

    from kvkit.cli._tables import print_table

    c = offload.config
    table = Table(title=describe_run(workload.describe(), c))
    table.add_column("", no_wrap=True)
    table.add_column("offload", justify="right", no_wrap=True)
    if baseline is not None:
        table.add_column("no offload", justify="right", no_wrap=True)
    base = dict(_rows(baseline)) if baseline is not None else {}
    for name, value in _rows(offload):
        table.add_row(name, value, *([base.get(name, "")] if baseline is not None else []))
    console = print_table(table)
    cost = c.cost
    console.print(f"cost model: {cost.prefill_tokens_per_s:,.0f} prefill tokens/s, "
                  f"{cost.pcie_gbps:g} GB/s PCIe, {cost.decode_ms_per_token:g} ms/token decode; "
                  f"bytes of {c.model.name} ({c.spec.bytes_per_block / 2**20:g} MiB a block)")
    if baseline is not None:
        console.print(describe_effect("CPU", _effect(baseline, offload)))
    console.print(f"total {wall:.1f} s, peak memory {peak_rss_mib:,.0f} MiB")


def _report(bar: Progress, task: TaskID, n: int, refs: int) -> None:
    """A replay's progress on ``bar``: ``n`` requests, ``refs`` block references."""
    bar.update(task, completed=n, note=f"requests, {plural(refs, 'block ref', grouped=True)}")


def describe_run(what: str, config: SimConfig) -> str:
    """``what`` (the trace or shape) with the run's tier sizes and policies: the title of its table and plot."""
    names = config.as_dict()
    return (f"{what}: GPU {plural(config.stack.gpu_blocks, 'block', grouped=True)}, CPU "
            f"{plural(config.stack.num_cpu_blocks, 'block', grouped=True)} of "
            f"{plural(config.spec.block_size, 'token')}; "
            f"eviction {names['cpu_eviction']} (GPU {names['gpu_eviction']}), store {names['store']}")
