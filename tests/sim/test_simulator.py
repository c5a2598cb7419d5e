"""Tests for the trace-driven simulator: accounting, the time model, --verify, and streaming."""

import math
import re

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.config import DEFAULTS
from kvkit.errors import ConfigError, RequestStateError, TraceFormatError
from kvkit.interfaces import Direction, OffloadCallback
from kvkit.sim.simulator import LLAMA_3_8B, CostModel, SimConfig, Simulator, simulate
from kvkit.sim.synthetic import SyntheticWorkload, generate
from kvkit.sim.traces import TraceRequest

small_workloads = st.builds(
    SyntheticWorkload,
    seed=st.integers(0, 2**16),
    num_conversations=st.integers(1, 12),
    block_size=st.sampled_from([4, 16]),
    conversations_per_s=st.floats(0.5, 20),
    num_system_prompts=st.integers(1, 3),
    system_prompt_tokens=st.tuples(st.integers(0, 100), st.integers(0, 100)).map(sorted),
    max_turns=st.integers(1, 5),
    user_tokens_mean=st.floats(1, 100),
    output_tokens_mean=st.floats(1, 100),
    think_time_mean_s=st.floats(0.1, 10),
    max_context_tokens=st.integers(202, 800),
)


def _config(workload, **kw):
    return SimConfig(**kw)  # the block size is the trace's


@given(small_workloads, st.integers(8, 120), st.integers(1, 200),
       st.sampled_from(["eager", "lazy", "selective", "never"]),
       st.sampled_from(["lru", "fifo", "arc", "s3fifo", "lirs"]))
def test_accounting_adds_up_and_nothing_leaks(workload, gpu_blocks, cpu_blocks, store, eviction):
    """Every prompt token is a GPU hit, a CPU hit or computed; every CPU hit is a loaded block; no block leaks."""
    trace = list(generate(workload))
    config = _config(workload, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks, store=store,
                     cpu_eviction=eviction)
    r = simulate(trace, config)
    bt = workload.block_size
    fits = [t for t in trace if math.ceil(t.input_length / bt) <= gpu_blocks]
    assert r.leaked_blocks == 0
    assert r.requests == len(fits) == len(r.ttft_ms)
    assert r.skipped_requests == len(trace) - len(fits)
    assert r.prompt_tokens == sum(t.input_length for t in fits)
    assert r.block_references == sum(len(t.hash_ids) for t in fits)
    assert r.gpu_hit_tokens + r.cpu_hit_tokens + r.computed_tokens == r.prompt_tokens
    assert r.computed_tokens >= sum(1 for t in fits if t.input_length)  # one token is always recomputed
    assert r.cpu_hit_tokens == r.blocks_loaded * bt
    assert (r.stats["gpu_hit_tokens"], r.stats["cpu_hit_tokens"]) == (r.gpu_hit_tokens, r.cpu_hit_tokens)
    assert r.bytes_loaded == r.blocks_loaded * LLAMA_3_8B.spec(bt).bytes_per_block
    assert min(r.ttft_ms, default=0) >= 0
    if store == "never":
        assert r.cpu_hit_tokens == r.blocks_stored == r.evictions_cpu == 0


def test_time_model_by_hand():
    """TTFT is queueing wait plus compute and load time; a request larger than the GPU pool is skipped."""
    cost = CostModel(prefill_tokens_per_s=1000, decode_ms_per_token=1.0)
    config = SimConfig(gpu_blocks=4, cpu_blocks=8, block_size=4, cost=cost)
    trace = [
        TraceRequest(0, 0, 3, (), 1, 4),  # no prompt: TTFT 0, ends at 3 ms
        TraceRequest(0, 16, 10, (1, 2, 3, 4), 2, 4),  # fills the GPU pool: 16 ms prefill, ends at 26
        TraceRequest(0, 16, 10, (1, 2, 3, 5), 3, 4),  # waits until 26, then 3 GPU-hit blocks + 4 tokens
        TraceRequest(0, 20, 1, (1, 2, 3, 4, 9), 4, 4),  # 5 blocks > 4: skipped
        TraceRequest(100, 9, 1, (1, 2, 7), 5, 4),  # 2 GPU-hit blocks, 1 token computed
    ]
    r = simulate(trace, config)
    assert list(r.ttft_ms) == [0.0, 16.0, 30.0, 1.0]
    assert (r.requests, r.skipped_requests, r.queued_requests) == (4, 1, 1)
    assert (r.gpu_hit_tokens, r.computed_tokens) == (20, 21)


