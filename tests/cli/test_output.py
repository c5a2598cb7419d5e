"""What ``kvkit`` prints: whole names at 80 columns, uncut help, thousands separators, the built-in trace."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvkit.cli as cli
import kvkit.registry as registry_module
from kvkit.registry import REGISTRIES, Registry

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared/traces/mooncake_conversation_part1.jsonl"


class _NeedsAFrobnicator:
    """A component that never runs here, with a long target and a reason."""

    @classmethod
    def is_available(cls) -> bool:
        return False

    @classmethod
    def unavailable_reason(cls) -> str:
        return "needs a frobnicator, which this machine does not have"


def _invoke(*args: str, width: int = 80):
    result = CliRunner().invoke(cli.main, list(args), env={"COLUMNS": str(width)})
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def test_list_keeps_every_name_and_target_whole_at_80_columns(monkeypatch):
    """At 80 columns each name and target is on one line, and a reason does not repeat its target."""
    fresh = {kind: Registry(kind, reg.protocol, reg.label, builtins=dict(reg._targets))
             for kind, reg in REGISTRIES.items()}
    fresh["copy"].register("frobnicated", _NeedsAFrobnicator)
    monkeypatch.setattr(registry_module, "REGISTRIES", fresh)
    out = _invoke("list")
    assert max(map(len, out.splitlines())) <= 80
    for registry in fresh.values():
        for name in registry.names():
            target = registry.target(name)
            assert out.count(target) == 1, target  # whole, and only once
            assert any(f" {name} " in line and target in line for line in out.splitlines()), name
    assert "needs a frobnicator, which" in out
    assert f"{fresh['copy'].target('frobnicated')}: needs" not in out


def test_bench_help_shows_the_whole_description():
    """`kvkit bench --help` lists `transfer` with its whole one-line description, not cut with '...'."""
    out = _invoke("bench", "--help", width=80)
    assert "transfer  Copy-backend GB/s on a KV cache, each copy checked." in out
    commands = out.partition("Commands:")[2].splitlines()
    assert commands and not any(line.endswith("...") for line in commands)


def test_policies_table_uses_thousands_separators():
    """`kvkit policies` prints request, reference and capacity counts with separators, as `simulate` does."""
    out = _invoke("policies", "--trace", "mooncake-conversation", "--limit", "1200", "--capacities", "1000",
                  "--policies", "lru", width=200)
    out = " ".join(out.split())  # the title wraps to the table's width
    assert "1,200 requests" in out and "1,000 blocks" in out
    references = json.loads(_invoke("policies", "--trace", "mooncake-conversation", "--limit", "1200",
                                    "--capacities", "1000", "--policies", "lru", "--json"))["block_references"]
    assert f"{references:,} block references" in out


def test_simulate_replays_the_builtin_trace_by_name():
    """`kvkit simulate --trace mooncake-conversation` replays the packaged trace at 512-token blocks."""
    report = json.loads(_invoke("simulate", "--trace", "mooncake-conversation", "--limit", "200",
                                "--gpu-blocks", "512", "--cpu-blocks", "4000", "--json"))
    assert report["requests"] == 200 and report["config"]["trace"] == "mooncake-conversation"
    assert report["config"]["block_size"] == 512


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"shared trace not found at {SHARED_TRACE}")
def test_the_builtin_trace_gives_the_shared_files_hit_counts():
    """`kvkit policies` on the built-in trace reports the same hits as on the file it was made from."""
    args = ["--limit", "3000", "--capacities", "500,2000", "--policies", "lru,s3fifo", "--json"]
    builtin, shared = (json.loads(_invoke("policies", "--trace", trace, *args))
                       for trace in ("mooncake-conversation", str(SHARED_TRACE)))
    for key in ("requests", "block_references", "results"):
        assert builtin[key] == shared[key], key
    assert builtin["requests"] == 3000


@pytest.mark.parametrize(("args", "whole"), [
    (["policies", "--trace", "mooncake-conversation", "--limit", "100", "--capacities", "1000,262144,1048576"],
     ["hit-density", "262,144 blocks", "1,048,576 blocks", "100 requests"]),
    (["bench", "transfer", "--backend", "torch", "--layers", "2", "--blocks", "4", "--pool-blocks", "8",
      "--repeat", "1"], ["descriptors", "% ceiling", "layers ms"]),
    (["simulate", "--limit", "50", "--gpu-blocks", "262144"],
     ["262,144", "hit tokens, CPU tier", "blocks stored / loaded"]),
])
@pytest.mark.parametrize("width", [80, 40])
def test_tables_never_cut_a_name_or_a_number(args, whole, width):
    """Off a terminal at 80 or 40 columns, table cells are whole: a table wider than that runs past it."""
    out = _invoke(*args, width=width)
    assert "…" not in out
    for text in whole:
        assert text in out, (text, out)
