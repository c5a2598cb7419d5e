"""The scheduler side of kvkit's vLLM connector: vLLM's scheduler calls mapped onto ``OffloadManager``.

vLLM-free: vLLM's ``Request`` objects are read by attribute (``request_id``,
``block_hashes``, ``num_tokens``, ``num_computed_tokens``,
``num_in_flight_tokens``). The mapping, per vLLM call:

========================================  =====================================================
vLLM (scheduler process)                  kvkit
========================================  =====================================================
``get_num_new_matched_tokens(req, n)``    ``add_request`` (first time) or ``extend``; a request
                                          the manager still runs was preempted: ``preempt``;
                                          then ``lookup(n)`` (pins, replaces an earlier pin)
``update_state_after_alloc(req, b, k)``   ``on_allocated(table, k)``: the rest of the hit is
                                          unpinned, the load enters the next plan
``build_connector_meta(out)``             ``preempt`` (``preempted_req_ids``),
                                          ``append_blocks`` (new blocks of running requests),
                                          ``build_step`` -> metadata for every worker
``update_connector_output(out)``          ``extend`` + ``on_computed`` for the requests of the
                                          step just run, ``apply_completions`` (workers'
                                          results); ``released`` -> ``finished_sending`` next step
``request_finished(req, blocks)``         ``finish`` (flush) or ``abort``; ``True`` delays the
                                          free until the flush's stores completed
``reset_cache()``                         ``reset``
========================================  =====================================================

vLLM frees a preempted request's blocks at once and may hand them to another
request in the same step, so every step that preempted carries a barrier: the
workers finish every copy in flight before that step's forward pass, and run
the step's stores (sources confirmed in earlier steps) before it too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvkit.errors import HashInputError
from kvkit.integrations._vllm_settings import ConnectorSettings
from kvkit.interfaces import BlockHash, TransferResult
from kvkit.manager import OffloadManager
from kvkit.manager.requests import RequestState
from kvkit.manager.step import StepPlan
from kvkit.validate import is_int

__all__ = ["LOADED_TOKENS_KEY", "RELOADED_TOKENS_KEY", "SchedulerSide", "StepOrder", "block_hash"]

LOADED_TOKENS_KEY = "kvkit_loaded_tokens"
"""Key, in a finished request's ``kv_transfer_params``, of the prompt tokens kvkit loaded
when vLLM first scheduled it (part of ``RequestOutput.num_cached_tokens``)."""
RELOADED_TOKENS_KEY = "kvkit_reloaded_tokens"
"""Key of the tokens kvkit loaded when vLLM resumed the request after preemptions."""

_RUNNING = RequestState.RUNNING


def block_hash(value: object) -> BlockHash:
    """kvkit's hash of one vLLM block hash: the big-endian integer of its bytes.

    vLLM's hashes are already digests (salted by cache salt and LoRA), so the
    mapping only changes the type; it is deterministic across processes.

    Raises:
        HashInputError: neither ``bytes`` nor a non-negative ``int``.
    """
    if isinstance(value, (bytes, bytearray)):
        return BlockHash(int.from_bytes(value, "big"))
    if is_int(value, 0):
        return BlockHash(int(value))
    raise HashInputError(f"vLLM block hash must be bytes or a non-negative int, got {value!r}")


@attrs.frozen
class StepOrder:
    """What the scheduler side sends every worker for one step (inside vLLM's metadata).

    Attributes:
        step: increases by one per ``build_connector_meta``.
        plan: the step's loads and stores.
        release: finished requests whose delayed free is over: report them
            in ``finished_sending``.
        barrier: a request was preempted since the last step: finish every
            copy in flight before this step's forward pass overwrites a freed block.
    """

    step: int
    plan: StepPlan
    release: tuple[str, ...] = ()
    barrier: bool = False


def _done_tokens(request: Any) -> int:
    """Tokens whose KV a finished forward pass wrote (async scheduling runs ahead)."""
    return max(0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0))


@attrs.define(eq=False)
class SchedulerSide:
    """Drives an ``OffloadManager`` from vLLM's scheduler-side connector calls.

    Args:
        manager: built with ``gpu=None`` (vLLM owns the GPU pool: delayed
            frees) and ``null_block=0``.

    Invariants:
        * The requests tracked are exactly those the manager has live.
        * An id enters ``finished_sending`` only if ``request_finished``
          returned ``True`` for it, and exactly once.
    """

    manager: OffloadManager
    num_preemptions: int = attrs.field(init=False, default=0)
    _requests: dict[str, Any] = attrs.field(init=False, factory=dict)
    _loaded_tokens: dict[str, list[int]] = attrs.field(init=False, factory=dict)  # [first, resumed]
    _scheduled: deque[list[str]] = attrs.field(init=False, factory=deque)  # per step built, not yet run
    _awaiting: set[str] = attrs.field(init=False, factory=set)
    _release: list[str] = attrs.field(init=False, factory=list)
    _barrier: bool = attrs.field(init=False, default=False)
    _step: int = attrs.field(init=False, default=0)

    @classmethod
    def from_settings(cls, settings: ConnectorSettings) -> SchedulerSide:
        """A manager over a CPU pool of ``settings.num_cpu_blocks`` blocks (no copy backend here)."""
        parts = attrs.evolve(settings.stack, copy=None).resolve()
        cpu = parts.allocator(num_blocks=parts.cpu_blocks, eviction=parts.cpu_eviction)
        return cls(OffloadManager(settings.stack.kv, cpu, parts.store,
                                  world_size=settings.stack.world_size, null_block=0))

    @property
    def idle(self) -> bool:
        """No request tracked, no transfer in flight, no delayed free pending."""
        return not (self._requests or self._awaiting or self._release
                    or self.manager.num_in_flight or self.manager.num_requests)

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """CPU-tier tokens right after vLLM's own prefix hit (pinned until allocation)."""
        rid = request.request_id
        if rid not in self._requests:
            self.manager.add_request(rid, [block_hash(h) for h in request.block_hashes],
                                     request.num_tokens)
            self._requests[rid] = request
            self._loaded_tokens[rid] = [0, 0]
        else:
            if self.manager.request(rid).state is _RUNNING:  # preempted between steps
                self._preempt(rid)
            self._sync(request)
        return self.manager.lookup(rid, num_computed_tokens, num_tokens=request.num_tokens)

    def allocated(self, request: Any, block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks and accepted ``num_external_tokens`` of the hit."""
        rid = request.request_id
        if rid not in self._requests:  # vLLM admitted it without asking us: nothing to load
            return
        self.manager.on_allocated(rid, [list(row) for row in block_ids], num_external_tokens)
        self._loaded_tokens[rid][getattr(request, "num_preemptions", 0) > 0] += num_external_tokens

    def build(self, *, preempted: Iterable[str], new_blocks: Iterable[tuple[str, Sequence[Sequence[int]]]],
              scheduled: Iterable[str]) -> StepOrder:
        """Plan one step.

        Args:
            preempted: ids vLLM preempted since the last step.
            new_blocks: ``(id, blocks per group)`` appended to running (not
                resumed) requests.
            scheduled: ids this step computes tokens for.
        """
        for rid in preempted:
            if rid in self._requests and self.manager.request(rid).state is _RUNNING:
                self._preempt(rid)
        for rid, blocks in new_blocks:
            if rid in self._requests and self.manager.request(rid).state is _RUNNING:
                self.manager.append_blocks(rid, blocks)
        self._step += 1
        order = StepOrder(self._step, self.manager.build_step(), tuple(self._release), self._barrier)
        self._release, self._barrier = [], False
        self._scheduled.append(list(scheduled))
        return order

    def completed(self, results: Iterable[TransferResult]) -> None:
        """The oldest step built ran: confirm its requests' progress, apply the workers' results.

        vLLM reports steps in the order it scheduled them (with async
        scheduling the next step is built before this one is reported).
        """
        for rid in self._scheduled.popleft() if self._scheduled else ():
            self._confirm(rid)
        report = self.manager.apply_completions(results)
        for rid in report.released:
            if rid in self._awaiting:  # not a preempted incarnation: vLLM freed those already
                self._awaiting.discard(rid)
                self._release.append(rid)

    def finished(self, request: Any, *, aborted: bool) -> tuple[bool, dict[str, int] | None]:
        """The request ended; returns (keep its blocks until released, kv_transfer_params)."""
        rid = request.request_id
        if rid not in self._requests:
            return False, None
        self._sync(request)
        r = self.manager.request(rid)
        if aborted:
            delay = self.manager.abort(rid)
        else:
            done = max(_done_tokens(request), r.num_computed_tokens) if r.state is _RUNNING else None
            delay = self.manager.finish(rid, done)
        del self._requests[rid]
        if delay:
            self._awaiting.add(rid)
        first, resumed = self._loaded_tokens.pop(rid)
        return delay, {LOADED_TOKENS_KEY: first, RELOADED_TOKENS_KEY: resumed}

    def reset(self) -> bool:
        """Empty the CPU tier (after in-flight copies drain); serves no hit from now on."""
        self.manager.reset()
        return True

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if this side or its manager is inconsistent."""
        self.manager.check_invariants()
        assert self.manager.num_requests == len(self._requests), (
            self.manager.num_requests, sorted(self._requests))
        for rid in self._requests:
            self.manager.request(rid)  # raises if the manager does not have it live
        assert self._loaded_tokens.keys() == self._requests.keys()
        assert not self._awaiting & set(self._requests), "a live request awaits its release"

    def _preempt(self, rid: str) -> None:
        self.manager.preempt(rid)
        self.num_preemptions += 1
        self._barrier = True

    def _sync(self, request: Any) -> None:
        """Tell the manager about blocks that became full and the request's length."""
        known = len(self.manager.request(request.request_id).block_hashes)
        hashes = request.block_hashes
        self.manager.extend(request.request_id, [block_hash(h) for h in hashes[known:]],
                            request.num_tokens)

    def _confirm(self, rid: str) -> None:
        request = self._requests.get(rid)
        if request is None or self.manager.request(rid).state is not _RUNNING:
            return  # finished, or preempted meanwhile
        self._sync(request)
        done = _done_tokens(request)
        if done > self.manager.request(rid).num_computed_tokens:
            self.manager.on_computed(rid, done)
