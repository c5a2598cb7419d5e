"""The reference engine carries load plans out: a head recomputed while the tail loads, declined ends, failures.

Properties (Hypothesis, random plans and fault schedules): every block of a
scheduled request is reused from the GPU, computed as the head, loaded, or
computed after the hit, exactly once; a load that failed is recomputed; no
reused block ever holds a wrong byte (``SyntheticCompute`` checks each one).
"""

from __future__ import annotations

import random
import threading
import time

import attrs
import hypothesis.strategies as st
from hypothesis import given, settings

import kvkit
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.hashing import hash_blocks
from kvkit.interfaces import LoadPlanner
from kvkit.interfaces.plan import HitQuery, LoadPlan
from kvkit.reference.engine import ReferenceEngine, SyntheticCompute
from kvkit.testing.doubles import FailingStore

SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float16")


@attrs.define(eq=False)
class RandomPlanner(LoadPlanner):
    """Answers a random valid plan for each hit (head, tail, declined end)."""

    rng: random.Random

    def plan(self, query: HitQuery) -> LoadPlan:
        h = query.hit_blocks
        e = self.rng.randint(0, h)
        k = self.rng.randint(0, e) if query.overlap else 0
        return LoadPlan(k, e - k, h)

    def estimate_ms(self, query, plan):
        return None

    def observe_move(self, source, num_bytes, seconds):
        return None

    def observe_compute(self, num_tokens, context_tokens, seconds, *, beside_loads=False):
        return None

    def estimates(self):
        return {}


@attrs.define(eq=False)
class RecordingCompute(SyntheticCompute):
    """Synthetic compute that records which block positions each call wrote, per request."""

    written: dict[str, list[int]] = attrs.field(factory=dict)

    def prefill_head(self, engine, request, start, stop):
        self.written.setdefault(request.request_id, []).extend(range(start, stop))
        super().prefill_head(engine, request, start, stop)

    def prefill(self, engine, request, first_block):
        n = len(request.table[0])
        self.written.setdefault(request.request_id, []).extend(range(first_block, n))
        return super().prefill(engine, request, first_block)


@attrs.define(eq=False)
class _FlakyStore(FailingStore):
    """A failing store that can also answer ``contains`` truly while every ``get`` fails (a fetch lost in flight)."""

    gets_fail: bool = False

    def get(self, keys, buffers):
        return self._fail(keys) if self.gets_fail else super().get(keys, buffers)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shared=st.booleans(),
       turns=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.sampled_from(["up", "down", "gets fail"]),
                                st.booleans()), min_size=1, max_size=12))
def test_every_block_is_reused_loaded_or_computed_exactly_once(seed, shared, turns):
    """Random plans, random shared-tier outages and lost fetches, cleared GPU caches: the accounting and the
    bytes hold, and a failed load is recomputed. Two instances take turns, so the shared tier serves hits."""
    server = MemoryStore() if shared else None
    store = _FlakyStore(server) if shared else None
    rng = random.Random(seed)
    stacks = [kvkit.build(kv=SPEC, gpu_blocks=24, cpu_blocks=12, layout="per-layer", device="cpu",
                          planner=RandomPlanner(rng),
                          shared=None if store is None else {"url": store, "backoff_s": 1e-3}) for _ in range(2)]
    engines = [ReferenceEngine(stack, compute=RecordingCompute()) for stack in stacks]
    assert all(engine.overlaps for engine in engines)
    prefixes = [list(range(100 * p, 100 * p + 40)) for p in range(4)]
    bs = SPEC.block_size
    try:
        for i, (prefix, extra, fault, forget) in enumerate(turns):
            engine, stack = engines[i % 2], stacks[i % 2]
            tokens = prefixes[prefix][: 40 - extra % 8] + [1000 * i + j for j in range(extra)]
            rid = f"r{i}"
            engine.add_request(rid, hash_blocks(tokens, bs), len(tokens))
            if store is not None:
                store.down, store.gets_fail = fault == "down", fault == "gets fail"
            failed_before = stack.stats.loads_failed.value
            (req,) = engine.step().scheduled
            assert engine.integrity_errors == 0
            gpu = req.gpu_hit_tokens // bs
            loaded = range(gpu + req.head_tokens // bs, gpu + (req.head_tokens + req.cpu_hit_tokens) // bs)
            written = engine.compute.written.pop(rid)
            reused = list(range(gpu)) + list(loaded)
            assert sorted(written + reused) == list(range(len(req.table[0]))), (written, reused)
            if stack.stats.loads_failed.value > failed_before:
                assert req.cpu_hit_tokens == 0  # the failed tail was recomputed
            engine.finish(rid)
            for _ in range(3):  # stores, then puts into the shared tier, then their results
                engine.step()
                engine.drain()
            stack.check_invariants()
            if forget:  # the next turns find their prefix on the CPU or shared tier only
                engine.drain()
                stack.gpu.decref(stack.gpu.allocate(stack.gpu.num_free))
        if store is not None:
            store.down = store.gets_fail = False
        for engine, stack in zip(engines, stacks):
            engine.step()
            engine.drain()
            assert engine.integrity_errors == 0 and engine.leaked_blocks() == 0
            stack.check_invariants()
    finally:
        for stack in stacks:
            stack.close()


class _SlowStore(MemoryStore):
    """A memory store whose fetches take ``delay`` seconds, answered on a timer (a slow link)."""

    delay: float = 0.3

    def get(self, keys, buffers):
        self.fetch_started = time.perf_counter()
        time.sleep(self.delay)
        self.fetch_done = time.perf_counter()
        return super().get(keys, buffers)


@attrs.define(eq=False)
class _TimedCompute(SyntheticCompute):
    head_done: float = 0.0
    head_thread: str = ""

    def prefill_head(self, engine, request, start, stop):
        self.head_thread = threading.current_thread().name
        super().prefill_head(engine, request, start, stop)
        self.head_done = time.perf_counter()


def test_the_head_is_computed_while_the_tail_is_fetched():
    """A hit split into a head and a tail: the head's compute runs during the tail's fetch, not after it."""
    store = _SlowStore()
    plan = LoadPlan(3, 5, 8)

    class Fixed(RandomPlanner):
        def plan(self, query):
            return plan if query.hit_blocks == 8 else LoadPlan.load_all(query.hit_blocks)

    tokens = list(range(8 * SPEC.block_size + 3))
    writer = kvkit.build(kv=SPEC, gpu_blocks=24, cpu_blocks=24, layout="per-layer", device="cpu", shared=store)
    reader = kvkit.build(kv=SPEC, gpu_blocks=24, cpu_blocks=24, layout="per-layer", device="cpu", shared=store,
                         planner=Fixed(random.Random(0)))
    try:
        first = ReferenceEngine(writer)
        first.add_request("a", hash_blocks(tokens, SPEC.block_size), len(tokens))
        first.step()
        first.finish("a")
        first.step()
        first.step()
        first.drain()
        compute = _TimedCompute()
        second = ReferenceEngine(reader, compute=compute)
        second.add_request("b", hash_blocks(tokens, SPEC.block_size), len(tokens))
        (req,) = second.step().scheduled
        assert (req.head_tokens, req.cpu_hit_tokens) == (3 * SPEC.block_size, 5 * SPEC.block_size)
        assert compute.head_done < store.fetch_done  # the head did not wait for the fetch
        assert compute.head_thread == threading.main_thread().name
        assert second.integrity_errors == 0 and reader.stats.hit_tokens_overlapped.value == 3 * SPEC.block_size
        assert reader.stats.shared_hit_tokens.value == 5 * SPEC.block_size
    finally:
        writer.close()
        reader.close()
