"""The one redaction rule: a URL's password, a secret-named value, a secret field: never shown, the rest kept."""

from __future__ import annotations

import ast
import traceback
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvkit.errors as errors
from kvkit.redact import MASK, is_secret_name, redact, redact_text, redact_url, secret_repr
from kvkit.validate import quote

# A password: a recognisable core, then anything a URL's userinfo may hold (no whitespace for text searches).
PASSWORDS = st.text(st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc")), max_size=12).map(
    lambda tail: "PW-s3cr3t-" + tail)
SCHEMES = st.sampled_from(["valkey", "valkeys", "redis", "rediss", "valkey+cluster", "file", "mystore"])


def _shows(pw: str, *texts: str) -> bool:
    return any(pw in text for text in texts)


@given(scheme=SCHEMES, user=st.sampled_from(["", "alice", "kvkit-acme"]), pw=PASSWORDS,
       hosts=st.sampled_from(["h", "10.0.0.1:7000", "a:1,b:2", "[::1]:6379"]),
       tail=st.sampled_from(["", "/0", "/3?ttl_s=60", "?request_timeout_s=0.5&tls_verify=false"]))
def test_a_url_password_is_never_shown(scheme, user, pw, hosts, tail):
    """Whatever the password holds ('@', ':', '/', '?', quotes), neither the URL, its repr, a message quoting it
    nor an error quoting it shows it; the scheme, user and hosts stay."""
    url = f"{scheme}://{user}:{pw}@{hosts}{tail}"
    shown = redact_url(url)
    if "?" in pw:  # a '?' before the last '@': the password may as well end in the query (see below)
        assert shown == f"{scheme}://{MASK}"
        return
    assert shown == f"{scheme}://{user}:{MASK}@{hosts}{tail}"
    message = f"block store URL {url!r} failed ({url}); see {[url]}"
    texts = [shown, quote(url), quote({"url": url}), redact_text(message), str(errors.ConfigError(message)),
             repr(errors.BackendUnavailableError(message))]
    assert not _shows(pw, *texts), texts
    assert all(hosts in text for text in texts)


@given(pw=PASSWORDS, name=st.sampled_from(["password", "Password", "tls_password", "secret", "shared_secret",
                                           "token", "auth_token", "api_key", "pasword", "secert", "auth",
                                           "pw", "PW", "db_pw", "pass", "db_pass", "requirepass", "passphrase",
                                           "passcode", "private_key", "access_key", "sessionKey"]))
def test_a_secret_named_option_is_never_shown(pw, name):
    """In a URL's query, a mapping (however nested) or name=value text, a secret name's value is masked."""
    assert is_secret_name(name)
    url = f"valkey://h:1/0?db=0&{name}={pw}&ttl_s=3"
    options = {"request_timeout": 1, name: pw, "nested": [{name: pw}, (name, pw)]}
    texts = [redact_url(url), quote(url), quote(options), repr(redact(options)), redact_text(f"{name}={pw!r}, x=1"),
             redact_text(f"{{'{name}': {pw!r}}}"), redact_text(f"extra[{name!r}]={pw!r}"),
             str(errors.ConfigError([f"options {options['nested'][0]!r} do not fit", f"{name}={pw}"]))]
    for text in texts:
        assert pw not in text, text
    assert "request_timeout" in quote(options)
    assert ("ttl_s=3" in redact_url(url)) == ("@" not in pw)  # a '@' in the query: all after '://' is masked


@pytest.mark.parametrize("name", ["tokens", "gpu_hit_tokens", "max_new_tokens", "decode_ms_per_token", "tokenizer",
                                  "request_timeout_s", "username", "tls_key", "capacity_bytes", "second", "select",
                                  "shared_secret_env", "password_file", "token_path", "passes", "passthrough",
                                  "pwr", "probe_key", "keys", "key"])
def test_what_is_not_secret_stays(name):
    """Counts of tokens, rates, user names, paths and where a secret is kept are shown as they are."""
    assert not is_secret_name(name)
    assert redact_text(f"{name}=12") == f"{name}=12"
    assert redact({name: 12}) == {name: 12}


def test_a_quoted_url_keeps_what_follows_its_masked_value():
    """A URL quoted in a message ends at its closing quote: a masked query value or password does not swallow the
    quote and the text after it."""
    assert redact_text("bad url 'valkey://h/0?password=PW': refused") == "bad url 'valkey://h/0?password=***': refused"
    assert redact_text('bad "valkey://:PW@h/0?token=T", ok') == 'bad "valkey://:***@h/0?token=***", ok'
    assert redact_text("x 'valkey://:PW s3cr3t@h/0': y") == "x 'valkey://:***@h/0': y"  # spaces and all
    assert redact_text("'valkey://:a'b@h") == "'valkey://:***@h"  # an unclosed quote: the password's
    assert redact_text("['valkey://:P\\'W@h?secret=S', 'x']") == "['valkey://:***@h?secret=***', 'x']"


