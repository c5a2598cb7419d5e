"""The shared tier end to end (``kvkit.build`` + ``ReferenceEngine``) under faults, against real servers:
a slow link, a server that closes idle connections, a server restarted empty, a Cluster with a dead node,
a build refused after the store was opened. Every step is bounded, none raises, every byte is checked."""

from __future__ import annotations

import socket
import threading
import time
import warnings
from unittest import mock

import attrs
import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvkit
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.backends.plan import LoadAllPlanner
from kvkit.config import SharedConfig
from kvkit.errors import InsufficientMemoryError
from kvkit.hashing import hash_blocks
from kvkit.interfaces import LoadPlan, OffloadCallback
from kvkit.manager import OffloadManager
from kvkit.reference.engine import ReferenceEngine
from kvkit.shared.format import HEADER_SIZE
from kvkit.testing.servers import LocalCluster, LocalServer, block_keys, server_binary_or_skip
from kvkit.testing.slowlink import SlowLink

# 4 KiB per block and rank: a 9-block fetch of two ranks is 72 KiB, 9 s at 8 KB/s.
SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=32, dtype="float32")
PROMPT = list(range(40))  # 10 blocks: a shared hit of 9
DEADLINE = 0.5
SLACK = 1.5  # scheduling noise on a busy 2-core machine
FAST = f"?request_timeout_s={DEADLINE}&connect_timeout_s={DEADLINE}&retry_interval_s=0.2"
ROOMY = "?request_timeout_s=5&connect_timeout_s=5&retry_interval_s=0.2"  # for tests of what a value holds, not of time


def instance(shared, *, write="write-through", wait_timeout_s=4.0, clock=None, secret=None):
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=16, copy="torch", device="cpu", cpu_eviction="lru",
                        layout="per-layer", shared=SharedConfig(url=shared, write=write, secret=secret), world_size=2,
                        wait_timeout_s=wait_timeout_s)
    if clock is not None:
        tier = stack.manager._shared
        tier.spec = attrs.evolve(tier.spec, clock=clock)
    return stack, ReferenceEngine(stack)


def serve(engine, rid, tokens=PROMPT, steps=4, limit=None):
    """Run one request to completion (each step within ``limit`` seconds if given); the scheduled request."""
    def step():
        start = time.monotonic()
        report = engine.step()
        if limit is not None:
            assert time.monotonic() - start <= limit, f"a step took {time.monotonic() - start:.2f} s"
        return report

    engine.add_request(rid, hash_blocks(tokens, SPEC.block_size), len(tokens))
    req = step().scheduled[0]
    engine.finish(rid)
    for _ in range(steps):
        step()
    engine.drain()
    return req


def forget_locally(stack, engine):
    """Empty the instance's GPU and CPU tiers: its next request for a prompt asks the shared tier."""
    engine.drain()
    stack.gpu.reset()
    engine.reset_cpu_tier()


def _io_threads():
    return sum(t.name in ("kvkit-valkey-put", "kvkit-valkey-get") and t.is_alive() for t in threading.enumerate())


@pytest.fixture
def server():
    with LocalServer(server_binary_or_skip()) as running:
        yield running


def test_a_slow_link_costs_a_step_at_most_its_deadlines_and_never_raises(server):
    """Replies and requests trickled at 8 KB/s (wait_timeout_s=4): the fetch of the shared hit is abandoned by
    the step's deadline and becomes a miss that recomputes (right bytes); the puts of the blocks past the hit
    are dropped and counted (failed at their deadline, or skipped once the probe failed too); no step waits
    on the shared tier longer than its lookup's and its fetches' deadlines, and none raises."""
    a, ea = instance(server.url + FAST)
    serve(ea, "a")
    assert a.stats.blocks_put.value == 10
    with SlowLink(("127.0.0.1", server.port), rate=8_000) as link:
        b, eb = instance(f"valkey://127.0.0.1:{link.port}/0" + FAST)
        req = serve(eb, "b", [*PROMPT[:20], *range(500, 520)], limit=2 * DEADLINE + SLACK)
        assert req.cpu_hit_tokens == 0, "the abandoned fetch was not recomputed"
        assert b.stats.fetches_failed.value == 5 and b.stats.blocks_fetched.value == 0
        # abandoned at their deadline, or skipped once the probe (as slow) turned the tier off: dropped and counted
        assert b.stats.puts_failed.value + b.stats.puts_skipped.value > 0, "the dropped puts were not counted"
        assert eb.integrity_errors == 0 and b.shared_counts["invalid_values"] == 0
        b.check_invariants()
        b.close()
    a.close()


def test_a_far_link_costs_a_step_one_deadline_for_its_lookup_and_fetch_together(server):
    """Every reply held 0.8 s (``request_timeout_s=1``, the two ranks' gets one after the other on one
    connection): the lookup finds the shared hit in 0.8 s and the fetch gets only what the deadline left, so
    the step waits on the shared tier about one deadline in all, not one for the lookup and one for the fetch;
    the fetch that did not come in time becomes a miss that recomputes right bytes, and the node is not marked
    down (it answers, late)."""
    a, ea = instance(server.url + FAST)
    serve(ea, "a")
    a.close()
    with SlowLink(("127.0.0.1", server.port), latency=0.8) as link:
        b, eb = instance(f"valkey://127.0.0.1:{link.port}/0?request_timeout_s=1&connect_timeout_s=1")
        eb.add_request("b", hash_blocks(PROMPT, SPEC.block_size), len(PROMPT))
        start = time.monotonic()
        req = eb.step().scheduled[0]
        took = time.monotonic() - start
        # One deadline and the step's own work on a loaded 2-core machine; two would be >= 1.8 s (two held replies).
        assert took < 1.75, f"the step waited {took:.2f} s on a shared tier whose deadline is 1 s"
        assert b.stats.shared_hit_tokens.value == 36 and b.stats.loads_failed.value == 1
        assert req.cpu_hit_tokens == 0 and b.shared_store.down_nodes == {}
        eb.finish("b")
        eb.step()
        eb.drain()
        assert b.stats.fetches_failed.value == 9
        assert eb.integrity_errors == 0 and b.shared_counts["invalid_values"] == 0
        b.check_invariants()
        b.close(timeout=3.0)


