"""Registries of named components, one per extension point.

A name maps to a target: a class or factory, or a lazy ``"module:Class"``
string that is imported only when the name is first used, so optional
dependencies (CuPy, the CUDA driver bindings) stay untouched until asked for.
Third-party packages add names through the ``kvkit.backends`` entry-point
group, entry ``"<kind>.<name>" = "module:Class"``; those are read on a
registry's first use, and a broken entry is reported, never fatal.

Invariants:
    * Every cached class belongs to a registered name.
    * Failed imports are not cached: a name can become available later.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any, Generic, TypeVar, cast

import attrs

from kvkit.errors import BackendUnavailableError, ConfigError
from kvkit.interfaces import (
    BlockAllocator,
    CopyBackend,
    EvictionPolicy,
    ExplainsUnavailability,
    ReportsAvailability,
    StorePolicy,
)
from kvkit.interfaces.plan import LoadPlanner
from kvkit.interfaces.shared import BlockStore
from kvkit.redact import redact_options
from kvkit.validate import did_you_mean

__all__ = [
    "ALLOCATOR",
    "COPY",
    "ENTRY_POINT_GROUP",
    "EVICTION",
    "PLANNER",
    "REGISTRIES",
    "SHARED",
    "STORE",
    "Registry",
    "entry_point_problems",
    "register",
]

ENTRY_POINT_GROUP = "kvkit.backends"

T = TypeVar("T")
Target = str | Callable[..., Any]


def _import(target: str) -> Any:
    module, _, attr = target.partition(":")
    return functools.reduce(getattr, attr.split("."), importlib.import_module(module))


def _describe(target: Target) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def _is_lazy_target(value: object) -> bool:
    if not isinstance(value, str):
        return False
    module, sep, attr = value.partition(":")
    return bool(sep and module and attr and " " not in value)


@attrs.define
class Registry(Generic[T]):
    """Names of the implementations of one protocol.

    Attributes:
        kind: the extension point (``"eviction"``, ``"store"``...), also the
            prefix of its entry-point names.
        protocol: the runtime-checkable protocol every product must satisfy.
        label: what one component is called in messages (``"eviction policy"``).
        problems: broken entry points of this kind, found on first use.
    """

    kind: str
    protocol: type  # a Protocol class, which mypy never accepts as a type[T]
    label: str
    _targets: dict[str, Target] = attrs.field(factory=dict, alias="builtins")
    _loaded: dict[str, Callable[..., Any]] = attrs.field(factory=dict, init=False)
    _scanned: bool = attrs.field(default=False, init=False)
    problems: list[str] = attrs.field(factory=list, init=False)

    def register(self, name: str, target: Target, *, override: bool = False) -> None:
        """Map ``name`` to a class/factory or a lazy ``"module:Class"`` string.

        Raises:
            ConfigError: ``name`` is taken (unless ``override``), or the name or
                target is malformed.
        """
        self._scan_entry_points()
        self._add(name, target, override=override)

    def names(self) -> list[str]:
        """Every registered name, sorted (available or not)."""
        self._scan_entry_points()
        return sorted(self._targets)

    def target(self, name: str) -> str:
        """``"module:Class"`` that ``name`` maps to (nothing is imported)."""
        return _describe(self._targets[self._known(name)])

    def load(self, name: str) -> Callable[..., T]:
        """The class or factory registered as ``name``, importing it if needed.

        Raises:
            ConfigError: ``name`` is not registered.
            BackendUnavailableError: its module cannot be imported.
        """
        loaded, reason = self._resolve(self._known(name))
        if loaded is None:
            raise BackendUnavailableError(
                f"{self.label} {name!r} ({self.target(name)}) is not available: {reason}")
        return loaded

    def why_unavailable(self, name: str) -> str | None:
        """Why ``name`` cannot be used on this machine, or ``None`` if it can. Never raises."""
        try:
            self._known(name)
            loaded, reason = self._resolve(name)
        except Exception as exc:  # noqa: BLE001 - a probe must not crash a listing
            return f"{type(exc).__name__}: {exc}"
        if loaded is None:
            return reason
        # Optional capabilities of the loaded class itself (a runtime protocol's
        # isinstance on a class object checks the class's attributes).
        if not isinstance(loaded, ReportsAvailability):
            return None
        try:
            ok = loaded.is_available()
        except Exception as exc:  # noqa: BLE001 - third-party probes may fail any way
            return f"{_describe(loaded)}.is_available() raised {type(exc).__name__}: {exc}"
        if ok:
            return None
        why = None  # say why, not just "no", when the class can
        if isinstance(loaded, ExplainsUnavailability):
            try:
                why = loaded.unavailable_reason()
            except Exception:  # noqa: BLE001 - a probe must not crash a listing
                why = None
        return f"{_describe(loaded)}: {why}" if why else f"{_describe(loaded)}.is_available() returned False"

    def available(self, name: str) -> bool:
        """Whether ``name`` is registered, imports, and its ``is_available()`` holds. Never raises."""
        return self.why_unavailable(name) is None

    def check(self, spec: object, *, slot: str | None = None) -> str | None:
        """The problem with ``spec`` (a name or an instance) for ``slot``, or ``None``.

        Names must be registered and available; instances must satisfy the
        protocol; a class is rejected (``isinstance`` on a protocol would
        wrongly accept it).
        """
        slot = slot or self.kind
        expected = f"a {self.protocol.__name__} instance or one of {self._name_list()}"
        if isinstance(spec, str):
            valid = self.names()
            if spec not in self._targets:
                return (f"{slot}={spec!r}: unknown {self.label}; valid: "
                        f"{', '.join(valid)}{did_you_mean(spec, valid)}")
            reason = self.why_unavailable(spec)
            if reason is not None:
                usable = [n for n in valid if n != spec and self.available(n)]
                return (f"{slot}={spec!r}: {self.label} not available on this machine: {reason}; "
                        f"available here: {', '.join(usable) or 'none'}")
            return None
        if isinstance(spec, type):
            return (f"{slot}={spec.__qualname__}: got a class, expected {expected}; "
                    f"hint: pass an instance, e.g. {spec.__qualname__}()")
        if not isinstance(spec, self.protocol):
            return (f"{slot}={spec!r}: {type(spec).__qualname__} is not a "
                    f"{self.protocol.__name__}; expected {expected}")
        return None

    def check_options(self, spec: str | Callable[..., Any], options: Mapping[str, Any], *,
                      slot: str | None = None, partial: bool = False) -> str | None:
        """The problem with calling ``spec`` (a name or a factory) with ``options``, or ``None``.

        ``partial`` allows required arguments to be missing (supplied later).
        Values under names ``spec`` does not take are never shown (:func:`~kvkit.redact.redact_options`).
        """
        factory = self.load(spec) if isinstance(spec, str) else spec
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):  # builtins without a signature: let the call decide
            return None
        try:
            (signature.bind_partial if partial else signature.bind)(**options)
        except TypeError as exc:
            shown = redact_options(options, signature.parameters)
            return f"{slot or self.kind}={spec!r}: options {shown!r} do not fit {_describe(factory)}: {exc}"
        return None

    def options_taken(self, name: str) -> frozenset[str]:
        """The keyword options the factory registered as ``name`` names in its signature; none if it cannot be
        loaded or has no signature. Never raises."""
        try:
            return frozenset(inspect.signature(self.load(name)).parameters)
        except Exception:  # noqa: BLE001 - unknown, unavailable or without a signature: it takes no known name
            return frozenset()

    def create(self, spec: str | T, /, *, slot: str | None = None, **kwargs: Any) -> T:
        """An instance for ``spec``: a name is built with ``kwargs``, an instance is returned as is.

        Raises:
            ConfigError: unknown name, wrong kind of object, or ``kwargs``
                that do not fit (the message names ``slot``).
            BackendUnavailableError: the name is registered but cannot run here.
        """
        slot = slot or self.kind
        if not isinstance(spec, str):
            problem = self.check(spec, slot=slot)
            if problem is None and kwargs:
                problem = (f"{slot}: options {redact_options(kwargs, ())!r} given for an instance; pass them to its "
                           f"constructor")
            if problem is not None:
                raise ConfigError(problem)
            return spec
        self._known(spec)
        reason = self.why_unavailable(spec)
        if reason is not None:
            raise BackendUnavailableError(f"{slot}={spec!r}: {self.label} not available: {reason}")
        problem = self.check_options(spec, kwargs, slot=slot)
        if problem is not None:
            raise ConfigError(problem)
        return self.build(self.load(spec), slot=slot, **kwargs)

    def build(self, factory: Callable[..., Any], /, *, slot: str | None = None, **kwargs: Any) -> T:
        """Call ``factory(**kwargs)`` and check the product satisfies the protocol.

        Raises:
            ConfigError: the product is not a ``protocol`` instance.
        """
        product = factory(**kwargs)
        if not isinstance(product, self.protocol):
            raise ConfigError(
                f"{slot or self.kind}: {_describe(factory)} built a {type(product).__qualname__}, "
                f"which is not a {self.protocol.__name__}")
        return cast(T, product)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a cached class has no registered name."""
        assert set(self._loaded) <= set(self._targets), (self._loaded, self._targets)

    def _name_list(self) -> str:
        return ", ".join(self.names()) or "(none registered)"

    def _known(self, name: str) -> str:
        self._scan_entry_points()
        if not isinstance(name, str) or name not in self._targets:
            valid = self.names()
            hint = did_you_mean(name, valid) if isinstance(name, str) else ""
            raise ConfigError(f"unknown {self.label} {name!r}; valid: {', '.join(valid)}{hint}")
        return name

    def _resolve(self, name: str) -> tuple[Callable[..., Any] | None, str | None]:
        if name in self._loaded:
            return self._loaded[name], None
        target = self._targets[name]
        if isinstance(target, str):
            try:
                target = _import(target)
            except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable"
                return None, f"import failed: {type(exc).__name__}: {exc}"
            if not callable(target):
                return None, f"{self._targets[name]} is a {type(target).__name__}, not a class or factory"
        self._loaded[name] = target
        return target, None

    def _add(self, name: str, target: Target, *, override: bool) -> None:
        if not isinstance(name, str) or not name or ":" in name or name != name.strip():
            raise ConfigError(f"{self.label} name must be a non-empty string without ':', got {name!r}")
        if not (callable(target) or _is_lazy_target(target)):
            raise ConfigError(
                f"{self.label} {name!r}: target must be a class, a factory or a "
                f"'module:Class' string, got {target!r}")
        if name in self._targets and not override:
            raise ConfigError(
                f"{self.label} {name!r} is already registered to {_describe(self._targets[name])}; "
                f"hint: pass override=True to replace it")
        self._targets[name] = target
        self._loaded.pop(name, None)

    def _scan_entry_points(self) -> None:
        if self._scanned:
            return
        self._scanned = True
        entries, problem = _entry_points()
        if problem:
            self.problems.append(problem)
        for ep in entries:
            kind, _, name = ep.name.partition(".")
            if kind != self.kind:
                continue
            where = f"entry point {ep.name!r} = {ep.value!r} ({_dist_name(ep)})"
            if name in self._targets and _describe(self._targets[name]) == ep.value:
                continue  # the same distribution seen twice (e.g. editable and installed)
            try:
                self._add(name, ep.value, override=False)
            except ConfigError as exc:
                self.problems.append(f"{where} ignored: {exc}")


