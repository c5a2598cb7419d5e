"""``DiskStore``: a ``BlockStore`` in a local directory, one file per key, with a capacity limit."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import math
import os
import resource
import secrets
import stat
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

import attrs

from kvkit.backends.blockstore._common import (
    MAX_WAITING,
    Descriptors,
    TicketBox,
    carry_through_fork,
    check_call,
    check_keys,
    check_timeout,
)
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.errors import ConfigError, KVKitError
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.shared import StoreResult
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import check_bool, check_int, checked, implements, plural, quote

__all__ = ["COUNTERS", "DiskStore", "absolute_path"]

_SUFFIX = ".kvb"
_TEMP = ".tmp-"  # "<name>.kvb.tmp-<owner>-<n>" (no dot in owner): a write not renamed yet, locked by its writer
_HEX = frozenset("0123456789abcdef")
_CLOSED = "DiskStore closed"
_FULL = (errno.ENOSPC, errno.EDQUOT)
_TEMP_ATTEMPTS = 3  # fresh temp names tried when a reaper removed each one before its writer locked it
# Opening never follows a symlink, and never blocks on a FIFO planted under a value's name.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
# A value's subdirectory is opened, and its files reached relative to it, never through a symlink in its place.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
# What a failed look says about a name: nothing leads there, or something that is not a directory is on the way.
# Any other failure (no descriptor left, no permission, an I/O error) says nothing about the file.
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
# The process or the system out of descriptors or memory: says nothing about any entry.
_SHORT = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)

# The stores of this process, by which their policies are told apart: a policy serves one open store (its ids
# are the store's own, numbered from 0; another store's would meet them).
_OPEN: weakref.WeakSet[DiskStore] = weakref.WeakSet()
_OPEN_LOCK = threading.Lock()

COUNTERS = ("foreign", "broken", "vanished", "oversized", "temps_removed", "temps_kept", "evicted", "unlink_failed",
            "disk_full")
"""The names of :attr:`DiskStore.counters`, in order."""


def absolute_path(path: str) -> str:
    """``path`` absolute: a leading ``~`` is the home directory, a relative path is joined to the working directory.

    Never normalised: a ``..`` stays for the kernel to follow, and after a symlink it leads to the parent of the
    link's target, not to the directory the text names before the link.
    """
    return os.path.join(os.getcwd(), os.path.expanduser(path))


def _path(value: object) -> Path:
    """``value`` as an absolute path (:func:`absolute_path`), fixed when the store opens."""
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(text, str) or not text:
        raise ConfigError(f"DiskStore.path={quote(value)}: must be a directory path")
    try:
        unusable = b"\0" in os.fsencode(text)
    except UnicodeEncodeError:  # a lone surrogate
        unusable = True
    if unusable:
        raise ConfigError(f"DiskStore.path={quote(value)}: holds a NUL byte or a character no file name can hold")
    return Path(absolute_path(text))


def _untracked(_store: object, _field: object, policy: EvictionPolicy) -> None:
    """An ``attrs`` validator refusing a policy that tracks blocks already (a closed store's, reused; another
    store's): the store numbers its values from 0, so their ids would meet the ones it holds, and its eviction
    would pick another's."""
    if len(policy):
        raise ConfigError(f"DiskStore.eviction={quote(policy)}: already tracks {plural(len(policy), 'block')}; "
                          f"give each store a new EvictionPolicy instance")


def _mode(value: object) -> int:
    """Permission bits: an int (``0o640``) or its octal digits as text (``"640"``, ``"0640"``, ``"0o640"``)."""
    mode = value
    if isinstance(value, str):
        try:
            mode = int(value.strip().lower().removeprefix("0o"), 8)
        except ValueError:
            mode = None
    if isinstance(mode, int) and not isinstance(mode, bool) and 0 <= mode <= 0o777 and mode & 0o600 == 0o600:
        return mode
    raise ConfigError(f"DiskStore.file_mode={quote(value)}: must be permission bits that let the owner "
                      f"read and write (an int such as 0o600, or octal text such as '640')")


@attrs.define(eq=False)
class DiskStore:
    """A directory of block values: ``<path>/<2 hex>/<sha256(key)>.kvb``, at most ``capacity_bytes``.

    ``path`` is made absolute when the store opens (a leading ``~`` is the home directory; a later ``chdir``
    moves nothing); one no file system can take (a NUL byte, a lone surrogate) raises
    :class:`~kvkit.errors.ConfigError`, quoting it.

    Writes. A value is written to a temporary file next to its final name,
    ``<name>.kvb.tmp-<owner>-<n>`` (``owner`` random per store, so writers in
    other processes, hosts or PID namespaces never share a name), then renamed
    over the final name (``os.replace``), so a reader sees a whole value or
    none. Its writer holds an exclusive ``flock`` on the temporary file from
    before anyone can find it (the writer checks, once locked, that the name
    still leads to its file) until after the rename; the lock dies with the
    writer's process. A ``path`` deleted while the store is open is made
    again, as opening makes it, by the next put; a subdirectory removed while
    a put writes in it (a neighbour's cleanup) is made again, once.

    Opening. A new instance re-indexes the directory: the file names are the
    index, sizes and modification times seed the eviction order (a file the listing names twice, as a
    directory read while other processes rename in it may, is indexed once). Entries that
    are not this layout's (other names, other places: ``foreign``), named as
    values or temporary files but not value files (symlinks, hard links, directories,
    devices, unlistable subdirectories, files whose status cannot be read:
    ``broken``), and entries gone between being listed and being looked at
    (``vanished``: another process evicted them) are counted in
    :attr:`counters` and left alone; so is a value file
    larger than the capacity (``oversized``: never indexed, since holding it
    would evict every other value); opening never raises on an entry. A
    temporary file is deleted only when its lock can be taken, which proves
    its writer gone (``temps_removed``); one whose lock is held,
    or that cannot be deleted (a read-only file system), is kept
    (``temps_kept``). Only an unusable ``path`` itself, or a process out of
    descriptors or memory (which would leave values unindexed), raises
    :class:`~kvkit.errors.ConfigError`, quoting it.

    Capacity. Eviction asks ``eviction`` (LRU by default; an instance of this store's own: one that tracks
    blocks already, or that another open store uses, raises :class:`~kvkit.errors.ConfigError`, quoting it,
    before anything changes) for victims and
    deletes their files; a file another process deleted first, or one that
    cannot be deleted, is forgotten all the same (``vanished``,
    ``unlink_failed``). A victim the process lacks the descriptors or memory
    to delete (``EMFILE``, ``ENFILE``, ``ENOMEM``: nothing about its file) stays
    indexed and ends the eviction: the put that needed the room fails, and a file
    a ``contains`` or ``get`` found is not adopted, so the files on disk stay
    within the capacity once descriptors are back. A put evicts for its value
    once the value is written, just before renaming it into place, so a put
    that fails (a subdirectory it cannot write, something else in a
    subdirectory's place) evicts nothing; only on a file system found full
    (below) is the room made before writing. A value larger than the capacity,
    or than the process's file size limit (``RLIMIT_FSIZE``: writing past it
    raises ``SIGXFSZ``, which kills a process that does not ignore it, or fails
    with ``EFBIG``), fails its put before anything is evicted or written. A put
    that meets a full file system (``ENOSPC``,
    ``EDQUOT``: ``disk_full``) lowers the effective capacity to what the file
    system holds for this store (the bytes indexed when it filled, plus the
    free space if less than the value) and evicts below it, retrying until the
    value lands or nothing is left to evict (victims that cannot be deleted,
    ``unlink_failed``, free nothing: a round that deletes none gives up).
    What the file system holds for this store includes the values neighbours
    wrote since it looked: with nothing indexed left to evict, or a value larger than the lowered capacity,
    it re-scans the directory, adopts the value files its index lacks and evicts
    them in turn; then, once per put, it removes the
    empty subdirectories (a file system out of inodes may lack the one a new
    file needs) and retries. While lowered, the capacity is
    re-measured (indexed bytes plus free space, never above
    ``capacity_bytes``) whenever it would force an eviction, so space freed on
    the file system is used again; a quota, invisible to ``statvfs``, is
    learned again at each refusal. A value written meanwhile (its temporary file
    on the file system, not yet indexed, while another put lowered the capacity)
    raises it back to the indexed bytes plus that value: the file system holds
    them all. Writes in flight may hold up to ``threads``
    values beyond the capacity in temporary files.

    Reading. A ``get`` reads with ``os.preadv`` straight into the caller's
    buffers; a value missing, not a value file, or unreadable is a failed
    key (a miss), never an exception. ``contains`` and ``get`` look at the file
    each time and the index follows: a file another process added is adopted,
    one it rewrote at another size counted at its new size, one it deleted
    forgotten. Only evidence moves the index (the name leads nowhere, or to
    something that is not a value file): a look that cannot be made (no
    descriptor left, no permission, an I/O error) is a miss that forgets
    nothing, and a rename refused leaves the old value counted. ``contains``
    opens each subdirectory once per call (so holds at most 256 descriptors
    while it runs) and looks at each file through it; it takes what the file system takes, so it
    ignores ``timeout_s`` (checked only). The capacity holds per process
    (values this store wrote, found when it opened, or met since); a full file
    system is relieved of any process's values. Work runs on a pool of
    ``threads`` threads of the process that opened the store: in a child
    forked from it, ``contains``/``put``/``get`` raise
    :class:`~kvkit.errors.KVKitError` (open a store in each process), the
    tickets open at the fork are reported failed there, the copies of the
    descriptors its calls held at the fork are closed there (a copy would hold
    the parent's ``flock`` and an evicted file's space for the child's life;
    the listing a full file system's re-scan or prune holds, ``os.scandir``'s
    own, excepted), and ``close`` returns at once. At most
    ``max_waiting`` finished results wait for the polls naming their tickets
    (one more abandons the oldest).

    Symlinks and hard links. No path is followed through a symlink: value and temporary files are opened with
    ``O_NOFOLLOW`` and reached relative to their subdirectory, itself opened with ``O_NOFOLLOW`` (by
    opening's scan too, which lists and reaps through that descriptor), so a symlink (or anything but a
    directory) in a subdirectory's place, even one swapped in during a scan, fails its keys' puts and gets
    and carries no write, read, reap or eviction outside ``path``. ``path`` itself may be a symlink. A value
    file is a regular file with one name (``st_nlink`` 1: written to a new temporary file, then renamed): a
    hard link planted under a value's name, to a file anywhere on the file system, is not one (``broken``
    when opening finds it; a miss that forgets, never deletes, it when looked at), so it is never read,
    counted or evicted; a put renames its value over the name, never writing into the linked file.

    Permissions. Value and temporary files get ``file_mode`` (``0o600`` by
    default) and the directories the store creates (``path`` when it does not
    exist, and its subdirectories) the same bits plus search where read is
    granted (``0o700``), whatever the umask (``0o477`` included, which takes the owner's read bit away):
    ``path`` and the directories above it that do not exist, and its subdirectories; an existing directory
    keeps its own.

    Invariants: ``used_bytes`` is the sum of the indexed files' sizes, never
    above :attr:`effective_capacity_bytes` (itself at most
    ``capacity_bytes``); the policy tracks exactly the indexed keys; every
    indexed file was a value file (a regular file with one name) of this layout when indexed.
    """

    path: Path = attrs.field(converter=_path)
    capacity_bytes: int = attrs.field(converter=checked(check_int, minimum=1, label="DiskStore."))  # type: ignore[misc]
    eviction: EvictionPolicy = attrs.field(factory=LRUPolicy, validator=[implements(
        EvictionPolicy, label="DiskStore.", what="an EvictionPolicy instance"), _untracked])
    threads: int = attrs.field(default=2, converter=checked(check_int, minimum=1, label="DiskStore."))  # type: ignore[misc]
    fsync: bool = attrs.field(default=False, converter=checked(check_bool, label="DiskStore."))  # type: ignore[misc]
    """Flush each file to the device before renaming it (survives power loss, costs a sync per value)."""
    page_cache: bool = attrs.field(default=True, converter=checked(check_bool, label="DiskStore."))  # type: ignore[misc]
    """Leave values in the kernel's page cache. ``False``: each value is flushed to the device once written
    and dropped from the page cache once written or read (``posix_fadvise(DONTNEED)``), so the store's
    bytes hold no host memory: what ``O_DIRECT`` gives without its alignment rules, at a sync per write."""
    file_mode: int = attrs.field(default=0o600, converter=_mode)
    """Permission bits of value files (``0o640`` lets the group read); directories add search bits."""
    max_waiting: int = attrs.field(default=MAX_WAITING, kw_only=True,
                                   converter=checked(check_int, minimum=1, label="DiskStore."))  # type: ignore[misc]
    used_bytes: int = attrs.field(default=0, init=False)
    closed: bool = attrs.field(default=False, init=False)
    _index: dict[str, tuple[BlockId, int]] = attrs.field(factory=dict, init=False)  # name -> (id, size)
    _names: dict[BlockId, str] = attrs.field(factory=dict, init=False)
    _fits: int | None = attrs.field(default=None, init=False)  # what the file system holds for us, once full
    _ids: itertools.count = attrs.field(factory=itertools.count, init=False)
    _temps: itertools.count = attrs.field(factory=itertools.count, init=False)
    _owner: str = attrs.field(factory=lambda: secrets.token_hex(6), init=False)
    _pid: int = attrs.field(factory=os.getpid, init=False)  # the process whose threads do the work
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _counts: Counter = attrs.field(factory=Counter, init=False)
    _counts_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _held: Descriptors = attrs.field(factory=Descriptors, init=False)
    _tickets: TicketBox = attrs.field(init=False, default=attrs.Factory(
        lambda self: TicketBox(self.max_waiting), takes_self=True))
    _pool: ThreadPoolExecutor = attrs.field(init=False)
    _close_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def __attrs_post_init__(self) -> None:
        with _OPEN_LOCK:
            if any(other.eviction is self.eviction and not other.closed for other in _OPEN):
                raise ConfigError(f"DiskStore.eviction={quote(self.eviction)}: another open store uses this "
                                  f"instance; give each store a new EvictionPolicy instance")
            _OPEN.add(self)
        try:
            self._make_root()
            self._reindex()
        except BaseException:
            _OPEN.discard(self)
            raise
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvkit-disk")
        carry_through_fork(self)

    def _forked(self, parent: int) -> None:
        """In a child forked from process ``parent``: fresh locks and an idle pool (the copies belong to the
        parent's threads), the copies of the descriptors its calls held closed, and the tickets still open
        failed (no thread here serves them)."""
        self._held.close_copies()
        self._lock, self._counts_lock, self._close_lock = threading.Lock(), threading.Lock(), threading.Lock()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvkit-disk")
        self._tickets.after_fork(f"transport: issued by process {parent}, which forked process {os.getpid()} "
                                 f"before it was answered")

    @property
    def counters(self) -> dict[str, int]:
        """What the store met on its file system since it opened, by name (:data:`COUNTERS`)."""
        with self._counts_lock:
            return {name: self._counts[name] for name in COUNTERS}

    @property
    def effective_capacity_bytes(self) -> int:
        """``capacity_bytes``, or less while the file system holds less for this store (see the class)."""
        with self._lock:
            return self._limit()

    def contains(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        self._check_process()
        check_keys("DiskStore", self.closed, keys)
        check_timeout("DiskStore", timeout_s)
        folders: dict[str, int] = {}
        try:
            n = 0
            for key in keys:
                if not self._known(_name(key), folders):
                    break
                n += 1
            return n
        finally:
            for folder in folders.values():
                self._held.close(folder)

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview]]) -> int:
        self._check_process()
        return self._submit(self._write, keys, check_call("DiskStore", self.closed, keys, values))

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        self._check_process()
        return self._submit(self._read, keys, check_call("DiskStore", self.closed, keys, buffers))

    def poll(self, tickets: Collection[int], timeout: float = 0.0) -> list[StoreResult]:
        return self._tickets.poll(tickets, timeout)

    def drop(self, key: bytes) -> bool:
        """Delete ``key``'s file as an outside eviction would; answer whether it was indexed. A process out of
        descriptors or memory to delete it with raises that ``OSError`` and keeps it indexed."""
        check_keys("DiskStore", False, [key])
        name = _name(key)
        with self._lock:
            held = name in self._index
            if held:
                self._forget(name)
        return held

    def close(self) -> None:
        """Finish the calls running, fail the queued ones; a ``close`` while another thread closes the store
        returns once it is closed."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._tickets.fail_open(_CLOSED)

    def check_invariants(self) -> None:
        with self._lock:
            assert self.used_bytes == sum(size for _, size in self._index.values()), "used_bytes drifted"
            assert self.used_bytes <= self._limit(), "over capacity"
            assert len(self.eviction) == len(self._index) == len(self._names), "policy and index disagree"
            assert all(self._names[block] == name for name, (block, _) in self._index.items()), "id map drifted"
            self.eviction.check_invariants()
        self._tickets.check_invariants()

    def _check_process(self) -> None:
        """Refuse work in a child forked from the opener: the pool's threads (and its temporary names) are the
        parent's, so work queued there would never run."""
        if os.getpid() != self._pid:
            raise KVKitError(f"DiskStore at {str(self.path)!r} was opened by process {self._pid} and inherited "
                             f"through fork by process {os.getpid()}: open a store in each process")

    # --- opening -------------------------------------------------------------

    def _make_root(self) -> None:
        """Create ``path`` and every missing directory above it with the store's directory mode.

        Each is made by :func:`_new_folder`: one another process made meanwhile keeps its own mode, and one a
        neighbour swapped for a symlink is never followed.
        """
        mode = _dir_mode(self.file_mode)
        missing = [p for p in (self.path, *self.path.parents) if not os.path.lexists(p)]
        try:
            for folder in reversed(missing):
                _new_folder(folder, mode, self._held)
        except OSError as exc:
            raise ConfigError(f"DiskStore.path={str(self.path)!r}: cannot create the directory: {exc}") from exc
        if not self.path.is_dir():
            raise ConfigError(f"DiskStore.path={str(self.path)!r}: exists and is not a directory")

    def _reindex(self) -> None:
        """Index every value file, oldest first; count what is not one; delete abandoned temporary files."""
        found = self._scan()
        with self._lock:
            try:
                for _, name, size in sorted(found):  # oldest first: the first victims of an LRU
                    self._adopt(name, size)  # evicts at once if the capacity is smaller than last time
            except OSError as exc:  # out of descriptors or memory to evict with (the only OSError it raises)
                self._check_short(str(self.path), exc)
                raise

    def _scan(self) -> list[tuple[int, str, int]]:
        """The directory's value files as ``(mtime_ns, name, size)``; count what is not one; delete abandoned
        temporary files. Raises :class:`~kvkit.errors.ConfigError`, quoting it, only when ``path`` itself
        cannot be listed, or the process is out of descriptors or memory (:meth:`_check_short`).

        Directories are read entry by entry, never listed whole: what is not a value costs time, not memory,
        however many entries a neighbour left. Each subdirectory is opened once (``O_NOFOLLOW``) and read,
        looked into and reaped through that descriptor: one swapped for a symlink after ``path`` was read is
        ``broken``, never followed.
        """
        found: list[tuple[int, str, int]] = []

        def unlistable(exc: OSError) -> NoReturn:
            raise ConfigError(f"DiskStore.path={str(self.path)!r}: cannot list the directory: {exc}") from exc

        try:
            listing = os.scandir(self.path)
        except OSError as exc:
            unlistable(exc)
        for top in _read(listing, unlistable):
            self._scan_folder(top, found)
        return found

    def _scan_folder(self, top: str, found: list[tuple[int, str, int]]) -> None:
        """:meth:`_scan` of the entry ``top`` of ``path``: its value files appended to ``found``."""
        if len(top) != 2 or not _HEX.issuperset(top):
            self._note("foreign")
            return
        where = os.path.join(self.path, top)

        def unreadable(exc: OSError) -> None:  # a subdirectory this process may not read, or an I/O error
            self._check_short(where, exc)
            self._note("broken")

        try:
            folder = self._held.open(where, _DIR_FLAGS)
        except FileNotFoundError:
            self._note("vanished")
            return
        except OSError as exc:  # a symlink, a file, or a subdirectory this process may not open
            unreadable(exc)
            return
        try:
            try:
                listing = os.scandir(folder)  # reads a duplicate of ``folder``, which stays open
            except OSError as exc:
                unreadable(exc)
                return
            for filename in _read(listing, unreadable):
                kind = _kind(top, filename)
                if kind == "temp":
                    self._reap(filename, folder)
                elif kind == "value":
                    value = self._regular(filename, folder)
                    if value is not None:
                        found.append((value.st_mtime_ns, filename[:-len(_SUFFIX)], value.st_size))
                else:
                    self._note("foreign")
        finally:
            self._held.close(folder)

    def _check_short(self, where: str, exc: OSError) -> None:
        """Raise :class:`~kvkit.errors.ConfigError`, quoting ``where``, when ``exc`` says the process is out of
        descriptors or memory (:data:`_SHORT`): a scan that went on would leave values on disk unindexed, and
        temporary files it could not examine kept as ``broken``."""
        if exc.errno in _SHORT:
            raise ConfigError(f"DiskStore.path={str(self.path)!r}: cannot look into {where!r}: "
                              f"{exc.strerror or exc}") from exc

    def _regular(self, filename: str, folder: int) -> os.stat_result | None:
        """The status of the regular file ``filename`` in the directory ``folder``, or ``None`` (counted) if it
        is not one."""
        try:
            found = os.lstat(filename, dir_fd=folder)
        except FileNotFoundError:
            self._note("vanished")
            return None
        except OSError:
            self._note("broken")
            return None
        if not _value_file(found):
            self._note("broken")
            return None
        return found

    def _reap(self, filename: str, folder: int) -> None:
        """Delete the temporary file ``filename`` in the directory ``folder`` if its writer is gone: only while
        holding its lock.

        A writer locks its file before writing and checks, once locked, that its name still leads to it
        (a reaper may have deleted it in between; the writer then takes a new name), and unlocks only
        after renaming it: so a temporary file locked here and still under its name is abandoned.
        """
        try:
            fd = self._held.open(filename, _READ_FLAGS, dir_fd=folder)
        except FileNotFoundError:  # renamed into place meanwhile
            self._note("vanished")
            return
        except OSError as exc:  # a symlink, or not ours to open; or no descriptor left, which says nothing of it
            self._check_short(os.path.join(self.path, filename[:2], filename), exc)
            self._note("broken")
            return
        try:
            try:
                found = os.fstat(fd)
            except OSError:  # a stale handle on a network file system, an I/O error: nothing proves it abandoned
                found = None
            if found is None or not stat.S_ISREG(found.st_mode):
                self._note("broken")
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its writer is alive (or locks do not work here: nothing proves it abandoned)
                self._note("temps_kept")
                return
            try:  # temporary names are never reused: if this one still exists, it is the file locked
                os.unlink(filename, dir_fd=folder)
            except FileNotFoundError:  # its writer renamed it before we locked it
                self._note("vanished")
            except OSError:  # a read-only file system
                self._note("temps_kept")
            else:
                self._note("temps_removed")
        finally:
            self._held.close(fd)

    # --- work on the pool ----------------------------------------------------

    def _submit(self, work, keys: Sequence[bytes], views: list[list[memoryview]]) -> int:
        """A ticket for ``work`` over ``keys`` and their checked byte views, queued on the pool.

        A call the pool refuses (the store closed since the call was checked, or no thread could start: the
        pool queued the call first) is reported failed at once unless a thread began it meanwhile. ``turn``
        is taken by whichever comes first, the call's run or its refusal: a call reported failed never runs
        later, so a get's buffers are never written once its caller was told they hold nothing.
        """
        ticket = self._tickets.issue(len(keys))
        turn = threading.Lock()
        try:
            self._pool.submit(self._run, turn, ticket, work, list(keys), views)
        except RuntimeError as exc:  # the pool is shut down (close() ran meanwhile), or no thread could start
            if turn.acquire(blocking=False):
                self._tickets.report(ticket, range(len(keys)), _CLOSED if self.closed else
                                     f"DiskStore cannot start a thread: {exc}")
        return ticket

    def _run(self, turn: threading.Lock, ticket: int, work, keys: list[bytes],
             views: list[list[memoryview]]) -> None:
        if not turn.acquire(blocking=False):  # refused and reported failed already
            return
        failed, errors = [], set()
        try:
            for i, (key, parts) in enumerate(zip(keys, views)):
                problem = work(key, parts)
                if problem:
                    failed.append(i)
                    errors.add(problem)
        except Exception as exc:  # noqa: BLE001 - a ticket is reported whatever happens
            failed, errors = list(range(len(keys))), {f"{type(exc).__name__}: {exc}"}
        self._tickets.report(ticket, failed, "; ".join(sorted(errors)))

    def _write(self, key: bytes, parts: list[memoryview]) -> str | None:
        size = sum(p.nbytes for p in parts)
        name = _name(key)
        largest = _largest_file()
        if size > largest:  # it would fail once written up to the limit (SIGXFSZ, EFBIG): evict nothing for it
            return f"a value of {size} bytes exceeds this process's file size limit of {largest} (RLIMIT_FSIZE)"
        pruned = remade = False
        while True:  # each round after a full file system evicts a value or (once) prunes, or gives up
            try:  # evicting raises OSError too: a process out of descriptors or memory (the victims stay)
                with self._lock:
                    fits = self._make_room(size)
                    limit = self._limit()
                if not fits:
                    held = "" if limit == self.capacity_bytes else " (what the file system holds for this store)"
                    return f"a value of {size} bytes exceeds the capacity of {limit}{held}"
                self._publish(name, size, parts)
                return None
            except OSError as exc:
                problem = f"cannot write {str(self._file(name))!r}: {exc.strerror or exc}"
                gone = exc.errno == errno.ENOENT and not os.path.lexists(self._file(name).parent)
                if gone and not remade:  # its subdirectory went meanwhile (a neighbour's prune, a cleanup):
                    remade = True  # made again, once
                    continue
                if exc.errno not in _FULL:
                    return problem
            self._note("disk_full")
            try:
                with self._lock:
                    relieved = self._relieve(size)
            except OSError as exc:  # out of descriptors or memory to evict with: the victims stay
                return f"{problem}, and cannot evict: {exc.strerror or exc}"
            if not relieved and not pruned:  # out of inodes, perhaps: the empty subdirectories hold some
                relieved = pruned = self._prune() > 0
            if not relieved:
                return f"{problem}, and nothing is left to evict"

    def _publish(self, name: str, size: int, parts: list[memoryview]) -> None:
        """Write a value to a locked temporary file and rename it over ``name``'s file; raise ``OSError``."""
        final = f"{name}{_SUFFIX}"
        folder = self._open_folder(name, create=True)
        try:
            fd, temp = self._create_temp(folder, final)
            try:
                os.fchmod(fd, self.file_mode)  # the creation mode passes through the umask
                _write_all(fd, parts)
                if self.fsync:
                    os.fsync(fd)
                if not self.page_cache:
                    if not self.fsync:
                        os.fdatasync(fd)  # only clean pages leave the page cache
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                with self._lock:
                    self._forget(name, unlink=False)  # os.replace swaps the file atomically: readers never miss it
                    if self._fits is not None:  # the file system holds the indexed files and this one at once
                        self._fits = max(self._fits, min(self.capacity_bytes, self.used_bytes + size))
                    self._evict_for(size)
                    try:
                        os.replace(temp, final, src_dir_fd=folder, dst_dir_fd=folder)
                    except OSError:  # the old file, if any, is still there: the index follows it
                        self._look(name, folder)
                        raise
                    self._adopt(name, size)
            except BaseException:
                _unlink_quietly(temp, folder)
                raise
            finally:
                self._held.close(fd)  # releases the lock once the temporary name is gone
        finally:
            self._held.close(folder)

    def _open_folder(self, name: str, *, create: bool = False) -> int:
        """A descriptor of ``name``'s subdirectory (made first with ``create``), never opened through a symlink.

        Raises ``OSError`` when something else is in its place (``ELOOP``, ``ENOTDIR``): a symlink there
        would carry reads, writes and evictions outside ``path``; ``ConfigError`` when ``path``, deleted,
        cannot be made again.
        """
        folder = os.path.join(self.path, name[:2])  # a str: cheaper than a Path, for every contains
        if create:
            try:
                _new_folder(folder, _dir_mode(self.file_mode), self._held)
            except FileNotFoundError:  # ``path`` itself was deleted (a cleanup): made again, as opening does
                self._make_root()
                _new_folder(folder, _dir_mode(self.file_mode), self._held)
        return self._held.open(folder, _DIR_FLAGS)

    def _create_temp(self, folder: int, final: str) -> tuple[int, str]:
        """A new temporary file next to ``final`` in the directory ``folder``, open for writing, locked by us."""
        for _ in range(_TEMP_ATTEMPTS):
            temp = f"{final}{_TEMP}{self._owner}-{next(self._temps)}"
            fd = self._held.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, self.file_mode,
                                 dir_fd=folder)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits out a reaper that is looking at it
                if _same_file(temp, folder, os.fstat(fd)):
                    return fd, temp
            except BaseException:
                self._held.close(fd)
                _unlink_quietly(temp, folder)
                raise
            self._held.close(fd)  # a reaper deleted it between our open and our lock: take a new name
        raise OSError(errno.EAGAIN, f"{plural(_TEMP_ATTEMPTS, 'temporary file')} were deleted by others "
                                    "before being locked")

    def _read(self, key: bytes, parts: list[memoryview]) -> str | None:
        name = _name(key)
        path = self._file(name)
        try:
            folder = self._open_folder(name)
        except OSError as exc:  # gone, or a symlink or a file in its subdirectory's place; or no descriptor left
            unopened = ("missing value" if exc.errno == errno.ENOENT
                        else f"cannot open {str(path.parent)!r}: {exc.strerror or exc}")
            return self._unusable(name, unopened) if exc.errno in _GONE else unopened
        try:
            problem = self._read_file(folder, path, parts)
            with self._lock:  # the index follows what the name leads to now, not the file read
                if self._look(name, folder) and problem is None and name in self._index:
                    self.eviction.on_access(self._index[name][0])
        finally:
            self._held.close(folder)
        return problem

    def _read_file(self, folder: int, path: Path, parts: list[memoryview]) -> str | None:
        """Read ``path``'s file, in the directory ``folder``, into ``parts``; answer the problem, if any."""
        want = sum(p.nbytes for p in parts)
        try:
            fd = self._held.open(path.name, _READ_FLAGS, dir_fd=folder)
        except FileNotFoundError:
            return "missing value"
        except OSError as exc:  # a symlink in its place, or no permission
            return f"cannot open {str(path)!r}: {exc.strerror or exc}"
        try:
            found = os.fstat(fd)
            if not _value_file(found):
                return f"{str(path)!r} is not a value file (a regular file with one name): it is {_what(found)}"
            if found.st_size != want:
                return f"value of {found.st_size} bytes, buffers of {want}"
            if _read_all(fd, parts) != want:
                return "value shrank while being read"
            if not self.page_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            return f"cannot read {str(path)!r}: {exc.strerror or exc}"
        finally:
            self._held.close(fd)
        return None

    def _unusable(self, name: str, problem: str) -> str:
        """Forget (without deleting: it is not ours) what is in the place of ``name``'s value; answer ``problem``."""
        with self._lock:
            self._forget(name, unlink=False)
        return problem

    # --- the index -----------------------------------------------------------

    def _known(self, name: str, folders: dict[str, int]) -> bool:
        """Whether ``name``'s value file is there now; the index follows what is found (:meth:`_look`).

        ``folders`` holds the subdirectories a ``contains`` opened, by prefix, each opened once per call (the
        caller closes them). A subdirectory gone or not a directory forgets the value; one that cannot be
        opened for another reason (no descriptor left, no permission) answers ``False`` and changes nothing.
        """
        folder = folders.get(name[:2])
        if folder is None:
            try:
                folder = folders[name[:2]] = self._open_folder(name)
            except OSError as exc:
                if exc.errno in _GONE:
                    with self._lock:
                        self._found(name, None)
                return False
        with self._lock:  # one step with the update: a rewrite by this store's threads cannot come between
            return self._look(name, folder)

    def _look(self, name: str, folder: int) -> bool:
        """Whether ``name``'s value file is in the directory ``folder`` now; the index follows what is found
        (:meth:`_found`). A look that fails for another reason than the file's absence (no permission, an I/O
        error), or whose adoption cannot evict for want of descriptors or memory (:meth:`_adopt`), answers
        ``False`` and adopts nothing: only evidence moves the index. The lock is held."""
        try:
            return self._found(name, _status(f"{name}{_SUFFIX}", folder))
        except OSError:
            return False

    def _found(self, name: str, found: os.stat_result | None) -> bool:
        """Bring ``name``'s entry up to date with its file as just looked at (``None``: gone, or not in a directory).

        Forgotten (not deleted) when it is not a regular file any more, adopted when new, re-adopted at its
        size when another process rewrote it at another: so ``used_bytes`` follows the files. Answers
        whether a value file is there. The lock is held, and was while ``found`` was looked at: this
        store's own rewrites (under the lock) never come between.
        """
        if found is None or not _value_file(found):
            self._forget(name, unlink=False)
            return False
        entry = self._index.get(name)
        if entry is None or entry[1] != found.st_size:
            self._adopt(name, found.st_size)
        return True

    def _file(self, name: str) -> Path:
        return self.path / name[:2] / f"{name}{_SUFFIX}"

    def _adopt(self, name: str, size: int) -> None:
        """Index ``name``'s file of ``size`` bytes, in place of its entry if indexed already, and evict for it;
        one larger than the capacity is never indexed (``oversized``): holding it would evict every other
        value, and then itself.

        Its hash for the policy is the whole name, every digit of it: a name planted to share a prefix with
        another's is a value of its own, never a second block under one hash (which a policy that indexes
        blocks by hash refuses). A name is indexed once: a listing may name a file twice (a directory read
        while another process renames or re-creates files in it: tmpfs does), and a second entry would be
        tracked by the policy but left out of the index, so eviction would pick it forever without freeing a
        byte.

        An eviction that raises ``OSError`` (:meth:`_forget`: the process out of descriptors or memory) leaves
        ``name`` unindexed, and raises: its file is a neighbour's or this store's own just renamed into place,
        and holding it would keep the indexed bytes above the capacity.
        """
        self._forget(name, unlink=False)
        if size > self._limit():
            self._note("oversized")
            return
        block = BlockId(next(self._ids))
        self._index[name] = (block, size)
        self._names[block] = name
        self.used_bytes += size
        self.eviction.on_insert(block, BlockHash(int(name, 16)), None)  # the whole name: one per indexed file
        try:
            self._evict_for(0)
        except OSError:
            self._forget(name, unlink=False)
            raise

    def _forget(self, name: str, *, unlink: bool = True) -> bool:
        """Drop ``name`` from the index, deleting its file with ``unlink``; answer whether a file was deleted
        (or, found gone, deleted by another process first): ``False`` when ``name`` was not indexed, without
        ``unlink``, or when its file cannot be deleted (``unlink_failed``).

        A process out of descriptors or memory to delete it with (:data:`_SHORT`) raises that ``OSError`` and
        keeps ``name`` indexed: the shortage says nothing about the file, which stays on disk, so forgetting
        it would leave its bytes on disk uncounted, beyond the capacity.
        """
        if name not in self._index:
            return False
        deleted = unlink and self._delete(name)
        block, size = self._index.pop(name)
        del self._names[block]
        self.used_bytes -= size
        self.eviction.on_remove(block)
        return deleted

    def _delete(self, name: str) -> bool:
        """Delete ``name``'s file; answer whether it is gone (``False``: it cannot be deleted, ``unlink_failed``);
        raise ``OSError`` when the process lacks the descriptors or memory to try (:data:`_SHORT`)."""
        try:
            folder = self._open_folder(name)
            try:
                os.unlink(f"{name}{_SUFFIX}", dir_fd=folder)
            finally:
                self._held.close(folder)
        except FileNotFoundError:  # another process evicted it first
            self._note("vanished")
        except OSError as exc:
            if exc.errno in _SHORT:
                raise
            self._note("unlink_failed")  # cannot be deleted, or no longer in a directory of ours
            return False
        return True

    # --- capacity ------------------------------------------------------------

    def _limit(self) -> int:
        return self.capacity_bytes if self._fits is None else min(self.capacity_bytes, self._fits)

    def _make_room(self, size: int) -> bool:
        """Whether ``size`` more bytes can fit (re-measuring a lowered capacity first).

        On a file system found full (a lowered capacity) it evicts until they do, since the value needs that
        room to be written; else its writer evicts for it once it is written (:meth:`_publish`), so a put
        that fails evicts nothing.
        """
        if self._fits is not None and self.used_bytes + size > self._fits:
            free = self._free()
            if free is not None:
                fits = self.used_bytes + free
                self._fits = None if fits >= self.capacity_bytes else fits
        if size > self._limit() and self._fits is not None:  # the file system's share may hold a neighbour's values
            self._adopt_unindexed()
        if size > self._limit():
            return False
        if self._fits is not None:
            self._evict_for(size)
        return True

    def _relieve(self, size: int) -> bool:
        """After a full file system refused ``size`` bytes: lower the capacity to what it holds and evict below it.

        When nothing indexed is left to evict, the directory's value files the index lacks (a neighbour's,
        written since this store looked) are adopted and evicted in turn. A victim that cannot be deleted
        frees nothing: eviction goes on past it until a victim's file is gone. Answers whether one is (none:
        the put fails, since adopting the same files to evict them again would never end).
        """
        free = self._free()
        room = free if free is not None and free < size else 0  # a quota's refusal leaves statvfs's free space
        freed = 0
        for adopt in (False, True):
            if adopt and not self._adopt_unindexed():
                break
            self._fits = min(self.capacity_bytes, self.used_bytes + room)
            freed = self._evict_for(size, until_freed=True)
            if freed:
                break
        return freed > 0

    def _adopt_unindexed(self) -> bool:
        """Index the directory's value files the index lacks (what the file system holds for this store beyond
        its index: a neighbour's values), lifting a lowered capacity so that none is taken for ``oversized``
        (the next refusal lowers it again, counting them); answer whether any was adopted.

        A full file system calls it, rarely: it re-scans the directory (:meth:`_scan`, which counts again what
        is not a value and deletes abandoned temporary files). The lock is held.
        """
        try:
            found = self._scan()
        except ConfigError:  # path itself cannot be listed now: nothing more to learn
            return False
        new = sorted(entry for entry in found if entry[1] not in self._index)
        if new:
            self._fits = None
        for _, name, size in new:  # oldest first, as opening does
            self._adopt(name, size)
        return bool(new)

    def _prune(self) -> int:
        """Remove the empty subdirectories of this layout; answer how many went.

        ``rmdir`` removes only an empty directory, so nothing is lost; a put of another thread or process
        whose subdirectory goes between its making and the creation of its temporary file makes it again.
        """
        pruned = 0
        with contextlib.suppress(OSError), os.scandir(self.path) as entries:
            for entry in entries:
                if len(entry.name) == 2 and _HEX.issuperset(entry.name) and entry.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):  # not empty, or not ours to remove
                        os.rmdir(entry.path)
                        pruned += 1
        return pruned

    def _free(self) -> int | None:
        try:
            found = os.statvfs(self.path)
        except OSError:
            return None
        return found.f_bavail * found.f_frsize

    def _evict_for(self, size: int, *, until_freed: bool = False) -> int:
        """Evict until ``size`` more bytes fit under the capacity (and, ``until_freed``, until a victim's file
        is gone); answer how many victims' files are gone (each victim leaves the index, but one that cannot be
        deleted frees no space). A victim the process lacks the descriptors or memory to delete stays indexed
        and ends the eviction: its ``OSError`` is raised (:meth:`_forget`)."""
        evicted = freed = 0
        try:
            while self._index and (self.used_bytes + size > self._limit() or (until_freed and not freed)):
                victims = self.eviction.select_victims(1, self._names.__contains__)
                assert victims, "the eviction policy found no victim among indexed files"
                freed += self._forget(self._names[victims[0]])
                evicted += 1
        finally:
            if evicted:
                self._note("evicted", evicted)
        return freed

    def _note(self, counter: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[counter] += n


def _name(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()


def _kind(prefix: str, filename: str) -> str | None:
    """``"value"`` or ``"temp"`` for a file of this layout in subdirectory ``prefix``, else ``None``."""
    name, _, rest = filename.partition(".")
    if len(name) != 64 or not _HEX.issuperset(name) or not name.startswith(prefix):
        return None
    if rest == _SUFFIX[1:]:
        return "value"
    temp = f"{_SUFFIX[1:]}{_TEMP}"
    owner, _, number = rest[len(temp):].rpartition("-")
    if rest.startswith(temp) and owner and "." not in owner and number.isascii() and number.isdigit():
        return "temp"  # exactly "<name>.kvb.tmp-<owner>-<n>": anything else there is another's
    return None


def _read(listing: contextlib.AbstractContextManager[Iterator[os.DirEntry[str]]],
          failed: Callable[[OSError], None]) -> Iterator[str]:
    """The names ``listing`` (an ``os.scandir``, closed once read) reads, one at a time: a directory's entries
    are never held all at once. A read that fails ends them, calling ``failed`` with its error (it may raise)."""
    with listing as entries:
        while True:
            try:
                entry = next(entries)
            except StopIteration:
                return
            except OSError as exc:
                failed(exc)
                return
            yield entry.name


def _dir_mode(file_mode: int) -> int:
    """``file_mode`` plus search wherever it grants read (``0o600`` -> ``0o700``, ``0o640`` -> ``0o750``)."""
    return file_mode | (file_mode & 0o444) >> 2


def _new_folder(folder: str | Path, mode: int, held: Descriptors) -> bool:
    """Make ``folder`` (private until its mode is set) with exactly ``mode``, whatever the umask; ``False`` if it
    exists already (its mode is its own). The descriptor it opens is held in ``held``.

    The mode is set through a descriptor that needs no permission on the folder (``O_PATH``, so a umask that took
    the owner's read bit away, ``0o477``, locks nothing out) and never follows a symlink a neighbour swapped in
    meanwhile (``ENOTDIR``: no mode lands on what it names); Linux changes a mode through such a descriptor by
    its ``/proc/self/fd`` name. A file system that refuses modes (vfat, some network mounts) raises ``OSError``.
    """
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        return False
    fd = held.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.chmod(f"/proc/self/fd/{fd}", mode)
    finally:
        held.close(fd)
    return True


def _value_file(found: os.stat_result) -> bool:
    """Whether ``found`` is the status of a value file as this store writes one: a regular file with no other
    name. A hard link is not one: it would carry reads (and, adopted, the capacity) to a file outside ``path``."""
    return stat.S_ISREG(found.st_mode) and found.st_nlink <= 1


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symlink"}


def _what(found: os.stat_result) -> str:
    """What ``found`` is the status of, in words (``a FIFO``, ``a regular file with 2 names``)."""
    if stat.S_ISREG(found.st_mode):
        return f"a regular file with {plural(found.st_nlink, 'name')}"
    return _KINDS.get(stat.S_IFMT(found.st_mode), f"of type {stat.S_IFMT(found.st_mode):o}")


def _status(filename: str, folder: int) -> os.stat_result | None:
    """The status of ``filename`` in the directory ``folder`` (a symlink not followed), or ``None`` if it is gone;
    raises ``OSError`` when it cannot be looked at (a directory we may not search, an I/O error)."""
    try:
        return os.lstat(filename, dir_fd=folder)
    except FileNotFoundError:
        return None


def _same_file(filename: str, folder: int, held: os.stat_result) -> bool:
    """Whether ``filename`` in ``folder`` (not followed) still leads to the open file ``held`` describes; raises
    ``OSError`` when it cannot be looked at."""
    now = _status(filename, folder)
    return now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _unlink_quietly(filename: str, folder: int) -> None:
    with contextlib.suppress(OSError):  # already gone, or the file system refuses: the next opener reaps it
        os.unlink(filename, dir_fd=folder)


def _largest_file() -> float:
    """The most bytes this process may write to a file (``RLIMIT_FSIZE``'s soft limit; ``inf`` without one)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return math.inf if soft == resource.RLIM_INFINITY else soft


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
