"""Contract suite every ``BlockStore`` must pass, built-in or your own.

Three lines make a pytest test class of it::

    class MyStoreContract(BlockStoreContract):
        def make_store(self): return MyStore()
    TestMyStore = MyStoreContract.TestCase

Override :meth:`drop` when the store can forget a key on request (the
built-ins have ``drop``; a server's key can be deleted with a raw client), and
:meth:`release_store` to clean up after each example (a directory, a server's
database). Set ``may_drop = True`` for a store that evicts on its own while
the suite runs (a small capacity): then a landed key may be missing, but never
wrong.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from typing_extensions import override

from kvkit.errors import ConfigError, KVKitError
from kvkit.interfaces.shared import BlockStore, StoreResult
from kvkit.validate import plural

__all__ = ["BlockStoreContract"]

_KEYS = 8
_SIZES = (1, 7, 100, 4096, 65_537)
_KEY_LIST = st.lists(st.integers(0, _KEYS - 1), min_size=0, max_size=6)


def _key(k: int) -> bytes:
    """Keys differ only in their last bytes (catches stores that key on a prefix)."""
    return b"kvkit:contract:" + b"x" * 48 + b":%02d" % k


@functools.cache
def _value(k: int) -> bytes:
    """Key ``k``'s only value: its bytes depend on ``k`` (catches one key served for another)."""
    size = _SIZES[k % len(_SIZES)]
    pattern = bytes((k * 37 + i * 11) % 251 for i in range(251))
    return (pattern * (size // 251 + 1))[:size]


def _split(data: bytes | bytearray, cuts: int) -> list[memoryview]:
    """``data`` as ``cuts + 1`` consecutive views (the first may be empty, as a header buffer may be)."""
    view = memoryview(data)
    edges = [0, *sorted({len(data) * (c + 1) // (cuts + 2) for c in range(cuts)}), len(data)]
    return [view[a:b] for a, b in itertools.pairwise(edges)]


class BlockStoreContract(RuleBasedStateMachine):
    """Drives a store the way the tiers do and checks it against a dict model.

    The model maps each key to "landed" (a put of it was reported landed and
    it was not dropped since), "maybe" (a put failed, or is in flight: either
    outcome is allowed), or nothing. Every key has one value of its own
    size. Two callers share the store, each submitting its own calls and
    polling by naming its own tickets. Rules put and get batches (buffers
    split into up to three views), ask ``contains``, drop keys, get into
    buffers of the wrong size, poll (naming also a ticket already reported
    or never issued), and abandon a get (its ticket is never named again);
    puts and gets may stay outstanding across steps.

    Checked, for every store (the invariants of :class:`BlockStore`):

    * ``put``/``get`` answer fresh tickets at once; every ticket is reported
      exactly once, to a poll naming it, within :attr:`report_timeout_s`; a
      poll reports no ticket it did not name (no result goes to another
      caller), none already reported, none never issued, and while one caller
      polls the other's results wait for it (none lost); a result names only
      indices of its call.
    * ``contains`` answers the leading run of landed keys (``may_drop``: at
      most the leading run of landed or maybe keys); never more. It accepts
      ``timeout_s`` (an ample one answers as the default; ``0`` never more).
    * A ``get`` of a landed key succeeds with exactly its bytes (``may_drop``:
      fails or has its bytes); a key that never landed fails; buffers of
      another total length fail, and are left for the store to fill only
      with a value of exactly their length.
    * A malformed call (a key not non-empty ``bytes``, buffer lists not one
      per key, a buffer not C-contiguous bytes-like, poll tickets not a
      collection of ints, a ``contains`` timeout not ``None`` or a number
      >= 0) raises ``ConfigError`` and writes nothing.
    * ``check_invariants()`` passes after every step; after ``close`` every
      outstanding ticket is reported once and every call raises.

    The bound on waiting results (abandoned tickets discarded) depends on the
    store's own bound; test it with the store's settings (kvkit's stores do).
    """

    may_drop = False
    """Whether the store may evict landed keys by itself during the run."""
    report_timeout_s = 10.0
    """How long a ticket may take to be reported."""

    def __init__(self) -> None:
        super().__init__()
        self.store = self.make_store()
        assert isinstance(self.store, BlockStore), f"{type(self.store).__name__} does not implement BlockStore"
        self.state: dict[int, str] = {}  # key number -> "landed" | "maybe"
        # ticket -> (operation, key numbers, buffers, keys landed when it was issued)
        self.outstanding: dict[int, tuple[str, list[int], list[bytearray], frozenset[int]]] = {}
        self.owner: dict[int, int] = {}  # outstanding ticket -> the caller (0 or 1) that submitted it
        self.seen: set[int] = set()
        self.reported: set[int] = set()

    def make_store(self) -> BlockStore:
        """Return a fresh, empty store under test (override this)."""
        raise NotImplementedError("subclass BlockStoreContract and override make_store()")

    def drop(self, store: BlockStore, key: bytes) -> bool:
        """Make ``store`` forget ``key``; answer ``False`` if this store cannot (the rule is skipped)."""
        forget = getattr(store, "drop", None)
        if forget is None:
            return False
        forget(key)
        return True

    def release_store(self, store: BlockStore) -> None:
        """Clean up after an example, once the store is closed (override to remove files or keys)."""

    @rule(ks=_KEY_LIST, cuts=st.integers(0, 2), wait=st.booleans(), caller=st.integers(0, 1))
    def put(self, ks: list[int], cuts: int, wait: bool, caller: int) -> None:
        """Queue a put of each key's value; keys in flight are "maybe" until reported."""
        values = [bytearray(_value(k)) for k in ks]
        ticket = self._issue(self.store.put([_key(k) for k in ks], [_split(v, cuts) for v in values]), caller)
        for k in ks:
            self.state.setdefault(k, "maybe")
        self.outstanding[ticket] = ("put", ks, values, frozenset())
        if wait:
            self._wait_for(ticket)

    @rule(ks=_KEY_LIST, cuts=st.integers(0, 2), wait=st.booleans(), caller=st.integers(0, 1))
    def get(self, ks: list[int], cuts: int, wait: bool, caller: int) -> None:
        """Queue a get of each key into fresh buffers of its size, split into views."""
        buffers = [bytearray(len(_value(k))) for k in ks]
        ticket = self._issue(self.store.get([_key(k) for k in ks], [_split(b, cuts) for b in buffers]), caller)
        self.outstanding[ticket] = ("get", ks, buffers, self._landed_now())
        if wait:
            self._wait_for(ticket)

    @rule(k=st.integers(0, _KEYS - 1), delta=st.sampled_from([-1, 1, 13]))
    def get_wrong_size(self, k: int, delta: int) -> None:
        """A get into buffers of another total length must fail for that key."""
        size = max(0, len(_value(k)) + delta)
        if size == len(_value(k)):
            return
        buffer = bytearray(size)
        ticket = self._issue(self.store.get([_key(k)], [_split(buffer, 1)]), 0)
        self.outstanding[ticket] = ("get-wrong", [k], [buffer], frozenset())
        self._wait_for(ticket)

    @rule(ks=_KEY_LIST, budget=st.sampled_from(["default", "ample", "none left"]))
    def contains(self, ks: list[int], budget: str) -> None:
        """The answer is the leading run of landed keys (at most that of landed-or-maybe ones), with the store's
        own deadline or an ample ``timeout_s``; with ``timeout_s=0`` at most that (a store with a deadline answers
        0 at once, a local one may ignore it)."""
        self._settle_puts()
        keys = [_key(k) for k in ks]
        if budget == "default":
            n = self.store.contains(keys)
        else:
            n = self._contains(keys, self.report_timeout_s if budget == "ample" else 0.0)
        assert isinstance(n, int) and 0 <= n <= len(ks), f"contains({ks}) answered {n!r}"
        sure = self._leading(ks, {"landed"})
        possible = self._leading(ks, {"landed", "maybe"})
        assert n <= possible, (f"contains({ks}) answered {n}, but only the first {plural(possible, 'key')} "
                               f"can be present (states {self._states(ks)})")
        if not self.may_drop and budget != "none left":
            assert n >= sure, (f"contains({ks}) answered {n}, but the first {plural(sure, 'key')} landed "
                               f"and none was dropped (states {self._states(ks)})")

    @rule(k=st.integers(0, _KEYS - 1))
    def drop_key(self, k: int) -> None:
        """Forget a key (as the server's own eviction would); it must then be absent."""
        self._drain()
        if self.drop(self.store, _key(k)):
            self.state.pop(k, None)

    @rule(caller=st.integers(0, 1), timeout=st.sampled_from([0.0, 0.01]),
          stray=st.sampled_from(["none", "reported", "never issued"]))
    def poll(self, caller: int, timeout: float, stray: str) -> None:
        """One caller takes whatever of its results are ready, naming its tickets (and maybe a stray one)."""
        named = {t for t, who in self.owner.items() if who == caller}
        if stray == "reported" and self.reported:
            named.add(min(self.reported))
        elif stray == "never issued":
            named.add(max(self.seen, default=0) + 1000)
        self._take(self.store.poll(named, timeout), named)

    @rule(i=st.integers(0, 50))
    def abandon(self, i: int) -> None:
        """A caller gives up on one of its gets: it never names that ticket again (its buffers are its own)."""
        gets = [t for t, entry in self.outstanding.items() if entry[0] == "get"]
        if gets:
            ticket = gets[i % len(gets)]
            del self.outstanding[ticket], self.owner[ticket]

    @invariant()
    def store_is_consistent(self) -> None:
        """The store's own bookkeeping holds after every step."""
        self.store.check_invariants()

    @rule(kind=st.sampled_from(["str key", "empty key", "short buffer list", "strided buffer", "not a buffer"]))
    def malformed_call(self, kind: str) -> None:
        """A malformed put or get raises ConfigError at once and queues nothing (bad buffers after a good
        key's value too: that value is not written); so do a poll of tickets not in a collection and a
        contains whose timeout is negative or not a number."""
        good = [memoryview(bytes(_value(0)))]
        cases: dict[str, tuple[list[Any], list[list[Any]]]] = {
            "str key": (["k"], [[memoryview(b"x")]]), "empty key": ([b""], [[memoryview(b"x")]]),
            "short buffer list": ([_key(0), _key(1)], [[memoryview(b"x")]]),
            "strided buffer": ([_key(0), _key(1)], [good, [memoryview(bytearray(8))[::2]]]),
            "not a buffer": ([_key(0), _key(1)], [good, [5]])}
        keys, buffers = cases[kind]
        for call in (self.store.put, self.store.get):
            try:
                call(keys, buffers)
            except ConfigError:
                continue
            raise AssertionError(f"{call.__name__} with a {kind} did not raise ConfigError")
        ticket: Any = 7  # not in a collection
        timeout: Any = "soon"
        for name, odd in (("poll(7)", lambda: self.store.poll(ticket)),
                          ("contains(timeout_s=-1.0)", lambda: self._contains([_key(0)], -1.0)),
                          ("contains(timeout_s='soon')", lambda: self._contains([_key(0)], timeout))):
            try:
                odd()
            except ConfigError:
                continue
            raise AssertionError(f"{name} did not raise ConfigError")

    @override
    def teardown(self) -> None:
        try:
            self._drain()
            ticket = self._issue(self.store.get([_key(0)], [[memoryview(bytearray(len(_value(0))))]]), 0)
            self.store.close()
            self.store.close()  # idempotent
            results = self._poll_until({ticket})
            assert [r.ticket for r in results] == [ticket], \
                f"ticket {ticket}, outstanding at close, was reported {results}"
            again = self.store.poll(self.reported | {ticket}, 0.0)
            assert again == [], f"tickets were reported again after close: {again}"
            for call in (lambda: self.store.put([_key(1)], [[memoryview(b"x")]]),
                         lambda: self.store.get([_key(1)], [[memoryview(bytearray(1))]]),
                         lambda: self.store.contains([_key(1)])):
                try:
                    call()
                except KVKitError:
                    continue
                raise AssertionError("a call after close() did not raise")
        finally:
            self.store.close()
            self.release_store(self.store)

    def _contains(self, keys: list[bytes], timeout_s: float) -> int:
        """``contains(keys, timeout_s=timeout_s)``; a store whose ``contains`` takes no ``timeout_s`` fails the
        contract (a scheduler could not bound its lookups by what a step has left)."""
        try:
            return self.store.contains(keys, timeout_s=timeout_s)
        except TypeError as exc:
            if "timeout_s" in str(exc):
                raise AssertionError(f"contains(keys, timeout_s={timeout_s!r}) raised {exc!r}: it must take "
                                     f"the keyword timeout_s") from None
            raise

    def _issue(self, ticket: object, caller: int) -> int:
        assert isinstance(ticket, int) and ticket >= 0, f"a ticket must be an int >= 0, got {ticket!r}"
        assert ticket not in self.seen, f"ticket {ticket} was handed out twice"
        self.seen.add(ticket)
        self.owner[ticket] = caller
        return ticket

    def _wait_for(self, ticket: int) -> None:
        """The caller of ``ticket`` waits for it alone (naming only it)."""
        self._take(self._poll_until({ticket}), {ticket})

    def _drain(self) -> None:
        """Both callers wait for all of their tickets."""
        named = set(self.outstanding)
        self._take(self._poll_until(named), named)

    def _settle_puts(self) -> None:
        """Model answers are exact only with no put in flight: wait for them."""
        if any(entry[0] == "put" for entry in self.outstanding.values()):
            self._drain()

    def _landed_now(self) -> frozenset[int]:
        return frozenset(k for k, state in self.state.items() if state == "landed")

    def _poll_until(self, tickets: set[int]) -> list[StoreResult]:
        """Poll naming ``tickets`` (those not reported yet) until each was reported."""
        deadline = time.monotonic() + self.report_timeout_s
        results: list[StoreResult] = []
        while missing := tickets - {r.ticket for r in results}:
            left = deadline - time.monotonic()
            assert left > 0, (f"tickets {sorted(missing)} not reported within {self.report_timeout_s} s "
                              f"(lost, or handed to a poll that did not name them; got {results})")
            got = self.store.poll(missing, min(left, 0.05))
            assert all(isinstance(r, StoreResult) and r.ticket in missing for r in got), \
                f"a poll naming {sorted(missing)} reported {got} (another caller's, or reported twice)"
            results += got
        return results

    def _take(self, results: list[StoreResult], named: set[int]) -> None:
        for result in results:
            assert isinstance(result, StoreResult), f"poll returned {result!r}, not a StoreResult"
            assert result.ticket in named, (
                f"ticket {result.ticket} reported to a poll naming only {sorted(named)} (another caller's result)")
            assert result.ticket in self.outstanding, (
                f"ticket {result.ticket} reported but not outstanding (reported twice, or never issued)")
            self.reported.add(result.ticket)
            del self.owner[result.ticket]
            op, ks, buffers, sure = self.outstanding.pop(result.ticket)
            assert all(0 <= i < len(ks) for i in result.failed), \
                f"{op} of {plural(len(ks), 'key')} reported failed indices {result.failed}"
            assert result.ok or result.error, f"{op} failed keys {result.failed} with no error text"
            _check_failure_kinds(op, result)
            for i, k in enumerate(ks):
                self._check_key(op, k, i in result.failed, buffers[i], k in sure)
            if op == "put":
                self._landed(ks, result.failed)

    def _check_key(self, op: str, k: int, failed: bool, buffer: bytearray, landed: bool) -> None:
        state = self.state.get(k)
        if op == "get-wrong":
            assert failed, f"a get of key {k} into {len(buffer)} bytes succeeded; its value has {len(_value(k))}"
        elif op == "get" and not failed:
            assert state is not None, f"a get of key {k}, never put, succeeded"
            assert bytes(buffer) == _value(k), f"a get of key {k} succeeded with the wrong bytes"
        elif op == "get" and failed:
            assert not landed or self.may_drop, f"a get of key {k}, landed and never dropped, failed"

    def _landed(self, ks: Sequence[int], failed: Sequence[int]) -> None:
        in_flight = {k for op, others, *_ in self.outstanding.values() if op == "put" for k in others}
        for i, k in enumerate(ks):
            if i not in failed:
                self.state[k] = "landed"
            elif self.state.get(k) != "landed" and k not in in_flight:
                self.state[k] = "maybe"

    def _leading(self, ks: Sequence[int], states: set[str]) -> int:
        n = 0
        while n < len(ks) and self.state.get(ks[n]) in states:
            n += 1
        return n

    def _states(self, ks: Sequence[int]) -> list[str]:
        return [self.state.get(k, "absent") for k in ks]


def _check_failure_kinds(op: str, result: StoreResult) -> None:
    """``unreached`` and ``unsent`` are each ``None`` or sorted failed indices without repeats, and no key is both
    (a key was sent or it was not); ``unanswered`` is failed keys, none of them unsent."""
    failed = set(result.failed)
    for name in ("unreached", "unsent"):
        part = getattr(result, name)
        assert part is None or (isinstance(part, tuple) and list(part) == sorted(set(part)) and set(part) <= failed), \
            f"{op} reported {name}={part!r}: not sorted failed keys without repeats (failed={result.failed})"
    unsent = set(result.unsent or ())
    assert unsent.isdisjoint(result.unreached or ()), \
        f"{op} reported keys both unreached and unsent: {sorted(unsent & set(result.unreached or ()))}"
    assert set(result.unanswered) <= failed - unsent, \
        f"{op} reported unanswered={result.unanswered} beyond its failed keys sent (unsent={result.unsent})"
