"""The keys of vLLM's ``kv_connector_extra_config`` are StackConfig's slots: accepted into the stack, bad values
quoted; the shared tier's ``shared`` key as a URL or a mapping of SharedConfig fields."""

import contextlib
import warnings

import attrs
import pytest

from kvkit.config import SharedConfig, StackConfig
from kvkit.errors import ConfigError
from kvkit.integrations.vllm.settings import EXTRA_KEYS, STACK_KEYS, VLLM_SLOTS, parse_extra_config
from kvkit.interfaces import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)


def _parse(model=None, **extra):
    return parse_extra_config({"cpu_blocks": 8, **extra}, kv=SPEC, gpu_blocks=16, world_size=1, device="cpu",
                              model=model)


@pytest.mark.parametrize(("extra", "needles"), [
    ({"shared": 7}, ["shared']=7", "URL string"]),
    ({"shared": {"url": "memory://", "write": "write-around"}}, ["shared.write='write-around'", "write-through"]),
    ({"shared": {"url": "memory://", "model": ""}}, ["shared.model=''"]),
    ({"shared": {"write": "write-back", "secret": "hunter2"}}, ["['shared']['url']=None", "URL string"]),
    ({"shared": "not a url"}, ["'not a url'", "URL"]),
    ({"shared": "memory://", "shared_write": "write-back"}, ["'shared_write'", "unknown key"]),
])
def test_bad_shared_keys_are_refused_quoting_the_value(extra, needles):
    """Each field of the shared tier is validated and a bad value quoted, with the valid choices."""
    with pytest.raises(ConfigError) as info:
        _parse(**extra)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("url", ["valkey://127.0.0.1:6379/0", "file:///tmp/kv?capacity_bytes=1GiB", "memory://"])
def test_shared_keys_reach_the_stack(url):
    """A shared-tier URL, or a mapping of SharedConfig fields, goes into the stack's config."""
    assert _parse(shared=url).stack.shared == SharedConfig(url=url)
    stack = _parse(shared={"url": url, "write": "write-back", "model": "llama@abc"}).stack
    assert stack.shared == SharedConfig(url=url, write="write-back", model="llama@abc")


def test_the_model_identity_defaults_to_vllms_model_and_an_explicit_one_wins():
    """Without a model the namespace names vLLM's model and revision; the config's own wins."""
    assert _parse(model="m@rev", shared="memory://").stack.shared.model == "m@rev"
    assert _parse(model="m@rev", shared={"url": "memory://", "model": "mine"}).stack.shared.model == "mine"


def test_without_shared_keys_nothing_changes():
    """A config without the shared tier builds settings as before."""
    assert _parse(model="m@rev").stack.shared is None


def test_the_keys_are_the_stack_slots_vllm_does_not_set():
    """Every StackConfig slot is either an extra-config key or set from vLLM; a vLLM-set one is refused, named."""
    assert set(STACK_KEYS) | set(VLLM_SLOTS) == set(attrs.fields_dict(StackConfig))
    assert set(STACK_KEYS) <= set(EXTRA_KEYS) and not set(VLLM_SLOTS) & set(EXTRA_KEYS)
    assert _parse(wait_timeout_s=5.0).stack.wait_timeout_s == 5.0
    with pytest.raises(ConfigError, match=r"\['gpu_blocks'\]: vLLM's KV cache config sets it"):
        _parse(gpu_blocks=3)
    with pytest.raises(ConfigError, match="did you mean 'cpu_eviction'"):
        _parse(cpu_evction="lru")


def test_the_tenant_and_the_secret_from_an_environment_variable_or_a_file_reach_the_stack(monkeypatch, tmp_path):
    """``shared``'s tenant goes into the stack; its secret is read from the named variable or file (a trailing
    newline dropped) in each process that parses the config, so scheduler and workers derive the same keys."""
    from kvkit.shared.client import FormatCodec

    monkeypatch.setenv("KVKIT_TEST_SECRET", "from-the-env")
    (tmp_path / "secret").write_bytes(b"from-a-file\n")
    by_env = {"url": "memory://", "tenant": "acme", "secret_env": "KVKIT_TEST_SECRET"}
    env = _parse(shared=by_env).stack.shared
    assert (env.tenant, env.secret) == ("acme", b"from-the-env")
    assert _parse(shared={"url": "memory://", "secret_file": str(tmp_path / "secret")}).stack.shared.secret \
        == b"from-a-file"
    codecs = [FormatCodec.for_stack(SPEC, 1, model="m", layout="none", tenant=s.tenant, secret=s.secret)
              for s in (env, _parse(shared=by_env).stack.shared)]
    assert codecs[0].key(7, 0) == codecs[1].key(7, 0) and codecs[0].key(7, 0).startswith(b"kvkit:acme:")


def test_a_secret_variable_holding_bytes_that_are_not_utf8_is_taken_as_they_are(monkeypatch):
    """An environment variable is bytes: one that does not decode as UTF-8 is the secret byte for byte (it
    raised a bare UnicodeEncodeError whose repr held the secret)."""
    import os

    monkeypatch.setenv("KVKIT_TEST_SECRET", os.fsdecode(b"s3cr3t-\xff\xfe"))
    assert _parse(shared={"url": "memory://", "secret_env": "KVKIT_TEST_SECRET"}).stack.shared.secret \
        == b"s3cr3t-\xff\xfe"


