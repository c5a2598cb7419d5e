"""``open_block_store(url)``: the one opener of a shared-tier ``BlockStore`` from a URL.

Each scheme has one meaning (``redis`` may replace ``valkey`` in every scheme):

* ``valkey://[[user]:password@]host[:port][/db]`` - a new client of one server (port 6379 by default);
* ``valkeys://...`` - the same over TLS (options ``tls_ca``, ``tls_cert``, ``tls_key``, ``tls_verify``);
* ``valkey+cluster://[[user]:password@]host:port[,host:port...]`` (``valkeys+cluster://`` with TLS) -
  a new client of a Cluster, found from any of the nodes listed;
* ``file:///path/to/dir`` - a new store over a local directory (option ``capacity_bytes``, required: ``"50GiB"``;
  ``file_mode``, octal, ``600`` by default); the path's percent-escapes are its bytes (``%E9``: a Latin-1 name);
* ``memory://`` or ``memory://NAME`` - the process's in-memory store of that name (``""`` for
  ``memory://``): the first open builds it (option ``capacity_bytes``), every later open in the
  process answers the same instance, so every stack of the process shares it. It belongs to the
  process: no caller closes it (one that was closed is replaced by a new, empty one at the next
  open), and a later open with other options is refused. NAME is any text without ``/``;
* ``<name>://...`` - a new instance of a third-party store registered as ``<name>``
  (``kvkit.register("shared", ...)``), built with ``url=`` and the options.

A *new* store belongs to the caller, who closes it; :func:`process_wide` tells the two kinds apart.
Options are keyword arguments of the store (``request_timeout_s=0.5``), or the URL's query
(``file:///kv?capacity_bytes=50GiB``, ``valkey://h:6379/0?request_timeout_s=0.5&ttl_s=3600``: numbers
and ``true``/``false`` are converted), so one string configures a store wherever only a string fits
(the CLI, vLLM's ``kv_connector_extra_config``). A ``#`` is no fragment mark: it belongs to the
password or option value it is in. A URL that fails to parse raises
:class:`~kvkit.errors.ConfigError` quoting it and naming the valid forms. No
message shows a password: URLs and options are quoted through
:func:`~kvkit.validate.quote` (:mod:`kvkit.redact`), and a URL's query option
that its store does not take (a misspelled password option) is shown by name
only (:func:`~kvkit.config.shown_url`, the form every report and repr shows a URL
in).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, unquote_to_bytes, urlsplit

from kvkit.config import VALKEY_SCHEMES, parse_bytes, shown_url
from kvkit.errors import ConfigError
from kvkit.interfaces.shared import BlockStore
from kvkit.kept import read_kept
from kvkit.redact import SecretText, redact_address
from kvkit.registry import SHARED
from kvkit.validate import quote

__all__ = ["PASSWORD_OPTIONS", "open_block_store", "process_wide"]

# Ports as numbers: the masking rule hides a port that is not one (it may be a password missing its '@host').
_FORMS = ("valkey://host:6379/0, valkeys://..., valkey+cluster://host:6379,host:6380, "
          "redis:// rediss:// redis+cluster:// (aliases), file:///path, memory://[NAME]")
_DEFAULT_PORT = 6379
_TLS_SCHEMES = ("valkeys", "rediss")  # of VALKEY_SCHEMES: the ones over TLS
_PASSWORD_SOURCES: dict[str, Literal["env", "file"]] = {"password_env": "env", "password_file": "file"}
PASSWORD_OPTIONS = ("password", *_PASSWORD_SOURCES)
"""The options that give a Valkey store its password: as it is, or where it is kept."""
_MEMORY: dict[str, tuple[BlockStore, dict[str, Any]]] = {}  # name -> (the process's store, its options)
_MEMORY_LOCK = threading.Lock()


def open_block_store(url: str, **options: Any) -> BlockStore:
    """The block store ``url`` names: a new one built with ``options``, or the process's ``memory://NAME``.

    Raises:
        ConfigError: ``url`` is malformed or of an unknown scheme (the message
            quotes it and lists the forms), or the options do not fit the store.
        BackendUnavailableError: the store is registered but cannot run here.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"block store URL {_quoted(url)}: expected one of {_FORMS}")
    try:
        return _open(url, _with_query(url, options))
    except ConfigError as exc:
        if str(exc).startswith("block store URL"):
            raise
        raise ConfigError(f"block store URL {_quoted(url)}: {exc}") from exc