def test_the_lookups_of_one_step_share_the_deadline_through_a_slow_link(server):
    """Ten requests looked up in one step through a link that keeps trickling (never stalled, so no node is
    marked down): each ``contains`` would wait its whole deadline; together they wait one deadline in all,
    the later ones finding nothing there. The next step's lookups ask again (and find a shared hit)."""
    a, ea = instance(server.url + FAST)
    serve(ea, "a")
    a.close()
    with SlowLink(("127.0.0.1", server.port), rate=2_000) as link:
        b = kvkit.build(kv=SPEC, gpu_blocks=128, cpu_blocks=128, copy="torch", device="cpu", layout="per-layer",
                        shared=SharedConfig(url=f"valkey://127.0.0.1:{link.port}/0" + FAST), world_size=2)
        assert b.manager._shared.spec.lookup_budget_s == DEADLINE  # the store's own deadline
        eb = ReferenceEngine(b)
        for i in range(10):
            tokens = [1000 * (i + 1) + t for t in PROMPT]
            eb.add_request(f"r{i}", hash_blocks(tokens, SPEC.block_size), len(tokens))
        start = time.monotonic()
        report = eb.step()
        assert time.monotonic() - start <= DEADLINE + SLACK, f"the step took {time.monotonic() - start:.2f} s"
        assert len(report.scheduled) == 10 and b.manager.shared_status == "on"
        assert b.shared_store.down_nodes == {}  # slow, not stalled: only the budget cut the lookups short
        link.rate = None
        serve(eb, "hit")
        assert b.stats.shared_hit_tokens.value == 36
        b.close(timeout=3.0)


def test_the_lookups_of_one_step_through_a_far_link_wait_one_deadline_in_all(server):
    """Every reply held 0.9 s (``request_timeout_s=1``), five requests with a shared hit each looked up in one
    step: the first lookup finds its hit in 0.9 s, the second is given only what is left of the deadline (not a
    whole one) and the rest nothing, so the step waits on the shared tier one deadline in all, not two; none
    raises, the node is not marked down (it answers, late), and the hit that could not be fetched in time is a
    miss that recomputes right bytes."""
    def wide(url):
        stack = kvkit.build(kv=SPEC, gpu_blocks=128, cpu_blocks=128, copy="torch", device="cpu",
                            layout="per-layer", shared=SharedConfig(url=url), world_size=2)
        return stack, ReferenceEngine(stack)

    prompts = [[1000 * (i + 1) + t for t in PROMPT] for i in range(5)]
    a, ea = wide(server.url + FAST)
    for i, tokens in enumerate(prompts):
        serve(ea, f"a{i}", tokens)
    a.close()
    with SlowLink(("127.0.0.1", server.port), latency=0.9) as link:
        b, eb = wide(f"valkey://127.0.0.1:{link.port}/0?request_timeout_s=1&connect_timeout_s=1")
        for i, tokens in enumerate(prompts):
            eb.add_request(f"b{i}", hash_blocks(tokens, SPEC.block_size), len(tokens))
        start = time.monotonic()
        report = eb.step()
        took = time.monotonic() - start
        # One deadline and the step's own work on a loaded 2-core machine; two would be >= 1.8 s (two held replies).
        assert took < 1.75, f"the step waited {took:.2f} s on a shared tier whose deadline is 1 s"
        assert len(report.scheduled) == 5 and all(req.cpu_hit_tokens == 0 for req in report.scheduled)
        assert b.stats.shared_hit_tokens.value == 36 and b.shared_store.down_nodes == {}
        for i in range(5):
            eb.finish(f"b{i}")
        eb.step()
        eb.drain()
        assert b.stats.fetches_failed.value == 9 and b.stats.loads_failed.value == 1
        assert eb.integrity_errors == 0 and b.shared_counts["invalid_values"] == 0
        b.check_invariants()
        b.close(timeout=3.0)


def _answer_probe(stack, engine, probes, timeout):
    """Step ``engine`` until the tier sent ``probes`` probes and none is out (the last one answered)."""
    tier, end = stack.manager._shared, time.monotonic() + timeout
    while stack.stats.shared_probes.value < probes or tier._probe is not None:
        assert time.monotonic() < end, f"{stack.stats.shared_probes.value} probes, the last one not answered"
        engine.step()
        time.sleep(0.01)


def test_a_probe_queued_behind_puts_crawling_to_their_deadline_keeps_the_tier_on(server):
    """Two puts of 10,000 blocks each (two ranks') through an uplink of 50 KB/s (64 KiB in flight; deadline 1 s)
    hold the put lane to their deadline, and a probe queued right behind them finds its own deadline passed
    before any of its bytes is sent: no server was asked, so it neither turns the tier off nor on, and it is sent
    again at the next step, when it lands. Of the first put, the keys that went through before the deadline
    landed, those whose bytes were leaving are unreached (sent, unanswered), the rest unsent; the node is not
    marked down and nothing is warned."""
    with SlowLink(("127.0.0.1", server.port), rate=50_000, window=64 << 10) as link:
        stack, engine = instance(f"valkey://127.0.0.1:{link.port}/0?request_timeout_s=1&connect_timeout_s=1")
        store, tier = stack.shared_store, stack.manager._shared
        blocks = [[memoryview(bytes(100))]] * 10_000
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an outage warns
            puts = [store.put([b"kvkit:crawl:%d:%d" % (rank, i) for i in range(len(blocks))], blocks)
                    for rank in range(2)]
            tier.suspect("a put failed")  # the probe queues behind the two puts
            _answer_probe(stack, engine, 2, 10.0)
        (first,) = store.poll(puts[:1], 0.0)
        landed = set(range(len(blocks))) - set(first.failed)
        assert first.unreached and first.unsent, first.error
        assert max(landed, default=-1) < min(first.unreached) <= max(first.unreached) < min(first.unsent)
        assert len(landed) + len(first.unreached) + len(first.unsent) == len(blocks)
        assert len(store.poll(puts[1:], 0.0)) == 1
        assert stack.stats.shared_outages.value == 0 and stack.manager.shared_status == "on"
        assert stack.stats.shared_probes.value == 2 and store.down_nodes == {}
        stack.close(timeout=3.0)


