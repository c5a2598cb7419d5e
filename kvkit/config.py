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
from urllib.parse import unquote

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
from kvkit.interfaces.shared import DEFAULT_TENANT, SHARED_WRITES, BlockStore, check_tenant
from kvkit.redact import MASK, redact, redact_url, secret_repr
from kvkit.registry import ALLOCATOR, COPY, EVICTION, PLANNER, SHARED, STORE, Registry
from kvkit.validate import (
    check_choice,
    check_real,
    checked,
    did_you_mean,
    int_problem,
    is_int,
    known_keywords,
    non_empty_str,
    one_of,
    plural,
    problem_of,
    quote,
    secret_bytes,
)
from kvkit.worker import WAIT_TIMEOUT_S
from kvkit.worker.memory import BOOKKEEPING_BYTES_PER_BLOCK, check_fits

__all__ = ["DEFAULTS", "DEVICES", "NAMED_SLOTS", "TEXT", "UNNAMED_MODEL", "VALKEY_SCHEMES", "Components", "Defaults",
           "SharedConfig", "SharedSpec", "StackConfig", "name_shared_model", "parse_bytes", "shown_url"]

DEVICES = ("cpu", "cuda")
"""Where the GPU tier lives; ``"cpu"`` is the stand-in CI and notebooks use."""

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")

# Slots a registry instantiates, and which registry; "allocator" is a factory slot.
_INSTANCE_SLOTS: dict[str, Registry[Any]] = {
    "cpu_eviction": EVICTION, "gpu_eviction": EVICTION, "store": STORE, "copy": COPY, "planner": PLANNER,
}
NAMED_SLOTS = (*_INSTANCE_SLOTS, "allocator")
"""Slots that take a registered name (or an instance or factory) and per-slot ``options``."""


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
        ConfigError: ``text`` is not a non-negative size; the message quotes it
            and says whether it is negative, has an unknown unit or does not parse.
    """
    if is_int(text):
        if text < 0:
            raise ConfigError(f"byte size {quote(text)} is negative; a size is at least 0")
        return int(text)
    if isinstance(text, str) and text.strip().startswith("-") and _SIZE.fullmatch(text.strip()[1:]):
        raise ConfigError(f"byte size {quote(text)} is negative; a size is at least 0, e.g. '8GiB'")
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"cannot parse byte size {quote(text)}; expected an int or a number with a unit "
                          f"({_UNIT_NAMES}), e.g. '8GiB' or '1.5 GiB'")
    unit = match[2].lower()
    if unit not in _UNITS:
        names = _UNIT_NAMES.split(", ")
        raise ConfigError(f"byte size {quote(text)}: unknown unit {match[2]!r}; valid: {_UNIT_NAMES}"
                          f"{did_you_mean(match[2], names)}")
    return int(Fraction(match[1]) * _UNITS[unit])


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


VALKEY_SCHEMES = ("valkey", "valkeys", "redis", "rediss")
"""URL schemes of a Valkey/Redis server (each with ``+cluster`` for a Cluster): the ``valkey`` block store's."""
_SCHEME_STORES = {"file": "disk", "memory": "memory"}  # the registered block store of each other kvkit scheme


def shown_url(url: str) -> str:
    """A block store URL fit to show: :func:`~kvkit.redact.redact_url`'s rule, and the value of every query
    option that the URL's store does not take (:meth:`~kvkit.registry.Registry.options_taken`; each one when the
    scheme names no store) masked too: such an option may be a misspelled password (``?passw=...``).

    Every error, repr and report that shows a block store URL shows it so. ``redact_url`` reads the URL
    whole first: a ``?`` in an unencoded password is no query mark, and what follows it never an option's name.
    """
    base, mark, query = redact_url(url).partition("?")
    if mark:
        scheme = base.partition("://")[0].lower()
        store = "valkey" if scheme.partition("+")[0] in VALKEY_SCHEMES else _SCHEME_STORES.get(scheme, scheme)
        taken = SHARED.options_taken(store)
        query = "&".join(item if "=" not in item or unquote(item.partition("=")[0]) in taken
                         else f"{item.partition('=')[0]}={MASK}" for item in query.split("&"))
    return base + mark + query


