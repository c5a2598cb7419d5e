"""A minimal RESP2 connection: pipelined commands written from, and bulk replies read into, the caller's buffers.

Hand-written because the measured gap is large (BENCHMARKS "Shared tier"): valkey-py and redis-py turn every
reply into a fresh ``bytes`` and a pipeline of 1,000 EXISTS costs them several milliseconds; ``recv_into``
the destination and writing the caller's buffers as they are move values without a copy. Only what the
block store needs is here: connect (TLS, AUTH, SELECT), the server's identity (``run_id`` and a marker key,
asked in the first commands' round trip), replies, CLUSTER slots and MOVED/ASK redirects; routing over nodes is
:mod:`kvkit.backends.blockstore.link`'s.

Every operation is bounded by the connection's ``deadline`` (``time.monotonic()`` seconds), a whole
call's, however slowly the bytes trickle: the socket is non-blocking, every read and write is tried
first and waits (``poll``) only for what is not there yet, never past the deadline; no receive starts
past it, even of bytes that are there (a reply arriving faster than it is read). A deadline that
passes raises :class:`DeadlineExceeded`; a server that closes the connection raises
:class:`ConnectionClosedError`, a refusing one ``ConnectionError`` (all ``OSError``), as does a reply that is
not RESP.
"""

from __future__ import annotations

import binascii
import contextlib
import errno
import fcntl
import ipaddress
import math
import os
import re
import select
import socket
import ssl
import struct
import termios
import threading
import time
from collections.abc import Callable, Sequence

import attrs

from kvkit.backends.blockstore._common import Descriptors

__all__ = ["MAX_LOOKUPS", "MAX_REPLY_BULK", "MAX_REPLY_DEPTH", "MAX_REPLY_ITEMS", "MISSING", "SLOTS", "Address",
           "ConnectOptions", "Connection", "ConnectionClosedError", "DeadlineExceeded", "LookupsBusy", "NoRoom",
           "Openings", "ProtocolRefusal", "Redirect", "ServerError", "ShortOfDescriptors", "SlotUnserved", "command",
           "error_reply", "key_slot", "node_host"]

Address = tuple[str, int]
_CRLF = b"\r\n"
_BUFFER = 1 << 16
_SMALL = 16 << 10  # buffers below this are joined before writing over TLS
_IOV_MAX = 1024  # buffers per sendmsg (Linux IOV_MAX)
_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
_HOST = re.compile(rb"[!-~]*")  # printable ASCII without spaces: what a host name, an address or "?" is
_ERROR_CODE = re.compile(r"[A-Z]{2,20}")  # the first word of an error reply: ERR, WRONGPASS, NOPERM...
_FAIR_CONNECT = 0.9  # a connect that timed out with this share of its budget or more is its node's fault
_UNACKED = getattr(termios, "TIOCOUTQ", None)  # Linux: bytes sent that the peer has not acknowledged yet
_SAMPLE_S = 0.05  # how often a wait looks whether the server took more of the bytes still on their way to it
SLOTS = 16384
"""Hash slots of a Cluster."""
MAX_REPLY_BULK = 64 << 20
"""The most bytes one reply :meth:`Connection.reply` reads holds, its bulks and lines together (a CLUSTER SLOTS
answer, an INFO text, a test's GET)."""
MAX_REPLY_ITEMS = 1 << 20
"""The most array elements one reply :meth:`Connection.reply` reads holds, at every depth together (CLUSTER SLOTS of
16384 ranges with two replicas each: about half a million)."""
MAX_REPLY_DEPTH = 16
"""The deepest nesting of arrays :meth:`Connection.reply` reads (CLUSTER SLOTS nests 4 deep)."""
MAX_LOOKUPS = 64
"""The most host names a process resolves at once, each on a thread of its own (a Cluster's host names resolve in
milliseconds each, so this many at once serve its 1,000 nodes well within a deadline; a name server that never
answers, for ever new names that redirects make up, holds at most this many threads; one more name fails its
connection at once, :class:`LookupsBusy`)."""


class ServerError(Exception):
    """An error reply (``-ERR ...``) other than a redirect."""


class ProtocolRefusal(ServerError):  # noqa: N818 - a reply, as ServerError is
    """``-ERR Protocol error: ...``: the server refused a command's framing (a bulk longer than its
    ``proto-max-bulk-len``: ``invalid bulk length``) and closes the connection after this reply, unread
    commands and all: the command's failure, and the reason the connection breaks right after."""


class SlotUnserved(ServerError):  # noqa: N818 - a reply, as ServerError is
    """``-CLUSTERDOWN ...``: the node serves no slot of the key (it left the Cluster, or the Cluster is down):
    the key's failure, no evidence against the node, and a sign that the slot map is stale."""