def test_a_fetch_queued_behind_a_get_crawling_to_its_deadline_counts_no_missing_value(server):
    """A fetch of two blocks present on the server, queued behind a get of 10,000 keys whose replies crawl at
    20 KB/s to its deadline (1 s), is never sent: it fails (the blocks recompute) but its keys are no missing
    values, nor evidence against the server."""
    from kvkit.backends.blockstore.valkey import ValkeyStore
    from kvkit.interfaces import Direction
    from kvkit.interfaces.shared import SharedPlan
    from kvkit.shared.client import FormatCodec
    from kvkit.shared.worker import SharedTierWorker

    codec = FormatCodec.for_stack(SPEC, 1, model="m", layout="none")
    with SlowLink(("127.0.0.1", server.port)) as link:
        store = ValkeyStore([link.address], request_timeout_s=1.0, connect_timeout_s=1.0, retry_interval_s=30.0)
        worker = SharedTierWorker(SPEC, store, codec, wait_timeout_s=5.0)
        worker.put([(1, SharedPlan(Direction.STORE, [3, 4], [11, 12]))])
        assert [r.ok for r in worker.drain(5.0)] == [True]
        crawl = [b"kvkit:crawl:%d" % i for i in range(10_000)]
        assert store.poll([store.put(crawl, [[memoryview(b"v")]] * len(crawl))], 5.0)[0].ok
        link.rate = 20_000
        crawling = store.get(crawl, [[memoryview(bytearray(1))] for _ in crawl])
        assert worker.fetch([(2, SharedPlan(Direction.LOAD, [5, 6], [11, 12]))]) == {5, 6}
        assert [(r.transfer_id, r.ok) for r in worker.take_store_results()] == [(2, False)]
        assert worker.missing_values == 0 and worker.invalid_values == 0
        assert store.poll([crawling], 1.0 + SLACK)[0].unreached and store.down_nodes == {}
        store.close()


def test_a_probe_sent_to_a_paused_server_turns_the_tier_off(server):
    """A server stopped (SIGSTOP) takes the probe's bytes and answers nothing: every key was sent and no server
    answered, so the tier turns off (one warning, one outage), and the node is marked down: a put's keys then
    fail at once, unreached, none unsent. Resumed, the next probe turns the tier on."""
    clock = Clock()
    stack, engine = instance(server.url + FAST, clock=clock)
    store, tier = stack.shared_store, stack.manager._shared
    server.pause()
    try:
        with pytest.warns(RuntimeWarning, match="shared tier is off"):
            tier.suspect("a put failed")
            _answer_probe(stack, engine, 1, DEADLINE + SLACK)
        assert stack.stats.shared_outages.value == 1 and stack.manager.shared_status.startswith("off")
        assert store.down_nodes, "a server that answered nothing for the whole deadline was not marked down"
        (result,) = store.poll([store.put([b"kvkit:paused"], [[memoryview(b"v")]])], DEADLINE + SLACK)
        assert result.unreached == (0,) and result.unsent == (), result
    finally:
        server.resume()
    time.sleep(0.3)  # the node's retry interval (0.2 s) passes
    clock.now += 10
    _answer_probe(stack, engine, 2, DEADLINE + SLACK)
    assert stack.manager.shared_status == "on" and stack.stats.shared_recoveries.value == 1
    stack.close(timeout=3.0)


def test_a_server_with_room_for_two_of_the_stores_connections_keeps_the_tier_on():
    """``maxclients`` lets the second instance's lookup and get connections in and refuses its put connection
    (another client holds the last place): its shared hit is fetched, its puts fail refused, and its probe
    (a put) too, which keeps the tier on: no outage, nothing forgotten, the hits keep coming. Once the other
    client left, its puts land."""
    with LocalServer(server_binary_or_skip(), args=["--maxclients", "3"]) as full:
        a, ea = instance(full.url + FAST)
        serve(ea, "a")
        a.close()
        with socket.create_connection(("127.0.0.1", full.port), timeout=5.0) as other:
            other.sendall(b"PING\r\n")
            assert other.recv(7) == b"+PONG\r\n"
            b, eb = instance(full.url + FAST)
            req = serve(eb, "b", [*PROMPT[:36], *range(600, 620)])  # the lookup and get links take two places
            assert req.cpu_hit_tokens == 36 and b.stats.blocks_fetched.value == 9
            assert b.stats.puts_failed.value > 0 and b.stats.shared_probes.value > 0
            assert b.stats.shared_outages.value == 0 and b.manager.shared_status in ("on", "suspect")
            forget_locally(b, eb)
            assert serve(eb, "b2").cpu_hit_tokens == 36, "the tier stopped serving hits"
            assert b.shared_store.down_nodes == {}
        forget_locally(b, eb)
        serve(eb, "b3", [*range(700, 740)])
        assert b.stats.blocks_put.value >= 10, "the puts did not land once there was room"
        assert b.stats.shared_outages.value == 0 and eb.integrity_errors == 0
        b.check_invariants()
        b.close()


def test_a_second_instance_finds_the_shared_tokens_after_the_server_closed_idle_connections():
    """``timeout 1``: every connection of both instances is closed by the server while idle; the second
    instance still finds all 36 shared tokens, and nothing is counted as an outage."""
    with LocalServer(server_binary_or_skip(), args=["--timeout", "1"]) as idle:
        a, ea = instance(idle.url + FAST)
        b, eb = instance(idle.url + FAST)
        serve(eb, "b-warm", [7000 + t for t in range(40)])  # b's connections exist, and will go idle
        serve(ea, "a")
        deadline = time.monotonic() + 10
        while b"connected_clients:1\r" not in idle.call(b"INFO", b"clients"):  # only this INFO's connection
            assert time.monotonic() < deadline, "the server never closed the idle connections"
            time.sleep(0.05)
        req = serve(eb, "b")
        assert req.cpu_hit_tokens == 36 and b.stats.shared_hit_tokens.value == 36
        assert b.stats.shared_outages.value == 0 and b.manager.shared_status == "on"
        assert eb.integrity_errors == 0
        a.close()
        b.close()


def test_values_lost_in_a_restart_are_put_again(server):
    """The server restarts empty: the instance that had put a prompt finds it gone when it needs it again,
    recomputes it and puts every block again, so the next instance gets the whole shared hit."""
    a, ea = instance(server.url + FAST)
    serve(ea, "a1")
    assert a.stats.blocks_put.value == 10
    server.kill()
    server.start()
    forget_locally(a, ea)
    serve(ea, "a2")
    assert a.stats.blocks_put.value == 20, "the blocks lost in the restart were not put again"
    b, eb = instance(server.url + FAST)
    assert serve(eb, "b").cpu_hit_tokens == 36 and eb.integrity_errors == 0
    a.close()
    b.close()


def _blocks(server) -> int:
    """How many block values ``server`` holds (its store's restart marker left out)."""
    return len(block_keys(server.call(b"KEYS", b"*")))


