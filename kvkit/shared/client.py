"""Composition of the shared tier: a store from a URL or an instance, the value format as a codec.

A stack's scheduler and every worker rank use the one store directly: each
collects the results of its own tickets (``BlockStore.poll(tickets)``), so
nothing sorts results between them.

A tier that keeps values on a network store beyond this host without an HMAC
secret trusts whoever can write that server: :func:`warn_unauthenticated` says
so once per process and server (a ``RuntimeWarning``), for every such tier
(:func:`connect_shared`; vLLM's ``KVKitSecondaryTier``, whose values are never
authenticated).
"""

from __future__ import annotations

import ipaddress
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvkit.interfaces import BlockHash, KVCacheSpec
from kvkit.interfaces.shared import DEFAULT_TENANT, BlockStore
from kvkit.redact import redact, redact_text
from kvkit.shared.format import HEADER_SIZE, Namespace, ValueStatus, block_key, check_value, encode_header
from kvkit.shared.urls import open_block_store, process_wide

if TYPE_CHECKING:
    from kvkit.config import StackConfig
    from kvkit.shared.scheduler import SharedTierSpec

__all__ = ["FormatCodec", "SharedConnection", "connect_shared", "open_shared", "store_deadline", "warn_unauthenticated"]

_WARNED: set[tuple[tuple[str, int], ...]] = set()  # servers this process warned about
_WARNED_LOCK = threading.Lock()


def open_shared(value: str | BlockStore) -> tuple[BlockStore, bool]:
    """The store ``value`` names, and whether the caller owns it (must close it).

    ``value`` is a :class:`~kvkit.interfaces.shared.BlockStore` instance (its
    giver keeps owning it) or a URL :func:`~kvkit.shared.urls.open_block_store`
    opens; the caller owns what that built, never the process's ``memory://`` stores.

    Raises:
        ConfigError: neither a store nor a URL :func:`~kvkit.shared.urls.open_block_store` accepts, quoting it.
        BackendUnavailableError: the URL's store cannot run here.
    """
    if isinstance(value, BlockStore) and not isinstance(value, type):
        return value, False
    store = open_block_store(value)  # type: ignore[arg-type]  # anything else: a ConfigError quoting it
    return store, not process_wide(store)


@attrs.frozen
class FormatCodec:
    """The shared tier's value format (:mod:`kvkit.shared.format`) as a :class:`~kvkit.interfaces.shared.BlockCodec`.

    Attributes:
        namespace: what gives the bytes their meaning (model, spec, layout, TP
            size), whose they are (tenant) and how they are authenticated (the
            deployment's HMAC secret, or none).
    """

    namespace: Namespace
    header_bytes: int = attrs.field(default=HEADER_SIZE, init=False)
    probe_key: bytes = attrs.field(init=False, default=attrs.Factory(
        lambda self: self.namespace.prefix + b"probe", takes_self=True))

    @classmethod
    def for_stack(cls, spec: KVCacheSpec, world_size: int, *, model: str, layout: str,
                  tenant: str = DEFAULT_TENANT, secret: bytes | None = None) -> FormatCodec:
        """The codec of a stack: ``model`` names the weights (and revision), ``layout`` the payload.

        Raises:
            ConfigError: a bad tenant or secret (the secret never quoted).
            BackendUnavailableError: the value format cannot run here (no ``xxhash``), before any store is used.
        """
        codec = cls(Namespace(model=model, spec=spec, layout=layout, tp_size=world_size, tenant=tenant,
                              secret=secret))
        encode_header(codec.namespace, 0, 0, [])  # fails now, not inside a worker's first put
        return codec

    def key(self, block_hash: BlockHash, rank: int) -> bytes:
        return block_key(self.namespace, _fold(block_hash), rank)

    def seal(self, header: memoryview, block_hash: BlockHash, rank: int, payload: Sequence[memoryview]) -> None:
        header[:] = encode_header(self.namespace, _fold(block_hash), rank, payload)

    def check(self, header: memoryview, block_hash: BlockHash, rank: int, payload: Sequence[memoryview]) -> bool:
        return check_value(self.namespace, _fold(block_hash), rank, header, payload) is ValueStatus.OK