class DeadlineExceeded(TimeoutError):  # noqa: N818
    """The call's deadline passed before the server sent (or took) what the call needs.

    ``stalled_s``: how long the connection had been waiting without receiving a byte, or the server taking one
    of those sent, when it gave up (a node that trickles bytes, or a link that crawls, is slow; one that takes
    and sends nothing for long is stalled).
    """

    def __init__(self, message: str, stalled_s: float) -> None:
        super().__init__(message)
        self.stalled_s = stalled_s


class LookupsBusy(DeadlineExceeded):
    """A host name not resolved because :data:`MAX_LOOKUPS` others are being resolved already (each on a thread that
    lives as long as its name servers take): the node was not reached, which is no evidence against it, as a
    deadline that passed before the node was reached is none (``stalled_s`` 0)."""


class ShortOfDescriptors(DeadlineExceeded):
    """No socket made for a connection because this process is out of descriptors or memory (``EMFILE``,
    ``ENFILE``, ``ENOBUFS``, ``ENOMEM``): the node was not reached, which is no evidence against it (as
    :class:`LookupsBusy`); the call's keys fail, and the next call tries again."""


_SHORT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class ConnectionClosedError(ConnectionError):
    """The server closed the connection (an end of file or a reset) while a call waited on its replies.

    ``stalled_s``: how long the connection had been waiting without receiving a byte when the close came (a
    server silent for long that then closes is stalled, as one that never answers is).
    """

    def __init__(self, message: str, stalled_s: float) -> None:
        super().__init__(message)
        self.stalled_s = stalled_s


class NoRoom(ConnectionRefusedError):  # noqa: N818 - a refusal, as ConnectionRefusedError is
    """``-ERR max number of clients reached``: the server has its ``maxclients`` clients and closes this new
    connection. Evidence against the node unless it serves other connections of the same store (see
    :class:`~kvkit.backends.blockstore.link.NodeHealth`): then it is full, not down, and only the link that
    could not connect fails its keys."""


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
    return binascii.crc_hqx(key, 0) % SLOTS


@attrs.frozen
class ConnectOptions:
    """How to reach and log in to every node: TLS context, credentials, database, timeouts.

    ``connect_timeout_s`` bounds connecting and logging in; ``request_timeout_s`` is the deadline of a
    whole call (a ``Connection`` made without one gets that long from its creation).
    """

    connect_timeout_s: float
    request_timeout_s: float
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    db: int = 0
    tls: ssl.SSLContext | None = None

    @property
    def connect_budget_s(self) -> float:
        """What connecting and logging in may take: ``connect_timeout_s``, at most a call's deadline (a connect
        always cut short by the deadline would never time out on its own, never counting against its node)."""
        return min(self.connect_timeout_s, self.request_timeout_s)


