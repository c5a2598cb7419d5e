"""``kvkit bench transfer`` on the CPU path: torch on host tensors, every copy checked."""

import json
import time

import pytest
import torch
from click.testing import CliRunner

from kvkit.bench import transfer as transfer_bench
from kvkit.cli import main
from kvkit.cli.bench import transfer_command
from kvkit.registry import COPY
from kvkit.worker.layouts import LAYOUTS

SMALL = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4", "--pool-blocks", "24"]

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


@needs_no_cuda
@pytest.mark.parametrize("layout", ["per-layer", "blocks-first", "cross-layer"])
@pytest.mark.parametrize(("ids", "direction"), [("random", "store"), ("consecutive", "load"), ("random", "both")])
def test_cpu_run_times_torch_and_checks_every_copy(layout, ids, direction):
    """Without a GPU the benchmark runs torch on host tensors and reports verified GB/s."""
    result = CliRunner().invoke(main, ["bench", "transfer", "--layout", layout, "--blocks", "5", "--ids", ids,
                                       "--direction", direction, "--repeat", "2", "--json", *SMALL])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stderr logs the steps
    assert report["device"] == "cpu" and report["ceiling_gbps"] > 0
    assert report["direction"] == direction and set(report["ceilings_gbps"]) == {"store", "load", "both"}
    (row,) = report["results"]
    assert row["backend"] == "torch" and row["verified"] and row["gbps"] > 0
    assert row["directions"] == (["store", "load"] if direction == "both" else [direction])
    # torch is a LayeredCopy: the same plan in one stage a layer, checked, against the whole plan.
    stages = 1 if layout == "cross-layer" else 2
    assert row["layered_stages"] == stages and row["layered_verified"] and row["layered_vs_whole"] > 0


@needs_no_cuda
def test_a_cpu_tier_in_another_layout_is_timed_and_checked():
    """``--cpu-layout`` lays the CPU tier out apart from the GPU tier; every copy is still verified."""
    result = CliRunner().invoke(main, ["bench", "transfer", "--layout", "per-layer", "--cpu-layout", "cross-layer",
                                       "--blocks", "5", "--direction", "both", "--repeat", "2", "--json", *SMALL])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stderr logs the steps
    assert (report["layout"], report["cpu_layout"]) == ("per-layer", "cross-layer")
    assert report["regions"] == 4 and report["skipped"] == {}  # layer{i}.k / .v for 2 layers
    (row,) = report["results"]
    assert row["verified"] and row["gbps"] > 0


@needs_no_cuda
@pytest.mark.parametrize(("args", "message"), [
    (["--with-gemm"], "needs a CUDA GPU"),
    (["--backend", "cupy-batch"], "copy backend not available on this machine"),
    (["--blocks", "20", "--direction", "both"], "pool of at least 40 blocks"),
    (["--set", "sm_budget"], "KEY=VALUE"),
])
def test_bad_requests_are_one_line_errors(args, message):
    """Impossible requests exit 2 with a one-line kvkit error."""
    result = CliRunner().invoke(main, ["bench", "transfer", "--blocks", "4", *SMALL, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_table_output_names_the_ceiling():
    """The default output is a table with the backend's GB/s next to the measured ceiling."""
    result = CliRunner().invoke(main, ["bench", "transfer", "--backend", "torch", "--blocks", "3", *SMALL])
    assert result.exit_code == 0, result.output
    assert "ceiling" in result.output and "torch" in result.output


def test_layout_choices_are_the_registered_layouts():
    """--layout and --cpu-layout offer exactly kvkit.worker.layouts.LAYOUTS (vllm-cpu included)."""
    params = {p.name: p for p in transfer_command.params}
    assert tuple(params["layout"].type.choices) == tuple(LAYOUTS) == tuple(params["cpu_layout"].type.choices)
    assert "vllm-cpu" in LAYOUTS


@needs_no_cuda
def test_the_vllm_cpu_layout_is_timed_and_checked():
    """The ``vllm-cpu`` layout is timed and checked like the others."""
    result = CliRunner().invoke(main, ["bench", "transfer", "--layout", "vllm-cpu", "--blocks", "5", "--repeat", "2",
                                       "--json", *SMALL])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["results"]
    assert row["verified"]


def test_a_backend_typo_fails_fast_naming_the_valid_backends(monkeypatch):
    """--backend typo exits 2 at once, before allocating or measuring, listing 'all' and every copy backend."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("measured before the backend name was checked")

    monkeypatch.setattr(transfer_bench.Rig, "allocate", must_not_run)
    monkeypatch.setattr(transfer_bench, "measure_ceiling", must_not_run)
    start = time.perf_counter()
    result = CliRunner().invoke(main, ["bench", "transfer", "--backend", "cupy-bach", *SMALL])
    assert time.perf_counter() - start < 2
    assert result.exit_code == 2, result.output
    assert "--backend 'cupy-bach': unknown copy backend" in result.stderr
    assert all(name in result.stderr for name in ["all", *COPY.names()])
    assert "did you mean 'cupy-batch'?" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


