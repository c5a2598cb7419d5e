"""No write after release: a transfer whose backend failed keeps its blocks until the backend confirmed its copy."""

import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvkit
from kvkit.errors import TransferTimeoutError
from kvkit.hashing import hash_blocks
from kvkit.interfaces import Direction, TransferPlan, TransferResult
from kvkit.reference.engine import ReferenceEngine
from kvkit.testing import ThreadedCopy
from kvkit.testing.kvdata import fill_random
from kvkit.worker.engine import TransferEngine

SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16")


class FailAllAtOnce(TransferEngine):
    """The planted bug (the old behaviour): a failing poll reports every transfer in flight failed at once."""

    def _suspect(self, exc):
        self._ready += [TransferResult(job.transfer_id, self.worker, ok=False) for job in self._in_flight.values()]
        self._in_flight.clear()


def _touches(plan):
    """``(written, read)``: the ``(tier, block)`` pairs a plan's copy writes and reads."""
    src, dst = ("gpu", "cpu") if plan.direction is Direction.STORE else ("cpu", "gpu")
    return {(dst, b) for b in plan.dst.tolist()}, {(src, b) for b in plan.src.tolist()}


def early_reuses(backend):
    """Pairs ``(x, y)``: ``y``, submitted before the earlier ``x`` landed, touches what ``x`` writes (or vice versa)."""
    order = {event: i for i, event in enumerate(backend.log)}
    found = []
    for x, plan in enumerate(backend.plans):
        written, read = _touches(plan)
        landed = order.get(("land", x), len(order))
        for y in range(x + 1, len(backend.plans)):
            if order[("submit", y)] < landed:
                y_written, y_read = _touches(backend.plans[y])
                if written & (y_written | y_read) or read & y_written:
                    found.append((x, y))
    return found


def _stack(engine_cls, backend, gpu_blocks=16, cpu_blocks=32):
    """A stack whose one worker is an ``engine_cls`` on ``backend`` (host memory)."""
    stack = kvkit.build(kv=SPEC, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks, copy=None, device="cpu")
    worker = engine_cls(SPEC, backend, num_cpu_blocks=cpu_blocks)
    worker.allocate_kv(gpu_blocks, "per-layer")
    stack.workers.append(worker)
    return stack, ReferenceEngine(stack)


def _serve(engine, name, tokens):
    """Prefill ``tokens`` as one request, finish it and run the step that submits its flush stores."""
    engine.add_request(name, hash_blocks(tokens, SPEC.block_size), len(tokens))
    [req] = engine.step().scheduled
    engine.finish(name)
    engine.step()
    return req


def _late_copy(engine_cls):
    """A's store is held on the pool, the backend's poll fails, B is stored, A lands late, C loads B's prefix."""
    backend = ThreadedCopy()
    stack, engine = _stack(engine_cls, backend)
    b = list(range(1000, 1017))
    late = backend.hold()
    _serve(engine, "a", list(range(17)))
    backend.gate = None
    backend.poll_error = RuntimeError("device lost")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine.step()
    backend.poll_error = None
    _serve(engine, "b", b)
    assert all(backend.landed(h, timeout=5) for h in range(1, len(backend.plans))), "B's store did not run"
    late.set()
    assert backend.landed(0, timeout=5)
    engine.drain()
    _serve(engine, "junk", list(range(5000, 5061)))  # pushes B out of the GPU tier
    engine.drain()
    c = _serve(engine, "c", [*b[:16], 7777])  # B's four full blocks come from the CPU tier
    engine.drain()
    stack.check_invariants()
    return engine, backend, c, [str(w.message) for w in seen]


def test_a_late_copy_never_lands_in_reused_blocks():
    """A store whose backend failed keeps its CPU blocks until its copy landed: B goes elsewhere, C loads B's bytes."""
    engine, backend, c, warned = _late_copy(TransferEngine)
    assert any("in doubt" in w for w in warned), warned
    assert backend.plans[1].dst.tolist() != backend.plans[0].dst.tolist()
    assert early_reuses(backend) == []
    assert c.cpu_hit_tokens == 16
    assert engine.integrity_errors == 0
    assert engine.leaked_blocks() == 0