class Connection:
    """One non-blocking connection with a small read buffer; bulk replies bypass it into caller buffers.

    ``deadline`` bounds every operation (:meth:`renew` moves it forward for each call; without one,
    the connection gets ``connect_timeout_s + request_timeout_s`` from its creation).
    """

    def __init__(self, address: Address, options: ConnectOptions, deadline: float | None = None,
                 openings: Openings | None = None) -> None:
        start = time.monotonic()
        self.deadline = start + options.connect_timeout_s + options.request_timeout_s if deadline is None \
            else deadline
        budget = options.connect_budget_s
        timeout = min(budget, self.deadline - start)
        if timeout <= 0:
            raise DeadlineExceeded("timed out: the call's deadline passed before connecting", 0.0)
        openings = Openings() if openings is None else openings
        try:
            sock = _connect(address, timeout, openings)  # held in ``openings`` until logged in
        except TimeoutError as exc:  # a short budget running out is not the node's fault
            raise _connect_timeout(exc, timeout, budget, 0.0) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if options.tls is not None:  # the handshake gets what the connect left of `timeout`
                shaking = time.monotonic()
                left = start + timeout - shaking
                try:
                    if left <= 0:
                        raise TimeoutError(f"timed out connecting to {address[0]}:{address[1]} before the TLS "
                                           f"handshake")
                    sock.settimeout(left)
                    # The handshake is ours to start, so that a failed one leaves the socket open until let go.
                    raw, sock = sock, options.tls.wrap_socket(sock, server_hostname=address[0],
                                                              do_handshake_on_connect=False)
                    openings.swap(raw, sock)
                    sock.do_handshake()
                except TimeoutError as exc:  # the handshake's silence, judged as a connect's
                    raise _connect_timeout(exc, timeout, budget, time.monotonic() - shaking) from None
            sock.setblocking(False)
        except BaseException:
            openings.let_go(sock)
            sock.close()
            raise
        self.sock, self._openings = sock, openings
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._events = select.POLLIN
        self._waiting_since: float | None = None  # since when nothing moved, while waiting
        self._unacked = 0  # bytes sent that the server had not acknowledged when that was last seen
        self._written = 0  # bytes the last send wrote, less those of the identity's commands sent ahead (see sent)
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0
        self._crlf = memoryview(bytearray(2))  # where a bulk's closing CRLF is received
        self._asking: _Identity | None = None  # identity to ask ahead of the next commands
        self._told: _Identity | None = None  # identity asked: its replies are read first
        self._planting: _Identity | None = None  # a marker found missing, planted when the next call starts
        try:
            login = time.monotonic() + budget
            deadline, self.deadline = self.deadline, min(self.deadline, login)
            if options.password is not None:
                user = [options.username.encode()] if options.username else []
                refusal = None  # the server's error may quote the password: raised below without it as context
                try:
                    self.call(b"AUTH", *user, options.password.encode())
                except ServerError as exc:
                    refusal = _login_refusal(exc)
                if refusal is not None:
                    raise ServerError(refusal)
            if options.db:
                self.call(b"SELECT", str(options.db).encode())
            self.deadline = deadline
        except ServerError as exc:
            self.close()
            raise ConnectionRefusedError(f"{address[0]}:{address[1]} refused the login: {exc}") from None
        except DeadlineExceeded as exc:  # a login that had the budget, or nearly, and timed out: the node's fault
            self.close()
            had = self.deadline - (login - budget)
            raise _connect_timeout(TimeoutError(f"timed out logging in to {address[0]}:{address[1]}: no answer in "
                                                f"{had:.3g} s"), had, budget, exc.stalled_s) from None
        except BaseException:
            self.close()
            raise
        openings.let_go(sock)  # logged in: its link's from here, which lets go of it in a forked child

    def ask_identity(self, told: Told, marker: bytes | None = None, *, plant: bool = False) -> None:
        """Ask the server's identity with the next command sent, in the same round trip (its replies are read
        ahead of that command's), and give ``told`` what it answered: its ``run_id`` (``INFO server``: Valkey
        and Redis give every run of a server a new one), and, given a ``marker`` key, the token held there.

        Without ``plant``, the marker is only read (``GET``, a read: served while the server holds writes, as
        ``CLIENT PAUSE WRITE`` does, so a connection opened then serves reads at once); one found missing (never
        planted, or a server that lost its data) is told as :data:`MISSING` at once and planted when the next
        call on this connection starts, ahead of its commands. With ``plant`` (a marker last found missing), it
        is read and planted in the first round trip. A plant is ``SET marker <random token> NX GET``: the token
        already there, else this connection's, set now (a deferred one tells the ``run_id`` told before). Either
        is ``None`` where the server does not tell it (``INFO`` refused: an ACL that does not grant it, a command
        renamed away; the marker's command refused or redirected; a deferred plant refused tells nothing)."""
        self._asking = _Identity(told, marker, plant)

    def _read_identity(self) -> None:
        """Read the replies of the identity asked ahead of the commands (:meth:`ask_identity`) and tell it."""
        asked, self._told = self._told, None
        assert asked is not None, "an identity was asked"
        run_id = asked.run_id
        if asked.info:
            info = self._reply(0, _Allowance())
            found = _RUN_ID.search(info) if isinstance(info, bytes) else None
            run_id = found.group(1) if found else None
        held = None
        if asked.marker is not None:
            reply = self._reply(0, _Allowance())
            if asked.plant:
                held = asked.offered if reply is None else reply if isinstance(reply, bytes) else None
            elif reply is None:
                held = MISSING
                self._planting = _Identity(asked.told, asked.marker, True, run_id=run_id, info=False)
            elif isinstance(reply, bytes):
                held = reply
        if asked.info or held is not None:
            asked.told(run_id, held)

    def renew(self, deadline: float) -> None:
        """Start a new call, bounded by ``deadline``, on a connection that holds no reply: every reply so far was
        read by the call that asked for it, so one there now is a reply to no command (``ConnectionError``: taken
        for the next command's, it would answer that one; but an error line that says why the server serves the
        connection nothing, as a server with its ``maxclients`` clients sends a new one unasked, raises what
        :func:`error_reply` raises for it: :class:`NoRoom`), and an end of file is a connection the server closed
        while idle (:class:`ConnectionClosedError`). Looking costs one receive that does not wait."""
        self.deadline = deadline
        self._waiting_since = None
        if self._planting is not None:
            self._asking, self._planting = self._planting, None
        if self._lo == self._hi:
            self._lo = self._hi = 0
            try:
                self._hi = self.sock.recv_into(self._view)
            except _WOULD_BLOCK:
                return
            except ConnectionResetError as exc:
                raise self._closed(f"the server reset the connection: {exc}") from None
            if not self._hi:
                raise self._closed("the server closed the connection")
        end = self._buf.find(_CRLF, self._lo, self._hi)
        if self._buf[self._lo:self._lo + 1] == b"-" and end >= 0:
            error_reply(bytes(self._view[self._lo + 1:end]))  # raises for a refusal of the connection
        raise ConnectionError(f"protocol error: the server sent {self._hi - self._lo} bytes no command asked for: "
                              f"{bytes(self._view[self._lo:self._lo + 40])!r}")

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
        How many bytes of ``parts`` it wrote, also when it raises, is :attr:`sent`.
        """
        self._written = 0
        if self._asking is not None and parts:  # ask_identity's commands go first, with a command read after them
            asked = self._asking
            ahead = [_INFO_SERVER] if asked.info else []
            if asked.marker is not None and asked.plant:
                asked.offered = os.urandom(16).hex().encode()
                ahead.append(command(b"SET", asked.marker, asked.offered, b"NX", b"GET"))
            elif asked.marker is not None:
                ahead.append(command(b"GET", asked.marker))
            self._told, self._asking = asked, None
            self._written = -sum(map(len, ahead))
            parts = [*ahead, *parts]
        if isinstance(self.sock, ssl.SSLSocket):
            self._send_tls(parts)
            return
        rest = parts
        while rest:
            try:
                sent = self.sock.sendmsg(rest if len(rest) <= _IOV_MAX else rest[:_IOV_MAX])
            except BlockingIOError:
                self._wait(select.POLLOUT)
                continue
            self._waiting_since = None
            self._written += sent
            rest = _unsent(rest, sent)

    @property
    def sent(self) -> int:
        """Bytes of the parts given to the last :meth:`send` written to the socket (they left this process): all
        of them once it returned; those written before it raised (a deadline, a closed connection) if it did."""
        return max(0, self._written)

    def _send_tls(self, parts: Sequence[bytes | memoryview]) -> None:
        small: list[bytes | memoryview] = []
        for part in parts:
            if len(part) < _SMALL:
                small.append(part)
                continue
            if small:
                self._send_all(b"".join(small))
                small.clear()
            self._send_all(part)
        if small:
            self._send_all(b"".join(small))

    def _send_all(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            try:
                sent = self.sock.send(view)
            except _WOULD_BLOCK as exc:
                self._wait(select.POLLIN if isinstance(exc, ssl.SSLWantReadError) else select.POLLOUT)
                continue
            self._waiting_since = None
            self._written += sent
            view = view[sent:]

    def line(self, ahead: int = _BUFFER) -> bytes:
        """The next reply line, without its CRLF.

        When the read buffer holds no whole line, the first receive takes at most ``ahead`` bytes: a
        caller that knows how long the line is leaves the bulk after it in the socket, so
        :meth:`read_bulk` receives it straight into its destination (not through the read buffer).
        """
        if self._told is not None:
            self._read_identity()
        limit = ahead
        while True:
            end = self._buf.find(_CRLF, self._lo, self._hi)
            if end >= 0:
                out = bytes(self._view[self._lo:end])
                self._lo = end + 2
                return out
            self._fill(limit)
            limit = _BUFFER

    def reply(self) -> object:
        """The next reply: bytes (simple or bulk), int, list, ``None`` (nil), ``ServerError`` or ``Redirect``.

        For the small replies read whole (EXISTS, PING, AUTH, CLUSTER SLOTS): a reply of more than
        :data:`MAX_REPLY_BULK` bytes or :data:`MAX_REPLY_ITEMS` array elements, or of arrays nested deeper than
        :data:`MAX_REPLY_DEPTH`, raises ``ConnectionError`` (no server sends them; reading them would raise
        ``MemoryError`` or ``RecursionError``). A bulk or an array is refused by the length it announces,
        before its bytes arrive; a bulk's memory grows with the bytes that arrived (64 KiB ahead of them at
        most), never with the length announced. Values go through :meth:`read_bulk`, into the caller's buffers.
        """
        return self._reply(0, _Allowance())

    def _reply(self, depth: int, left: _Allowance) -> object:
        """The next reply, charged to ``left`` (what is left of the whole reply's bytes and elements)."""
        head = self.line()
        left.take(len(head), 0)
        kind, rest = head[:1], head[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return _number(head)
        if kind == b"$":
            n = _number(head)
            if n < 0:
                return None
            left.take(n, 0)
            out = bytearray()
            while len(out) < n:  # grown as the bytes arrive: a length announced costs no memory before them
                piece = bytearray(min(n - len(out), _BUFFER))
                self._read_exactly([memoryview(piece)])
                out += piece
            self.read_bulk([])
            return bytes(out)
        if kind == b"*":
            n = _number(head)
            if depth >= MAX_REPLY_DEPTH:
                raise ConnectionError(f"protocol error: arrays nested deeper than {MAX_REPLY_DEPTH}")
            if n < 0:
                return None
            left.take(0, n)
            return [self._reply(depth + 1, left) for _ in range(n)]
        if kind == b"-":
            return error_reply(rest)
        raise ConnectionError(f"protocol error: unexpected reply {head[:80]!r}")

    def read_bulk(self, views: Sequence[memoryview]) -> None:
        """Fill every buffer of ``views`` exactly, in order, then consume the bulk's closing CRLF.

        What the read buffer holds is copied first; the rest is received straight into the
        buffers: on a plain socket one ``recvmsg_into`` scatters into all of them and the CRLF (a
        value's header row, payload and CRLF in one system call), resumed where it stopped; a TLS
        socket has no ``recvmsg_into``: one buffer at a time. A bulk not closed by CRLF raises
        ``ConnectionError`` (the connection is out of step).
        """
        self._read_exactly([*views, self._crlf])
        if self._crlf != _CRLF:
            raise ConnectionError(f"protocol error: a bulk reply ended with {bytes(self._crlf)!r}, not CRLF")

    def _read_exactly(self, views: Sequence[memoryview]) -> None:
        """Fill every buffer of ``views`` exactly, in order: the read buffer's bytes first, then the socket's."""
        rest: list[memoryview] = []
        for view in views:
            n = min(self._hi - self._lo, view.nbytes)
            if n:
                view[:n] = self._view[self._lo:self._lo + n]
                self._lo += n
            if n < view.nbytes:
                rest.append(view[n:])
        i = 0
        while i < len(rest):
            got = self._recv_scatter(rest[i:i + _IOV_MAX])
            while got:  # drop what was filled; a partly filled buffer keeps its empty tail
                size = rest[i].nbytes
                if got < size:
                    rest[i] = rest[i][got:]
                    break
                got -= size
                i += 1

    def small_ints(self, n: int) -> list[int] | None:
        """``n`` replies if all are ``:0``/``:1`` (consumed), else ``None`` (nothing consumed)."""
        if self._told is not None:
            self._read_identity()
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
        """Shut the socket down (waking a wait on it in another thread) and close it; idempotent."""
        self._openings.let_go(self.sock)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def release(self) -> None:
        """Close this process's descriptor of the socket, never shutting it down: a process that shares it
        through fork keeps its connection."""
        self.sock.close()

    def _fill(self, limit: int = _BUFFER) -> None:
        """Receive at most ``limit`` more bytes into the read buffer (at least one)."""
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):
            if self._lo == 0:
                raise ConnectionError("protocol error: a reply line longer than 64 KiB")
            self._buf[:self._hi - self._lo] = self._buf[self._lo:self._hi]
            self._lo, self._hi = 0, self._hi - self._lo
        self._hi += self._recv_into(self._view[self._hi:self._hi + limit])

    def _recv_scatter(self, views: list[memoryview]) -> int:
        """Receive what is there into ``views`` in order (at least one byte), waiting for it until the deadline."""
        if isinstance(self.sock, ssl.SSLSocket):
            return self._recv_into(views[0])
        while True:
            self._in_time()
            try:
                got = self.sock.recvmsg_into(views)[0]
            except BlockingIOError:
                self._wait(select.POLLIN)
                continue
            except ConnectionResetError as exc:
                raise self._closed(f"the server reset the connection: {exc}") from None
            if not got:
                raise self._closed("the server closed the connection")
            self._waiting_since = None
            return got

    def _recv_into(self, view: memoryview) -> int:
        """Receive what is there into ``view`` (at least one byte), waiting for it until the deadline."""
        while True:
            self._in_time()
            try:
                got = self.sock.recv_into(view)
            except _WOULD_BLOCK as exc:
                self._wait(select.POLLOUT if isinstance(exc, ssl.SSLWantWriteError) else select.POLLIN)
                continue
            except ConnectionResetError as exc:
                raise self._closed(f"the server reset the connection: {exc}") from None
            if not got:
                raise self._closed("the server closed the connection")
            self._waiting_since = None
            return got

    def _in_time(self) -> None:
        """Raise :class:`DeadlineExceeded` once the deadline passed, even with bytes there to receive: a reply that
        arrives faster than it is read (a million array elements, a bulk of gigabytes to skip) ends with the
        call's deadline too (``stalled_s``: how long nothing moved, 0 while bytes were there)."""
        now = time.monotonic()
        if now >= self.deadline:
            stalled = 0.0 if self._waiting_since is None else now - self._waiting_since
            raise DeadlineExceeded("timed out: the call's deadline passed", stalled)

    def _closed(self, why: str) -> ConnectionClosedError:
        """``ConnectionClosedError`` saying ``why``, with how long the connection had waited without a byte."""
        stalled = 0.0 if self._waiting_since is None else time.monotonic() - self._waiting_since
        return ConnectionClosedError(why, stalled)

    def _wait(self, events: int) -> None:
        """Wait until the socket is ready for ``events`` or the deadline passes (``DeadlineExceeded``).

        Bytes the server takes count as progress as bytes it sends do: while some sent are not acknowledged yet
        (a put whose bytes crawl up a slow link, its reply awaited), the wait looks every ``_SAMPLE_S`` whether
        their number fell, and if it did the connection is not stalled since (Linux: ``TIOCOUTQ``).
        """
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
            self._unacked = self._unacked_bytes()
        left = self.deadline - now
        if left <= 0:
            raise DeadlineExceeded("timed out: the call's deadline passed", now - self._waiting_since)
        if events != self._events:
            self._poll.modify(self.sock, events)
            self._events = events
        self._poll.poll(math.ceil((min(left, _SAMPLE_S) if self._unacked else left) * 1000))
        if self._unacked:
            unacked = self._unacked_bytes()
            if unacked < self._unacked:
                self._waiting_since, self._unacked = time.monotonic(), unacked

    def _unacked_bytes(self) -> int:
        """Bytes sent on this connection that the server has not acknowledged yet (0 where that is not known)."""
        if _UNACKED is None:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), _UNACKED, b"\0\0\0\0"))[0]
        except (OSError, ValueError):  # closed meanwhile (a close from another thread)
            return 0


