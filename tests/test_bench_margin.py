"""``benchmarks/bench_margin.py``: its list arguments split where a shape name's own commas do not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
