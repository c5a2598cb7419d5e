"""The shared tier's value format: any damaged, foreign or tampered value is rejected, a good one accepted."""

from __future__ import annotations

import itertools

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkit.errors import ConfigError
from kvkit.interfaces.types import KVCacheSpec, KVGroupSpec
from kvkit.shared.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    Namespace,
    ValueStatus,
    block_key,
    check_value,
    encode_header,
)

SPEC = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)
NS = Namespace("org/model", SPEC, revision="abc123", tp_size=2)
SECRET = b"s3cret"
_HASH = 0x0123456789ABCDEF0123456789ABCDEF


def _value(payload: bytes, secret=None, ns=NS, block_hash=_HASH, rank=1):
    return encode_header(ns, block_hash, rank, [payload], secret=secret), payload


def _check(header, payload, secret=None, ns=NS, block_hash=_HASH, rank=1):
    return check_value(ns, block_hash, rank, header, [payload], secret=secret)


@pytest.mark.parametrize("secret", [None, SECRET])
@given(payload=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=3))
def test_a_value_checks_ok_however_its_payload_is_split(secret, payload, cuts):
    """The header covers the payload's bytes, not how they are split into buffers."""
    header = encode_header(NS, _HASH, 1, [payload], secret=secret)
    assert len(header) == HEADER_SIZE
    edges = [0, *sorted(min(c, len(payload)) for c in cuts), len(payload)]
    parts = [memoryview(payload)[a:b] for a, b in itertools.pairwise(edges)]
    assert check_value(NS, _HASH, 1, header, parts, secret=secret) is ValueStatus.OK


@pytest.mark.parametrize("secret", [None, SECRET])
@given(payload=st.binary(min_size=1, max_size=64), data=st.data())
def test_any_flipped_bit_is_rejected(secret, payload, data):
    """One flipped bit anywhere in header or payload makes the value not OK."""
    header, _ = _value(payload, secret)
    value = bytearray(header + payload)
    bit = data.draw(st.integers(0, len(value) * 8 - 1))
    value[bit // 8] ^= 1 << (bit % 8)
    assert _check(value[:HEADER_SIZE], bytes(value[HEADER_SIZE:]), secret) is not ValueStatus.OK


@given(payload=st.binary(min_size=1, max_size=64), data=st.data())
def test_truncation_is_rejected(payload, data):
    """A value cut anywhere (in the header or the payload) is TRUNCATED."""
    header, _ = _value(payload)
    value = header + payload
    cut = data.draw(st.integers(0, len(value) - 1))
    short = value[:cut]
    assert _check(short[:HEADER_SIZE], short[HEADER_SIZE:]) is ValueStatus.TRUNCATED


@pytest.mark.parametrize("other", [
    attrs.evolve(NS, model="org/other"), attrs.evolve(NS, revision="def456"),
    attrs.evolve(NS, spec=attrs.evolve(SPEC, dtype="float16")),
    attrs.evolve(NS, spec=attrs.evolve(SPEC, block_size=32)),
    attrs.evolve(NS, spec=KVCacheSpec(2, 16, 2, 8, groups=(KVGroupSpec((0,)), KVGroupSpec((1,))))),
    attrs.evolve(NS, layout="per-layer"), attrs.evolve(NS, tp_size=4),
], ids=["model", "revision", "dtype", "block_size", "kv_groups", "layout", "tp_size"])
def test_a_foreign_namespace_is_rejected_and_gets_other_keys(other):
    """Every namespace field changes the digest, hence the key, and a value is FOREIGN under the other."""
    assert other.digest != NS.digest
    assert block_key(other, _HASH, 1) != block_key(NS, _HASH, 1)
    header, payload = _value(b"kv bytes")
    assert _check(header, payload, ns=other) is ValueStatus.FOREIGN


@pytest.mark.parametrize("change", [{"block_hash": _HASH + 1}, {"rank": 0}])
def test_a_value_under_another_block_or_rank_is_foreign(change):
    """A value copied to another block's or rank's key is FOREIGN (hash and rank are in the header)."""
    header, payload = _value(b"kv bytes")
    assert _check(header, payload, **change) is ValueStatus.FOREIGN


def test_secret_mismatches_are_rejected():
    """A wrong secret is TAMPERED; a keyed value read without a secret, or the reverse, is FOREIGN."""
    keyed, payload = _value(b"kv bytes", SECRET)
    plain, _ = _value(b"kv bytes")
    assert _check(keyed, payload, b"other") is ValueStatus.TAMPERED
    assert _check(keyed, payload, None) is ValueStatus.FOREIGN
    assert _check(plain, payload, SECRET) is ValueStatus.FOREIGN


def test_the_mac_binds_the_key():
    """A keyed value re-headed for another block (checksum recomputed, MAC copied) is TAMPERED."""
    header, payload = _value(b"kv bytes", SECRET)
    forged = bytearray(encode_header(NS, _HASH + 1, 1, [payload]))
    forged[4:6], forged[6:8] = FORMAT_VERSION.to_bytes(2, "little"), (1).to_bytes(2, "little")
    forged[-32:] = header[-32:]
    assert check_value(NS, _HASH + 1, 1, forged, [payload], secret=SECRET) is ValueStatus.TAMPERED


def test_keys_and_digests_are_stable():
    """The digest does not depend on the process (no PYTHONHASHSEED): a fixed namespace, a fixed key."""
    assert block_key(NS, 1, 0) == b"kvkit:v1:" + NS.digest.hex().encode() + b":" + b"0" * 31 + b"1:r0"
    assert Namespace("org/model", SPEC, revision="abc123", tp_size=2).digest == NS.digest


@pytest.mark.parametrize(("call", "match"), [
    (lambda: Namespace("", SPEC), "model"),
    (lambda: Namespace("m", "spec"), "spec"),
    (lambda: Namespace("m", SPEC, tp_size=0), "tp_size"),
    (lambda: block_key(NS, -1, 0), "block_hash"),
    (lambda: block_key(NS, 1 << 128, 0), "128 bits"),
    (lambda: block_key(NS, 1, 2), "tp_size=2"),
    (lambda: encode_header(NS, 1, 0, [b"x"], secret=b""), "secret"),
])
def test_bad_input_is_refused_with_the_value_quoted(call, match):
    """Malformed namespaces, hashes, ranks and secrets raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=match):
        call()


def test_the_bit_flip_property_catches_a_format_without_checksum(monkeypatch):
    """Planted: with the checksum disabled, the flipped-bit property finds a payload bit that slips through.

    Hypothesis favours short payloads, where a drawn bit lands in the 100-byte header far more often
    than in the payload, so the property runs here with a fixed seed and enough examples to always
    find one (with the profile's 25 random ones it missed now and then)."""
    from kvkit.shared import format as blockformat

    monkeypatch.setattr(blockformat, "_checksum", lambda views: bytes(16))
    thorough = settings(max_examples=1000, derandomize=True, database=None)(test_any_flipped_bit_is_rejected)
    with pytest.raises(AssertionError):
        thorough(None)