@attrs.define
class _Allowance:
    """What is left of one reply's :data:`MAX_REPLY_BULK` bytes and :data:`MAX_REPLY_ITEMS` elements."""

    size: int = MAX_REPLY_BULK
    items: int = MAX_REPLY_ITEMS

    def take(self, size: int, items: int) -> None:
        """Charge ``size`` bytes and ``items`` elements; ``ConnectionError`` when the reply would hold more."""
        if size > self.size:
            raise ConnectionError(f"protocol error: a reply longer than {MAX_REPLY_BULK} bytes (its next part "
                                  f"alone: {size})")
        if items > self.items:
            raise ConnectionError(f"protocol error: a reply of more than {MAX_REPLY_ITEMS} array elements (its "
                                  f"next array alone: {items})")
        self.size -= size
        self.items -= items


_TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", None)  # Linux only


def _connect_timeout(exc: TimeoutError, timeout: float, budget: float, silent_s: float) -> TimeoutError:
    """What a connect, TLS handshake or login (AUTH, SELECT) that timed out after ``timeout`` seconds of a ``budget``
    raises: ``exc`` (evidence against the node) when it had the budget, or nearly; else :class:`DeadlineExceeded`
    (the call's deadline cut it short) with ``silent_s`` as its ``stalled_s``: how long the handshake or login
    waited (a connect: 0)."""
    if timeout >= _FAIR_CONNECT * budget:
        return exc
    return DeadlineExceeded(f"timed out connecting: {exc}", silent_s)


