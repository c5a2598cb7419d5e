"""Two engine processes sharing one store (disk, Valkey, a Valkey Cluster): the second reuses, byte-identical,
a prefix the first computed."""

import json
import subprocess
import sys
import textwrap

import pytest

from kvkit.registry import SHARED
from kvkit.testing.forked import in_child
from kvkit.testing.servers import LocalCluster, LocalServer, server_binary_or_skip

_ENGINE = textwrap.dedent("""
    import json, sys
    import kvkit
    from kvkit.hashing import hash_blocks
    from kvkit.interfaces import Tier
    from kvkit.reference.engine import ReferenceEngine

    url, role, out = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    stack = kvkit.build(kv=spec, gpu_blocks=16, cpu_blocks=16, copy="torch", device="cpu", layout="per-layer",
                        world_size=2, shared={"url": url, "model": "two-process-test"})
    engine = ReferenceEngine(stack)
    tokens = list(range(100, 140))  # 10 blocks; a hit is at most 9 (one token is recomputed)
    engine.add_request(role, hash_blocks(tokens, 4), len(tokens))
    req = engine.step().scheduled[0]
    prefix = {str(rank): [w.read_block(Tier.GPU, b).hex() for b in req.table[0][:9]]
              for rank, w in enumerate(stack.workers)}
    engine.finish(role)
    for _ in range(3):
        engine.step()
    engine.drain()
    stack.check_invariants()
    stack.close()
    json.dump({"hit": req.cpu_hit_tokens, "shared": stack.stats.shared_hit_tokens.value,
               "put": stack.stats.blocks_put.value, "errors": engine.integrity_errors,
               "invalid": sum(w.invalid_values for w in stack.shared_workers), "prefix": prefix}, open(out, "w"))
""")


def _engine(url: str, role: str, out) -> dict:
    done = subprocess.run([sys.executable, "-c", _ENGINE, url, role, str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


@pytest.fixture(params=["file", "valkey", "valkey-cluster"])
def shared_url(request, tmp_path):
    """A store both processes reach: a directory, a real Valkey server, a real 3-node Cluster."""
    if request.param == "file":
        if "disk" not in SHARED.names():
            pytest.skip("no disk block store in this installation")
        yield f"file://{tmp_path / 'kv'}?capacity_bytes=64MiB"
        return
    binary = server_binary_or_skip()
    with (LocalServer(binary) if request.param == "valkey" else LocalCluster(binary=binary)) as server:
        yield server.url


def test_a_second_process_reuses_the_first_ones_prefix(shared_url, tmp_path):
    """Process 1 computes and puts; process 2 (a fresh interpreter) fetches, loads and checks every byte."""
    url = shared_url
    first = _engine(url, "first", tmp_path / "first.json")
    assert first["hit"] == 0 and first["put"] == 10 and first["errors"] == 0
    second = _engine(url, "second", tmp_path / "second.json")
    assert second["hit"] == second["shared"] == 36 and second["errors"] == 0 and second["invalid"] == 0
    assert second["prefix"] == first["prefix"], "the loaded prefix differs from the bytes the first process computed"


def test_a_stack_built_before_fork_serves_the_forked_child(shared_url):
    """A stack built, used and left with puts in flight, then inherited through ``os.fork`` (multiprocessing's
    workers): the child's engine gets the whole shared hit another stack put, byte-identical, within the deadline
    (a disk store refuses work in the child: no hit), and closes its stack cleanly (every
    ticket open at the fork reported); the parent's stack keeps serving. Before, the child's fetches queued for
    threads it does not have: every hit recomputed after a whole deadline, and its close raised for tickets never
    reported."""
    import time

    import kvkit
    from kvkit.hashing import hash_blocks
    from kvkit.reference.engine import ReferenceEngine

    spec = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")

    def build():
        return kvkit.build(kv=spec, gpu_blocks=16, cpu_blocks=16, copy="torch", device="cpu", layout="per-layer",
                           shared={"url": shared_url, "model": "fork-test"}, wait_timeout_s=2.0)

    def run(stack, name, tokens):
        engine = ReferenceEngine(stack)
        engine.add_request(name, hash_blocks(tokens, 4), len(tokens))
        hit = engine.step().scheduled[0].cpu_hit_tokens
        engine.finish(name)
        for _ in range(3):  # its blocks stored to the CPU tier, then put
            engine.step()
        return engine, hit

    writer, inherited = build(), build()
    engine, _ = run(writer, "writer", list(range(100, 140)))
    engine.drain()
    run(inherited, "own", list(range(500, 540)))  # its puts may still be in flight at the fork
    def child():
        start = time.monotonic()
        engine, hit = run(inherited, "child", list(range(100, 140)))
        took = time.monotonic() - start
        engine.drain()
        inherited.check_invariants()
        inherited.close()
        return {"hit": hit, "errors": engine.integrity_errors, "took": took < 2.0,
                "invalid": inherited.shared_counts["invalid_values"]}

    outcome = in_child(child)()
    assert outcome == {"hit": 0 if shared_url.startswith("file:") else 36, "errors": 0, "took": True, "invalid": 0}
    engine, hit = run(inherited, "parent", list(range(100, 140)))
    engine.drain()
    assert hit == 36 and engine.integrity_errors == 0
    for stack in (writer, inherited):
        stack.check_invariants()
        stack.close()
