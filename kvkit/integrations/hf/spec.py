"""What kvkit needs to know of a Hugging Face model: its KV spec and its identity.

:func:`kv_spec_from_config` reads the KV geometry from a model config;
:func:`model_fingerprint` keys blocks by the model's identity (config, dtype
and a fingerprint of its weights, or a name the user gives), so two models on
one stack never reuse each other's KV, while the same model wrapped twice does.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvkit.config import DEFAULTS
from kvkit.errors import ConfigError, UnsupportedModelError
from kvkit.hashing import BlockHasher
from kvkit.interfaces import GroupKind, KVCacheSpec, KVGroupSpec
from kvkit.validate import plural, quote

SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` values whose attention and cache kvkit was tested against."""


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def kv_spec_from_config(config: Any, *, block_size: int = DEFAULTS.block_size, dtype: object = None) -> KVCacheSpec:
    """The ``KVCacheSpec`` of a model built from ``config``, with one KV group per attention kind.

    The layer kinds come from the cache ``transformers`` itself builds for the
    config: full-attention layers form one group, sliding-window layers one
    group per window size.

    Args:
        config: a ``transformers`` model config (``PretrainedConfig``).
        block_size: tokens per kvkit block.
        dtype: KV element type (a ``torch.dtype`` or its name); default the
            config's dtype, else float32.

    Raises:
        UnsupportedModelError: a family outside :data:`SUPPORTED_FAMILIES`, or
            a cache layer that is neither full attention nor a sliding window.
        ConfigError: a bad block size or dtype.
    """
    text = _text_config(config)
    family = getattr(text, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model family {family!r} is not supported by kvkit.integrations.hf; supported: "
            f"{list(SUPPORTED_FAMILIES)} (decoder-only, full or sliding-window attention)")
    num_layers = int(text.num_hidden_layers)
    layers = DynamicCache(config=config).layers
    if len(layers) != num_layers:
        raise UnsupportedModelError(
            f"{family!r} config builds {plural(len(layers), 'cache layer')} for {plural(num_layers, 'hidden layer')} "
            f"(shared or missing KV); kvkit needs one cache layer per layer")
    full: list[int] = []
    sliding: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            full.append(i)
        elif type(layer) is DynamicSlidingWindowLayer:
            sliding.setdefault(int(layer.sliding_window), []).append(i)
        else:
            raise UnsupportedModelError(
                f"layer {i} of {family!r} uses a {type(layer).__name__} cache; kvkit holds only "
                f"DynamicLayer (full attention) and DynamicSlidingWindowLayer")
    groups = [KVGroupSpec(full)] if full else []
    # HF's window W covers the query itself; the group's window covers the W tokens attended.
    groups += [KVGroupSpec(ls, kind=GroupKind.SLIDING_WINDOW, window=w) for w, ls in sorted(sliding.items())]
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    if dtype is None:
        dtype = getattr(text, "dtype", None) or torch.float32
    return KVCacheSpec(num_layers=num_layers, block_size=block_size, num_kv_heads=kv_heads,
                       head_dim=head_dim, dtype=_dtype_name(dtype), groups=groups)


_SAMPLES_PER_TENSOR = 64


_NOT_IDENTITY = ("_name_or_path",)  # where the config was loaded from, not what the model is


def model_fingerprint(model: Any, *, model_name: str | None = None) -> str:
    """A hex SHA-256 digest of what makes ``model``'s KV mean what it means; kvkit salts its blocks with it.

    It digests the config (``config.to_dict()`` without the path it was loaded
    from), the dtype, and either ``model_name`` or a fingerprint of the weights: for
    every parameter its name, shape, dtype and the bytes of 64 evenly spaced
    elements (one small gather per tensor; the weights are not read whole).
    Equal models (the same object, a copy, the same checkpoint loaded twice)
    get equal digests; another config, dtype or set of weights gets another.

    The weights fingerprint samples: a fine-tune that changed only a few rows
    of a tensor may keep its base model's digest. Give ``model_name`` (a model
    id and revision, say) to be sure, or to skip the sampling. The name
    replaces the weights: two models given one name and config are treated as
    one, and share KV; keeping names distinct is the caller's responsibility.

    Raises:
        ConfigError: ``model_name`` is not a non-empty str, or a parameter has
            no data to sample (the meta device) and no ``model_name`` was given.
    """
    _check_model_name(model_name)
    config = {k: v for k, v in model.config.to_dict().items() if k not in _NOT_IDENTITY}
    digest = hashlib.sha256(b"kvkit-hf-model-v1")
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(f"\0dtype={_dtype_name(model.dtype)}\0".encode())
    if model_name is not None:
        digest.update(b"name\0" + model_name.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.device.type == "meta":
                raise ConfigError(f"parameter {pname!r} is on the meta device, so its weights cannot be "
                                  f"fingerprinted; pass model_name= to name the model")
            flat = param.detach().reshape(-1)
            count = min(flat.numel(), _SAMPLES_PER_TENSOR)
            # Exact integer positions: the same tensor gives the same sample on every device.
            where = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
            sample = flat.index_select(0, where).view(torch.uint8).cpu().numpy().tobytes()
            digest.update(f"\0{pname}\0{tuple(param.shape)}\0{param.dtype}\0".encode() + sample)
    return digest.hexdigest()


def _check_model_name(model_name: object) -> None:
    if model_name is not None and (not isinstance(model_name, str) or not model_name):
        raise ConfigError(f"model_name={quote(model_name)}: must be a non-empty str (or None: fingerprint the weights)")


def _check_identity(model_name: object, cache_salt: tuple) -> None:
    """Refuse a bad ``model_name`` or ``cache_salt`` now, before a stack is built or a prompt hashed."""
    _check_model_name(model_name)
    BlockHasher(1, extra_keys=cache_salt)  # encodes the salt once: a bad key raises HashInputError
