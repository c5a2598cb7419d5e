"""A minimal RESP2 client: pipelined EXISTS/SET/GET with replies received straight into the caller's buffers.

Hand-written because the measured gap is large (DESIGN §8, BENCHMARKS "Shared tier"): valkey-py and
redis-py turn every reply into a fresh ``bytes`` (0.3-0.9 GB/s for 2 MiB GETs on the 2-core VM) and a
pipeline of 1,000 EXISTS costs them 4.5-12 ms; ``recv_into`` the destination and writing the
caller's buffers as they are reach 1.9-3.0 GB/s and about 1 ms. Only what the block store needs is here:
connect (TLS, AUTH, SELECT), pipelines per node, CLUSTER SLOTS, MOVED/ASK redirects.

Every socket operation is bounded by the request timeout: a server that makes no progress for that
long raises ``TimeoutError``; a closed or refusing one raises ``ConnectionError`` (both ``OSError``).
"""

from __future__ import annotations

import binascii
import contextlib
import socket
import ssl
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import cast

import attrs

__all__ = ["Address", "ConnectOptions", "Connection", "Link", "Redirect", "ServerError", "key_slot"]

Address = tuple[str, int]
_CRLF = b"\r\n"
_BUFFER = 1 << 16
_SMALL = 16 << 10  # buffers below this are joined before writing over TLS
_IOV_MAX = 1024  # buffers per sendmsg (Linux IOV_MAX)
_MAX_REDIRECTS = 5
_ASKING = b"*1\r\n$6\r\nASKING\r\n"


class ServerError(Exception):
    """An error reply (``-ERR ...``) other than a redirect."""


@attrs.frozen
class Redirect:
    """A ``-MOVED`` (the slot moved for good) or ``-ASK`` (ask once, during a migration) reply."""

    slot: int
    address: Address
    ask: bool