def _open(url: str, options: dict[str, Any]) -> BlockStore:
    scheme = url.partition("://")[0].lower()
    base, plus, mode = scheme.partition("+")
    if base in VALKEY_SCHEMES and mode in ("", "cluster"):
        settings = _valkey(url, base in _TLS_SCHEMES, bool(plus))
        _given_once(url, settings, options)
        return SHARED.create("valkey", slot="shared", **_kept_password({**settings, **options}))
    if scheme == "file":
        return SHARED.create("disk", slot="shared", **_disk(url, options))
    if scheme == "memory":
        return _memory(url, _sizes(options))
    if scheme in SHARED.names():
        return SHARED.create(scheme, slot="shared", url=url, **options)
    raise ConfigError(f"block store URL {_quoted(url)}: unknown scheme {scheme!r}; expected one of {_FORMS}, "
                      f"or a registered block store: {', '.join(SHARED.names())}")


def _given_once(url: str, settings: dict[str, Any], options: dict[str, Any]) -> None:
    """Refuse a setting the URL makes (its address, a disk store's directory) given again among the options
    (``?path=`` in the query, or a keyword): which of the two was meant is not known."""
    twice = sorted(settings.keys() & options.keys())
    if twice:
        raise ConfigError(f"block store URL {_quoted(url)}: {', '.join(twice)} given both in the URL and as "
                          f"options")


def process_wide(store: BlockStore) -> bool:
    """Whether ``store`` is one of the process's ``memory://NAME`` stores (which no caller closes)."""
    with _MEMORY_LOCK:
        return any(store is held for held, _ in _MEMORY.values())


def _quoted(url: object) -> str:
    """``url`` quoted for a message (:func:`~kvkit.validate.quote`), a string as
    :func:`~kvkit.config.shown_url` shows it."""
    return quote(shown_url(url) if isinstance(url, str) else url)


def _memory(url: str, options: dict[str, Any]) -> BlockStore:
    name = url.partition("://")[2].partition("?")[0]
    if "/" in name:
        raise ConfigError(f"block store URL {_quoted(url)}: expected memory:// or memory://NAME (a name without '/')")
    with _MEMORY_LOCK:
        held = _MEMORY.get(name)
        if held is not None and not getattr(held[0], "closed", False):
            if held[1] != options:
                raise ConfigError(f"block store URL {_quoted(url)}: this process's memory store {quote(name)} is open "
                                  f"with options {quote(held[1])}, not {quote(options)}; open it with the same options")
            return held[0]
        store = SHARED.create("memory", slot="shared", **options)
        _MEMORY[name] = (store, options)
        return store


def _valkey(url: str, tls: bool, cluster: bool) -> dict[str, Any]:
    rest = url.partition("://")[2].partition("?")[0]
    auth, at, location = rest.rpartition("@")
    if not at:
        auth, location = "", rest
    hosts, _, path = location.partition("/")
    if not hosts:
        raise ConfigError(f"block store URL {_quoted(url)}: no host; expected e.g. valkey://127.0.0.1:6379/0")
    nodes = [_address(url, part) for part in hosts.split(",")]
    if len(nodes) > 1 and not cluster:
        raise ConfigError(f"block store URL {_quoted(url)}: several hosts need a Cluster scheme, "
                          f"e.g. valkey+cluster://{hosts}")  # the URL ends the text: no port reads ')' as its own
    settings: dict[str, Any] = {"nodes": nodes, "cluster": cluster, "tls": tls}
    if path:
        if not (path.isascii() and path.isdigit()):  # str.isdigit takes other scripts' digits too
            raise ConfigError(f"block store URL {_quoted(url)}: the database {path!r} must be a number")
        settings["db"] = int(path)
    if auth:
        user, colon, password = auth.partition(":")
        if not colon:
            user, password = "", user
        settings["password"] = _decoded(url, "password", password)
        if user:
            settings["username"] = _decoded(url, "user name", user)
    return settings


