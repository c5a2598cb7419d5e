"""``kvkit simulate --instances N``: isolated instances against instances sharing a third tier."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from kvkit.sim.fleet import FleetResult, compare_fleets
from kvkit.sim.simulator import SimConfig, describe_effect, tier_effect

__all__ = ["run_fleets"]


def run_fleets(workload: Any, config: SimConfig, *, instances: int, router: str, shared_url: str | None,
               as_json: bool) -> None:
    """Replay ``workload`` through ``instances`` isolated instances, then as many sharing a tier; report both."""
    from kvkit.shared.client import open_shared

    store, owned = open_shared(shared_url) if shared_url is not None else (None, False)
    start = time.perf_counter()
    try:
        isolated, sharing = compare_fleets(workload.requests, config, instances=instances, router=router,
                                           shared=store)
    finally:
        if owned:
            store.close()
    wall = time.perf_counter() - start
    if as_json:
        report = {"isolated": isolated.as_dict(), "shared": sharing.as_dict(), "shared_tier": _effect(isolated, sharing),
                  "shared_url": shared_url or "in-process", "config": config.as_dict() | workload.as_dict(),
                  "wall_s": round(wall, 3)}
        click.echo(json.dumps(report, indent=2, default=str))
        return
    _print(isolated, sharing, workload.describe(), config, shared_url, wall)


def _effect(isolated: FleetResult, sharing: FleetResult) -> dict[str, Any]:
    """The shared tier's effect on the modelled TTFT (see :func:`~kvkit.sim.simulator.tier_effect`)."""
    return tier_effect(isolated.ttft_summary(), sharing.ttft_summary(), served=sharing.total("hit_tokens_shared"),
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
        "hit tokens, GPU tier": tokens("hit_tokens_gpu"),
        "hit tokens, CPU tier": tokens("hit_tokens_cpu"),
        "hit tokens, shared tier": tokens("hit_tokens_shared"),
        "computed tokens": tokens("computed_tokens"),
        "  of which overlapping loads": tokens("overlapped_tokens"),
        "hits declined, CPU / shared tier": f"{f.total('declined_cpu'):,} / {f.total('declined_shared'):,}",
        **{f"modelled TTFT {q}": f"{v:,.1f} ms" for q, v in ttft.items()},
        "blocks put / fetched": f"{f.stat('blocks_put'):,} / {f.stat('blocks_fetched'):,}",
        "failed puts / fetches": f"{f.stat('puts_failed'):,} / {f.stat('fetches_failed'):,}",
        "outages / recoveries": f"{f.stat('shared_outages'):,} / {f.stat('shared_recoveries'):,}",
        "leaked blocks": str(f.total("leaked_blocks")),
    }


def _print(isolated: FleetResult, sharing: FleetResult, what: str, config: SimConfig, shared_url: str | None,
           wall: float) -> None:
    from rich.console import Console
    from rich.table import Table

    n = len(isolated.instances)
    table = Table(title=f"{what}: {n} instances ({isolated.router}), each GPU {config.gpu_blocks:,} + "
                        f"CPU {config.num_cpu_blocks:,} blocks of {config.block_size} tokens")
    table.add_column("")
    table.add_column("isolated", justify="right")
    table.add_column(f"shared tier ({shared_url or 'in-process'})", justify="right")
    shared = _rows(sharing)
    for name, value in _rows(isolated).items():
        table.add_row(name, value, shared[name])
    console = Console()
    console.print(table)
    console.print(f"{describe_effect('shared', _effect(isolated, sharing))} (fetch {config.cost.shared_gbps:g} "
                  f"GB/s, prefill {config.cost.prefill_tokens_per_s:,.0f} tokens/s, planner "
                  f"{config.as_dict()['planner']}); total {wall:.1f} s")
