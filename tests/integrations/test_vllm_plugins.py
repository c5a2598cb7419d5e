"""kvkit's plug-ins for vLLM's own OffloadingConnector, under vLLM's scheduler-side classes, in process.

The OffloadingConnector's worker refuses the CPU platform (``CPUOffloadingSpec.get_worker``:
"CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"), so no engine runs
here. Everything above the worker is vLLM's: ``CPUOffloadingManager`` drives the cache policy,
and ``TieringOffloadingSpec.get_manager`` builds the CPU primary tier (over its shared-memory
region) and loads the secondary tier by module path, as an engine's scheduler does. The tests
stand in for the GPU<->CPU worker only: they write a chunk's bytes into the primary tier's row
where a store would have copied them, and read them back where a load would have. kvkit's
eviction contract also drives the policy adapter through the calls vLLM's manager makes.
"""

import os
import random
import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvkit.errors import ConfigError, KVKitError
from kvkit.integrations.vllm import KVKitCachePolicy, KVKitSecondaryTier, cache_policy_class, tier_key_prefix
from kvkit.registry import EVICTION
from kvkit.testing import EvictionPolicyContract, FIFOContract, LRUContract

POLICY_MODULE = "kvkit.integrations.vllm.cache_policy"
TIER_MODULE = "kvkit.integrations.vllm.tier"
CHUNK_BYTES = 4096
IDLE = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def _key(i: int, group: int = 0):
    return make_offload_key(i.to_bytes(32, "big"), group)


def _policies() -> list[str]:
    """Every registered kvkit policy that builds without options (``opt`` needs the future)."""
    names = []
    for name in EVICTION.names():
        try:
            EVICTION.create(name)
        except Exception:  # noqa: BLE001 - a policy that cannot build alone is not offered to vLLM
            continue
        names.append(name)
    return names


def _manager(name: str, num_chunks: int = 4) -> CPUOffloadingManager:
    return CPUOffloadingManager(num_chunks=num_chunks, cache_policy=f"kvkit-{name}",
                                cache_policy_module_path=POLICY_MODULE)


def _check(manager: CPUOffloadingManager) -> None:
    policy = manager._policy
    assert isinstance(policy, KVKitCachePolicy)
    policy.check_invariants()


# -- the cache policy ---------------------------------------------------------------------------


def test_vllm_resolves_the_policy_classes_by_module_path():
    default = CachePolicyFactory.get_cache_policy_cls("KVKitCachePolicy", POLICY_MODULE)
    assert default is KVKitCachePolicy and default.policy_name == "hit-density"
    assert CachePolicyFactory.get_cache_policy_cls("kvkit-hit-density", POLICY_MODULE) is KVKitCachePolicy
    lfu = CachePolicyFactory.get_cache_policy_cls("kvkit-lfu", POLICY_MODULE)
    assert issubclass(lfu, KVKitCachePolicy) and lfu.policy_name == "lfu"
    assert cache_policy_class("lfu") is lfu  # one class per name
    assert isinstance(CPUOffloadingManager(4, "kvkit-lfu", POLICY_MODULE)._policy.policy, type(EVICTION.create("lfu")))


def test_an_unknown_policy_name_is_refused_quoting_it():
    with pytest.raises(ConfigError, match=r"'nope'.*valid: .*hit-density"):
        CachePolicyFactory.get_cache_policy_cls("kvkit-nope", POLICY_MODULE)
    with pytest.raises(AttributeError, match="'LRU'"):
        CachePolicyFactory.get_cache_policy_cls("LRU", POLICY_MODULE)


