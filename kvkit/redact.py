"""Secrets never printed: the one rule that masks them in every message, repr, report and child's argv.

A *secret* is

* a URL's password: the userinfo of ``scheme://[user]:PASSWORD@host...`` (or
  ``scheme://PASSWORD@host``): everything between ``://`` and the URL's last
  ``@`` (:func:`~kvkit.shared.urls.open_block_store` refuses a ``@`` in the
  query, so it reads the same userinfo; such a URL is masked whole after
  ``://``); ``file:///path`` has none;
* the value of a *secret name*: a mapping key, URL query option (its name
  percent-decoded, as kvkit reads it) or
  ``name=value`` whose name holds ``password``, ``passwd``, ``pwd``,
  ``secret``, ``auth``, ``credential``, ``apikey`` or ``token`` (not
  ``tokens``, ``tokenizer`` or a ``per_token`` rate: counts of tokens are
  kvkit's business, never secret), ends a word with ``pass``,
  ``passphrase`` or ``passcode`` (``requirepass``, ``db_pass``), has the
  word ``pw``, or holds ``private_key``, ``access_key`` or ``session_key``
  (a mistyped password option's value is shown as unknown with the rest,
  so these must be masked), or has a word one typo away from
  ``password`` or ``secret`` (``pasword=`` is refused as unknown, and its
  value must not be shown while saying so). A name ending in ``_env``,
  ``_file`` or ``_path`` names where a secret is kept, not the secret, and
  is shown;
* a URL query item without ``=`` or without a name: it names no option
  (kvkit refuses it), and may be the tail of a password holding an
  unencoded ``&``;
* a value kvkit was told is secret (the shared tier's HMAC key): its field's
  repr is :func:`secret_repr`, and a check of it names its type only; one kvkit
  reads itself from where it is kept (:mod:`kvkit.kept`: a password's
  ``password_env``/``password_file``, vLLM's ``secret_env``/``secret_file``) is held
  as :class:`SecretText` or :class:`SecretBytes` from the read on, whose repr (a
  slice's too) is :func:`secret_repr`, so the frame locals a traceback prints
  (pytest's ``--showlocals``, rich's ``show_locals``) show it as ``'***'``;
* a PEM private key (``-----BEGIN ... PRIVATE KEY-----`` through its
  ``-----END ... PRIVATE KEY-----`` line, or to the end of the text when that
  is missing), wherever it is: a key's text given where its file's path
  belongs (``tls_key``, ``tls_cert``) is quoted by every message about that path.

Each is shown as ``***``; what is not secret (the user name, hosts, other
options) stays, so a message still says what was wrong. ``None`` stays too:
whether a secret is set is not a secret.

* :func:`redact_url` masks one URL;
* :func:`redact` masks a value before it is shown (a URL string, a mapping's
  secret entries and ``(name, value)`` pairs, recursively through lists,
  tuples and mappings); a string
  without a scheme but with ``//`` or ``:`` before a ``@`` (a mistyped URL
  such as ``valkey//:pw@host``) has its userinfo masked too, spaces and all
  when it starts like a URL (``valkey//``, ``valkey:``, ``//``) or holds
  ``://`` before the ``@`` (`` valkey://...``), so a password holding a
  space is masked whole;
* :func:`redact_options` masks refused options: :func:`redact`'s rule, and
  every value under a name its receiver does not take (a misspelled secret
  option), so an error listing them shows their names only;
* :func:`redact_text` masks what it recognises in finished text: URLs (a
  quoted one ends at its closing quote, spaces and all, and the quote and the
  punctuation after it stay), and
  ``name=value`` or ``'name': value`` with a secret name. Every
  :class:`~kvkit.errors.KVKitError` passes its message through it, and so do
  kvkit's warnings, so a message built without :func:`~kvkit.validate.quote`
  is masked too.

An error about an input that holds a secret is raised outside the handler of the
error that found it (a decoder's, a parser's, the file system's, a server's): that
error quotes the input, and ``raise ... from None`` hides it from a traceback but
still holds it as ``__context__`` for whoever walks the chain.

Invariant (``tests/test_redact.py``, ``tests/shared/test_secrets_never_shown.py``):
a secret given to kvkit in any of these forms appears in none of its errors (nor
any error one holds as its cause or context), reprs, warnings, CLI tables, JSON
reports or child processes' argv.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Collection, Mapping
from typing import Any, SupportsIndex, overload
from urllib.parse import unquote, unquote_plus

from typing_extensions import override

__all__ = ["MASK", "SecretBytes", "SecretText", "is_secret_name", "redact", "redact_address", "redact_options",
           "redact_text", "redact_url", "secret_repr"]

MASK = "***"
"""What a secret is shown as."""

_SECRET_NAME = re.compile(r"passw(?:or)?d|pwd|secret|auth|credential|api_?key|(?<!per_)token(?!s|izer)"
                          r"|pass(?:phrase|code)?(?![a-z])|(?<![a-z])pw(?![a-z])|(?:private|access|session)_?key",
                          re.IGNORECASE)
_TYPO_OF = ("password", "secret")
_WHERE = re.compile(r"_(?:env|file|path)$", re.IGNORECASE)
_WORDS = re.compile(r"[a-z]+")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_MISTYPED_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*(?::|//)|//")
_CLOSING = re.compile(r"""['"][)\]}]*[:,;.]?""")  # a quoted URL's end in text: 'url': 'url', ('url')
_QUOTED_URL = re.compile(r"""(?P<q>['"])(?P<url>[A-Za-z][A-Za-z0-9+.\-]*://(?:\\.|(?!(?P=q))[^\\\n])*)(?P=q)""")
_URL_IN_TEXT = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://\S*")
_NAMED = re.compile(r"""(?<![\w.\-])(?P<name>[\w.\-]+)\s*=\s*"""  # name=value
                    r"""|(?P<q>['"])(?P<key>[\w.\-]+)(?P=q)(?:\]?\s*=|\s*(?P<colon>:))\s*""")  # 'name': , ['name']=
_IN_MAPPING = re.compile(r"[{,]\s*$")  # what comes before a mapping's key
_PLAIN_END = re.compile(r"""[\s,;&)}\]'"]|:(?!\S)""")  # what ends a value neither quoted nor bracketed
_CLOSE = {"[": "]", "(": ")", "{": "}", "<": ">"}
_DEPTH = 6
_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----(?:.*?-----END [A-Z0-9 ]*PRIVATE KEY-----|.*)",
                          re.DOTALL)