def _spoiled(server, how, only=None):
    """Every value on ``server`` (or only the keys of ``only``) spoiled ``how``; the bad values by key."""
    keys = sorted(block_keys(server.call(b"KEYS", b"kvkit:*")))
    values = {key: bytearray(server.call(b"GET", key)) for key in keys}
    bad = {}
    for i, key in enumerate(keys):
        if only is not None and key not in only:
            continue
        value = values[key]
        if how == "a flipped byte":
            value[-1] ^= 0xFF
        elif how == "truncated":
            del value[len(value) // 2:]
        elif how == "another block's":  # a genuine value, sealed for another block of the same rank
            value = next(values[k] for k in keys[i + 1:] + keys[:i] if k[-3:] == key[-3:])
        else:  # forged: other KV, the checksum recomputed from the public layout, the HMAC left as it was
            forged = bytes(b ^ 0x5A for b in value[HEADER_SIZE:])
            value[HEADER_SIZE - 48:HEADER_SIZE - 32] = xxhash.xxh3_128(forged).digest()
            value[HEADER_SIZE:] = forged
        bad[key] = bytes(value)
        assert server.call(b"SET", key, bad[key]) == b"OK"
    return bad


@pytest.mark.parametrize(("how", "secret"), [("a flipped byte", None), ("truncated", None),
                                             ("another block's", None), ("forged", b"deployment-secret")])
def test_values_refused_are_put_again_and_the_next_instance_gets_the_whole_hit(server, how, secret):
    """Every value of a prompt spoiled on the server (a flipped byte, truncated, another block's value, forged
    without the deployment's HMAC secret): instance B looks the prompt up, finds it present, refuses every value
    (counted), recomputes right bytes and puts each block again over the bad value, so instance C gets the
    whole shared hit, clean: a bad value poisons its prefix for one fetch, not until its expiry."""
    a, ea = instance(server.url + FAST, secret=secret)
    serve(ea, "a")
    a.close()
    bad = _spoiled(server, how)
    assert len(bad) == 2 * 10
    b, eb = instance(server.url + FAST, secret=secret)
    assert serve(eb, "b").cpu_hit_tokens == 0 and eb.integrity_errors == 0
    refused = b.shared_counts["invalid_values"] + b.shared_counts["missing_values"]
    assert refused == 2 * 9 and b.stats.fetches_failed.value == 9
    assert b.stats.blocks_put.value == 10, "the blocks recomputed over refused values were not put again"
    assert all(server.call(b"GET", key) != value for key, value in bad.items()), "a bad value was kept"
    b.close()
    c, ec = instance(server.url + FAST, secret=secret)
    assert serve(ec, "c").cpu_hit_tokens == 36 and c.stats.shared_hit_tokens.value == 36
    assert c.stats.fetches_failed.value == 0 and ec.integrity_errors == 0
    c.close()


def _key(stack, block, rank):
    """The store key of ``PROMPT``'s block ``block`` on worker ``rank`` of ``stack``."""
    return stack.manager.shared.codec.key(hash_blocks(PROMPT, SPEC.block_size)[block], rank)


@pytest.mark.parametrize("how", ["a flipped byte", "truncated", "another block's"])
@pytest.mark.parametrize("spoilt", [[(3, 1)], [(2, 0), (5, 1)]], ids=["one shard", "two blocks, two ranks"])
def test_a_fetch_with_a_bad_value_commits_its_clean_blocks_and_refuses_only_the_bad_ones(server, how, spoilt):
    """A step's fetch of a 9-block shared hit over two ranks in which only the values ``spoilt`` (block, rank)
    are bad: the blocks whose every shard checked are committed to B's CPU tier and count as fetched; only the
    bad blocks count as failed fetches, are refused and put again (with the last block, which B never looked
    up); the load reading them fails and the request recomputes right bytes. B's CPU tier then serves the
    prompt without another fetch, and instance C gets the whole shared hit, clean."""
    a, ea = instance(server.url + FAST)
    serve(ea, "a")
    bad_keys = {_key(a, block, rank) for block, rank in spoilt}
    a.close()
    before = {key: server.call(b"GET", key) for key in block_keys(server.call(b"KEYS", b"kvkit:*"))}
    assert len(_spoiled(server, how, only=bad_keys)) == len(spoilt)
    b, eb = instance(server.url + FAST)
    serve(eb, "b1")
    counts = b.shared_counts
    assert counts["invalid_values"] + counts["missing_values"] == len(spoilt) and eb.integrity_errors == 0
    assert b.stats.fetches_failed.value == len(spoilt), "clean blocks of the fetch were counted failed"
    assert b.stats.blocks_fetched.value == 9 - len(spoilt), "the clean blocks of the fetch were discarded"
    assert b.stats.bytes_fetched.value == (9 - len(spoilt)) * b.manager.kv.bytes_per_block
    assert b.stats.blocks_stored.value == len(spoilt) + 1, "blocks the fetch landed were computed and stored"
    assert b.stats.blocks_put.value == len(spoilt) + 1, "clean blocks of the fetch were put again"
    assert {key: server.call(b"GET", key) for key in before} == before, "a bad value was kept, or a clean one put"
    b.gpu.reset()  # the next request of the prompt is a CPU hit
    assert serve(eb, "b2").cpu_hit_tokens == 36 and eb.integrity_errors == 0
    assert b.stats.blocks_fetched.value == 9 - len(spoilt) and b.stats.shared_hit_tokens.value == 36
    b.close()
    c, ec = instance(server.url + FAST)
    assert serve(ec, "c").cpu_hit_tokens == 36 and c.stats.fetches_failed.value == 0 and ec.integrity_errors == 0
    c.close()


def test_a_value_refused_whose_put_again_failed_is_taken_as_lost_by_the_next_lookup_of_the_cpu_hit(server):
    """Every value of a prompt spoiled, and the server refusing writes (``-OOM``) while instance B refuses them and
    recomputes: its puts again fail. Writes allowed again, B's next lookup of the prompt (a CPU hit) finds the
    keys present but takes the values it refused as lost, not as held, and puts its blocks again over them, so
    instance C gets the whole shared hit, clean."""
    a, ea = instance(server.url + FAST)
    serve(ea, "a")
    a.close()
    _spoiled(server, "a flipped byte")
    b, eb = instance(server.url + FAST)
    assert server.call(b"CONFIG", b"SET", b"maxmemory", b"1") == b"OK"
    serve(eb, "b1")
    assert b.stats.fetches_failed.value == 9 and b.stats.puts_failed.value == 10 and b.stats.blocks_put.value == 0
    assert server.call(b"CONFIG", b"SET", b"maxmemory", b"0") == b"OK"
    b.gpu.reset()  # the next request of the prompt is a CPU hit, not a GPU one
    assert serve(eb, "b2").cpu_hit_tokens == 36
    assert b.stats.blocks_found_lost.value == 9, "the values refused were taken as held"
    assert b.stats.blocks_put.value == 9 and eb.integrity_errors == 0
    b.close()
    c, ec = instance(server.url + FAST)
    assert serve(ec, "c").cpu_hit_tokens == 36 and c.stats.fetches_failed.value == 0 and ec.integrity_errors == 0
    c.close()


def test_an_outage_forgets_what_was_put():
    """After the tier was off (the server may have come back empty), what was put before is put again at
    once (write-back: the CPU pool's next victims), well before ``trust_s``."""
    from kvkit.testing.doubles import FailingStore

    store, clock = FailingStore(MemoryStore()), Clock()
    a, ea = instance(store, write="write-back", clock=clock)
    serve(ea, "a1")
    assert a.stats.blocks_put.value == 4 and len(store.inner._values) == 8  # 4 victims x 2 ranks
    store.inner, store.down = MemoryStore(), True  # down, and back empty
    a.manager._shared.suspect("a put failed")
    with pytest.warns(RuntimeWarning, match="shared tier is off"):
        ea.step()  # the probe fails
    store.down = False
    clock.now += 10  # past the back-off, far from trust_s
    for _ in range(3):
        ea.step()
    ea.drain()
    assert a.manager.shared_status == "on"
    assert a.stats.blocks_put.value >= 8 and len(store.inner._values) >= 8, "the victims were not put again"


def test_what_was_put_is_trusted_only_for_trust_s():
    """write-back keeps putting the CPU pool's next victims; a value the store lost meanwhile is put again
    once ``trust_s`` passed, not before."""
    store, clock = MemoryStore(), Clock()
    a, ea = instance(store, write="write-back", clock=clock)
    serve(ea, "a1")
    put = a.stats.blocks_put.value
    assert put == 4  # the CPU tier's next 4 victims
    for key in list(store._values):
        store.drop(key)
    for _ in range(3):
        ea.step()
    assert a.stats.blocks_put.value == put, "a block put moments ago was put again"
    clock.now += a.manager._shared.spec.trust_s
    for _ in range(2):
        ea.step()
    ea.drain()
    assert a.stats.blocks_put.value == 2 * put and len(store._values) == 2 * put


@pytest.mark.parametrize("turn", ["same", "next"])
@pytest.mark.parametrize("loss", ["flushall", "restart"])
def test_blocks_the_server_lost_are_put_again_from_the_cpu_tier(server, loss, turn):
    """The server loses an instance's prompt (FLUSHALL, or a restart empty between calls: no outage is seen)
    while the instance keeps it in its CPU tier: once ``trust_s`` passed, its next lookup of the prompt (a CPU
    hit, nothing after it to look up) or of the conversation's next turn (the prompt and new blocks the
    server never held) finds the CPU hit's blocks lost and puts them again, so a second instance gets the
    whole shared hit."""
    clock = Clock()
    a, ea = instance(server.url + FAST, clock=clock)
    serve(ea, "a1")
    assert a.stats.blocks_put.value == 10
    if loss == "flushall":
        assert server.call(b"FLUSHALL") == b"OK"
    else:
        server.kill()
        server.start()
    clock.now += a.manager._shared.spec.trust_s
    a.gpu.reset()  # the next request of the prompt is a CPU hit, not a GPU one
    if turn == "same":
        assert serve(ea, "a2").cpu_hit_tokens == 36
        lost, put = 9, 19
    else:
        assert serve(ea, "a2", PROMPT + [7000 + t for t in range(20)]).cpu_hit_tokens == 40
        lost, put = 10, 25  # the whole prompt again, and the turn's 5 new blocks
    assert a.stats.blocks_found_lost.value == lost, "the CPU hit's lost blocks were not found lost"
    assert a.stats.blocks_put.value == put, "the lost blocks were not put again"
    b, eb = instance(server.url + FAST)
    assert serve(eb, "b").cpu_hit_tokens == 36 and b.stats.shared_hit_tokens.value == 36
    assert eb.integrity_errors == 0
    a.close()
    b.close()


def test_a_restart_no_call_failed_on_is_found_by_the_next_lookup_and_what_was_lost_is_put_again(server):
    """The server restarts empty between calls (no call fails, no outage is seen) while the instance that put a
    prompt keeps it in its CPU tier, long before ``trust_s``: its next lookup (the conversation's next turn)
    reconnects, finds another run of the server there, forgets what it remembered as put, finds the CPU hit's
    blocks lost in the same lookup and puts them again, so a second instance gets the whole shared hit."""
    a, ea = instance(server.url + FAST)
    serve(ea, "a1")
    assert a.stats.blocks_put.value == 10
    server.kill()
    server.start()
    a.gpu.reset()  # the next request of the prompt is a CPU hit, not a GPU one
    assert serve(ea, "a2", PROMPT + [7000 + t for t in range(20)]).cpu_hit_tokens == 40
    assert a.stats.shared_outages.value == 0 and a.stats.fetches_failed.value == 0
    assert a.stats.blocks_found_lost.value == 10, "the restart was trusted: the CPU hit's blocks were not checked"
    assert a.stats.blocks_put.value == 25, "the blocks lost in the restart were not put again"
    b, eb = instance(server.url + FAST)
    assert serve(eb, "b").cpu_hit_tokens == 36 and b.stats.shared_hit_tokens.value == 36
    assert eb.integrity_errors == 0
    a.close()
    b.close()


@pytest.mark.parametrize("turn", ["same", "next"])
def test_values_past_the_servers_ttl_are_put_again_within_the_ttl(server, turn):
    """Values expire (``ttl_s``) long before ``trust_s``: the instance that put a prompt, keeping it in its CPU
    tier, takes them as lost once the store's ``ttl_s`` passed (not ``trust_s``), so its next lookup of the
    prompt (a CPU hit) or of the conversation's next turn puts them again and a second instance gets the whole
    shared hit."""
    clock = Clock()
    url = server.url + FAST + "&ttl_s=1"
    a, ea = instance(url, clock=clock)
    serve(ea, "a1")
    assert a.stats.blocks_put.value == 10
    time.sleep(1.2)
    assert _blocks(server) == 0  # every value expired
    clock.now += 1.0  # the ttl, far from trust_s
    a.gpu.reset()
    if turn == "same":
        assert serve(ea, "a2").cpu_hit_tokens == 36
        lost, put = 9, 19
    else:
        assert serve(ea, "a2", PROMPT + [7000 + t for t in range(20)]).cpu_hit_tokens == 40
        lost, put = 10, 25
    assert a.stats.blocks_found_lost.value == lost, "values past the ttl were trusted as held"
    assert a.stats.blocks_put.value == put, "values past the ttl were not put again"
    b, eb = instance(url)
    assert serve(eb, "b").cpu_hit_tokens == 36 and b.stats.shared_hit_tokens.value == 36
    assert eb.integrity_errors == 0
    a.close()
    b.close()


def test_write_back_puts_its_candidates_again_once_the_server_expired_them(server):
    """write-back keeps the CPU pool's next victims put: on a server whose values expire (``ttl_s``), the
    candidates are put again once the ttl passed, long before ``trust_s``."""
    clock = Clock()
    a, ea = instance(server.url + FAST + "&ttl_s=1", write="write-back", clock=clock)
    serve(ea, "a1")
    put = a.stats.blocks_put.value
    assert put > 0 and _blocks(server) == 2 * put
    time.sleep(1.2)
    assert _blocks(server) == 0  # every value expired
    clock.now += 1.0  # the ttl, far from trust_s
    for _ in range(3):
        ea.step()
    ea.drain()
    assert a.stats.blocks_put.value == 2 * put, "the expired candidates were not put again"
    assert _blocks(server) == 2 * put
    a.close()


class _Counting(MemoryStore):
    """A memory store that records the keys of each ``contains`` round trip."""

    def __init__(self):
        super().__init__()
        self.asked: list[list[bytes]] = []

    def contains(self, keys, *, timeout_s=None):
        self.asked.append(list(keys))
        return super().contains(keys, timeout_s=timeout_s)


@settings(max_examples=30)
@given(st.lists(st.one_of(st.tuples(st.just("serve"), st.integers(0, 3)),
                          st.tuples(st.just("wait"), st.sampled_from([0.5, 30.0, 59.5, 60.0, 100.0])),
                          st.tuples(st.just("flush"), st.integers(0, 40))), min_size=1, max_size=12))
@example([("serve", 0), ("wait", 100.0), ("serve", 1)])  # lapsed CPU hit, absent tail: a second trip
@example([("serve", 0), ("flush", 0), ("wait", 100.0), ("serve", 2)])  # lapsed CPU hit, tail lost too
@example([("serve", 0), ("wait", 100.0), ("serve", 2), ("serve", 0)])  # answered past a present tail
def test_a_lookup_makes_at_most_two_round_trips_and_never_rechecks_what_it_remembers(ops):
    """Whatever the server lost and however time passed: a lookup makes at most two ``contains`` round trips
    (the second asks only CPU-hit blocks), none when its CPU hit is remembered and nothing follows it to look
    up, and never asks about a CPU-hit block it remembered as held (or found lost) less than ``trust_s`` ago.
    Every request is a CPU hit (the GPU is emptied first)."""
    store, clock = _Counting(), Clock()
    a, ea = instance(store, clock=clock)
    mgr, tier, cpu = a.manager, a.manager._shared, a.cpu
    prompts = [list(range(40)), list(range(20)) + [99] * 20, list(range(44)), list(range(8))]
    lookup, keys = OffloadManager.lookup, {}

    def checked_lookup(self, rid, gpu_hit_tokens, **kw):
        r = mgr._requests[rid]
        start, stop = gpu_hit_tokens // SPEC.block_size, min((r.num_tokens - 1) // SPEC.block_size,
                                                               len(r.block_hashes))
        held = r.block_hashes[start:start + len(cpu.lookup(r.block_hashes[start:stop]))] if start < stop else []
        for h in r.block_hashes:
            keys.update({tier.spec.codec.key(h, rank): h for rank in range(2)})
        remembered = {h for h in held for memory in (tier._known, tier._lost)
                      if h in memory and not tier._expired(memory[h])}
        before = len(store.asked)
        out = lookup(self, rid, gpu_hit_tokens, **kw)
        trips = store.asked[before:]
        assert len(trips) <= 2, f"a lookup made {len(trips)} contains round trips"
        if len(trips) == 2:
            assert {keys[k] for k in trips[1]} <= set(held), "a second round trip asked beyond the CPU hit"
        asked = {keys[k] for trip in trips for k in trip}
        assert not asked & remembered, "a CPU-hit block remembered (held or lost) was checked again before trust_s"
        if start + len(held) >= stop and len(remembered) == len(held):
            assert not trips, "a lookup whose CPU hit is remembered made a round trip"
        return out

    with mock.patch.object(OffloadManager, "lookup", checked_lookup):
        for i, (op, arg) in enumerate(ops):
            if op == "serve":
                a.gpu.reset()
                serve(ea, f"r{i}", prompts[arg], steps=2)
            elif op == "wait":
                clock.now += arg
            else:
                for key in list(store._values)[arg:]:
                    store.drop(key)
            mgr.check_invariants()
    a.close()


