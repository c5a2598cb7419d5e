"""Tests for ``kvkit simulate``: JSON and table output, plots, and one-line errors for bad traces."""

import json

import pytest
from click.testing import CliRunner

import kvkit.cli as cli
from kvkit.config import DEFAULTS
from kvkit.sim.simulator import CostModel
from kvkit.sim.synthetic import SyntheticWorkload, generate
from kvkit.sim.traces import write_trace

REQUIRED_KEYS = {
    "requests", "prompt_tokens", "gpu_hit_tokens", "cpu_hit_tokens", "computed_tokens",
    "blocks_stored", "blocks_loaded", "bytes_stored", "bytes_loaded", "evictions_gpu",
    "evictions_cpu", "leaked_blocks", "integrity_errors", "ttft_model_ms", "config",
}

_GOOD = '{"timestamp": 0, "input_length": 20, "output_length": 5, "hash_ids": [1, 2]}'


def _run(*args):
    return CliRunner().invoke(cli.main, ["simulate", *map(str, args)], terminal_width=200)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """A small synthetic trace at 16-token blocks, written as JSONL."""
    path = tmp_path_factory.mktemp("traces") / "chat.jsonl"
    write_trace(path, generate(SyntheticWorkload(num_conversations=30, seed=5)))
    return path


def test_default_run_shows_that_offload_helps():
    """The built-in workload's JSON has every key, CPU hits, no leak, and a lower TTFT than without offload."""
    result = _run("--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) >= REQUIRED_KEYS
    assert set(report["ttft_model_ms"]) >= {"p50", "p90", "p99"}
    assert report["cpu_hit_tokens"] > 0
    assert report["leaked_blocks"] == 0
    assert report["integrity_errors"] is None
    baseline = report["baseline"]
    assert baseline["cpu_hit_tokens"] == 0
    assert report["ttft_model_ms"]["p50"] < baseline["ttft_model_ms"]["p50"]
    assert report["ttft_model_ms"]["mean"] < baseline["ttft_model_ms"]["mean"]
    assert report["cpu_tier"]["verdict"] == "sooner" and report["cpu_tier"]["mean_change"] < 0
    assert report["cpu_tier"]["served_tokens"] == report["cpu_hit_tokens"]
    assert report["planner"]["prefill_tokens_per_s"] == 20_000 and report["config"]["planner"] == "overlap"
    config = report["config"]
    assert (config["trace"], config["seed"], config["block_size"]) == ("synthetic", 0, 16)
    assert "block_tokens" not in config and "eviction" not in config  # JSON speaks the new names only
    assert config["store"] == "eager" and config["cpu_blocks"] > 0


def test_trace_flags_reach_the_configuration(trace_file):
    """Sizes, policies and cost flags given on the command line are the ones simulated and reported."""
    result = _run("--trace", trace_file, "--block-size", 16, "--gpu-blocks", 300, "--cpu-bytes", "1GiB",
                  "--cpu-eviction", "s3fifo", "--gpu-eviction", "fifo", "--store", "lazy", "--seed", 9,
                  "--pcie-gbps", 50, "--prefill-tokens-per-s", 9000, "--no-baseline", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    config = report["config"]
    assert config["gpu_blocks"] == 300 and config["cpu_blocks"] == 2**30 // (16 * 2**17)
    assert (config["cpu_eviction"], config["gpu_eviction"], config["store"]) == ("s3fifo", "fifo", "lazy")
    assert config["cost"]["pcie_gbps"] == 50 and config["cost"]["prefill_tokens_per_s"] == 9000
    assert config["trace"] == str(trace_file)
    assert "baseline" not in report
    lines = sum(1 for line in trace_file.read_text().splitlines() if line.strip())
    assert report["requests"] + report["skipped_requests"] == lines


def test_verify_reports_zero_integrity_errors(trace_file):
    """--verify moves real bytes and finds every loaded block intact."""
    result = _run("--trace", trace_file, "--block-size", 16, "--gpu-blocks", 300, "--cpu-blocks", 3000,
                  "--verify", "--json", "--no-baseline")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["blocks_loaded"] > 0
    assert report["integrity_errors"] == 0 and report["leaked_blocks"] == 0


def test_table_and_plot(trace_file, tmp_path):
    """Without --json a table compares both runs, and --plot writes a non-empty PNG."""
    plot = tmp_path / "sim.png"
    result = _run("--trace", trace_file, "--block-size", 16, "--gpu-blocks", 300, "--plot", plot)
    assert result.exit_code == 0, result.output
    for text in ("offload", "no offload", "hit tokens, CPU tier", "modelled TTFT p99", "leaked blocks"):
        assert text in result.stdout
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


_MALFORMED = {
    "bad JSON": ('{"timestamp": 0, "input_length": 20,', "not valid JSON"),
    "not an object": ("[1, 2, 3]", "expected a JSON object"),
    "missing field": ('{"timestamp": 1, "input_length": 20, "output_length": 5}', "'hash_ids': missing"),
    "negative length": ('{"timestamp": 1, "input_length": -20, "output_length": 5, "hash_ids": []}',
                        "'input_length'"),
    "negative output": ('{"timestamp": 1, "input_length": 20, "output_length": -1, "hash_ids": [1, 2]}',
                        "'output_length'"),
    "decreasing timestamp": ('{"timestamp": -1, "input_length": 20, "output_length": 5, "hash_ids": [1, 2]}',
                             "'timestamp'"),
    "string hash id": ('{"timestamp": 1, "input_length": 20, "output_length": 5, "hash_ids": [1, "2"]}',
                       "expected ints, got '2'"),
    "float hash id": ('{"timestamp": 1, "input_length": 20, "output_length": 5, "hash_ids": [1, 2.5]}',
                      "expected ints, got 2.5"),
    "wrong number of hash ids": ('{"timestamp": 1, "input_length": 20, "output_length": 5, "hash_ids": [1]}',
                                 "has 1 id but"),
}


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_malformed_trace_is_one_line_error(tmp_path, case):
    """A malformed line exits 2 with one error naming the file and line, and no traceback."""
    line, message = _MALFORMED[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{_GOOD}\n\n{line}\n{_GOOD}\n")
    result = _run("--trace", path, "--block-size", 16)
    assert result.exit_code == 2, result.output
    assert f"{path}:3:" in result.stderr and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_non_utf8_trace_is_one_line_error(tmp_path):
    """Bytes that are not UTF-8 are reported at their line, not as a decoding traceback."""
    path = tmp_path / "binary.jsonl"
    path.write_bytes(_GOOD.encode() + b"\n\xff\xfe\x00\n")
    result = _run("--trace", path, "--block-size", 16)
    assert result.exit_code == 2
    assert f"{path}:2:" in result.stderr and "not UTF-8" in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--cpu-eviction", "bogus", "--store", "nope"], "valid: "),
    (["--cpu-blocks", 10, "--cpu-bytes", "1GiB"], "give exactly one of --cpu-blocks or --cpu-bytes"),
    (["--cpu-bytes", "12XB"], "byte size '12XB': unknown unit 'XB'"),
    (["--gpu-blocks", 0], "--gpu-blocks=0: must be an int >= 1"),
    (["--gpu-blcks", 3], "No such option '--gpu-blcks'"),
])
def test_bad_options_are_one_line_errors(args, message):
    """Bad options exit 2 with a one-line error naming the flags, before any simulation runs."""
    result = _run(*args, "--limit", 10)
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split())
    assert "Traceback" not in result.output


