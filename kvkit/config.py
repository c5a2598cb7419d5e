"""``StackConfig``: every slot of an offload stack, validated all at once.

A slot takes a registered name or an instance. Construction checks every slot
and raises *one* :class:`~kvkit.errors.ConfigError` listing each problem (the
bad value quoted, the valid names, a hint), so a user fixes a config in one
round instead of one error at a time. :meth:`StackConfig.resolve` turns the
names into components; building pools, manager and engine is the stack's job.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

import attrs

from kvkit.errors import ConfigError
from kvkit.hashing import HASH_ALGORITHMS
from kvkit.interfaces import (
    BlockAllocator,
    CopyBackend,
    EvictionPolicy,
    KVCacheSpec,
    OffloadCallback,
    StorePolicy,
)
from kvkit.interfaces.plan import LoadPlanner
from kvkit.interfaces.shared import SHARED_WRITES, BlockStore
from kvkit.registry import ALLOCATOR, COPY, EVICTION, PLANNER, STORE, Registry, did_you_mean
from kvkit.validate import check_real, int_problem, is_int
from kvkit.worker import WAIT_TIMEOUT_S
from kvkit.worker.memory import BOOKKEEPING_BYTES_PER_BLOCK, check_fits

__all__ = ["DEFAULTS", "DEVICES", "Components", "Defaults", "StackConfig", "parse_bytes"]

DEVICES = ("cpu", "cuda")
"""Where the GPU tier lives; ``"cpu"`` is the stand-in CI and notebooks use."""

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")

# Slots a registry instantiates, and which registry; "allocator" is a factory slot.
_INSTANCE_SLOTS: dict[str, Registry[Any]] = {
    "cpu_eviction": EVICTION, "gpu_eviction": EVICTION, "store": STORE, "copy": COPY, "planner": PLANNER,
}
_OPTION_SLOTS = (*_INSTANCE_SLOTS, "allocator")


@attrs.frozen(kw_only=True)
class Defaults:
    """kvkit's defaults, in one record: the config, simulator, CLI and vLLM connector read them here.

    Attributes:
        cpu_eviction / gpu_eviction / store / copy / allocator / planner:
            registered names of the stack's slots.
        hash_algorithm: one of :data:`kvkit.hashing.HASH_ALGORITHMS`.
        world_size: workers per stack.
        block_size: tokens per block where the engine does not decide it
            (simulator, synthetic workload, benchmarks, Hugging Face models).
        gpu_blocks: GPU tier size of a simulation (64Ki tokens at 16-token blocks).
        cpu_blocks: CPU tier size of a simulation (8x the GPU tier).
        wait_timeout_s: seconds a worker's ``drain``/``close`` wait at most.
    """

    cpu_eviction: str = "hit-density"
    gpu_eviction: str = "lru"
    store: str = "eager"
    copy: str = "torch"
    allocator: str = "pool"
    planner: str = "overlap"
    hash_algorithm: str = "sha256"
    world_size: int = 1
    block_size: int = 16
    gpu_blocks: int = 4096
    cpu_blocks: int = 32768
    wait_timeout_s: float = WAIT_TIMEOUT_S


DEFAULTS = Defaults()
"""kvkit's defaults (see :class:`Defaults`)."""


def parse_bytes(text: str | int) -> int:
    """Bytes in ``text``: an int, or a number with an optional unit (``"8GiB"``, ``"512MB"``, ``"1.5 GiB"``).

    Units are case-insensitive; ``KB``/``MB``/``GB``/``TB`` are powers of 1000,
    ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024. Fractions of a byte round down.

    Raises:
        ConfigError: ``text`` is not a non-negative size.
    """
    if is_int(text):
        if text < 0:
            raise ConfigError(f"byte size must be non-negative, got {text!r}")
        return int(text)
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None or match[2].lower() not in _UNITS:
        raise ConfigError(
            f"cannot parse byte size {text!r}; expected an int or a number with a unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '8GiB' or '1.5 GiB'")
    return int(Fraction(match[1]) * _UNITS[match[2].lower()])


def _default_device() -> str:
    import torch  # deferred: `import kvkit` must not import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@attrs.frozen