class Clock:
    """The shared tier's clock, moved by the test."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _serve_beside_a_dead_node(cluster, a, ea):
    """Kill the third node, serve three new prompts: the tier stays on (no outage, no warning)."""
    cluster.nodes[2].kill()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(3):
            serve(ea, f"a{i + 2}", [9000 * (i + 1) + t for t in range(40)], limit=DEADLINE + SLACK)
    assert not [w for w in seen if "shared tier is off" in str(w.message)], [str(w.message) for w in seen]
    assert a.stats.shared_outages.value == 0 and a.manager.shared_status in ("on", "suspect")


def test_a_cluster_with_a_dead_node_keeps_the_tier_on():
    """One of three Cluster nodes is killed: the probe lands on the live ones, so the tier stays on (no
    outage, no warning); requests go on with right bytes and new blocks land on the live nodes."""
    cluster = LocalCluster(binary=server_binary_or_skip(), args=["--cluster-require-full-coverage", "no"])
    with cluster:
        a, ea = instance(cluster.url + FAST.replace("retry_interval_s=0.2", "retry_interval_s=60"))
        serve(ea, "a1")
        assert a.stats.blocks_put.value == 10
        _serve_beside_a_dead_node(cluster, a, ea)
        assert ea.integrity_errors == 0
        live = sum(_blocks(node) for node in cluster.nodes[:2])
        assert live > 20, "nothing landed on the live nodes"
        assert list(a.shared_store.down_nodes) == [("127.0.0.1", cluster.nodes[2].port)]
        a.close()


def test_a_fetch_beside_a_cluster_node_that_died_after_the_lookup_commits_the_live_nodes_blocks():
    """A Cluster node dies between B's lookup of a 9-block shared hit (every key present) and its fetch: the
    blocks with a shard on the dead node fail alone (counted, never findable), those whose every shard lives
    on the live nodes are committed to B's CPU tier and counted fetched; the load reading a failed block fails
    (its request recomputes)."""
    cluster = LocalCluster(binary=server_binary_or_skip(), args=["--cluster-require-full-coverage", "no"])
    with cluster:
        url = cluster.url + FAST.replace("retry_interval_s=0.2", "retry_interval_s=60")
        a, ea = instance(url)
        serve(ea, "a")
        a.close()
        dead = set(block_keys(cluster.nodes[2].call(b"KEYS", b"*")))
        b, eb = instance(url)
        hashes = hash_blocks(PROMPT, SPEC.block_size)
        failed = {i for i in range(9) if {_key(b, i, rank) for rank in range(2)} & dead}
        assert 0 < len(failed) < 9, "the test needs blocks on the dead node and beside it"
        eb.add_request("b", hashes, len(PROMPT))
        assert b.manager.lookup("b", 0) == 36
        cluster.nodes[2].kill()
        b.manager.on_allocated("b", [b.gpu.allocate(10)], 36)
        plan = b.manager.build_step()
        for worker in b.shared_workers:
            worker.submit(plan)
        report = b.manager.apply_completions([res for w in b.shared_workers for res in w.drain()])
        assert report.load_failed == {"b"}
        assert b.stats.fetches_failed.value == len(failed), "blocks of the live nodes were counted failed"
        assert b.stats.blocks_fetched.value == 9 - len(failed), "blocks of the live nodes were discarded"
        findable = {i for i in range(9) if b.cpu.lookup([hashes[i]])}
        assert findable == set(range(9)) - failed
        b.check_invariants()
        b.close()


def test_a_cluster_whose_live_nodes_refuse_writes_beside_a_dead_node_keeps_the_tier_on():
    """One node dead and the live ones refusing writes (``maxmemory`` reached under ``noeviction``: ``-OOM``):
    every key of the probe fails, but the live nodes answered it, so the tier stays on (no outage, no warning)
    and goes on serving their values; the refused puts are counted."""
    cluster = LocalCluster(binary=server_binary_or_skip(), args=["--cluster-require-full-coverage", "no"])
    with cluster:
        a, ea = instance(cluster.url + FAST.replace("retry_interval_s=0.2", "retry_interval_s=60"))
        serve(ea, "a1")
        for node in cluster.nodes[:2]:
            node.call(b"CONFIG", b"SET", b"maxmemory-policy", b"noeviction")
            node.call(b"CONFIG", b"SET", b"maxmemory", b"1")
        _serve_beside_a_dead_node(cluster, a, ea)
        assert a.stats.puts_failed.value > 0 and ea.integrity_errors == 0
        a.close()


def test_blocks_longer_than_the_servers_bulk_limit_are_counted_failed_puts_and_the_tier_stays_on():
    """A server whose ``proto-max-bulk-len`` (1 MiB) is shorter than a block's value (1 MiB of payload a rank, and
    its header): every put fails, refused, and is counted; the tier stays on (no outage, no warning), since the
    server answered the probe, and requests are served right from the GPU and CPU tiers."""
    spec = kvkit.KVCacheSpec(num_layers=32, block_size=SPEC.block_size, num_kv_heads=8, head_dim=256,
                             dtype="float32")  # 2 MiB a block
    with LocalServer(server_binary_or_skip(), args=["--proto-max-bulk-len", "1mb"]) as server:
        stack = kvkit.build(kv=spec, gpu_blocks=16, cpu_blocks=16, copy="torch", device="cpu", cpu_eviction="lru",
                            layout="per-layer", shared=SharedConfig(url=server.url + FAST),
                            world_size=2, wait_timeout_s=4.0)
        engine = ReferenceEngine(stack)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for i in range(3):
                serve(engine, f"big{i}", [1000 * i + t for t in PROMPT])  # 2 MiB blocks: copies take CPU time
        assert not [w for w in seen if "shared tier is off" in str(w.message)], [str(w.message) for w in seen]
        assert stack.stats.shared_outages.value == 0 and stack.manager.shared_status in ("on", "suspect")
        assert stack.stats.puts_failed.value > 0 and stack.stats.blocks_put.value == 0
        assert engine.integrity_errors == 0 and stack.shared_store.down_nodes == {}
        stack.close()


def test_a_build_refused_after_opening_the_store_leaves_no_thread(server, monkeypatch):
    """A build that fails after its store was opened closes it: no I/O thread is left, attempt after attempt."""
    from kvkit.worker.engine import TransferEngine

    def refuse(self, *args, **kwargs):
        raise InsufficientMemoryError("no room for the mirror (planted)")

    monkeypatch.setattr(TransferEngine, "allocate_kv", refuse)
    before = _io_threads()
    for _ in range(3):
        with pytest.raises(InsufficientMemoryError, match="planted"):
            instance(server.url + FAST)
    assert _io_threads() == before


def test_every_guarantee_under_faults_in_the_docs_names_tests_that_exist():
    """docs/shared-tier.md's table of guarantees under faults: every test it names is defined where it says."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "shared-tier.md").read_text()
    section = text[text.index("## When the server fails"):text.index("## The value format")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "::" in line]
    assert len(rows) >= 15
    files = {p.name: p for p in (root / "tests").rglob("test_*.py")}
    for row in rows:
        named = re.findall(r"`(?:[\w/]+/)?(test_\w+\.py)::(test_\w+)`", row)
        assert named, row
        for path, name in named:
            assert f"def {name}(" in files[path].read_text(), f"{path}::{name} is named in the docs but not defined"


