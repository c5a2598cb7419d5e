"""StackConfig validation (every problem in one ConfigError), resolve, and parse_bytes."""

import math
import re

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvkit.config import DEFAULTS, Components, StackConfig, parse_bytes
from kvkit.errors import ConfigError, InsufficientMemoryError
from kvkit.interfaces import (
    BlockAllocator,
    CopyBackend,
    EvictionPolicy,
    KVCacheSpec,
    KVGroupSpec,
    OffloadCallback,
    StorePolicy,
)
from kvkit.registry import ALLOCATOR, COPY, EVICTION, STORE
from kvkit.testing.doubles import InertPolicy

KV = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="float16")


class FakeEviction(InertPolicy):
    pass


class FakeStore:
    def __init__(self, k=1):
        self.k = k

    def on_computed(self, request, start, stop): return range(start, stop)
    def on_finished(self, request): return ()
    def writeback_target(self, gpu_free, gpu_blocks): return 0


class FakeCopy:
    @classmethod
    def is_available(cls): return True
    def register(self, regions): pass
    def submit(self, plan, *, after=None): return 0
    def poll(self): return []
    def wait(self, handle): pass


class OffCopy(FakeCopy):
    @classmethod
    def is_available(cls): return False


@attrs.define
class FakePool:
    num_blocks: int
    eviction: object
    tag: str = ""
    num_free: int = 0
    def allocate(self, n): return []
    def incref(self, blocks): pass
    def decref(self, blocks): pass
    def commit(self, blocks, hashes, parents=None): return []
    def lookup(self, hashes): return []
    def touch(self, blocks): pass
    def refcount(self, block): return 0
    def block_hash(self, block): return None
    def add_evict_listener(self, listener): pass
    def reset(self): return 0
    def check_invariants(self): pass


@pytest.fixture(autouse=True)
def fake_names(monkeypatch):
    """Register fake components under test-only names in the global registries (undone after)."""
    for reg in (EVICTION, STORE, COPY, ALLOCATOR):
        reg.names()  # read entry points now, so they cannot clash with the fakes later
        monkeypatch.setattr(reg, "_targets", dict(reg._targets))
        monkeypatch.setattr(reg, "_loaded", dict(reg._loaded))
    for reg, name, target in ((EVICTION, "t-evict", FakeEviction), (STORE, "t-store", FakeStore),
                              (COPY, "t-copy", FakeCopy), (COPY, "t-off", OffCopy),
                              (ALLOCATOR, "t-pool", FakePool)):
        reg.register(name, target)


def good(**overrides):
    """Keyword arguments of a valid config, with ``overrides`` applied."""
    kwargs = dict(kv=KV, gpu_blocks=8, cpu_blocks=32, cpu_eviction="t-evict", gpu_eviction="t-evict",
                  store="t-store", copy="t-copy", allocator="t-pool", device="cpu")
    kwargs.update(overrides)
    return kwargs


def problems_of(**overrides):
    """The problems a config with ``overrides`` reports (empty if it is valid)."""
    try:
        StackConfig(**good(**overrides))
    except ConfigError as exc:
        return exc.problems
    return []


def test_valid_config_resolves_to_components():
    """Named slots are built with their options; the tiers get distinct policy instances."""
    config = StackConfig(**good(options={"store": {"k": 3}, "allocator": {"tag": "t"}}))
    parts = config.resolve()
    assert isinstance(parts, Components)
    assert isinstance(parts.gpu_eviction, EvictionPolicy) and isinstance(parts.cpu_eviction, EvictionPolicy)
    assert parts.gpu_eviction is not parts.cpu_eviction
    assert isinstance(parts.store, StorePolicy) and parts.store.k == 3
    assert isinstance(parts.copy, CopyBackend)
    pool = parts.allocator(num_blocks=parts.cpu_blocks, eviction=parts.cpu_eviction)
    assert isinstance(pool, BlockAllocator) and pool.tag == "t" and pool.num_blocks == 32
    assert (parts.gpu_blocks, parts.cpu_blocks, parts.callbacks) == (8, 32, ())


