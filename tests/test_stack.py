"""Tests of ``kvkit.build`` and the reference engine loop on CPU tensors."""

import contextlib
import re
import signal
import threading
import time
from collections.abc import Iterator

import pytest

import kvkit
from kvkit.errors import ConfigError, RequestStateError, TransferTimeoutError, UnknownRequestError
from kvkit.hashing import hash_blocks
from kvkit.interfaces import OffloadCallback
from kvkit.reference.engine import ReferenceEngine
from kvkit.testing.forked import in_child
from kvkit.worker.layouts import allocate_kv

SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16")


class Recorder(OffloadCallback):
    """Counts every hook call by name."""

    def __init__(self):
        self.calls = {}

    def __getattribute__(self, name):
        if name.startswith("on_"):
            calls = object.__getattribute__(self, "calls")
            return lambda *a, **k: calls.__setitem__(name, calls.get(name, 0) + 1)
        return object.__getattribute__(self, name)


def conversation(engine, turns, *, thrash=True):
    """Run a multi-turn conversation; returns (gpu_hit, cpu_hit) tokens per turn."""
    prefix, hits = list(range(30)), []
    for turn in range(turns):
        tokens = prefix + [1000 + 10 * turn + i for i in range(5)]
        engine.add_request(f"t{turn}", hash_blocks(tokens, SPEC.block_size), len(tokens))
        req = engine.step().scheduled[0]
        hits.append((req.gpu_hit_tokens, req.cpu_hit_tokens))
        engine.finish(f"t{turn}")
        engine.step()
        if thrash:  # push the conversation out of the small GPU tier
            junk = hash_blocks([5000 + 100 * turn + i for i in range(44)], SPEC.block_size)
            engine.add_request(f"j{turn}", junk, 44)
            engine.step()
            engine.finish(f"j{turn}")
            engine.step()
        prefix = tokens
    return hits


@pytest.mark.parametrize("layout", [None, "per-layer", "blocks-first", "cross-layer", "vllm-cpu"])
def test_built_stack_serves_earlier_turns_from_the_cpu_tier(layout):
    """Once the GPU tier forgot a conversation, its next turn hits the CPU tier, with intact bytes."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=64, layout=layout, device="cpu")
    engine = ReferenceEngine(stack)
    hits = conversation(engine, 4)
    assert hits[0] == (0, 0)
    assert all(cpu > 0 and gpu == 0 for gpu, cpu in hits[1:]), hits
    engine.drain()
    stack.check_invariants()
    assert engine.integrity_errors == 0
    assert engine.leaked_blocks() == 0
    assert stack.moves_bytes == (layout is not None)


@pytest.mark.parametrize(("layout", "cpu_layout"), [
    ("per-layer", "cross-layer"), ("blocks-first", "cross-layer"), ("cross-layer", "per-layer"),
    ("per-layer", "blocks-first")])
def test_cpu_tier_in_another_layout_serves_intact_bytes(layout, cpu_layout):
    """A CPU mirror laid out unlike the GPU tier (cpu_layout slot) still serves later turns byte for byte."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=64, layout=layout, cpu_layout=cpu_layout, device="cpu")
    [worker] = stack.workers
    assert (worker.layout, worker.cpu_layout) == (layout, cpu_layout)
    engine = ReferenceEngine(stack)
    hits = conversation(engine, 4)
    assert all(cpu > 0 and gpu == 0 for gpu, cpu in hits[1:]), hits
    engine.drain()
    stack.check_invariants()
    assert engine.integrity_errors == 0 and engine.leaked_blocks() == 0


def test_build_refuses_cpu_layouts_that_cannot_apply():
    """cpu_layout without a layout, or paired with vllm-cpu, is a ConfigError naming the layouts."""
    with pytest.raises(ConfigError, match=r"cpu_layout='cross-layer'.*scheduler-only"):
        kvkit.build(kv=SPEC, gpu_blocks=8, cpu_blocks=8, cpu_layout="cross-layer", device="cpu")
    with pytest.raises(ConfigError, match="GPU layout 'vllm-cpu' with CPU layout 'per-layer'"):
        kvkit.build(kv=SPEC, gpu_blocks=8, cpu_blocks=8, layout="vllm-cpu", cpu_layout="per-layer", device="cpu")


