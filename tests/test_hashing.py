"""Chained block hashes: determinism, chaining, salt isolation, encoding and errors."""

import sys

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvkit.errors import BackendUnavailableError, HashInputError
from kvkit.hashing import HASH_ALGORITHMS, BlockHasher, hash_blocks

tokens_st = st.lists(st.integers(0, 2**40), max_size=48)
block_size_st = st.integers(1, 8)
key_st = st.recursive(
    st.text(max_size=6) | st.integers(-(2**70), 2**70) | st.binary(max_size=6),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=6,
)
salt_st = st.lists(key_st, max_size=3).map(tuple)


def test_known_values_are_stable():
    """The default encoding and digest are pinned, so hashes agree across processes and releases."""
    assert hash_blocks([1, 2, 3, 4, 5], 2) == [
        hash_blocks([1, 2], 2)[0],
        hash_blocks([3, 4], 2, parent=hash_blocks([1, 2], 2)[0])[0],
    ]
    assert hash_blocks(list(range(40)), 16) == [
        272551049802307918839413325802368009871, 310800359180602268021658823986827802598,
    ]


@given(tokens=tokens_st, block_size=block_size_st)
def test_only_full_blocks_are_hashed(tokens, block_size):
    """Every full block gets one hash in [0, 2**128); a trailing partial block gets none."""
    hashes = hash_blocks(tokens, block_size)
    assert len(hashes) == len(tokens) // block_size
    assert all(type(h) is int and 0 <= h < 2**128 for h in hashes)


@given(tokens=tokens_st, block_size=block_size_st, salt=salt_st)
def test_equal_tokens_and_salt_give_equal_chains(tokens, block_size, salt):
    """Hashing is deterministic, and lists and numpy arrays of any int dtype agree."""
    hashes = hash_blocks(tokens, block_size, extra_keys=salt)
    assert hash_blocks(list(tokens), block_size, extra_keys=salt) == hashes
    assert hash_blocks(np.asarray(tokens, dtype=np.int64), block_size, extra_keys=salt) == hashes
    assert hash_blocks(np.asarray(tokens, dtype=np.uint64), block_size, extra_keys=salt) == hashes


@given(tokens=tokens_st, block_size=block_size_st, salts=st.lists(salt_st, min_size=2,
                                                                   max_size=2, unique=True))
def test_different_salts_never_share_a_block(tokens, block_size, salts):
    """Equal tokens under different salts share no block hash at any position."""
    first, second = (hash_blocks(tokens, block_size, extra_keys=s) for s in salts)
    assert not set(first) & set(second)


@given(tokens=tokens_st.filter(bool), block_size=block_size_st, data=st.data())
def test_a_changed_token_changes_its_block_and_every_later_one(tokens, block_size, data):
    """Changing one token changes its block's hash and all later ones, never earlier ones."""
    assume(len(tokens) >= block_size)
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = data.draw(st.integers(0, 2**40).filter(lambda t: t != tokens[position]))
    before, after = hash_blocks(tokens, block_size), hash_blocks(changed, block_size)
    block = position // block_size
    assert before[:block] == after[:block]
    assert all(a != b for a, b in zip(before[block:], after[block:]))


@given(tokens=tokens_st, block_size=block_size_st, cut=st.integers(0, 6))
def test_chains_continue_from_a_parent(tokens, block_size, cut):
    """Hashing a suffix with the prefix's last hash as parent continues the same chain."""
    hashes = hash_blocks(tokens, block_size)
    cut = min(cut, len(hashes))
    parent = hashes[cut - 1] if cut else None
    assert hash_blocks(tokens[cut * block_size:], block_size, parent=parent) == hashes[cut:]


@given(tokens=tokens_st, block_size=block_size_st, salt=salt_st,
       cuts=st.lists(st.integers(0, 48), max_size=5))
def test_incremental_hasher_matches_one_shot(tokens, block_size, salt, cuts):
    """Feeding tokens to BlockHasher in any split yields the one-shot chain."""
    hasher = BlockHasher(block_size, extra_keys=salt)
    produced = []
    start = 0
    for cut in [*sorted(cuts), len(tokens)]:
        produced += hasher.extend(tokens[start:max(start, cut)])
        start = max(start, cut)
        hasher.check_invariants()
    assert produced == hasher.hashes == hash_blocks(tokens, block_size, extra_keys=salt)
    assert hasher.num_tokens == len(tokens)


