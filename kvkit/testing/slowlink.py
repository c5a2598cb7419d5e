"""A slow link on loopback: a threaded TCP proxy that trickles bytes at a set rate, for fault tests.

``SlowLink(target)`` listens on ``127.0.0.1:port`` and forwards every connection to ``target``,
each direction at most ``rate`` bytes per second (``None``: as fast as they come), and holds each
reply ``latency`` seconds before its first byte moves on (a far link). Both may be changed while
connections are open. ``window`` bounds what the proxy buffers of a client's bytes (a link with
few bytes in flight, as a slow WAN has, so a client sees its sent bytes leave as the link takes
them). Every wait of its threads is short (``_TICK``), so :meth:`SlowLink.close` stops them all
and closes every socket within a bounded time.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable

import attrs

__all__ = ["SlowLink"]

_TICK = 0.02  # the longest any proxy thread waits before looking at the stop flag again
_CHUNK = 1 << 16


@attrs.define(eq=False)
class SlowLink:
    """A proxy from ``127.0.0.1:port`` to ``target`` that moves at most ``rate`` bytes/s each way.

    ``latency``: seconds the target's bytes wait before they move on whenever they come after a pause
    (nothing from the target for a tick) or after the client sent more: each reply arrives that much
    later, however it is split and however soon the client asks again. ``window``: the receive buffer
    (``SO_RCVBUF``) of the client connections, in bytes (``None``: the system's, megabytes on loopback).
    Use as a context manager, or call :meth:`start` and :meth:`close`. ``connections`` counts the
    connections accepted so far.
    """

    target: tuple[str, int]
    rate: float | None = None
    latency: float = 0.0
    window: int | None = None
    port: int = attrs.field(default=0, init=False)
    connections: int = attrs.field(default=0, init=False)
    _listener: socket.socket | None = attrs.field(default=None, init=False)
    _stop: threading.Event = attrs.field(factory=threading.Event, init=False)
    _threads: list[threading.Thread] = attrs.field(factory=list, init=False)
    _sockets: list[socket.socket] = attrs.field(factory=list, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    @property
    def address(self) -> tuple[str, int]:
        """Where clients connect."""
        return ("127.0.0.1", self.port)

    def start(self) -> SlowLink:
        """Listen (on a free port) and accept in a background thread."""
        self._listener = socket.socket()
        if self.window is not None:  # before listen(): accepted connections take it, window scaling included
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.window)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept)
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop every thread and close every socket (each thread notices within ``_TICK``)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()
        if self._listener is not None:
            self._listener.close()
        assert not any(t.is_alive() for t in threads), "a slow-link thread did not stop"

    def __enter__(self) -> SlowLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name="kvkit-slowlink", daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None, "start() listens first"
        while not self._stop.is_set():
            if not select.select([listener], [], [], _TICK)[0]:
                continue
            try:
                client, _ = listener.accept()
                server = socket.create_connection(self.target, timeout=1.0)
            except OSError:
                continue
            self.connections += 1
            for sock in (client, server):
                sock.setblocking(False)
                with self._lock:
                    self._sockets.append(sock)
            asked = threading.Event()  # the client sent bytes the target's next reply answers
            self._spawn(self._pump, client, server, False, asked)
            self._spawn(self._pump, server, client, True, asked)

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool, asked: threading.Event) -> None:
        """Move ``src``'s bytes to ``dst`` at the rate (``replies``: the target's, held ``latency`` after a
        pause or a new request, ``asked``); at EOF or an error, shut ``dst``'s writing side."""
        paused = True
        try:
            while not self._stop.is_set():
                if not select.select([src], [], [], _TICK)[0]:
                    paused = True
                    continue
                if not replies:
                    asked.set()
                elif paused or asked.is_set():
                    asked.clear()
                    self._sleep(self.latency)
                paused = False
                rate = self.rate
                data = src.recv(_CHUNK if rate is None else max(1, int(rate * _TICK)))
                if not data:
                    break
                self._send(dst, data)
                if rate is not None:
                    self._sleep(len(data) / rate)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _send(self, dst: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view.nbytes and not self._stop.is_set():
            if select.select([], [dst], [], _TICK)[1]:
                view = view[dst.send(view):]

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stop.is_set() and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, _TICK))