def test_a_shared_hit_the_plan_declines_is_recomputed_and_not_put_again():
    """An instance whose plan recomputes a shared hit instead of loading it puts none of those blocks back (the
    lookup found them held); a block past the hit, which the lookup did not find, is put."""
    from kvkit.backends.plan import LoadAllPlanner
    from kvkit.interfaces import LoadPlan

    class Decline(LoadAllPlanner):
        def plan(self, query):
            return LoadPlan(0, 0, query.hit_blocks)

    store = MemoryStore()
    a, ea = instance(store)
    serve(ea, "a")
    assert a.stats.blocks_put.value == 10
    b = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=16, copy="torch", device="cpu", cpu_eviction="lru",
                    layout="per-layer", shared=SharedConfig(url=store, write="write-through"), world_size=2,
                    planner=Decline())
    eb = ReferenceEngine(b)
    req = serve(eb, "b", tokens=[*PROMPT, *range(100, 104)])  # a's 10 blocks, then one more
    assert req.cpu_hit_tokens == 0 and b.stats.hits_declined_shared.value == len(PROMPT)
    assert b.stats.blocks_put.value == 1, "the declined hit was put back"
    assert eb.integrity_errors == 0


OTHER = list(range(1000, 1040))  # 10 blocks sharing none of PROMPT's
SHARING = PROMPT[:16] + list(range(2000, 2024))  # 10 blocks: PROMPT's first 4, then its own