def test_corrupted_cpu_tier_is_detected():
    """Bytes changed in the CPU mirror show up as integrity errors when loaded."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=64, layout="per-layer", device="cpu")
    engine = ReferenceEngine(stack)
    conversation(engine, 1)
    engine.drain()
    for t in stack.workers[0].cpu_kv:
        t.add_(1)
    conversation_hits = conversation(engine, 2)
    assert conversation_hits[0][1] > 0
    assert engine.integrity_errors > 0


def test_without_offload_nothing_is_served_from_cpu():
    """With the `never` store policy the CPU tier stays empty, so later turns recompute."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=64, store="never")
    hits = conversation(ReferenceEngine(stack), 3)
    assert all(cpu == 0 for _, cpu in hits)


def test_gpu_prefix_cache_hits_when_the_conversation_stays_resident():
    """A roomy GPU tier serves the shared prefix itself; the CPU tier adds nothing."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=64, cpu_blocks=64)
    hits = conversation(ReferenceEngine(stack), 3, thrash=False)
    assert hits[1][0] > 0 and hits[1][1] == 0


def test_callbacks_see_every_event():
    """Lookups, transfers, evictions and finishes reach the callbacks."""
    rec = Recorder()
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=8, callbacks=[rec])
    conversation(ReferenceEngine(stack), 4)
    for hook in ("on_lookup", "on_transfer_submitted", "on_transfer_completed", "on_evict",
                 "on_request_finished"):
        assert rec.calls.get(hook, 0) > 0, (hook, rec.calls)


def test_build_accepts_instances_and_reports_every_bad_slot_at_once():
    """Names and instances mix; bad slots all appear in one ConfigError quoting them."""
    from kvkit.backends.eviction.fifo import FIFOPolicy
    from kvkit.backends.store.eager import EagerStore

    stack = kvkit.build(kv=SPEC, gpu_blocks=8, cpu_bytes=SPEC.bytes_per_block * 5,
                        cpu_eviction=FIFOPolicy(), store=EagerStore())
    assert stack.cpu.num_blocks == 5
    with pytest.raises(ConfigError) as err:
        kvkit.build(kv=SPEC, gpu_blocks=0, cpu_blocks=8, cpu_eviction="lruu", store=object())
    text = str(err.value)
    assert "gpu_blocks" in text and "'lruu'" in text and "store" in text


def test_build_names_an_unknown_slot_with_the_valid_ones():
    """A misspelt slot is one ConfigError with a did-you-mean and the valid slots, beside every other problem."""
    with pytest.raises(ConfigError) as err:
        kvkit.build(kv=SPEC, gpu_blcks=3, cpu_blocks=8, cpu_eviction="lruu")
    problems = err.value.problems
    assert "did you mean 'gpu_blocks'?" in problems[0] and "valid: kv, gpu_blocks, cpu_blocks" in problems[0]
    assert any("gpu_blocks=None" in p for p in problems) and any("'lruu'" in p for p in problems)


def test_build_rejects_mixed_config_and_slots_and_bad_kv_usage():
    """A config plus keyword slots, or kv_tensors without a layout, is a ConfigError."""
    config = kvkit.StackConfig(kv=SPEC, gpu_blocks=8, cpu_blocks=8)
    with pytest.raises(ConfigError, match="not both"):
        kvkit.build(config, gpu_blocks=4)
    with pytest.raises(ConfigError, match="kv_tensors needs layout"):
        kvkit.build(config, kv_tensors=[])


def test_engine_errors_are_typed():
    """Unknown ids, duplicates and preempting a waiting request raise typed errors quoting the id."""
    engine = ReferenceEngine(kvkit.build(kv=SPEC, gpu_blocks=8, cpu_blocks=8))
    engine.add_request("a", [], 3)
    with pytest.raises(RequestStateError, match="'a'"):
        engine.add_request("a", [], 3)
    with pytest.raises(RequestStateError, match="'a'"):
        engine.preempt("a")
    with pytest.raises(UnknownRequestError, match="'zz'"):
        engine.finish("zz")


def test_request_larger_than_the_gpu_pool_is_rejected():
    """A prompt that can never fit the GPU pool is an OutOfBlocksError quoting it, not a stall."""
    engine = ReferenceEngine(kvkit.build(kv=SPEC, gpu_blocks=4, cpu_blocks=8))
    with pytest.raises(kvkit.errors.OutOfBlocksError, match=r"'big'.*17 tokens"):
        engine.add_request("big", [], 17)


def _spy_allocator(built):
    """An allocator factory that records every pool it builds (the built-in pool underneath)."""
    from kvkit.backends.allocator.pool import BlockPool

    def factory(**kwargs):
        built.append(kwargs["num_blocks"])
        return BlockPool(**kwargs)

    return factory


@pytest.mark.parametrize(("make", "pattern"), [
    (lambda: allocate_kv(SPEC, "per-layer", 15), r"cache holds 15 blocks .*needs at least 16"),
    (lambda: [t.numpy() for t in allocate_kv(SPEC, "per-layer", 16)], r"tensor 0 must be a torch.Tensor, got ndarray"),
    (lambda: [t.to("meta") for t in allocate_kv(SPEC, "per-layer", 16)], r"no plain memory.*device meta"),
    (lambda: [allocate_kv(SPEC, "per-layer", 16)[0]] * 2, r"tensors 0 and 1 overlap in memory"),
    (lambda: allocate_kv(SPEC, "per-layer", 16)[0], r"hint: wrap one tensor in a list"),
])
def test_build_refuses_bad_kv_tensors_before_building_anything(make, pattern):
    """kv_tensors that cannot serve gpu_blocks (too few blocks, not tensors, meta, aliasing) build nothing."""
    built = []
    with pytest.raises(kvkit.errors.SpecMismatchError, match=pattern):
        kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=8, layout="per-layer", kv_tensors=make(), device="cpu",
                    allocator=_spy_allocator(built))
    assert built == []


def test_kv_tensors_with_more_blocks_than_the_pool_serve_it():
    """A cache larger than gpu_blocks is accepted: the pool never hands out the extra block ids."""
    tensors = allocate_kv(SPEC, "per-layer", 20)
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=64, layout="per-layer", kv_tensors=tensors, device="cpu")
    engine = ReferenceEngine(stack)
    hits = conversation(engine, 3)
    assert all(cpu > 0 for _, cpu in hits[1:]) and engine.integrity_errors == 0
    assert stack.workers[0].gpu_kv[0] is tensors[0]


@pytest.mark.parametrize(("slots", "needle"), [
    (dict(gpu_blocks=10**12, cpu_blocks=8), "gpu_blocks=1000000000000"),
    (dict(gpu_blocks=8, cpu_bytes="1000TiB"), "from cpu_bytes='1000TiB'"),
    (dict(gpu_blocks=8, cpu_bytes="1000TiB", layout="per-layer"), "1 CPU mirror of 4294967296000 blocks"),
    (dict(gpu_blocks=10**11, cpu_blocks=8, layout="blocks-first"), "1 GPU tier of gpu_blocks=100000000000"),
])
def test_build_refuses_sizes_no_machine_holds_before_allocating(slots, needle):
    """Pools, mirrors or GPU tiers beyond host memory: InsufficientMemoryError naming the size; nothing built."""
    built = []
    start = time.monotonic()
    with pytest.raises(kvkit.errors.InsufficientMemoryError, match=re.escape(needle)) as err:
        kvkit.build(kv=SPEC, device="cpu", allocator=_spy_allocator(built), **slots)
    assert isinstance(err.value, MemoryError) and "nothing was allocated" in str(err.value)
    assert built == [] and time.monotonic() - start < 5


def test_build_adds_up_every_workers_mirror(monkeypatch):
    """Each mirror fits alone, four do not: the stack is refused before its first worker allocates."""
    from kvkit.worker import memory

    per_worker = 64 * SPEC.bytes_per_block + 8 * SPEC.bytes_per_block
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2 * per_worker + 72 * 100)
    kvkit.build(kv=SPEC, gpu_blocks=8, cpu_blocks=64, layout="per-layer", device="cpu", world_size=2)
    built = []
    with pytest.raises(kvkit.errors.InsufficientMemoryError, match=r"4 CPU mirrors of 64 blocks"):
        kvkit.build(kv=SPEC, gpu_blocks=8, cpu_blocks=64, layout="per-layer", device="cpu", world_size=4,
                    allocator=_spy_allocator(built))
    assert built == []


def test_a_stack_prints_as_its_parts_and_sizes_and_no_secret():
    """print(stack) is one short line naming the components and sizes: no private field, no secret."""
    import attrs

    stack = kvkit.build(kv=SPEC, gpu_blocks=1, cpu_blocks=2048, copy="torch", layout="per-layer", device="cpu",
                        shared={"url": "memory://", "secret": b"hmac-key-never-shown"})
    text = repr(stack)
    assert str(stack) == text and "\n" not in text and len(text) < 300, text
    assert text.startswith("OffloadStack(kv=2 layers x 1 KV head x 8 dims (float16), 4 tokens a block, ")
    for part in ("gpu=1 block (lru)", "cpu=2,048 blocks (hit-density)", "store=eager", "copy=torch", "workers=1",
                 "shared=memory://"):
        assert part in text, (part, text)
    for private in ("hmac-key-never-shown", "config=", "manager=", "_", "BlockPool(", "TransferEngine("):
        assert private not in text.replace("hit-density", ""), (private, text)
    served = attrs.evolve(stack, config=attrs.evolve(stack.config, shared="valkey://alice:hunter2@10.0.0.1:6379/0"))
    assert "shared=valkey://alice:***@10.0.0.1:6379/0" in repr(served) and "hunter2" not in repr(served)
    assert "hunter2" not in repr(served.config) and "alice:***@10.0.0.1" in repr(served.config.shared)
    stack.close()


@pytest.mark.parametrize(("url", "shown"), [
    ("valkey://alice:hunter2@10.0.0.1:6379/0", "valkey://alice:***@10.0.0.1:6379/0"),
    ("redis://hunter2@h/1", "redis://***@h/1"),
    ("valkeys+cluster://:hunter2@a:1,b:2?tls_ca=/ca.pem&password=hunter2&ttl_s=3",
     "valkeys+cluster://:***@a:1,b:2?tls_ca=/ca.pem&password=***&ttl_s=3"),
    ("file:///srv/a@b/kv?capacity_bytes=1GiB", "file:///srv/a@b/kv?capacity_bytes=1GiB"),
    ("memory://", "memory://"),
])
def test_a_store_url_is_shown_without_its_password(url, shown):
    from kvkit.redact import redact_url

    assert redact_url(url) == shown


@contextlib.contextmanager
def _step_held_elsewhere(stack: kvkit.OffloadStack) -> Iterator[None]:
    """Another thread holds ``stack``'s drive lock (a step in progress) until the block ends."""
    stepping, done = threading.Event(), threading.Event()

    def step():
        with stack.driving():
            stepping.set()
            done.wait(10)

    holder = threading.Thread(target=step)
    holder.start()
    assert stepping.wait(10)
    try:
        yield
    finally:
        done.set()
        holder.join(10)