@pytest.mark.parametrize(("a", "b"), [
    (("1",), (1,)),
    (("1",), (b"1",)),
    ((b"1",), (1,)),
    (("ab", "c"), ("a", "bc")),
    ((("a",),), ("a",)),
    ((("a", "b"),), (("a",), ("b",))),
    ((-1,), (255,)),
    ((0,), ()),
    (((),), ()),
    (("",), ()),
])
def test_salt_encoding_is_injective(a, b):
    """Salts that differ in type, grouping or split never encode (and hash) alike."""
    assert hash_blocks([1, 2], 2, extra_keys=a) != hash_blocks([1, 2], 2, extra_keys=b)


def test_parent_and_algorithm_change_every_hash():
    """A chain with no parent, with parent 0, and under each algorithm are all different."""
    tokens = list(range(8))
    chains = [hash_blocks(tokens, 4), hash_blocks(tokens, 4, parent=0)]
    chains += [hash_blocks(tokens, 4, algorithm=a) for a in HASH_ALGORITHMS[1:]]
    flat = [h for chain in chains for h in chain]
    assert len(set(flat)) == len(flat)
    for algorithm in HASH_ALGORITHMS:
        assert hash_blocks(tokens, 4, algorithm=algorithm) == hash_blocks(
            np.asarray(tokens), 4, algorithm=algorithm)


@pytest.mark.parametrize(("tokens", "message"), [
    ([1, -2, 3], "got -2 at position 1"),
    (np.array([4, -1]), "got -1 at position 1"),
    ([1, 2.5], "got 2.5 at position 1"),
    ([1, "a"], "got 'a' at position 1"),
    ([True, False], "got True at position 0"),  # a bool inside an int list is coerced by numpy
    ([0, None], "got None at position 1"),
    ([1, 2**64], f"got {2**64} at position 1"),
    (np.array([1, 2**63], dtype=np.uint64), f"got {2**63} at position 1"),
    (np.array([1.0, 2.0]), "got 1.0 at position 0"),
    ([[1, 2], [3, 4]], r"got shape \(2, 2\)"),
])
def test_bad_tokens_quote_the_value(tokens, message):
    """Non-integer, negative or too-large token ids raise HashInputError quoting them."""
    with pytest.raises(HashInputError, match=message):
        hash_blocks(tokens, 2)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_size": 0}, "block_size=0: must be an int >= 1"),
    ({"block_size": 2.0}, "block_size=2.0: must be an int >= 1"),
    ({"block_size": True}, "block_size=True: must be an int >= 1"),
    ({"extra_keys": "salt"}, "extra_keys must be a tuple, got 'salt'"),
    ({"extra_keys": (1.5,)}, "got 1.5"),
    ({"extra_keys": (None,)}, "got None"),
    ({"extra_keys": (("a", [1]),)}, r"got \[1\]"),
    ({"extra_keys": (False,)}, "got False"),
    ({"extra_keys": ("\ud800",)}, "not encodable as UTF-8"),
    ({"algorithm": "md5"}, r"unknown hash algorithm 'md5'; valid: \['sha256', 'blake2b', 'xxh3'\]"),
    ({"parent": -1}, "got -1"),
    ({"parent": 2**128}, f"got {2**128}"),
    ({"parent": "abc"}, "got 'abc'"),
])
def test_bad_arguments_quote_the_value(kwargs, message):
    """A bad block size, salt, algorithm or parent raises HashInputError quoting it."""
    kwargs = {"block_size": 2, **kwargs}
    with pytest.raises(HashInputError, match=message) as info:
        hash_blocks([1, 2], **kwargs)
    assert isinstance(info.value, ValueError)


def test_xxh3_without_xxhash_is_a_typed_error(monkeypatch):
    """Choosing xxh3 without the xxhash package raises BackendUnavailableError with the fix."""
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'kvkit\[fast-hash\]'"):
        hash_blocks([1, 2], 2, algorithm="xxh3")


def test_failed_extend_changes_nothing():
    """A bad token in extend leaves the hasher's chain and pending tokens untouched."""
    hasher = BlockHasher(2)
    hasher.extend([1, 2, 3])
    with pytest.raises(HashInputError, match="got -4"):
        hasher.extend([4, -4])
    assert hasher.num_tokens == 3
    assert hasher.extend([4]) == hash_blocks([1, 2, 3, 4], 2)[1:]
    hasher.check_invariants()