def test_instances_and_factories_are_used_as_given():
    """Instance slots are passed through unchanged and a factory allocator is called and checked."""
    gpu, cpu, store, copy, callback = FakeEviction(), FakeEviction(), FakeStore(), FakeCopy(), OffloadCallback()
    config = StackConfig(**good(gpu_eviction=gpu, cpu_eviction=cpu, store=store, copy=copy,
                                allocator=FakePool, callbacks=[callback]))
    parts = config.resolve()
    assert (parts.gpu_eviction, parts.cpu_eviction, parts.store, parts.copy) == (gpu, cpu, store, copy)
    assert parts.callbacks == (callback,)
    assert isinstance(parts.allocator(num_blocks=4, eviction=gpu), FakePool)
    bad_factory = StackConfig(**good(allocator=lambda **kw: object())).resolve().allocator
    with pytest.raises(ConfigError, match=r"allocator: .* built a object, which is not a BlockAllocator"):
        bad_factory(num_blocks=4, eviction=gpu)


def test_field_defaults_come_from_the_one_defaults_record():
    """Every defaulted slot of StackConfig reads DEFAULTS."""
    fields = attrs.fields_dict(StackConfig)
    for name in ("cpu_eviction", "gpu_eviction", "store", "copy", "allocator", "world_size", "hash_algorithm",
                 "wait_timeout_s"):
        assert fields[name].default == getattr(DEFAULTS, name), name


def test_cpu_bytes_become_blocks():
    """cpu_bytes converts to whole blocks of the kv spec; exactly one block's bytes is enough."""
    per_block = KV.bytes_per_block
    assert StackConfig(**good(cpu_blocks=None, cpu_bytes=per_block)).num_cpu_blocks == 1
    assert StackConfig(**good(cpu_blocks=None, cpu_bytes="1MiB")).num_cpu_blocks == 2**20 // per_block
    assert StackConfig(**good(cpu_blocks=None, cpu_bytes="1MiB")).resolve().cpu_blocks == 2**20 // per_block


# slot -> (bad value, text the single problem must contain)
BAD = {
    "kv": ("8 layers", "kv='8 layers'"),
    "gpu_blocks": (0, "gpu_blocks=0"),
    "cpu_blocks": (-3, "cpu_blocks=-3"),
    "cpu_eviction": ("lur", "cpu_eviction='lur'"),
    "gpu_eviction": (FakeStore(), "gpu_eviction=<"),
    "store": ("eagre", "store='eagre'"),
    "copy": ("t-off", "copy='t-off'"),
    "allocator": (7, "allocator=7"),
    "callbacks": ([OffloadCallback(), "cb"], "callbacks[1]='cb'"),
    "world_size": (0, "world_size=0"),
    "device": ("gpu", "device='gpu'"),
    "hash_algorithm": ("md5", "hash_algorithm='md5'"),
    "options": ({"stroe": {}}, "options['stroe']"),
    "cpu_layout": ("nhd", "cpu_layout='nhd'"),
}


@given(st.sets(st.sampled_from(sorted(BAD))))
def test_every_bad_slot_is_reported_once_in_one_error(broken):
    """Any set of broken slots yields one ConfigError with exactly one problem per slot, each quoting its value."""
    problems = problems_of(**{slot: BAD[slot][0] for slot in broken})
    assert len(problems) == len(broken), problems
    for slot in broken:
        assert sum(BAD[slot][1] in p for p in problems) == 1, (slot, problems)


def test_message_lists_valid_names_and_hints():
    """The error message quotes each bad value, lists valid names and suggests a close match."""
    with pytest.raises(ConfigError) as info:
        StackConfig(**good(cpu_eviction="lur", store="eagre", gpu_blocks=-1))
    message = str(info.value)
    assert message.startswith("3 configuration problems:")
    assert "did you mean 'lru'?" in message and "did you mean 'eager'?" in message
    assert all(name in message for name in EVICTION.names())
    assert isinstance(info.value, ValueError)


def test_wrong_kind_of_object_in_slot():
    """A component of the wrong protocol is rejected, naming slot, type and expected protocol."""
    (problem,) = problems_of(cpu_eviction=FakeStore())
    assert "cpu_eviction=" in problem and "FakeStore is not a EvictionPolicy" in problem
    (problem,) = problems_of(copy=FakeEviction())
    assert "copy=" in problem and "FakeEviction is not a CopyBackend" in problem
    (problem,) = problems_of(store=FakeStore)
    assert "got a class" in problem and "FakeStore()" in problem


