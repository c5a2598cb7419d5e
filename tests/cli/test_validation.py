"""Every ``kvkit`` choice is checked before any work: a bad one is one quick error line, nothing measured."""

import time

import pytest
from click.testing import CliRunner

import kvkit.bench.transfer as transfer_bench
import kvkit.cli as cli
import kvkit.cli.bench  # noqa: F401 - imported here, so the timing below covers the command alone
import kvkit.cli.policies as policies_module
import kvkit.cli.simulate as simulate_module


def _no_work(*args, **kwargs):
    raise AssertionError("work started before the arguments were checked")


@pytest.fixture
def no_bench_work(monkeypatch):
    """``kvkit bench transfer`` fails the test if it fills a tier or measures anything."""
    for name in ("kv_views", "allocate_kv", "measure_ceiling", "bench_backend"):
        monkeypatch.setattr(transfer_bench, name, _no_work)


def _error(*args: str) -> str:
    result = CliRunner().invoke(cli.main, list(args))
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_a_typo_backend_is_named_with_the_valid_ones_in_under_2_s(no_bench_work):
    """`bench transfer --backend <typo>` names the typo, lists every valid backend and hints, before any work."""
    start = time.perf_counter()
    line = _error("bench", "transfer", "--backend", "torhc")
    assert time.perf_counter() - start < 2
    assert "'torhc'" in line and "valid: all, " in line and "torch" in line and "did you mean 'torch'" in line


def test_an_option_no_selected_backend_takes_is_refused(no_bench_work):
    """`--set nope=1` with every backend names the option instead of ignoring it for a minute of timing."""
    assert "--set 'nope'" in _error("bench", "transfer", "--set", "nope=1")


def test_layouts_that_do_not_pair_are_refused_before_allocation(no_bench_work):
    """A GPU and a CPU layout that cannot pair fail before either tier is filled."""
    assert "pairs only with itself" in _error("bench", "transfer", "--layout", "vllm-cpu", "--cpu-layout",
                                              "cross-layer")


def test_a_pool_smaller_than_the_plans_is_refused_before_allocation(no_bench_work):
    """`--blocks` larger than `--pool-blocks` fails before the pool is allocated."""
    assert "needs a pool of at least 64 blocks" in _error("bench", "transfer", "--blocks", "64",
                                                          "--pool-blocks", "8")


def test_a_pool_larger_than_memory_is_one_line(no_bench_work):
    """Tiers that do not fit in memory are one error naming the sizes, not a torch RuntimeError."""
    assert "nothing was allocated" in _error("bench", "transfer", "--blocks", "10000000")


def test_an_unknown_policy_fails_before_the_trace_is_read(monkeypatch):
    """`policies --policies lru,bogus` names 'bogus' and the valid policies without reading the trace."""
    monkeypatch.setattr(policies_module, "read_trace", _no_work)
    line = _error("policies", "--trace", "mooncake-conversation", "--policies", "lru,bogus")
    assert "'bogus'" in line and "valid: " in line and "lru" in line


@pytest.mark.parametrize(("command", "work"), [
    (["simulate"], (simulate_module, "simulate")),
    (["policies", "--trace", "mooncake-conversation"], (policies_module, "study")),
])
def test_a_plot_path_in_no_folder_fails_before_any_work(monkeypatch, tmp_path, command, work):
    """`--plot` into a folder that does not exist fails at once, not with a traceback after the run."""
    monkeypatch.setattr(*work, _no_work)
    target = tmp_path / "no-such-folder" / "plot.png"
    assert f"no folder '{target.parent}'" in _error(*command, "--plot", str(target))
