"""The block-store contract on every built-in store (real servers for Valkey), and proof that it catches bugs."""

from __future__ import annotations

import contextlib
import shutil
import tempfile

import pytest
from hypothesis import Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from kvkit.backends.blockstore._common import wanted_tickets
from kvkit.backends.blockstore.disk import DiskStore
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.backends.blockstore.valkey import ValkeyStore
from kvkit.errors import ConfigError
from kvkit.testing import BlockStoreContract

# --- every built-in joins the contract in three lines ------------------------

# Variants of a store already run at full strength get fewer examples (the CI budget).
_FEWER = settings(max_examples=min(60, settings().max_examples))


class MemoryContract(BlockStoreContract):
    def make_store(self):
        return MemoryStore()


TestMemory = MemoryContract.TestCase


class SmallMemoryContract(BlockStoreContract):
    may_drop = True

    def make_store(self):
        return MemoryStore(capacity_bytes=70_000)


TestSmallMemory = SmallMemoryContract.TestCase
TestSmallMemory.settings = _FEWER


class DiskContract(BlockStoreContract):
    capacity = 1 << 30

    def make_store(self):
        return DiskStore(tempfile.mkdtemp(prefix="kvkit-disk-contract-"), self.capacity)

    def release_store(self, store):
        shutil.rmtree(store.path, ignore_errors=True)


TestDisk = DiskContract.TestCase
TestDisk.settings = _FEWER


class SmallDiskContract(DiskContract):
    may_drop = True
    capacity = 70_000


TestSmallDisk = SmallDiskContract.TestCase
TestSmallDisk.settings = _FEWER


class UncachedDiskContract(SmallDiskContract):
    def make_store(self):
        return DiskStore(tempfile.mkdtemp(prefix="kvkit-disk-contract-"), self.capacity, page_cache=False)


TestUncachedDisk = UncachedDiskContract.TestCase
TestUncachedDisk.settings = _FEWER


class ValkeyContract(BlockStoreContract):
    server = None  # bound by the fixture below

    def make_store(self):
        self.server.call(b"FLUSHALL")
        return ValkeyStore([("127.0.0.1", self.server.port)], request_timeout_s=5.0)

    def drop(self, store, key):
        self.server.call(b"DEL", key)
        return True


class ClusterContract(BlockStoreContract):
    cluster = None

    def make_store(self):
        for node in self.cluster.nodes:
            node.call(b"FLUSHALL")
        return ValkeyStore([("127.0.0.1", self.cluster.nodes[0].port)], cluster=True, request_timeout_s=5.0)

    def drop(self, store, key):
        for node in self.cluster.nodes:  # only the owner holds it; the others answer MOVED
            try:
                node.call(b"DEL", key)
            except Exception:  # noqa: BLE001 - MOVED from the nodes that do not own the slot
                continue
        return True


@pytest.fixture
def _bind_servers(monkeypatch, valkey_server):
    monkeypatch.setattr(ValkeyContract, "server", valkey_server)


@pytest.fixture
def _bind_cluster(monkeypatch, valkey_cluster):
    monkeypatch.setattr(ClusterContract, "cluster", valkey_cluster)


class RedisContract(ValkeyContract):
    server = None


@pytest.fixture
def _bind_redis(monkeypatch, redis_server):
    monkeypatch.setattr(RedisContract, "server", redis_server)


TestValkey = pytest.mark.usefixtures("_bind_servers")(ValkeyContract.TestCase)
TestRedis = pytest.mark.usefixtures("_bind_redis")(RedisContract.TestCase)
TestRedis.settings = _FEWER
TestValkeyCluster = pytest.mark.usefixtures("_bind_cluster")(ClusterContract.TestCase)
TestValkeyCluster.settings = _FEWER


# --- planted bugs: each check can fail ----------------------------------------

_FIND_BUG = settings(max_examples=300, phases=[Phase.generate], database=None, deadline=None, derandomize=True,
                     report_multiple_bugs=False)


class _CountsEveryHit(MemoryStore):
    """contains counts every present key, not the leading run."""

    def contains(self, keys, *, timeout_s=None):
        return sum(k in self._values for k in keys)


class _AcceptsShortValues(MemoryStore):
    """A value shorter than the buffers fills their start and is reported landed."""

    def get(self, keys, buffers):
        ticket = self._tickets.issue(len(keys))
        for key, parts in zip(keys, buffers):
            value = self._values.get(key, b"")
            view = memoryview(bytearray(sum(len(p) for p in parts)))
            view[:min(len(value), len(view))] = value[:len(view)]
            at = 0
            for p in parts:
                p[:] = view[at:at + len(p)]
                at += len(p)
        self._tickets.report(ticket)
        return ticket


class _LosesWrites(MemoryStore):
    """Every third put is reported landed but not kept."""

    def put(self, keys, values):
        self._puts = getattr(self, "_puts", 0) + 1
        if self._puts % 3:
            return super().put(keys, values)
        ticket = self._tickets.issue(len(keys))
        self._tickets.report(ticket)
        return ticket


class _KeysOnAPrefix(MemoryStore):
    """Keys are truncated (a too-short file name or key), so similar keys collide."""

    def put(self, keys, values):
        return super().put([k[:-2] for k in keys], values)

    def get(self, keys, buffers):
        return super().get([k[:-2] for k in keys], buffers)

    def contains(self, keys, *, timeout_s=None):
        return super().contains([k[:-2] for k in keys], timeout_s=timeout_s)


class _NoLookupBudget(MemoryStore):
    """contains refuses ``timeout_s``, so a scheduler cannot bound a lookup by what its step has left."""

    def contains(self, keys):
        return super().contains(keys)


