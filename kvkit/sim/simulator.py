"""Trace-driven simulation: replay requests through a real offload stack under a time model.

Every request of the trace goes through kvkit's own parts: the
:class:`~kvkit.reference.engine.ReferenceEngine` loop, the GPU and CPU
:class:`~kvkit.backends.allocator.pool.BlockPool` tiers, the
:class:`~kvkit.manager.OffloadManager` and the configured eviction and store
policies. Only the clock is modelled.

Time model (every figure configurable in :class:`CostModel`):

* A request arrives at its trace timestamp and is admitted in arrival order
  (FIFO): it starts at ``max(arrival, start of the request before it)``.
* Before it starts, every running request whose modelled end is at or before
  the start time finishes (in end order): its stores are flushed and its GPU
  blocks released (they stay cached, evictable, on the GPU tier).
* If the GPU pool still cannot hold the request, the earliest-ending running
  requests finish one by one, and the start time moves to each one's end
  (queueing), until it fits. A finished request's blocks are free once the
  stores its finish flushed are copied, one engine step later; that step
  takes no modelled time.
* A request the engine cannot schedule at its start (the GPU pool is full)
  has its shared-tier hit prefetched into the CPU tier, as the reference
  engine prefetches every request a step leaves waiting
  (:meth:`~kvkit.reference.engine.ReferenceEngine.prefetch`): the prefetch
  starts then and runs at ``shared_gbps`` while the request queues.
* The stack's load planner decides which blocks of the request's CPU and
  shared-tier hit to load and which to recompute (see
  :mod:`kvkit.interfaces.plan`); prefetched blocks are CPU hits by then.
  Its prefill then runs two sides at once: the *compute side* computes the
  plan's head (the hit's first blocks) at ``prefill_tokens_per_s``, while
  the *load side* waits for its prefetch to land if it loads a prefetched
  block (``max(0, prefetch end - start)``), fetches the shared-tier blocks
  of the tail into the CPU tier at ``shared_gbps`` and then loads the whole
  tail at ``pcie_gbps``; once both are done, the rest of the prompt
  (declined hit blocks included) is computed. Prefill time = ``max(head
  compute, prefetch wait + fetch + load) + rest compute + overhead_ms``;
  with no head this is the wait, the fetch, the load and the compute one
  after the other. Hit tokens on the GPU tier cost nothing. Prefills and
  prefetches of different requests do not contend with one another;
  requests interact only through GPU memory.
* The planner learns from what the model says each part took: every
  request's modelled prefetch, fetch, load and compute times are its
  observations (in the stack's bytes), as a real engine's completed
  transfers and forward passes would be.
* Modelled time to first token = queueing wait + prefill time.
* It then decodes ``output_length`` tokens at ``decode_ms_per_token`` each
  and ends, holding its GPU blocks until then. Decoded tokens are not cached.

The block size is the trace's: each request carries it
(:attr:`~kvkit.sim.traces.TraceRequest.block_size`), and a
:class:`SimConfig` that leaves ``block_size`` unset takes the first request's;
every request must then have that block size.

A request needing more blocks than the whole GPU pool can never run: it is
skipped and counted in :attr:`SimResult.skipped_requests` (not in any other
figure). Byte figures use a model shape (default Llama-3-8B: 32 layers, 8 KV
heads, head dim 128, bf16), whatever the stack moves: with ``verify=True`` the
stack moves real bytes of a tiny spec with the same block size through the
``torch`` copy backend on CPU tensors, and the engine checks every loaded
block against the bytes that were computed for it.

Memory stays flat on long traces: requests are consumed one at a time, the
pools are fixed size, ended requests leave no state (the manager remembers a
bounded number of ended ids); the only per-request record kept is one float
(its modelled TTFT, for percentiles and plots).
"""

from __future__ import annotations

import contextlib
import heapq
import math
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import attrs

from kvkit.config import DEFAULTS, StackConfig, shown_url
from kvkit.errors import ConfigError, RequestStateError, TraceFormatError
from kvkit.interfaces import BlockHash, HitSource, KVCacheSpec
from kvkit.redact import redact
from kvkit.reference.engine import ReferenceEngine
from kvkit.sim.traces import TraceRequest
from kvkit.stack import OffloadStack, build
from kvkit.validate import (
    at_least,
    check_bool,
    checked,
    implements,
    known_keywords,
    non_empty_str,
    optional_at_least,
    plural,
    quote,
    real_in,
    unknown_keywords,
)

