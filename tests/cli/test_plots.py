"""Every plot kvkit writes: legends off the data, plain ticks at the capacities run, a title naming the run."""

from __future__ import annotations

import itertools

import pytest
from click.testing import CliRunner

import kvkit.cli as cli
from kvkit.cli import plots
from kvkit.sim.fleet import compare_fleets
from kvkit.sim.policy_study import study
from kvkit.sim.simulator import SimConfig, simulate
from kvkit.sim.synthetic import shape

pytest.importorskip("matplotlib")

CAPACITIES = (1000, 4000, 262144)


def _requests(n: int = 60):
    return list(itertools.islice(shape("chat", seed=1).requests(), n))


@pytest.fixture(scope="module")
def figures():
    config = SimConfig(gpu_blocks=256, cpu_blocks=2048, block_size=16)
    offload = simulate(_requests(), config)
    baseline = simulate(_requests(), SimConfig(gpu_blocks=256, cpu_blocks=2048, block_size=16, store="never"))
    isolated, sharing = compare_fleets(_requests, config, instances=2)
    result = study(_requests(), CAPACITIES, ["lru", "arc"], jobs=1)
    return {
        "simulate": plots.sim_figure(offload, baseline, title="synthetic chat: GPU 256 blocks, eviction lru"),
        "fleet": plots.fleet_figure(isolated, sharing, title="2 instances, synthetic chat: GPU 256 blocks"),
        "policies": plots.policy_figure(result, title="synthetic chat: lru, arc against opt, at 1,000 blocks"),
    }


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("name", ["simulate", "fleet", "policies"])
def test_legends_cover_no_data_and_titles_fit(figures, name):
    """Each legend lies outside every axes (so over no line or bar); every title lies inside the figure."""
    fig = figures[name]
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    axes = [ax.get_window_extent(renderer) for ax in fig.axes]
    legends = [ax.get_legend() for ax in fig.axes]
    assert all(legend is not None for legend in legends)
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert not any(_overlaps(box, area) for area in axes), name
    page = fig.bbox
    titles = [fig._suptitle] if fig._suptitle is not None else []
    titles += [ax.title for ax in fig.axes]
    for title in titles:
        box = title.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, (name, title.get_text())


def test_the_capacity_axis_has_a_plain_tick_at_each_capacity_run(figures):
    ax = figures["policies"].axes[0]
    figures["policies"].canvas.draw()
    assert list(ax.get_xticks()) == list(CAPACITIES)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1,000", "4,000", "262,144"]
    assert not list(ax.get_xticks(minor=True))


def test_the_ttft_axis_shows_plain_numbers(figures):
    for name in ("simulate", "fleet"):
        fig = figures[name]
        fig.canvas.draw()
        labels = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text()]
        assert labels and not any("$" in text or "^" in text for text in labels), labels


def _run(*args: object):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


@pytest.mark.parametrize(("command", "args", "names"), [
    ("policies", ["--limit", 100, "--capacities", "1000,4000", "--policies", "lru,arc"],
     ["mooncake-conversation", "100 requests", "blocks of 512 tokens", "lru, arc against opt", "1,000, 4,000 blocks"]),
    ("simulate", ["--limit", 50, "--gpu-blocks", 300, "--cpu-blocks", 900],
     ["synthetic chat", "GPU 300 blocks", "CPU 900 blocks of 16 tokens", "eviction hit-density", "store eager"]),
    ("simulate", ["--limit", 50, "--instances", 2],
     ["2 instances (round-robin)", "synthetic chat", "shared tier in-process"]),
])
def test_each_command_writes_a_plot_whose_title_names_the_run(tmp_path, monkeypatch, command, args, names):
    """--plot writes a PNG (with --instances too) titled with the trace, the policies and the sizes."""
    titles = []
    save = plots.save

    def keep_title(figure, path):
        titles.append(" ".join(figure._suptitle.get_text().split()) if figure._suptitle is not None
                      else " ".join(figure.axes[0].get_title().split()))
        save(figure, path)

    monkeypatch.setattr(plots, "save", keep_title)
    png = tmp_path / "plot.png"
    result = _run(command, *args, "--plot", png)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot written to {png}" in result.output
    for name in names:
        assert name in titles[0], (name, titles[0])


def test_no_baseline_with_instances_is_refused_before_any_work(monkeypatch):
    """--no-baseline names no run of a fleet comparison: refused, saying why, nothing simulated."""
    import kvkit.cli._fleet as fleet_module

    monkeypatch.setattr(fleet_module, "compare_fleets", lambda *a, **k: pytest.fail("work started"))
    result = _run("simulate", "--instances", 4, "--no-baseline")
    assert result.exit_code == 2
    assert "--no-baseline" in result.output and "--instances" in result.output
