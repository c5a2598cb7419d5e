"""The shared tier's health on the scheduler side: suspect, off, exponential back-off, probes, recovery."""

import math
import warnings

import pytest

from kvkit.backends.allocator import BlockPool
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.store import EagerStore
from kvkit.errors import ConfigError
from kvkit.interfaces import KVCacheSpec
from kvkit.manager import OffloadManager
from kvkit.shared.client import FormatCodec
from kvkit.shared.scheduler import SharedTierSpec
from kvkit.testing.doubles import FailingStore

SPEC = KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=1, head_dim=2)


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def manager(store, clock, **kw):
    codec = FormatCodec.for_stack(SPEC, 1, model="m", layout="none")
    spec = SharedTierSpec(store=store, codec=codec, clock=clock, backoff_s=1.0, max_backoff_s=4.0, **kw)
    return OffloadManager(SPEC, BlockPool(8, eviction=LRUPolicy()), EagerStore(),
                          gpu=BlockPool(8, eviction=LRUPolicy()), shared=spec)


def test_back_off_doubles_up_to_its_cap_and_resets_on_recovery():
    """Off after a failed probe; each failed retry doubles the wait (1, 2, 4, 4 s); a good probe turns it on."""
    store, clock = FailingStore(MemoryStore(), down=True), Clock()
    mgr = manager(store, clock)
    shared = mgr._shared
    with pytest.warns(RuntimeWarning, match="shared tier is off for 1 s"):
        shared.suspect("a put failed")
        mgr.build_step()  # reads the probe's answer
    assert not shared.available and "backing off 1 s" in mgr.shared_status
    waits = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per outage, not per retry
        for _ in range(4):
            clock.now += 10
            mgr.build_step()  # the retry probe goes out
            assert mgr.shared_status.startswith("off (probing)")
            mgr.build_step()  # and fails
            waits.append(shared._interval)
    assert waits == [2.0, 4.0, 4.0, 4.0]
    assert mgr.stats.shared_outages.value == 1 and mgr.stats.shared_probes.value == 5
    store.down = False
    clock.now += 10
    mgr.build_step()
    mgr.build_step()
    assert shared.available and mgr.shared_status == "on" and mgr.stats.shared_recoveries.value == 1
    assert shared._interval == 1.0
    mgr.check_invariants()


def test_an_infinite_back_off_turns_the_tier_off_for_good_at_its_first_outage():
    """``backoff_s=inf`` (documented: one outage and off for good) is accepted by ``SharedConfig``; after the
    first failed probe no probe is ever sent again, however long the server has been back."""
    from kvkit.config import SharedConfig

    assert SharedConfig(url="memory://", backoff_s=math.inf).backoff_s == math.inf
    store, clock = FailingStore(MemoryStore(), down=True), Clock()
    codec = FormatCodec.for_stack(SPEC, 1, model="m", layout="none")
    spec = SharedTierSpec(store=store, codec=codec, clock=clock, backoff_s=math.inf, max_backoff_s=math.inf)
    mgr = OffloadManager(SPEC, BlockPool(8, eviction=LRUPolicy()), EagerStore(),
                         gpu=BlockPool(8, eviction=LRUPolicy()), shared=spec)
    with pytest.warns(RuntimeWarning, match="shared tier is off for inf s"):
        mgr._shared.suspect("a put failed")
        mgr.build_step()
    store.down = False
    for _ in range(3):
        clock.now += 1e12
        mgr.build_step()
    assert not mgr._shared.available and mgr.stats.shared_probes.value == 1
    assert mgr.stats.shared_recoveries.value == 0 and mgr.shared_status.startswith("off (backing off inf s")


def test_a_failure_that_is_not_the_transport_keeps_the_tier_on():
    """A probe that lands (the server is fine; a key was simply gone) leaves the tier on, no warning."""
    mgr = manager(MemoryStore(), Clock())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr._shared.suspect("a fetch failed")
        assert mgr.shared_status == "suspect" and mgr._shared.available
        mgr.build_step()
    assert mgr.shared_status == "on" and mgr.stats.shared_outages.value == 0


