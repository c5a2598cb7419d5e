"""Chained block hashes: equal hashes mean equal token prefixes under equal salts.

Each full block of ``block_size`` tokens hashes the canonical bytes of

* its predecessor: a tag byte, then the previous block's 16-byte digest (or,
  for a chain's first block, the caller's ``parent`` or a fixed root tag);
* a version tag and the ``extra_keys`` (cache salt, LoRA/adapter ids), encoded
  type-tagged and length-prefixed, mixed into *every* block so requests with
  different salts never share a block;
* the block's token ids as little-endian int64 (packed by numpy, no per-token
  Python loop), length-prefixed.

Digests are truncated to 128 bits and returned as non-negative ``int``
(:data:`~kvkit.interfaces.types.BlockHash`). The default, SHA-256, is
collision-resistant; ``algorithm="xxh3"`` (xxhash's 128-bit XXH3) is about 8x
faster but not collision-resistant, so a user must choose it explicitly.
Python's ``hash()`` is never used: it is salted per process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from kvkit.errors import BackendUnavailableError, HashInputError
from kvkit.interfaces.types import BlockHash
from kvkit.validate import at_least, is_int

__all__ = ["HASH_ALGORITHMS", "BlockHasher", "hash_blocks"]

HASH_ALGORITHMS = ("sha256", "blake2b", "xxh3")
"""Valid ``algorithm`` names; only ``xxh3`` is not collision-resistant."""

_DIGEST_BYTES = 16
_ROOT = b"\x00"  # a chain's first block with no parent
_CHAINED = b"\x01"  # followed by the predecessor's digest
_VERSION = b"kvkit-block-hash-v1"
_LEN = struct.Struct("<Q")

Digest = Callable[[bytes], bytes]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:_DIGEST_BYTES]


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def _digest_for(algorithm: object) -> Digest:
    if algorithm == "sha256":
        return _sha256
    if algorithm == "blake2b":
        return _blake2b
    if algorithm == "xxh3":
        try:
            import xxhash
        except ImportError as exc:
            raise BackendUnavailableError(
                "algorithm='xxh3' needs the xxhash package: pip install 'kvkit[fast-hash]'"
            ) from exc
        return xxhash.xxh3_128_digest
    raise HashInputError(f"unknown hash algorithm {algorithm!r}; valid: {list(HASH_ALGORITHMS)}")


def _encode_key(key: object) -> bytes:
    """Type-tagged, length-prefixed bytes of one extra key (injective across types)."""
    if isinstance(key, bool):  # bool is an int subclass; True == 1 would be ambiguous
        raise HashInputError(f"extra keys must be str, int, bytes or tuples of these, got {key!r}")
    if isinstance(key, int):
        body = key.to_bytes(key.bit_length() // 8 + 1, "little", signed=True)
        return b"i" + _LEN.pack(len(body)) + body
    if isinstance(key, str):
        try:
            body = key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise HashInputError(f"extra key {key!r} is not encodable as UTF-8") from exc
        return b"s" + _LEN.pack(len(body)) + body
    if isinstance(key, (bytes, bytearray)):
        return b"b" + _LEN.pack(len(key)) + bytes(key)
    if isinstance(key, tuple):
        return b"t" + _LEN.pack(len(key)) + b"".join(_encode_key(k) for k in key)
    raise HashInputError(f"extra keys must be str, int, bytes or tuples of these, got {key!r}")


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Validate ``tokens`` (non-negative ints) and pack them as little-endian int64."""
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError, OverflowError) as exc:
        raise HashInputError(f"token ids must be a flat sequence of ints, got {tokens!r}") from exc
    if arr.ndim != 1:
        raise HashInputError(f"token ids must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        # Error path only: quote the first offending element as the caller wrote it.
        values = arr.tolist() if isinstance(tokens, np.ndarray) else tokens
        for i, t in enumerate(values):
            if (isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))
                    or not 0 <= t < 2**63):
                raise HashInputError(
                    f"token ids must be non-negative ints, got {t!r} at position {i}"
                )
        arr = np.asarray(values, dtype=np.int64)  # e.g. an object array of valid ints
    elif arr.min() < 0 or arr.max() >= 2**63:
        bad = np.flatnonzero((arr < 0) | (arr >= 2**63))[0]
        raise HashInputError(
            f"token ids must be non-negative int64, got {arr[bad].item()!r} at position {bad}"
        )
    return arr.astype("<i8", copy=False).tobytes()


