"""The value format of the shared tier: namespace, key derivation, a fixed header, optional HMAC.

A value stored under :func:`block_key` is ``header + payload``. The header is
:data:`HEADER_SIZE` bytes, little-endian::

    magic "KVKB" | format version u16 | flags u16 | namespace digest 16 B |
    block hash 16 B | worker rank u32 | payload length u64 |
    xxh3-128 of the payload 16 B | HMAC-SHA256 32 B (zeros without a secret)

Keys are ``kvkit:<tenant>:v<version>:<namespace digest>:<block hash>:r<rank>``:
every key of a tenant starts with :attr:`Namespace.prefix`, so a server's
access rules (a Valkey ACL key pattern ``~kvkit:<tenant>:*``) confine a
client to its tenant. The namespace's HMAC secret is bound into its digest
(through a tag, ``HMAC(secret, "kvkit-namespace")``, never the secret
itself), so deployments with different secrets, or one with and one without,
use disjoint keys and never overwrite each other's values.

The HMAC (flag bit 0) covers the key, the header with its MAC field zeroed,
and the payload, so a value replayed under another key fails. Never pickle:
the payload is raw block bytes. :func:`check_value` answers a
:class:`ValueStatus`; anything but ``OK`` is a miss the caller counts and never
loads. Without a secret a value is only checked against accidents (the
checksum is recomputable by anyone): whoever can write the server can forge it.

Invariants (``tests/shared/test_format.py``):
    * A value :func:`encode_header` built checks ``OK`` under the same
      namespace, hash, rank and key.
    * Any single flipped bit of header or payload, any truncation, another
      namespace (another secret or tenant included), hash, rank or key: not ``OK``.
    * Namespaces that differ in any field, the secret included, share no key.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from collections.abc import Sequence

import attrs

from kvkit.errors import BackendUnavailableError, ConfigError
from kvkit.interfaces.shared import DEFAULT_TENANT, check_tenant
from kvkit.interfaces.types import KVCacheSpec
from kvkit.redact import secret_repr
from kvkit.validate import check_int, check_secret, checked, quote

__all__ = ["FORMAT_VERSION", "HEADER_SIZE", "Namespace", "ValueStatus", "block_key",
           "check_value", "encode_header"]

FORMAT_VERSION = 2
"""Bumped whenever header, key or namespace encoding changes; part of every key and digest."""

_MAGIC = b"KVKB"
_HMAC_FLAG = 1
_LAYOUT = struct.Struct("<4sHH16s16sIQ16s32s")
_MAC_AT = _LAYOUT.size - 32
HEADER_SIZE = _LAYOUT.size
"""Bytes of the fixed header that precedes every payload (100)."""

_Buffers = Sequence[memoryview | bytes | bytearray]


class ValueStatus(enum.Enum):
    """What :func:`check_value` found; everything but ``OK`` is a counted miss."""

    OK = "ok"
    TRUNCATED = "truncated"
    """Header shorter than :data:`HEADER_SIZE`, or payload length not the header's."""
    FOREIGN = "foreign"
    """Another format, version, namespace, block hash or rank (or HMAC use differs)."""
    CORRUPT = "corrupt"
    """The payload's checksum does not match."""
    TAMPERED = "tampered"
    """The HMAC does not verify (altered bytes, or replayed under another key)."""


_NAMESPACE_TAG = b"kvkit-namespace"


def _spec_record(spec: KVCacheSpec) -> dict[str, object]:
    return attrs.asdict(spec, value_serializer=lambda _i, _a, v: v.value if isinstance(v, enum.Enum) else v)


def _text(name: str, *, allow_empty: bool = False):
    def convert(value: object) -> str:
        if not isinstance(value, str) or not (value or allow_empty):
            raise ConfigError(f"Namespace.{name}={quote(value)}: must be a {'' if allow_empty else 'non-empty '}string")
        return value
    return convert


