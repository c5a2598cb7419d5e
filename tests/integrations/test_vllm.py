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
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import torch

from kvkit.errors import ConfigError
from kvkit.integrations.vllm import KVKitConnector

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


def settle(llm) -> None:
    """Step the engine until no request (nor a delayed free) is left."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    for _ in range(20):
        if not scheduler.has_requests():
            return
        llm.llm_engine.step()
    raise AssertionError("the engine still holds requests after 20 idle steps")


def reset_prefix_cache(llm, *, connector: bool) -> None:
    """``reset_prefix_cache`` once delayed frees drained (in-process engines step only when asked)."""
    for _ in range(20):
        if llm.reset_prefix_cache(reset_connector=connector):
            return
        llm.llm_engine.step()
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
    assert worker.transfer_engine.num_in_flight == 0
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but vLLM's null block


def run_reference(model, workload):
    with engine(model, kvkit=False) as llm:
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
        hits_before = sched.stats.hit_tokens_cpu.value
        cold = replay(llm, prompts, MULTI_TURN["max_tokens"])
        assert cold.outputs == expected
        assert cold.kvkit_loaded_tokens == 0 and cold.vllm_cached_tokens == 0
        assert cold.computed_tokens == cold.prompt_tokens
        assert sched.stats.hit_tokens_cpu.value == hits_before
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
        for layer in worker.transfer_engine.cpu_kv:  # the CPU mirror, vLLM's CPU layout
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
    with pytest.raises(ConfigError) as info, engine(tiny_llama, cpu_bytes="lots", cpu_eviction="lruu",
                                                    store="lazy"):
        pass
    text = str(info.value)
    assert "'lots'" in text and "'lruu'" in text and "did you mean 'lru'" in text
    assert len(info.value.problems) == 2  # a bad capacity and a bad name; 'lazy' is checked once both are valid


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