def test_cpu_hits_cost_load_time_not_compute_time():
    """A prefix evicted from the GPU tier comes back from the CPU tier at PCIe speed (every hit loaded)."""
    cost = CostModel(prefill_tokens_per_s=1000, pcie_gbps=1.0, decode_ms_per_token=0.0)
    config = SimConfig(gpu_blocks=5, cpu_blocks=16, cost=cost, planner="load-all")  # the block size is the trace's
    trace = [TraceRequest(0, 16, 1, (1, 2, 3, 4), 1, 4),
             TraceRequest(100, 20, 1, (5, 6, 7, 8, 10), 2, 4),  # evicts the first from the GPU tier
             TraceRequest(200, 17, 1, (1, 2, 3, 4, 9), 3, 4)]  # 4 blocks from the CPU tier, 1 token computed
    r = simulate(trace, config)
    assert r.config.block_size == 4
    load_ms = 4 * r.config.spec.bytes_per_block / 1e9 * 1e3
    assert r.cpu_hit_tokens == 16 and r.blocks_loaded == 4
    assert r.ttft_ms[2] == pytest.approx(1.0 + load_ms)


def test_overlap_time_model_by_hand():
    """Prefill = max(head compute, fetch + load) + the rest's compute + the overhead."""
    cost = CostModel(prefill_tokens_per_s=1000, pcie_gbps=1.0, shared_gbps=0.5, overhead_ms=2.0)
    mb = 10**6
    assert cost.prefill_ms(30, 4 * mb, 2 * mb) == pytest.approx(30 + 4 + 4 + 2)  # nothing overlapped
    assert cost.prefill_ms(30, 4 * mb, 2 * mb, overlapped_tokens=5) == pytest.approx(8 + 25 + 2)  # load side longer
    assert cost.prefill_ms(30, 4 * mb, 2 * mb, overlapped_tokens=20) == pytest.approx(20 + 10 + 2)  # compute longer
    # a prefetch still landing 9 ms after the start delays the load side
    assert cost.prefill_ms(30, 4 * mb, 0, overlapped_tokens=5, ready_ms=9.0) == pytest.approx(9 + 4 + 25 + 2)


def test_the_planner_probes_a_tier_then_plans_from_what_it_observed():
    """The CPU tier's first hit loads one block (a probe) while the rest recomputes; then the planner knows
    the tier's speed and splits each hit where the two sides meet."""
    cost = CostModel(prefill_tokens_per_s=250, pcie_gbps=0.0625, decode_ms_per_token=0.0)
    config = SimConfig(gpu_blocks=5, cpu_blocks=16, block_size=4, cost=cost)
    block_ms = config.spec.bytes_per_block / (0.0625 * 1e9) * 1e3  # a block: 8.4 ms to load, 16 to compute
    trace = [TraceRequest(0, 16, 1, (1, 2, 3, 4), 1, 4),
             TraceRequest(1e6, 20, 1, (5, 6, 7, 8, 10), 2, 4),  # evicts the first from the GPU tier
             TraceRequest(2e6, 17, 1, (1, 2, 3, 4, 9), 3, 4),  # its 4 blocks from the CPU tier: a probe
             TraceRequest(3e6, 20, 1, (11, 12, 13, 14, 15), 4, 4),
             TraceRequest(4e6, 17, 1, (5, 6, 7, 8, 16), 5, 4)]  # 4 CPU blocks: 1 computed while 3 load
    r = simulate(trace, config)
    assert r.ttft_ms[2] == pytest.approx(max(3 * 16, block_ms) + 4)
    assert r.ttft_ms[4] == pytest.approx(max(16, 3 * block_ms) + 4)
    assert (r.cpu_hit_tokens, r.overlapped_tokens, r.declined_cpu) == (4 + 12, 12 + 4, 16)
    assert r.planner["cpu_gbps"] == pytest.approx(0.0625) and r.planner["prefill_tokens_per_s"] == pytest.approx(250)