def _kept_password(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``password_env`` or ``password_file`` (:mod:`kvkit.kept`) read into ``password``.

    The password comes from one place: the URL, the ``password`` option, or one of these.
    """
    given = [key for key in PASSWORD_OPTIONS if key in options]
    if len(given) > 1:
        raise ConfigError(f"the password is given by {' and '.join(given)}; give one (the URL's user info is the "
                          f"password option)")
    if not given or given[0] == "password":
        return options
    options = dict(options)
    key = given[0]
    source = options.pop(key)
    kept = read_kept(key, source, _PASSWORD_SOURCES[key])
    try:
        options["password"] = SecretText(kept.decode())
        return options
    except UnicodeDecodeError:
        pass  # the decoder's error holds the password: raised without it as context (kvkit.redact)
    raise ConfigError(f"{key}={source!r}: the password is not UTF-8 text")


def _decoded(url: str, what: str, text: str) -> str:
    """``text`` percent-decoded; ``ConfigError`` (the URL quoted redacted) for escapes that are not UTF-8."""
    try:
        return unquote(text, errors="strict")
    except UnicodeDecodeError:
        pass  # the decoder's error holds the text, a password perhaps: raised without it as context (kvkit.redact)
    raise ConfigError(f"block store URL {_quoted(url)}: the {what} has percent-escapes that are not UTF-8 "
                      f"(such as %ff); encode its bytes as UTF-8 first")


def _address(url: str, part: str) -> tuple[str, int]:
    try:
        parsed = urlsplit(f"//{part}")
        host, port = parsed.hostname, _DEFAULT_PORT if parsed.port is None else parsed.port
    except ValueError:  # its text quotes the port, a password perhaps: raised below without it as context
        host, port = None, 0
    if port == 0:  # no server listens there: never the default port instead
        raise ConfigError(f"block store URL {_quoted(url)}: bad address {redact_address(part)!r}; expected "
                          f"host:port with a port of 1-65535 (a port that is not a number is not shown: it may "
                          f"be a password missing its '@host')")
    if not host:
        raise ConfigError(f"block store URL {_quoted(url)}: bad address {redact_address(part)!r}; expected host:port")
    return host, port


def _disk(url: str, options: dict[str, Any]) -> dict[str, Any]:
    try:
        parsed = urlsplit(url, allow_fragments=False)  # a '#' is part of the directory's name
    except ValueError:  # a bracket that opens no IPv6 address
        parsed = None
    if parsed is None or parsed.netloc not in ("", "localhost") or not parsed.path:
        raise ConfigError(f"block store URL {_quoted(url)}: expected file:///absolute/path (a local directory)")
    if "capacity_bytes" not in options:
        raise ConfigError(f"block store URL {_quoted(url)}: a disk store needs capacity_bytes (e.g. '50GiB')")
    raw = dict(parse_qsl(url.partition("?")[2], keep_blank_values=True)).get("file_mode")
    if raw is not None:  # octal text: "640" must not become the decimal number 640
        options = {**options, "file_mode": raw}
    settings = {"path": os.fsdecode(unquote_to_bytes(parsed.path))}  # escapes: the name's bytes
    _given_once(url, settings, options)
    return {**settings, **_sizes(options)}


def _with_query(url: str, options: dict[str, Any]) -> dict[str, Any]:
    query = url.partition("?")[2]  # all of it: a '#' is part of a value here (a password's), not a fragment
    if "@" in query:  # else the userinfo would be ambiguous (see kvkit.redact)
        raise ConfigError(f"block store URL {_quoted(url)}: a '@' after the '?'; percent-encode it (%40)")
    found: dict[str, Any] = {}
    problem: str | None = None  # the parser's errors quote the query (a password?): raised without them as context
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query), errors="strict")
    except UnicodeDecodeError:
        problem = "the query has percent-escapes that are not UTF-8 (such as %ff); encode its values as UTF-8 first"
    except ValueError:  # strict parsing: an item without '=' (a password's tail after an unencoded '&'?)
        problem = "every query item must be name=value (a value holding '&' percent-encodes it: %26)"
    if problem is not None:
        raise ConfigError(f"block store URL {_quoted(url)}: {problem}")
    for name, text in pairs:
        if name in options or name in found:
            raise ConfigError(f"block store URL {_quoted(url)}: option {name!r} given twice")
        found[name] = _option_value(text)
    return {**found, **options}


def _option_value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def _sizes(options: dict[str, Any]) -> dict[str, Any]:
    if isinstance(options.get("capacity_bytes"), str):
        return {**options, "capacity_bytes": parse_bytes(options["capacity_bytes"])}
    return options
