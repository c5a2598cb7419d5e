"""Composition of the shared tier: a store from a URL or an instance, the value format as a codec.

A stack's scheduler and every worker rank use the one store directly: each
collects the results of its own tickets (``BlockStore.poll(tickets)``), so
nothing sorts results between them.

A tier that keeps values on a network store beyond this host without an HMAC
secret trusts whoever can write that server: :func:`warn_unauthenticated` says
so once per store and never twice per node (a ``RuntimeWarning``), for every such tier
(:func:`connect_shared`; vLLM's ``KVKitSecondaryTier``, whose values are never
authenticated).
"""

from __future__ import annotations

import inspect
import ipaddress
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvkit.backends.blockstore.link import remember
from kvkit.errors import ConfigError
from kvkit.interfaces import BlockHash, KVCacheSpec
from kvkit.interfaces.shared import DEFAULT_TENANT, BlockStore
from kvkit.redact import redact, redact_text
from kvkit.shared.format import HEADER_SIZE, Namespace, ValueStatus, block_key, check_value, encode_header
from kvkit.shared.urls import open_block_store, process_wide
from kvkit.warn import warn

if TYPE_CHECKING:
    from kvkit.config import StackConfig
    from kvkit.shared.scheduler import SharedTierSpec

__all__ = ["FormatCodec", "SharedConnection", "connect_shared", "open_shared", "store_deadline", "store_lifetime",
           "mark_restarts", "store_restarts", "warn_unauthenticated"]

_WARNED: dict[tuple[str, int], None] = {}  # the nodes this process warned about last, oldest first
_WARNED_LOCK = threading.Lock()


def open_shared(value: str | BlockStore) -> tuple[BlockStore, bool]:
    """The store ``value`` names, and whether the caller owns it (must close it).

    ``value`` is a :class:`~kvkit.interfaces.shared.BlockStore` instance (its
    giver keeps owning it) or a URL :func:`~kvkit.shared.urls.open_block_store`
    opens; the caller owns what that built, never the process's ``memory://`` stores.

    The store's ``contains`` must take the step's deadline (``timeout_s``, as
    the protocol spells it): one that does not is refused here, before any step
    calls it (a store this call built is closed first).

    Raises:
        ConfigError: neither a store nor a URL :func:`~kvkit.shared.urls.open_block_store` accepts, quoting it;
            or a store whose ``contains`` takes no ``timeout_s``, naming its class.
        BackendUnavailableError: the URL's store cannot run here.
    """
    if isinstance(value, BlockStore) and not isinstance(value, type):
        _check_contains(value)
        return value, False
    store = open_block_store(value)  # type: ignore[arg-type]  # anything else: a ConfigError quoting it
    owned = not process_wide(store)
    try:
        _check_contains(store)
    except ConfigError:
        if owned:
            store.close()
        raise
    return store, owned


def _check_contains(store: BlockStore) -> None:
    try:
        signature = inspect.signature(store.contains)
    except (TypeError, ValueError):  # no signature to read (a C method): it is taken at its word
        return
    try:
        signature.bind([b"k"], timeout_s=None)
    except TypeError:
        raise ConfigError(f"shared store {type(store).__qualname__}: contains{signature} takes no timeout_s; the "
                          f"BlockStore protocol's is contains(keys, *, timeout_s=None) (the step's deadline: "
                          f"answer within it, or ignore it if every call is answered at once)") from None


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
        mark_restarts(store, codec.namespace.prefix)
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
    return _seconds(store, "request_timeout_s")


def store_lifetime(store: BlockStore) -> float | None:
    """How long ``store`` keeps a value at most: a network store's ``ttl_s`` (every value expires by then from its
    put), or ``None`` for a store whose values never expire (they go only when evicted, flushed or lost)."""
    return _seconds(store, "ttl_s")


