"""kvkit: compose, drive, explore and prove CPU offload tiers for paged KV caches.

This module is the public facade: every name a user needs, resolved on first
use (PEP 562), so ``import kvkit`` stays cheap and never imports torch or CuPy,
touches CUDA, or loads the manager or the registry. Backends load lazily by
name through the registries (``kvkit.EVICTION.create("lru")``); in-process
components join them with :func:`register`. Besides this facade, only
``kvkit.testing`` (contract suites) and ``kvkit.integrations.*`` (engines and
model libraries) are public; every other module path may move.

Invariants:
    * ``__all__`` is sorted and holds exactly ``errors`` and the keys of
      ``_LAZY``; each resolves, and the ``TYPE_CHECKING`` imports name the
      same targets (a test checks all three).
    * A resolved name is cached in the module's globals, so ``__getattr__``
      runs at most once per name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvkit import _moved, errors

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # compose: builder, configuration, stack, registries
    "build": "kvkit.stack:build",
    "OffloadStack": "kvkit.stack:OffloadStack",
    "StackConfig": "kvkit.config:StackConfig",
    "DEFAULTS": "kvkit.config:DEFAULTS",
    "parse_bytes": "kvkit.config:parse_bytes",
    "register": "kvkit.registry:register",
    "REGISTRIES": "kvkit.registry:REGISTRIES",
    "ALLOCATOR": "kvkit.registry:ALLOCATOR",
    "COPY": "kvkit.registry:COPY",
    "EVICTION": "kvkit.registry:EVICTION",
    "STORE": "kvkit.registry:STORE",
    "SHARED": "kvkit.registry:SHARED",
    "open_block_store": "kvkit.blockstores:open_block_store",
    # drive: scheduler side, worker side, hashing, stats
    "OffloadManager": "kvkit.manager:OffloadManager",
    "StepPlan": "kvkit.manager:StepPlan",
    "CompletionReport": "kvkit.manager:CompletionReport",
    "SharedTierSpec": "kvkit.manager.shared:SharedTierSpec",
    "TransferEngine": "kvkit.worker.engine:TransferEngine",
    "hash_blocks": "kvkit.hashing:hash_blocks",
    "BlockHasher": "kvkit.hashing:BlockHasher",
    "OffloadStats": "kvkit.stats:OffloadStats",
    # protocols and the value types they exchange
    "BlockAllocator": "kvkit.interfaces:BlockAllocator",
    "BlockHash": "kvkit.interfaces:BlockHash",
    "BlockId": "kvkit.interfaces:BlockId",
    "CopyBackend": "kvkit.interfaces:CopyBackend",
    "Direction": "kvkit.interfaces:Direction",
    "EvictionPolicy": "kvkit.interfaces:EvictionPolicy",
    "GroupKind": "kvkit.interfaces:GroupKind",
    "KVCacheSpec": "kvkit.interfaces:KVCacheSpec",
    "KVGroupSpec": "kvkit.interfaces:KVGroupSpec",
    "OffloadCallback": "kvkit.interfaces:OffloadCallback",
    "Region": "kvkit.interfaces:Region",
    "RequestView": "kvkit.interfaces:RequestView",
    "StorePolicy": "kvkit.interfaces:StorePolicy",
    "TransferPlan": "kvkit.interfaces:TransferPlan",
    "TransferResult": "kvkit.interfaces:TransferResult",
    "Tier": "kvkit.interfaces:Tier",
    # optional capabilities a component may have beyond its protocol
    "EvictionOrder": "kvkit.interfaces:EvictionOrder",
    "EvictionWindow": "kvkit.interfaces:EvictionWindow",
    "ExplainsUnavailability": "kvkit.interfaces:ExplainsUnavailability",
    "PinAwarePolicy": "kvkit.interfaces:PinAwarePolicy",
    "PrefillCompute": "kvkit.interfaces:PrefillCompute",
    "ReportsAvailability": "kvkit.interfaces:ReportsAvailability",
    "SelectivePins": "kvkit.interfaces:SelectivePins",
    "SelfChecking": "kvkit.interfaces:SelfChecking",
    "WindowedPolicy": "kvkit.interfaces:WindowedPolicy",
    "HintAwarePolicy": "kvkit.interfaces.hints:HintAwarePolicy",
    # what a request may tell the CPU tier's policy (OffloadManager.add_request(hints=...))
    "WorkloadHints": "kvkit.interfaces.hints:WorkloadHints",
    # explore: reference engine loop, simulator, workloads, traces
    "ReferenceEngine": "kvkit.sim.engine_loop:ReferenceEngine",
    "EngineRequest": "kvkit.sim.engine_loop:EngineRequest",
    "StepReport": "kvkit.sim.engine_loop:StepReport",
    "SyntheticCompute": "kvkit.sim.engine_loop:SyntheticCompute",
    "simulate": "kvkit.sim.simulator:simulate",
    "simulate_fleet": "kvkit.sim.fleet:simulate_fleet",
    "compare_fleets": "kvkit.sim.fleet:compare_fleets",
    "FleetResult": "kvkit.sim.fleet:FleetResult",
    "Simulator": "kvkit.sim.simulator:Simulator",
    "SimConfig": "kvkit.sim.simulator:SimConfig",
    "SimResult": "kvkit.sim.simulator:SimResult",
    "CostModel": "kvkit.sim.simulator:CostModel",
    "ModelShape": "kvkit.sim.simulator:ModelShape",
    "SyntheticWorkload": "kvkit.sim.synthetic:SyntheticWorkload",
    "generate": "kvkit.sim.synthetic:generate",
    "SHAPES": "kvkit.sim.synthetic:SHAPES",
    "shape": "kvkit.sim.synthetic:shape",
    "BUILTIN_TRACES": "kvkit.sim.traces:BUILTIN_TRACES",
    "TraceRequest": "kvkit.sim.traces:TraceRequest",
    "read_trace": "kvkit.sim.traces:read_trace",
    "write_trace": "kvkit.sim.traces:write_trace",
    # explore: eviction policies replayed on traces
    "OPT": "kvkit.sim.policy_study:OPT",
    "HitStats": "kvkit.sim.policy_study:HitStats",
    "PolicyStudy": "kvkit.sim.policy_study:PolicyStudy",
    "default_policies": "kvkit.sim.policy_study:default_policies",
    "replay": "kvkit.sim.policy_study:replay",
    "TraceClock": "kvkit.sim.policy_study:TraceClock",
    "libcachesim_study": "kvkit.sim.baselines:libcachesim_study",
    "LIBCACHESIM_POLICIES": "kvkit.sim.baselines:LIBCACHESIM_POLICIES",
    "study": "kvkit.sim.policy_study:study",
    "block_class": "kvkit.backends.eviction.hit_density:block_class",
    "REUSE_LEVELS": "kvkit.backends.eviction.hit_density:REUSE_LEVELS",
    # explore: copy-backend throughput (the library half of `kvkit bench transfer`)
    "Rig": "kvkit.sim.transfer_bench:Rig",
    "GemmLoad": "kvkit.sim.transfer_bench:GemmLoad",
    "bench_backend": "kvkit.sim.transfer_bench:bench_backend",
    "gemm_alone": "kvkit.sim.transfer_bench:gemm_alone",
    "make_plans": "kvkit.sim.transfer_bench:make_plans",
    "measure_ceiling": "kvkit.sim.transfer_bench:measure_ceiling",
    "run_transfer": "kvkit.sim.transfer_bench:run_transfer",
}
"""Public name -> ``"module:attribute"`` it resolves to on first use."""

__all__ = [
    "ALLOCATOR",
    "BUILTIN_TRACES",
    "BlockAllocator",
    "BlockHash",
    "BlockHasher",
    "BlockId",
    "COPY",
    "CompletionReport",
    "CopyBackend",
    "CostModel",
    "DEFAULTS",
    "Direction",
    "EVICTION",
    "EngineRequest",
    "EvictionOrder",
    "EvictionPolicy",
    "EvictionWindow",
    "ExplainsUnavailability",
    "FleetResult",
    "GemmLoad",
    "GroupKind",
    "HintAwarePolicy",
    "HitStats",
    "KVCacheSpec",
    "KVGroupSpec",
    "LIBCACHESIM_POLICIES",
    "ModelShape",
    "OPT",
    "OffloadCallback",
    "OffloadManager",
    "OffloadStack",
    "OffloadStats",
    "PinAwarePolicy",
    "PolicyStudy",
    "PrefillCompute",
    "REGISTRIES",
    "REUSE_LEVELS",
    "ReferenceEngine",
    "Region",
    "ReportsAvailability",
    "RequestView",
    "Rig",
    "SHAPES",
    "SHARED",
    "STORE",
    "SelectivePins",
    "SelfChecking",
    "SharedTierSpec",
    "SimConfig",
    "SimResult",
    "Simulator",
    "StackConfig",
    "StepPlan",
    "StepReport",
    "StorePolicy",
    "SyntheticCompute",
    "SyntheticWorkload",
    "Tier",
    "TraceClock",
    "TraceRequest",
    "TransferEngine",
    "TransferPlan",
    "TransferResult",
    "WindowedPolicy",
    "WorkloadHints",
    "bench_backend",
    "block_class",
    "build",
    "compare_fleets",
    "default_policies",
    "errors",
    "gemm_alone",
    "generate",
    "hash_blocks",
    "libcachesim_study",
    "make_plans",
    "measure_ceiling",
    "open_block_store",
    "parse_bytes",
    "read_trace",
    "register",
    "replay",
    "run_transfer",
    "shape",
    "simulate",
    "simulate_fleet",
    "study",
    "write_trace",
]

if TYPE_CHECKING:  # what __getattr__ returns, spelled out for type checkers and IDEs
    from kvkit.backends.eviction.hit_density import REUSE_LEVELS, block_class
    from kvkit.blockstores import open_block_store
    from kvkit.config import DEFAULTS, StackConfig, parse_bytes
    from kvkit.hashing import BlockHasher, hash_blocks
    from kvkit.interfaces import (
        BlockAllocator,
        BlockHash,
        BlockId,
        CopyBackend,
        Direction,
        EvictionOrder,
        EvictionPolicy,
        EvictionWindow,
        ExplainsUnavailability,
        GroupKind,
        KVCacheSpec,
        KVGroupSpec,
        OffloadCallback,
        PinAwarePolicy,
        PrefillCompute,
        Region,
        ReportsAvailability,
        RequestView,
        SelectivePins,
        SelfChecking,
        StorePolicy,
        Tier,
        TransferPlan,
        TransferResult,
        WindowedPolicy,
    )
    from kvkit.interfaces.hints import HintAwarePolicy, WorkloadHints
    from kvkit.manager import CompletionReport, OffloadManager, StepPlan
    from kvkit.manager.shared import SharedTierSpec
    from kvkit.registry import ALLOCATOR, COPY, EVICTION, REGISTRIES, SHARED, STORE, register
    from kvkit.sim.baselines import LIBCACHESIM_POLICIES, libcachesim_study
    from kvkit.sim.engine_loop import EngineRequest, ReferenceEngine, StepReport, SyntheticCompute
    from kvkit.sim.fleet import FleetResult, compare_fleets, simulate_fleet
    from kvkit.sim.policy_study import OPT, HitStats, PolicyStudy, TraceClock, default_policies, replay, study
    from kvkit.sim.simulator import CostModel, ModelShape, SimConfig, SimResult, Simulator, simulate
    from kvkit.sim.synthetic import SHAPES, SyntheticWorkload, generate, shape
    from kvkit.sim.traces import BUILTIN_TRACES, TraceRequest, read_trace, write_trace
    from kvkit.sim.transfer_bench import (
        GemmLoad,
        Rig,
        bench_backend,
        gemm_alone,
        make_plans,
        measure_ceiling,
        run_transfer,
    )
    from kvkit.stack import OffloadStack, build
    from kvkit.stats import OffloadStats
    from kvkit.worker.engine import TransferEngine

_moved.install()  # old module paths (kvkit.simulator, ...) import for one more release, with a warning


def __getattr__(name: str) -> Any:
    """Import the target of a public name on first use and cache it in this module."""
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'kvkit' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """Module globals and every public name, resolved or not."""
    return sorted({*globals(), *_LAZY})