def _spec(value: object) -> KVCacheSpec:
    if not isinstance(value, KVCacheSpec):
        raise ConfigError(f"Namespace.spec={quote(value)}: must be a KVCacheSpec")
    return value


@attrs.frozen
class Namespace:
    """Everything that gives KV bytes their meaning; two namespaces never share a key.

    Attributes:
        model: model identity (a name, or a path's canonical name).
        revision: the weights' revision or fingerprint (``""`` if unknown).
        spec: block size, layers, heads, head dim, dtype and KV groups.
        layout: how a rank's payload is laid out (a kvkit layout name).
        tp_size: tensor-parallel ranks sharing each block (each stores its shard).
        tenant: who owns the keys: the second field of every key (:attr:`prefix`),
            so a server's ACL key pattern can confine a client to it; 1-64
            letters, digits, ``_``, ``.`` or ``-`` (:func:`~kvkit.interfaces.shared.check_tenant`).
        secret: the deployment's HMAC secret (non-empty bytes), or ``None``:
            values are then sealed and checked with it, and it is bound into
            :attr:`digest` through a tag (never shown: its repr is ``'***'``).
        digest: 16 bytes naming all of the above, in every key and header.

    Sealing and checking a value costs the same whatever the secret's length: a secret longer than SHA-256's
    block (64 bytes) keys the HMAC through its SHA-256, as RFC 2104 defines, hashed once here (not once a value).

    Cache salts need no field: they are mixed into the block hashes, which are
    part of every key.
    """

    model: str = attrs.field(converter=_text("model"))  # type: ignore[misc]
    spec: KVCacheSpec = attrs.field(converter=_spec)
    layout: str = attrs.field(default="cross-layer", converter=_text("layout"))  # type: ignore[misc]
    revision: str = attrs.field(default="", converter=_text("revision", allow_empty=True))  # type: ignore[misc]
    tp_size: int = attrs.field(default=1, converter=checked(check_int, minimum=1, label="Namespace."))  # type: ignore[misc]
    tenant: str = attrs.field(default=DEFAULT_TENANT, converter=checked(check_tenant, label="Namespace."))  # type: ignore[misc]
    secret: bytes | None = attrs.field(default=None, repr=secret_repr,
                                       converter=checked(check_secret, label="Namespace.", optional=True))  # type: ignore[misc]
    digest: bytes = attrs.field(init=False, repr=False)
    _mac_key: bytes | None = attrs.field(init=False, repr=False, eq=False)  # the HMAC key the secret stands for

    def __attrs_post_init__(self) -> None:
        tag = "" if self.secret is None else hmac.new(self.secret, _NAMESPACE_TAG, hashlib.sha256).hexdigest()
        record = {"format": FORMAT_VERSION, "model": self.model, "revision": self.revision,
                  "layout": self.layout, "tp_size": self.tp_size, "spec": _spec_record(self.spec),
                  "tenant": self.tenant, "secret_tag": tag}
        canonical = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        object.__setattr__(self, "digest", hashlib.sha256(canonical).digest()[:16])
        secret = self.secret
        long = secret is not None and len(secret) > hashlib.sha256().block_size
        object.__setattr__(self, "_mac_key", hashlib.sha256(secret).digest() if secret is not None and long else secret)

    @property
    def prefix(self) -> bytes:
        """What every key of this namespace starts with: ``kvkit:<tenant>:`` (ACL pattern ``~kvkit:<tenant>:*``)."""
        return b"kvkit:%s:" % self.tenant.encode()


def block_key(namespace: Namespace, block_hash: int, rank: int) -> bytes:
    """The store key of ``rank``'s shard of block ``block_hash`` (ASCII, about 100 bytes, no hash tag)."""
    _check_hash_rank(namespace, block_hash, rank)
    return b"%sv%d:%s:%032x:r%d" % (namespace.prefix, FORMAT_VERSION, namespace.digest.hex().encode(), block_hash,
                                    rank)