@attrs.define(eq=False)
class Openings:
    """The sockets one owner's threads are opening connections on (the connect, a TLS handshake, the login), not
    yet connections a link holds: closing the owner (:meth:`shut`) shuts each down, which wakes its wait at once
    (the connection fails instead of running out its connect budget; one held after :meth:`shut` is shut down at
    once), and a child forked meanwhile closes its copies of their descriptors (:data:`_OPENING`, process-wide: a
    link there lets go of its connections only). A socket is held from just after it is made until its
    connection is logged in or closed. Thread-safe."""

    _held: dict[socket.socket, int] = attrs.field(factory=dict, init=False)  # socket -> its descriptor
    _shut: bool = attrs.field(default=False, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def hold(self, sock: socket.socket) -> None:
        fd = _OPENING.hold(sock.fileno())
        with self._lock:
            self._held[sock] = fd
            shut = self._shut
        if shut:
            _shut_down(sock)

    def swap(self, old: socket.socket, new: socket.socket) -> None:
        """Hold ``new`` (a TLS socket wrapping ``old``: the same descriptor) in ``old``'s place."""
        with self._lock:
            self._held[new] = self._held.pop(old)

    def let_go(self, sock: socket.socket) -> None:
        """Hold ``sock`` no more (one not held: nothing), before it is closed or once it is logged in."""
        with self._lock:
            fd = self._held.pop(sock, None)
        if fd is not None:
            _OPENING.let_go(fd)

    def shut(self) -> None:
        with self._lock:
            self._shut = True
            held = list(self._held)
        for sock in held:
            _shut_down(sock)


def _shut_down(sock: socket.socket) -> None:
    """Shut ``sock`` down at the socket's level (a TLS socket's handshake, in another thread, then fails), or do
    nothing if it is no longer open."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


_OPENING = Descriptors()
"""The descriptors of every :class:`Openings`' sockets in this process: a child forked meanwhile closes its copies."""
os.register_at_fork(after_in_child=_OPENING.close_copies)


def _connect(address: Address, timeout: float, openings: Openings) -> socket.socket:
    """``socket.create_connection(address, timeout)``, name resolution included in ``timeout`` (:func:`_resolve`),
    the socket held in ``openings`` (its caller lets go of it), except that each of the name's addresses, in
    order, gets an equal share of what is left of ``timeout`` (the last all of it), so one that never answers
    leaves the others time, and a loopback peer gets Reno congestion control.

    Set before the handshake, so the system's default (BBR, where it is the default) never starts on the
    socket: BBR paces a connection at its estimate of the path's bandwidth, and on loopback that
    estimate follows the CPU time other processes leave, so a long-lived connection stays paced below
    what it can move, at a higher CPU cost per byte (BENCHMARKS.md, "Shared tier throughput"). Reno
    does not pace. A system that refuses Reno keeps its default. Other peers keep the system's choice.
    """
    host, port = address
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    peers = _resolve(host, port, timeout)
    for i, (family, kind, proto, _, peer) in enumerate(peers):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            if exc.errno in _SHORT:
                raise ShortOfDescriptors(f"no socket for {host}:{port}: {exc.strerror}", 0.0) from None
            raise
        openings.hold(sock)  # until its connection is logged in (Connection)
        try:
            if _TCP_CONGESTION is not None and ipaddress.ip_address(peer[0]).is_loopback:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, b"reno")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out connecting to {host}:{port}")
            sock.settimeout(left / (len(peers) - i))
            sock.connect(peer)
            return sock
        except OSError as exc:
            openings.let_go(sock)
            sock.close()
            last = exc
    raise last if last is not None else OSError(f"getaddrinfo found no address for {host}:{port}")


