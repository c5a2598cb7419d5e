"""The disk store beyond the contract: restarts, crashed writes, capacity through its eviction policy."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import types

import pytest

from kvkit.backends.blockstore import disk
from kvkit.backends.blockstore.disk import DiskStore, _name
from kvkit.backends.eviction.fifo import FIFOPolicy
from kvkit.errors import ConfigError, KVKitError
from kvkit.registry import EVICTION
from kvkit.shared.urls import open_block_store
from kvkit.testing.forked import in_child


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


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"path": "", "capacity_bytes": 1}, "path"),
    ({"path": "x", "capacity_bytes": 0}, "capacity_bytes"),
    ({"path": "x", "capacity_bytes": 1, "eviction": "lru"}, "EvictionPolicy"),
    ({"path": "x", "capacity_bytes": 1, "threads": 0}, "threads"),
    ({"path": "x", "capacity_bytes": 1, "page_cache": "no"}, "page_cache"),
])
def test_bad_settings_are_refused(tmp_path, kwargs, match):
    """Bad settings raise ConfigError quoting the field."""
    kwargs = {**kwargs, "path": kwargs["path"] and tmp_path / kwargs["path"]}
    with pytest.raises(ConfigError, match=match):
        DiskStore(**kwargs)


def test_an_eviction_policy_that_tracks_blocks_already_is_refused_changing_nothing(tmp_path):
    """A policy reused from a closed store (or another store's) would mix its ids with the new store's (opening
    or the puts would fail with the policy's own error): it is a ConfigError quoting the policy, before anything
    on the file system changes; a new instance serves."""
    policy = FIFOPolicy()
    store = DiskStore(tmp_path / "kv", 1000, eviction=policy)
    assert _put(store, [b"a"], 100).ok
    store.close()
    before = sorted(p.name for p in (tmp_path / "kv").rglob("*"))
    for path in (tmp_path / "kv", tmp_path / "other"):
        with pytest.raises(ConfigError, match=r"DiskStore\.eviction=FIFOPolicy.*already tracks 1 block"):
            DiskStore(path, 1000, eviction=policy)
    assert sorted(p.name for p in (tmp_path / "kv").rglob("*")) == before and not (tmp_path / "other").exists()
    store = DiskStore(tmp_path / "kv", 1000, eviction=FIFOPolicy())
    assert store.contains([b"a"]) == 1 and _put(store, [b"b"], 100).ok
    store.check_invariants()
    store.close()


def test_an_eviction_policy_another_open_store_uses_is_refused_changing_nothing(tmp_path):
    """Two open stores given one policy (a shared default instance) would number their values alike (the second
    store's puts failing with the policy's error, its evictions removing the first store's blocks from the
    policy): the second store is a ConfigError quoting the policy, and creates nothing; the first serves on."""
    policy = FIFOPolicy()
    first = DiskStore(tmp_path / "a", 1000, eviction=policy)
    with pytest.raises(ConfigError, match=r"DiskStore\.eviction=FIFOPolicy.*another open store uses"):
        DiskStore(tmp_path / "b", 1000, eviction=policy)
    assert not (tmp_path / "b").exists()
    assert _put(first, [b"a", b"b"], 100).ok and first.contains([b"a", b"b"]) == 2
    first.check_invariants()
    first.close()


@pytest.mark.parametrize("path", ["kv\0x", "kv\ud800"])
def test_a_path_the_operating_system_cannot_take_is_refused(tmp_path, path):
    """A NUL byte or a lone surrogate (also through a URL) is a ConfigError quoting the path; nothing is created."""
    with pytest.raises(ConfigError, match=r"DiskStore\.path=.*kv"):
        DiskStore(tmp_path / path, 10)
    with pytest.raises(ConfigError, match="kv"):
        open_block_store(f"file://{tmp_path}/kv%00x?capacity_bytes=1KiB")
    assert os.listdir(tmp_path) == []


def test_a_relative_path_and_a_tilde_are_fixed_when_the_store_opens(tmp_path, monkeypatch):
    """A relative path is taken from the working directory at opening (a later chdir moves nothing);
    a leading ``~`` is the home directory, never a directory named ``~``."""
    (tmp_path / "home").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    relative, home = DiskStore("rel/kv/", 1000), DiskStore("~/kv", 1000)
    assert (relative.path, home.path) == (tmp_path / "rel" / "kv", tmp_path / "home" / "kv")
    monkeypatch.chdir(tmp_path / "elsewhere")
    for store in (relative, home):
        assert _put(store, [b"a"], 10).ok and _get(store, [b"a"], 10)[0].ok
        store.close()
    assert not (tmp_path / "~").exists() and os.listdir(tmp_path / "elsewhere") == []


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_a_dot_dot_after_a_symlink_leads_where_the_kernel_goes(tmp_path, monkeypatch, relative):
    """``link/../kv``, ``link`` a symlink to ``real/sub``: the store's directory is ``real/kv``, where the kernel
    goes through the link, never ``kv`` beside the link (the text's ``..`` is not taken away)."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    store = DiskStore("link/../kv" if relative else str(tmp_path / "link" / ".." / "kv"), 1000)
    assert str(store.path) == os.path.join(tmp_path, "link", "..", "kv")
    assert _put(store, [b"a"], 10).ok and _get(store, [b"a"], 10)[0].ok
    store.close()
    assert (tmp_path / "real" / "kv").is_dir() and not (tmp_path / "kv").exists()


@pytest.mark.parametrize("page_cache", [True, False])
def test_without_the_page_cache_each_value_is_flushed_and_dropped_once_written_or_read(tmp_path, monkeypatch,
                                                                                        page_cache):
    """``page_cache=False``: a put syncs then drops its file's pages, a get drops them; ``True`` does neither."""
    calls = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append("sync"))
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append(
        ("drop", offset, length) if advice == os.POSIX_FADV_DONTNEED else advice))
    store = DiskStore(tmp_path, 10_000, page_cache=page_cache)
    assert _put(store, [b"a"], 100).ok
    written, calls[:] = list(calls), []
    result, buffers = _get(store, [b"a"], 100)
    assert result.ok and buffers == [bytearray(100)]
    assert (written, calls) == (([], []) if page_cache else (["sync", ("drop", 0, 0)], [("drop", 0, 0)]))
    store.close()


def test_a_file_in_the_way_of_the_directory_is_a_config_error(tmp_path):
    """A path that cannot be a directory is refused with the path quoted."""
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ConfigError, match="cannot create"):
        DiskStore(tmp_path / "f" / "sub", 10)


@pytest.mark.parametrize(("call", "match"), [
    (lambda s: s.put([b"a"], [[memoryview(bytearray(8))[::2]]]), "contiguous"),
    (lambda s: s.put([b"a"], [[5]]), "5"),
    (lambda s: s.put([b"a"], [5]), "5"),
    (lambda s: s.get([b"a"], [[memoryview(bytearray(8))[::2]]]), "contiguous"),
    (lambda s: s.put([b"a"], 5), "5"),
    (lambda s: s.contains(None), "None"),
    (lambda s: s.get(None, []), "None"),
    (lambda s: s.drop("a"), "'a'"),
])
def test_malformed_buffers_and_keys_are_refused_changing_nothing(tmp_path, call, match):
    """Buffers that are not contiguous bytes-like objects, and keys that are not a sequence, raise ConfigError
    quoting them, before any ticket is issued or anything written."""
    store = DiskStore(tmp_path, 1000)
    with pytest.raises(ConfigError, match=match):
        call(store)
    assert store._tickets.outstanding == 0 and store.poll(range(4)) == [] and os.listdir(tmp_path) == []
    store.check_invariants()
    store.close()


def test_calls_after_close_raise(tmp_path):
    """A closed store refuses work."""
    store = DiskStore(tmp_path, 10)
    store.close()
    with pytest.raises(KVKitError, match="closed"):
        store.contains([b"a"])


@pytest.mark.parametrize("op", ["put", "get"])
def test_a_call_racing_close_is_reported_failed_not_raised(tmp_path, monkeypatch, op):
    """``close`` running between a ``put``'s (or ``get``'s) check and its queueing: the call answers a ticket,
    reported failed at once, never the pool's ``RuntimeError``, and no ticket is left open."""
    from kvkit.backends.blockstore._common import TicketBox

    store = DiskStore(tmp_path, 10_000)
    issue = TicketBox.issue

    def closing_first(box, n_keys):
        store.close()  # another thread's close, landing just before the ticket is issued
        return issue(box, n_keys)

    monkeypatch.setattr(TicketBox, "issue", closing_first)
    ticket = getattr(store, op)([b"racing"], [[memoryview(bytearray(4))]])
    monkeypatch.setattr(TicketBox, "issue", issue)
    (result,) = store.poll([ticket], 0.0)
    assert result.failed == (0,) and "closed" in result.error, result
    store.check_invariants()


def test_a_call_no_thread_can_start_for_fails_saying_so_and_never_runs_later(tmp_path, monkeypatch):
    """A process at its thread limit (a container's pids limit): the pool cannot start a worker for a get. Its
    ticket fails quoting that, never claiming the open store closed, and the get never runs later (the pool
    queued it first): a buffer its caller was told holds nothing is never written once another call starts a
    thread."""
    import threading

    store = DiskStore(tmp_path, 10_000)
    value = b"abcd"
    assert store.poll([store.put([b"k"], [[memoryview(value)]])], 10.0)[0].ok
    store._pool.shutdown(wait=True)  # a pool with no thread left, as a fresh one
    store._pool = type(store._pool)(1, thread_name_prefix="kvkit-disk")

    def start(thread):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", start)
    buffer = bytearray(4)
    ticket = store.get([b"k"], [[memoryview(buffer)]])
    monkeypatch.undo()
    (result,) = store.poll([ticket], 10.0)
    assert result.failed == (0,) and "can't start new thread" in result.error and "closed" not in result.error
    assert _put(store, [b"other"], 4).ok  # a thread starts, and runs what the pool queued
    store.close()
    assert buffer == bytes(4), "a get reported failed wrote its caller's buffer later"
    store.check_invariants()


