"""``StorePolicyContract``: the tests every ``StorePolicy`` must pass, built-in or your own.

Join it in three lines (pytest collects the subclass)::

    class TestMyStore(StorePolicyContract):
        def make_policy(self):
            return MyStore()

A Hypothesis state machine (:class:`StoreDriver`) calls the policy the way
``OffloadManager`` does. Requests arrive with chained block hashes that share
prefixes with earlier requests; they confirm blocks in steps
(``on_computed(r, start, stop)``: ``start`` is the previous confirmed count,
``stop`` the new one, already in ``r.num_confirmed_blocks``); decode appends
hashes; a preemption starts a fresh incarnation (same id and hash list,
confirming from 0 again); a running request finishes (``on_finished``) or
any request aborts (no call); and ``writeback_target(gpu_free, gpu_blocks)``
is asked for pools of a few sizes. Checked on every answer:

* ``on_computed`` answers ints (``bool`` is not one) in ``[start, stop)``;
* ``on_finished`` answers ints in ``[0, num_confirmed_blocks)``;
* ``writeback_target`` is an int in ``[0, gpu_blocks]``, the same for equal
  arguments throughout the policy's life;
* no call changes a ``RequestView`` (the protocol's views are read-only; the
  manager hands out its own request records), nor does a later one;
* ``check_invariants()`` passes after every step if the policy is
  :class:`~kvkit.interfaces.capabilities.SelfChecking`.

Answers may repeat an index and may be lazy iterables: the manager reads an
answer once and deduplicates what it stores.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvkit.interfaces.capabilities import SelfChecking
from kvkit.interfaces.store import StorePolicy
from kvkit.interfaces.types import BlockHash
from kvkit.validate import is_int, plural

__all__ = ["StoreDriver", "StorePolicyContract"]

_PICK = st.integers(0, 63)  # reduced modulo the live choices, so it shrinks towards the first
_HASH_BASE = 1 << 40  # hashes far from block indices: an index/hash mix-up cannot pass


@attrs.define(eq=False)
class _View:
    """The ``RequestView`` handed to the policy: mutable, like the manager's request records."""

    request_id: str
    block_hashes: list[BlockHash]
    num_confirmed_blocks: int = 0


@attrs.define(eq=False)
class _Incarnation:
    """A live request: the view handed out, and what the driver knows it must still say."""

    view: _View
    hashes: list[BlockHash]  # the driver's own copies of what the view must say
    confirmed: int = 0
    running: bool = False