@pytest.mark.parametrize("url", ["valkey//:PW s3cr3t@host", "valkey:/:PW s3cr3t@host", "valkey:PW s3cr3t@host",
                                 "//:PW s3cr3t@host", "valkey://:PW s3cr3t@host", " valkey://:PW s3cr3t@host",
                                 "<valkey://:PW s3cr3t@host>", "valkey :// :PW s3cr3t@host"])
def test_a_mistyped_url_whose_password_has_a_space_is_masked(url):
    """A password may hold spaces: a URL missing its '://', or with something before its scheme, still has all
    of its userinfo masked."""
    for text in (quote(url), str(errors.ConfigError(f"block store URL {quote(url)}: bad"))):
        assert "PW" not in text and "s3cr3t" not in text and "host" in text, text


@pytest.mark.parametrize("url", ["valkey://h:6379/0?password=p@ssw0rd&ttl_s=3", "valkey://h?pw=a@ssw0rd",
                                 "valkeys://u:p?ssw0rd@h/0"])
def test_a_url_with_a_at_after_its_query_mark_shows_nothing_after_its_scheme(url):
    """A '@' after the '?' (kvkit refuses such a URL) leaves unknown where a password ends: in the userinfo or in
    the query, so nothing after the scheme is shown."""
    assert redact_url(url) == url.partition("://")[0] + "://***"
    assert "ssw0rd" not in quote(url) + redact_text(f"bad url {url!r}: x") + redact_text(f"bad url {url}")


@pytest.mark.parametrize("url", ["valkey://:pa?PW-s3cr3t=x@h:6379/0", "valkey://user:?PW-s3cr3t=@h/0",
                                 "valkeys+cluster://:x?PW-s3cr3t=y@h:1,h:2", "valkey://h/0?ttl_s=1&PW-s3cr3t=@x"])
def test_a_password_holding_a_query_mark_and_an_equals_sign_is_never_shown_as_an_option_name(url):
    """A password holding an unencoded '?' puts its '@' after the '?': the URL every error and repr shows
    (``shown_url``) shows nothing after its scheme, never the password's part that reads as an option name."""
    from kvkit.config import SharedConfig, shown_url
    from kvkit.shared.urls import open_block_store

    assert shown_url(url) == url.partition("://")[0] + "://***"
    with pytest.raises(errors.ConfigError) as info:
        open_block_store(url)
    texts = ["".join(traceback.format_exception(info.value)), repr(SharedConfig(url=url))]
    assert not any("s3cr3t" in text for text in texts), texts


def test_a_percent_encoded_option_name_is_read_as_kvkit_reads_it():
    """kvkit decodes a query option's name (``%70assword`` is ``password``), so the rule reads it decoded too."""
    url = "valkey://h/0?%70%61%73%73%77%6f%72%64=s3cr3t&t%6Fken=s3cr3t&ttl_s=3"
    assert redact_url(url) == "valkey://h/0?%70%61%73%73%77%6f%72%64=***&t%6Fken=***&ttl_s=3"


def test_a_query_item_without_a_value_is_masked():
    """A query item without '=' or without a name names no option (kvkit refuses it): it may be the tail of a
    password holding an unencoded '&', so it is masked; named options stay."""
    assert redact_url("valkey://h/0?password=PW&s3cr3t&ttl_s=3") == "valkey://h/0?password=***&***&ttl_s=3"
    assert redact_url("valkey://h/0?=s3cr3t&&ttl_s=3&") == "valkey://h/0?***&&ttl_s=3&"


def test_a_mistyped_url_and_none_and_masks():
    """A URL missing its '://' still has its userinfo masked (not a shape's '@' or an address); None (no
    secret) and the mask itself stay."""
    assert "PW" not in quote("valkey//:PW@host") and "host" in quote("valkey//:PW@host")
    assert "PW" not in quote("valkey:/:PW@host") and "PW" not in quote("user:PW@host")
    assert quote("few-shot@nope=1") == "'few-shot@nope=1'" and quote("a@b.example") == "'a@b.example'"
    assert redact_text("shared_secret=None") == "shared_secret=None"
    assert redact_text(redact_text("password=x")) == "password='***'"
    assert secret_repr(None) == "None" and secret_repr(b"x") == "'***'"


@pytest.mark.parametrize("cls", [getattr(errors, name) for name in errors.__all__
                                 if name not in ("TraceFormatError", "TraceFileError", "TransferTimeoutError")])
