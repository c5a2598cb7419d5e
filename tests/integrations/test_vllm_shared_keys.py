"""The shared-tier keys of vLLM's ``kv_connector_extra_config``: accepted into the stack, bad values quoted."""

import pytest

from kvkit.errors import ConfigError
from kvkit.integrations._vllm_settings import parse_extra_config
from kvkit.interfaces import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)


def _parse(model=None, **extra):
    return parse_extra_config({"cpu_blocks": 8, **extra}, kv=SPEC, gpu_blocks=16, world_size=1, device="cpu",
                              model=model)


@pytest.mark.parametrize("extra, needles", [
    ({"shared": 7}, ["shared']=7", "URL string"]),
    ({"shared": "memory://", "shared_write": "write-around"}, ["write-around", "write-through"]),
    ({"shared": "memory://", "shared_url": "memory://other"}, ["disagree"]),
    ({"shared": "memory://", "shared_model": ""}, ["shared_model=''"]),
    ({"shared": "not a url"}, ["'not a url'", "URL"]),
])
def test_bad_shared_keys_are_refused_quoting_the_value(extra, needles):
    """Each shared-tier key is validated and a bad value quoted, with the valid choices."""
    with pytest.raises(ConfigError) as info:
        _parse(**extra)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize("key", ["shared", "shared_url"])
@pytest.mark.parametrize("url", ["valkey://127.0.0.1:6379/0", "file:///tmp/kv?capacity_bytes=1GiB", "memory://"])
def test_shared_keys_reach_the_stack(key, url):
    """A shared-tier URL (under either key), its write mode and model go into the stack's config."""
    stack = _parse(**{key: url, "shared_write": "write-back", "shared_model": "llama@abc"}).stack
    assert (stack.shared, stack.shared_write, stack.shared_model) == (url, "write-back", "llama@abc")


def test_the_model_identity_defaults_to_vllms_model_and_an_explicit_one_wins():
    """Without shared_model the namespace names vLLM's model and revision; the key overrides it."""
    assert _parse(model="m@rev", shared="memory://").stack.shared_model == "m@rev"
    assert _parse(model="m@rev", shared="memory://", shared_model="mine").stack.shared_model == "mine"


def test_without_shared_keys_nothing_changes():
    """A config without the shared tier builds settings as before."""
    assert _parse(model="m@rev").stack.shared is None


def test_the_tenant_and_the_secret_from_an_environment_variable_or_a_file_reach_the_stack(monkeypatch, tmp_path):
    """shared_tenant goes into the stack; the secret is read from the named variable or file (a trailing newline
    dropped), in each process that parses the config, so scheduler and workers derive the same keys."""
    from kvkit.shared.client import FormatCodec

    monkeypatch.setenv("KVKIT_TEST_SECRET", "from-the-env")
    (tmp_path / "secret").write_bytes(b"from-a-file\n")
    by_env = _parse(shared="memory://", shared_tenant="acme", shared_secret_env="KVKIT_TEST_SECRET").stack
    by_file = _parse(shared="memory://", shared_secret_file=str(tmp_path / "secret")).stack
    assert (by_env.shared_tenant, by_env.shared_secret) == ("acme", b"from-the-env")
    assert by_file.shared_secret == b"from-a-file"
    codecs = [FormatCodec.for_stack(s.kv, 1, model="m", layout="none", tenant=s.shared_tenant, secret=s.shared_secret)
              for s in (by_env, _parse(shared="memory://", shared_tenant="acme",
                                       shared_secret_env="KVKIT_TEST_SECRET").stack)]
    assert codecs[0].key(7, 0) == codecs[1].key(7, 0) and codecs[0].key(7, 0).startswith(b"kvkit:acme:")


@pytest.mark.parametrize("extra, needles", [
    ({"shared_secret": "PW-s3cr3t"}, ["shared_secret", "shared_secret_env or shared_secret_file"]),
    ({"shared_secret_env": "KVKIT_TEST_UNSET"}, ["KVKIT_TEST_UNSET is not set"]),
    ({"shared_secret_env": "KVKIT_TEST_EMPTY"}, ["KVKIT_TEST_EMPTY is empty"]),
    ({"shared_secret_file": "/nonexistent/kvkit-secret"}, ["/nonexistent/kvkit-secret", "cannot be read"]),
    ({"shared_secret_file": "EMPTY"}, ["the file is empty"]),
    ({"shared_secret_env": "KVKIT_TEST_SECRET", "shared_secret_file": "/x"}, ["give one"]),
    ({"shared_secret_env": ""}, ["shared_secret_env']=''"]),
    ({"shared_tenant": "a:b"}, ["shared_tenant='a:b'"]),
])
def test_a_secret_is_never_taken_from_the_config_and_a_bad_source_is_named(extra, needles, monkeypatch, tmp_path):
    """The secret itself in the extra config is refused; an unset, empty or unreadable source is named. No
    message shows a secret."""
    monkeypatch.delenv("KVKIT_TEST_UNSET", raising=False)
    monkeypatch.setenv("KVKIT_TEST_EMPTY", "")
    monkeypatch.setenv("KVKIT_TEST_SECRET", "PW-s3cr3t-env")
    (tmp_path / "empty").write_bytes(b"\n")
    if extra.get("shared_secret_file") == "EMPTY":
        extra = {"shared_secret_file": str(tmp_path / "empty")}
    with pytest.raises(ConfigError) as info:
        _parse(shared="memory://", **extra)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert "s3cr3t" not in str(info.value)