def test_unavailable_name_is_reported_with_reason():
    """A registered name that cannot run here is reported with the probe's reason and what is available."""
    (problem,) = problems_of(copy="t-off")
    assert "not available on this machine" in problem and "is_available() returned False" in problem
    assert "t-copy" in problem


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"gpu_blocks": 0}, "gpu_blocks=0: must be an int >= 1"),
    ({"gpu_blocks": -5}, "gpu_blocks=-5"),
    ({"gpu_blocks": None}, "gpu_blocks=None: must be an int >= 1 (required)"),
    ({"gpu_blocks": True}, "gpu_blocks=True"),
    ({"gpu_blocks": 2.0}, "gpu_blocks=2.0"),
    ({"cpu_blocks": 0}, "cpu_blocks=0"),
    ({"cpu_blocks": None, "cpu_bytes": -1}, "cpu_bytes=-1"),
    ({"cpu_blocks": None, "cpu_bytes": "0B"}, "cpu_bytes='0B' (0 bytes) holds no block"),
    ({"cpu_blocks": None, "cpu_bytes": "lots"}, "cpu_bytes='lots'"),
    ({"cpu_blocks": None}, "exactly one of cpu_blocks or cpu_bytes, got neither"),
    ({"cpu_bytes": "1GiB"}, "got both cpu_blocks=32 and cpu_bytes='1GiB'"),
    ({"world_size": 0}, "world_size=0"),
])
def test_capacity_and_count_problems(overrides, needle):
    """Zero, negative, non-int and missing sizes are each reported quoting the value."""
    problems = problems_of(**overrides)
    assert len(problems) == 1 and needle in problems[0], problems


def test_cpu_capacity_below_one_block():
    """cpu_bytes one byte short of a block is rejected, quoting the value and the block size."""
    short = KV.bytes_per_block - 1
    (problem,) = problems_of(cpu_blocks=None, cpu_bytes=short)
    assert f"cpu_bytes={short}" in problem and f"takes {KV.bytes_per_block} bytes" in problem


def test_same_policy_instance_for_both_tiers():
    """One policy object cannot serve both pools."""
    shared = FakeEviction()
    (problem,) = problems_of(cpu_eviction=shared, gpu_eviction=shared)
    assert "same FakeEviction instance" in problem


def test_options_problems():
    """Options must name a slot, be a dict, fit the constructor, and not target an instance."""
    assert "options['stroe']: unknown slot" in problems_of(options={"stroe": {}})[0]
    assert "did you mean 'store'?" in problems_of(options={"stroe": {}})[0]
    assert "options['store']=3" in problems_of(options={"store": 3})[0]
    (problem,) = problems_of(options={"store": {"kk": 2}})
    assert "store='t-store'" in problem and "'kk'" in problem
    (problem,) = problems_of(store=FakeStore(), options={"store": {"k": 2}})
    assert "store is an instance" in problem
    (problem,) = problems_of(options={"allocator": {"size": 2}})
    assert "allocator='t-pool'" in problem and "'size'" in problem
    assert "must be a dict" in problems_of(options=[("store", {})])[0]


def test_allocator_slot():
    """The allocator slot takes a name or a factory, never a pool instance."""
    (problem,) = problems_of(allocator=FakePool(4, None))
    assert "got a pool instance" in problem and "each tier builds its own pool" in problem
    (problem,) = problems_of(allocator="poool")
    assert "allocator='poool': unknown block allocator" in problem
    (problem,) = problems_of(allocator=FakePool, options={"allocator": {"size": 2}})
    assert "allocator=" in problem and "FakePool" in problem and "'size'" in problem


def test_callbacks_problems():
    """Callbacks must be a list of OffloadCallback instances; classes and bare objects get hints."""
    assert "wrap it in a list" in problems_of(callbacks=OffloadCallback())[0]
    assert "callbacks[0]=OffloadCallback: got a class" in problems_of(callbacks=[OffloadCallback])[0]
    assert "callbacks[0]=3" in problems_of(callbacks=[3])[0]


def test_device_problems():
    """Only 'cpu' and 'cuda' are devices, and 'cuda' needs a GPU."""
    assert "did you mean 'cuda'?" in problems_of(device="cude")[0]
    cuda = problems_of(device="cuda")
    assert cuda == [] if torch.cuda.is_available() else "CUDA is not available" in cuda[0]