def _chain_start(parent: object) -> bytes:
    if parent is None:
        return _ROOT
    if not (is_int(parent, 0) and parent < 2**128):
        raise HashInputError(
            f"parent must be a BlockHash (an int in [0, 2**128)) or None, got {parent!r}"
        )
    return _CHAINED + int(parent).to_bytes(_DIGEST_BYTES, "little")


@attrs.define
class BlockHasher:
    """Hashes a growing token sequence block by block, chaining each hash on the last.

    ``BlockHasher(16, extra_keys=("salt",)).extend(tokens)`` returns the hashes
    of the full blocks completed by ``tokens``; the trailing partial block is
    kept and hashed once a later :meth:`extend` completes it. Feeding tokens in
    any split gives the same chain as :func:`hash_blocks` on all of them.

    Invariants: fewer than ``block_size`` tokens are pending; ``num_tokens ==
    len(hashes) * block_size + pending``.
    """

    block_size: int = attrs.field(validator=at_least(1, error=HashInputError), on_setattr=attrs.setters.frozen)
    extra_keys: tuple = attrs.field(default=(), kw_only=True, on_setattr=attrs.setters.frozen)
    algorithm: str = attrs.field(default="sha256", kw_only=True, on_setattr=attrs.setters.frozen)
    parent: BlockHash | None = attrs.field(default=None, kw_only=True,
                                           on_setattr=attrs.setters.frozen)
    _digest: Digest = attrs.field(init=False)
    _salt: bytes = attrs.field(init=False)  # version, salt and block length: same every block
    _prev: bytes = attrs.field(init=False)
    _pending: bytes = attrs.field(init=False, default=b"")
    _hashes: list[BlockHash] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.extra_keys, tuple):
            raise HashInputError(f"extra_keys must be a tuple, got {self.extra_keys!r}")
        self._digest = _digest_for(self.algorithm)
        self._salt = (_VERSION + _encode_key(self.extra_keys)
                      + _LEN.pack(self.block_size * 8))
        self._prev = _chain_start(self.parent)

    @property
    def hashes(self) -> list[BlockHash]:
        """Hashes of every full block so far, in order (a copy)."""
        return list(self._hashes)

    @property
    def num_tokens(self) -> int:
        """Tokens consumed so far, including the pending partial block."""
        return len(self._hashes) * self.block_size + len(self._pending) // 8

    def extend(self, tokens: Sequence[int] | np.ndarray) -> list[BlockHash]:
        """Append ``tokens``; return the hashes of the blocks they complete.

        Raises:
            HashInputError: a token id is not a non-negative int; nothing changed.
        """
        data = self._pending + _token_bytes(tokens)
        block_bytes = self.block_size * 8
        digest, salt, prev = self._digest, self._salt, self._prev
        new: list[BlockHash] = []
        end = len(data) - len(data) % block_bytes
        for start in range(0, end, block_bytes):
            d = digest(prev + salt + data[start:start + block_bytes])
            new.append(BlockHash(int.from_bytes(d, "little")))
            prev = _CHAINED + d
        self._prev, self._pending = prev, data[end:]
        self._hashes.extend(new)
        return new

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the pending tail or the chain state is inconsistent."""
        assert len(self._pending) % 8 == 0, len(self._pending)
        assert len(self._pending) < self.block_size * 8, (len(self._pending), self.block_size)
        if self._hashes:
            last = self._hashes[-1].to_bytes(_DIGEST_BYTES, "little")
            assert self._prev == _CHAINED + last, "chain state is not the last hash"
        else:
            assert self._prev == _chain_start(self.parent), "chain state is not the start"


def hash_blocks(tokens: Sequence[int] | np.ndarray, block_size: int, *,
                parent: BlockHash | None = None, extra_keys: tuple = (),
                algorithm: str = "sha256") -> list[BlockHash]:
    """Chained hashes of every full block of ``tokens`` (a trailing partial block is skipped).

    Args:
        tokens: token ids, non-negative ints (a sequence or a 1-D integer array).
        block_size: tokens per block.
        parent: hash of the block before ``tokens[0]``, to continue a chain.
        extra_keys: salt mixed into every block: str, int, bytes or tuples of these.
        algorithm: one of :data:`HASH_ALGORITHMS`; ``"xxh3"`` only when chosen explicitly.

    Raises:
        HashInputError: malformed tokens, block size, parent, extra key or algorithm.
        BackendUnavailableError: ``"xxh3"`` without the xxhash package.
    """
    hasher = BlockHasher(block_size, extra_keys=extra_keys, algorithm=algorithm, parent=parent)
    return hasher.extend(tokens)
