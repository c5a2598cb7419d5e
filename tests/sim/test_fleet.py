"""Many instances behind a router (``kvkit.sim.fleet`` and ``kvkit simulate --instances``)."""

import json
from itertools import islice

import pytest
from click.testing import CliRunner

import kvkit.cli as cli
from kvkit.errors import ConfigError
from kvkit.sim.fleet import compare_fleets, simulate_fleet
from kvkit.sim.simulator import SimConfig, describe_effect
from kvkit.sim.synthetic import SyntheticWorkload, generate

CONFIG = SimConfig(gpu_blocks=256, cpu_blocks=512)


def workload():
    return islice(generate(SyntheticWorkload(num_conversations=40, seed=3)), 300)


@pytest.mark.parametrize("router", ["round-robin", "session"])
def test_a_shared_tier_serves_what_isolated_instances_recompute(router):
    """Same trace, same instances: sharing computes fewer tokens, serves some from the shared tier, leaks nothing."""
    isolated, sharing = compare_fleets(workload, CONFIG, instances=3, router=router)
    assert isolated.total("prompt_tokens") == sharing.total("prompt_tokens") > 0
    assert isolated.total("shared_hit_tokens") == 0 and not isolated.shared
    if router == "round-robin":  # conversations scattered: the turns of one meet only through the shared tier
        assert sharing.total("shared_hit_tokens") > 0
        assert sharing.total("computed_tokens") < isolated.total("computed_tokens")
    assert sharing.total("leaked_blocks") == isolated.total("leaked_blocks") == 0
    report = sharing.as_dict()
    assert report["shared"] and len(report["per_instance"]) == 3 and report["ttft_model_ms"]["p50"] >= 0


def test_verified_bytes_through_a_shared_tier():
    """With --verify the fleet moves real bytes through the shared tier and every loaded block checks."""
    from kvkit.backends.blockstore.memory import MemoryStore

    config = SimConfig(gpu_blocks=256, cpu_blocks=512, verify=True, shared=MemoryStore())
    fleet = simulate_fleet(islice(workload(), 120), config, instances=2)
    assert fleet.total("shared_hit_tokens") > 0
    assert all(r.integrity_errors == 0 for r in fleet.instances)


@pytest.mark.parametrize(("kwargs", "quoted"), [({"instances": 0}, "instances=0"),
                                            ({"instances": 2, "router": "random"}, "router='random'")])
def test_bad_fleet_arguments_are_refused(kwargs, quoted):
    """A bad instance count or router is a ConfigError quoting it."""
    with pytest.raises(ConfigError, match=quoted):
        simulate_fleet(workload(), CONFIG, **kwargs)