def _dist_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"from {dist.name}" if dist is not None else "from an unknown distribution"


def _entry_points() -> tuple[list[metadata.EntryPoint], str | None]:
    """Entries of the ``kvkit.backends`` group; a broken environment is a problem, not a crash."""
    try:
        return list(metadata.entry_points(group=ENTRY_POINT_GROUP)), None
    except Exception as exc:  # noqa: BLE001 - broken metadata of an unrelated package
        return [], f"cannot read entry points of group {ENTRY_POINT_GROUP!r}: {type(exc).__name__}: {exc}"


EVICTION: Registry[EvictionPolicy] = Registry("eviction", EvictionPolicy, "eviction policy", builtins={
    "lru": "kvkit.backends.eviction.lru:LRUPolicy",
    "fifo": "kvkit.backends.eviction.fifo:FIFOPolicy",
    "lfu": "kvkit.backends.eviction.lfu:LFUPolicy",
    "arc": "kvkit.backends.eviction.arc:ARCPolicy",
    "s3fifo": "kvkit.backends.eviction.s3fifo:S3FIFOPolicy",
    "lirs": "kvkit.backends.eviction.lirs:LIRSPolicy",
    "prefix-lru": "kvkit.backends.eviction.prefix_lru:PrefixLRUPolicy",
    "hit-density": "kvkit.backends.eviction.hit_density:HitDensityPolicy",
    "adaptive": "kvkit.backends.eviction.adaptive:AdaptivePolicy",
    "hinted": "kvkit.backends.eviction.hinted:HintedPolicy",
    "opt": "kvkit.backends.eviction.opt:OptimalPolicy",
})
STORE: Registry[StorePolicy] = Registry("store", StorePolicy, "store policy", builtins={
    "eager": "kvkit.backends.store.eager:EagerStore",
    "lazy": "kvkit.backends.store.lazy:LazyStore",
    "selective": "kvkit.backends.store.selective:SelectiveStore",
    "never": "kvkit.backends.store.never:NeverStore",
})
COPY: Registry[CopyBackend] = Registry("copy", CopyBackend, "copy backend", builtins={
    "torch": "kvkit.backends.copy.torch_copy:TorchCopy",
    "cuda-dma": "kvkit.backends.copy.cuda_dma:CudaDMACopy",
    "cupy-batch": "kvkit.backends.copy.cupy_batch:CupyBatchCopy",
    "auto": "kvkit.backends.copy.auto:AutoCopy",
    "staged": "kvkit.backends.copy.staged:StagedCopy",
})
ALLOCATOR: Registry[BlockAllocator] = Registry("allocator", BlockAllocator, "block allocator", builtins={
    "pool": "kvkit.backends.allocator.pool:BlockPool",
})