def encode_header(namespace: Namespace, block_hash: int, rank: int, payload: _Buffers) -> bytes:
    """The header to store before ``payload`` (its buffers in order) under ``block_key(...)``.

    With the namespace's secret the header carries the value's HMAC.
    """
    _check_hash_rank(namespace, block_hash, rank)
    views = _views(payload)
    key = namespace._mac_key
    header = _pack(namespace, block_hash, rank, views, _checksum(views))
    if key is None:
        return header
    return header[:_MAC_AT] + _mac(key, block_key(namespace, block_hash, rank), header, views)


def check_value(namespace: Namespace, block_hash: int, rank: int, header: bytes | memoryview | bytearray,
                payload: _Buffers) -> ValueStatus:
    """Check a value read under ``block_key(namespace, block_hash, rank)``; never raises for bad bytes.

    With the namespace's secret only a value sealed with it is ``OK``.
    """
    _check_hash_rank(namespace, block_hash, rank)
    key = namespace._mac_key
    head = bytes(memoryview(header).cast("B")[:HEADER_SIZE])
    views = _views(payload)
    if len(head) < HEADER_SIZE:
        return ValueStatus.TRUNCATED
    magic, version, flags, digest, hash_bytes, got_rank, length, checksum, mac = _LAYOUT.unpack(head)
    if magic != _MAGIC or version != FORMAT_VERSION:
        return ValueStatus.FOREIGN
    if flags != (_HMAC_FLAG if key is not None else 0) or (key is None and any(mac)):
        return ValueStatus.FOREIGN
    if digest != namespace.digest or hash_bytes != block_hash.to_bytes(16, "little") or got_rank != rank:
        return ValueStatus.FOREIGN
    if length != sum(v.nbytes for v in views):
        return ValueStatus.TRUNCATED
    if checksum != _checksum(views):
        return ValueStatus.CORRUPT
    if key is not None:
        expected = _mac(key, block_key(namespace, block_hash, rank), head, views)
        if not hmac.compare_digest(mac, expected):
            return ValueStatus.TAMPERED
    return ValueStatus.OK


def _pack(namespace: Namespace, block_hash: int, rank: int, views: list[memoryview], checksum: bytes) -> bytes:
    return _LAYOUT.pack(_MAGIC, FORMAT_VERSION, _HMAC_FLAG if namespace.secret is not None else 0, namespace.digest,
                        block_hash.to_bytes(16, "little"), rank, sum(v.nbytes for v in views), checksum,
                        bytes(32))


def _mac(mac_key: bytes, key: bytes, header: bytes, views: list[memoryview]) -> bytes:
    mac = hmac.new(mac_key, key, hashlib.sha256)
    mac.update(header[:_MAC_AT] + bytes(32))
    for view in views:
        mac.update(view)
    return mac.digest()


def _checksum(views: list[memoryview]) -> bytes:
    try:
        import xxhash
    except ImportError as exc:
        raise BackendUnavailableError(
            "the shared-tier value format needs xxhash; hint: pip install 'kvkit[shared]'") from exc
    hasher = xxhash.xxh3_128()
    for view in views:
        hasher.update(view)
    return hasher.digest()


def _views(payload: _Buffers) -> list[memoryview]:
    return [memoryview(p).cast("B") for p in payload]


def _check_hash_rank(namespace: Namespace, block_hash: int, rank: int) -> None:
    if not isinstance(namespace, Namespace):
        raise ConfigError(f"namespace={quote(namespace)}: must be a Namespace")
    check_int("block_hash", block_hash, minimum=0)
    if block_hash >= 1 << 128:
        raise ConfigError(f"block_hash={quote(block_hash)}: must fit 128 bits")
    check_int("rank", rank, minimum=0)
    if rank >= namespace.tp_size:
        raise ConfigError(f"rank={quote(rank)}: must be below the namespace's tp_size={namespace.tp_size}")