def test_close_waits_at_most_its_timeout_for_a_step_another_thread_holds():
    """A step held past ``close(timeout)``: TransferTimeoutError, nothing closed, no step starts any more;
    once it ended, close() closes. close() inside a step of its own thread closes at once; that step's later
    calls are refused."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=64, layout="per-layer", device="cpu")
    with pytest.raises(ConfigError, match=r"timeout.*-1"):
        stack.close(timeout=-1)
    stack.manager.build_step()  # a refused close changed nothing
    with _step_held_elsewhere(stack):
        with pytest.raises(TransferTimeoutError, match="nothing was closed"):
            stack.close(timeout=0.05)
        assert stack.workers[0].layout == "per-layer"  # still registered
    with pytest.raises(RequestStateError, match="the stack is closed"):
        stack.manager.build_step()
    stack.close()
    assert stack.workers[0].layout is None

    inner = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=64, device="cpu")
    with inner.driving():
        inner.close(timeout=0.0)
        with pytest.raises(RequestStateError, match="the stack is closed"):
            inner.manager.build_step()  # the rest of the step that closed it
    with pytest.raises(RequestStateError, match="the stack is closed"):
        ReferenceEngine(inner).step()


def test_a_child_forked_while_another_thread_stepped_can_drive_its_copy():
    """Fork while another thread holds the stack's drive lock: the child's own calls are not blocked forever."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=64, device="cpu")

    def child() -> str:  # killed by the alarm if the call blocks
        signal.alarm(10)
        stack.manager.build_step()
        return "stepped"

    with _step_held_elsewhere(stack):
        assert in_child(child)() == "stepped"


def test_a_step_running_when_another_thread_closes_runs_to_its_end():
    """The calls a step makes after another thread's close() began, before close() could hold the drive lock, run."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=64, layout="per-layer", device="cpu")
    stepping, errors, planned = threading.Event(), [], []

    def step():
        try:
            with stack.driving():
                stepping.set()
                deadline = time.monotonic() + 10
                while not stack.driving().closed and time.monotonic() < deadline:
                    time.sleep(0.001)
                planned.append(stack.manager.build_step())
                planned.append(stack.manager.apply_completions([]))
        except Exception as exc:  # noqa: BLE001 - the test reports what the stepping thread met
            errors.append(exc)

    stepper = threading.Thread(target=step)
    stepper.start()
    assert stepping.wait(10)
    stack.close()
    stepper.join(10)
    assert errors == [] and len(planned) == 2
    assert stack.workers[0].layout is None