@pytest.mark.parametrize("name", _policies())
def test_the_manager_keeps_vllms_rules_under_every_kvkit_policy(name):
    """vLLM's own regression scenarios: a resident chunk of the offer is never evicted for it; a
    chunk being loaded is never evicted; a failed eviction changes nothing; a failed store frees
    its slot; a reset forgets everything."""
    manager = _manager(name)
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    first = manager.prepare_store([_key(1), _key(2)], ctx)
    assert first is not None and first.evicted_keys == []
    manager.complete_store([_key(1), _key(2)], ctx)
    _check(manager)

    out = manager.prepare_store([_key(2), _key(3), _key(4), _key(5)], ctx)
    assert out is not None and out.keys_to_store == [_key(3), _key(4), _key(5)]
    assert out.evicted_keys == [_key(1)]  # the only idle chunk outside the offer
    manager.complete_store(out.keys_to_store, ctx)
    assert manager.lookup(_key(2), ctx) is LookupResult.HIT
    assert manager.lookup(_key(1), ctx) is LookupResult.MISS
    _check(manager)

    manager.prepare_load([_key(2), _key(3), _key(4), _key(5)], ctx)  # every chunk pinned by a load
    assert manager.prepare_store([_key(6)], ctx) is None
    _check(manager)
    manager.complete_load([_key(2), _key(3), _key(4)], ctx)  # _key(5) still loading
    out = manager.prepare_store([_key(6), _key(7), _key(8)], ctx)
    assert out is not None and set(out.evicted_keys) == {_key(2), _key(3), _key(4)}
    assert manager.lookup(_key(5), ctx) is LookupResult.HIT
    assert manager.lookup(_key(6), ctx) is LookupResult.HIT_PENDING
    manager.complete_store([_key(6), _key(7)], ctx)
    manager.complete_store([_key(8)], ctx, success=False)
    assert manager.lookup(_key(8), ctx) is LookupResult.MISS
    _check(manager)

    manager.complete_load([_key(5)], ctx)
    manager.on_request_finished(ctx)
    _check(manager)
    manager.reset_cache()
    assert all(manager.lookup(_key(i), ctx) is LookupResult.MISS for i in range(9))
    assert len(manager._policy.policy) == 0
    _check(manager)


@pytest.mark.parametrize("name", ["hit-density", "lru", "s3fifo"])
def test_a_random_workload_never_evicts_a_chunk_in_use(name):
    """Requests of shared prefixes load what is cached and store what is not, with loads held
    across requests; the stored chunks never exceed the tier and a loading chunk stays."""
    rng = random.Random(7)
    manager = _manager(name, num_chunks=16)
    loading: list[tuple[list, ReqContext]] = []
    for r in range(300):
        ctx = ReqContext(f"r{r}")
        manager.on_new_request(ctx)
        prefix = rng.randrange(6)
        keys = [_key(prefix * 100 + i) for i in range(rng.randrange(1, 6))]
        hits = []
        for key in keys:
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            hits.append(key)
        if hits:
            manager.prepare_load(hits, ctx)
            loading.append((hits, ctx))
        out = manager.prepare_store(keys[len(hits):], ctx)
        if out is not None:
            manager.complete_store(out.keys_to_store, ctx, success=rng.random() > 0.1)
        for held, _ in loading:
            assert all(manager.lookup(key, ctx) is LookupResult.HIT for key in held)
        if len(loading) > 3:
            held, held_ctx = loading.pop(0)
            manager.complete_load(held, held_ctx)
            manager.on_request_finished(held_ctx)
        _check(manager)
        assert len(manager._policy.policy) <= 16


def test_touch_and_reuse_reach_the_kvkit_policy_as_hits():
    manager = _manager("lru", num_chunks=3)
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    manager.complete_store(manager.prepare_store([_key(1), _key(2), _key(3)], ctx).keys_to_store, ctx)
    manager.touch([_key(1)], ctx)  # the LRU order is now 2, 3, 1
    out = manager.prepare_store([_key(4)], ctx)
    assert out.evicted_keys == [_key(2)]
    manager.complete_store([_key(4)], ctx)
    reader = ReqContext("r2")
    manager.on_new_request(reader)
    manager.prepare_load([_key(3)], reader)
    manager.complete_load([_key(3)], reader)
    manager.on_request_finished(reader)  # reused 3: the LRU order is now 1, 4, 3
    assert manager.prepare_store([_key(5)], ctx).evicted_keys == [_key(1)]


