"""The keys of vLLM's ``kv_connector_extra_config`` are StackConfig's slots: accepted into the stack, bad values
quoted; the shared tier's ``shared`` key as a URL or a mapping of SharedConfig fields."""

import attrs
import pytest

from kvkit.config import SharedConfig, StackConfig
from kvkit.errors import ConfigError
from kvkit.integrations._vllm_settings import EXTRA_KEYS, STACK_KEYS, VLLM_SLOTS, parse_extra_config
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