@pytest.mark.parametrize(("shared", "needles"), [
    ({"secret": "PW-s3cr3t"}, ["['shared']['secret']: not taken here", "secret_env", "secret_file"]),
    ({"secret_env": "KVKIT_TEST_UNSET"}, ["KVKIT_TEST_UNSET is not set"]),
    ({"secret_env": "KVKIT_TEST_EMPTY"}, ["KVKIT_TEST_EMPTY is empty"]),
    ({"secret_file": "/nonexistent/kvkit-secret"}, ["/nonexistent/kvkit-secret", "cannot be read"]),
    ({"secret_file": "EMPTY"}, ["the file is empty"]),
    ({"secret_env": "KVKIT_TEST_SECRET", "secret_file": "/x"}, ["give one"]),
    ({"secret_env": ""}, ["['secret_env']=''"]),
    ({"secret_env": "PW-s3cr3t/literal"}, ["['secret_env']: not an environment variable's name"]),  # a mistake
    ({"tenant": "a:b"}, ["shared.tenant='a:b'"]),
    ({"password": "PW-s3cr3t"}, [("['shared']['password']: not taken here (the extra config is on vLLM's command "
                                 "line and in its logs)"), "?password_env=VAR", "?password_file=PATH"]),
    ({"token": "PW-s3cr3t"}, ["['shared']['token']: not taken here (the extra config", "?password_env=VAR"]),
    ({"password_env": "KVKIT_TEST_SECRET"}, [("['shared']['password_env']: not taken here; the store's password "
                                             "is named in its URL"), "?password_env=VAR"]),
])
def test_a_secret_is_never_taken_from_the_config_and_a_bad_source_is_named(shared, needles, monkeypatch, tmp_path):
    """The secret itself in the extra config is refused; an unset, empty or unreadable source is named; a
    password (or where it is kept) given beside the URL is refused saying it is named in the URL, and one given
    as it is saying it is in vLLM's logs. No message shows a secret."""
    monkeypatch.delenv("KVKIT_TEST_UNSET", raising=False)
    monkeypatch.setenv("KVKIT_TEST_EMPTY", "")
    monkeypatch.setenv("KVKIT_TEST_SECRET", "PW-s3cr3t-env")
    (tmp_path / "empty").write_bytes(b"\n")
    if shared.get("secret_file") == "EMPTY":
        shared = {"secret_file": str(tmp_path / "empty")}
    with pytest.raises(ConfigError) as info:
        _parse(shared={"url": "memory://", **shared})
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert "s3cr3t" not in str(info.value)


def _parse_in_time(shared, seconds=20.0):
    """``_parse(shared=shared)`` on a thread, given ``seconds``: answer the ConfigError it raised, or None
    if it returned, or ``"blocked"``."""
    import threading

    outcome = []

    def parse():
        try:
            _parse(shared=shared)
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=parse, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else "blocked"


@pytest.mark.parametrize("what", ["FIFO", "device", "directory", "huge file"])
def test_a_secret_file_that_is_no_small_regular_file_is_refused_at_once(what, tmp_path):
    """A FIFO (whose open waits for a writer, and whose bytes only one process could read), a device such as
    /dev/zero (which never ends), a directory, or a file far larger than any secret (the wrong path) is
    refused at once with a ConfigError naming it: never a wait, a MemoryError or a secret read in part."""
    import os

    path = {"FIFO": tmp_path / "fifo", "device": "/dev/zero", "directory": tmp_path,
            "huge file": tmp_path / "model.bin"}[what]
    if what == "FIFO":
        os.mkfifo(path)
    elif what == "huge file":
        path.write_bytes(b"s3cr3t" * (1 << 18))
    try:
        error = _parse_in_time({"url": "memory://", "secret_file": str(path)})
    finally:
        if what == "FIFO":  # a reader still waiting meets a writer and the end of the file
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert isinstance(error, ConfigError), error
    assert f"['secret_file']={str(path)!r}" in str(error) and "s3cr3t" not in str(error), str(error)


@pytest.mark.parametrize("shared", [{"url": "valkey://:hunter2@cache:6380/0"},
                                    "valkey://kvkit-acme:hunter2@cache:6380/0?ttl_s=60",
                                    "valkey://cache:6380/0?username=kvkit-acme&password=hunter2"])
def test_a_password_written_in_the_shared_url_is_taken_with_a_warning_that_does_not_show_it(shared):
    """vLLM logs its arguments at start, the extra config whole: a password written in the shared tier's URL is
    taken, with a warning naming where to keep it instead (password_env, password_file), which shows no password."""
    with pytest.warns(UserWarning, match="holds a password") as caught:
        settings = _parse(shared=shared)
    assert settings.stack.shared.url == (shared["url"] if isinstance(shared, dict) else shared)
    assert all("hunter2" not in str(w.message) and "password_env" in str(w.message) for w in caught)


@pytest.mark.parametrize("url", ["valkey://cache:6380/0?username=kvkit-acme&password_env=KVKIT_VALKEY_PASSWORD",
                                 "valkey://cache:6380/0?password_file=/run/secrets/valkey", "memory://",
                                 "file:///tmp/kv@1?capacity_bytes=1GiB"])
def test_a_url_naming_where_its_password_is_kept_is_taken_without_a_warning(url):
    """The documented forms (the password's variable or file named) and URLs without a password warn nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _parse(shared=url).stack.shared.url == url
