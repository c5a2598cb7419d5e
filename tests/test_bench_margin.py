"""``benchmarks/bench_margin.py``: list arguments, the named sets of points, trace workloads."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvkit
from kvkit.errors import ConfigError

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_margin.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_margin", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_comma_inside_brackets_stays_with_its_workload():
    split = _load()._split
    assert split("rag@document_tokens=(2000,12000);docs_per_request=1,chat,,few-shot@x=[1,2]") == (
        "rag@document_tokens=(2000,12000);docs_per_request=1", "chat", "few-shot@x=[1,2]")
    assert split("0,1,2") == ("0", "1", "2")
    assert split("") == ()


def test_the_named_sets_are_the_250_points_of_benchmarks():
    """T, A, B, S, L, X expand to BENCHMARKS.md's 48, 45, 36, 33, 70 and 18 points; a bad name is refused."""
    module = _load()
    grid = module.points(tuple(module.SETS))
    counts = {name: sum(point[0] == name for point in grid) for name in module.SETS}
    assert counts == {"T": 48, "A": 45, "B": 36, "S": 33, "L": 70, "X": 18}
    assert len(set(grid)) == 250
    with pytest.raises(ConfigError, match=r"'Q'.*T, A, B"):
        module.points(("T", "Q"))


def test_a_trace_workload_is_one_point_per_capacity(tmp_path):
    """``trace:PATH`` replays the file whatever the seeds; ``--json`` keeps every rule's hit ratio."""
    trace = tmp_path / "t.jsonl"
    kvkit.write_trace(trace, kvkit.shape("chat@num_conversations=12", seed=1, block_size=512).requests())
    out = tmp_path / "margins.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--workloads", f"trace:{trace},chat@num_conversations=12",
                          "--seeds", "0,1", "--capacities", "10", "--others", "lru", "--baselines", "",
                          "--jobs", "1", "--json", str(out)], capture_output=True, text=True, check=True)
    points = json.loads(out.read_text())["points"]
    assert [(p["workload"].startswith("trace:"), p["seed"]) for p in points] == [(True, 0), (False, 0), (False, 1)]
    assert all(set(p["hit_ratio"]) == {"hit-density", "lru"} for p in points)
    assert "met" in run.stdout.splitlines()[-1]


def test_an_unwritable_json_path_is_refused_before_any_replay(tmp_path):
    """``--json`` into a missing directory is a usage error quoting the path, before the replays start."""
    bad = tmp_path / "no" / "such.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--workloads", "chat@num_conversations=12", "--seeds", "0",
                          "--capacities", "10", "--others", "lru", "--baselines", "", "--json", str(bad)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and repr(str(bad)) in run.stderr and "set workload" not in run.stdout


def test_no_rule_to_compare_against_is_refused_before_any_replay():
    """Empty ``--others`` and ``--baselines`` leave no margin to take: a usage error quoting both, no replay."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--workloads", "chat@num_conversations=12", "--seeds", "0",
                          "--capacities", "10", "--others", "", "--baselines", ""], capture_output=True, text=True)
    assert run.returncode == 2 and "--others ''" in run.stderr and "--baselines ''" in run.stderr
    assert "set workload" not in run.stdout
