"""``DiskStore``: a ``BlockStore`` in a local directory, one file per key, with a capacity limit."""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs

from kvkit.backends.blockstore._common import MAX_WAITING, TicketBox, check_call, check_keys, flat_views
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.errors import ConfigError
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.shared import StoreResult
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import check_bool, check_int, checked, implements, quote

__all__ = ["DiskStore"]

_SUFFIX = ".kvb"
_TEMP = ".tmp-"  # "<name>.tmp-<pid>-<n>": a write not renamed yet


def _path(value: object) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ConfigError(f"DiskStore.path={quote(value)}: must be a directory path")
    return Path(value)


@attrs.define(eq=False)
class DiskStore:
    """A directory of block values: ``<path>/<2 hex>/<sha256(key)>.kvb``, at most ``capacity_bytes``.

    A write goes to a temporary name in the same directory and is renamed
    over the final name (``os.replace``), so a reader sees a whole value or
    none. A new instance re-indexes the directory (the file names are the
    index; sizes and modification times seed the eviction order) and deletes
    temporary files a crashed writer left. Eviction asks ``eviction`` (LRU by
    default) for victims and unlinks them. Work runs on a pool of
    ``threads`` threads; a ``get`` reads with ``os.preadv`` straight into the
    caller's buffers. Files another process adds to the directory are adopted
    when ``contains`` or ``get`` finds them; the capacity holds per process.
    At most ``max_waiting`` finished results wait for the polls naming their
    tickets (one more abandons the oldest).

    Invariants: ``used_bytes`` is the sum of the indexed files' sizes, never
    above ``capacity_bytes``; the policy tracks exactly the indexed keys.
    """

    path: Path = attrs.field(converter=_path)
    capacity_bytes: int = attrs.field(converter=checked(check_int, minimum=1, label="DiskStore."))
    eviction: EvictionPolicy = attrs.field(factory=LRUPolicy, validator=implements(EvictionPolicy, label="DiskStore.", what="an EvictionPolicy instance"))
    threads: int = attrs.field(default=2, converter=checked(check_int, minimum=1, label="DiskStore."))
    fsync: bool = attrs.field(default=False, converter=checked(check_bool, label="DiskStore."))
    """Flush each file to the device before renaming it (survives power loss, costs a sync per value)."""
    max_waiting: int = attrs.field(default=MAX_WAITING, kw_only=True,
                                   converter=checked(check_int, minimum=1, label="DiskStore."))
    used_bytes: int = attrs.field(default=0, init=False)
    closed: bool = attrs.field(default=False, init=False)
    _index: dict[str, tuple[BlockId, int]] = attrs.field(factory=dict, init=False)  # name -> (id, size)
    _names: dict[BlockId, str] = attrs.field(factory=dict, init=False)
    _ids: itertools.count = attrs.field(factory=itertools.count, init=False)
    _temps: itertools.count = attrs.field(factory=itertools.count, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _tickets: TicketBox = attrs.field(init=False, default=attrs.Factory(
        lambda self: TicketBox(self.max_waiting), takes_self=True))
    _pool: ThreadPoolExecutor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"DiskStore.path={str(self.path)!r}: cannot create the directory: {exc}") from exc
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvkit-disk")
        found = []
        for file in self.path.glob(f"??/*{_SUFFIX}*"):
            if _TEMP in file.name:
                file.unlink(missing_ok=True)  # a write that never got renamed
            elif file.name.endswith(_SUFFIX):
                stat = file.stat()
                found.append((stat.st_mtime_ns, file.name[:-len(_SUFFIX)], stat.st_size))
        with self._lock:
            for _, name, size in sorted(found):  # oldest first: the first victims of an LRU
                self._adopt(name, size)  # evicts at once if the capacity is smaller than last time

    def contains(self, keys: Sequence[bytes]) -> int:
        check_keys("DiskStore", self.closed, keys)
        n = 0
        for key in keys:
            if not self._known(_name(key)):
                break
            n += 1
        return n

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview]]) -> int:
        check_call("DiskStore", self.closed, keys, values)
        ticket = self._tickets.issue(len(keys))
        self._pool.submit(self._run, ticket, self._write, list(keys), [flat_views(v) for v in values])
        return ticket

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        check_call("DiskStore", self.closed, keys, buffers)
        ticket = self._tickets.issue(len(keys))
        self._pool.submit(self._run, ticket, self._read, list(keys), [flat_views(b) for b in buffers])
        return ticket

    def poll(self, tickets: Collection[int], timeout: float = 0.0) -> list[StoreResult]:
        return self._tickets.poll(tickets, timeout)

    def drop(self, key: bytes) -> bool:
        """Delete ``key``'s file as an outside eviction would; answer whether it was indexed."""
        name = _name(key)
        with self._lock:
            held = name in self._index
            if held:
                self._forget(name)
        return held

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._tickets.fail_open("DiskStore closed")

    def check_invariants(self) -> None:
        with self._lock:
            assert self.used_bytes == sum(size for _, size in self._index.values()), "used_bytes drifted"
            assert self.used_bytes <= self.capacity_bytes, "over capacity"
            assert len(self.eviction) == len(self._index) == len(self._names), "policy and index disagree"
            assert all(self._names[block] == name for name, (block, _) in self._index.items()), "id map drifted"
            self.eviction.check_invariants()
        self._tickets.check_invariants()

    def _run(self, ticket: int, work, keys: list[bytes], views: list[list[memoryview]]) -> None:
        failed, errors = [], set()
        try:
            for i, (key, parts) in enumerate(zip(keys, views)):
                problem = work(key, parts)
                if problem:
                    failed.append(i)
                    errors.add(problem)
        except Exception as exc:  # a ticket is reported whatever happens
            failed, errors = list(range(len(keys))), {f"{type(exc).__name__}: {exc}"}
        self._tickets.report(ticket, failed, "; ".join(sorted(errors)))

    def _write(self, key: bytes, parts: list[memoryview]) -> str | None:
        size = sum(p.nbytes for p in parts)
        if size > self.capacity_bytes:
            return f"a value of {size} bytes exceeds the capacity of {self.capacity_bytes}"
        name = _name(key)
        final = self._file(name)
        temp = final.with_name(f"{final.name}{_TEMP}{os.getpid()}-{next(self._temps)}")
        try:
            final.parent.mkdir(exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, parts)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                self._forget(name, unlink=False)  # os.replace swaps the file atomically: readers never miss it
                self._evict_for(size)
                os.replace(temp, final)
                self._adopt(name, size)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            return f"write failed: {exc}"
        return None

    def _read(self, key: bytes, parts: list[memoryview]) -> str | None:
        name = _name(key)
        want = sum(p.nbytes for p in parts)
        try:
            fd = os.open(self._file(name), os.O_RDONLY)
        except FileNotFoundError:
            with self._lock:
                if not self._file(name).exists():  # deleted behind our back (not just rewritten)
                    self._forget(name, unlink=False)
            return "missing value"
        try:
            size = os.fstat(fd).st_size
            if size != want:
                return f"value of {size} bytes, buffers of {want}"
            if _read_all(fd, parts) != want:
                return "value shrank while being read"
        finally:
            os.close(fd)
        with self._lock:
            entry = self._index.get(name)
            if entry is None:
                self._adopt(name, size)
            else:
                self.eviction.on_access(entry[0])
        return None

    def _known(self, name: str) -> bool:
        with self._lock:
            if name in self._index:
                return True
        try:
            size = self._file(name).stat().st_size
        except OSError:
            return False
        with self._lock:
            if name not in self._index:
                self._adopt(name, size)
        return True

    def _file(self, name: str) -> Path:
        return self.path / name[:2] / f"{name}{_SUFFIX}"

    def _adopt(self, name: str, size: int) -> None:
        block = BlockId(next(self._ids))
        self._index[name] = (block, size)
        self._names[block] = name
        self.used_bytes += size
        self.eviction.on_insert(block, BlockHash(int(name[:32], 16)), None)
        self._evict_for(0)

    def _forget(self, name: str, *, unlink: bool = True) -> None:
        entry = self._index.pop(name, None)
        if entry is None:
            return
        block, size = entry
        del self._names[block]
        self.used_bytes -= size
        self.eviction.on_remove(block)
        if unlink:
            self._file(name).unlink(missing_ok=True)

    def _evict_for(self, size: int) -> None:
        while self._index and self.used_bytes + size > self.capacity_bytes:
            victims = self.eviction.select_victims(1, self._names.__contains__)
            assert victims, "the eviction policy found no victim among indexed files"
            self._forget(self._names[victims[0]])


def _name(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()


def _write_all(fd: int, parts: list[memoryview]) -> None:
    pending = [p for p in parts if p.nbytes]
    while pending:
        written = os.writev(fd, pending[:1024])
        while pending and written >= pending[0].nbytes:
            written -= pending.pop(0).nbytes
        if written:
            pending[0] = pending[0][written:]


def _read_all(fd: int, parts: list[memoryview]) -> int:
    pending, offset = [p for p in parts if p.nbytes], 0
    while pending:
        got = os.preadv(fd, pending[:1024], offset)
        if got == 0:
            break
        offset += got
        while pending and got >= pending[0].nbytes:
            got -= pending.pop(0).nbytes
        if got:
            pending[0] = pending[0][got:]
    return offset
