"""kvkit: compose, drive, explore and prove offload tiers for paged KV caches.

This module is the public facade: the names a user composes with, each
resolved on first use (PEP 562), so ``import kvkit`` stays cheap and never
imports torch or CuPy, touches CUDA, or loads the manager or the registry.
Backends load lazily by name through the registries
(``kvkit.EVICTION.create("lru")``); in-process components join them with
:func:`register`. Each room exports the rest of its public names:
``kvkit.interfaces`` (the protocols, capabilities and value types; the
shared tier's in ``kvkit.interfaces.shared``, workload hints in
``kvkit.interfaces.hints``), ``kvkit.errors``, ``kvkit.sim``, ``kvkit.reference``, ``kvkit.shared``,
``kvkit.bench``, ``kvkit.testing`` (contract suites) and
``kvkit.integrations.*`` (engines and model libraries).

Invariants:
    * ``__all__`` is sorted and holds exactly ``errors`` and the keys of
      ``_LAZY``; each resolves, and the ``TYPE_CHECKING`` imports name the
      same targets (a test checks all three).
    * A resolved name is cached in the module's globals, so ``__getattr__``
      runs at most once per name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvkit import errors
from kvkit._lazy import lazy_exports

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # compose: the builder, its configuration, the registries of named components
    "build": "kvkit.stack:build",
    "OffloadStack": "kvkit.stack:OffloadStack",
    "StackConfig": "kvkit.config:StackConfig",
    "SharedConfig": "kvkit.config:SharedConfig",
    "register": "kvkit.registry:register",
    "ALLOCATOR": "kvkit.registry:ALLOCATOR",
    "COPY": "kvkit.registry:COPY",
    "EVICTION": "kvkit.registry:EVICTION",
    "STORE": "kvkit.registry:STORE",
    "SHARED": "kvkit.registry:SHARED",
    "open_block_store": "kvkit.shared.urls:open_block_store",
    # drive: the scheduler side, the worker side, the reference engine, hashing, stats
    "OffloadManager": "kvkit.manager.manager:OffloadManager",
    "StepPlan": "kvkit.manager.step:StepPlan",
    "CompletionReport": "kvkit.manager.step:CompletionReport",
    "TransferEngine": "kvkit.worker.engine:TransferEngine",
    "ReferenceEngine": "kvkit.reference:ReferenceEngine",
    "hash_blocks": "kvkit.hashing:hash_blocks",
    "OffloadStats": "kvkit.stats:OffloadStats",
    "WorkloadHints": "kvkit.interfaces.hints:WorkloadHints",
    # protocols and the value types they exchange (every other one: kvkit.interfaces)
    "BlockAllocator": "kvkit.interfaces:BlockAllocator",
    "CopyBackend": "kvkit.interfaces:CopyBackend",
    "EvictionPolicy": "kvkit.interfaces:EvictionPolicy",
    "StorePolicy": "kvkit.interfaces:StorePolicy",
    "BlockStore": "kvkit.interfaces.shared:BlockStore",
    "OffloadCallback": "kvkit.interfaces:OffloadCallback",
    "KVCacheSpec": "kvkit.interfaces:KVCacheSpec",
    "KVGroupSpec": "kvkit.interfaces:KVGroupSpec",
    "TransferPlan": "kvkit.interfaces:TransferPlan",
    "TransferResult": "kvkit.interfaces:TransferResult",
    "Direction": "kvkit.interfaces:Direction",
    "Tier": "kvkit.interfaces:Tier",
    # explore: simulator, workloads, traces, policy replays (the rest: kvkit.sim)
    "simulate": "kvkit.sim.simulator:simulate",
    "simulate_fleet": "kvkit.sim.fleet:simulate_fleet",
    "SimConfig": "kvkit.sim.simulator:SimConfig",
    "SimResult": "kvkit.sim.simulator:SimResult",
    "SyntheticWorkload": "kvkit.sim.synthetic:SyntheticWorkload",
    "shape": "kvkit.sim.synthetic:shape",
    "read_trace": "kvkit.sim.traces:read_trace",
    "write_trace": "kvkit.sim.traces:write_trace",
    "replay": "kvkit.sim.policy_study:replay",
    "study": "kvkit.sim.policy_study:study",
    "TraceClock": "kvkit.sim.policy_study:TraceClock",
    # errors a caller most often catches (every error: kvkit.errors)
    "KVKitError": "kvkit.errors:KVKitError",
    "ConfigError": "kvkit.errors:ConfigError",
    "OutOfBlocksError": "kvkit.errors:OutOfBlocksError",
    "TransferTimeoutError": "kvkit.errors:TransferTimeoutError",
    "BackendUnavailableError": "kvkit.errors:BackendUnavailableError",
}
"""Public name -> ``"module:attribute"`` it resolves to on first use."""

__all__ = [
    "ALLOCATOR",
    "BackendUnavailableError",
    "BlockAllocator",
    "BlockStore",
    "COPY",
    "CompletionReport",
    "ConfigError",
    "CopyBackend",
    "Direction",
    "EVICTION",
    "EvictionPolicy",
    "KVCacheSpec",
    "KVGroupSpec",
    "KVKitError",
    "OffloadCallback",
    "OffloadManager",
    "OffloadStack",
    "OffloadStats",
    "OutOfBlocksError",
    "ReferenceEngine",
    "SHARED",
    "STORE",
    "SharedConfig",
    "SimConfig",
    "SimResult",
    "StackConfig",
    "StepPlan",
    "StorePolicy",
    "SyntheticWorkload",
    "Tier",
    "TraceClock",
    "TransferEngine",
    "TransferPlan",
    "TransferResult",
    "TransferTimeoutError",
    "WorkloadHints",
    "build",
    "errors",
    "hash_blocks",
    "open_block_store",
    "read_trace",
    "register",
    "replay",
    "shape",
    "simulate",
    "simulate_fleet",
    "study",
    "write_trace",
]

if TYPE_CHECKING:  # what __getattr__ returns, spelled out for type checkers and IDEs
    from kvkit.config import SharedConfig, StackConfig
    from kvkit.errors import BackendUnavailableError, ConfigError, KVKitError, OutOfBlocksError, TransferTimeoutError
    from kvkit.hashing import hash_blocks
    from kvkit.interfaces import (
        BlockAllocator,
        CopyBackend,
        Direction,
        EvictionPolicy,
        KVCacheSpec,
        KVGroupSpec,
        OffloadCallback,
        StorePolicy,
        Tier,
        TransferPlan,
        TransferResult,
    )
    from kvkit.interfaces.hints import WorkloadHints
    from kvkit.interfaces.shared import BlockStore
    from kvkit.manager.manager import OffloadManager
    from kvkit.manager.step import CompletionReport, StepPlan
    from kvkit.reference import ReferenceEngine
    from kvkit.registry import ALLOCATOR, COPY, EVICTION, SHARED, STORE, register
    from kvkit.shared.urls import open_block_store
    from kvkit.sim.fleet import simulate_fleet
    from kvkit.sim.policy_study import TraceClock, replay, study
    from kvkit.sim.simulator import SimConfig, SimResult, simulate
    from kvkit.sim.synthetic import SyntheticWorkload, shape
    from kvkit.sim.traces import read_trace, write_trace
    from kvkit.stack import OffloadStack, build
    from kvkit.stats import OffloadStats
    from kvkit.worker.engine import TransferEngine

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