@attrs.define(eq=False)
class _Lookup:
    """One name resolution in flight on its own thread: its outcome once ``done`` is set."""

    done: threading.Event = attrs.field(factory=threading.Event)
    outcome: list[tuple] | OSError | None = None


_LOOKUPS: dict[Address, _Lookup] = {}  # the resolutions in flight, one per (host, port)
_LOOKUPS_LOCK = threading.Lock()


def _forget_lookups() -> None:
    """In a forked child: the resolutions in flight are the parent's threads, not this process's (a call waiting
    for one would never get its answer), and the lock may be held by one of them."""
    global _LOOKUPS_LOCK
    _LOOKUPS.clear()
    _LOOKUPS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_lookups)


def _resolve(host: str, port: int, timeout: float) -> list[tuple]:
    """``socket.getaddrinfo(host, port)`` for a stream socket, answered within ``timeout`` (else ``TimeoutError``).

    A numeric address is answered at once. A name is resolved on a daemon thread: the system resolver
    waits on its name servers as long as its configuration says (5 s a try), whatever the call's
    deadline, so a host whose name servers do not answer costs the call its connect timeout, not the
    resolver's. Calls for a name whose resolution is still in flight wait for that one: however often
    they come, a name has at most one thread, which ends when the resolver answers or gives up. At most
    :data:`MAX_LOOKUPS` names are resolved at once in a process, however many names servers' redirects
    make up: one more raises :class:`LookupsBusy` at once. A child forked while one was in flight resolves
    the name afresh.
    """
    try:
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    with _LOOKUPS_LOCK:
        lookup = _LOOKUPS.get((host, port))
        if lookup is None:
            if len(_LOOKUPS) >= MAX_LOOKUPS:
                raise LookupsBusy(f"{host!r} not resolved: {MAX_LOOKUPS} names are being resolved already", 0.0)
            lookup = _LOOKUPS[(host, port)] = _Lookup()
            try:
                threading.Thread(target=_look_up, args=(host, port, lookup), name="kvkit-resolve",
                                 daemon=True).start()
            except BaseException:  # no thread (a pids limit): no resolution in flight for later calls to wait on
                del _LOOKUPS[(host, port)]
                raise
    if not lookup.done.wait(timeout):
        raise TimeoutError(f"timed out resolving {host!r} (its name servers did not answer in {timeout:.3g} s)")
    if isinstance(lookup.outcome, OSError):
        raise lookup.outcome
    assert lookup.outcome is not None, "a finished lookup has an outcome"
    return lookup.outcome