class _ThroughVllm:
    """A kvkit ``EvictionPolicy`` whose every call goes through the ``CachePolicy`` adapter as vLLM's manager
    makes it: ``on_pin``/``on_unpin`` are a load's ``ref_cnt`` 0 -> 1 -> 0 with ``mark_non_evictable`` /
    ``mark_evictable``, a selection is ``evict(n, protected)`` with the blocks the driver may not evict
    protected (the adapter removes its victims at once; the driver's ``on_remove`` then finds them gone).
    Chain parents do not pass: vLLM's ``CachePolicy`` has no way to carry them. The contracts below leave
    their refusal rule off: vLLM's manager is the adapter's only caller and its ``CachePolicy`` contract
    allows what kvkit refuses (``touch`` of an uncached key)."""

    def __init__(self, name: str) -> None:
        self.adapter = cache_policy_class(name)(cache_capacity=EvictionPolicyContract.max_blocks)
        self.keys: dict[int, bytes] = {}
        self.evicted: set[int] = set()

    def on_insert(self, block, block_hash, parent) -> None:
        chunk = ChunkStatus(block)
        chunk.ref_cnt = 0  # stored and idle, as a completed store leaves it
        self.keys[block] = block_hash.to_bytes(8, "big")
        self.adapter.insert(self.keys[block], chunk)

    def on_access(self, block) -> None:
        self.adapter.touch([self.keys[block]], ReqContext("contract"))

    def on_remove(self, block) -> None:
        key = self.keys.pop(block)
        if block in self.evicted:
            self.evicted.remove(block)
        else:
            self.adapter.remove(key)

    def select_victims(self, n, is_evictable):
        protected = {key for block, key in self.keys.items() if not is_evictable(block)}
        evicted = self.adapter.evict(n, protected)
        if evicted is None:
            return None
        victims = [chunk.chunk_id for _, chunk in evicted]
        self.evicted.update(victims)
        return victims

    def on_pin(self, block) -> None:
        self.adapter.get(self.keys[block]).ref_cnt = 1
        self.adapter.mark_non_evictable(self.keys[block])

    def on_unpin(self, block) -> None:
        self.adapter.get(self.keys[block]).ref_cnt = 0
        self.adapter.mark_evictable(self.keys[block])

    def __len__(self) -> int:
        return len(self.keys)

    def check_invariants(self) -> None:
        assert not self.evicted, self.evicted  # the driver removed every victim
        self.adapter.check_invariants()


class _LRUThroughVllm(LRUContract):
    def make_policy(self):
        return _ThroughVllm("lru")


class _FIFOThroughVllm(FIFOContract):
    def make_policy(self):
        return _ThroughVllm("fifo")


class _HitDensityThroughVllm(EvictionPolicyContract):
    def make_policy(self):
        return _ThroughVllm("hit-density")


class _HitDensityThroughVllmUnpinned(_HitDensityThroughVllm):
    drive_pin_hooks = False  # pins reach the adapter only as protected keys


class _S3FIFOThroughVllm(EvictionPolicyContract):
    def make_policy(self):
        return _ThroughVllm("s3fifo")


# kvkit's eviction contract, driven through vLLM's CachePolicy calls: exact LRU and FIFO orders survive
TestLRUThroughVllm = _LRUThroughVllm.TestCase
TestFIFOThroughVllm = _FIFOThroughVllm.TestCase
TestHitDensityThroughVllm = _HitDensityThroughVllm.TestCase
TestHitDensityThroughVllmUnpinned = _HitDensityThroughVllmUnpinned.TestCase
TestS3FIFOThroughVllm = _S3FIFOThroughVllm.TestCase


# -- the secondary tier -------------------------------------------------------------------------


def _config(extra: dict, *, engine: str, model: str = "tiny-llama") -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.attn",), group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES, enable_kv_cache_events=False, extra_config=extra,
        engine_id=engine, model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def _tiering(tier: dict, *, engine: str, chunks: int = 8):
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": chunks * CHUNK_BYTES,
             "eviction_policy": "KVKitCachePolicy", "cache_policy_module_path": POLICY_MODULE,
             "secondary_tiers": [{"type": "KVKitSecondaryTier", "module_path": TIER_MODULE, **tier}]}
    manager = TieringOffloadingSpec(_config(extra, engine=f"{engine}-{os.getpid()}")).get_manager()
    assert isinstance(manager.primary_tier._policy, KVKitCachePolicy)
    (secondary,) = manager.secondary_tiers
    assert isinstance(secondary, KVKitSecondaryTier)
    return manager, secondary