def test_close_called_again_while_another_thread_closes_returns_once_closed(tmp_path, monkeypatch):
    """Two threads close one store with a slow write in flight: the second ``close`` returns only once the
    store is closed and every ticket reported."""
    import threading

    store = DiskStore(tmp_path, 10_000)
    write = DiskStore._write

    def slow_write(self, key, parts):
        time.sleep(0.3)
        return write(self, key, parts)

    monkeypatch.setattr(DiskStore, "_write", slow_write)
    ticket = store.put([b"slow"], [[memoryview(b"v")]])
    first = threading.Thread(target=store.close)
    first.start()
    time.sleep(0.05)
    try:
        store.close()
        assert store._tickets.outstanding == 0
        assert [r.ticket for r in store.poll([ticket])] == [ticket]
    finally:
        first.join()


def test_a_value_survives_a_real_process_restart(tmp_path):
    """One Python process writes and exits; a second one (a fresh interpreter) reads the bytes back."""
    write = ("import sys; from kvkit.backends.blockstore.disk import DiskStore\n"
             "s = DiskStore(sys.argv[1], 1 << 20); t = s.put([b'k'], [[memoryview(b'\\x07' * 999)]])\n"
             "assert [r.ticket for r in s.poll([t], 5.0) if r.ok] == [t]; s.close()\n")
    subprocess.run([sys.executable, "-c", write, str(tmp_path)], check=True, timeout=60)
    store = DiskStore(tmp_path, 1 << 20)
    result, (buffer,) = _get(store, [b"k"], 999)
    assert result.ok and buffer == b"\x07" * 999
    store.close()


def test_a_store_inherited_through_fork_refuses_work_in_the_child(tmp_path):
    """A forked child has the store's object but not its threads: its calls raise KVKitError (they would queue
    work nothing runs, never reported); the parent's store keeps working."""
    store = DiskStore(tmp_path, 1 << 20)

    def child():
        outcome = []
        for call in (lambda: store.put([b"a"], [[memoryview(b"x")]]), lambda: store.get([b"a"], [[memoryview(
                bytearray(1))]]), lambda: store.contains([b"a"])):
            try:
                call()
                outcome.append("ran")
            except KVKitError as exc:
                outcome.append("KVKitError" if "fork" in str(exc) and str(tmp_path) in str(exc) else str(exc))
        return outcome

    outcome = in_child(child)()
    assert outcome == ["KVKitError"] * 3
    assert _put(store, [b"a"], 10).ok and store.contains([b"a"]) == 1
    store.close()


def _open_under(root):
    """What this process's descriptors open under ``root`` (paths, sorted)."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(link for link in links if link.startswith(f"{root}{os.sep}"))


def test_a_child_forked_while_calls_run_keeps_none_of_their_descriptors(tmp_path, monkeypatch):
    """A child forked while the store's threads write and read (a subdirectory and a file open each) closes its
    copies of their descriptors: no call runs on there to close them, and a copy would hold the parent's flock
    and, once the value is evicted, its file's space for as long as the child lives."""
    store = DiskStore(tmp_path, 1 << 20)
    assert _put(store, [b"r"], 10).ok
    writing, reading, release = threading.Event(), threading.Event(), threading.Event()
    write_all, read_all = disk._write_all, disk._read_all

    def held_write(fd, parts):
        writing.set()
        release.wait(10)
        write_all(fd, parts)

    def held_read(fd, parts):
        reading.set()
        release.wait(10)
        return read_all(fd, parts)

    monkeypatch.setattr(disk, "_write_all", held_write)
    monkeypatch.setattr(disk, "_read_all", held_read)
    put = store.put([b"w"], [[memoryview(bytes(10))]])
    get = store.get([b"r"], [[memoryview(bytearray(10))]])
    assert writing.wait(10) and reading.wait(10)
    held = _open_under(tmp_path)
    assert len(held) == 4, held  # two subdirectories, a temporary file and a value file
    assert in_child(lambda: _open_under(tmp_path))() == []
    release.set()
    assert all(result.ok for ticket in (put, get) for result in store.poll([ticket], 10.0))
    assert _open_under(tmp_path) == []
    store.close()


# --- among neighbours on a real file system -----------------------------------
# Other processes open, write and evict in the same directory; people and tools leave things in it; the file
# system fills up or turns read-only. None of it may crash a store or make it delete what is not provably its own.

_VALUE = 1 << 16


def _sub(tmp_path, key):
    """The subdirectory ``key``'s value lives in (created), and the value's file name there."""
    name = _name(key)
    sub = tmp_path / name[:2]
    sub.mkdir(exist_ok=True)
    return sub, f"{name}.kvb"


def _temp_of(tmp_path, key, owner="gone-0"):
    sub, file = _sub(tmp_path, key)
    return sub / f"{file}.tmp-{owner}"


def _plant_symlink_value(tmp_path):
    sub, file = _sub(tmp_path, b"planted")
    (tmp_path / "elsewhere").mkdir()  # the target: a foreign directory at the top
    (tmp_path / "elsewhere" / "secret").write_bytes(b"s" * 10)
    (sub / file).symlink_to(tmp_path / "elsewhere" / "secret")
    return sub / file


def _plant(tmp_path, what):
    """Put ``what`` in the store's directory; answer its path."""
    sub, file = _sub(tmp_path, b"planted")
    target = {
        "stray file named as a value": sub / "README.kvb",
        "stray file at the top": tmp_path / "README",
        "stray directory at the top": tmp_path / "lost+found",
        "value in the wrong subdirectory": tmp_path / ("00" if sub.name != "00" else "01") / file,
        "upper-case name": tmp_path / sub.name.upper() / file.upper(),
        "stray temporary file": sub / "README.kvb.tmp-1-0",
        "temporary name without its writer": sub / f"{file}.tmp-",
        "temporary name without its number": sub / f"{file}.tmp-x",
        "temporary name with a suffix": sub / f"{file}.tmp-x-1.kvb",
        "dangling symlink as a value": sub / file,
        "hard link as a value": sub / file,
        "directory as a value": sub / file,
        "FIFO as a value": sub / file,
        "file as a subdirectory": tmp_path / "ff",
        "symlink as a temporary file": sub / f"{file}.tmp-x-0",
        "FIFO as a temporary file": sub / f"{file}.tmp-x-1",
    }[what]
    target.parent.mkdir(exist_ok=True)
    if what.startswith(("dangling symlink", "symlink")):
        target.symlink_to(tmp_path / "nowhere")
    elif what.startswith("hard link"):  # to a file outside the store's directory, of a value's size
        outside = tmp_path.parent / f"{tmp_path.name}-secret"
        outside.write_bytes(b"s" * 10)
        os.link(outside, target)
    elif what.startswith("FIFO"):
        os.mkfifo(target)
    elif "directory" in what and "subdirectory" not in what:
        target.mkdir()
    else:
        target.write_bytes(b"not a value")
    return target


_FOREIGN = ["stray file named as a value", "stray file at the top", "stray directory at the top",
            "value in the wrong subdirectory", "upper-case name", "stray temporary file",
            "temporary name without its writer", "temporary name without its number", "temporary name with a suffix"]
_BROKEN = ["dangling symlink as a value", "hard link as a value", "directory as a value", "FIFO as a value",
           "file as a subdirectory", "symlink as a temporary file", "FIFO as a temporary file"]


@pytest.mark.parametrize("policy", ["lru", "lirs", "prefix-lru", "hit-density"])
def test_a_value_name_sharing_another_ones_first_128_bits_opens_under_every_policy(tmp_path, policy):
    """A file named as a value whose name shares its first 128 bits with another value's (planted: any 64 hex
    digits in the right subdirectory are a value's name) is a value of its own: opening indexes both and
    raises nothing, whatever the eviction policy (one that indexes blocks by hash refuses a second block under
    one hash), and both are evicted as values."""
    store = DiskStore(tmp_path, 25)
    assert _put(store, [b"a"], 10).ok
    store.close()
    sub, file = _sub(tmp_path, b"a")
    twin = file[:32] + ("0" if file[32] != "0" else "1") + file[33:]
    (sub / twin).write_bytes(bytes(10))
    store = DiskStore(tmp_path, 25, eviction=EVICTION.create(policy, slot="eviction"))
    assert store.used_bytes == 20 and store.contains([b"a"]) == 1
    assert _put(store, [b"b"], 10).ok and store.counters["evicted"] == 1
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("what", _FOREIGN + _BROKEN)
def test_opening_counts_and_keeps_what_is_not_a_value(tmp_path, what):
    """Foreign and broken entries are counted, left where they are, and never indexed; the real values serve."""
    store = DiskStore(tmp_path, 1 << 20)
    assert _put(store, [b"real"], 100).ok
    store.close()
    planted = _plant(tmp_path, what)
    store = DiskStore(tmp_path, 1 << 20)
    expected = "foreign" if what in _FOREIGN else "broken"
    assert store.counters == {**dict.fromkeys(store.counters, 0), expected: 1}, store.counters
    assert os.path.lexists(planted) and store.used_bytes == 100 and store.contains([b"real"]) == 1
    store.check_invariants()
    store.close()


