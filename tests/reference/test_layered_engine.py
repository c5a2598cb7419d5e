"""The reference engine with layered loads: compute waits per layer, nothing is published before loads land."""

import threading

import pytest

import kvkit
from kvkit.errors import ConfigError
from kvkit.hashing import hash_blocks
from kvkit.reference.engine import ReferenceEngine, SyntheticCompute
from kvkit.testing import ThreadedCopy
from kvkit.testing.kvdata import fill_random

SPEC = kvkit.KVCacheSpec(num_layers=3, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16")


class NoWaitEngine(ReferenceEngine):
    """The planted bug: compute reads reused blocks without waiting for their layers' loads."""

    def wait_layer(self, layer):
        return None


def _turns(engine_type, copy, *, delay_s=0.05, expect_hit=True):
    """Turn 1 of a prompt, the GPU tier emptied, turn 2 loads it from the CPU tier through slow copies."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=8, cpu_blocks=16, copy=copy, layout="per-layer", device="cpu")
    engine = engine_type(stack, compute=SyntheticCompute(), layered=True)
    hashes = hash_blocks(list(range(6 * 4)), 4)
    engine.add_request("a", hashes, 6 * 4)
    engine.step()
    engine.finish("a")
    engine.step()  # plans the finish flush
    engine.drain()
    stack.gpu.reset()
    fill_random(stack.workers[0].gpu_kv, seed=5)  # whatever turn 1 left there is not the load's bytes
    gate = copy.hold()  # turn 2's load lands only after delay_s
    threading.Timer(delay_s, gate.set).start()
    engine.add_request("b", hashes + hash_blocks(list(range(100, 104)), 4, parent=hashes[-1]), 7 * 4)
    engine.step()
    # Turn 1's whole prompt is a CPU hit, unless its load failed: then it was computed again without it.
    assert engine.running[0].cpu_hit_tokens == (6 * 4 if expect_hit else 0)
    engine.finish("b")
    engine.step()
    engine.drain()
    assert engine.leaked_blocks() == 0
    return engine.integrity_errors


def test_a_layered_step_reads_each_layer_after_its_load():
    """Slow, asynchronous copies: the compute's per-layer waits see only landed bytes."""
    assert _turns(ReferenceEngine, ThreadedCopy(threads=1)) == 0


def test_the_check_fails_when_compute_does_not_wait():
    """Planted bug: compute reading without wait_layer sees blocks before their load landed."""
    assert _turns(NoWaitEngine, ThreadedCopy(threads=1)) > 0


def test_layered_must_be_a_bool():
    """``layered`` is a real bool."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=8, cpu_blocks=16, layout="per-layer", device="cpu")
    with pytest.raises(ConfigError, match="layered='yes'"):
        ReferenceEngine(stack, layered="yes")


class FailingLoads(ThreadedCopy):
    """Loads fail to launch (a ``TransferResult(ok=False)``); stores work."""

    def submit(self, plan, *, after=None):
        if plan.direction.value == "load":
            raise RuntimeError("the copy engine is gone")
        return super().submit(plan, after=after)


def test_a_request_whose_layered_load_failed_is_computed_again_without_its_hit():
    """The failure is known only after compute: the request is recomputed before anything is published."""
    with pytest.warns(RuntimeWarning, match="failed to launch"):
        assert _turns(ReferenceEngine, FailingLoads(threads=1), expect_hit=False) == 0
