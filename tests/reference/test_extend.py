"""A running request extended by decoded tokens: its new full blocks are cached and stored like a prompt's."""

from __future__ import annotations

import pytest

import kvkit
from kvkit.errors import OutOfBlocksError, RequestStateError
from kvkit.hashing import hash_blocks
from kvkit.reference.engine import ReferenceEngine, SyntheticCompute

SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float16")
TOKENS = list(range(100, 114))  # 14 tokens: 3 full blocks and a partial one


def _engine(gpu_blocks: int = 12) -> ReferenceEngine:
    return ReferenceEngine(kvkit.build(kv=SPEC, gpu_blocks=gpu_blocks, cpu_blocks=12, layout="per-layer",
                                       device="cpu"))


def _prefilled(engine: ReferenceEngine, rid: str, num_tokens: int) -> None:
    engine.add_request(rid, hash_blocks(TOKENS[:num_tokens], SPEC.block_size), num_tokens)
    (req,) = engine.step().scheduled
    assert req.request_id == rid


def _write(engine: ReferenceEngine, calls: list[int]):
    def write(req, start):  # the synthetic KV of every block from the one holding token ``start``
        calls.append(start)
        SyntheticCompute._write(engine, req, start // SPEC.block_size)
    return write


def test_decoded_blocks_are_published_stored_and_served_to_a_longer_prompt():
    """6 prompt tokens grown to 13: blocks 1-2 fill, the GPU tier serves them and, once cleared, the CPU tier
    loads them with the bytes written for their hashes (the engine's compute checks every loaded byte)."""
    engine, calls = _engine(), []
    _prefilled(engine, "a", 6)
    hashes = hash_blocks(TOKENS[:13], SPEC.block_size)
    engine.extend("a", hashes[1:], 13, _write(engine, calls))
    assert calls == [6] and len(engine.running[0].table[0]) == 4
    assert engine.stack.gpu.lookup(hashes) == engine.running[0].table[0][:3]
    engine.finish("a")
    engine.step()
    engine.drain()
    assert engine.stack.stats.blocks_stored.value == 3
    engine.stack.gpu.reset()
    _prefilled(engine, "b", 14)
    engine.drain()
    assert engine.integrity_errors == 0 and engine.stack.stats.cpu_hit_tokens.value == 12
    engine.finish("b")
    engine.step()
    engine.drain()
    assert engine.leaked_blocks() == 0
    engine.stack.check_invariants()


def test_an_extension_that_is_wrong_or_does_not_fit_changes_nothing():
    """A waiting or unknown request, hashes that are not the new full blocks', or too few free GPU blocks:
    a typed error, and the request's table, hashes and the pool are as they were."""
    engine, calls = _engine(gpu_blocks=3), []
    _prefilled(engine, "a", 6)
    engine.add_request("waiting", [], 2)
    hashes = hash_blocks(TOKENS[:13], SPEC.block_size)
    with pytest.raises(RequestStateError, match="'waiting' is not running"):
        engine.extend("waiting", [], 3, _write(engine, calls))
    with pytest.raises(RequestStateError, match="num_tokens=13 with 1 new hash"):
        engine.extend("a", hashes[1:2], 13, _write(engine, calls))
    with pytest.raises(RequestStateError, match="num_tokens=5"):
        engine.extend("a", [], 5, _write(engine, calls))
    (req,) = engine.running
    before = ([list(row) for row in req.table], list(req.block_hashes), engine.stack.gpu.num_free)
    with pytest.raises(OutOfBlocksError, match="needs 2 more GPU blocks for 13 tokens"):
        engine.extend("a", hashes[1:], 13, _write(engine, calls))
    assert ([list(row) for row in req.table], list(req.block_hashes), engine.stack.gpu.num_free) == before
    assert calls == []
    engine.abort("waiting")
    engine.finish("a")
    engine.step()
    engine.drain()
    assert engine.leaked_blocks() == 0