def test_the_planted_fail_all_at_once_is_caught():
    """The old behaviour (fail all at once, free the blocks) reuses A's blocks before A landed; C loads wrong bytes."""
    engine, backend, c, _ = _late_copy(FailAllAtOnce)
    assert backend.plans[1].dst.tolist() == backend.plans[0].dst.tolist()
    assert (0, 1) in early_reuses(backend)
    assert c.cpu_hit_tokens == 16
    assert engine.integrity_errors > 0


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["ok", "hold", "fail"])), min_size=1, max_size=8))
def test_conversations_with_failing_polls_and_late_copies_load_only_true_bytes(turns):
    """Held copies and failing polls, mixed: no copy touches blocks one in flight writes; no loaded byte is wrong.

    A turn's fault hits the step that submits its stores. Its prefill step runs
    fault-free: the step waits for its loads before computing, so a load held
    for good or behind polls that keep failing can only end in the (correct)
    TransferTimeoutError.
    """
    backend = ThreadedCopy()
    stack, engine = _stack(TransferEngine, backend, gpu_blocks=24, cpu_blocks=12)
    gates = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, (conversation, fault) in enumerate(turns):
            backend.gate = backend.poll_error = None
            tokens = list(range(100 * conversation, 100 * conversation + 9 + 4 * i))
            engine.add_request(f"r{i}", hash_blocks(tokens, SPEC.block_size), len(tokens))
            engine.step()
            if fault == "hold":
                gates.append(backend.hold())
            backend.poll_error = RuntimeError("device lost") if fault == "fail" else None
            engine.finish(f"r{i}")
            engine.step()
            stack.check_invariants()
        backend.poll_error = backend.gate = None
        for gate in gates:
            gate.set()
        engine.step()
        engine.drain()
    stack.check_invariants()
    assert early_reuses(backend) == []
    assert engine.integrity_errors == 0
    assert engine.leaked_blocks() == 0


@pytest.fixture
def held():
    """An engine on a ThreadedCopy whose copies wait for ``gate``; the gate opens at teardown."""
    backend = ThreadedCopy()
    engine = TransferEngine(SPEC, backend, num_cpu_blocks=4)
    fill_random(engine.allocate_kv(4, "per-layer"), seed=4)
    gate = backend.hold()
    yield engine, backend, gate
    gate.set()


def test_transfers_in_doubt_are_reported_failed_once_the_backend_confirms_them(held):
    """In doubt after a failed poll, a transfer stays in flight (one warning) until a poll confirms it, ok=False."""
    engine, backend, gate = held
    engine.submit(1, TransferPlan([0, 1], [0, 1], "store"))
    backend.gate = None
    backend.poll_error = RuntimeError("device lost")
    with pytest.warns(RuntimeWarning, match=r"in doubt now: 1 transfer in flight \[1\]"):
        assert engine.poll() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same transfer is not warned about twice
        assert engine.poll() == []
    backend.poll_error = None
    engine.submit(2, TransferPlan([2], [2], "store"))  # after the failure: not in doubt
    assert engine.poll() == [] and (engine.num_in_flight, engine.num_in_doubt) == (2, 1)
    engine.check_invariants()
    gate.set()
    assert [(r.transfer_id, r.ok) for r in engine.drain()] == [(1, False), (2, True)]
    assert engine.num_in_flight == 0
    engine.check_invariants()


def test_a_backend_that_never_recovers_keeps_its_transfers_in_flight(held):
    """While every poll raises, nothing is reported: a drain times out naming the transfers in doubt."""
    engine, backend, gate = held
    engine.submit(3, TransferPlan([0], [0], "load"))
    backend.poll_error = RuntimeError("device lost")
    gate.set()
    assert backend.landed(0, timeout=5)
    with pytest.warns(RuntimeWarning, match="in doubt"), \
            pytest.raises(TransferTimeoutError, match=r"1 in doubt since the copy backend failed.*\[3\]") as err:
        engine.drain(timeout=0.05)
    assert err.value.pending == (3,) and engine.num_in_flight == 1
    engine.check_invariants()
    backend.poll_error = None
    assert engine.drain() == [TransferResult(3, 0, ok=False)]