def test_defaults_come_from_the_one_defaults_record():
    """The simulate flags' defaults are the config's DEFAULTS and the cost model's own defaults."""
    params = {p.name: p for p in cli.main.get_command(None, "simulate").params}
    for slot in ("gpu_blocks", "cpu_blocks", "cpu_eviction", "gpu_eviction", "store"):
        assert params[slot].default is None  # left out, the config's own default applies ...
        assert f"[default: {getattr(DEFAULTS, slot)}]" in params[slot].help  # ... and the help shows it
    defaults = {name: p.default for name, p in params.items()}
    cost = CostModel()
    assert (defaults["pcie_gbps"], defaults["prefill_tokens_per_s"], defaults["decode_ms_per_token"]) == (
        cost.pcie_gbps, cost.prefill_tokens_per_s, cost.decode_ms_per_token)




def test_the_stack_flags_are_the_simulator_s_stack_slots():
    """Every StackConfig slot a SimConfig takes and a command line can spell is a flag, described by its docstring."""
    import attrs

    from kvkit.config import TEXT, StackConfig
    from kvkit.sim.simulator import STACK_SLOTS

    params = {p.name: p for p in cli.main.get_command(None, "simulate").params}
    fields = attrs.fields_dict(StackConfig)
    expected = {s for s in STACK_SLOTS if TEXT in fields[s].metadata} - {"shared"}  # --shared: the fleet's store
    assert expected <= set(params) and {"gpu_blocks", "cpu_bytes", "cpu_eviction", "store"} <= expected
    for slot in expected:
        assert params[slot].opts == ["--" + slot.replace("_", "-")]
        assert params[slot].help and "``" not in params[slot].help


def test_a_shared_url_password_never_reaches_the_output(monkeypatch):
    """`--shared` with a password: the table, the JSON and the plot title show it as ***."""
    import kvkit.shared.client as client
    from kvkit.backends.blockstore.memory import MemoryStore

    monkeypatch.setattr(client, "open_shared", lambda url: (MemoryStore(), True))
    url = "valkey://alice:hunter2@127.0.0.1:6379/0"
    for extra in ([], ["--json"]):
        result = _run("--shared", url, "--instances", 2, "--limit", 20, *extra)
        assert result.exit_code == 0, result.output
        assert "hunter2" not in result.output and "alice:***@127.0.0.1" in " ".join(result.output.split())
