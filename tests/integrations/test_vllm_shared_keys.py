"""The shared-tier keys of vLLM's ``kv_connector_extra_config``: validated, then refused (not run yet)."""

import pytest

from kvkit.errors import ConfigError
from kvkit.integrations._vllm_settings import parse_extra_config
from kvkit.interfaces import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)


def _parse(**extra):
    return parse_extra_config({"cpu_blocks": 8, **extra}, kv=SPEC, gpu_blocks=16, world_size=1, device="cpu")


@pytest.mark.parametrize("extra, needles", [
    ({"shared": "valkey://127.0.0.1:6379/0"}, ["valid, but", "does not run the shared tier yet"]),
    ({"shared_url": "file:///tmp/kv"}, ["'file:///tmp/kv'", "does not run the shared tier yet"]),
    ({"shared": 7}, ["shared']=7", "URL string"]),
    ({"shared": "memory://", "shared_write": "write-around"}, ["write-around", "write-through"]),
    ({"shared": "memory://", "shared_url": "memory://other"}, ["disagree"]),
    ({"shared": "memory://", "shared_model": ""}, ["shared_model=''"]),
])
def test_shared_keys_are_checked_and_quoted(extra, needles):
    """Each shared-tier key is validated (the bad value quoted); a valid one is refused, saying why."""
    with pytest.raises(ConfigError) as info:
        _parse(**extra)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_without_shared_keys_nothing_changes():
    """A config without the shared tier builds settings as before."""
    assert _parse().stack.shared is None