def test_offload_beats_no_offload_on_the_default_workload():
    """The built-in workload gets CPU hits, and a lower modelled TTFT than the same run with store 'never'."""
    trace = list(generate())
    offload = simulate(trace, SimConfig())
    baseline = simulate(trace, SimConfig(store="never"))
    assert offload.cpu_hit_tokens > 0 and baseline.cpu_hit_tokens == 0
    assert offload.computed_tokens < baseline.computed_tokens
    for q, ms in offload.ttft_percentiles().items():
        assert ms <= baseline.ttft_percentiles()[q], q
    assert sum(offload.ttft_ms) < sum(baseline.ttft_ms)
    assert offload.leaked_blocks == baseline.leaked_blocks == 0


def test_verify_checks_real_bytes_without_errors():
    """With verify, real bytes move through the torch backend and every loaded block matches."""
    workload = SyntheticWorkload(num_conversations=10, seed=3)
    r = simulate(generate(workload), SimConfig(gpu_blocks=600, cpu_blocks=2000, verify=True))
    assert r.blocks_loaded > 0
    assert r.integrity_errors == 0 and r.leaked_blocks == 0


class _PoisonCPUTier(OffloadCallback):
    """Overwrites every worker's CPU mirror after each completed store (a corrupted CPU tier)."""

    workers = ()

    def on_transfer_completed(self, transfer_id, direction, num_blocks, ok):
        if direction is Direction.STORE:
            for worker in self.workers:
                for tensor in worker.cpu_kv:
                    tensor.view(-1).view(dtype=tensor.dtype).fill_(0x5A)


def test_verify_detects_a_corrupted_cpu_tier():
    """Poisoning the CPU mirror mid-run makes the loaded blocks' bytes mismatch: integrity_errors > 0."""
    poison = _PoisonCPUTier()
    sim = Simulator(SimConfig(gpu_blocks=600, cpu_blocks=2000, block_size=16, verify=True, callbacks=[poison]))
    poison.workers = sim.stack.workers
    for request in generate(SyntheticWorkload(num_conversations=10, seed=3)):
        sim.feed(request)
    r = sim.close()
    assert r.blocks_loaded > 0
    assert r.integrity_errors > 0
    assert r.leaked_blocks == 0


def test_no_state_outlives_a_request():
    """While streaming, the manager tracks exactly the running requests (ended ones leave nothing)."""
    sim = Simulator(SimConfig(gpu_blocks=300, cpu_blocks=1000))
    most = 0
    for request in generate(SyntheticWorkload(num_conversations=60, seed=1)):
        sim.feed(request)
        running = len(sim.engine.running)
        assert sim.stack.manager.num_requests == running
        assert sim.engine.num_waiting == 0
        most = max(most, running)
    assert most > 1  # the check saw concurrent requests
    assert sim.close().leaked_blocks == 0


def test_progress_reports_the_final_counts():
    """The progress callback's last call carries every request and block reference read."""
    calls = []
    trace = list(generate(SyntheticWorkload(num_conversations=80)))
    simulate(trace, SimConfig(), progress=lambda n, refs: calls.append((n, refs)))
    assert calls[-1] == (len(trace), sum(len(t.hash_ids) for t in trace))
    assert len(calls) >= 2


@pytest.mark.parametrize(("request_", "field"), [
    (TraceRequest(10, 20, 1, (1,), 7), "hash_ids"),  # 20 tokens of 16-token blocks need 2 ids
    (TraceRequest(10, 16, 1, (1, 2), 7), "hash_ids"),
    (TraceRequest(5, 16, 1, (1,), 7), "timestamp"),  # before the previous arrival
    (TraceRequest(10, 32, 1, (1,), 7, 32), "block_size"),  # not the block size of the requests before
])
def test_feed_rejects_requests_that_do_not_fit(request_, field):
    """Hash ids that do not match the block size, or an arrival back in time, raise TraceFormatError."""
    sim = Simulator(SimConfig())
    sim.feed(TraceRequest(6, 1, 1, (0,), 1))  # 16-token blocks: the simulation's from now on
    with pytest.raises(TraceFormatError) as info:
        sim.feed(request_)
    assert info.value.line == 7 and info.value.field == field
    sim.close()
    with pytest.raises(RequestStateError):
        sim.feed(TraceRequest(0, 1, 1, (0,), 8))