def test_while_off_nothing_is_looked_up_there():
    """An off tier answers no hit without asking the store."""
    class Counting(MemoryStore):
        calls = 0

        def contains(self, keys, *, timeout_s=None):
            Counting.calls += 1
            return super().contains(keys, timeout_s=timeout_s)

    store, clock = FailingStore(Counting(), down=True), Clock()
    mgr = manager(store, clock)
    with pytest.warns(RuntimeWarning):
        mgr._shared.suspect("x")
        mgr.build_step()
    mgr.add_request("r", [1, 2, 3], 13)
    assert mgr.lookup("r", 0) == 0 and Counting.calls == 0


@pytest.mark.parametrize(("kwargs", "quoted"), [({"write": "write-around"}, "write-around"),
                                            ({"writeback_blocks": 0}, "writeback_blocks=0"),
                                            ({"backoff_s": -1}, "backoff_s")])
def test_a_bad_spec_is_refused(kwargs, quoted):
    """SharedTierSpec quotes a bad field."""
    with pytest.raises(ConfigError, match=quoted):
        SharedTierSpec(store=MemoryStore(), codec=FormatCodec.for_stack(SPEC, 1, model="m", layout="none"), **kwargs)


def test_a_store_class_is_not_a_store():
    """Passing the class instead of an instance is refused, quoting it."""
    with pytest.raises(ConfigError, match="MemoryStore"):
        SharedTierSpec(store=MemoryStore, codec=FormatCodec.for_stack(SPEC, 1, model="m", layout="none"))


class _HalfDown(MemoryStore):
    """A Cluster with dead nodes as a client sees it: every other key of every call fails as a transport failure."""

    def poll(self, tickets, timeout=0.0):
        from kvkit.interfaces.shared import StoreResult

        return [StoreResult(r.ticket, range(0, 16, 2), "transport: 127.0.0.1:7001: ConnectionRefusedError")
                for r in super().poll(tickets, timeout)]


def test_a_probe_that_lands_on_any_node_keeps_the_tier_on():
    """The probe fails on some keys only (their nodes are dead): the tier stays on, nothing is said."""
    mgr = manager(_HalfDown(), Clock())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr._shared.suspect("a fetch failed")
        mgr.build_step()
    assert mgr.shared_status == "on" and mgr.stats.shared_outages.value == 0


