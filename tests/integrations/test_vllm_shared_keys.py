"""The shared-tier keys of vLLM's ``kv_connector_extra_config``: accepted into the stack, bad values quoted."""

import pytest

from kvkit.errors import ConfigError
from kvkit.integrations._vllm_settings import parse_extra_config
from kvkit.interfaces import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)


def _parse(model=None, **extra):
    return parse_extra_config({"cpu_blocks": 8, **extra}, kv=SPEC, gpu_blocks=16, world_size=1, device="cpu",
                              model=model)


@pytest.mark.parametrize(("extra", "needles"), [
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