class StoreDriver(RuleBasedStateMachine):
    """Drives one policy as the manager does and checks each of its answers (see the module docstring)."""

    max_requests = 6
    """Most requests live at once."""

    def __init__(self, policy: StorePolicy) -> None:
        super().__init__()
        assert isinstance(policy, StorePolicy), f"{type(policy).__name__} does not implement StorePolicy"
        self.policy = policy
        self.live: dict[str, _Incarnation] = {}
        self.chains: list[list[BlockHash]] = []  # every request's hashes, for later prefixes
        self.targets: dict[tuple[int, int], int] = {}  # (gpu_free, gpu_blocks) -> first answer
        self.last_call = "nothing yet"
        self._hashes = 0
        self._requests = 0

    def _fresh_hashes(self, n: int) -> list[BlockHash]:
        first, self._hashes = self._hashes, self._hashes + n
        return [BlockHash(_HASH_BASE + k) for k in range(first, first + n)]

    def _pick(self, pick: int, running: bool = False) -> _Incarnation:
        ids = sorted(rid for rid, r in self.live.items() if r.running or not running)
        return self.live[ids[pick % len(ids)]]

    def _check(self, answer: Iterable[int], allowed: range) -> None:
        indices = list(answer)  # read once, as the manager does
        bad = [i for i in indices if not is_int(i) or not allowed.start <= i < allowed.stop]
        assert not bad, (f"{self.last_call} answered {bad!r}, not ints in [{allowed.start}, {allowed.stop}) "
                         f"(whole answer: {indices!r})")

    @precondition(lambda self: len(self.live) < self.max_requests)
    @rule(source=_PICK, shared=st.integers(0, 6), fresh=st.integers(0, 4))
    def arrive(self, source: int, shared: int, fresh: int) -> None:
        """A request arrives: a prefix of an earlier request's hashes, then fresh ones."""
        prefix = self.chains[source % len(self.chains)][:shared] if self.chains else []
        hashes = prefix + self._fresh_hashes(fresh)
        rid, self._requests = f"req{self._requests}", self._requests + 1
        self.live[rid] = _Incarnation(_View(rid, list(hashes)), hashes)
        self.chains.append(hashes)

    @precondition(lambda self: self.live)
    @rule(pick=_PICK, blocks=st.integers(1, 4))
    def compute(self, pick: int, blocks: int) -> None:
        """The request runs and confirms up to ``blocks`` more of its hashed blocks."""
        r = self._pick(pick)
        r.running = True
        start = r.confirmed
        stop = min(start + blocks, len(r.hashes))
        if stop > start:
            r.view.num_confirmed_blocks = r.confirmed = stop
            self.last_call = f"on_computed({r.view.request_id!r}, {start}, {stop})"
            self._check(self.policy.on_computed(r.view, start, stop), range(start, stop))

    @precondition(lambda self: self.live)
    @rule(pick=_PICK, blocks=st.integers(1, 3))
    def extend(self, pick: int, blocks: int) -> None:
        """Decode filled ``blocks`` more blocks: their hashes join the request's list."""
        r = self._pick(pick)
        new = self._fresh_hashes(blocks)
        r.view.block_hashes.extend(new)
        r.hashes.extend(new)

    @precondition(lambda self: any(r.running for r in self.live.values()))
    @rule(pick=_PICK)
    def preempt(self, pick: int) -> None:
        """A running request is preempted: a fresh incarnation, same id and hash list, nothing confirmed."""
        r = self._pick(pick, running=True)
        rid = r.view.request_id
        self.live[rid] = _Incarnation(_View(rid, r.view.block_hashes), r.hashes)

    @precondition(lambda self: self.live)
    @rule(pick=_PICK)
    def finish(self, pick: int) -> None:
        """The request finishes; a running one is flushed (``on_finished``)."""
        r = self._pick(pick)
        if r.running:
            self.last_call = f"on_finished({r.view.request_id!r}) with {plural(r.confirmed, 'confirmed block')}"
            self._check(self.policy.on_finished(r.view), range(r.confirmed))
            self._assert_views_unchanged()
        del self.live[r.view.request_id]

    @precondition(lambda self: self.live)
    @rule(pick=_PICK)
    def abort(self, pick: int) -> None:
        """The request is aborted: it ends without a flush."""
        del self.live[self._pick(pick).view.request_id]

    @rule(gpu_blocks=st.integers(1, 8), gpu_free=st.integers(0, 8))
    def writeback(self, gpu_blocks: int, gpu_free: int) -> None:
        """The write-back target for a pool of ``gpu_blocks`` blocks, ``gpu_free`` of them free, asked twice."""
        args = (min(gpu_free, gpu_blocks), gpu_blocks)
        self.last_call = "writeback_target({}, {})".format(*args)
        answers = [self.policy.writeback_target(*args) for _ in range(2)]
        assert all(is_int(t) and 0 <= t <= gpu_blocks for t in answers), \
            f"{self.last_call} returned {answers!r} (asked twice), not ints in [0, {gpu_blocks}]"
        first = self.targets.setdefault(args, answers[0])
        assert answers == [first, first], \
            f"{self.last_call} returned {answers}, earlier {first}: the same arguments must give the same target"

    @invariant()
    def views_are_unchanged(self) -> None:
        """No call changed any live request's view."""
        self._assert_views_unchanged()

    @invariant()
    def policy_is_consistent(self) -> None:
        """The policy's own invariants hold, if it can check them."""
        if isinstance(self.policy, SelfChecking):
            self.policy.check_invariants()

    def _assert_views_unchanged(self) -> None:
        for rid, r in self.live.items():
            v = r.view
            assert (v.request_id, v.block_hashes, v.num_confirmed_blocks) == (rid, r.hashes, r.confirmed), (
                f"after {self.last_call}, the view of {rid!r} says id {v.request_id!r}, {v.num_confirmed_blocks} "
                f"confirmed of hashes {v.block_hashes}; the driver gave it {r.confirmed} of {r.hashes}: "
                f"the policy changed a RequestView")


class StorePolicyContract:
    """The contract as a pytest test class: subclass it and override :meth:`make_policy`.

    Attributes:
        hypothesis_settings: settings for the state machine (``None``: the
            loaded profile).
    """

    hypothesis_settings: ClassVar[settings | None] = None

    def make_policy(self) -> StorePolicy:
        """A fresh policy under test (override this); deterministic, so failures replay."""
        raise NotImplementedError("subclass StorePolicyContract and override make_policy()")

    def test_answers_as_the_manager_expects(self) -> None:
        """Driven as the manager drives it, the policy is a ``StorePolicy`` and every answer keeps the contract."""
        # hypothesis documents any factory of a state machine here, though its annotation names a class
        run_state_machine_as_test(lambda: StoreDriver(self.make_policy()),  # type: ignore[arg-type]
                                  settings=self.hypothesis_settings)