__all__ = [
    "LLAMA_3_8B",
    "SIMULATOR_SLOTS",
    "STACK_SLOTS",
    "CostModel",
    "ModelShape",
    "SimConfig",
    "SimResult",
    "Simulator",
    "describe_effect",
    "simulate",
    "tier_effect",
]

_PROGRESS_EVERY = 256  # requests between progress reports
_VERIFY_COPY = "torch"  # --verify's backend: the one that runs with both tiers in host memory

_positive = real_in(low=0, low_open=True, high=math.inf, high_open=True)  # finite and > 0
_non_negative = real_in(low=0, high=math.inf, high_open=True)  # finite and >= 0


@known_keywords
@attrs.frozen(kw_only=True)
class ModelShape:
    """The KV shape of a model, without the block size (the trace decides that).

    Attributes:
        name: shown in reports.
        num_layers / num_kv_heads / head_dim / dtype: as in ``KVCacheSpec``,
            and checked by it.
    """

    name: str = attrs.field(validator=non_empty_str(label="ModelShape."))
    num_layers: int = attrs.field(validator=at_least(1, label="ModelShape."))
    num_kv_heads: int = attrs.field(validator=at_least(1, label="ModelShape."))
    head_dim: int = attrs.field(validator=at_least(1, label="ModelShape."))
    dtype: str = "bfloat16"

    def __attrs_post_init__(self) -> None:
        self.spec(1)  # KVCacheSpec's checks: the dtype, the cache's size

    def spec(self, block_size: int) -> KVCacheSpec:
        """This shape as a ``KVCacheSpec`` of ``block_size``-token blocks."""
        return KVCacheSpec(num_layers=self.num_layers, block_size=block_size,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype)

    def bytes_per_token(self) -> int:
        """KV bytes of one token across every layer, K and V."""
        return self.spec(1).bytes_per_block