class Components:
    """The instantiated parts of one stack (``StackConfig.resolve()``).

    Attributes:
        gpu_eviction: the GPU pool's policy.
        cpu_eviction: the CPU pool's policy (never the same object as ``gpu_eviction``).
        store: decides which GPU blocks go to the CPU tier.
        copy: moves the bytes (regions not registered yet); ``None`` for a
            scheduler-only stack.
        allocator: ``allocator(num_blocks=..., eviction=...)`` builds one pool per tier,
            checked against ``BlockAllocator``; the config's allocator options are bound.
        gpu_blocks: GPU pool size in blocks.
        cpu_blocks: CPU pool size in blocks (``cpu_bytes`` already converted).
        callbacks: observers, in call order.
        planner: decides per request which hit blocks to load and which to recompute.
    """

    gpu_eviction: EvictionPolicy
    cpu_eviction: EvictionPolicy
    store: StorePolicy
    copy: CopyBackend | None
    allocator: Callable[..., BlockAllocator]
    gpu_blocks: int
    cpu_blocks: int
    callbacks: tuple[OffloadCallback, ...]
    planner: LoadPlanner


@attrs.frozen(kw_only=True)
class StackConfig:
    """Every slot of an offload stack; construction validates all of them.

    Attributes:
        kv: shape of the KV cache (required).
        gpu_blocks: GPU pool size in blocks (required, >= 1).
        cpu_blocks: CPU pool size in blocks; give this or ``cpu_bytes``.
        cpu_bytes: CPU pool size in bytes (int or ``"8GiB"``); must hold a block.
        cpu_eviction: the CPU tier's eviction policy (name or instance);
            ``eviction=`` is its deprecated old name (warns; one release).
        gpu_eviction: the GPU tier's eviction policy (name or a *different* instance).
        store: store policy (name or instance).
        copy: copy backend (name or instance), or ``None`` for a scheduler-only
            stack that moves no bytes (simulation; imports no copy backend).
        allocator: block pool (name, or a factory ``(num_blocks=..., eviction=...) -> BlockAllocator``).
        planner: the load planner (name or instance): per request, which
            blocks of a CPU or shared-tier hit to load and which to recompute
            (see :mod:`kvkit.interfaces.plan`); ``"load-all"`` loads every hit.
        callbacks: ``OffloadCallback`` instances.
        world_size: workers that must all finish a copy before it counts (>= 1).
        device: ``"cuda"`` (default where available) or ``"cpu"``.
        hash_algorithm: one of :data:`kvkit.hashing.HASH_ALGORITHMS`.
        cpu_layout: layout of every worker's CPU mirror, a name in
            :data:`kvkit.worker.layouts.LAYOUTS`; ``None`` (default) mirrors the GPU
            tier's layout (``build(layout=...)``). Only a stack that moves bytes has one.
        wait_timeout_s: how long each worker's ``drain()`` and ``close()`` wait
            at most by default, in seconds (> 0; ``math.inf`` waits forever).
        options: per-slot constructor kwargs for named slots, e.g. ``{"store": {"k": 2}}``.
        shared: the shared (third) tier behind the CPU tier: a URL
            (``"memory://"``, ``"file:///path"``, ``"valkey://host:6379/0"``) or a
            :class:`~kvkit.interfaces.shared.BlockStore` instance; ``None``
            (default) for two tiers. See :mod:`kvkit.shared.scheduler`.
        shared_write: ``"write-through"`` (put what a CPU store committed) or
            ``"write-back"`` (put the CPU tier's next eviction candidates).
        shared_model: the model identity (name and revision or fingerprint) in
            the shared tier's namespace: instances that share a store share
            blocks only under the same identity, spec, layout and world size.
        shared_secret: HMAC secret (bytes) every instance of a deployment shares, or ``None``.
        shared_backoff_s: seconds the shared tier stays off after a failure
            before a probe (doubling on each failed probe, at most 60x).

    Defaults come from :data:`DEFAULTS`.

    Invariants: a constructed config has no problems; instances given in slots
    are used as-is by :meth:`resolve`, so resolve a config once per stack.

    Raises:
        ConfigError: on construction, listing every problem found.
    """

    kv: KVCacheSpec | None = None
    gpu_blocks: int | None = None
    cpu_blocks: int | None = None
    cpu_bytes: int | str | None = None
    cpu_eviction: str | EvictionPolicy = DEFAULTS.cpu_eviction
    gpu_eviction: str | EvictionPolicy = DEFAULTS.gpu_eviction
    store: str | StorePolicy = DEFAULTS.store
    copy: str | CopyBackend | None = DEFAULTS.copy
    allocator: str | Callable[..., BlockAllocator] = DEFAULTS.allocator
    planner: str | LoadPlanner = DEFAULTS.planner
    callbacks: list[OffloadCallback] | tuple[OffloadCallback, ...] = ()
    world_size: int = DEFAULTS.world_size
    device: str = attrs.field(factory=_default_device)
    hash_algorithm: str = DEFAULTS.hash_algorithm
    cpu_layout: str | None = None
    wait_timeout_s: float = DEFAULTS.wait_timeout_s
    options: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    shared: str | BlockStore | None = None
    shared_write: str = "write-through"
    shared_model: str = "unnamed-model"
    shared_secret: bytes | None = None
    shared_backoff_s: float = 1.0

    def __attrs_post_init__(self) -> None:
        problems = [
            *self._shape_problems(),
            *self._capacity_problems(),
            *self._options_problems(),
            *self._component_problems(),
            *self._callback_problems(),
            *self._runtime_problems(),
            *self._layout_problems(),
            *self._shared_problems(),
        ]
        if problems:
            raise ConfigError(problems)

    @property
    def num_cpu_blocks(self) -> int:
        """CPU pool size in blocks, from ``cpu_blocks`` or ``cpu_bytes``."""
        if self.cpu_blocks is not None:
            return int(self.cpu_blocks)
        return self.kv.blocks_for(parse_bytes(self.cpu_bytes))

    def pool_bytes(self) -> dict[str, int]:
        """Host bytes the two pools' bookkeeping needs (what -> bytes): it is O(blocks), before any use."""
        given = "" if self.cpu_bytes is None else f" from cpu_bytes={self.cpu_bytes!r}"
        return {f"pool bookkeeping of gpu_blocks={self.gpu_blocks} + cpu_blocks={self.num_cpu_blocks}{given}":
                (int(self.gpu_blocks) + self.num_cpu_blocks) * BOOKKEEPING_BYTES_PER_BLOCK}

    def resolve(self) -> Components:
        """Instantiate the named components with their ``options``.

        Raises:
            InsufficientMemoryError: the pools' bookkeeping (:meth:`pool_bytes`)
                does not fit in host memory (checked first).
            BackendUnavailableError: a backend stopped being available since validation.
        """
        check_fits("cpu", self.pool_bytes())
        return Components(
            gpu_eviction=self._create("gpu_eviction"),
            cpu_eviction=self._create("cpu_eviction"),
            store=self._create("store"),
            copy=None if self.copy is None else self._create("copy"),
            allocator=functools.partial(
                ALLOCATOR.build,
                ALLOCATOR.load(self.allocator) if isinstance(self.allocator, str) else self.allocator,
                slot="allocator", **self._options("allocator")),
            gpu_blocks=int(self.gpu_blocks),
            cpu_blocks=self.num_cpu_blocks,
            callbacks=tuple(self.callbacks),
            planner=self._create("planner"),
        )

    def _create(self, slot: str) -> Any:
        return _INSTANCE_SLOTS[slot].create(getattr(self, slot), slot=slot, **self._options(slot))

    def _options(self, slot: str) -> dict[str, Any]:
        return dict(self.options.get(slot, {}))

    def _shape_problems(self) -> list[str]:
        problems = []
        if not isinstance(self.kv, KVCacheSpec):
            problems.append(f"kv={self.kv!r}: required, a KVCacheSpec(num_layers=..., block_size=..., "
                            f"num_kv_heads=..., head_dim=...)")
        if (problem := int_problem("gpu_blocks", self.gpu_blocks, 1)) is not None:
            problems.append(problem + " (required)" if self.gpu_blocks is None else problem)
        return problems

    def _capacity_problems(self) -> list[str]:
        if (self.cpu_blocks is None) == (self.cpu_bytes is None):
            got = ("neither" if self.cpu_blocks is None
                   else f"both cpu_blocks={self.cpu_blocks!r} and cpu_bytes={self.cpu_bytes!r}")
            return [f"give exactly one of cpu_blocks or cpu_bytes, got {got}; hint: cpu_bytes='8GiB'"]
        if self.cpu_blocks is not None:
            problem = int_problem("cpu_blocks", self.cpu_blocks, 1)
            return [problem] if problem else []
        try:
            num_bytes = parse_bytes(self.cpu_bytes)
        except ConfigError as exc:
            return [f"cpu_bytes={self.cpu_bytes!r}: {exc}"]
        if isinstance(self.kv, KVCacheSpec) and self.kv.blocks_for(num_bytes) < 1:
            return [f"cpu_bytes={self.cpu_bytes!r} ({num_bytes} bytes) holds no block: one block of "
                    f"this kv spec takes {self.kv.bytes_per_block} bytes"]
        return []

    def _options_problems(self) -> list[str]:
        if not isinstance(self.options, Mapping):
            return [f"options={self.options!r}: must be a dict of slot -> kwargs, e.g. {{'store': {{'k': 2}}}}"]
        problems = []
        for slot, kwargs in self.options.items():
            if slot not in _OPTION_SLOTS:
                problems.append(f"options[{slot!r}]: unknown slot; valid: {', '.join(_OPTION_SLOTS)}"
                                f"{did_you_mean(str(slot), list(_OPTION_SLOTS))}")
            elif not isinstance(kwargs, Mapping):
                problems.append(f"options[{slot!r}]={kwargs!r}: must be a dict of keyword arguments")
            elif kwargs and not isinstance(getattr(self, slot), str) and slot != "allocator":
                problems.append(f"options[{slot!r}]={dict(kwargs)!r}: {slot} is an instance, not a name; "
                                f"hint: pass these to its constructor")
        return problems

    def _component_problems(self) -> list[str]:
        problems = []
        options = self.options if isinstance(self.options, Mapping) else {}
        for slot, registry in _INSTANCE_SLOTS.items():
            spec = getattr(self, slot)
            if spec is None and slot == "copy":  # scheduler-only
                continue
            problem = registry.check(spec, slot=slot)
            kwargs = options.get(slot)
            if problem is None and isinstance(spec, str) and isinstance(kwargs, Mapping):
                problem = registry.check_options(spec, kwargs, slot=slot)
            if problem is not None:
                problems.append(problem)
        if not isinstance(self.cpu_eviction, str) and self.cpu_eviction is self.gpu_eviction:
            problems.append(f"cpu_eviction and gpu_eviction are the same "
                            f"{type(self.cpu_eviction).__qualname__} instance; each pool needs its own "
                            f"policy: pass two instances or names")
        problems.extend(self._allocator_problems(options.get("allocator")))
        return problems

    def _allocator_problems(self, kwargs: object) -> list[str]:
        spec = self.allocator
        # A class is a factory; isinstance(cls, BlockAllocator) would wrongly match it.
        is_factory = isinstance(spec, type) or (callable(spec) and not isinstance(spec, BlockAllocator))
        if isinstance(spec, str) or is_factory:
            problem = ALLOCATOR.check(spec, slot="allocator") if isinstance(spec, str) else None
            if problem is None and isinstance(kwargs, Mapping):
                problem = ALLOCATOR.check_options(spec, kwargs, slot="allocator", partial=True)
            return [problem] if problem else []
        expected = f"one of {', '.join(ALLOCATOR.names())} or a factory (num_blocks=..., eviction=...) -> BlockAllocator"
        if isinstance(spec, BlockAllocator):
            return [f"allocator={spec!r}: got a pool instance, expected {expected}; "
                    f"each tier builds its own pool"]
        return [f"allocator={spec!r}: {type(spec).__qualname__} is not callable; expected {expected}"]

    def _callback_problems(self) -> list[str]:
        if not isinstance(self.callbacks, (list, tuple)):
            hint = "; hint: wrap it in a list" if isinstance(self.callbacks, OffloadCallback) else ""
            return [f"callbacks={self.callbacks!r}: must be a list of OffloadCallback instances{hint}"]
        problems = []
        for i, callback in enumerate(self.callbacks):
            if isinstance(callback, type) and issubclass(callback, OffloadCallback):
                problems.append(f"callbacks[{i}]={callback.__qualname__}: got a class; "
                                f"hint: pass an instance, e.g. {callback.__qualname__}()")
            elif not isinstance(callback, OffloadCallback):
                problems.append(f"callbacks[{i}]={callback!r}: {type(callback).__qualname__} is not "
                                f"an OffloadCallback; hint: subclass kvkit.OffloadCallback")
        return problems

    def _runtime_problems(self) -> list[str]:
        problems = []
        if (problem := int_problem("world_size", self.world_size, 1)) is not None:
            problems.append(problem)
        if self.device not in DEVICES:
            problems.append(f"device={self.device!r}: unknown device; valid: {', '.join(DEVICES)}"
                            f"{did_you_mean(str(self.device), list(DEVICES))}")
        elif self.device == "cuda" and _default_device() != "cuda":
            problems.append("device='cuda': CUDA is not available on this machine; hint: device='cpu'")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            problems.append(f"hash_algorithm={self.hash_algorithm!r}: unknown; valid: "
                            f"{', '.join(HASH_ALGORITHMS)}"
                            f"{did_you_mean(str(self.hash_algorithm), list(HASH_ALGORITHMS))}")
        elif self.hash_algorithm == "xxh3" and importlib.util.find_spec("xxhash") is None:
            problems.append("hash_algorithm='xxh3': needs the xxhash package; "
                            "hint: pip install 'kvkit[fast-hash]'")
        try:
            check_real("wait_timeout_s", self.wait_timeout_s, low=0, low_open=True)
        except ConfigError as exc:
            problems.append(f"{exc}; hint: math.inf waits forever")
        return problems

    def _shared_problems(self) -> list[str]:

        problems = []
        shared = self.shared
        if shared is not None and not (isinstance(shared, str) and "://" in shared) and (
                isinstance(shared, type) or not isinstance(shared, BlockStore)):
            problems.append(f"shared={shared!r}: must be None, a BlockStore instance or a URL such as "
                            f"'memory://', 'file:///path' or 'valkey://host:6379/0'")
        if self.shared_write not in SHARED_WRITES:
            problems.append(f"shared_write={self.shared_write!r}: unknown; valid: {', '.join(SHARED_WRITES)}"
                            f"{did_you_mean(str(self.shared_write), list(SHARED_WRITES))}")
        if not isinstance(self.shared_model, str) or not self.shared_model:
            problems.append(f"shared_model={self.shared_model!r}: must be a non-empty str (the model's name "
                            f"and revision, part of the shared tier's namespace)")
        if self.shared_secret is not None and not (isinstance(self.shared_secret, bytes) and self.shared_secret):
            problems.append(f"shared_secret={self.shared_secret!r}: must be None or non-empty bytes")
        try:
            check_real("shared_backoff_s", self.shared_backoff_s, low=0, low_open=True)
        except ConfigError as exc:
            problems.append(str(exc))
        return problems

    def _layout_problems(self) -> list[str]:
        if self.cpu_layout is None:
            return []
        from kvkit.worker.layouts import LAYOUTS, check_layouts  # deferred: imports torch

        if self.cpu_layout not in LAYOUTS:
            return [f"cpu_layout={self.cpu_layout!r}: unknown KV layout; valid: {', '.join(LAYOUTS)}"
                    f"{did_you_mean(str(self.cpu_layout), list(LAYOUTS))}"]
        if isinstance(self.kv, KVCacheSpec):
            try:
                check_layouts(self.kv, self.cpu_layout)
            except ConfigError as exc:
                return [f"cpu_layout={self.cpu_layout!r}: {exc}"]
        return []