def test_opening_reads_junk_entry_by_entry_in_bounded_memory(tmp_path):
    """Entries a neighbour left by the ten thousand (at the top and in a value's subdirectory) cost opening
    time, not memory: each directory is read entry by entry, never listed whole (a listing of ten million names
    would hold about a gigabyte). Each is counted ``foreign``; the real values are indexed."""
    store = DiskStore(tmp_path, 1 << 20)
    assert _put(store, [b"real"], 100).ok
    store.close()
    sub, _ = _sub(tmp_path, b"real")
    for i in range(15_000):
        for folder in (tmp_path, sub):
            os.close(os.open(folder / f"left-behind-by-a-neighbour-{i:08d}-{'x' * 40}", os.O_CREAT, 0o600))
    tracemalloc.start()
    try:
        store = DiskStore(tmp_path, 1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"opening held {peak} bytes at its peak"
    assert store.counters["foreign"] == 30_000 and store.contains([b"real"]) == 1 and store.used_bytes == 100
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("what", ["dangling symlink as a value", "hard link as a value", "directory as a value",
                                  "FIFO as a value"])
def test_something_else_in_a_values_place_is_a_miss(tmp_path, what):
    """contains answers 0 and get fails (quoting the path and saying what is there, never blocking on a FIFO),
    never raising."""
    planted = _plant(tmp_path, what)
    store = DiskStore(tmp_path, 1 << 20)
    assert store.contains([b"planted"]) == 0
    result, _ = _get(store, [b"planted"], 10)
    assert result.failed == (0,) and str(planted) in result.error
    said = {"dangling symlink as a value": os.strerror(errno.ELOOP), "hard link as a value": "a regular file with 2 "
            "names", "directory as a value": "it is a directory", "FIFO as a value": "it is a FIFO"}[what]
    assert said in result.error, result.error
    assert os.path.lexists(planted) and store.used_bytes == 0
    store.check_invariants()
    store.close()


def test_a_symlink_to_a_file_is_never_followed(tmp_path):
    """A value's name pointing elsewhere is not served, however well its target's size fits."""
    link = _plant_symlink_value(tmp_path)
    store = DiskStore(tmp_path, 1 << 20)
    assert store.counters["broken"] == 1 and store.contains([b"planted"]) == 0
    result, (buffer,) = _get(store, [b"planted"], 10)
    assert result.failed == (0,) and buffer == bytearray(10) and os.path.lexists(link)
    store.close()


def test_a_hard_link_planted_over_an_indexed_value_is_never_read_counted_or_written_through(tmp_path):
    """A neighbour replaces an indexed value's name with a hard link to a file outside ``path`` (of the value's
    size): it is a miss that forgets the value (never read into the buffers, never counted), and a put of the
    key renames a new file over the name, leaving the linked file's bytes as they were."""
    store = DiskStore(tmp_path, 1 << 20)
    assert _put(store, [b"planted"], 10).ok and store.used_bytes == 10
    sub, file = _sub(tmp_path, b"planted")
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 10)
    (sub / file).unlink()
    os.link(secret, sub / file)
    result, (buffer,) = _get(store, [b"planted"], 10)
    assert result.failed == (0,) and buffer == bytearray(10), "a hard link's target was read"
    assert store.contains([b"planted"]) == 0 and store.used_bytes == 0
    assert _put(store, [b"planted"], 10).ok and store.contains([b"planted"]) == 1
    assert secret.read_bytes() == b"s" * 10 and secret.stat().st_nlink == 1
    result, (buffer,) = _get(store, [b"planted"], 10)
    assert result.ok and buffer == bytearray(10) and store.used_bytes == 10
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("when", ["before opening", "after indexing"])
def test_a_symlink_in_a_subdirectorys_place_is_never_followed(tmp_path, when):
    """A subdirectory replaced by a symlink to a directory elsewhere carries no eviction, get, contains or put
    outside the store: they forget, miss or fail, and nothing there is deleted, read or written."""
    store_dir, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    elsewhere.mkdir()
    size = 100
    store = DiskStore(store_dir, 3 * size)
    assert _put(store, [b"a"], size).ok
    folder = store._file(_name(b"a")).parent
    if when == "before opening":
        store.close()
    planted = elsewhere / store._file(_name(b"a")).name
    planted.write_bytes(bytes(size))  # what an eviction through the link would delete, a get serve
    shutil.rmtree(folder)
    folder.symlink_to(elsewhere, target_is_directory=True)
    if when == "before opening":
        store = DiskStore(store_dir, 3 * size)
        assert store.counters["broken"] == 1 and store.used_bytes == 0
    candidates = [b"b%d" % i for i in range(5000)]
    assert _put(store, [k for k in candidates if _name(k)[:2] != folder.name][:5], size).ok  # evicts "a" if held
    result, _ = _get(store, [b"a"], size)
    assert result.failed == (0,) and store.contains([b"a"]) == 0
    beside = [k for k in candidates if _name(k)[:2] == folder.name][:2]
    result = _put(store, [b"a", *beside], size)
    assert result.failed == (0, 1, 2) and "cannot write" in result.error
    assert os.listdir(elsewhere) == [planted.name] and planted.read_bytes() == bytes(size)
    assert folder.is_symlink()
    store.check_invariants()
    store.close()


def test_a_subdirectory_swapped_for_a_symlink_while_opening_is_never_followed(tmp_path, monkeypatch):
    """A subdirectory replaced by a symlink to a directory elsewhere between the listing of ``path`` and its
    own: opening neither deletes an abandoned temporary file there nor indexes a value there."""
    store_dir, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store = DiskStore(store_dir, 1 << 20)
    assert _put(store, [b"a"], 100).ok
    store.close()
    final = store._file(_name(b"a"))
    elsewhere.mkdir()
    (elsewhere / final.name).write_bytes(bytes(100))
    temp = elsewhere / f"{final.name}.tmp-gone-0"
    temp.write_bytes(b"half")  # unlocked: a reaper that got here would delete it
    real = os.scandir

    def swapped_once_listed(path="."):
        if str(path) != str(store_dir):
            return real(path)
        with real(path) as listed:
            entries = list(listed)
        shutil.rmtree(final.parent)
        final.parent.symlink_to(elsewhere, target_is_directory=True)
        return contextlib.nullcontext(iter(entries))

    monkeypatch.setattr(disk.os, "scandir", swapped_once_listed)
    store = DiskStore(store_dir, 1 << 20)
    assert store.counters["broken"] == 1 and store.used_bytes == 0 and store.contains([b"a"]) == 0
    assert sorted(os.listdir(elsewhere)) == sorted([final.name, temp.name])
    store.check_invariants()
    store.close()


def test_a_value_replaced_by_a_directory_after_indexing_is_forgotten_not_deleted(tmp_path):
    """What takes an indexed value's place is another's: the get fails, the index drops the value,
    nothing is deleted."""
    store = DiskStore(tmp_path, 1 << 20)
    _put(store, [b"a"], 100)
    path = store._file(_name(b"a"))
    path.unlink()
    path.mkdir()
    result, _ = _get(store, [b"a"], 100)
    assert result.failed == (0,) and str(path) in result.error and path.is_dir() and store.used_bytes == 0
    store.check_invariants()
    store.close()