class _ForgetsTickets(MemoryStore):
    """A get whose keys all miss is never reported."""

    def get(self, keys, buffers):
        if keys and not any(k in self._values for k in keys):
            return self._tickets.issue(len(keys))
        return super().get(keys, buffers)


class _ReportsTwice(MemoryStore):
    """poll reports every result twice."""

    def poll(self, tickets, timeout=0.0):
        done = super().poll(tickets, timeout)
        return done + done


class _ReusesTickets(MemoryStore):
    """Tickets restart from 0 after each poll."""

    def poll(self, tickets, timeout=0.0):
        done = super().poll(tickets, timeout)
        self._tickets._next = 0
        return done


class _HandsOutEveryResult(MemoryStore):
    """poll reports every finished ticket, named or not: one caller takes another's results."""

    def poll(self, tickets, timeout=0.0):
        wanted_tickets(tickets)
        return super().poll(range(self._tickets._next), timeout)


class _LosesOthersResults(MemoryStore):
    """poll takes every finished result and keeps only the named ones: the other callers' are lost."""

    def poll(self, tickets, timeout=0.0):
        wanted = wanted_tickets(tickets)
        return [r for r in super().poll(range(self._tickets._next), timeout) if r.ticket in wanted]


class _AcceptsAnyTickets(MemoryStore):
    """poll(7) is taken for "no ticket" instead of raising ConfigError."""

    def poll(self, tickets, timeout=0.0):
        return super().poll(tickets if isinstance(tickets, list | set | tuple | range) else (), timeout)


class _SaysAKeyWasSentAndNot(MemoryStore):
    """Its results name every failed key both unreached and unsent (a result built past StoreResult's checks)."""

    def poll(self, tickets, timeout=0.0):
        done = super().poll(tickets, timeout)
        for result in done:
            object.__setattr__(result, "unreached", result.failed)
            object.__setattr__(result, "unsent", result.failed)
        return done


class _ServesAfterDrop(MemoryStore):
    """drop forgets the size accounting but keeps serving the value."""

    def drop(self, key):
        return key in self._values


class _LiveAfterClose(MemoryStore):
    """Calls after close still work."""

    def close(self):
        pass


class _ChecksNothing(MemoryStore):
    """A malformed put is swallowed and reported landed instead of raising."""

    def put(self, keys, values):
        try:
            return super().put(keys, values)
        except ConfigError:
            ticket = self._tickets.issue(len(keys))
            self._tickets.report(ticket)
            return ticket


class _WritesBeforeChecking(MemoryStore):
    """A put refused for one value's buffers has written the values before it."""

    def put(self, keys, values):
        try:
            return super().put(keys, values)
        except ConfigError as exc:
            if "C-contiguous" in str(exc):  # the buffers, not the keys or their count
                for key, parts in zip(keys, values):
                    with contextlib.suppress(ConfigError):
                        super().put([key], [parts])
            raise


class _DriftingDisk(DiskStore):
    """The disk store's usage counter misses overwritten files."""

    def _forget(self, name, *, unlink=True):
        entry = self._index.get(name)
        super()._forget(name, unlink=unlink)
        if entry is not None:
            self.used_bytes += entry[1]


def _memory_machine(store_cls):
    return type(f"Buggy{store_cls.__name__}", (BlockStoreContract,), {"make_store": lambda self: store_cls()})


_SELF_CHECK_FAILURES: list[AssertionError] = []
"""The failures a planted disk store's own ``check_invariants`` raised during a contract run."""


def _disk_machine(store_cls):
    """A disk store whose self-check failures are recorded as well as raised.

    Its I/O thread may finish calls in another order when Hypothesis replays
    the failing case, so the replay can pass or draw differently and
    Hypothesis reports a flaky run instead of the failure: the record shows
    that the contract's consistency check caught the bug all the same.
    """

    class Recording(store_cls):
        def check_invariants(self):
            try:
                super().check_invariants()
            except AssertionError as exc:
                _SELF_CHECK_FAILURES.append(exc)
                raise

    return type(f"Buggy{store_cls.__name__}", (DiskContract,),
                {"make_store": lambda self: Recording(tempfile.mkdtemp(prefix="kvkit-bug-"), 1 << 30, threads=1)})


@pytest.mark.parametrize("machine", [
    _memory_machine(_CountsEveryHit), _memory_machine(_AcceptsShortValues), _memory_machine(_LosesWrites),
    _memory_machine(_KeysOnAPrefix), _memory_machine(_NoLookupBudget), _memory_machine(_ForgetsTickets),
    _memory_machine(_ReportsTwice),
    _memory_machine(_ReusesTickets), _memory_machine(_HandsOutEveryResult), _memory_machine(_LosesOthersResults),
    _memory_machine(_AcceptsAnyTickets), _memory_machine(_SaysAKeyWasSentAndNot), _memory_machine(_ServesAfterDrop),
    _memory_machine(_LiveAfterClose),
    _memory_machine(_ChecksNothing), _memory_machine(_WritesBeforeChecking),
    _disk_machine(_DriftingDisk),
], ids=lambda m: m.__name__.removeprefix("Buggy_"))
def test_contract_catches_planted_bug(machine):
    """The contract's checks catch each planted failure mode."""
    machine.report_timeout_s = 0.5
    _SELF_CHECK_FAILURES.clear()
    try:
        run_state_machine_as_test(machine, settings=_FIND_BUG)
    except AssertionError:
        return
    except Flaky:
        assert _SELF_CHECK_FAILURES, "a flaky run without a failed self-check"
        return
    raise AssertionError(f"{machine.__name__}: the contract did not catch the planted bug")
