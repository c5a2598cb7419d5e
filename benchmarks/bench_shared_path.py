"""The Valkey store's put/get with several ``window_bytes`` against a bare socket client.

Each store sends a node at most two chunks of about ``window_bytes`` of values before reading
replies; a huge window is the whole batch in flight. The bare client is a loop of ``sendmsg``
(header, the value's buffer, CRLF) and ``recv_into`` the destination row, ``--bare-window``
requests ahead (0: the whole batch), showing what loopback, server and Python's socket calls cost
without the store's I/O thread and tickets. Rounds run every way once, in a fresh random order
(the first way after a round's last GET was favoured otherwise); medians are printed.

    python benchmarks/bench_shared_path.py [--size BYTES] [--batch-mib N] [--windows KiB ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import time

import numpy as np

from kvkit import open_block_store
from kvkit.testing.servers import LocalServer


def bare_client(port: int):
    """A connected socket and a function running pipelined SETs or GETs of numpy rows, ``window`` ahead."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    line = bytearray(64)

    def read_line() -> int:
        """Consume the next reply line (peeked, then read exactly); answer its length field, or 0."""
        while True:
            peeked = sock.recv(64, socket.MSG_PEEK)
            end = peeked.find(b"\r\n")
            if end >= 0:
                sock.recv_into(line, end + 2)
                return int(peeked[1:end]) if peeked[:1] == b"$" else 0

    def run(keys, rows, window, put):
        sent = done = 0
        ahead = window or len(keys)
        while done < len(keys):
            while sent < len(keys) and sent - done < ahead:
                key = keys[sent]
                if put:
                    sock.sendmsg([b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, rows[sent].nbytes),
                                  memoryview(rows[sent]), b"\r\n"])
                else:
                    sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key))
                sent += 1
            size = read_line()
            if not put:
                view, got = memoryview(rows[done]), 0
                while got < size:
                    got += sock.recv_into(view[got:])
                sock.recv_into(line, 2)
            done += 1

    return sock, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256 << 10, help="value bytes")
    parser.add_argument("--batch-mib", type=int, default=128, help="MiB per put or get")
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 1 << 30],
                        help="store window_bytes to compare, in KiB (1073741824: the whole batch)")
    parser.add_argument("--bare-window", type=int, default=1, help="requests ahead for the bare client (0: all)")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n = max(1, (args.batch_mib << 20) // args.size)
    with LocalServer() as server:
        stores = {kib: open_block_store(server.url, request_timeout_s=30.0, window_bytes=kib << 10)
                  for kib in args.windows}
        sock, bare = bare_client(server.port)
        keys = [b"kvkit:path:%d" % i for i in range(n)]
        source = np.random.default_rng(0).integers(0, 256, (n, args.size), dtype=np.uint8)
        target = np.ones_like(source)
        values, buffers = [[memoryview(r)] for r in source], [[memoryview(r)] for r in target]

        def finish(store, ticket: int) -> None:
            while True:
                for result in store.poll((ticket,), 5.0):
                    assert result.ok, result
                    return

        ways = {"bare_put": lambda: bare(keys, source, args.bare_window, True),
                "bare_get": lambda: bare(keys, target, args.bare_window, False)}
        for kib, store in stores.items():
            ways[f"store_{kib}KiB_put"] = lambda s=store: finish(s, s.put(keys, values))
            ways[f"store_{kib}KiB_get"] = lambda s=store: finish(s, s.get(keys, buffers))
        times: dict[str, list[float]] = {name: [] for name in ways}
        for work in ways.values():
            work()
        order = list(ways)
        for _ in range(args.repeat):
            random.shuffle(order)
            for name in order:
                start = time.perf_counter()
                ways[name]()
                times[name].append(time.perf_counter() - start)
        assert np.array_equal(source, target), "a value read back differs"
        report = {"size": args.size, "values": n, "bare_window": args.bare_window,
                  **{f"{name}_GBps": round(n * args.size / statistics.median(t) / 1e9, 2) for name, t in times.items()}}
        sock.close()
        for store in stores.values():
            store.close()
    print(json.dumps(report) if args.json else "  ".join(f"{k}={v}" for k, v in report.items()))


if __name__ == "__main__":
    main()