def _two_requests(shared, layered=False, planner=None, callbacks=()):
    stack = kvkit.build(kv=SPEC, gpu_blocks=32, cpu_blocks=32, copy="torch", device="cpu", cpu_eviction="lru",
                        layout="per-layer", shared=SharedConfig(url=shared, write="write-through"), world_size=2,
                        wait_timeout_s=4.0, callbacks=list(callbacks),
                        **({} if planner is None else {"planner": planner}))
    return stack, ReferenceEngine(stack, layered=layered)


class _SpoilOnHit(OffloadCallback):
    """Spoils a value once ``request_id``'s shared hit is accepted: after the step's lookups, before its fetch."""

    def __init__(self, request_id, spoil):
        self.request_id, self.spoil = request_id, spoil

    def on_shared_hit(self, request_id, shared_hit_tokens):
        if request_id == self.request_id:
            self.spoil()


class _Head(LoadAllPlanner):
    """Plans the hit's first 2 blocks as the head (where the engine overlaps), the rest loaded."""

    def plan(self, query):
        head = 2 if query.overlap else 0
        return LoadPlan(head, query.hit_blocks - head, query.hit_blocks)


@pytest.fixture(params=["memory", "valkey"])
def spoilable(request):
    """A shared store URL and ``spoil(key, how)``: its value spoiled (a flipped byte) or deleted (missing)."""
    if request.param == "memory":
        url = f"memory://two-requests-{request.node.name}"
        store = kvkit.shared.open_block_store(url)

        def spoil(key, how):
            if how == "missing":
                assert store.drop(key)
            else:
                value = bytearray(store._values[key])
                value[-1] ^= 0xFF
                store._values[key] = bytes(value)

        yield url, spoil
        for key in list(store._values):  # the process keeps its memory:// stores
            store.drop(key)
        return
    with LocalServer(server_binary_or_skip()) as running:
        def spoil(key, how):
            if how == "missing":
                assert running.call(b"DEL", key) == 1
            else:
                value = bytearray(running.call(b"GET", key))
                value[-1] ^= 0xFF
                assert running.call(b"SET", key, bytes(value)) == b"OK"

        yield running.url + ROOMY, spoil  # a loaded machine must not turn a late fetch into a lost hit here