def _payload(key) -> bytes:
    return (key * (CHUNK_BYTES // len(key) + 1))[:CHUNK_BYTES]


def _settle(manager, tier, until, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "the tiering manager did not settle"
        manager.on_schedule_end(IDLE)
        tier.check_invariants()
        time.sleep(0.005)


def _store_through_the_primary(manager, tier, keys) -> None:
    """A request computes ``keys``: the stand-in worker copies each chunk into its primary row."""
    ctx = ReqContext("writer")
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    rows = np.asarray(manager.primary_tier.get_kv_memoryview())
    for key, chunk in zip(out.keys_to_store, out.store_spec.block_ids):
        rows[chunk] = np.frombuffer(_payload(key), np.int8)  # one row per chunk, as the GPU->CPU copy writes it
    manager.complete_store(out.keys_to_store, ctx)  # cascades to the secondary tier
    manager.on_request_finished(ctx)
    _settle(manager, tier, lambda: not manager.has_pending_work())


def _lookup_all(manager, tier, keys, ctx) -> list[LookupResult]:
    """What vLLM's scheduler does for a waiting request: look every key up, step, repeat."""
    deadline = time.monotonic() + 10
    while True:
        results = [manager.lookup(key, ctx) for key in keys]
        if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
            return results
        assert time.monotonic() < deadline, results
        manager.on_schedule_end(IDLE)
        tier.check_invariants()
        time.sleep(0.005)


def _round_trip(manager, tier) -> None:
    keys = [_key(i) for i in range(5)]
    _store_through_the_primary(manager, tier, keys)
    assert tier.store.contains([tier.store_key(key) for key in keys]) == 5
    manager.reset_cache()  # the primary forgets; the secondary keeps
    ctx = ReqContext("reader")
    manager.on_new_request(ctx)
    assert manager.primary_tier.lookup(keys[0], ctx) is LookupResult.MISS
    assert _lookup_all(manager, tier, [*keys, _key(99)], ctx) == [LookupResult.HIT] * 5 + [LookupResult.MISS]
    spec = manager.prepare_load(keys, ctx)
    rows = np.asarray(manager.primary_tier.get_kv_memoryview())
    assert [rows[c].tobytes() for c in spec.block_ids] == [_payload(key) for key in keys]
    manager.complete_load(keys, ctx)
    manager.on_request_finished(ctx)
    _settle(manager, tier, lambda: not manager.has_pending_work())


def test_a_disk_store_tier_cascades_and_promotes_under_vllms_tiering_manager(tmp_path, caplog):
    manager, tier = _tiering({"url": f"file://{tmp_path}/kv", "capacity_bytes": "1MiB"}, engine="disk")
    try:
        assert tier.locality is None and tier.medium.value == "STORAGE"
        _round_trip(manager, tier)
    finally:
        manager.shutdown()
    with pytest.raises(KVKitError):  # the tier closed the store it opened
        tier.store.contains([tier.store_key(_key(1))])
    assert "Failed to close mmap_obj" not in caplog.text  # nor holds the primary's memory past shutdown


def test_the_cpu_platform_refuses_the_offloading_worker():
    """Why the tests stand in for the worker: vLLM builds none on this platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        pytest.skip("this platform runs vLLM's offloading worker")
    spec = TieringOffloadingSpec(_config({"cpu_bytes_to_use": CHUNK_BYTES}, engine="worker"))
    with pytest.raises(Exception, match="only supported on CUDA-alike and XPU GPUs"):  # vLLM raises a bare Exception
        spec.get_worker(kv_caches=None)


def test_a_valkey_store_tier_cascades_and_promotes_under_vllms_tiering_manager():
    from kvkit.testing.servers import LocalServer, server_binary_or_skip

    with LocalServer(server_binary_or_skip()) as server:
        manager, tier = _tiering({"url": server.url, "tenant": "team-a", "locality": "REMOTE"}, engine="valkey")
        try:
            assert tier.locality.value == "REMOTE"
            assert tier.store_key(_key(1)).startswith(b"kvkit:team-a:vllm:")
            _round_trip(manager, tier)
        finally:
            manager.shutdown()


def test_a_reset_drains_cascades_in_flight(tmp_path):
    """vLLM's reset_cache asks each tier to drain, then requires every job reported."""
    manager, tier = _tiering({"url": f"file://{tmp_path}/kv", "capacity_bytes": "1MiB"}, engine="drain")
    try:
        keys = [_key(i) for i in range(6)]
        ctx = ReqContext("writer")
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        manager.complete_store(out.keys_to_store, ctx)  # six puts queued, none polled
        manager.on_request_finished(ctx)
        manager.reset_cache()  # drain_jobs, then vLLM asserts no job is left
        assert not manager.has_pending_work()
        assert tier.store.contains([tier.store_key(key) for key in keys]) == 6  # drained, not dropped
        tier.check_invariants()
    finally:
        manager.shutdown()


def test_the_secondary_tier_warns_that_values_on_a_server_beyond_loopback_are_unauthenticated():
    """Its values carry no kvkit header: a Valkey server beyond loopback is warned about once, by the shared
    tier's rule (the store connects lazily: the name need not resolve); a disk store is not."""
    url = f"valkey://kvkit-unauthenticated-{os.getpid()}.invalid:6379"
    with pytest.warns(RuntimeWarning, match=f"values kept on kvkit-unauthenticated-{os.getpid()}.invalid:6379 "
                                            "are not authenticated"):
        manager, _ = _tiering({"url": url, "request_timeout_s": 0.3}, engine="unauthenticated")
    manager.shutdown()


def test_a_password_in_the_secondary_tiers_entry_is_taken_with_a_warning_that_does_not_show_it(monkeypatch):
    """The tier's entry is in vLLM's kv_transfer_config (on its command line and in the arguments vLLM logs at
    start): a password written in its URL or as its option is taken, by a server that needs it, with one warning
    naming password_env and password_file that shows no password; the password's variable named warns nothing."""
    import warnings

    from kvkit.testing.servers import LocalServer, server_binary_or_skip

    password = "hunter2-s3cr3t"
    monkeypatch.setenv("KVKIT_TEST_PASSWORD", password)
    server = LocalServer(server_binary_or_skip(), password=password).start()
    address = f"127.0.0.1:{server.port}"
    try:
        for i, (entry, warned) in enumerate([
                ({"url": f"valkey://:{password}@{address}/0"}, 1),
                ({"url": f"valkey://{address}/0?password={password}"}, 1),
                ({"url": f"valkey://{address}/0", "password": password}, 1),
                ({"url": f"valkey://{address}/0?password_env=KVKIT_TEST_PASSWORD"}, 0),
                ({"url": f"valkey://{address}/0", "password_env": "KVKIT_TEST_PASSWORD"}, 0)]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                manager, tier = _tiering({**entry, "request_timeout_s": 1}, engine=f"password-{i}")
            try:
                said = [str(w.message) for w in caught if "password" in str(w.message)]
                assert len(said) == warned, (entry, said)
                assert all("s3cr3t" not in text and "password_env" in text for text in said), said
                _store_through_the_primary(manager, tier, [_key(i)])
                assert tier.store.contains([tier.store_key(_key(i))]) == 1, entry  # taken: the server let it in
            finally:
                manager.shutdown()
    finally:
        server.stop()


def test_a_dead_valkey_server_makes_misses_and_failed_cascades_never_a_hang():
    from kvkit.testing.servers import LocalServer, server_binary_or_skip

    server = LocalServer(server_binary_or_skip()).start()
    manager, tier = _tiering({"url": server.url, "request_timeout_s": 0.3}, engine="dead")
    try:
        _store_through_the_primary(manager, tier, [_key(1)])
        manager.get_stats()  # vLLM's metrics from here on
        server.kill()
        _store_through_the_primary(manager, tier, [_key(2)])  # settles: the cascade was reported
        failures = {name: value for name, value in manager.get_stats().reduce().items()
                    if name.startswith(TieringOffloadingMetrics.CASCADE_JOB_FAILURES)}
        assert list(failures.values()) == [1], failures
        manager.reset_cache()
        ctx = ReqContext("reader")
        manager.on_new_request(ctx)
        assert _lookup_all(manager, tier, [_key(1), _key(2)], ctx) == [LookupResult.MISS] * 2
        manager.on_request_finished(ctx)
    finally:
        manager.shutdown()
        server.stop()


def test_two_engines_of_one_model_share_chunks_and_other_models_do_not(tmp_path):
    url = f"file://{tmp_path}/kv"
    first, first_tier = _tiering({"url": url, "capacity_bytes": "1MiB"}, engine="a")
    second, second_tier = _tiering({"url": url, "capacity_bytes": "1MiB"}, engine="b")
    try:
        _store_through_the_primary(first, first_tier, [_key(1), _key(2)])
        assert second_tier.store_key(_key(1)) == first_tier.store_key(_key(1))
        ctx = ReqContext("other-engine")
        second.on_new_request(ctx)
        assert _lookup_all(second, second_tier, [_key(1), _key(2)], ctx) == [LookupResult.HIT] * 2
        second.on_request_finished(ctx)
        _settle(second, second_tier, lambda: not second.has_pending_work())
    finally:
        first.shutdown()
        second.shutdown()


def test_keys_differ_by_model_tenant_and_row_length():
    def prefix(model="tiny-llama", tenant="default", chunk_bytes=CHUNK_BYTES):
        spec = TieringOffloadingSpec(_config({"cpu_bytes_to_use": CHUNK_BYTES}, engine="keys", model=model))
        return tier_key_prefix(spec, tenant, chunk_bytes)

    assert prefix() == prefix()
    assert len({prefix(), prefix(model="other"), prefix(tenant="team-b"), prefix(chunk_bytes=2 * CHUNK_BYTES)}) == 4
    assert prefix(tenant="team-b").startswith(b"kvkit:team-b:vllm:")


def test_a_promotion_whose_value_vanished_fails_and_becomes_a_miss(tmp_path):
    manager, tier = _tiering({"url": f"file://{tmp_path}/kv", "capacity_bytes": "1MiB"}, engine="vanish")
    try:
        keys = [_key(1), _key(2)]
        _store_through_the_primary(manager, tier, keys)
        manager.reset_cache()
        ctx = ReqContext("reader")
        manager.on_new_request(ctx)
        deadline = time.monotonic() + 10
        while manager.lookup(keys[0], ctx) is not LookupResult.HIT_PENDING:  # promotion queued, not submitted
            assert time.monotonic() < deadline
            manager.on_schedule_end(IDLE)
            time.sleep(0.005)
        for root, _, files in os.walk(tmp_path):
            for name in files:
                os.remove(os.path.join(root, name))
        assert _lookup_all(manager, tier, keys[:1], ctx) == [LookupResult.MISS]
        assert manager.primary_tier.lookup(keys[0], ctx) is LookupResult.MISS  # its slot was freed
        manager.on_request_finished(ctx)
        _settle(manager, tier, lambda: not manager.has_pending_work())
    finally:
        manager.shutdown()


@pytest.mark.parametrize(("entry", "match"), [
    ({"url": "ftp://nowhere"}, "ftp://nowhere"),
    ({"url": "file:///tmp/kvkit-tier-never"}, "capacity_bytes"),
    ({"url": "memory://tier-bad", "tenant": "a:b"}, "'a:b'"),
    ({"url": "memory://tier-bad", "locality": "NEAR"}, "'NEAR'"),
])
def test_a_bad_tier_entry_is_refused_quoting_it(entry, match):
    with pytest.raises(ConfigError, match=match):
        _tiering(entry, engine="bad")
