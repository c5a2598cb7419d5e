"""`kvkit policies --shape` / `--baselines libcachesim` and `kvkit simulate --shape`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvkit import cli


def _policies(*args: str):
    return CliRunner().invoke(cli.main, ["policies", "--capacities", "200", "--policies", "lru", "--limit", "40",
                                         "--json", *args])


def test_a_shape_replays_by_name_with_its_block_size() -> None:
    """--shape picks a synthetic workload; its blocks default to kvkit's block size; JSON names it."""
    result = _policies("--shape", "agent")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["trace"] == "synthetic:agent" and report["block_size"] == 16 and report["seed"] == 0
    assert set(report["results"]["200"]) == {"lru", "opt"}
    assert "baselines" not in report


def test_without_trace_or_shape_the_builtin_trace_runs() -> None:
    """Neither --trace nor --shape replays the packaged trace; both is a usage error."""
    from kvkit.cli.policies import DEFAULT_TRACE
    from kvkit.sim.traces import BUILTIN_TRACES

    assert DEFAULT_TRACE in BUILTIN_TRACES
    result = _policies("--limit", "100", "--capacities", "1000", "--policies", "lru", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["trace"] == DEFAULT_TRACE and report["requests"] == 100 and report["block_size"] == 512
    both = _policies("--shape", "rag", "--trace", "mooncake-conversation")
    assert both.exit_code == 2 and "not both" in both.output


def test_seed_draws_another_trace_of_the_shape() -> None:
    """--seed reseeds the --shape workload (JSON records it); with --trace it is a usage error."""
    runs = {seed: json.loads(_policies("--shape", "few-shot", "--seed", str(seed)).output) for seed in (0, 1)}
    assert [runs[s]["seed"] for s in (0, 1)] == [0, 1]
    assert runs[0]["block_references"] != runs[1]["block_references"]
    assert json.loads(_policies("--trace", "mooncake-conversation").output)["seed"] is None
    refused = _policies("--trace", "mooncake-conversation", "--seed", "3")
    assert refused.exit_code == 2 and "--seed 3" in refused.output


def test_unknown_shape_lists_the_choices() -> None:
    """A bad shape name is refused by the option, listing the valid ones."""
    result = _policies("--shape", "chatt")
    assert result.exit_code == 2 and "few-shot" in result.output


def test_an_unknown_policy_is_quoted_with_its_flag_and_the_closest_name() -> None:
    """`--policies lru,hit-densty` names the flag and the bad name, and suggests the registered one."""
    result = CliRunner().invoke(cli.main, ["policies", "--policies", "lru,hit-densty", "--capacities", "10"])
    assert result.exit_code != 0
    assert "--policies='hit-densty'" in result.output and "did you mean 'hit-density'?" in result.output, \
        result.output


@pytest.mark.parametrize("command", ["policies", "simulate"])
@pytest.mark.parametrize(("value", "suggestion"), [("chta", "did you mean 'chat'?"),
                                               ("few-shot@num_tmplates=3", "did you mean 'num_templates'?")])
def test_a_mistyped_shape_or_field_gets_the_closest_name(command, value, suggestion) -> None:
    """`--shape chta` suggests 'chat'; a mistyped field after '@' suggests the field."""
    result = CliRunner().invoke(cli.main, [command, "--shape", value])
    assert result.exit_code == 2 and suggestion in result.output, result.output


def test_libcachesim_baselines_sit_beside_kvkit_results_labelled_plain() -> None:
    """--baselines adds libCacheSim's plain counts under their own key; kvkit's results keep their shape."""
    pytest.importorskip("libcachesim")
    result = _policies("--shape", "chat", "--baselines", "libcachesim")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report["results"]["200"]) == {"lru", "opt"}
    baselines = report["baselines"]["libcachesim"]
    assert baselines["counting"] == "plain"
    assert {"lcs:LRU", "lcs:Belady"} <= set(baselines["results"]["200"])
    table = CliRunner().invoke(cli.main, ["policies", "--shape", "chat", "--capacities", "200", "--policies",
                                          "lru", "--limit", "40", "--baselines", "libcachesim"])
    assert "PLAIN" in table.output and "lcs:LIRS" in table.output


def test_prefix_counting_scores_the_baselines_as_kvkit_counts() -> None:
    """--counting prefix counts libCacheSim's hits only in a hit prefix: its LRU equals kvkit's, others move."""
    pytest.importorskip("libcachesim")
    runs = {c: json.loads(_policies("--shape", "few-shot", "--baselines", "libcachesim", "--counting", c).output)
            for c in ("plain", "prefix")}
    plain, prefix = (runs[c]["baselines"]["libcachesim"] for c in ("plain", "prefix"))
    assert (plain["counting"], prefix["counting"]) == ("plain", "prefix")
    assert prefix["results"]["200"]["lcs:LRU"]["hit_ratio"] == runs["prefix"]["results"]["200"]["lru"]["hit_ratio"]
    assert any(prefix["results"]["200"][n]["hit_ratio"] != plain["results"]["200"][n]["hit_ratio"]
               for n in prefix["results"]["200"])
    table = CliRunner().invoke(cli.main, ["policies", "--shape", "chat", "--capacities", "200", "--policies", "lru",
                                          "--limit", "40", "--baselines", "libcachesim", "--counting", "prefix"])
    assert "PREFIX counting" in table.output and "PLAIN" not in table.output
    alone = _policies("--shape", "chat", "--counting", "prefix")
    assert alone.exit_code == 2 and "--baselines libcachesim" in alone.output


def test_missing_libcachesim_is_a_usage_error_before_any_work(without_libcachesim) -> None:
    """Without the extra the command says how to install it."""
    result = _policies("--shape", "chat", "--baselines", "libcachesim")
    assert result.exit_code == 2 and "kvkit[libcachesim]" in result.output


def test_simulate_takes_a_shape() -> None:
    """kvkit simulate --shape replays that shape and reports it."""
    result = CliRunner().invoke(cli.main, ["simulate", "--shape", "few-shot", "--limit", "30", "--no-baseline",
                                           "--json"])
    assert result.exit_code == 0, result.output
    config = json.loads(result.output)["config"]
    assert config["shape"] == "few-shot"
    both = CliRunner().invoke(cli.main, ["simulate", "--shape", "rag", "--trace", "mooncake-conversation"])
    assert both.exit_code == 2 and "not both" in both.output


def test_a_shape_takes_moved_fields_as_kvkit_shape_reads_them() -> None:
    """--shape NAME@FIELD=VALUE;... replays that generator (JSON names it); a bad field or value is refused, quoted."""
    moved = json.loads(_policies("--shape", "few-shot@num_templates=3;drift_every=10").output)
    plain = json.loads(_policies("--shape", "few-shot").output)
    assert moved["trace"] == "synthetic:few-shot@num_templates=3;drift_every=10"
    assert moved["block_references"] != plain["block_references"]
    for bad, quoted in (("few-shot@drift_evry=10", "'drift_evry=10'"), ("rag@document_skew=-1", "document_skew=-1"),
                        ("chat@num_conversations=x", "'x'")):
        for command in (["policies", "--capacities", "200"], ["simulate", "--limit", "5"]):
            result = CliRunner().invoke(cli.main, [*command, "--shape", bad])
            assert result.exit_code == 2 and quoted in result.output and "Traceback" not in result.output, bad
    config = json.loads(CliRunner().invoke(cli.main, ["simulate", "--shape", "agent@num_system_prompts=2", "--limit",
                                                      "20", "--no-baseline", "--json"]).output)["config"]
    assert config["shape"] == "agent@num_system_prompts=2"