def _store_url(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if not ((isinstance(value, str) and "://" in value)
            or (isinstance(value, BlockStore) and not isinstance(value, type))):
        shown = quote(shown_url(value) if isinstance(value, str) else value)
        raise ConfigError(f"shared.url={shown}: must be a URL such as 'memory://', 'file:///path' or "
                          f"'valkey://host:6379/0', or a BlockStore instance")


def _shown_url(value: object) -> str:
    """``SharedConfig.url`` in a repr: as :func:`shown_url` shows it."""
    return repr(shown_url(value)) if isinstance(value, str) else repr(value)


def _redacted_repr(value: object) -> str:
    """A :class:`StackConfig` field that may hold a secret, in a repr, as :func:`~kvkit.redact.redact` shows it:
    ``options`` (a component's ``api_token``), and ``shared`` while it is a URL or mapping not yet made a
    :class:`SharedConfig` (one refused: the config being checked is a traceback's frame local)."""
    return repr(redact(value))


_SHARED = "shared."


@known_keywords
@attrs.frozen(kw_only=True)
class SharedConfig:
    """The shared tier behind the CPU tier: its store, and how a stack uses it.

    ``StackConfig(shared="valkey://host:6379/0")`` is short for
    ``StackConfig(shared=SharedConfig(url="valkey://host:6379/0"))``; a mapping
    of these fields is taken too (``shared={"url": ..., "write": "write-back"}``,
    as JSON configs spell it). See :mod:`kvkit.shared.scheduler`.

    Attributes:
        url: the store: a URL (``"memory://"`` or ``"memory://NAME"``: one
            in-process store per name; ``"file:///path"``;
            ``"valkey://host:6379/0"``), or a
            :class:`~kvkit.interfaces.shared.BlockStore` instance, which the
            caller keeps owning.
        write: ``"write-through"`` (put what a CPU store committed) or
            ``"write-back"`` (put the CPU tier's next eviction candidates).
        model: the model identity (name and revision, or fingerprint) in the
            shared tier's namespace: instances that share a store share blocks
            only under the same identity, spec, layout and world size. ``None``
            (default): the integration's (``OffloadedLM``: the weights'
            fingerprint; vLLM: its model and revision), :data:`UNNAMED_MODEL`
            for a stack built directly.
        tenant: who owns the tier's keys: every key starts with
            ``kvkit:<tenant>:``, a prefix a server's ACL key pattern confines a
            client to (``"default"``; 1-64 letters, digits, ``_``, ``.``, ``-``:
            :func:`~kvkit.interfaces.shared.check_tenant`).
        secret: HMAC secret (non-empty bytes) every instance of a deployment
            shares, or ``None``: values are then trusted as the server holds
            them. It seals and checks every value and is bound into the keys,
            so instances with another secret or none never share or overwrite
            them. Never shown in a repr or an error (a repr shows ``'***'``, and
            a password in ``url`` as ``***``).
        backoff_s: seconds the tier stays off after a failure before a probe
            (doubling on each failed probe, at most 60x). ``math.inf`` turns the
            tier off for good at its first outage (no probe is sent again: the
            process serves from its GPU and CPU tiers until it is restarted).

    Raises:
        ConfigError: a bad field, quoting it (never the secret).
    """

    url: str | BlockStore = attrs.field(validator=_store_url, repr=_shown_url)
    write: str = attrs.field(default="write-through", validator=one_of(SHARED_WRITES, label=_SHARED))
    model: str | None = attrs.field(default=None, validator=non_empty_str(label=_SHARED, optional=True))
    tenant: str = attrs.field(default=DEFAULT_TENANT, converter=checked(check_tenant, label=_SHARED))  # type: ignore[misc]
    secret: bytes | None = attrs.field(default=None, repr=secret_repr,
                                       validator=secret_bytes(label=_SHARED, optional=True))
    backoff_s: float = attrs.field(default=1.0, converter=checked(check_real, low=0, low_open=True, label=_SHARED))  # type: ignore[misc]


UNNAMED_MODEL = "unnamed-model"
"""The shared tier's model identity where neither the config nor an integration names one."""

SharedSpec = SharedConfig | str | BlockStore | Mapping[str, Any]
"""What ``StackConfig(shared=...)`` takes: a :class:`SharedConfig`, its ``url``, or a mapping of its fields."""


def _shared_config(value: str | BlockStore | Mapping[str, Any]) -> SharedConfig:
    return SharedConfig(**value) if isinstance(value, Mapping) else SharedConfig(url=value)


def _as_shared(value: SharedSpec | None) -> SharedConfig | None:
    """``shared=`` as a :class:`SharedConfig`; a value none can be made of is kept for the check to refuse."""
    if value is None or isinstance(value, SharedConfig):
        return value
    try:
        return _shared_config(value)
    except (ConfigError, TypeError):  # TypeError: a mapping whose keys are not all strings
        return value  # type: ignore[return-value]


TEXT = "text"
"""``attrs`` metadata key of a :class:`StackConfig` slot that has a text form (a command-line flag,
a JSON value): the type its text parses to (``int``, ``float`` or ``str``). Slots without one take
objects (a KV spec, callbacks, per-slot options)."""


def _text(kind: type) -> dict[str, type]:
    return {TEXT: kind}


@known_keywords
@attrs.frozen(kw_only=True)
class StackConfig:
    """Every slot of an offload stack; construction validates all of them.

    Attributes:
        kv: shape of the KV cache. Required.
        gpu_blocks: GPU tier size in blocks. Required, at least 1.
        cpu_blocks: CPU tier size in blocks. Give this or ``cpu_bytes``.
        cpu_bytes: CPU tier size in bytes, an int or a size such as ``8GiB``. Give
            this or ``cpu_blocks``; it must hold a block.
        cpu_eviction: CPU tier eviction policy. A registered name or an instance.
        gpu_eviction: GPU tier eviction policy. A registered name or an instance
            (not ``cpu_eviction``'s: each tier has its own).
        store: store policy, which decides what GPU blocks go to the CPU tier. A
            registered name or an instance.
        copy: copy backend. A registered name or an instance, or ``None`` for a
            scheduler-only stack that moves no bytes (simulation; imports no copy backend).
        allocator: block pool. A registered name, or a factory
            ``(num_blocks=..., eviction=...) -> BlockAllocator``.
        planner: load planner, which decides per request which blocks of a CPU or
            shared-tier hit to load and which to recompute. A registered name or
            an instance; ``load-all`` loads every hit.
        callbacks: ``OffloadCallback`` instances, called in order.
        world_size: workers that must all finish a copy before it counts. At least 1.
        device: where the GPU tier lives, ``cuda`` or ``cpu``. Default: ``cuda``
            where available.
        hash_algorithm: block hash algorithm, one of :data:`kvkit.hashing.HASH_ALGORITHMS`.
        cpu_layout: layout of every worker's CPU mirror, a name in
            :data:`kvkit.worker.layouts.LAYOUTS`. ``None`` (default) mirrors the GPU
            tier's layout (``build(layout=...)``); only a stack that moves bytes has one.
        wait_timeout_s: seconds each worker's ``drain()`` and ``close()`` wait at most
            by default. Above 0; ``math.inf`` waits forever.
        options: per-slot constructor kwargs for named slots, e.g. ``{"store": {"k": 2}}``.
        shared: the shared tier behind the CPU tier. A :class:`SharedConfig`, its
            ``url`` or a mapping of its fields; ``None`` (default) for two tiers.

    Defaults come from :data:`DEFAULTS`. A slot's ``attrs`` metadata
    :data:`TEXT` says how a command line or a JSON config spells it.

    Invariants: a constructed config has no problems; instances given in slots
    are used as-is by :meth:`resolve`, so resolve a config once per stack.

    Raises:
        ConfigError: on construction, listing every problem found (an unknown
            slot too, with the valid ones).
    """

    # Required, yet defaulted to None so that a missing one is a ConfigError listed with every other
    # problem: a constructed config always holds both, as their types say.
    kv: KVCacheSpec = None  # type: ignore[assignment]
    gpu_blocks: int = attrs.field(default=None, metadata=_text(int))
    cpu_blocks: int | None = attrs.field(default=None, metadata=_text(int))
    cpu_bytes: int | str | None = attrs.field(default=None, metadata=_text(str))
    cpu_eviction: str | EvictionPolicy = attrs.field(default=DEFAULTS.cpu_eviction, metadata=_text(str))
    gpu_eviction: str | EvictionPolicy = attrs.field(default=DEFAULTS.gpu_eviction, metadata=_text(str))
    store: str | StorePolicy = attrs.field(default=DEFAULTS.store, metadata=_text(str))
    copy: str | CopyBackend | None = attrs.field(default=DEFAULTS.copy, metadata=_text(str))
    allocator: str | Callable[..., BlockAllocator] = attrs.field(default=DEFAULTS.allocator, metadata=_text(str))
    planner: str | LoadPlanner = attrs.field(default=DEFAULTS.planner, metadata=_text(str))
    callbacks: list[OffloadCallback] | tuple[OffloadCallback, ...] = ()
    world_size: int = attrs.field(default=DEFAULTS.world_size, metadata=_text(int))
    device: str = attrs.field(factory=_default_device, metadata=_text(str))
    hash_algorithm: str = attrs.field(default=DEFAULTS.hash_algorithm, metadata=_text(str))
    cpu_layout: str | None = attrs.field(default=None, metadata=_text(str))
    wait_timeout_s: float = attrs.field(default=DEFAULTS.wait_timeout_s, metadata=_text(float))
    options: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict, repr=_redacted_repr)
    shared: SharedConfig | None = attrs.field(default=None, converter=_as_shared, repr=_redacted_repr,
                                              metadata=_text(str))

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
        assert self.cpu_bytes is not None  # exactly one of the two is given
        return self.kv.blocks_for(parse_bytes(self.cpu_bytes))

    def pool_bytes(self) -> dict[str, int]:
        """Host bytes the two pools' bookkeeping needs (what -> bytes): it is O(blocks), before any use."""
        given = "" if self.cpu_bytes is None else f" from cpu_bytes={quote(self.cpu_bytes)}"
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
            problems.append(f"kv={quote(self.kv)}: required, a KVCacheSpec(num_layers=..., block_size=..., "
                            f"num_kv_heads=..., head_dim=...)")
        if (problem := int_problem("gpu_blocks", self.gpu_blocks, 1)) is not None:
            problems.append(problem + " (required)" if self.gpu_blocks is None else problem)
        return problems

    def _capacity_problems(self) -> list[str]:
        if (self.cpu_blocks is None) == (self.cpu_bytes is None):
            got = ("neither" if self.cpu_blocks is None
                   else f"both cpu_blocks={quote(self.cpu_blocks)} and cpu_bytes={quote(self.cpu_bytes)}")
            return [f"give exactly one of cpu_blocks or cpu_bytes, got {got}; hint: cpu_bytes='8GiB'"]
        if self.cpu_blocks is not None:
            problem = int_problem("cpu_blocks", self.cpu_blocks, 1)
            return [problem] if problem else []
        assert self.cpu_bytes is not None  # exactly one of the two is given (checked above)
        try:
            num_bytes = parse_bytes(self.cpu_bytes)
        except ConfigError as exc:
            return [f"cpu_bytes={quote(self.cpu_bytes)}: {exc}"]
        if isinstance(self.kv, KVCacheSpec) and self.kv.blocks_for(num_bytes) < 1:
            return [(f"cpu_bytes={quote(self.cpu_bytes)} ({plural(num_bytes, 'byte')}) holds no block: one block of "
                     f"this kv spec takes {self.kv.bytes_per_block} bytes")]
        return []

    def _options_problems(self) -> list[str]:
        if not isinstance(self.options, Mapping):
            return [f"options={quote(self.options)}: must be a dict of slot -> kwargs, e.g. {{'store': {{'k': 2}}}}"]
        problems = []
        for slot, kwargs in self.options.items():
            if slot not in NAMED_SLOTS:
                problems.append(f"options[{quote(slot)}]: unknown slot; valid: {', '.join(NAMED_SLOTS)}"
                                f"{did_you_mean(str(slot), list(NAMED_SLOTS))}")
            elif not isinstance(kwargs, Mapping):
                problems.append(f"options[{quote(slot)}]={quote(kwargs)}: must be a dict of keyword arguments")
            elif kwargs and not isinstance(getattr(self, slot), str) and slot != "allocator":
                problems.append(f"options[{quote(slot)}]={quote(dict(kwargs))}: {slot} is an instance, not a name; "
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
        expected = (f"one of {', '.join(ALLOCATOR.names())} or a factory (num_blocks=..., eviction=...) "
                    f"-> BlockAllocator")
        if isinstance(spec, BlockAllocator):
            return [(f"allocator={quote(spec)}: got a pool instance, expected {expected}; "
                     f"each tier builds its own pool")]
        return [f"allocator={quote(spec)}: {type(spec).__qualname__} is not callable; expected {expected}"]

    def _callback_problems(self) -> list[str]:
        if not isinstance(self.callbacks, (list, tuple)):
            hint = "; hint: wrap it in a list" if isinstance(self.callbacks, OffloadCallback) else ""
            return [f"callbacks={quote(self.callbacks)}: must be a list of OffloadCallback instances{hint}"]
        problems = []
        for i, callback in enumerate(self.callbacks):
            if isinstance(callback, type) and issubclass(callback, OffloadCallback):
                problems.append(f"callbacks[{i}]={callback.__qualname__}: got a class; "
                                f"hint: pass an instance, e.g. {callback.__qualname__}()")
            elif not isinstance(callback, OffloadCallback):
                problems.append(f"callbacks[{i}]={quote(callback)}: {type(callback).__qualname__} is not "
                                f"an OffloadCallback; hint: subclass kvkit.OffloadCallback")
        return problems

    def _runtime_problems(self) -> list[str]:
        problems = [
            int_problem("world_size", self.world_size, 1),
            problem_of(check_choice, "device", self.device, DEVICES),
            problem_of(check_choice, "hash_algorithm", self.hash_algorithm, HASH_ALGORITHMS),
            problem_of(check_real, "wait_timeout_s", self.wait_timeout_s, low=0, low_open=True),
        ]
        if problems[1] is None and self.device == "cuda" and _default_device() != "cuda":
            problems[1] = "device='cuda': CUDA is not available on this machine; hint: device='cpu'"
        if problems[2] is None and self.hash_algorithm == "xxh3" and importlib.util.find_spec("xxhash") is None:
            problems[2] = "hash_algorithm='xxh3': needs the xxhash package; hint: pip install 'kvkit[fast-hash]'"
        if problems[3] is not None:
            problems[3] += "; hint: math.inf waits forever"
        return [problem for problem in problems if problem is not None]

    def _shared_problems(self) -> list[str]:
        shared = self.shared
        if shared is None or isinstance(shared, SharedConfig):
            return []
        if not isinstance(shared, (str, Mapping)) and (isinstance(shared, type) or not isinstance(shared, BlockStore)):
            return [(f"shared={quote(shared)}: must be None, a SharedConfig, its url (a URL such as 'memory://', "
                     f"'file:///path' or 'valkey://host:6379/0', or a BlockStore instance) or a mapping of its fields")]
        if isinstance(shared, Mapping) and not all(isinstance(key, str) for key in shared):
            return [f"shared: a mapping of SharedConfig fields has str keys, got {sorted(map(repr, shared))}"]
        try:
            _shared_config(shared)
        except ConfigError as exc:
            return exc.problems
        return []

    def _layout_problems(self) -> list[str]:
        if self.cpu_layout is None:
            return []
        from kvkit.worker.layouts import LAYOUTS, check_layouts  # deferred: imports torch

        if (problem := problem_of(check_choice, "cpu_layout", self.cpu_layout, LAYOUTS)) is not None:
            return [problem]
        if isinstance(self.kv, KVCacheSpec):
            try:
                check_layouts(self.kv, self.cpu_layout)
            except ConfigError as exc:
                return [f"cpu_layout={quote(self.cpu_layout)}: {exc}"]
        return []


def name_shared_model(config: StackConfig, model: str) -> StackConfig:
    """``config`` with its shared tier's model identity set to ``model``, unless the config names one.

    The integrations call it with the identity they know (a model fingerprint,
    vLLM's model and revision); a config without a shared tier is returned as is.
    """
    if config.shared is None or config.shared.model is not None:
        return config
    return attrs.evolve(config, shared=attrs.evolve(config.shared, model=model))