@pytest.mark.parametrize("timeout", [0, -1.5, math.nan, "60", True, None, [60]])
def test_wait_timeout_problems(timeout):
    """wait_timeout_s must be a number > 0 (math.inf waits forever); a bad one is quoted with a hint."""
    (problem,) = problems_of(wait_timeout_s=timeout)
    assert f"wait_timeout_s={timeout!r}: must be a number in (0" in problem and "math.inf" in problem
    assert problems_of(wait_timeout_s=math.inf) == [] and problems_of(wait_timeout_s=np.float32(0.5)) == []


@pytest.mark.parametrize(("overrides", "needle"), [
    (dict(gpu_blocks=10**12), "pool bookkeeping of gpu_blocks=1000000000000 + cpu_blocks=32"),
    (dict(cpu_blocks=None, cpu_bytes="1000TiB"), "cpu_blocks=67108864000 from cpu_bytes='1000TiB'"),
    (dict(cpu_blocks=10**11), "cpu_blocks=100000000000"),
])
def test_resolve_refuses_pools_the_host_cannot_hold(overrides, needle):
    """resolve() refuses pools whose O(blocks) bookkeeping exceeds host memory, before building anything."""
    config = StackConfig(**good(allocator=lambda **kw: pytest.fail("a pool was built"), **overrides))
    with pytest.raises(InsufficientMemoryError, match=re.escape(needle)):
        config.resolve()


def test_cpu_layout_problems():
    """cpu_layout must name a layout that can hold the kv spec; None (the default) mirrors the GPU tier."""
    assert StackConfig(**good()).cpu_layout is None
    assert StackConfig(**good(cpu_layout="cross-layer")).cpu_layout == "cross-layer"
    assert "did you mean 'cross-layer'?" in problems_of(cpu_layout="cross-layr")[0]
    two_groups = KVCacheSpec(2, 16, 2, 64, groups=[KVGroupSpec([0]), KVGroupSpec([1])])
    (problem,) = problems_of(kv=two_groups, cpu_layout="cross-layer")
    assert "cpu_layout='cross-layer'" in problem and "single KV group" in problem


def test_default_device_matches_machine():
    """The default device is cuda exactly when CUDA is available."""
    config = StackConfig(**{k: v for k, v in good().items() if k != "device"})
    assert config.device == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("text", "expected"), [
    ("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", 3 * 2**29), (" 2 kib ", 2048),
    ("100", 100), ("100B", 100), (".5KiB", 512), ("1.KB", 1000), ("3TB", 3 * 10**12),
    (4096, 4096), (0, 0), ("1.1KiB", 1126),
])
def test_parse_bytes_examples(text, expected):
    """Decimal and binary units, spaces, fractions (rounded down) and plain ints."""
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "8 GiBs", "-1KB", "1e9", "8 G", "1,5GiB", None, -1, True, 2.5, "٣MB"])
def test_parse_bytes_rejects_garbage(text):
    """Garbage raises ConfigError quoting the value."""
    with pytest.raises(ConfigError) as info:
        parse_bytes(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(("text", "says"), [
    ("-1GiB", "byte size '-1GiB' is negative"), (" -2 KB", "byte size ' -2 KB' is negative"),
    (-1, "byte size -1 is negative"),
    ("8 GiBs", ("byte size '8 GiBs': unknown unit 'GiBs'; valid: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; "
               "did you mean 'GiB'?")),
    ("abc", "cannot parse byte size 'abc'; expected an int or a number with a unit"),
])
def test_parse_bytes_says_what_is_wrong(text, says):
    """A negative size is called negative, an unknown unit is named (with the closest one), garbage is garbage."""
    with pytest.raises(ConfigError) as info:
        parse_bytes(text)
    assert says in str(info.value)


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@given(st.integers(0, 10**6), st.sampled_from(sorted(UNITS)), st.sampled_from(["", " "]), st.booleans())
def test_parse_bytes_round_trip(n, unit, space, lower):
    """n with any unit (any case, optional space) parses to n times the unit."""
    assert parse_bytes(f"{n}{space}{unit.lower() if lower else unit}") == n * UNITS[unit]


@given(st.text(max_size=10))
def test_parse_bytes_total(text):
    """Any string parses to a non-negative int or raises ConfigError, nothing else."""
    try:
        value = parse_bytes(text)
    except ConfigError:
        return
    assert isinstance(value, int) and value >= 0