def _look_up(host: str, port: int, lookup: _Lookup) -> None:
    """Resolve ``host`` into ``lookup`` (on its own thread), then let later calls start a fresh resolution (whatever
    the resolver raised: a resolution in flight always ends)."""
    try:
        lookup.outcome = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except OSError as exc:
        lookup.outcome = exc
    finally:
        with _LOOKUPS_LOCK:
            del _LOOKUPS[(host, port)]
        lookup.done.set()


def _unsent(parts: Sequence[bytes | memoryview], sent: int) -> Sequence[bytes | memoryview]:
    """What a write of ``sent`` bytes left of ``parts``: a partly written buffer as its tail, empty ones dropped."""
    for i, part in enumerate(parts):
        size = part.nbytes if isinstance(part, memoryview) else len(part)
        if sent < size:
            return [memoryview(part).cast("B")[sent:], *parts[i + 1:]] if sent else parts[i:]
        sent -= size
    return ()


def _number(head: bytes) -> int:
    try:
        return int(head[1:])
    except ValueError:
        raise ConnectionError(f"protocol error: unexpected reply {head[:80]!r}") from None


def _login_refusal(exc: ServerError) -> str:
    """What a refused ``AUTH`` is shown as: the reply's error code (``WRONGPASS``, ``ERR``...), never its text.

    A server may quote the command's arguments in its reply (an ``AUTH`` it does not know, renamed away
    or behind a proxy, answers ``ERR unknown command 'AUTH', with args beginning with: '<password>'``),
    and no rule can find every shape of the password in such text (quoted, escaped, cut short).
    """
    code = str(exc).split(maxsplit=1)[0] if str(exc).strip() else ""
    shown = code if _ERROR_CODE.fullmatch(code) else "an error"
    return f"{shown} (the server's message is not shown: it may quote the password)"


