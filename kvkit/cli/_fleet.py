"""``kvkit simulate --instances N``: isolated instances against instances sharing a third tier."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from kvkit.config import shown_url
from kvkit.sim.fleet import FleetResult, compare_fleets
from kvkit.sim.simulator import SimConfig, describe_effect, tier_effect
from kvkit.validate import plural

__all__ = ["run_fleets"]


def run_fleets(workload: Any, config: SimConfig, *, instances: int, router: str, shared_url: str | None,
               as_json: bool, plot_path: Path | None = None) -> None:
    """Replay ``workload`` through ``instances`` isolated instances, then as many sharing a tier; report both.

    With ``plot_path``, also write :func:`~kvkit.cli.plots.fleet_figure` there as a PNG.
    """
    from kvkit.shared.client import open_shared

    store, owned = open_shared(shared_url) if shared_url is not None else (None, False)
    where = "in-process" if shared_url is None else shown_url(shared_url)  # never a password
    start = time.perf_counter()
    try:
        isolated, sharing = compare_fleets(workload.requests, config, instances=instances, router=router,
                                           shared=store)
    finally:
        if owned and store is not None:  # owned: opened here
            store.close()
    wall = time.perf_counter() - start
    config = isolated.instances[0].config  # with the trace's block size
    if plot_path is not None:
        from kvkit.cli.plots import fleet_figure, save
        from kvkit.cli.simulate import describe_run  # imported here: simulate imports this module

        title = (f"{plural(len(isolated.instances), 'instance')} ({isolated.router}), each "
                 f"{describe_run(workload.describe(), config)}; shared tier {where}")
        save(fleet_figure(isolated, sharing, title=title), plot_path)
    if as_json:
        report = {"isolated": isolated.as_dict(), "shared": sharing.as_dict(),
                  "shared_tier": _effect(isolated, sharing), "shared_url": where,
                  "config": config.as_dict() | workload.as_dict(), "wall_s": round(wall, 3)}
        click.echo(json.dumps(report, indent=2, default=str))
        return
    _print(isolated, sharing, workload.describe(), config, where, wall)
    if plot_path is not None:
        click.echo(f"plot written to {plot_path}")


def _effect(isolated: FleetResult, sharing: FleetResult) -> dict[str, Any]:
    """The shared tier's effect on the modelled TTFT (see :func:`~kvkit.sim.simulator.tier_effect`)."""
    return tier_effect(isolated.ttft_summary(), sharing.ttft_summary(), served=sharing.total("shared_hit_tokens"),
                       declined=sharing.total("declined_shared"))


def _rows(f: FleetResult) -> dict[str, str]:
    prompt = f.total("prompt_tokens")

    def tokens(name: str) -> str:
        n = f.total(name)
        return f"{n:,}" + (f" ({n / prompt:.1%})" if prompt else "")

    ttft = f.ttft_summary()
    return {
        "requests": f"{f.total('requests'):,}",
        "prompt tokens": f"{prompt:,}",
        "hit tokens, GPU tier": tokens("gpu_hit_tokens"),
        "hit tokens, CPU tier": tokens("cpu_hit_tokens"),
        "hit tokens, shared tier": tokens("shared_hit_tokens"),
        "computed tokens": tokens("computed_tokens"),
        "  of which overlapping loads": tokens("overlapped_tokens"),
        "hits declined, CPU / shared tier": f"{f.total('declined_cpu'):,} / {f.total('declined_shared'):,}",
        **{f"modelled TTFT {q}": f"{v:,.1f} ms" for q, v in ttft.items()},
        "blocks put / fetched": f"{f.stat('blocks_put'):,} / {f.stat('blocks_fetched'):,}",
        "failed puts / fetches": f"{f.stat('puts_failed'):,} / {f.stat('fetches_failed'):,}",
        "outages / recoveries": f"{f.stat('shared_outages'):,} / {f.stat('shared_recoveries'):,}",
        "leaked blocks": str(f.total("leaked_blocks")),
    }


def _print(isolated: FleetResult, sharing: FleetResult, what: str, config: SimConfig, where: str,
           wall: float) -> None:
    from rich.table import Table

    from kvkit.cli._tables import print_table

    n = len(isolated.instances)
    table = Table(title=f"{what}: {plural(n, 'instance')} ({isolated.router}), each GPU {config.stack.gpu_blocks:,} + "
                        f"CPU {plural(config.stack.num_cpu_blocks, 'block', grouped=True)} of "
                        f"{plural(config.spec.block_size, 'token')}")
    table.add_column("", no_wrap=True)
    table.add_column("isolated", justify="right", no_wrap=True)
    table.add_column(f"shared tier ({where})", justify="right", no_wrap=True)
    shared = _rows(sharing)
    for name, value in _rows(isolated).items():
        table.add_row(name, value, shared[name])
    console = print_table(table)
    console.print(f"{describe_effect('shared', _effect(isolated, sharing))} (fetch {config.cost.shared_gbps:g} "
                  f"GB/s, prefill {config.cost.prefill_tokens_per_s:,.0f} tokens/s, planner "
                  f"{config.as_dict()['planner']}); total {wall:.1f} s")