def test_config_validation():
    """Bad sizes, slots and costs raise ConfigError quoting the value, on construction; cpu_bytes converts to
    model blocks."""
    with pytest.raises(ConfigError, match="both cpu_blocks=10 and cpu_bytes='1GiB'"):
        SimConfig(cpu_blocks=10, cpu_bytes="1GiB")
    with pytest.raises(ConfigError, match="holds no block"):
        SimConfig(cpu_bytes="1MiB")
    with pytest.raises(ConfigError, match="-1"):
        SimConfig(gpu_blocks=-1)
    with pytest.raises(ConfigError, match="nan"):
        CostModel(pcie_gbps=float("nan"))
    assert SimConfig(cpu_bytes="1GiB", block_size=16).stack.num_cpu_blocks == 2**30 // (16 * 2**17)
    with pytest.raises(ConfigError, match="bogus") as info:
        SimConfig(cpu_eviction="bogus", store="nope")
    assert len(info.value.problems) == 2


@pytest.mark.parametrize(("slots", "message"), [
    ({"gpu_blcks": 3}, "did you mean 'gpu_blocks'?"),
    ({"kv": None}, "the simulator sets it"),
    ({"copy": "torch"}, "the simulator sets it"),
    ({"stack": 3}, "stack=3: must be a StackConfig"),
])
def test_a_simconfig_takes_only_the_stack_slots_it_does_not_set(slots, message):
    """An unknown keyword, or a slot the simulator sets itself, is a ConfigError naming it (and the valid ones)."""
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        SimConfig(cpu_eviction="bogus", **slots)
    assert len(info.value.problems) == 2  # every problem at once
    if "gpu_blcks" in slots:
        assert "valid: " in str(info.value) and "cpu_eviction" in str(info.value)


def test_replace_and_evolve_keep_the_slots():
    """``replace`` changes slots and fields; a new capacity replaces the old one; ``attrs.evolve`` keeps slots."""
    config = SimConfig(gpu_blocks=600, cpu_blocks=2000, cpu_eviction="lru")
    assert config.replace(cpu_bytes="8GiB").stack.cpu_blocks is None
    assert config.replace(store="never", verify=True).stack.store == "never"
    assert config.replace(store="never", verify=True).stack.copy == "torch"
    evolved = attrs.evolve(config, block_size=512)
    assert (evolved.stack.gpu_blocks, evolved.stack.cpu_eviction, evolved.spec.block_size) == (600, "lru", 512)
    assert SimConfig(stack=config.stack, store="lazy").stack.cpu_eviction == "lru"


def test_a_trace_block_size_flows_into_the_simulation():
    """``simulate(read_trace("mooncake-conversation"), SimConfig(...))`` runs at the trace's 512-token blocks."""
    from kvkit.sim.traces import MOONCAKE_BLOCK_SIZE, read_trace

    r = simulate(read_trace("mooncake-conversation", limit=200), SimConfig(gpu_blocks=400, cpu_blocks=2000))
    assert r.config.block_size == MOONCAKE_BLOCK_SIZE == r.config.spec.block_size
    assert r.requests == 200 and r.gpu_hit_tokens > 0
    assert r.bytes_loaded == r.blocks_loaded * LLAMA_3_8B.spec(MOONCAKE_BLOCK_SIZE).bytes_per_block
    with pytest.raises(TraceFormatError, match=r"SimConfig.block_size=16"):
        simulate(read_trace("mooncake-conversation", limit=5), SimConfig(block_size=16))
    with pytest.raises(ConfigError, match="holds no block"):  # 1 MiB holds 16-token blocks, not 512-token ones
        simulate(read_trace("mooncake-conversation", limit=5), SimConfig(cpu_bytes="4MiB"))


def test_a_simulator_builds_its_stack_at_the_first_request_without_a_block_size():
    """Without ``block_size`` the stack waits for the first request; with one it is built at once."""
    sim = Simulator(SimConfig(gpu_blocks=64, cpu_blocks=64))
    with pytest.raises(RequestStateError, match="block_size"):
        sim.stack  # noqa: B018
    sim.feed(TraceRequest(0, 8, 1, (1, 2), 1, 4))
    assert sim.config.block_size == 4 and sim.stack.config.kv.block_size == 4
    assert sim.close().config.block_size == 4
    assert Simulator(SimConfig(block_size=8)).stack.config.kv.block_size == 8
    assert Simulator(SimConfig()).close().requests == 0