@pytest.mark.parametrize("how", ["a flipped byte", "missing"])
@pytest.mark.parametrize(("other", "block", "both"), [(OTHER, 3, False), (SHARING, 5, False), (SHARING, 3, True)],
                         ids=["disjoint", "sharing a clean prefix", "sharing the bad block"])
@pytest.mark.parametrize("mode", ["plain", "layered", "head"])
def test_a_bad_value_fails_the_load_of_only_the_requests_that_read_it(spoilable, how, other, block, both, mode):
    """Two requests loaded in one step from one fetch and one copy per rank, one value of ``PROMPT``'s block
    ``block`` on rank 1 spoiled between the step's lookup and its fetch (a flipped byte, or deleted): only the
    requests that read that block (both, where both prompts hold it) recompute their hit; the other keeps its
    whole shared hit, loaded in the same copies, every loaded byte checked (plain, layered, or with a head
    computed beside the loads). Only the failed requests' loads count failed and none of their blocks count
    loaded; the fetch's clean blocks are committed and serve both prompts later, every byte checked."""
    url, spoil = spoilable
    a, ea = _two_requests(url)
    serve(ea, "a1")
    serve(ea, "a2", tokens=other)
    a.close()
    key = _key(a, block, 1)
    b, eb = _two_requests(url, layered=mode == "layered", planner=_Head() if mode == "head" else None,
                          callbacks=[_SpoilOnHit("o", lambda: spoil(key, how))])  # both looked up
    eb.add_request("p", hash_blocks(PROMPT, SPEC.block_size), len(PROMPT))
    eb.add_request("o", hash_blocks(other, SPEC.block_size), len(other))
    report = eb.step()
    head = 8 if mode == "head" else 0
    hits = {r.request_id: r.head_tokens + r.cpu_hit_tokens for r in report.scheduled}
    assert hits == {"p": head, "o": head if both else 36}, "a request that read no bad block lost its hit"
    assert report.load_failed == ({"p", "o"} if both else {"p"})
    assert report.integrity_errors == 0 and eb.integrity_errors == 0
    b.check_invariants()
    assert b.stats.loads_failed.value == 1 + both
    loaded = 0 if both else 9 - head // SPEC.block_size  # the kept request's tail alone
    assert b.stats.blocks_loaded.value == loaded
    assert b.stats.bytes_loaded.value == loaded * b.manager.kv.bytes_per_block
    fetched = 9 - head // SPEC.block_size  # each request fetches its tail (the shared block twice, once each)
    assert b.stats.fetches_failed.value == 1 + both, "clean blocks of the fetch were counted failed"
    assert b.stats.blocks_fetched.value == 2 * fetched - (1 + both), "clean blocks of the fetch were discarded"
    eb.finish("p")
    eb.finish("o")
    for _ in range(4):
        eb.step()
    eb.drain()
    b.gpu.reset()  # the next requests of both prompts are CPU hits: every byte of them is checked
    for rid, tokens in (("p2", PROMPT), ("o2", other)):
        req = serve(eb, rid, tokens=tokens)
        assert req.gpu_hit_tokens + req.head_tokens + req.cpu_hit_tokens == 36
    assert eb.integrity_errors == 0
    b.check_invariants()
    b.close()