def test_cli_compares_isolated_and_shared_instances():
    """``kvkit simulate --instances 2 --json`` reports both fleets; the shared one served tokens."""
    result = CliRunner().invoke(cli.main, ["simulate", "--instances", "2", "--limit", "200", "--json",
                                           "--gpu-blocks", "256", "--cpu-blocks", "512"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["isolated"]["shared_hit_tokens"] == 0 < report["shared"]["shared_hit_tokens"]
    assert report["shared"]["per_instance"][0]["planner"]["prefill_tokens_per_s"] > 0
    effect = report["shared_tier"]
    assert effect["verdict"] in ("sooner", "later", "same") and effect["served_tokens"] > 0
    assert effect["mean_ms"] == [report["isolated"]["ttft_model_ms"]["mean"], report["shared"]["ttft_model_ms"]["mean"]]
    assert report["shared_url"] == "in-process"
    assert report["shared"]["blocks_put"] > 0 and report["shared"]["shared_outages"] == 0


def test_cli_table_and_a_memory_url():
    """The table names both columns; ``--shared memory://`` is accepted."""
    result = CliRunner().invoke(cli.main, ["simulate", "--instances", "2", "--limit", "100", "--shared",
                                           "memory://fleet-cli", "--gpu-blocks", "256", "--cpu-blocks", "512"],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps cells at the console's width
    assert "isolated" in text and "memory://fleet-cli" in text and "outages / recoveries" in text
    assert "the shared tier made the first token" in text and "hits declined" in text


def test_cli_refuses_an_unknown_router():
    """--router lists the valid choices."""
    result = CliRunner().invoke(cli.main, ["simulate", "--instances", "2", "--router", "sticky"])
    assert result.exit_code != 0 and "round-robin" in result.output


def _chat(limit):
    from kvkit.sim.synthetic import shape

    return lambda: islice(shape("chat", seed=0, block_size=16).requests(), limit)


@pytest.mark.parametrize("gbps", [0.1, 0.5, 2.0, 10.0])
def test_a_shared_tier_never_makes_the_first_token_later(gbps):
    """Four instances on the chat workload: with the default planner, sharing a tier of any fetch bandwidth
    leaves mean and p90 modelled TTFT at most those of isolated instances (slower tiers help less)."""
    from kvkit.sim.simulator import CostModel

    isolated, sharing = compare_fleets(_chat(100), SimConfig(cost=CostModel(shared_gbps=gbps)), instances=4)
    a, b = isolated.ttft_summary(), sharing.ttft_summary()
    assert b["mean"] <= a["mean"] and b["p90"] <= a["p90"], (a, b)
    assert sharing.total("shared_hit_tokens") > 0


@pytest.mark.parametrize("gbps", [0.5, 10.0])
def test_prefetching_what_waits_for_gpu_blocks_never_makes_the_first_token_later(gbps):
    """A GPU pool small enough that requests queue: their shared hits are prefetched while they wait (a fast tier),
    and the shared fleet's mean and p90 modelled TTFT stay at most the isolated fleet's."""
    from kvkit.sim.simulator import CostModel

    config = SimConfig(gpu_blocks=128, cost=CostModel(shared_gbps=gbps))
    isolated, sharing = compare_fleets(_chat(100), config, instances=4)
    a, b = isolated.ttft_summary(), sharing.ttft_summary()
    assert b["mean"] <= a["mean"] and b["p90"] <= a["p90"], (a, b)
    assert sharing.total("queued_requests") > 0 and sharing.total("leaked_blocks") == 0
    if gbps >= 10:
        assert sharing.stat("blocks_prefetched") > 0


@pytest.mark.parametrize("gbps", [0.5, 2.0, 10.0])
def test_an_instance_whose_first_request_is_a_shared_hit_pays_at_most_a_probe(gbps):
    """A GPU pool so small that most requests are skipped: an instance's first prefill can be a shared hit, before
    it has timed any computation. The hit is probed, not loaded whole: the shared fleet's TTFT sum exceeds the
    isolated one's by at most one block's fetch and load per instance (each instance's first use of the tier)."""
    from kvkit.sim.simulator import CostModel

    cost = CostModel(shared_gbps=gbps)
    isolated, sharing = compare_fleets(_chat(400), SimConfig(gpu_blocks=64, cost=cost), instances=4)
    block = SimConfig().spec.bytes_per_block
    probe_ms = cost.fetch_ms(block) + cost.load_ms(block)
    assert sharing.total("shared_hit_tokens") > 0
    assert sum(sharing.ttft_ms) <= sum(isolated.ttft_ms) + 4 * probe_ms, (sum(sharing.ttft_ms), sum(isolated.ttft_ms))
    assert max(sharing.ttft_ms) <= max(isolated.ttft_ms) + probe_ms


def test_loading_every_hit_of_a_slow_tier_makes_the_first_token_later():
    """The control: without a planner (every hit loaded) the same slow tier makes the first token later."""
    from kvkit.sim.simulator import CostModel

    config = SimConfig(cost=CostModel(shared_gbps=0.5), planner="load-all")
    isolated, sharing = compare_fleets(_chat(100), config, instances=4)
    assert sharing.ttft_summary()["mean"] > isolated.ttft_summary()["mean"]
    assert sharing.total("declined_shared") == 0


@pytest.mark.parametrize(("verdict", "words"), [("sooner", "sooner"), ("later", "later"),
                                                ("same", "neither sooner nor later")])
def test_the_effect_sentence_reads_for_every_verdict(verdict, words):
    """The report's sentence says sooner, later or neither, never a bare 'same'."""
    effect = {"verdict": verdict, "mean_ms": [10.0, 10.0], "mean_change": 0.0, "p90_ms": [20.0, 20.0],
              "p90_change": 0.0, "served_tokens": 0, "declined_tokens": 0}
    assert f"made the first token {words}: mean" in describe_effect("shared", effect)