def test_result_as_dict_is_json_ready():
    """``as_dict`` has every reported figure, TTFT percentiles and the configuration."""
    import json

    r = simulate(generate(SyntheticWorkload(num_conversations=5)), SimConfig())
    d = json.loads(json.dumps(r.as_dict()))
    assert {"requests", "prompt_tokens", "gpu_hit_tokens", "cpu_hit_tokens", "computed_tokens",
            "blocks_stored", "blocks_loaded", "bytes_stored", "bytes_loaded", "evictions_gpu",
            "evictions_cpu", "leaked_blocks", "integrity_errors", "ttft_model_ms", "config"} <= set(d)
    assert set(d["ttft_model_ms"]) >= {"p50", "p90", "p99"}
    assert d["config"]["gpu_blocks"] == SimConfig().stack.gpu_blocks


def test_scheduler_only_simulation_imports_no_torch():
    """Without verify the stack has no copy backend (copy=None), so simulating never imports torch."""
    import subprocess
    import sys

    code = ("import sys; from kvkit.sim.simulator import SimConfig, simulate; "
            "from kvkit.sim.synthetic import SyntheticWorkload, generate; "
            "simulate(generate(SyntheticWorkload(num_conversations=3)), SimConfig()); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_copy_none_cannot_move_bytes():
    """A scheduler-only stack (copy=None) refuses a KV layout, naming the fix."""
    from kvkit.stack import build

    config = SimConfig().stack_config()
    assert config.copy is None and config.device == "cpu"
    with pytest.raises(ConfigError, match="copy='torch'"):
        build(config, layout="per-layer")


def test_defaults_come_from_the_one_defaults_record():
    """A default SimConfig uses the config's DEFAULTS, and its JSON speaks the new names only."""
    config = SimConfig()
    stack = config.stack
    assert (stack.gpu_blocks, stack.num_cpu_blocks, stack.kv.block_size) == (
        DEFAULTS.gpu_blocks, DEFAULTS.cpu_blocks, DEFAULTS.block_size)
    assert config.block_size is None  # the trace's
    assert (stack.cpu_eviction, stack.gpu_eviction, stack.store) == (
        DEFAULTS.cpu_eviction, DEFAULTS.gpu_eviction, DEFAULTS.store)
    d = config.as_dict()
    assert {"block_size", "cpu_eviction", "gpu_eviction"} <= set(d) and "pcie_gbps" in d["cost"]
    assert not {"block_tokens", "eviction"} & set(d) and "pcie_gb_per_s" not in d["cost"]


@pytest.mark.parametrize("shared_gbps", [0.1, 0.01])
def test_a_request_that_waits_for_gpu_blocks_loads_its_prefetched_shared_hit_by_hand(shared_gbps):
    """One instance puts a prefix into the shared tier; on another, a request that waits for GPU blocks has it
    prefetched from its first failed scheduling attempt, then loads it as a CPU hit whose load side starts
    once the prefetch landed: TTFT = wait + max(0, prefetch end - start) + load + the rest's compute."""
    from kvkit.backends.blockstore.memory import MemoryStore

    store = MemoryStore()
    cost = CostModel(prefill_tokens_per_s=1000, pcie_gbps=1.0, decode_ms_per_token=1.0, shared_gbps=shared_gbps)
    config = SimConfig(gpu_blocks=8, cpu_blocks=64, block_size=4, cost=cost, planner="load-all", shared=store)
    first = Simulator(config)
    first.feed(TraceRequest(0, 21, 1, (1, 2, 3, 4, 5, 6), 1, 4))
    for i in range(1, 4):  # later requests' steps store it, then put it
        first.feed(TraceRequest(1e6 * i, 4, 1, (100 + i,), 1 + i, 4))
    assert first.stack.stats.blocks_put.value >= 5
    first.close()
    other = Simulator(config)
    other.feed(TraceRequest(0, 28, 100, (11, 12, 13, 14, 15, 16, 17), 1, 4))  # 7 of 8 GPU blocks until 128 ms
    other.feed(TraceRequest(1, 21, 1, (1, 2, 3, 4, 5, 6), 2, 4))  # 6 blocks: waits from 1 to 128 ms
    r = other.close()
    block = config.spec.bytes_per_block
    prefetch_ms, load_ms = 5 * block / (shared_gbps * 1e6), 5 * block / 1e6
    assert r.stats["blocks_prefetched"] == 5 and r.shared_hit_tokens == 20 and r.queued_requests == 1
    assert r.ttft_ms[1] == pytest.approx(127 + max(0.0, 1 + prefetch_ms - 128) + load_ms + 1)