def test_the_probe_keys_reach_every_node_of_a_small_cluster():
    """Under any tenant's prefix, the probe keys fall in the slots of every node of a 2- to 5-node Cluster."""
    from kvkit.backends.blockstore.resp import key_slot
    from kvkit.shared.scheduler import PROBE_KEYS

    for prefix in [b"kvkit:probe", *(b"kvkit:t%d:%08x:probe" % (i, 2654435761 * i % 2**32) for i in range(20))]:
        for size in range(2, 6):
            step = 16384 // size
            slots = {min(key_slot(prefix + suffix) // step, size - 1) for suffix in PROBE_KEYS}
            assert slots == set(range(size)), (prefix, size)


def test_a_hash_found_absent_is_put_again():
    """A lookup that finds a block put before missing forgets it (and what follows): the recomputed blocks
    are put again, not skipped as already put."""
    store = MemoryStore()
    mgr = manager(store, Clock())
    shared = mgr._shared
    shared._remember([1, 2, 3, 4])
    store.put([shared.spec.codec.key(1, 0)], [[memoryview(b"x")]])
    assert shared.find([1, 2, 3], tail=[4]) == 1
    assert list(shared._known) == [1], "absent hashes are still taken as put"
    assert shared.find([1]) == 1 and list(shared._known) == [1]


def test_a_cpu_hit_not_remembered_is_checked_in_the_lookups_round_trip_or_a_second():
    """The CPU hit's hashes not remembered as held ride after the looked-up ones in one ``contains``: those
    present are remembered, the lost queued for a put; past a tail that stops early a second ``contains``
    asks them alone, without changing the lookup's answer."""
    store = MemoryStore()
    mgr = manager(store, Clock())
    shared, key = mgr._shared, mgr._shared.spec.codec.key
    store.put([key(h, 0) for h in (1, 2, 5)], [[memoryview(b"x")]] * 3)
    shared._remember([3])
    assert shared.find([5], held=[1, 2, 3, 4]) == 1  # asks 5, 1, 2, 4 (3 is remembered)
    assert set(shared._known) == {1, 2, 3, 5}
    assert list(shared._queued) == [4] and mgr.stats.blocks_found_lost.value == 1
    store.put([key(8, 0)], [[memoryview(b"x")]])
    assert shared.find([6], held=[7, 8]) == 0 and 6 not in shared._known
    assert 7 in shared._queued and 8 in shared._queued and mgr.stats.blocks_found_lost.value == 3
    assert shared.find([6], held=[8, 7]) == 0  # both found lost less than trust_s ago: not asked again
    assert mgr.stats.blocks_found_lost.value == 3


def test_the_failed_keys_no_server_answered_are_told_from_the_refused_ones():
    """``StoreResult.unanswered``: the ``unreached`` keys a store names, else every failed key of a transport
    failure (a store that does not tell them apart), else none; ``unreached`` beyond ``failed`` is refused."""
    from kvkit.errors import PlanError
    from kvkit.interfaces.shared import StoreResult

    assert StoreResult(0, [3, 1, 3], "transport: down; OOM", [3]).unanswered == (3,)
    assert StoreResult(0, [1, 3], "transport: down").unanswered == (1, 3)
    assert StoreResult(0, [1, 3], "OOM command not allowed").unanswered == ()
    assert StoreResult(0, [1, 3], "transport: down; OOM", []).unanswered == ()
    with pytest.raises(PlanError, match=r"unreached=\(2,\)"):
        StoreResult(0, [1, 3], "transport: down", [2])


def test_the_failed_keys_never_sent_are_told_from_those_sent_and_unanswered():
    """``StoreResult.unsent``: failed keys never sent, disjoint from ``unreached``, no evidence against a server
    (not :attr:`~StoreResult.unanswered`, also where the store names no ``unreached``); ``None`` for a store that
    does not tell. Bad input (not key indices, keys that did not fail, keys also unreached) is a ``PlanError``
    quoting it, and leaves the input as it was."""
    from kvkit.errors import PlanError
    from kvkit.interfaces.shared import StoreResult

    assert StoreResult(0, [1, 3], "transport: down").unsent is None
    told = StoreResult(0, [5, 1, 3], "transport: deadline", [1], [5, 3, 5])
    assert told.unsent == (3, 5) and told.unreached == (1,) and told.unanswered == (1,)
    assert StoreResult(0, [1, 3], "transport: deadline", unsent=[3]).unanswered == (1,)
    assert StoreResult(0, [1, 3], "transport: deadline", unsent=range(4)[1::2]).unanswered == ()
    assert StoreResult(0, [1, 3], "OOM command not allowed", unsent=[]).unanswered == ()
    for bad, quoted in [([2], r"unsent=\(2,\)"), ("13", r"unsent='13'"), ([1, -3], r"unsent=\[1, -3\]"),
                        ([1.0], r"unsent=\[1\.0\]"), ([True], r"unsent=\[True\]"), (3, r"unsent=3"),
                        ([3, 1], r"unsent=\(1, 3\): keys also unreached")]:
        before = list(bad) if isinstance(bad, list) else bad
        with pytest.raises(PlanError, match=quoted):
            StoreResult(0, [1, 3], "transport: deadline", [1, 3] if "unreached" in quoted else None, bad)
        assert bad == before
    with pytest.raises(PlanError, match=r"failed=\['x'\]"):
        StoreResult(0, ["x"], "transport: down")


class _Unsent(MemoryStore):
    """A client whose calls wait in its own queue: the probe's first ``unsent`` keys fail never sent, the
    next ``unreached`` sent and unanswered, the rest are stored."""

    def __init__(self, unsent, unreached=0):
        super().__init__()
        self.unsent, self.unreached = unsent, unreached

    def poll(self, tickets, timeout=0.0):
        from kvkit.interfaces.shared import StoreResult

        done = super().poll(tickets, timeout)
        failed = range(self.unsent + self.unreached)
        return [StoreResult(r.ticket, failed, "transport: the call's deadline passed" if failed else "",
                            failed[self.unsent:], failed[:self.unsent]) for r in done]


@pytest.mark.parametrize(("unsent", "unreached"), [(64, 0), (60, 4), (1, 63)])
def test_a_probe_no_server_was_asked_decides_nothing_and_is_sent_again(unsent, unreached):
    """A probe with keys never sent and none answered neither turns the tier off nor on: it is sent again at the
    next step (counted); once sent and unanswered on every key it turns the tier off; one answered key of a
    retry turns it on."""
    store, clock = _Unsent(unsent, unreached), Clock()
    mgr = manager(store, clock)
    shared = mgr._shared
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared.suspect("a put failed")
        mgr.build_step()  # the probe's answer: no server asked
        assert mgr.shared_status == "suspect" and shared._probe is None
        mgr.build_step()  # sent again
        assert mgr.stats.shared_probes.value == 2 and shared._probe is not None
    store.unsent, store.unreached = 0, 64
    with pytest.warns(RuntimeWarning, match="shared tier is off"):
        mgr.build_step()
    assert mgr.stats.shared_outages.value == 1
    store.unsent, store.unreached = 64, 0
    clock.now += 10
    mgr.build_step()  # the retry goes out
    mgr.build_step()  # no server asked: still off, probing
    assert mgr.shared_status.startswith("off (probing)") and shared._probe is None
    store.unsent, store.unreached = 0, 63
    mgr.build_step()  # sent again
    mgr.build_step()  # one key stored
    assert mgr.shared_status == "on" and mgr.stats.shared_recoveries.value == 1
    assert mgr.stats.shared_probes.value == 4


class _Slow(MemoryStore):
    """A store with a deadline of one call (``request_timeout_s``) whose ``contains`` takes ``seconds`` on the
    tier's clock."""

    def __init__(self, clock, seconds):
        super().__init__()
        self.clock, self.seconds = clock, seconds
        self.request_timeout_s = 1.0

    def contains(self, keys, *, timeout_s=None):
        self.clock.now += self.seconds
        return super().contains(keys, timeout_s=timeout_s)


def test_the_fetches_of_a_step_get_what_its_lookups_left_of_the_deadline():
    """``lookup_budget_s`` is one step's wait on a store with a deadline in all: the plan's ``fetch_wait_s`` is
    what the lookups left; a lookup that spent it answers 0 (no time to fetch what it found, which is still
    held), and the next step's lookups and fetches have the whole deadline again. A store without a deadline
    (a local one) leaves its fetches unbounded but for the workers' own ``wait_timeout_s``."""
    clock = Clock()
    store = _Slow(clock, 0.3)
    mgr = manager(store, clock, lookup_budget_s=1.0)
    shared = mgr._shared
    for h in (1, 2, 3):
        store.put([shared.spec.codec.key(h, 0)], [[memoryview(b"x")]])
    assert mgr.build_step().fetch_wait_s == 1.0
    assert shared.find([1]) == 1 and shared.find([2]) == 1
    assert mgr.build_step().fetch_wait_s == pytest.approx(0.4)
    assert shared.find([1]) == 1
    store.seconds = 1.0
    assert shared.find([3]) == 0, "a hit found with no time left to fetch it was taken"
    assert 3 in shared._known and shared.find([2]) == 0 and mgr.build_step().fetch_wait_s == 0.0
    store.seconds = 0.3
    assert shared.find([2]) == 1 and mgr.build_step().fetch_wait_s == pytest.approx(0.7)
    local = manager(MemoryStore(), clock, lookup_budget_s=1.0)
    assert local.build_step().fetch_wait_s == math.inf
