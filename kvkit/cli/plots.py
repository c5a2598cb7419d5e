"""The plots ``kvkit simulate --plot`` and ``kvkit policies --plot`` write (matplotlib, imported on use).

Rules every plot keeps: legends sit outside the axes, so they never cover
data; axes show plain numbers (``1,000``, never ``10^3``), and a capacity
axis has a tick at exactly each capacity run; the title names the run (the
trace or shape, the policies, the sizes), so a PNG read alone says what it shows.
Figures use an Agg canvas, not pyplot: no global state, no display needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kvkit.sim.fleet import FleetResult
from kvkit.sim.policy_study import OPT, PolicyStudy
from kvkit.sim.simulator import SimResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["fleet_figure", "policy_figure", "save", "sim_figure"]

_PARTS = (("gpu_hit_tokens", "hit in the GPU tier", "tab:green"), ("cpu_hit_tokens", "hit in the CPU tier", "tab:blue"),
          ("shared_hit_tokens", "hit in the shared tier", "tab:purple"), ("computed_tokens", "computed", "tab:gray"))
"""Where a prompt token came from: (figure, legend label, colour), bottom to top of each bar."""


def _plain(value: float, _position: object = None) -> str:
    return f"{value:,g}"


def _title(title: str, figure: Figure) -> str:
    """``title`` wrapped at spaces to the figure's width (about 11 characters an inch)."""
    import textwrap

    width = int(figure.get_figwidth() * 11)
    return "\n".join(textwrap.fill(line, width, break_long_words=False) for line in title.splitlines())


def _legend_outside(ax: Axes) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


@attrs.frozen
class _Run:
    """One run of a simulation plot: its label, every request's modelled TTFT, its prompt tokens by origin."""

    label: str
    ttft_ms: Any  # array("d")
    prompt_tokens: int
    parts: dict[str, int]

    @classmethod
    def of(cls, label: str, result: SimResult | FleetResult) -> _Run:
        if isinstance(result, FleetResult):
            return cls(label, result.ttft_ms, result.total("prompt_tokens"),
                       {name: result.total(name) for name, _, _ in _PARTS})
        return cls(label, result.ttft_ms, result.prompt_tokens, {name: getattr(result, name) for name, _, _ in _PARTS})


def sim_figure(offload: SimResult, baseline: SimResult | None = None, *, title: str) -> Figure:
    """Modelled TTFT CDF, and prompt tokens by tier, with offload and (if run) without."""
    runs = [_Run.of("offload", offload)] + ([_Run.of("no offload", baseline)] if baseline is not None else [])
    return _sim_figure(runs, title)


def fleet_figure(isolated: FleetResult, sharing: FleetResult, *, title: str) -> Figure:
    """Modelled TTFT CDF, and prompt tokens by tier, of isolated instances against instances sharing a tier."""
    return _sim_figure([_Run.of("isolated", isolated), _Run.of("shared tier", sharing)], title)


def _sim_figure(runs: list[_Run], title: str) -> Figure:
    import numpy as np
    from matplotlib.ticker import FuncFormatter, NullFormatter, PercentFormatter

    fig = _new_figure(12, 4.8)
    cdf, tiers = fig.subplots(1, 2, width_ratios=[3, 2])
    for run in runs:
        ttft = np.sort(np.frombuffer(run.ttft_ms, dtype=np.float64))
        if len(ttft):
            cdf.plot(np.maximum(ttft, 1e-3), np.arange(1, len(ttft) + 1) / len(ttft), label=run.label)
    cdf.set_xscale("log")
    cdf.xaxis.set_major_formatter(FuncFormatter(_plain))
    cdf.xaxis.set_minor_formatter(NullFormatter())
    cdf.set_xlabel("modelled time to first token (ms)")
    cdf.set_ylabel("requests")
    cdf.yaxis.set_major_formatter(PercentFormatter(1.0))
    cdf.grid(True, alpha=0.3)
    cdf.set_title("modelled TTFT, cumulative")
    _legend_outside(cdf)
    bottom = np.zeros(len(runs))
    for name, label, color in _PARTS:
        share = np.array([run.parts[name] / run.prompt_tokens if run.prompt_tokens else 0.0 for run in runs])
        if share.any():  # a tier no run has (the shared one, mostly) gets no legend entry
            tiers.bar([run.label for run in runs], share, bottom=bottom, color=color, label=label)
            bottom += share
    tiers.yaxis.set_major_formatter(PercentFormatter(1.0))
    tiers.set_ylabel("prompt tokens")
    tiers.set_title("where prompt tokens came from")
    _legend_outside(tiers)
    fig.suptitle(_title(title, fig))
    return fig


def policy_figure(result: PolicyStudy, *, title: str) -> Figure:
    """Each policy's prefix hit ratio against capacity (the optimum dashed), a tick at each capacity run."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator, PercentFormatter

    fig = _new_figure(9, 4.8)
    ax = fig.add_subplot()
    xs = list(result.capacities)
    for policy in result.policies:
        style: dict[str, Any] = {"color": "black", "linestyle": "--"} if policy == OPT else {}
        ax.plot(xs, [result.hit_ratio(policy, c) for c in xs], marker="o", label=policy, **style)
    if len(xs) > 1 and max(xs) / min(xs) >= 10:
        ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(xs))
    ax.xaxis.set_major_formatter(FixedFormatter([_plain(c) for c in xs]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("pool capacity (blocks)")
    ax.set_ylabel("prefix hit ratio")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title(_title(title, fig))
    ax.grid(True, alpha=0.3)
    _legend_outside(ax)
    return fig


def save(figure: Figure, path: str | Path) -> None:
    """Write ``figure`` as a PNG to ``path``."""
    figure.savefig(path, dpi=120)
