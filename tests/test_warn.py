"""kvkit's warnings name the caller's line, whatever the path through kvkit took (``kvkit.warn``)."""

from __future__ import annotations

import warnings

import pytest

import kvkit
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.config import SharedConfig
from kvkit.hashing import hash_blocks
from kvkit.interfaces import OffloadCallback
from kvkit.reference.engine import ReferenceEngine
from kvkit.testing.doubles import FailingStore

SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
HOOKS = ("on_lookup", "on_transfer_submitted", "on_transfer_completed", "on_cpu_stored", "on_evict",
         "on_request_finished", "on_reset")


def _raising(hook: str) -> OffloadCallback:
    def fail(self, *args):
        raise ValueError(f"{hook} is broken")

    return type(f"Broken_{hook}", (OffloadCallback,), {hook: fail})()


def _serve(engine, rid, tokens):
    engine.add_request(rid, hash_blocks(tokens, SPEC.block_size), len(tokens))
    engine.step()
    engine.finish(rid)
    engine.step()
    engine.drain()


def test_a_callbacks_error_is_attributed_to_the_callers_line_on_every_path():
    """A callback that raises is warned about once per hook, reached through ``add_request``, ``step``,
    ``finish``, ``drain`` or a reset at different depths of kvkit: every warning names this file (the line
    that called kvkit), never a frame of kvkit's own."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=8, cpu_blocks=8, copy="torch", device="cpu",
                        callbacks=[_raising(hook) for hook in HOOKS])
    engine = ReferenceEngine(stack)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            _serve(engine, f"r{i}", [100 * i + t for t in range(24)])
        engine.reset_cpu_tier()
    raised = {w.message.args[0].split(" raised")[0].split(".")[-1]: w for w in caught if " raised " in str(w.message)}
    assert set(raised) == set(HOOKS), sorted(raised)
    assert {hook: w.filename for hook, w in raised.items()} == dict.fromkeys(HOOKS, __file__)
    stack.close()


def test_the_shared_tier_turning_off_is_attributed_to_the_callers_line():
    """The tier's outage warning, raised deep inside a step, names the line that called ``step``."""
    store = FailingStore(MemoryStore())
    stack = kvkit.build(kv=SPEC, gpu_blocks=8, cpu_blocks=8, copy="torch", device="cpu",
                        shared=SharedConfig(url=store))
    engine = ReferenceEngine(stack)
    store.down = True
    stack.manager._shared.suspect("a put failed")
    with pytest.warns(RuntimeWarning, match="shared tier is off") as caught:
        engine.step()
    assert [w.filename for w in caught if "shared tier is off" in str(w.message)] == [__file__]
    stack.close()
