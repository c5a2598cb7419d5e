"""The disk store beyond the contract: restarts, crashed writes, capacity through its eviction policy."""

from __future__ import annotations

import os

import pytest

from kvkit.backends.blockstore.disk import DiskStore, _name
from kvkit.backends.eviction.fifo import FIFOPolicy
from kvkit.errors import ConfigError, KVKitError


def _put(store, keys, size):
    ticket = store.put(keys, [[memoryview(bytes([i % 251]) * size)] for i, _ in enumerate(keys)])
    (result,) = store.poll([ticket], 5.0)
    assert result.ticket == ticket
    return result


def _get(store, keys, size):
    buffers = [bytearray(size) for _ in keys]
    ticket = store.get(keys, [[memoryview(b)[:3], memoryview(b)[3:]] for b in buffers])
    (result,) = store.poll([ticket], 5.0)
    return result, buffers


def test_a_new_process_finds_what_the_last_one_wrote(tmp_path):
    """Values survive a restart: a new store re-indexes the directory and serves them."""
    first = DiskStore(tmp_path, 10_000)
    assert _put(first, [b"a", b"b"], 100).ok
    first.close()
    second = DiskStore(tmp_path, 10_000)
    assert second.used_bytes == 200 and second.contains([b"a", b"b", b"c"]) == 2
    result, buffers = _get(second, [b"a", b"b"], 100)
    assert result.ok and buffers == [bytearray(b"\x00" * 100), bytearray(b"\x01" * 100)]
    second.check_invariants()
    second.close()


def test_half_written_temp_files_are_ignored_and_removed(tmp_path):
    """A write that never got renamed (a crash) is not a value, and the next start deletes it."""
    store = DiskStore(tmp_path, 10_000)
    assert _put(store, [b"a"], 10).ok
    store.close()
    (final,) = tmp_path.glob("??/*.kvb")
    temp = final.with_name(final.name + ".tmp-999-0")
    temp.write_bytes(b"half")
    store = DiskStore(tmp_path, 10_000)
    assert not temp.exists() and store.used_bytes == 10
    store.close()


def test_capacity_is_kept_through_the_eviction_policy(tmp_path):
    """Writes past the capacity evict the policy's victims (FIFO: the oldest) and delete their files."""
    store = DiskStore(tmp_path, 300, eviction=FIFOPolicy())
    for key in (b"a", b"b", b"c"):
        assert _put(store, [key], 100).ok
    _get(store, [b"a"], 100)  # a hit does not matter to FIFO
    assert _put(store, [b"d"], 100).ok
    assert [store.contains([k]) for k in (b"a", b"b", b"c", b"d")] == [0, 1, 1, 1]
    assert len(list(tmp_path.glob("??/*.kvb"))) == 3 and store.used_bytes == 300
    result = _put(store, [b"huge"], 301)
    assert result.failed == (0,) and "capacity" in result.error
    store.check_invariants()
    store.close()


def test_lru_keeps_what_was_read(tmp_path):
    """With the default LRU policy, a value read recently outlives an older unread one."""
    store = DiskStore(tmp_path, 200)
    _put(store, [b"a"], 100)
    _put(store, [b"b"], 100)
    _get(store, [b"a"], 100)
    _put(store, [b"c"], 100)
    assert [store.contains([k]) for k in (b"a", b"b", b"c")] == [1, 0, 1]
    store.close()


def test_a_smaller_capacity_at_restart_evicts_the_oldest(tmp_path):
    """Re-indexing under a smaller capacity evicts (oldest modification first) until it fits."""
    store = DiskStore(tmp_path, 1000)
    for age, key in enumerate((b"a", b"b", b"c")):
        _put(store, [key], 100)
        os.utime(store._file(_name(key)), ns=(age * 10**9, age * 10**9))
    store.close()
    smaller = DiskStore(tmp_path, 200)
    assert [smaller.contains([k]) for k in (b"a", b"b", b"c")] == [0, 1, 1]
    smaller.close()


def test_values_written_by_another_process_are_adopted(tmp_path):
    """Two stores on one directory see each other's values (adopted on contains)."""
    one, two = DiskStore(tmp_path, 10_000), DiskStore(tmp_path, 10_000)
    _put(one, [b"shared"], 50)
    assert two.contains([b"shared"]) == 1 and two.used_bytes == 50
    result, (buffer,) = _get(two, [b"shared"], 50)
    assert result.ok and buffer == bytearray(50)
    one.close()
    two.close()


def test_a_file_deleted_behind_its_back_is_a_clean_miss(tmp_path):
    """Deleting a value's file makes its get fail and takes it out of the index."""
    store = DiskStore(tmp_path, 10_000)
    _put(store, [b"a"], 10)
    for path in tmp_path.glob("??/*.kvb"):
        path.unlink()
    result, _ = _get(store, [b"a"], 10)
    assert result.failed == (0,) and store.used_bytes == 0
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"path": "", "capacity_bytes": 1}, "path"),
    ({"path": "x", "capacity_bytes": 0}, "capacity_bytes"),
    ({"path": "x", "capacity_bytes": 1, "eviction": "lru"}, "EvictionPolicy"),
    ({"path": "x", "capacity_bytes": 1, "threads": 0}, "threads"),
])
def test_bad_settings_are_refused(tmp_path, kwargs, match):
    """Bad settings raise ConfigError quoting the field."""
    kwargs = {**kwargs, "path": kwargs["path"] and tmp_path / kwargs["path"]}
    with pytest.raises(ConfigError, match=match):
        DiskStore(**kwargs)


def test_a_file_in_the_way_of_the_directory_is_a_config_error(tmp_path):
    """A path that cannot be a directory is refused with the path quoted."""
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ConfigError, match="cannot create"):
        DiskStore(tmp_path / "f" / "sub", 10)


def test_calls_after_close_raise(tmp_path):
    """A closed store refuses work."""
    store = DiskStore(tmp_path, 10)
    store.close()
    with pytest.raises(KVKitError, match="closed"):
        store.contains([b"a"])


def test_a_value_survives_a_real_process_restart(tmp_path):
    """One Python process writes and exits; a second one (a fresh interpreter) reads the bytes back."""
    import subprocess
    import sys

    write = ("import sys; from kvkit.backends.blockstore.disk import DiskStore\n"
             "s = DiskStore(sys.argv[1], 1 << 20); t = s.put([b'k'], [[memoryview(b'\\x07' * 999)]])\n"
             "assert [r.ticket for r in s.poll([t], 5.0) if r.ok] == [t]; s.close()\n")
    subprocess.run([sys.executable, "-c", write, str(tmp_path)], check=True, timeout=60)
    store = DiskStore(tmp_path, 1 << 20)
    result, (buffer,) = _get(store, [b"k"], 999)
    assert result.ok and buffer == b"\x07" * 999
    store.close()