MISSING = b""
"""The token told for a marker key found missing (real tokens are 32 hex digits)."""
Told = Callable[[bytes | None, bytes | None], None]
"""What :meth:`Connection.ask_identity` tells: the server's ``run_id`` and the marker's token (:data:`MISSING`
for a marker found missing; each ``None`` where the server does not tell it)."""


@attrs.define
class _Identity:
    """An identity to ask (:meth:`Connection.ask_identity`): whom to tell, the marker key, whether the marker is
    planted or only read, the token ``offered`` once a plant is sent, and whether ``INFO`` is asked too (a plant
    deferred to the next call is not: it tells the ``run_id`` told with the marker found missing)."""

    told: Told
    marker: bytes | None
    plant: bool
    run_id: bytes | None = None
    offered: bytes | None = None
    info: bool = True


_INFO_SERVER = b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n"
_RUN_ID = re.compile(rb"^run_id:([0-9a-f]{40})\r?$", re.MULTILINE)


def command(*args: bytes) -> bytes:
    """``args`` as one RESP array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


_UNUSABLE = {
    b"NOAUTH": "the connection is not logged in (the server demands a password this store was not given)",
    b"LOADING": "the server is loading its dataset and serves no command until it is done",
    b"MASTERDOWN": "the replica lost its primary and serves no stale data",
    b"BUSY": "the server is running a script or function past its busy-reply-threshold and serves no other command",
}
"""The first words of the error replies that say a node serves no command for now, with what they mean."""
_NO_ROOM = b"ERR max number of clients reached"
"""The reply of a server that has ``maxclients`` clients already, before it closes the new connection."""
_UNAUTHENTICATED = b"ERR Protocol error: unauthenticated"
"""How a server that demands a login refuses a command too large for a connection not logged in (a bulk over
16 KiB, too many arguments), before it closes the connection: its ``-NOAUTH`` for such a command."""


def error_reply(text: bytes) -> ServerError | Redirect:
    """An error line (without its ``-``) as a ``Redirect`` when it is ``MOVED``/``ASK`` to a slot (0-16383) at
    a port (1-65535) of a host (:func:`node_host`), else ``ServerError`` (a redirect out of range names no
    node: its key fails with the server's words, :func:`shown`).

    A reply saying the node serves no command for now (:data:`_UNUSABLE`: ``NOAUTH``, ``LOADING``,
    ``MASTERDOWN``, ``BUSY``; :data:`_UNAUTHENTICATED`), or no connection (:data:`_NO_ROOM`: ``maxclients``
    reached: :class:`NoRoom`), raises
    ``ConnectionRefusedError`` instead: like a refused login, that is evidence against the node
    (marked down, tried again after its retry interval), not a key's failure.
    ``MISCONF`` (writes refused, reads served) stays a ``ServerError``: it fails the writes only.
    ``ERR Protocol error`` is a :class:`ProtocolRefusal`, ``CLUSTERDOWN`` a :class:`SlotUnserved`.
    """
    parts = text.split()
    unusable = _UNUSABLE.get(parts[0]) if parts else None
    if unusable is not None:
        raise ConnectionRefusedError(f"the server answered {parts[0].decode()}: {unusable}")
    if text.startswith(_UNAUTHENTICATED):
        raise ConnectionRefusedError(f"the server answered {shown(text[:60])!r}: {_UNUSABLE[b'NOAUTH']}")
    if text.startswith(_NO_ROOM):
        raise NoRoom(f"the server answered {_NO_ROOM.decode()!r}: it has its maxclients clients and closes the "
                     f"connection")
    if len(parts) == 3 and parts[0] in (b"MOVED", b"ASK"):
        host, _, port = parts[2].rpartition(b":")
        if parts[1].isdigit() and port.isdigit() and int(parts[1]) < SLOTS and 0 < int(port) < 65536:
            with contextlib.suppress(ValueError):  # a host that is no host name names no node
                return Redirect(int(parts[1]), (node_host(host), int(port)), parts[0] == b"ASK")
    if text.startswith(b"ERR Protocol error"):
        return ProtocolRefusal(shown(text))
    if parts and parts[0] == b"CLUSTERDOWN":
        return SlotUnserved(shown(text))
    return ServerError(shown(text))


def shown(text: bytes) -> str:
    """A server's words as text to show: printable ASCII as it is, every other byte as a ``\\xNN`` escape, so no
    control sequence a server sends (a screen clear, a clipboard write) reaches a terminal or a log raw."""
    return "".join(chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}" for b in text)


def node_host(raw: bytes) -> str:
    """A host a server names (a slot map's endpoint or ``ip``) as text; ``ValueError`` unless it is printable ASCII
    without spaces (a host name, an address, ``?``): anything else names no node, and is never looked up or shown."""
    if not _HOST.fullmatch(raw):
        raise ValueError(f"a node named {shown(raw)!r:.80}, which is no host name")
    return raw.decode()