_HASH_MASK = (1 << 128) - 1


def _fold(block_hash: BlockHash) -> BlockHash:
    """The value format's 128-bit block hash: wider hashes (vLLM's SHA-256 digests) keep their low 128 bits.

    Any 128 bits of a cryptographic digest are as collision-resistant as the
    format's field allows; kvkit's own hashes already fit and are unchanged.
    """
    return BlockHash(block_hash & _HASH_MASK) if block_hash > _HASH_MASK else block_hash


@attrs.frozen
class SharedConnection:
    """One process's connection to the shared tier of a :class:`~kvkit.config.StackConfig`.

    Attributes:
        spec: the scheduler's view (the store, the codec, write mode, back-off).
        store: the store the scheduler and every worker rank use.
        owned: whether this process opened ``store`` (and must close it).
    """

    spec: SharedTierSpec
    store: BlockStore
    owned: bool


def connect_shared(config: StackConfig, *, layout: str) -> SharedConnection:
    """Open ``config.shared.url`` and build its codec: the one path of every stack, kvkit's own and vLLM's.

    ``layout`` is the CPU payload layout the namespace names.

    Raises:
        ConfigError / BackendUnavailableError: as :func:`open_shared` and :meth:`FormatCodec.for_stack`.
    """
    from kvkit.config import UNNAMED_MODEL
    from kvkit.shared.scheduler import SharedTierSpec

    shared = config.shared
    assert shared is not None, "connect_shared needs a config with a shared tier"
    codec = FormatCodec.for_stack(config.kv, config.world_size, model=shared.model or UNNAMED_MODEL, layout=layout,
                                  tenant=shared.tenant, secret=shared.secret)
    store, owned = open_shared(shared.url)  # last: nothing after it may fail and leave it open
    try:
        warn_unauthenticated(store, codec.namespace.secret)
        deadline = store_deadline(store)
        budget: dict[str, Any] = {} if deadline is None else {"lookup_budget_s": deadline}
        spec = SharedTierSpec(store=store, codec=codec, write=shared.write,
                              backoff_s=shared.backoff_s, max_backoff_s=60 * shared.backoff_s, **budget)
    except BaseException:
        if owned:
            store.close()
        raise
    return SharedConnection(spec, store, owned)


def store_deadline(store: BlockStore) -> float | None:
    """``store``'s deadline of one call: a network store's ``request_timeout_s`` (every ``put``, ``get`` and
    ``contains`` ends by then), or ``None`` for a store that has none (a local one: a call takes what its
    medium takes)."""
    deadline = getattr(store, "request_timeout_s", None)
    return float(deadline) if isinstance(deadline, int | float) and deadline > 0 else None


def warn_unauthenticated(store: BlockStore, secret: bytes | None) -> bool:
    """Warn (once per process and server) that ``store``'s values are trusted unauthenticated; whether it did.

    The one rule of every tier that keeps KV on a store: only a network store
    (one with ``nodes``, ``(host, port)`` pairs) with a node beyond loopback
    and no ``secret`` is warned about: then anyone who can write that server
    can plant KV that is loaded and served. Host names other than
    ``localhost`` count as beyond loopback (nothing is resolved). The nodes
    are those the store was given (a Cluster's seeds), not those a Cluster
    announces later (docs/shared-tier.md, "Threat model").
    """
    nodes = getattr(store, "nodes", None)
    if secret is not None or not nodes:
        return False
    try:
        key = tuple(sorted((str(host), int(port)) for host, port in nodes))
    except (TypeError, ValueError):
        return False
    if all(_loopback(host) for host, _ in key):
        return False
    with _WARNED_LOCK:
        if key in _WARNED:
            return False
        _WARNED.add(key)
    where = ", ".join(redact(f"{host}:{port}") for host, port in key)
    warnings.warn(redact_text(
        f"kvkit: the KV values kept on {where} are not authenticated (no HMAC secret): anyone who can write that "
        f"server can plant KV this engine will load and serve; use such a server only where every writer is "
        f"trusted, or kvkit's shared tier with a secret every instance of the deployment shares "
        f"(docs/shared-tier.md, 'Threat model')"), RuntimeWarning, stacklevel=3)
    return True


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