SHARED: Registry[BlockStore] = Registry("shared", BlockStore, "block store", builtins={
    "memory": "kvkit.backends.blockstore.memory:MemoryStore",
    "disk": "kvkit.backends.blockstore.disk:DiskStore",
    "valkey": "kvkit.backends.blockstore.valkey:ValkeyStore",
})

PLANNER: Registry[LoadPlanner] = Registry("planner", LoadPlanner, "load planner", builtins={
    "overlap": "kvkit.backends.plan.overlap:OverlapPlanner",
    "load-all": "kvkit.backends.plan.overlap:LoadAllPlanner",
})

REGISTRIES: dict[str, Registry[Any]] = {r.kind: r for r in (EVICTION, STORE, COPY, ALLOCATOR, SHARED, PLANNER)}
"""Every extension point by kind, in display order."""


def register(kind: str, name: str, target: Target, *, override: bool = False) -> None:
    """Map ``name`` to ``target`` in the registry of ``kind`` (``kvkit.register``).

    ``target`` is a class, a factory or a lazy ``"module:Class"`` string, as
    for :meth:`Registry.register`; the name is usable in every slot of that
    kind from then on, in this process.

    Raises:
        ConfigError: ``kind`` is not one of :data:`REGISTRIES` (the message
            lists them), or the registry refuses the name or target.
    """
    registry = REGISTRIES.get(kind) if isinstance(kind, str) else None
    if registry is None:
        valid = list(REGISTRIES)
        hint = did_you_mean(kind, valid) if isinstance(kind, str) else ""
        raise ConfigError(f"unknown registry kind {kind!r}; valid: {', '.join(valid)}{hint}")
    registry.register(name, target, override=override)


def entry_point_problems() -> list[str]:
    """Every broken ``kvkit.backends`` entry point: bad names, unknown kinds, clashes, unreadable metadata."""
    entries, problem = _entry_points()
    problems = [problem] if problem else []
    for ep in entries:
        kind, dot, name = ep.name.partition(".")
        if not (dot and name) or kind not in REGISTRIES:
            problems.append(
                f"entry point {ep.name!r} = {ep.value!r} ({_dist_name(ep)}) ignored: its name must be "
                f"'<kind>.<name>' with kind one of {', '.join(REGISTRIES)}"
                f"{did_you_mean(kind, list(REGISTRIES))}")
    for registry in REGISTRIES.values():
        registry.names()  # reads the entry points once
        problems.extend(p for p in registry.problems if p not in problems)
    return problems