def key_slot(key: bytes) -> int:
    """The Cluster hash slot of ``key``: CRC16-XMODEM of its hash tag (``{...}``) or of the whole key."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return binascii.crc_hqx(key, 0) % 16384


@attrs.frozen
class ConnectOptions:
    """How to reach and log in to every node: TLS context, credentials, database, timeouts."""

    connect_timeout_s: float
    request_timeout_s: float
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    db: int = 0
    tls: ssl.SSLContext | None = None


class Connection:
    """One blocking connection with a small read buffer; bulk replies bypass it into caller buffers."""

    def __init__(self, address: Address, options: ConnectOptions) -> None:
        sock = socket.create_connection(address, timeout=options.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if options.tls is not None:
                sock = options.tls.wrap_socket(sock, server_hostname=address[0])
            sock.settimeout(options.request_timeout_s)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0
        try:
            if options.password is not None:
                user = [options.username.encode()] if options.username else []
                self.call(b"AUTH", *user, options.password.encode())
            if options.db:
                self.call(b"SELECT", str(options.db).encode())
        except ServerError as exc:
            self.close()
            raise ConnectionRefusedError(f"{address[0]}:{address[1]} refused the login: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def call(self, *args: bytes) -> object:
        """Send one command and answer its reply; an error reply raises ``ServerError``."""
        self.send([command(*args)])
        reply = self.reply()
        if isinstance(reply, ServerError):
            raise reply
        return reply

    def send(self, parts: Sequence[bytes | memoryview]) -> None:
        """Write every buffer, in order, without copying a value.

        A plain socket gets ``sendmsg`` of up to ``IOV_MAX`` buffers per call (a SET's header, the
        value's own buffers and its CRLF in one system call), resumed where a partial write stopped;
        a TLS socket has no ``sendmsg``: runs of small buffers are joined, large ones sent as they are.
        256 KiB SETs ran 1.3-1.6x faster than a ``sendall`` per buffer (BENCHMARKS.md, "the put path
        with ``sendmsg``"), 2 MiB alike.
        """
        if isinstance(self.sock, ssl.SSLSocket):
            self._send_tls(parts)
            return
        views = [memoryview(p) for p in parts if len(p)]  # an empty buffer would stall the loop below
        i = 0
        while i < len(views):
            sent = self.sock.sendmsg(views[i:i + _IOV_MAX])
            while sent:  # drop what went out; a partly written buffer keeps its unsent tail
                size = views[i].nbytes
                if sent < size:
                    views[i] = views[i][sent:]
                    break
                sent -= size
                i += 1

    def _send_tls(self, parts: Sequence[bytes | memoryview]) -> None:
        small: list[bytes | memoryview] = []
        for part in parts:
            if len(part) < _SMALL:
                small.append(part)
                continue
            if small:
                self.sock.sendall(b"".join(small))
                small.clear()
            self.sock.sendall(part)
        if small:
            self.sock.sendall(b"".join(small))

    def line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while True:
            end = self._buf.find(_CRLF, self._lo, self._hi)
            if end >= 0:
                out = bytes(self._view[self._lo:end])
                self._lo = end + 2
                return out
            self._fill()

    def reply(self) -> object:
        """The next reply: bytes (simple or bulk), int, list, ``None`` (nil), ``ServerError`` or ``Redirect``."""
        head = self.line()
        kind, rest = head[:1], head[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            out = bytearray(n + 2)
            self.read_into(memoryview(out))
            return bytes(out[:n])
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        if kind == b"-":
            return error_reply(rest)
        raise ConnectionError(f"protocol error: unexpected reply {head[:80]!r}")

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly: first from the read buffer, the rest straight from the socket."""
        n = min(self._hi - self._lo, view.nbytes)
        view[:n] = self._view[self._lo:self._lo + n]
        self._lo += n
        while n < view.nbytes:
            got = self.sock.recv_into(view[n:])
            if not got:
                raise ConnectionError("the server closed the connection")
            n += got

    def small_ints(self, n: int) -> list[int] | None:
        """``n`` replies if all are ``:0``/``:1`` (consumed), else ``None`` (nothing consumed)."""
        size = 4 * n
        while self._hi - self._lo < size:
            if self._hi == len(self._buf) and self._lo:
                self._buf[:self._hi - self._lo] = self._buf[self._lo:self._hi]
                self._lo, self._hi = 0, self._hi - self._lo
            if self._hi == len(self._buf) or self._buf.find(b"-", self._lo, self._hi) >= 0:
                return None  # too many to buffer, or an error reply among them: parse one by one
            self._fill()
        data = self._buf[self._lo:self._lo + size]
        if data[0::4] != b":" * n or data[2::4] != b"\r" * n or data[3::4] != b"\n" * n:
            return None
        self._lo += size
        return [d - 48 for d in data[1::4]]

    def skip(self, n: int) -> None:
        """Consume ``n`` bytes of a reply nobody wants (a value of the wrong size)."""
        while n:
            if self._lo == self._hi:
                self._fill()
            step = min(n, self._hi - self._lo)
            self._lo += step
            n -= step

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _fill(self) -> None:
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):
            if self._lo == 0:
                raise ConnectionError("protocol error: a reply line longer than 64 KiB")
            self._buf[:self._hi - self._lo] = self._buf[self._lo:self._hi]
            self._lo, self._hi = 0, self._hi - self._lo
        got = self.sock.recv_into(self._view[self._hi:])
        if not got:
            raise ConnectionError("the server closed the connection")
        self._hi += got


def command(*args: bytes) -> bytes:
    """``args`` as one RESP array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def error_reply(text: bytes) -> ServerError | Redirect:
    """An error line (without its ``-``) as a ``Redirect`` when it is ``MOVED``/``ASK``, else ``ServerError``."""
    parts = text.split()
    if len(parts) == 3 and parts[0] in (b"MOVED", b"ASK"):
        host, _, port = parts[2].rpartition(b":")
        return Redirect(int(parts[1]), (host.decode(), int(port)), parts[0] == b"ASK")
    return ServerError(text.decode(errors="replace"))


Encode = Callable[[list[int]], list[bytes | memoryview]]
"""Indices of keys bound for one node -> the buffers of their commands, in order."""
Read = Callable[["Connection", list[int]], list[object]]
"""A connection and the indices sent to it -> their outcomes (each may be a ``Redirect``), in order."""


@attrs.define(eq=False)
class Link:
    """Connections to one server or one Cluster, used by one thread at a time.

    ``run`` sends every key's command to its node (all nodes first, then it
    reads from each), follows MOVED (updating the slot map, refreshing it
    before the next call) and ASK redirects, and answers one outcome per key.
    Large values go in a window: a node gets chunk ``k + 1`` (about
    ``window_bytes`` of values) before chunk ``k``'s replies are read, so one
    to two chunks are in flight. A whole batch of 64-256 KiB SETs or GETs
    in flight ran 1.2-1.9x slower here (BENCHMARKS.md, "Shared tier"); 2 MiB
    values ran alike either way.
    Any ``OSError`` closes every connection and propagates: the caller fails
    the whole call as a transport failure.
    """

    seeds: tuple[Address, ...]
    cluster: bool
    options: ConnectOptions
    window_bytes: int = 256 << 10
    _conns: dict[Address, Connection] = attrs.field(factory=dict, init=False)
    _slots: list[Address] | None = attrs.field(default=None, init=False)
    _stale: bool = attrs.field(default=True, init=False)

    def run(self, keys: Sequence[bytes], encode: Encode, read: Read,
            weights: Sequence[int] | None = None) -> list[object]:
        """One outcome per key; with ``weights`` (value bytes per key), at most two chunks of about
        ``window_bytes`` each are in flight per node (see the class docstring)."""
        outcomes: list[object] = [None] * len(keys)
        if not keys:
            return outcomes
        try:
            if self.cluster and self._stale:
                self.refresh()
            pending: list[int] = list(range(len(keys)))
            asked: dict[int, Address] = {}
            for _ in range(_MAX_REDIRECTS):
                groups: dict[tuple[Address, bool], list[int]] = defaultdict(list)
                for i in pending:
                    target = asked.get(i)
                    groups[(target, True) if target else (self._node_for(keys[i]), False)].append(i)
                chunks = {group: self._chunks(indices, weights) for group, indices in groups.items()}
                pending, asked = [], {}
                for step in range(max(len(c) for c in chunks.values()) + 1):
                    for (address, ask), parts in chunks.items():  # chunk `step` goes out before `step - 1` is read
                        if step < len(parts):
                            self._conn(address).send([b for i in parts[step] for b in (_ASKING, *encode([i]))]
                                                     if ask else encode(parts[step]))
                    for (address, ask), parts in chunks.items():
                        if not 0 < step <= len(parts):
                            continue
                        indices = parts[step - 1]
                        for i, outcome in zip(indices, self._read(self._conn(address), indices, ask, read)):
                            self._settle(i, outcome, outcomes, pending, asked)
                if not pending:
                    break
            for i in pending:
                outcomes[i] = ServerError(f"still redirected after {_MAX_REDIRECTS} tries")
        except OSError:
            self.close()
            raise
        return outcomes

    def _chunks(self, indices: list[int], weights: Sequence[int] | None) -> list[list[int]]:
        if weights is None:
            return [indices]
        chunks: list[list[int]] = [[]]
        load = 0
        for i in indices:
            if load >= self.window_bytes:
                chunks.append([])
                load = 0
            chunks[-1].append(i)
            load += weights[i]
        return chunks

    def _settle(self, i: int, outcome: object, outcomes: list[object], pending: list[int],
                asked: dict[int, Address]) -> None:
        if isinstance(outcome, Redirect) and not self.cluster:
            outcome = ServerError("a MOVED/ASK reply: the server is a Cluster node; hint: use a valkey+cluster:// URL")
        if isinstance(outcome, Redirect):
            self._redirected(outcome, i, asked)
            pending.append(i)
        else:
            outcomes[i] = outcome

    @staticmethod
    def _read(conn: Connection, indices: list[int], ask: bool, read: Read) -> list[object]:
        if not ask:
            return read(conn, indices)
        outcomes = []
        for i in indices:
            if not isinstance(conn.reply(), bytes):
                raise ConnectionError("ASKING was refused")
            outcomes += read(conn, [i])
        return outcomes

    def refresh(self) -> None:
        """Read the slot map (CLUSTER SLOTS) from the first node that answers."""
        known = list(dict.fromkeys([*self.seeds, *(self._slots or ())]))
        last: Exception | None = None
        for address in known:
            try:
                reply = self._conn(address).call(b"CLUSTER", b"SLOTS")
            except (OSError, ServerError) as exc:
                self._drop(address)
                last = exc
                continue
            slots: list[Address] = [address] * 16384
            for start, end, primary, *_ in cast(list, reply):  # CLUSTER SLOTS answers an array of ranges
                host = primary[0].decode() or address[0]
                slots[start:end + 1] = [(host, int(primary[1]))] * (end + 1 - start)
            self._slots, self._stale = slots, False
            return
        raise ConnectionError(f"no Cluster node answered CLUSTER SLOTS (last error: {last})")

    def close(self) -> None:
        """Close every connection (a blocked read in another thread returns at once)."""
        for address in list(self._conns):
            self._drop(address)
        self._stale = True

    def _node_for(self, key: bytes) -> Address:
        if not self.cluster:
            return self.seeds[0]
        assert self._slots is not None, "refresh() runs before routing"
        return self._slots[key_slot(key)]

    def _redirected(self, redirect: Redirect, index: int, asked: dict[int, Address]) -> None:
        if redirect.ask:
            asked[index] = redirect.address
        else:
            assert self._slots is not None, "refresh() runs before routing"
            self._slots[redirect.slot] = redirect.address
            self._stale = True

    def _conn(self, address: Address) -> Connection:
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = Connection(address, self.options)
        return conn

    def _drop(self, address: Address) -> None:
        conn = self._conns.pop(address, None)
        if conn is not None:
            conn.close()