def test_a_live_writers_temporary_file_is_kept_and_an_abandoned_one_removed(tmp_path):
    """A temporary file whose lock is held (its writer is alive) survives an open;
    once released, the next removes it."""
    temp = _temp_of(tmp_path, b"k", owner="live-0")
    temp.write_bytes(b"half")
    fd = os.open(temp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        store = DiskStore(tmp_path, 1 << 20)
        assert temp.exists() and store.counters["temps_kept"] == 1 and store.counters["temps_removed"] == 0
        store.close()
    finally:
        os.close(fd)
    store = DiskStore(tmp_path, 1 << 20)
    assert not temp.exists() and store.counters["temps_removed"] == 1
    store.close()


@pytest.mark.parametrize("code", ["ESTALE", "EIO"])
def test_a_temporary_file_that_cannot_be_looked_at_once_open_is_kept_and_counted(tmp_path, monkeypatch, code):
    """A temporary file whose status cannot be read once opened (a stale handle on a network file system, whose
    writer on another host renamed it; an I/O error) is kept and counted as broken: opening never raises, and
    on a full file system the put's re-scan goes on."""
    store = DiskStore(tmp_path, 1 << 20)
    assert _put(store, [b"real"], 100).ok
    store.close()
    temp = _temp_of(tmp_path, b"k")
    temp.write_bytes(b"half")
    real = os.fstat

    def fstat(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str(temp):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return real(fd)

    monkeypatch.setattr(disk.os, "fstat", fstat)
    store = DiskStore(tmp_path, 1 << 20)
    assert store.counters["broken"] == 1 and temp.exists() and store.contains([b"real"]) == 1
    with store._lock:
        assert store._adopt_unindexed() is False  # the re-scan of a full file system
    assert store.counters["broken"] == 2
    store.check_invariants()
    store.close()


def test_a_temporary_file_renamed_while_being_examined_is_left_alone(tmp_path, monkeypatch):
    """A writer that renames its file between the reaper's open and lock: the reaper must not delete the value."""
    temp = _temp_of(tmp_path, b"k")
    temp.write_bytes(b"v" * 10)
    final = temp.with_name(temp.name.partition(".tmp-")[0])
    real = fcntl.flock

    def renamed_first(fd, operation):
        if os.path.exists(temp):
            os.replace(temp, final)  # the writer finished just now
        return real(fd, operation)

    monkeypatch.setattr(disk.fcntl, "flock", renamed_first)
    store = DiskStore(tmp_path, 1 << 20)
    assert final.read_bytes() == b"v" * 10 and store.counters["vanished"] == 1
    store.close()


def test_a_writer_whose_temporary_file_is_reaped_before_it_locks_takes_a_new_name(tmp_path, monkeypatch):
    """Between creating and locking its file a writer is unprotected; if a reaper deletes it then, it starts over."""
    real, reaped = fcntl.flock, []

    def reaper_first(fd, operation):
        if operation == fcntl.LOCK_EX and len(reaped) < limit:  # the writer's blocking lock
            for temp in tmp_path.glob("??/*.tmp-*"):
                temp.unlink()
                reaped.append(temp)
        return real(fd, operation)

    monkeypatch.setattr(disk.fcntl, "flock", reaper_first)
    store = DiskStore(tmp_path, 1 << 20)
    limit = 1
    assert _put(store, [b"a"], 100).ok and len(reaped) == 1
    limit = 99  # a reaper wins every time: the put fails, typed, after a bounded number of names
    result = _put(store, [b"b"], 100)
    assert result.failed == (0,) and "deleted by others" in result.error and len(reaped) == 4
    assert not list(tmp_path.glob("??/*.tmp-*")) and store.contains([b"a", b"b"]) == 1
    store.close()


def test_a_value_evicted_between_listing_and_looking_is_skipped(tmp_path, monkeypatch):
    """Another process evicts while this one opens: the vanished file is counted, not a crash."""
    store = DiskStore(tmp_path, 1 << 20)
    _put(store, [b"a", b"b"], 100)
    store.close()
    victim, real = DiskStore(tmp_path, 1 << 20)._file(_name(b"a")), os.lstat

    def evicted_first(path, *args, **kwargs):
        if str(path) == victim.name and victim.exists():  # looked at relative to its subdirectory
            victim.unlink()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(disk.os, "lstat", evicted_first)
    store = DiskStore(tmp_path, 1 << 20)
    assert store.counters["vanished"] == 1 and store.used_bytes == 100 and store.contains([b"b"]) == 1
    store.check_invariants()
    store.close()


def test_a_directory_deleted_under_an_open_store_is_made_again(tmp_path):
    """A cleanup deleting the whole directory: the next put makes it again (private, as opening does) and lands;
    what was deleted is a miss."""
    store = DiskStore(tmp_path / "kv", 1000)
    assert _put(store, [b"a"], 100).ok
    shutil.rmtree(tmp_path / "kv")
    assert _put(store, [b"b"], 100).ok and _get(store, [b"b"], 100)[0].ok
    assert store.contains([b"a"]) == 0 and store.used_bytes == 100
    assert _modes(tmp_path / "kv") == ({"0o600"}, {"0o700"})
    store.check_invariants()
    store.close()


def test_a_subdirectory_removed_while_a_put_writes_in_it_is_made_again(tmp_path, monkeypatch):
    """A neighbour removes an empty subdirectory (its prune when out of inodes, a cleanup) between a put's making
    it and creating its temporary file there: the put makes it again and lands."""
    store = DiskStore(tmp_path, 1000)
    real, removed = DiskStore._create_temp, []

    def removed_first(self, folder, final):
        if not removed:
            removed.append(final)
            os.rmdir(store._file(_name(b"a")).parent)
        return real(self, folder, final)

    monkeypatch.setattr(DiskStore, "_create_temp", removed_first)
    assert _put(store, [b"a"], 100).ok and removed and _get(store, [b"a"], 100)[0].ok
    store.check_invariants()
    store.close()


def test_a_victim_another_process_evicted_first_is_counted(tmp_path):
    """Evicting a file already gone is not an error: the put that needed the room lands."""
    store = DiskStore(tmp_path, 200)
    _put(store, [b"a"], 100)
    _put(store, [b"b"], 100)
    store._file(_name(b"a")).unlink()  # the other process's eviction
    assert _put(store, [b"c"], 100).ok
    assert store.counters["vanished"] == 1 and store.counters["evicted"] == 1 and store.contains([b"b", b"c"]) == 2
    store.check_invariants()
    store.close()


def test_what_cannot_be_deleted_is_counted_not_raised(tmp_path, monkeypatch):
    """Unlinks refused (as on a read-only file system): a stale temporary file is kept, a victim forgotten."""
    store = DiskStore(tmp_path, 1 << 20)
    _put(store, [b"a", b"b"], 100)
    store.close()
    temp = _temp_of(tmp_path, b"a")
    temp.write_bytes(b"half")

    def refused(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(disk.os, "unlink", refused)
    store = DiskStore(tmp_path, 100)  # smaller: one of the two must go
    counters = store.counters
    assert counters["temps_kept"] == 1 and counters["unlink_failed"] == 1 and counters["evicted"] == 1
    assert temp.exists() and len(list(tmp_path.glob("??/*.kvb"))) == 2 and store.used_bytes == 100
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("code", ["EMFILE", "ENFILE", "ENOMEM"])
def test_opening_without_descriptors_is_a_config_error_not_a_broken_count(tmp_path, monkeypatch, code):
    """A process out of descriptors (or memory) cannot look into a subdirectory: that says nothing about the
    entry, so opening raises ConfigError quoting it rather than leave its values on disk unindexed."""
    store = DiskStore(tmp_path, 1 << 20)
    assert _put(store, [b"a"], 100).ok
    store.close()
    folder, real = store._file(_name(b"a")).parent, os.open

    def short(path, flags, *args, **kwargs):
        if str(path) == str(folder):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(disk.os, "open", short)
    with pytest.raises(ConfigError, match=f"{folder}.*{os.strerror(getattr(errno, code))}"):
        DiskStore(tmp_path, 1 << 20)


def test_an_unusable_directory_is_a_config_error_quoting_it(tmp_path, monkeypatch):
    """A path that is a file, or a directory that cannot be listed, raises ConfigError with the path."""
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'f'}.*not a directory"):
        DiskStore(tmp_path / "f", 10)
    real = os.scandir

    def refused(path="."):
        if str(path) == str(tmp_path / "d"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    (tmp_path / "d").mkdir()
    monkeypatch.setattr(disk.os, "scandir", refused)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'd'}.*cannot list"):
        DiskStore(tmp_path / "d", 10)


@pytest.mark.parametrize("junk", ["file", "symlink"])
def test_a_put_that_cannot_be_written_evicts_nothing(tmp_path, junk):
    """A put evicts for its value only once the value is written, just before renaming it into place: one that
    fails (something not a directory in its subdirectory's place: a file, a symlink) costs no value its place."""
    store = DiskStore(tmp_path, 1000)
    keys = [b"k%d" % i for i in range(10)]
    assert _put(store, keys, 100).ok
    key = next(b"x%d" % i for i in range(1000) if not (tmp_path / _name(b"x%d" % i)[:2]).exists())
    in_the_way = tmp_path / _name(key)[:2]
    if junk == "file":
        in_the_way.write_bytes(b"")
    else:
        in_the_way.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    result = _put(store, [key], 100)
    assert result.failed == (0,) and str(in_the_way) in result.error
    assert store.counters["evicted"] == 0 and store.contains(keys) == 10 and store.used_bytes == 1000
    in_the_way.unlink()
    assert _put(store, [key], 100).ok and store.counters["evicted"] == 1 and store.contains(keys[1:]) == 9
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("meets", ["contains", "get of its new size", "get of its old size"])
def test_a_value_another_process_rewrote_at_another_size_is_counted_at_its_size(tmp_path, meets):
    """Another process (a second store: they share nothing but the directory) rewrites an indexed key at another
    size: whatever first meets the file corrects ``used_bytes`` to the bytes on disk, and the capacity holds."""
    one, two = DiskStore(tmp_path, 1000), DiskStore(tmp_path, 10_000)
    assert _put(one, [b"k"], 100).ok and _put(one, [b"old"], 100).ok
    assert _put(two, [b"k"], 900).ok
    if meets == "contains":
        assert one.contains([b"k"]) == 1
    else:
        result, _ = _get(one, [b"k"], 900 if meets == "get of its new size" else 100)
        assert result.ok == (meets == "get of its new size")
    assert one.used_bytes == 1000 and one.contains([b"old", b"k"]) == 2
    one.check_invariants()
    assert _put(one, [b"new"], 100).ok  # room is made for what is really on disk
    assert one.used_bytes == sum(p.stat().st_size for p in tmp_path.glob("??/*.kvb")) <= 1000
    one.check_invariants()
    one.close()
    two.close()


def test_a_get_counts_the_file_its_name_leads_to_once_read(tmp_path, monkeypatch):
    """Another process rewrites the value at another size while a get reads the old file: the get serves the
    old bytes, whole, and the index counts the new file."""
    store = DiskStore(tmp_path, 1000)
    assert _put(store, [b"k"], 100).ok
    final, real = store._file(_name(b"k")), disk._read_all

    def rewritten_meanwhile(fd, parts):
        final.with_name("other").write_bytes(b"n" * 900)
        os.replace(final.with_name("other"), final)
        return real(fd, parts)

    monkeypatch.setattr(disk, "_read_all", rewritten_meanwhile)
    result, (buffer,) = _get(store, [b"k"], 100)
    assert result.ok and buffer == bytes(100) and store.used_bytes == 900
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("call", ["contains", "get"])
def test_a_look_at_a_file_never_undoes_a_rewrite_this_store_made_meanwhile(tmp_path, monkeypatch, call):
    """contains or get looks at a file while one of the store's own threads rewrites it at another size: the
    look and the index update are one step, so the index keeps the rewrite's size."""
    store = DiskStore(tmp_path, 10_000)
    assert _put(store, [b"k"], 100).ok
    real, rewrites = disk._status, []

    def rewritten_meanwhile(filename, folder):
        found = real(filename, folder)
        if not rewrites:
            rewrites.append(store.put([b"k"], [[memoryview(bytes(900))]]))
            store.poll(rewrites, 0.5)  # lands now unless the look holds the index
        return found

    monkeypatch.setattr(disk, "_status", rewritten_meanwhile)
    if call == "contains":
        assert store.contains([b"k"]) == 1
    else:
        _get(store, [b"k"], 100)
    store.poll(rewrites, 5.0)
    assert store.used_bytes == store._file(_name(b"k")).stat().st_size == 900
    store.check_invariants()
    store.close()


def test_contains_opens_each_subdirectory_once_per_call_and_closes_it(tmp_path, monkeypatch):
    """A batch looks at its keys' files through one descriptor per subdirectory, all closed when it answers."""
    store, keys = DiskStore(tmp_path, 1 << 20), [b"k%d" % i for i in range(300)]
    assert _put(store, keys, 10).ok
    real, opened = os.open, []

    def counted(path, flags, *args, **kwargs):
        opened.append(path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(disk.os, "open", counted)
    before = len(os.listdir("/proc/self/fd"))
    assert store.contains(keys) == 300
    assert sorted(opened) == sorted({str(store._file(_name(k)).parent) for k in keys})
    assert len(os.listdir("/proc/self/fd")) == before
    store.close()


@pytest.mark.parametrize("code", ["EIO", "EROFS"])
def test_a_rewrite_whose_rename_fails_keeps_the_old_value_counted(tmp_path, monkeypatch, code):
    """A rename refused (an I/O error, a file system gone read-only) leaves the old value in place: the put
    fails, quoting the path, and the index still counts the file on disk."""
    store = DiskStore(tmp_path, 1000)
    assert _put(store, [b"k"], 100).ok

    def refused(*args, **kwargs):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(disk.os, "replace", refused)
    result = _put(store, [b"k"], 300)
    assert result.failed == (0,) and str(store._file(_name(b"k"))) in result.error
    assert store.used_bytes == store._file(_name(b"k")).stat().st_size == 100
    assert not list(tmp_path.glob("??/*.tmp-*"))
    store.check_invariants()
    store.close()


def test_a_value_another_process_deleted_is_no_longer_counted(tmp_path):
    """contains finds that another process evicted an indexed value: it answers absent and forgets its bytes."""
    one, two = DiskStore(tmp_path, 1000), DiskStore(tmp_path, 1000)
    assert _put(one, [b"k"], 100).ok and two.contains([b"k"]) == 1
    assert two.drop(b"k")
    assert one.contains([b"k"]) == 0 and one.used_bytes == 0
    one.check_invariants()
    one.close()
    two.close()


_NO_DESCRIPTORS = """
import json, os, resource, sys
from kvkit.backends.blockstore.disk import DiskStore
from kvkit.testing.limits import hold_every_descriptor
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
store, keys, report = DiskStore(sys.argv[1], 10 * 1000), [b"k%d" % i for i in range(10)], {}
value = [[memoryview(bytes(1000))]] * 10
report["put"] = store.poll([store.put(keys, value)], 10.0)[0].ok
held, report["exhausted"] = hold_every_descriptor()
report["contains"] = [store.contains([k]) for k in keys]
(result,) = store.poll([store.get(keys[:1], [[memoryview(bytearray(1000))]])], 10.0)
report["get_error"], report["used"] = result.error, store.used_bytes
for fd in held:
    os.close(fd)
report["contains_after"] = store.contains(keys)
report["put_more"] = store.poll([store.put([b"n%d" % i for i in range(10)], value)], 10.0)[0].ok
report["files"] = sum(len(files) for _, _, files in os.walk(sys.argv[1]))
store.check_invariants()
store.close()
print(json.dumps(report))
"""


def test_a_look_that_fails_for_want_of_descriptors_changes_nothing(tmp_path):
    """A process out of file descriptors (EMFILE, a real limit): contains answers 0 and get fails, quoting the
    path, but the index keeps what it holds, so the capacity still bounds the files on disk once they are back."""
    done = subprocess.run([sys.executable, "-c", _NO_DESCRIPTORS, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["put"] and report["exhausted"] == errno.EMFILE
    assert report["contains"] == [0] * 10 and str(tmp_path) in report["get_error"], report
    assert report["used"] == 10_000 and report["contains_after"] == 10, report
    assert report["put_more"] and report["files"] == 10, report


_EVICTING_WITHOUT_DESCRIPTORS = """
import json, os, resource, sys
from kvkit.backends.blockstore.disk import DiskStore, _name
from kvkit.testing.limits import hold_every_descriptor
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
root, report = sys.argv[1], {}
store, value = DiskStore(root, 10 * 1000), [memoryview(bytes(1000))]
report["full"] = store.poll([store.put([b"k%d" % i for i in range(11)], [value] * 11)], 10.0)[0].ok
neighbour = _name(b"neighbour")  # a value another process wrote since the store looked
os.makedirs(os.path.join(root, neighbour[:2]), exist_ok=True)
with open(os.path.join(root, neighbour[:2], neighbour + ".kvb"), "wb") as f:
    f.write(bytes(1000))
held, report["exhausted"] = hold_every_descriptor()
result = store.poll([store.put([b"new"], [value])], 10.0)[0]
report["put"], report["put_error"] = result.ok, result.error
os.close(held.pop())  # one descriptor: enough for contains to look, none to evict with
report["contains"] = store.contains([b"neighbour"])
report["used"], report["evicted"] = store.used_bytes, store.counters["evicted"]
store.check_invariants()
for fd in held:
    os.close(fd)
report["contains_after"] = store.contains([b"neighbour"])
report["put_after"] = store.poll([store.put([b"m%d" % i for i in range(5)], [value] * 5)], 10.0)[0].ok
report["on_disk"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
report["used_after"] = store.used_bytes
store.check_invariants()
store.close()
print(json.dumps(report))
"""


def test_a_victim_that_cannot_be_deleted_for_want_of_descriptors_stays_counted(tmp_path):
    """A process out of file descriptors (EMFILE, a real limit) cannot delete a victim: the victim stays indexed
    and the eviction ends, so the put that needed the room fails and a neighbour's file a contains found is not
    adopted (a miss). Forgetting the victim instead would leave its bytes on disk uncounted: the directory
    would hold more than the capacity once descriptors are back."""
    done = subprocess.run([sys.executable, "-c", _EVICTING_WITHOUT_DESCRIPTORS, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["full"] and report["exhausted"] == errno.EMFILE, report
    assert not report["put"] and "Too many open files" in report["put_error"], report
    assert report["contains"] == 0 and report["used"] == 10_000 and report["evicted"] == 1, report
    assert report["contains_after"] == 1 and report["put_after"], report
    assert report["on_disk"] == report["used_after"] == 10_000, report


_FILE_SIZE_LIMIT = """
import json, os, resource, signal, sys
from kvkit.backends.blockstore.disk import DiskStore
signal.signal(signal.SIGXFSZ, getattr(signal, sys.argv[2]))  # SIG_DFL: writing past the limit kills the process
resource.setrlimit(resource.RLIMIT_FSIZE, (5000, resource.RLIM_INFINITY))
store, keys, report = DiskStore(sys.argv[1], 10 * 1000), [b"k%d" % i for i in range(10)], {}
report["full"] = store.poll([store.put(keys, [[memoryview(bytes(1000))]] * 10)], 10.0)[0].ok
result = store.poll([store.put([b"big"], [[memoryview(bytes(8000))]])], 10.0)[0]
report["big"], report["error"] = result.ok, result.error
report["at_limit"] = store.poll([store.put([b"five"], [[memoryview(bytes(5000))]])], 10.0)[0].ok
report["kept"], report["evicted"] = store.contains(keys[5:]), store.counters["evicted"]
report["files"] = sorted(f for _, _, files in os.walk(sys.argv[1]) for f in files if ".tmp-" in f)
store.check_invariants()
store.close()
print(json.dumps(report))
"""


@pytest.mark.parametrize("handler", ["SIG_IGN", "SIG_DFL"])
def test_a_value_past_the_file_size_limit_fails_before_anything_is_evicted_or_written(tmp_path, handler):
    """A value larger than the process's file size limit (RLIMIT_FSIZE, a real limit) can never land: its put
    fails naming the limit before it evicts a value or writes a byte (writing past the limit raises SIGXFSZ,
    which kills a process that does not ignore it, or fails with EFBIG); a value at the limit lands, evicting
    only what it needs."""
    done = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, str(tmp_path), handler], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    report = json.loads(done.stdout)
    assert report["full"] and not report["big"], report
    assert "8000 bytes exceeds this process's file size limit of 5000 (RLIMIT_FSIZE)" in report["error"], report
    assert report["at_limit"] and report["evicted"] == 5 and report["kept"] == 5, report
    assert report["files"] == [], report


_REAPING_WITHOUT_DESCRIPTORS = """
import json, os, resource, sys
from kvkit.backends.blockstore.disk import DiskStore, _name
from kvkit.errors import ConfigError
from kvkit.testing.limits import hold_every_descriptor
root, outcomes = sys.argv[1], []
store = DiskStore(root, 1 << 20)
store.poll([store.put([b"k"], [[memoryview(bytes(10))]])], 10.0)
store.close()
name = _name(b"k")
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
for free in range(1, 7):  # descriptors left: too few to list, enough to list but not to examine a file, enough
    open(os.path.join(root, name[:2], f"{name}.kvb.tmp-gone-{free}"), "wb").close()  # a writer gone
    held, _ = hold_every_descriptor()
    for fd in held[len(held) - free:]:
        os.close(fd)
    del held[len(held) - free:]
    try:
        store = DiskStore(root, 1 << 20)
        outcomes.append(["opened", store.counters["broken"], store.counters["temps_removed"], store.used_bytes])
        store.close()
    except ConfigError as exc:
        outcomes.append(["ConfigError", str(exc)])
    for fd in held:
        os.close(fd)
print(json.dumps(outcomes))
"""


def test_opening_without_a_descriptor_to_examine_a_temporary_file_is_a_config_error_not_a_broken_count(tmp_path):
    """A process with descriptors enough to list a subdirectory but not to open a temporary file in it (a real
    limit) cannot tell whether its writer is gone: opening raises ConfigError quoting the file, as for any
    entry it cannot look into, never counting it broken; with descriptors enough, the temporary files of
    writers gone are removed."""
    done = subprocess.run([sys.executable, "-c", _REAPING_WITHOUT_DESCRIPTORS, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = json.loads(done.stdout)
    refusals = [outcome[1] for outcome in outcomes if outcome[0] == "ConfigError"]
    assert all("Too many open files" in refusal for refusal in refusals), outcomes
    assert any(".kvb.tmp-gone-" in refusal for refusal in refusals), outcomes  # the temporary file, quoted
    opened = [outcome[1:] for outcome in outcomes if outcome[0] == "opened"]
    assert opened and all(broken == 0 and used == 10 for broken, _, used in opened), outcomes
    assert opened[0][1] > 1, outcomes  # the first open that could examine them removed every one left


@pytest.mark.parametrize("found", ["when opening", "by contains", "by get"])
def test_a_value_file_larger_than_the_capacity_is_left_alone_and_evicts_nothing(tmp_path, found):
    """A file named as a value but larger than the capacity (a neighbour's with a larger capacity, a planted one)
    can never be held: it is counted (``oversized``), never indexed or deleted, and costs no other value its place."""
    store = DiskStore(tmp_path, 1000)
    assert _put(store, [b"a", b"b"], 100).ok
    sub, file = _sub(tmp_path, b"huge")
    with open(sub / file, "wb") as huge:
        huge.truncate(1 << 40)  # sparse: a terabyte named as a value, newer than every real one
    if found == "when opening":
        store.close()
        store = DiskStore(tmp_path, 1000)
    elif found == "by contains":
        assert store.contains([b"huge"]) == 1
    else:
        result, _ = _get(store, [b"huge"], 100)
        assert result.failed == (0,) and "value of 1099511627776 bytes" in result.error
    assert store.counters["oversized"] == 1 and store.counters["evicted"] == 0
    assert store.contains([b"a", b"b"]) == 2 and store.used_bytes == 200 and (sub / file).exists()
    store.check_invariants()
    store.close()


# --- permissions ---------------------------------------------------------------

def _modes(root):
    files = {oct(p.stat().st_mode & 0o777) for p in root.rglob("*") if p.is_file()}
    dirs = {oct(p.stat().st_mode & 0o777) for p in [root, *root.rglob("*")] if p.is_dir()}
    return files, dirs


_SWAPPER = """
import json, os, sys
from kvkit.backends.blockstore.disk import DiskStore
from kvkit.errors import ConfigError
target, victim, made = sys.argv[1], sys.argv[2], []

def swap(event, args):  # the neighbour's move, at the store's first step on the directory it has just made
    path = os.fspath(args[0]) if args and isinstance(args[0], str | os.PathLike) else None
    if event == "os.mkdir" and path == target:
        made.append(path)
    elif made and path == target and event in ("open", "os.chmod"):
        made.clear()
        os.rmdir(target)
        os.symlink(victim, target)

sys.addaudithook(swap)  # for the rest of this process: hence a process of its own
try:
    DiskStore(target, 1000).close()
    error = None
except ConfigError as exc:
    error = str(exc)
print(json.dumps({"error": error, "victim": os.stat(victim).st_mode & 0o777}))
"""


def test_a_directory_swapped_for_a_symlink_as_it_is_made_lends_no_mode_to_what_it_names(tmp_path):
    """A neighbour swaps the directory the store has just made (``path``, in a directory the neighbour may
    write) for a symlink to a file of the user's before its mode is set: setting the mode through the symlink
    would turn a ``0o644`` file ``0o700``. The symlink is never followed: opening is a ConfigError quoting the
    path, and the file keeps its mode."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's")
    victim.chmod(0o644)
    target = tmp_path / "shared" / "kv"
    done = subprocess.run([sys.executable, "-c", _SWAPPER, str(target), str(victim)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["victim"] == 0o644, oct(report["victim"])
    assert report["error"] and str(target) in report["error"], report
    assert target.is_symlink() and victim.read_bytes() == b"the user's"


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_values_are_private_whatever_the_umask(tmp_path, umask):
    """Files 0600 and directories 0700 by default, under any umask: the store's own, and those created above it."""
    old = os.umask(umask)
    try:
        store = DiskStore(tmp_path / "new" / "kv", 1 << 20)
        _put(store, [b"a", b"b"], 10)
        store.close()
    finally:
        os.umask(old)
    assert _modes(tmp_path / "new") == ({"0o600"}, {"0o700"})


def test_a_umask_that_takes_the_owners_read_bit_leaves_puts_working_and_modes_exact():
    """Under umask 0o477 a process that is not root (root, who reads any directory, runs it as ``nobody``) puts and
    gets its values, and the files are 0600 and the directories 0700 all the same: a directory the store made is
    reached without its owner's read bit never missing."""
    where = tempfile.mkdtemp()  # in a directory every user may search: ``nobody`` reaches it
    try:
        if os.geteuid() == 0:
            os.chown(where, 65534, 65534)

        def child():
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            os.umask(0o477)
            store = DiskStore(os.path.join(where, "new", "kv"), 1 << 20)
            put = _put(store, [b"a", b"b"], 10)
            got, buffers = _get(store, [b"a", b"b"], 10)
            store.close()
            return [put.failed, put.error, got.failed, [bytes(b).hex() for b in buffers]]

        assert in_child(child)() == [[], "", [], [(bytes([0]) * 10).hex(), (bytes([1]) * 10).hex()]]
        files, dirs = _modes(pathlib.Path(where, "new"))
        assert (files, dirs) == ({"0o600"}, {"0o700"})
    finally:
        shutil.rmtree(where)


def test_file_mode_is_configurable_also_in_the_url(tmp_path):
    """file_mode=640 (octal, in a URL too) gives files 0640 and directories 0750; an existing path keeps its mode."""
    old = os.umask(0o077)
    try:
        store = open_block_store(f"file://{tmp_path}/kv?capacity_bytes=1MiB&file_mode=640")
        assert store.file_mode == 0o640
        _put(store, [b"a"], 10)
        store.close()
    finally:
        os.umask(old)
    assert _modes(tmp_path / "kv") == ({"0o640"}, {"0o750"})
    os.chmod(tmp_path / "kv", 0o711)
    DiskStore(tmp_path / "kv", 1 << 20).close()
    assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o711


@pytest.mark.parametrize("mode", ["rw", "800", 0o1600, 0o400, -1, True, 1.5])
def test_a_bad_file_mode_is_refused(tmp_path, mode):
    """Modes that are not permission bits, or lock the owner out, raise ConfigError quoting them."""
    with pytest.raises(ConfigError, match="file_mode"):
        DiskStore(tmp_path, 10, file_mode=mode)


# --- a full file system -----------------------------------------------------------

def _fill(store, n, size=_VALUE):
    """Put ``n`` values one by one; answer the results that failed."""
    failed = []
    for i in range(n):
        result = _put(store, [b"fill-%d" % i], size)
        if not result.ok:
            failed.append(result.error)
    return failed


def _budget(monkeypatch, root, budget, code):
    """Make the file system under ``root`` hold ``budget`` bytes (simulated: a write past it fails with ``code``,
    ENOSPC or EDQUOT); answer a function giving the bytes on it."""
    real = os.writev

    def on_disk():
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())

    def writev(fd, buffers):
        if on_disk() + sum(memoryview(b).nbytes for b in buffers) > budget:
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return real(fd, buffers)

    def statvfs(path):  # a quota leaves the file system's free space as it was
        return types.SimpleNamespace(f_frsize=1, f_bavail=budget - on_disk() if code == "ENOSPC" else 1 << 40)

    monkeypatch.setattr(os, "writev", writev)
    monkeypatch.setattr(os, "statvfs", statvfs)
    return on_disk


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT"])
def test_a_full_file_system_is_relieved_by_eviction(tmp_path, monkeypatch, code):
    """A file system smaller than capacity_bytes (simulated: writes past a budget fail with ENOSPC or EDQUOT)."""
    budget = 10 * _VALUE + _VALUE // 2
    on_disk = _budget(monkeypatch, tmp_path, budget, code)
    store = DiskStore(tmp_path, 1 << 30)
    assert _fill(store, 30) == []
    assert store.counters["disk_full"] >= 1 and store.used_bytes <= budget and on_disk() <= budget
    result, (buffer,) = _get(store, [b"fill-29"], _VALUE)
    assert result.ok and buffer == bytes([0]) * _VALUE
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT"])
def test_a_file_system_a_neighbour_filled_is_relieved_by_evicting_its_values(tmp_path, monkeypatch, code):
    """A store opened before a neighbour filled the file system with values it never indexed: once nothing of
    its own is left to evict, it adopts the directory's values and evicts them, so its puts land."""
    budget = 10 * _VALUE + _VALUE // 2
    on_disk = _budget(monkeypatch, tmp_path, budget, code)
    store, neighbour = DiskStore(tmp_path, 1 << 30), DiskStore(tmp_path, 1 << 30)
    assert _fill(neighbour, 12) == []
    neighbour.close()
    assert [_put(store, [b"own-%d" % i], _VALUE).error for i in range(8)] == [""] * 8
    assert store.counters["disk_full"] >= 1 and store.counters["evicted"] >= 8 and on_disk() <= budget
    result, (buffer,) = _get(store, [b"own-7"], _VALUE)
    assert result.ok and buffer == bytes(_VALUE)
    assert store.used_bytes == on_disk() and store.contains([b"own-%d" % i for i in range(8)]) == 8
    store.check_invariants()
    store.close()


def _mount_tmpfs(where, options):
    """Mount a real tmpfs with ``options`` (``"size=2m"``) at ``where`` (needs root and a sandbox that allows it);
    skip otherwise."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.fixture
def small_fs(tmp_path):
    """A real 2 MiB tmpfs, unmounted afterwards; ``remount(*options)`` changes its options (``"ro"``)."""
    where = tmp_path / "mnt"
    _mount_tmpfs(where, "size=2m")

    def remount(*options):
        subprocess.run(["mount", "-o", ",".join(["remount", *options]), str(where)], check=True)

    yield where, remount
    subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.fixture
def roomy_fs(tmp_path):
    """A real 64 MiB tmpfs, unmounted afterwards."""
    where = tmp_path / "tmpfs"
    _mount_tmpfs(where, "size=64m")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


_REWRITER = """
import contextlib, os, sys
folder, names = sys.argv[1], sys.argv[2:]
while True:  # as neighbours evict values and put them again: deleted, then a new file renamed into place
    for name in names:
        fd = os.open(os.path.join(folder, name + ".staged"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, bytes(10))
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, name + ".kvb"))
        os.replace(os.path.join(folder, name + ".staged"), os.path.join(folder, name + ".kvb"))
"""

_OPENER = """
import json, os, sys, time
from kvkit.backends.blockstore.disk import DiskStore
path, seconds = sys.argv[1], float(sys.argv[2])
report, deadline = {"opens": 0, "broken": None}, time.monotonic() + seconds
while report["broken"] is None and time.monotonic() < deadline:
    store = DiskStore(path, 1 << 20, threads=1)
    report["opens"] += 1
    try:
        store.check_invariants()
    except AssertionError as exc:
        report["broken"] = f"{exc} (used_bytes {store.used_bytes}, {len(store.eviction)} tracked)"
        ticket = store.put([b"big"], [[memoryview(bytes((1 << 20) - 100))]])  # evicts nearly every value
        if not store.poll([ticket], 10.0):
            report["broken"] += "; a put that evicts never answered"
            print(json.dumps(report), flush=True)
            os._exit(0)  # its thread spins on, holding the store's lock: close would wait forever
    store.close()
print(json.dumps(report), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_value_listed_twice_by_a_directory_read_during_rewrites_is_indexed_once(roomy_fs):
    """A directory read while another process evicts and puts values in it may name a file twice (on tmpfs a
    file made again is listed anew at the end). Indexed twice, it would be counted twice and leave the policy
    a block the index lost, which the first evicting put would pick forever, holding the lock (that put never
    answered, every contains hung). Each name is indexed once: every open keeps the invariants. A race: a
    loaded machine may run the two processes apart, so the opener tries for 12 s."""
    path = roomy_fs / "kv"
    folder = path / "ab"
    folder.mkdir(parents=True)
    names = [f"ab{i:062x}" for i in range(3000)]  # enough for a listing to take many reads of the directory
    for name in names:
        (folder / f"{name}.kvb").write_bytes(bytes(10))
    rewriter = subprocess.Popen([sys.executable, "-c", _REWRITER, str(folder), *names])
    try:
        done = subprocess.run([sys.executable, "-c", _OPENER, str(path), "12"], capture_output=True, text=True,
                              timeout=90)
    finally:
        rewriter.kill()
        rewriter.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["broken"] is None and report["opens"] >= 5, report


def test_a_real_full_file_system_is_relieved_and_its_space_reused(small_fs):
    """capacity_bytes far above a 2 MiB tmpfs: every put lands, and space freed by others is used again."""
    where, _ = small_fs
    filler = where / "filler"
    filler.write_bytes(bytes(1 << 20))  # someone else's half of the file system
    store = DiskStore(where / "kv", 1 << 30)
    assert _fill(store, 40) == []
    lowered = store.effective_capacity_bytes
    assert store.counters["disk_full"] >= 1 and lowered <= 1 << 20 and store.used_bytes <= lowered
    filler.unlink()
    assert _fill(store, 40) == []
    assert store.effective_capacity_bytes > lowered + (1 << 19) and store.used_bytes > lowered
    store.check_invariants()
    too_big = _put(store, [b"huge"], 3 << 20)
    assert too_big.failed == (0,) and "capacity" in too_big.error
    store.close()


def test_a_real_file_system_a_neighbour_process_filled_is_relieved(small_fs):
    """A real 2 MiB tmpfs filled by another process's store after this one opened: this store's puts land."""
    where, _ = small_fs
    store = DiskStore(where / "kv", 1 << 30)
    fill = f"""
from kvkit.backends.blockstore.disk import DiskStore
store = DiskStore({str(where / "kv")!r}, 1 << 30)
for i in range(40):
    store.poll([store.put([b"theirs-%d" % i], [[memoryview(bytes({_VALUE}))]])], 10.0)
assert store.counters["disk_full"] >= 1
store.close()
"""
    subprocess.run([sys.executable, "-c", fill], check=True, timeout=60)
    assert _fill(store, 8) == [] and store.counters["disk_full"] >= 1
    store.check_invariants()
    store.close()


def test_a_file_system_out_of_inodes_is_relieved_also_of_empty_subdirectories(tmp_path):
    """A file system that runs out of inodes (ENOSPC, with bytes free): evicting values frees theirs, and once
    none is left the empty subdirectories the store made give theirs back, so every put still lands."""
    where = tmp_path / "mnt"
    _mount_tmpfs(where, "size=2m,nr_inodes=24")
    try:
        store = DiskStore(where / "kv", 1 << 30)
        assert _fill(store, 100, size=1000) == []  # the keys' subdirectories alone outnumber the inodes
        assert store.counters["disk_full"] >= 1 and store.used_bytes > 0
        result, (buffer,) = _get(store, [b"fill-99"], 1000)
        assert result.ok and buffer == bytes(1000)
        store.check_invariants()
        store.close()
        shutil.rmtree(where / "kv")
        store = DiskStore(where / "kv", 1 << 30)
        for i in range(100):  # others take every inode but one: a subdirectory fits, its file never does
            try:
                (where / f"other-{i}").write_bytes(b"")
            except OSError:
                break
        (where / "other-0").unlink()
        refused = _put(store, [b"x-%d" % i for i in range(3)], 1000)
        assert refused.failed == (0, 1, 2) and "nothing is left to evict" in refused.error
        store.check_invariants()
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_read_only_file_system_opens_serves_and_refuses_puts(small_fs):
    """On a read-only file system a stale temporary file and an over-capacity start are counted, not raised."""
    where, remount = small_fs
    store = DiskStore(where / "kv", 1 << 20)
    _put(store, [b"a", b"b"], 100)
    store.close()
    temp = _temp_of(where / "kv", b"a")
    temp.write_bytes(b"half")
    remount("ro")
    smaller = DiskStore(where / "kv", 100)
    assert smaller.counters["temps_kept"] == 1 and smaller.counters["unlink_failed"] == 1 and temp.exists()
    smaller.close()
    store = DiskStore(where / "kv", 1 << 20)
    result, (buffer,) = _get(store, [b"b"], 100)
    assert result.ok and buffer == bytes([1]) * 100
    refused = _put(store, [b"c"], 100)
    assert refused.failed == (0,) and "Read-only file system" in refused.error and str(where / "kv") in refused.error
    store.close()


# --- two processes on one directory ---------------------------------------------

_WRITER = """
import json, sys, time
from kvkit.backends.blockstore.disk import DiskStore
path, seconds, size = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
store = DiskStore(path, 24 * size)
value, puts, failed, errors, i = memoryview(bytes(size)), 0, 0, set(), 0
print("ready", flush=True)
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    keys = [b"w%d" % (i + j) for j in range(4)]
    i += 4
    ticket = store.put(keys, [[value]] * 4)
    for result in store.poll([ticket], 10.0):
        failed += len(result.failed)
        errors.update([result.error] if result.failed else [])
    puts += 4
    store.poll([store.get(keys[:1], [[memoryview(bytearray(size))]])], 10.0)
store.check_invariants()
store.close()
print(json.dumps({"puts": puts, "failed": failed, "errors": sorted(errors)}), flush=True)
"""


def _race(path, opener=DiskStore):
    """One process puts and evicts for 2 s while this one opens ``opener`` stores, reads and evicts.

    Answers (opens, crashes of this process's stores, the writer's report). Bounded: the writer is killed
    after a minute.
    """
    size = 1 << 18
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), "2.0", str(size)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        opens, crashes, deadline = 0, [], time.monotonic() + 60
        while writer.poll() is None and time.monotonic() < deadline:
            try:
                store = opener(path, 8 * size, threads=1)  # smaller than the writer's: opening evicts too
                try:
                    store.contains([b"w%d" % k for k in range(0, 400, 7)])
                    _get(store, [b"w%d" % k for k in range(0, 400, 13)], size)
                    store.check_invariants()
                finally:
                    store.close()
                opens += 1
            except Exception as exc:  # noqa: BLE001 - every crash is collected and reported below
                crashes.append(f"{type(exc).__name__}: {exc}")
        out, _ = writer.communicate(timeout=60)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == 0, f"the writer process crashed ({writer.returncode})"
    return opens, crashes, json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_two_processes_open_write_and_evict_one_directory(tmp_path):
    """A process putting and evicting, and another opening, reading and evicting: no crash, no failed put."""
    opens, crashes, writer = _race(tmp_path)
    assert opens >= 10, f"only {opens} opens ran: the race was not exercised"
    assert crashes == [], f"{len(crashes)} of {opens + len(crashes)} opens crashed: {crashes[:3]}"
    assert writer["puts"] >= 40 and writer["failed"] == 0, writer


_NEIGHBOUR = """
import hashlib, json, os, random, sys, time
from kvkit.backends.blockstore.disk import DiskStore
from kvkit.errors import KVKitError
path, me, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
rng, keys, sizes = random.Random(me), [b"k%d" % i for i in range(24)], (3000, 8000, 20000)

def value(key, writer, size):  # says who wrote it: any writer's value for the key, of any size, is right
    return (hashlib.sha256(b"%s/%d/%d" % (key, writer, size)).digest() * (size // 32 + 1))[:size]

report = {"puts": 0, "put_failed": [], "hits": 0, "wrong": 0, "raised": [], "opens": 0}
store = DiskStore(path, 100_000)
print("ready", flush=True)
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    batch, op = rng.sample(keys, 3), rng.random()
    try:
        if op < 0.45:
            ticket = store.put(batch, [[memoryview(value(k, me, rng.choice(sizes)))] for k in batch])
            report["put_failed"] += [r.error for r in store.poll([ticket], 10.0) if r.failed]
            report["puts"] += 3
        elif op < 0.9:
            store.contains(batch)
            buffers = [bytearray(rng.choice(sizes)) for _ in batch]
            (result,) = store.poll([store.get(batch, [[memoryview(b)[:7], memoryview(b)[7:]] for b in buffers])],
                                   10.0)
            for i, (key, buffer) in enumerate(zip(batch, buffers)):
                if i not in result.failed:
                    report["hits"] += 1
                    report["wrong"] += all(buffer != value(key, w, len(buffer)) for w in range(n))
        elif op < 0.95:
            store.drop(batch[0])
        else:
            store.check_invariants()
            store.close()
            store = DiskStore(path, rng.choice([40_000, 100_000]), threads=rng.choice([1, 2]))
            report["opens"] += 1
    except Exception as exc:  # every exception is reported, typed or not
        report["raised"].append(f"{type(exc).__name__}: {exc}")
def wait_for(flag, count=1):
    while len([f for f in os.listdir(os.path.join(path, "..")) if f.startswith(flag)]) < count:
        time.sleep(0.01)

open(os.path.join(path, "..", f"done-{me}"), "w").close()
wait_for("done-", n)  # all still: process 0 rewrites every key at another size, then each store meets them all
if me == 0:
    ticket = store.put(keys, [[memoryview(value(k, me, 1000))] for k in keys])
    report["put_failed"] += [r.error for r in store.poll([ticket], 10.0) if r.failed]
    open(os.path.join(path, "..", "rewritten"), "w").close()
wait_for("rewritten")
found = [store.contains([k]) for k in keys]  # may adopt files past capacity, and evict some of them
open(os.path.join(path, "..", f"checked-{me}"), "w").close()
wait_for("checked-", n)  # every store's evictions done: a second look forgets what others evicted, evicts nothing
found = [store.contains([k]) for k in keys]
on_disk = sum(os.stat(f).st_size if os.path.exists(f) else 0 for f in map(store._file, store._index))
report.update(used=store.used_bytes, on_disk=on_disk, capacity=store.effective_capacity_bytes)
store.check_invariants()
store.close()
print(json.dumps(report), flush=True)
"""


@pytest.mark.timeout(300)
def test_three_processes_put_get_drop_and_reopen_one_directory(tmp_path):
    """Three processes put (each key at changing sizes), get, drop, close and reopen stores on one directory
    for 2 s: nothing raises, every value read is byte for byte one some process wrote for its key, and once
    all are still each store's used_bytes is the bytes its indexed files hold, within its capacity."""
    path, n = tmp_path / "kv", 3
    path.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, str(path), str(me), str(n), "2.0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for me in range(n)]
    try:
        outs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert [proc.returncode for proc in procs] == [0] * n, [err[-2000:] for _, err in outs]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    for report in reports:
        assert report["raised"] == [] and report["put_failed"] == [] and report["wrong"] == 0, report
        assert report["hits"] > 0 and report["puts"] > 0, report
        assert report["used"] == report["on_disk"] <= report["capacity"], report


class _StatsUnguarded(DiskStore):
    """Planted regression: the scan stats each listed file as if no other process could evict it."""

    def _regular(self, filename, folder):
        time.sleep(0.001)  # the window between listing and looking, widened so one run shows it
        return os.stat(filename, dir_fd=folder)


class _ReapsEverything(DiskStore):
    """Planted regression: start-up deletes every temporary file, whoever is writing it."""

    def _reap(self, filename, folder):
        os.unlink(filename, dir_fd=folder)


@pytest.mark.timeout(300)
def test_the_two_process_race_catches_a_planted_crash(tmp_path):
    """The race test fails on a store whose scan crashes on a file evicted mid-scan."""
    _, crashes, _ = _race(tmp_path, opener=_StatsUnguarded)
    assert any("FileNotFoundError" in crash for crash in crashes), crashes[:3]


@pytest.mark.timeout(300)
def test_the_two_process_race_catches_a_reaped_live_write(tmp_path):
    """The race test fails on a store whose start-up deletes a live writer's temporary files.

    An open meets a temporary file only while the writer writes one, a few times a second: the race runs
    again, at most three times, until a put has failed.
    """
    reports = []
    while len(reports) < 3 and not any(writer["failed"] for writer in reports):
        reports.append(_race(tmp_path / str(len(reports)), opener=_ReapsEverything)[2])
    assert reports[-1]["failed"] > 0, reports


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT"])
@pytest.mark.parametrize("undeletable", [4, 2])
def test_a_full_file_system_whose_values_cannot_be_deleted_never_spins(tmp_path, monkeypatch, code, undeletable):
    """A full file system holding values this store may not delete (another user's, immutable, under a
    read-only bind mount): evicting one frees nothing, so eviction goes on past it. With none deletable the
    put fails at once, quoting the refusal, and never spins re-adopting the same files; with the oldest two
    undeletable the next ones go and the put lands."""
    budget = 4 * _VALUE + _VALUE // 2
    _budget(monkeypatch, tmp_path, budget, code)
    neighbour = DiskStore(tmp_path, 1 << 30)
    assert _fill(neighbour, 4) == []
    neighbour.close()
    kept = {f"{_name(b'fill-%d' % i)}.kvb" for i in range(undeletable)}  # the oldest: the first victims
    real = os.unlink

    def unlink(path, *args, **kwargs):
        if os.path.basename(path) in kept:
            raise OSError(errno.EPERM, os.strerror(errno.EPERM), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(disk.os, "unlink", unlink)
    store = DiskStore(tmp_path, 1 << 30)
    ticket = store.put([b"new"], [[memoryview(bytes(_VALUE))]])
    (result,) = store.poll([ticket], 60.0)
    if undeletable == 4:
        assert result.failed == (0,) and os.strerror(getattr(errno, code)) in result.error, result
        assert "nothing is left to evict" in result.error and len(list(tmp_path.glob("??/*.kvb"))) == 4
    else:
        assert result.ok and store.contains([b"new"]) == 1, result
    assert store.counters["unlink_failed"] >= undeletable
    store.check_invariants()
    store.close()


def test_a_value_written_while_another_put_lowered_the_capacity_is_kept_and_evicts_nothing(tmp_path, monkeypatch):
    """Another thread's put that met a full file system lowers the capacity while this put writes its value
    (measured with this value's temporary file on disk but not indexed): the value the file system took is
    indexed and counted, never left on disk untracked as 'oversized', and the values held stay."""
    store = DiskStore(tmp_path, 1 << 20)
    assert _fill(store, 3, size=1000) == []
    real = disk._write_all

    def write_all(fd, parts):
        real(fd, parts)
        with store._lock:  # what _relieve sets: the indexed bytes, the file system's free space not counted
            store._fits = store.used_bytes

    monkeypatch.setattr(disk, "_write_all", write_all)
    assert _put(store, [b"new"], 4000).ok
    monkeypatch.setattr(disk, "_write_all", real)
    assert store.counters["oversized"] == 0 and store.counters["evicted"] == 0, store.counters
    assert store.used_bytes == 7000 and store.contains([b"fill-0", b"fill-1", b"fill-2", b"new"]) == 4
    store.check_invariants()
    store.close()


def test_a_subdirectory_whose_mode_cannot_be_set_leaves_no_descriptor_open(tmp_path, monkeypatch):
    """A file system that refuses chmod (vfat, some network mounts: EPERM) fails the put that made a
    subdirectory, quoting the refusal, and leaves no descriptor of it open."""
    store = DiskStore(tmp_path, 1 << 20)
    real = os.chmod

    def chmod(path, mode, *args, **kwargs):
        if os.path.isdir(path):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(disk.os, "chmod", chmod)
    before = len(os.listdir("/proc/self/fd"))
    refused = _put(store, [b"k%d" % i for i in range(8)], 100)
    assert refused.failed and os.strerror(errno.EPERM) in refused.error, refused
    assert len(os.listdir("/proc/self/fd")) == before
    store.check_invariants()
    store.close()