def test_every_kvkit_error_masks_its_message(cls):
    """Whatever message an error is built with, its str, repr, args and traceback show no password."""
    exc = cls("opening 'valkey://u:PW-s3cr3t-1@h/0' with {'password': 'PW-s3cr3t-2'} and secret=b'PW-s3cr3t-3'")
    text = "".join(traceback.format_exception(exc)) + repr(exc) + repr(exc.args) + str(getattr(exc, "problems", ""))
    assert "s3cr3t" not in text and "valkey://u:***@h/0" in text


def test_the_errors_with_their_own_signatures_mask_too():
    """TraceFileError, TraceFormatError and TransferTimeoutError pass their text through the same rule."""
    for exc in (errors.TraceFileError("t.jsonl", "password=PW-s3cr3t"),
                errors.TraceFormatError("t.jsonl", 3, "f", "valkey://:PW-s3cr3t@h"),
                errors.TransferTimeoutError("valkey://:PW-s3cr3t@h timed out", (1,))):
        assert "s3cr3t" not in str(exc) + repr(exc)


def test_a_components_secret_named_option_is_masked_in_the_config_and_the_simulators_json(monkeypatch):
    """A registered component may take a secret as a keyword option (``options={"store": {"api_token": ...}}``):
    the StackConfig's repr and the simulator's JSON config show it as ***, the option's name kept."""
    import json

    import kvkit
    from kvkit.backends.store.eager import EagerStore
    from kvkit.sim.simulator import SimConfig

    class TokenStore(EagerStore):
        def __init__(self, api_token=None, **options):
            super().__init__(**options)

    kvkit.STORE.names()  # entry points read now, then the registry is restored after the test
    monkeypatch.setattr(kvkit.STORE, "_targets", dict(kvkit.STORE._targets))
    monkeypatch.setattr(kvkit.STORE, "_loaded", dict(kvkit.STORE._loaded))
    kvkit.register("store", "t-token-store", TokenStore)
    spec = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float32")
    config = kvkit.StackConfig(kv=spec, gpu_blocks=4, cpu_blocks=4, store="t-token-store",
                               options={"store": {"api_token": "PW-s3cr3t"}})
    texts = [repr(config), str(config), repr(SimConfig(stack=config)), json.dumps(SimConfig(stack=config).as_dict())]
    for text in texts:
        assert "s3cr3t" not in text and "api_token" in text, text
    assert config.options["store"]["api_token"] == "PW-s3cr3t"  # masked when shown, kept as given


@pytest.mark.parametrize("value", [["PW-s3cr3t"], {"x": "PW-s3cr3t"}, ("PW-s3cr3t", 1), {"PW-s3cr3t"},
                                   [["PW-s3cr3t"], "b]"], 987654321, b"PW-s3cr3t", "PW-s3cr3t",
                                   bytearray(b"PW-s3cr3t"), ["a)b", "PW-s3cr3t"]])
def test_a_secret_named_value_of_any_type_is_masked_whole(value):
    """A secret name's value is masked whatever its type (a password given as a list, a mapping, an int, bytes):
    a bracketed value to its matching bracket, quotes and nesting included, in name=value and 'name': value
    text alike; what follows it stays."""
    shown = repr(value)
    for text in (f"password={shown}", f"ValkeyStore.password={shown}: must be a string",
                 f"{{'password': {shown}, 'db': 0}}", f"extra['shared']['secret']={shown}; db=0",
                 f'{{"token": {shown}}}'):
        masked = redact_text(text)
        assert "s3cr3t" not in masked and "987654321" not in masked, masked
        assert masked.endswith(text[text.index(shown) + len(shown):]), masked


def test_an_unclosed_secret_value_is_masked_to_the_end():
    """A value cut short (a message quoted to its first 200 characters) is masked to the end of the text."""
    assert redact_text("password=['PW-s3cr3t', 'x...") == "password='***'"
    assert redact_text("{'secret': b'PW-s3cr3t...") == "{'secret': '***'"


def test_options_a_factory_does_not_take_are_shown_by_name_only():
    """Options that do not fit a factory: values under names it takes are shown (secrets masked), values under
    names it does not take are not: a misspelled password option's name may be no recognisable secret."""
    import kvkit
    from kvkit.registry import SHARED

    with pytest.raises(errors.ConfigError) as info:
        SHARED.create("memory", slot="shared", capacity_bytes=12345, passw="PW-s3cr3t", pwd1="PW-s3cr3t")
    text = str(info.value)
    assert "s3cr3t" not in text and "12345" in text and "'passw'" in text and "'pwd1'" in text, text
    store = kvkit.open_block_store("memory://registry-test")
    with pytest.raises(errors.ConfigError) as info:
        SHARED.create(store, slot="shared", paswd="PW-s3cr3t")
    assert "s3cr3t" not in str(info.value) and "paswd" in str(info.value)