def mark_restarts(store: BlockStore, prefix: bytes) -> None:
    """Have ``store`` tell a server's lost data by a marker key under the tenant's ``prefix`` (keys its ACL lets
    it write: :meth:`ValkeyStore.mark_restarts_under
    <kvkit.backends.blockstore.valkey.ValkeyStore.mark_restarts_under>`), where it can; a store that cannot
    is left as it is."""
    mark = getattr(store, "mark_restarts_under", None)
    if callable(mark):
        mark(prefix)


def store_restarts(store: BlockStore) -> int:
    """How many times ``store`` found that a server may have lost what it held (a restart that no failed call
    revealed: :attr:`ValkeyStore.restarts <kvkit.backends.blockstore.valkey.ValkeyStore.restarts>`), or 0 for
    a store that does not tell (its count never changes)."""
    value = getattr(store, "restarts", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _seconds(store: BlockStore, name: str) -> float | None:
    """``store``'s attribute ``name``: a positive number of seconds, or ``None`` where it has none."""
    value = getattr(store, name, None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None


def warn_unauthenticated(store: BlockStore, secret: bytes | None) -> bool:
    """Warn that ``store``'s values are trusted unauthenticated when it talks to a node beyond loopback; whether
    it did so now.

    The one rule of every tier that keeps KV on a store: only a network store
    and no ``secret`` is warned about, since then anyone who can write one of
    its nodes can plant KV that is loaded and served. The nodes are those the
    store was given (``nodes``, ``(host, port)`` pairs: warned about now) and,
    for a store that reports the nodes it connects to (``watch``, as
    :class:`~kvkit.backends.blockstore.valkey.ValkeyStore` does), every node
    it connects to later: a Cluster's nodes as its slot map and redirects
    announce them, whatever its seeds were (warned about before the first
    connection to such a node). Host names other than ``localhost`` count as
    beyond loopback (nothing is resolved). One store warns at most once, and
    the process never twice about one node (docs/shared-tier.md, "Threat
    model"), of the last :data:`~kvkit.backends.blockstore.link.MAX_NODES` it
    warned about: only those are remembered, so Clusters whose nodes come and
    go at ever new addresses never grow the process's memory without bound.
    With warnings turned into errors the warning is raised instead, each time:
    from here at start-up, and later in each call that would connect to such
    a node, which fails (a failed call to the tier).
    """
    if secret is not None:
        return False
    warning = _Unauthenticated()
    warned = warning.check(getattr(store, "nodes", None) or ())
    watch = getattr(store, "watch", None)
    if callable(watch) and not warned:
        watch(warning.connected)
    return warned


@attrs.define(eq=False)
class _Unauthenticated:
    """One store's warning about unauthenticated values: given at most once, naming its nodes beyond loopback.

    It holds no reference to the store (a store's threads call :meth:`connected`)."""

    given: bool = False

    def check(self, nodes: object) -> bool:
        """Warn if ``nodes`` (``(host, port)`` pairs) hold one beyond loopback that this process has not warned
        about, and this store has not warned yet; whether it did."""
        try:
            key = sorted({(str(host), int(port)) for host, port in nodes})  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            return False
        remote = {node for node in key if not _loopback(node[0])}
        where = ", ".join(redact(f"{host}:{port}") for host, port in key)
        with _WARNED_LOCK:  # held while warning: a warning turned into an error marks nothing, so it is raised again
            if self.given or _WARNED.keys() >= remote:
                return False
            warn(redact_text(
                f"kvkit: the KV values kept on {where} are not authenticated (no HMAC secret): anyone who can write "
                f"that server can plant KV this engine will load and serve; use such a server only where every "
                f"writer is trusted, or kvkit's shared tier with a secret every instance of the deployment shares "
                f"(docs/shared-tier.md, 'Threat model')"), RuntimeWarning)
            for node in sorted(remote):
                remember(_WARNED, node, None)
            self.given = True
        return True

    def connected(self, address: tuple[str, int]) -> None:
        """The store is about to connect to ``address`` (its ``watch``)."""
        self.check([address])


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