def is_secret_name(name: object) -> bool:
    """Whether values named ``name`` are secret (see the module's rule)."""
    return isinstance(name, str) and _secret_name(name)


@functools.lru_cache(maxsize=4096)  # messages repeat their names; the typo check is the slow part
def _secret_name(name: str) -> bool:
    if _WHERE.search(name) is not None:
        return False
    if _SECRET_NAME.search(name) is not None:
        return True
    return any(difflib.get_close_matches(word, _TYPO_OF, n=1, cutoff=0.8)
               for word in _WORDS.findall(name.lower()) if len(word) >= 5)


def secret_repr(value: object) -> str:
    """The repr of a secret field: ``None``, or ``'***'`` whatever it holds."""
    return "None" if value is None else repr(MASK)


class SecretText(str):
    """A text secret kvkit read (a password): a ``str`` in every use, but its repr, and a slice's (rich shows a
    long string's head), is :func:`secret_repr`."""

    __slots__ = ()

    @override
    def __repr__(self) -> str:
        return secret_repr(self)

    @override
    def __getitem__(self, key: SupportsIndex | slice) -> SecretText:
        return SecretText(str.__getitem__(self, key))


class SecretBytes(bytes):
    """A secret's bytes kvkit read: ``bytes`` in every use, but its repr, and a slice's, is :func:`secret_repr`."""

    __slots__ = ()

    @override
    def __repr__(self) -> str:
        return secret_repr(self)

    @overload
    def __getitem__(self, key: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> SecretBytes: ...

    @override
    def __getitem__(self, key: SupportsIndex | slice) -> int | SecretBytes:
        if isinstance(key, slice):
            return SecretBytes(bytes.__getitem__(self, key))
        return bytes.__getitem__(self, key)


def redact_url(url: str) -> str:
    """``url`` with its password and every secret-named query value shown as ``***``.

    Everything between ``://`` and the last ``@`` is userinfo: ``user:password``
    keeps the user, a lone ``password`` is masked whole. A ``file:///path``
    URL (no host part) has none: a ``@`` in its path stays. A ``@`` after a
    ``?`` (which :func:`~kvkit.shared.urls.open_block_store` refuses) leaves
    unknown whether the password ends before or after the ``?``: all after
    ``://`` is masked.
    """
    match = _SCHEME.match(url)
    if match is None:
        return url
    head, rest = url[:match.end()], url[match.end():]
    auth, at, rest = ("", "", rest) if head.lower() == "file://" and rest[:1] == "/" else rest.rpartition("@")
    if at and "?" in auth:  # a '@' after a '?': the password may end in the userinfo or in the query
        return head + MASK
    if at:
        user, colon, _ = auth.partition(":")
        head += f"{user}:{MASK}@" if colon else f"{MASK}@"
    location, mark, query = rest.partition("?")
    if query:
        query = "&".join(map(_query_item, query.split("&")))
    if head.lower() != "file://":
        netloc, slash, path = location.partition("/")
        location = ",".join(map(redact_address, netloc.split(","))) + slash + path
    return head + location + mark + query


def redact_address(address: str) -> str:
    """``host:port`` shown: a port that is not a number is masked (``:PASSWORD`` whose ``@host`` is missing)."""
    host, colon, port = address.rpartition(":")
    if not colon or address.endswith("]") or port.isdigit() or not port:
        return address
    return f"{host}:{MASK}"


def _query_item(item: str) -> str:
    """One ``name=value`` of a URL's query, shown: a secret name's value masked, a value holding a PEM private key
    (percent-encoded) too, and an item naming no option."""
    name, eq, value = item.partition("=")
    if not (name and eq):
        return item and MASK  # names no option: perhaps a password's tail after an unencoded '&'
    secret = is_secret_name(unquote(name)) or _PRIVATE_KEY.search(unquote_plus(value)) is not None
    return name + eq + (MASK if secret else value)


def redact(value: Any, _depth: int = 0) -> Any:
    """``value`` fit to show: a URL string redacted, a mapping's secret-named values masked (recursively).

    Lists, tuples and mappings are copied (as a list, tuple or dict) with their
    items redacted; other values are returned as they are (their repr is
    :func:`redact_text`'s job).
    """
    if isinstance(value, str):
        if _SCHEME.match(value):
            return redact_url(value)
        before = value.rpartition("@")[0]
        if "://" in before or _MISTYPED_SCHEME.match(before) or (  # a mistyped URL
                ("//" in before or ":" in before) and not any(c.isspace() for c in value)):
            head, slashes, rest = value.partition("//")
            if not slashes:
                head, rest = "", value
            return head + slashes + redact_url("x://" + rest)[len("x://"):]
        return redact_text(value)
    if _depth >= _DEPTH:
        return value
    if isinstance(value, Mapping):
        return {k: MASK if is_secret_name(k) and v is not None else redact(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, _depth + 1) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):  # a namedtuple is shown as it is
        if len(value) == 2 and is_secret_name(value[0]) and value[1] is not None:  # a (name, value) pair
            return value[0], MASK
        return tuple(redact(v, _depth + 1) for v in value)
    return value


def redact_options(options: Mapping[str, Any], known: Collection[str]) -> dict[str, Any]:
    """Options shown where they were refused: :func:`redact`'s rule, and every value under a name not in ``known``
    (the names their receiver takes) masked too: a misspelled secret option (``passw``) may be named like no
    secret. ``None`` stays."""
    return {name: value if name in known or value is None else MASK for name, value in redact(dict(options)).items()}


def redact_text(text: str) -> str:
    """``text`` with every URL's password, secret-named value and PEM private key it recognises shown as ``***``."""
    if "PRIVATE KEY-----" in text:
        text = _PRIVATE_KEY.sub(MASK, text)
    if "://" in text:
        text = _QUOTED_URL.sub(lambda m: m["q"] + redact_url(m["url"]) + m["q"], text)  # spaces and all
        text = _URL_IN_TEXT.sub(_url_in_text, text)
    if "=" in text or ":" in text:
        text = _mask_named(text)
    return text


def _url_in_text(match: re.Match[str]) -> str:
    """The URL ``match`` found, redacted; one after a quote ends at its last closing quote, which stays with the
    punctuation after it (anything else after that quote may be the password's, and is redacted with it)."""
    url, tail = match.group(), ""
    opening = match.string[match.start() - 1:match.start()]
    if opening in ("'", '"') and opening in url:
        head, closing, rest = url.rpartition(opening)
        if _CLOSING.fullmatch(closing + rest):
            url, tail = head, closing + rest
    return redact_url(url) + tail


def _mask_named(text: str) -> str:
    """``text`` with the value after every secret name (``name=``, ``['name']=``, ``'name':`` in a mapping, or
    followed by a quoted value) shown as ``'***'``.

    A value is one token of any type as a repr writes it: a quoted string (``b'...'`` too), a bracketed one to
    its matching bracket (a list, tuple, set, mapping or ``<...>``, quotes and nesting followed), or a run of
    characters up to a space, ``,;&``, a closing bracket or quote, or a ``:`` that ends a clause (a call's
    repr, ``bytearray(b'...')``, to its closing bracket). One cut short (unclosed) runs to the end of the
    text. ``None`` and the mask itself stay.
    """
    shown: list[str] = []
    done = 0
    for match in _NAMED.finditer(text):
        if match.start() < done or not is_secret_name(match["name"] or match["key"]):
            continue
        end = _value_end(text, match.end())
        value = text[match.end():end]
        if value in ("", "None", MASK, repr(MASK)) or (  # 'name': text outside a mapping: prose, unless quoted
                match["colon"] and value.lstrip("b")[:1] not in ("'", '"')
                and not _IN_MAPPING.search(text, 0, match.start())):
            continue
        shown += [text[done:match.end()], repr(MASK)]
        done = end
    return "".join(shown) + text[done:]


def _value_end(text: str, start: int) -> int:
    """Where the value starting at ``start`` ends (see :func:`_mask_named`)."""
    i = start + 1 if text[start:start + 2] in ("b'", 'b"') else start
    if text[i:i + 1] in ("'", '"'):
        return _group_end(text, i)
    i = start
    while i < len(text) and text[i] not in _CLOSE and _PLAIN_END.match(text, i) is None:
        i += 1
    return _group_end(text, i) if text[i:i + 1] in _CLOSE else i  # a call's repr: bytearray(b'...')


def _group_end(text: str, start: int) -> int:
    """Just past the string or bracketed group opening at ``start`` (strings and nesting inside followed), or the
    end of ``text`` if it is never closed."""
    closing: list[str] = []
    i = start
    while i < len(text):
        char = text[i]
        if char in "'\"":  # a string: to its unescaped closing quote
            i += 1
            while i < len(text) and text[i] != char:
                i += 2 if text[i] == "\\" else 1
        elif char in _CLOSE:
            closing.append(_CLOSE[char])
        elif closing and char == closing[-1]:
            closing.pop()
        i += 1
        if not closing:
            return min(i, len(text))
    return len(text)