@pytest.mark.parametrize("name", ["passw", "pwd1", "pword", "my_pass_w", "sekret", "key", "x"])
def test_a_url_option_its_store_does_not_take_is_shown_by_name_only(name):
    """A URL's query option its store does not take (refused as unknown) may be a misspelled password: the
    refusal names it, and shows the values of the options the store takes, never its value."""
    from kvkit.shared.urls import open_block_store

    for url in (f"valkey://127.0.0.1:1/0?request_timeout_s=0.5&{name}=PW-s3cr3t",
                f"file:///tmp/kvkit-redact-test?capacity_bytes=1MiB&{name}=PW-s3cr3t",
                f"memory://redact-test?{name}=PW-s3cr3t&capacity_bytes=1000"):
        with pytest.raises(errors.ConfigError) as info:
            open_block_store(url)
        text = "".join(traceback.format_exception(info.value))
        assert "s3cr3t" not in text and name in text, text
        assert "request_timeout_s=0.5" in text or "capacity_bytes=1" in text, text


def test_a_quoted_secret_looking_name_in_prose_keeps_the_words_after_it():
    """``'name': word`` outside a mapping is prose (a refused value and why): only a quoted value after it is
    masked there."""
    assert redact_text("--planner='pw-store': unknown load planner") == "--planner='pw-store': unknown load planner"
    assert redact_text("got 'password': 'PW-s3cr3t'") == "got 'password': '***'"


def _attrs_classes() -> list[tuple[str, ast.ClassDef]]:
    """Every class of kvkit's source (importable here or not: vLLM's modules too) made by an ``attrs`` decorator."""
    paths = sorted(p for room in SOURCES for p in (ROOT / room).rglob("*.py"))  # links not followed
    return [(f"{path.relative_to(ROOT)}:{node.name}", node) for path in paths
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ClassDef) and any("attr" in ast.unparse(d) for d in node.decorator_list)]


ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("kvkit", "backends", "interfaces")
_MASKING_REPRS = ("False", "secret_repr", "_shown_url", "_redacted_repr")


def test_every_attrs_field_that_may_hold_a_secret_has_a_masking_repr():
    """The sweep behind every auto-generated repr: in every ``attrs`` class of kvkit's source (the backends and
    interfaces too), a field named as a secret (the redaction rule's names), a URL or a mapping of options is
    shown through a masking repr (``secret_repr``, ``_shown_url``, ``_redacted_repr``) or not at all."""
    classes = _attrs_classes()
    assert len(classes) > 100 and any(name == "backends/blockstore/valkey.py:ValkeyStore" for name, _ in classes)
    unmasked = []
    for owner, node in classes:
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            name = item.target.id.lstrip("_")
            mapping = any(kind in ast.unparse(item.annotation) for kind in ("dict", "Mapping"))
            if not (is_secret_name(name) or name == "url" or (name == "options" and mapping)):
                continue
            call = item.value if isinstance(item.value, ast.Call) else None
            shown = next((ast.unparse(k.value) for k in (call.keywords if call else ()) if k.arg == "repr"), "True")
            if shown.rpartition(".")[2] not in _MASKING_REPRS and (owner, name) not in _NOT_SECRET:
                unmasked.append(f"{owner}.{name} (repr={shown})")
    assert not unmasked, unmasked


_NOT_SECRET = {("kvkit/integrations/hf/cache.py:_Job", "first_token_at")}  # a time, named after tokens


@pytest.mark.parametrize("kind", ["", "RSA ", "EC ", "ENCRYPTED ", "OPENSSH "])
def test_a_pem_private_key_is_masked_wherever_it_is_and_the_rest_stays(kind):
    """A PEM private key (of any kind, cut short too) is masked in text and as a value; a certificate is shown."""
    key = f"-----BEGIN {kind}PRIVATE KEY-----\nMIIEvQIBADANBgkq\n-----END {kind}PRIVATE KEY-----\n"
    text = f"tls_key={key!r} cannot be loaded: no such file: {key!r}; the rest stays"
    assert redact_text(text) == f"tls_key='{MASK}\\n' cannot be loaded: no such file: '{MASK}\\n'; the rest stays"
    assert redact_text(f"cut short: {key[:40]}") == f"cut short: {MASK}"
    assert redact(key) == f"{MASK}\n"
    cert = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    assert redact_text(cert) == cert