LLAMA_3_8B = ModelShape(name="llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128)
"""Llama-3-8B: 128 KiB of KV per token in bf16."""

_VERIFY_SHAPE = ModelShape(name="verify", num_layers=1, num_kv_heads=1, head_dim=8, dtype="uint8")
# A tiny cache whose bytes --verify really moves; block size comes from the trace.


@known_keywords
@attrs.frozen(kw_only=True)
class CostModel:
    """Prices of the time model (see the module docstring); the one home of their defaults.

    Attributes:
        prefill_tokens_per_s: prompt tokens one request's prefill computes per
            second (default: Llama-3-8B on one H200-class GPU).
        pcie_gbps: CPU -> GPU load bandwidth, 10**9 bytes per second
            (default: batched DMA of 32 KiB pieces, measured on an H200).
        decode_ms_per_token: time per generated token; sets how long a
            request holds its GPU blocks.
        overhead_ms: fixed cost added to every request's time to first token.
        shared_gbps: shared tier -> CPU fetch bandwidth, 10**9 bytes per second
            (default: one Valkey connection over loopback on a 2-core VM).
    """

    prefill_tokens_per_s: float = attrs.field(default=20_000.0, validator=_positive)
    pcie_gbps: float = attrs.field(default=25.0, validator=_positive)
    decode_ms_per_token: float = attrs.field(default=10.0, validator=_non_negative)
    overhead_ms: float = attrs.field(default=0.0, validator=_non_negative)
    shared_gbps: float = attrs.field(default=2.0, validator=_positive)

    def prefill_ms(self, computed_tokens: int, loaded_bytes: int, fetched_bytes: int = 0,
                   overlapped_tokens: int = 0, ready_ms: float = 0.0) -> float:
        """Modelled prefill time (see the module docstring), plus the overhead.

        ``overlapped_tokens`` of the ``computed_tokens`` (a plan's head) are
        computed while, ``ready_ms`` after the start (a prefetch still
        landing), the shared tier fetches ``fetched_bytes`` and then
        ``loaded_bytes`` are loaded; the rest are computed after both.
        """
        head = self.compute_ms(overlapped_tokens)
        return (max(head, ready_ms + self.fetch_ms(fetched_bytes) + self.load_ms(loaded_bytes))
                + self.compute_ms(computed_tokens - overlapped_tokens) + self.overhead_ms)

    def compute_ms(self, tokens: int) -> float:
        """Modelled time to compute ``tokens`` prompt tokens."""
        return tokens * 1e3 / self.prefill_tokens_per_s

    def load_ms(self, num_bytes: int) -> float:
        """Modelled time to load ``num_bytes`` from the CPU tier to the GPU."""
        return num_bytes * 1e-6 / self.pcie_gbps

    def fetch_ms(self, num_bytes: int) -> float:
        """Modelled time to fetch ``num_bytes`` from the shared tier into the CPU tier."""
        return num_bytes * 1e-6 / self.shared_gbps


_COST = CostModel()

SIMULATOR_SLOTS: dict[str, str] = {
    "kv": "the byte model: model at block_size",
    "copy": "None, or 'torch' with verify",
    "device": "'cpu'",
    "cpu_layout": "the GPU tier's with verify",
    "hash_algorithm": "the trace's hash ids are the block hashes",
}
"""``StackConfig`` slots the simulator sets itself, and to what; a :class:`SimConfig` takes every other one."""

STACK_SLOTS: tuple[str, ...] = tuple(f.name for f in attrs.fields(StackConfig) if f.name not in SIMULATOR_SLOTS)
"""The ``StackConfig`` slots a :class:`SimConfig` takes as keywords (the rest are :data:`SIMULATOR_SLOTS`)."""

_OWN = ("block_size", "verify", "cost", "model")
_CAPACITY = ("cpu_blocks", "cpu_bytes")


@attrs.frozen(kw_only=True, init=False)
class SimConfig:
    """One simulation: the stack's slots, and the simulator's own block size, time model and byte model.

    ``SimConfig(gpu_blocks=600, cpu_bytes="64GiB", cpu_eviction="lru", verify=True)``:
    every keyword of :data:`STACK_SLOTS` is a :class:`~kvkit.config.StackConfig`
    slot, validated by ``StackConfig`` on construction (every problem in one
    ``ConfigError``, an unknown keyword named with the valid ones); the
    simulator sets :data:`SIMULATOR_SLOTS` itself. A simulation's sizes
    default to :data:`kvkit.config.DEFAULTS`: ``gpu_blocks`` and, when neither
    ``cpu_blocks`` nor ``cpu_bytes`` is given, ``cpu_blocks``. :meth:`replace`
    changes slots and fields alike (``attrs.evolve`` changes fields only).

    Attributes:
        stack: the stack's slots as a ``StackConfig`` whose ``kv`` is the byte
            model (``model`` at ``block_size``); ``stack=`` starts from another
            ``StackConfig``'s slots (keywords override them; the simulator's
            slots are always its own).
        block_size: tokens per block; ``None`` (default): the trace's (the
            first request's :attr:`~kvkit.sim.traces.TraceRequest.block_size`;
            until then ``stack`` is sized at ``DEFAULTS.block_size``). A
            :class:`SimResult`'s config always has it.
        verify: move real bytes (tiny spec, ``torch`` backend, CPU tensors)
            and check every loaded block.
        cost: the time model's prices.
        model: the model shape bytes are counted for.

    Raises:
        ConfigError: a bad field or slot, quoting it.
    """

    stack: StackConfig
    block_size: int | None = attrs.field(validator=optional_at_least(1))
    verify: bool = attrs.field(converter=checked(check_bool))  # type: ignore[misc]
    cost: CostModel = attrs.field(validator=implements(CostModel))
    model: ModelShape = attrs.field(validator=implements(ModelShape))

    def __init__(self, *, stack: StackConfig | None = None, block_size: int | None = None, verify: bool = False,
                 cost: CostModel = _COST, model: ModelShape = LLAMA_3_8B, **slots: Any) -> None:
        # The stack is set once the fields it derives from (block_size, verify, model) passed their checks.
        self.__attrs_init__(stack=stack, block_size=block_size, verify=verify, cost=cost,  # type: ignore[arg-type]
                            model=model)
        object.__setattr__(self, "stack", self._stack(stack, slots))

    def _stack(self, base: object, slots: dict[str, Any]) -> StackConfig:
        """The stack's config from ``base``'s slots and ``slots``, with the simulator's slots and defaults."""
        problems = unknown_keywords([k for k in slots if k not in SIMULATOR_SLOTS], ("stack", *STACK_SLOTS, *_OWN),
                                    "SimConfig")
        problems += [f"{name}={quote(slots[name])}: the simulator sets it ({why})"
                     for name, why in SIMULATOR_SLOTS.items() if name in slots]
        given: dict[str, Any] = {}
        if isinstance(base, StackConfig):
            given = {name: getattr(base, name) for name in STACK_SLOTS}
            if any(slots.get(name) is not None for name in _CAPACITY):  # the keywords size the CPU tier
                given = {k: v for k, v in given.items() if k not in _CAPACITY}
        elif base is not None:
            problems.append(f"stack={quote(base)}: must be a StackConfig")
        given.update((name, value) for name, value in slots.items() if name in STACK_SLOTS)
        if given.get("gpu_blocks") is None:
            given["gpu_blocks"] = DEFAULTS.gpu_blocks
        if all(given.get(name) is None for name in _CAPACITY):
            given["cpu_blocks"] = DEFAULTS.cpu_blocks
        try:
            stack = StackConfig(kv=self.model.spec(self.block_size or DEFAULTS.block_size), device="cpu",
                                copy=_VERIFY_COPY if self.verify else None, **given)
        except ConfigError as exc:
            problems += exc.problems
        if problems:
            raise ConfigError(problems)
        return stack

    def replace(self, **changes: Any) -> SimConfig:
        """This config with ``changes`` to its fields and slots (``cpu_blocks`` or ``cpu_bytes`` replaces both).

        Raises:
            ConfigError: as the constructor.
        """
        own = {name: changes.pop(name, getattr(self, name)) for name in _OWN}
        return SimConfig(stack=self.stack, **own, **changes)

    @property
    def spec(self) -> KVCacheSpec:
        """The byte-accounting spec: ``model`` at ``block_size`` (``stack.kv``)."""
        kv = self.stack.kv
        assert kv is not None  # StackConfig requires it
        return kv

    def stack_config(self) -> StackConfig:
        """The ``StackConfig`` the simulation builds: ``stack``, with the tiny spec when verifying, and the
        ``overlap`` planner told the cost model's prefill speed (an engine that knows its speed gives it: an
        instance whose first request is a shared hit plans it, probing the tier, instead of loading it whole),
        unless ``options`` name one."""
        stack = self.stack
        if stack.planner == "overlap" and "prefill_tokens_per_s" not in stack.options.get("planner", {}):
            planner = {**stack.options.get("planner", {}), "prefill_tokens_per_s": self.cost.prefill_tokens_per_s}
            stack = attrs.evolve(stack, options={**stack.options, "planner": planner})
        if not self.verify:
            return stack
        return attrs.evolve(stack, kv=_VERIFY_SHAPE.spec(self.spec.block_size),
                            cpu_blocks=stack.num_cpu_blocks, cpu_bytes=None)

    def as_dict(self) -> dict[str, Any]:
        """The configuration as JSON-ready values (instances by class name, the shared tier without its secret
        or its URL's password, secret-named options as ``***``)."""
        def name(slot: object) -> Any:
            return slot if slot is None or isinstance(slot, (str, int, float)) else type(slot).__name__

        stack = self.stack
        slots = {slot: name(getattr(stack, slot)) for slot in STACK_SLOTS if slot not in ("callbacks", "options")}
        shared = stack.shared
        return {
            **slots,
            "cpu_blocks": stack.num_cpu_blocks,
            "block_size": self.block_size,
            "options": {k: redact(dict(v)) for k, v in stack.options.items()},
            "callbacks": [name(c) for c in stack.callbacks],
            "verify": self.verify,
            "model": attrs.asdict(self.model),
            "shared": None if shared is None else {
                "url": shown_url(shared.url) if isinstance(shared.url, str) else name(shared.url),
                "write": shared.write, "model": shared.model, "tenant": shared.tenant,
                "backoff_s": shared.backoff_s},
            "block_bytes": self.spec.bytes_per_block,
            "cost": attrs.asdict(self.cost),
        }


@attrs.frozen(kw_only=True)
class SimResult:
    """What one simulation measured. Token and byte figures cover simulated requests only.

    Attributes:
        config: the configuration simulated.
        requests: requests simulated.
        skipped_requests: requests larger than the whole GPU pool (never run).
        queued_requests: requests that waited for GPU blocks.
        prompt_tokens: prompt tokens of the simulated requests.
        block_references: prompt blocks of the simulated requests (the last,
            partial block included, as the trace counts them).
        gpu_hit_tokens / cpu_hit_tokens / shared_hit_tokens: prompt tokens
            served by each tier (a shared hit is fetched into the CPU tier and
            loaded from there; it counts here, not as a CPU hit).
        computed_tokens: prompt tokens recomputed (the rest of ``prompt_tokens``).
        overlapped_tokens: of those, the plans' heads: hit tokens recomputed
            while the rest of their hit loaded.
        declined_cpu / declined_shared: hit tokens each tier offered that the
            plans did not load (recomputed instead: heads and declined ends).
        blocks_stored / blocks_loaded: blocks that became findable on the CPU
            tier / were loaded back; ``bytes_*`` the same in ``config.model`` bytes.
        evictions_gpu / evictions_cpu: blocks each tier's pool evicted.
        leaked_blocks: blocks still referenced after the final drain (must be 0).
        integrity_errors: loaded blocks whose bytes differed from what was
            stored (``None`` unless ``config.verify``).
        ttft_ms: modelled time to first token of each simulated request, in order.
        seconds: wall time of the simulation.
        stats: the manager's counters (``OffloadStats.as_dict()``).
        planner: the load planner's estimates at the end (``LoadPlanner.estimates()``).
    """

    config: SimConfig
    requests: int
    skipped_requests: int
    queued_requests: int
    prompt_tokens: int
    block_references: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    computed_tokens: int
    blocks_stored: int
    blocks_loaded: int
    evictions_gpu: int
    evictions_cpu: int
    leaked_blocks: int
    integrity_errors: int | None
    ttft_ms: array
    seconds: float
    stats: dict[str, int | float]
    shared_hit_tokens: int = 0
    overlapped_tokens: int = 0
    declined_cpu: int = 0
    declined_shared: int = 0
    planner: dict[str, Any] = attrs.field(factory=dict)

    @property
    def bytes_stored(self) -> int:
        """Bytes of KV stored to the CPU tier (``config.model``)."""
        return self.blocks_stored * self.config.spec.bytes_per_block

    @property
    def bytes_loaded(self) -> int:
        """Bytes of KV loaded back from the CPU tier (``config.model``)."""
        return self.blocks_loaded * self.config.spec.bytes_per_block

    @property
    def block_refs_per_s(self) -> float:
        """Simulation speed: block references replayed per wall-clock second."""
        return self.block_references / self.seconds if self.seconds > 0 else 0.0

    @property
    def ttft_mean_ms(self) -> float:
        """Mean modelled TTFT in ms (0 with no request)."""
        return sum(self.ttft_ms) / len(self.ttft_ms) if self.ttft_ms else 0.0

    def ttft_percentiles(self, qs: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
        """``{"p50": ..., ...}``: percentiles of the modelled TTFT in ms (0 with no request)."""
        import numpy as np

        ttft = np.frombuffer(self.ttft_ms, dtype=np.float64) if len(self.ttft_ms) else np.zeros(1)
        return {f"p{q:g}": round(float(np.percentile(ttft, q)), 3) for q in qs}

    def as_dict(self) -> dict[str, Any]:
        """Every figure as JSON-ready values (the TTFT list summarised as percentiles)."""
        ttft = self.ttft_percentiles()
        ttft["mean"] = round(self.ttft_mean_ms, 3)
        return {
            "requests": self.requests,
            "skipped_requests": self.skipped_requests,
            "queued_requests": self.queued_requests,
            "prompt_tokens": self.prompt_tokens,
            "block_references": self.block_references,
            "gpu_hit_tokens": self.gpu_hit_tokens,
            "cpu_hit_tokens": self.cpu_hit_tokens,
            "shared_hit_tokens": self.shared_hit_tokens,
            "computed_tokens": self.computed_tokens,
            "overlapped_tokens": self.overlapped_tokens,
            "declined_cpu": self.declined_cpu,
            "declined_shared": self.declined_shared,
            "blocks_stored": self.blocks_stored,
            "blocks_loaded": self.blocks_loaded,
            "bytes_stored": self.bytes_stored,
            "bytes_loaded": self.bytes_loaded,
            "evictions_gpu": self.evictions_gpu,
            "evictions_cpu": self.evictions_cpu,
            "leaked_blocks": self.leaked_blocks,
            "integrity_errors": self.integrity_errors,
            "ttft_model_ms": ttft,
            "seconds": round(self.seconds, 3),
            "block_refs_per_s": round(self.block_refs_per_s),
            "planner": dict(self.planner),
            "config": self.config.as_dict(),
        }


def tier_effect(without: Mapping[str, float], with_: Mapping[str, float], *, served: int,
                declined: int) -> dict[str, Any]:
    """What a tier did to the modelled time to first token, JSON-ready.

    Args:
        without / with_: TTFT summaries (``mean`` and ``p90`` in ms) of the
            same trace without the tier and with it.
        served: prompt tokens the tier served.
        declined: hit tokens the tier offered that the load plans recomputed.

    Returns:
        ``verdict`` (``"sooner"``, ``"later"`` or ``"same"``, by the mean),
        ``mean_ms`` and ``p90_ms`` as ``[without, with]``, ``mean_change`` and
        ``p90_change`` (relative, negative when sooner), ``served_tokens`` and
        ``declined_tokens``.
    """
    def change(q: str) -> float:
        return round((with_[q] - without[q]) / without[q], 4) if without[q] else 0.0

    mean = change("mean")
    return {"verdict": "sooner" if mean < 0 else "later" if mean > 0 else "same",
            "mean_ms": [without["mean"], with_["mean"]], "mean_change": mean,
            "p90_ms": [without["p90"], with_["p90"]], "p90_change": change("p90"),
            "served_tokens": served, "declined_tokens": declined}


def describe_effect(tier: str, effect: Mapping[str, Any]) -> str:
    """One sentence for a report: whether ``tier`` made the first token sooner or later, by how much."""
    (a, b), (c, d) = effect["mean_ms"], effect["p90_ms"]
    verdict = {"same": "neither sooner nor later"}.get(effect["verdict"], effect["verdict"])
    return (f"the {tier} tier made the first token {verdict}: mean {b:,.1f} vs {a:,.1f} ms "
            f"({effect['mean_change']:+.1%}), p90 {d:,.1f} vs {c:,.1f} ms ({effect['p90_change']:+.1%}); it "
            f"served {plural(effect['served_tokens'], 'prompt token', grouped=True)}, and the load plans "
            f"recomputed {plural(effect['declined_tokens'], 'hit token', grouped=True)} instead of loading them")


_NOT_BUILT = ("the stack is built at the first request, whose block size it takes; give SimConfig(block_size=...) "
              "to build it now")


@attrs.define(eq=False)
class Simulator:
    """Replays requests one at a time through a stack built from ``config``.

    Feed requests in arrival order with :meth:`feed`, then :meth:`close` once
    to finish every request, drain the stack and get the :class:`SimResult`.
    :func:`simulate` does both. The stack is built at construction when
    ``config.block_size`` is set, else at the first request, whose block size
    it takes (``config`` then has it).

    Invariants: the clock never goes back; a running request holds its GPU
    blocks until its modelled end; after :meth:`close` no block is held.
    """

    config: SimConfig
    _stack: OffloadStack | None = attrs.field(init=False, default=None)
    _engine: ReferenceEngine | None = attrs.field(init=False, default=None)
    _running: list[tuple[float, int, str]] = attrs.field(init=False, factory=list)  # end-time heap
    _clock_ms: float = attrs.field(init=False, default=0.0)
    _last_arrival_ms: float = attrs.field(init=False, default=0.0)
    _block_bytes: int = attrs.field(init=False, default=0)
    _gpu_blocks: int = attrs.field(init=False, default=0)
    _ttft: array = attrs.field(init=False, factory=lambda: array("d"))
    _counts: dict[str, int] = attrs.field(init=False, factory=lambda: dict.fromkeys(
        ("skipped", "queued", "prompt_tokens", "block_references", "gpu", "cpu", "shared"), 0))
    _started: float = attrs.field(init=False, factory=time.perf_counter)
    _closed: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.config, SimConfig):
            raise ConfigError(f"config must be a SimConfig, got {quote(self.config)}")
        if self.config.block_size is not None:
            self._build(self.config)

    def _build(self, config: SimConfig) -> ReferenceEngine:
        stack = build(config.stack_config(), layout="per-layer" if config.verify else None)
        self.config, self._stack = config, stack
        self._engine = ReferenceEngine(stack)
        self._block_bytes = config.spec.bytes_per_block
        self._gpu_blocks = stack.gpu.num_blocks
        return self._engine

    @property
    def stack(self) -> OffloadStack:
        """The simulated stack.

        Raises:
            RequestStateError: not built yet (``config.block_size`` is the first request's).
        """
        if self._stack is None:
            raise RequestStateError(_NOT_BUILT)
        return self._stack

    @property
    def engine(self) -> ReferenceEngine:
        """The reference engine loop driving :attr:`stack` (built with it).

        Raises:
            RequestStateError: not built yet.
        """
        if self._engine is None:
            raise RequestStateError(_NOT_BUILT)
        return self._engine

    @property
    def requests(self) -> int:
        """Requests fed so far and simulated (skipped ones excluded)."""
        return len(self._ttft)

    def feed(self, request: TraceRequest) -> None:
        """Simulate one request (arrivals must not go back in time).

        Raises:
            TraceFormatError: the request's block size is not ``config.block_size``,
                its ``hash_ids`` do not fit it, or it arrives before the previous one.
            ConfigError: the first request's block size makes the config invalid
                (``cpu_bytes`` that hold no block of it).
            RequestStateError: :meth:`close` was called.
        """
        if self._closed:
            raise RequestStateError("the simulation is closed; build a new Simulator")
        engine = self._engine
        if engine is None:
            engine = self._build(attrs.evolve(self.config, block_size=request.block_size))
        bt, counts = self.config.block_size, self._counts
        if request.block_size != bt:
            raise TraceFormatError("<trace>", request.line, "block_size",
                                   f"is {plural(request.block_size, 'token')}, but the simulation's blocks are "
                                   f"SimConfig.block_size={bt}; hint: leave block_size unset to take the trace's")
        n = request.input_length
        if len(request.hash_ids) != -(-n // bt):
            raise TraceFormatError("<trace>", request.line, "hash_ids",
                                   f"has {plural(len(request.hash_ids), 'id')} but input_length={n} needs "
                                   f"{plural(-(-n // bt), 'block')} of {plural(bt, 'token')}")
        if request.timestamp_ms < self._last_arrival_ms:
            raise TraceFormatError("<trace>", request.line, "timestamp",
                                   f"decreases: {request.timestamp_ms!r} after {self._last_arrival_ms!r}")
        self._last_arrival_ms = request.timestamp_ms
        if len(request.hash_ids) > self._gpu_blocks:
            counts["skipped"] += 1
            return
        running, stats = self._running, engine.stack.stats
        rid = str(len(self._ttft))
        start = max(request.timestamp_ms, self._clock_ms)
        while running and running[0][0] <= start:
            engine.finish(heapq.heappop(running)[2])
        engine.add_request(rid, cast("tuple[BlockHash, ...]", request.hash_ids[: n // bt]), n)  # ids are hashes
        shared_before = stats.shared_hit_tokens.value
        retried, failed_at = False, start  # the engine prefetches it at its first failed scheduling attempt
        while not (report := engine.step()).scheduled:
            # Stores flushed by finished requests hold GPU blocks until the step that
            # copies them, which was this one: the blocks are free now (no time passes).
            if not retried:
                retried = True
                continue
            assert running, f"request {rid} fits the GPU pool but was not admitted"
            end, _, done = heapq.heappop(running)  # queue: the earliest-ending request makes room
            start = max(start, end)
            engine.finish(done)
            retried = False
        if start > request.timestamp_ms:
            counts["queued"] += 1
        self._clock_ms = start
        req = report.scheduled[0]
        gpu, head, cpu = req.gpu_hit_tokens, req.head_tokens, req.cpu_hit_tokens
        shared = min(cpu, int(stats.shared_hit_tokens.value - shared_before))  # 0 if its fetch failed
        cpu -= shared
        ready_ms, prefetched = 0.0, 0  # CPU-hit tokens it loads that its prefetch brought, and their wait
        if req.prefetched:
            prefetch_ms, lo = self._prefetch_ms(len(req.prefetched)), (gpu + head) // bt
            prefetched = bt * len(range(max(lo, req.prefetched.start), min(lo + cpu // bt, req.prefetched.stop)))
            if prefetched:
                ready_ms = max(0.0, failed_at + prefetch_ms - start)
        first_token = start + self._prefill_ms(n, gpu, head, cpu // bt, shared // bt, ready_ms)
        self._ttft.append(first_token - request.timestamp_ms)
        end = first_token + request.output_length * self.config.cost.decode_ms_per_token
        heapq.heappush(running, (end, len(self._ttft), rid))
        counts["prompt_tokens"] += n
        counts["block_references"] += len(request.hash_ids)
        counts["gpu"] += gpu
        counts["cpu"] += cpu - prefetched
        counts["shared"] += shared + prefetched

    def _prefetch_ms(self, blocks: int) -> float:
        """The modelled time of a prefetch of ``blocks`` blocks; tells the planner."""
        fetch_ms = self.config.cost.fetch_ms(blocks * self._block_bytes)
        planner, kv = self.stack.manager.planner, self.stack.config.kv
        if planner is not None and kv is not None:
            planner.observe_move(HitSource.SHARED, blocks * kv.bytes_per_block, fetch_ms * 1e-3)
        return fetch_ms

    def _prefill_ms(self, n: int, gpu: int, head: int, cpu_blocks: int, shared_blocks: int,
                    ready_ms: float = 0.0) -> float:
        """The modelled prefill of a request (its load side ``ready_ms`` late: a prefetch still landing);
        tells the planner what each of its parts took."""
        cost, planner = self.config.cost, self.stack.manager.planner
        bt, kv = self.config.block_size, self.stack.config.kv
        assert bt is not None and kv is not None  # the stack is built
        loaded = cpu_blocks + shared_blocks
        rest = n - gpu - head - loaded * bt
        fetch_ms = cost.fetch_ms(shared_blocks * self._block_bytes)
        load_ms = cost.load_ms(loaded * self._block_bytes)
        if planner is not None:
            stack_bytes = kv.bytes_per_block
            if shared_blocks:
                planner.observe_move(HitSource.SHARED, shared_blocks * stack_bytes, fetch_ms * 1e-3)
            if loaded:
                planner.observe_move(HitSource.CPU, loaded * stack_bytes, load_ms * 1e-3)
            if head:
                planner.observe_compute(head, gpu, cost.compute_ms(head) * 1e-3)
            planner.observe_compute(rest, n - rest, cost.compute_ms(rest) * 1e-3)
        return cost.prefill_ms(head + rest, loaded * self._block_bytes, shared_blocks * self._block_bytes, head,
                               ready_ms)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the stack or the simulator's own bookkeeping is inconsistent."""
        if not self._closed and self._stack is not None:
            self._stack.check_invariants()
        assert all(end >= self._clock_ms for end, _, _ in self._running), "a running request ended in the past"
        counts = self._counts
        assert counts["gpu"] + counts["cpu"] + counts["shared"] <= counts["prompt_tokens"], counts
        assert len(self._running) <= len(self._ttft), (len(self._running), len(self._ttft))

    def close(self) -> SimResult:
        """Finish every running request, drain the stack and report.

        Raises:
            RequestStateError: called twice.
        """
        if self._closed:
            raise RequestStateError("the simulation is already closed")
        engine = self._engine
        if engine is None:  # no request came: an empty run at the default block size
            engine = self._build(attrs.evolve(self.config, block_size=DEFAULTS.block_size))
        self._closed = True
        running = self._running
        while running:
            engine.finish(heapq.heappop(running)[2])
        engine.step()  # plans the stores the last finishes flushed
        engine.drain()
        leaked = engine.leaked_blocks()
        stack = engine.stack
        stack.check_invariants()
        stack.close()
        stats, counts = stack.stats, self._counts
        return SimResult(
            config=self.config,
            requests=len(self._ttft),
            skipped_requests=counts["skipped"],
            queued_requests=counts["queued"],
            prompt_tokens=counts["prompt_tokens"],
            block_references=counts["block_references"],
            gpu_hit_tokens=counts["gpu"],
            cpu_hit_tokens=counts["cpu"],
            computed_tokens=counts["prompt_tokens"] - counts["gpu"] - counts["cpu"] - counts["shared"],
            blocks_stored=int(stats.blocks_stored),
            blocks_loaded=int(stats.blocks_loaded),
            evictions_gpu=int(stats.evictions_gpu),
            evictions_cpu=int(stats.evictions_cpu),
            leaked_blocks=leaked,
            integrity_errors=engine.integrity_errors if self.config.verify else None,
            ttft_ms=self._ttft,
            seconds=time.perf_counter() - self._started,
            stats=stats.as_dict(),
            shared_hit_tokens=counts["shared"],
            overlapped_tokens=int(stats.hit_tokens_overlapped),
            declined_cpu=int(stats.hits_declined_cpu),
            declined_shared=int(stats.hits_declined_shared),
            planner={} if self.stack.manager.planner is None else dict(self.stack.manager.planner.estimates()),
        )

    def abort(self) -> None:
        """Release the stack without a result (a feed failed); the simulator is closed."""
        self._closed = True
        if self._stack is not None:
            self._stack.close()


def simulate(requests: Iterable[TraceRequest], config: SimConfig | None = None, *,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Replay ``requests`` (arrival order) through a stack built from ``config``; see the module docstring.

    Streams: ``requests`` may be a lazy reader such as
    :func:`~kvkit.sim.traces.read_trace` of any length.

    Args:
        requests: trace requests in arrival order; the simulation's block size
            is theirs unless ``config.block_size`` says it.
        config: the simulation (default :class:`SimConfig()`).
        progress: called as ``progress(requests_read, block_references_read)``
            every few hundred requests and once at the end.

    Raises:
        ConfigError: invalid configuration.
        TraceFormatError: a malformed request (from the reader, or a block
            size or hash ids that do not fit ``config.block_size``).
    """
    sim = Simulator(config if config is not None else SimConfig())
    read = refs = 0
    with _single_threaded_torch(sim.config.verify):
        try:
            for request in requests:
                sim.feed(request)
                read += 1
                refs += len(request.hash_ids)
                if progress is not None and not read % _PROGRESS_EVERY:
                    progress(read, refs)
        except BaseException:
            sim.abort()
            raise
        if progress is not None:
            progress(read, refs)
        return sim.close()


@contextlib.contextmanager
def _single_threaded_torch(enabled: bool) -> Iterator[None]:
    """Run torch ops on one thread: --verify's tensors are tiny, and idle intra-op
    threads spin-waiting on a busy machine made it 4x slower."""
    if not enabled:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
