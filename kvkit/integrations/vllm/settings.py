"""Settings of kvkit's vLLM connector: the KV shape and ``kv_connector_extra_config``, validated.

vLLM-free (vLLM's config objects are read by attribute), so both connector
sides and the tests share one parser. The scheduler side and every worker
build their settings from the same ``extra_config`` and KV cache config, so
the CPU tier's size has one source of truth: :attr:`ConnectorSettings.stack`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote as url_quote

import attrs

from kvkit.backends.blockstore.disk import absolute_path
from kvkit.config import DEFAULTS, NAMED_SLOTS, StackConfig, name_shared_model, parse_bytes, shown_url
from kvkit.errors import ConfigError
from kvkit.interfaces import GroupKind, KVCacheSpec, KVGroupSpec
from kvkit.kept import read_kept
from kvkit.redact import is_secret_name, redact_url
from kvkit.registry import STORE
from kvkit.shared.urls import PASSWORD_OPTIONS
from kvkit.validate import check_bool, check_choice, check_int, did_you_mean, plural, problem_of, quote
from kvkit.warn import warn
from kvkit.worker.layouts import LAYOUTS

__all__ = ["EXTRA_KEYS", "KV_ROLES", "SEED_DEFAULTS", "STACK_KEYS", "VLLM_SLOTS", "ConnectorSettings",
           "kv_spec_from_vllm", "kvkit_window", "parse_extra_config", "shared_layout", "warn_logged_password"]

VLLM_SLOTS: dict[str, str] = {
    "kv": "vLLM's KV cache config",
    "gpu_blocks": "vLLM's KV cache config",
    "world_size": "vLLM's tensor-parallel size",
    "device": "vLLM's platform",
    "gpu_eviction": "vLLM's prefix cache evicts GPU blocks",
    "hash_algorithm": "vLLM's block hashes",
    "callbacks": "objects do not cross vLLM's processes",
}
"""``StackConfig`` slots the connector sets from vLLM, and from what; the extra config takes every other one."""

STACK_KEYS: tuple[str, ...] = tuple(f.name for f in attrs.fields(StackConfig) if f.name not in VLLM_SLOTS)
"""``StackConfig`` slots ``kv_connector_extra_config`` takes, with their meaning and defaults."""

_CONNECTOR_KEYS = ("layout", "async_load", "layerwise")
_DISK_KEYS = ("disk_path", "disk_capacity_bytes", "disk_buffer_slots", "use_page_cache")
"""The seed's keys that only its disk backend reads (ignored, with a warning, under ``kv_offload_backend="cpu"``)."""
_SEED_KEYS = ("cpu_bytes_to_use", "cpu_bytes_to_use_per_rank", "lazy_offload", "kv_offload_backend", *_DISK_KEYS)

SEED_DEFAULTS: dict[str, Any] = {"cpu_bytes_to_use": 8 << 30, "kv_offload_backend": "cpu",
                                 "disk_capacity_bytes": 100 << 30, "disk_buffer_slots": 2, "use_page_cache": False}
"""Defaults of vLLM's ``SimpleCPUOffloadConnector`` (vllm 0.32) that kvkit applies to an absent key:
8 GiB of CPU tier over all ranks, the CPU backend, 100 GiB of disk per rank, 2 I/O slots, no page cache."""

KV_ROLES: dict[str, str] = {
    "kv_both": "loads hits and stores",
    "kv_producer": "stores; loads its own hits too (a hit only spares compute, the tokens are the same)",
    "kv_consumer": "loads hits and never stores (store='never'): it reads what producers stored",
}
"""vLLM's ``KVTransferConfig.kv_role`` values and what kvkit's connector does under each."""

EXTRA_KEYS: tuple[str, ...] = (*STACK_KEYS, *_CONNECTOR_KEYS, *_SEED_KEYS)
"""Keys ``kv_connector_extra_config`` may hold (see :func:`parse_extra_config`): :data:`STACK_KEYS`,
the connector's own, and those of vLLM's ``SimpleCPUOffloadConnector``, with its meaning."""

_BYTE_KEYS = ("cpu_bytes", "cpu_bytes_to_use_per_rank", "cpu_bytes_to_use")
"""Keys that size the CPU tier in bytes: per worker (kvkit's), per rank, and in total over every rank."""

_EXTRA = "kv_connector_extra_config"

_SECRET_SOURCES = ("secret_env", "secret_file")
"""Where the connector reads the shared tier's HMAC secret (keys of ``shared``): never the extra config
itself, which is on vLLM's command line and in its logged config."""


@attrs.frozen
class ConnectorSettings:
    """Everything one connector side needs, validated.

    Attributes:
        stack: the offload stack's configuration (KV shape, CPU capacity,
            component names); ``stack.num_cpu_blocks`` sizes both the
            scheduler's CPU pool and every worker's CPU mirror.
        layout: ``"auto"`` (detected from vLLM's KV tensors) or a name in
            :data:`kvkit.worker.layouts.LAYOUTS`.
        async_load: a CPU hit is loaded while other requests run (vLLM's
            asynchronous-load path), not before the forward pass that reads it.
            :func:`parse_extra_config` sets it for a model with several KV groups
            or a sliding-window group and a shared tier (vLLM recomputes a failed
            load of such a model correctly only as a whole request loaded
            asynchronously).
        layerwise: loads and stores run layer by layer: a layer's forward waits
            (on the device) only for its own blocks, a layer's stores start once
            its KV is written.
        num_cpu_blocks: ``stack.num_cpu_blocks``, computed once.
        shared_layout: with a shared tier, the CPU payload layout its
            namespace names (:func:`shared_layout`); ``None`` without one.
    """

    stack: StackConfig
    layout: str = "auto"
    async_load: bool = False
    layerwise: bool = True
    num_cpu_blocks: int = attrs.field(
        init=False, default=attrs.Factory(lambda self: self.stack.num_cpu_blocks, takes_self=True))
    """Blocks of the CPU tier (the one figure both sides must agree on)."""
    shared_layout: str | None = attrs.field(
        init=False, default=attrs.Factory(lambda self: shared_layout(self.stack, self.layout), takes_self=True))


def shared_layout(stack: StackConfig, layout: str) -> str | None:
    """The CPU payload layout the shared tier's namespace names, from what the scheduler knows too.

    The namespace must be the same on the scheduler (which derives keys for
    ``contains``) and on every worker, but vLLM's KV layout is detected on the
    worker. So it is a deterministic function of the settings both sides
    share: ``cpu_layout`` if given, else ``layout`` if not ``"auto"``, else
    the layout vLLM's default attention backend of that device and cache kind
    uses (``latent`` for MLA, ``vllm-cpu`` on CPU, FlashAttention's
    ``per-layer`` on CUDA). Each worker checks, once its KV is registered,
    that its CPU mirror is in this layout and refuses to start otherwise
    (:meth:`~kvkit.integrations.vllm.worker.WorkerSide.register`).
    """
    if stack.shared is None:
        return None
    if stack.cpu_layout is not None:
        return stack.cpu_layout
    if layout != "auto":
        return layout
    if stack.kv.latent:
        return "latent"
    return "vllm-cpu" if stack.device == "cpu" else "per-layer"


_KINDS = {"FullAttentionSpec": GroupKind.FULL, "SlidingWindowSpec": GroupKind.SLIDING_WINDOW,
          "MLAAttentionSpec": GroupKind.FULL}
"""vLLM KV cache spec classes (by exact name: other subclasses are refused) -> group kind."""

_LATENT = "MLAAttentionSpec"
"""The spec of MLA layers: one latent vector of ``head_size`` per token (``head_size_v=0``), no K and V."""


def kv_spec_from_vllm(kv_cache_config: Any) -> KVCacheSpec:
    """The :class:`KVCacheSpec` of a vLLM ``KVCacheConfig``: one kvkit KV group per vLLM group.

    Reads each of ``kv_cache_groups``: ``layer_names`` (kvkit numbers the layers
    group after group, as the worker registers them) and ``kv_cache_spec``
    (``block_size``, ``num_kv_heads``, ``head_size``, ``head_size_v``, ``dtype``,
    and a sliding window's ``sliding_window`` and ``extra_retained_tokens``).
    MLA layers (``MLAAttentionSpec``: full attention over one latent of
    ``head_size`` per token, ``head_size_v=0``) give a
    :attr:`~kvkit.interfaces.KVCacheSpec.latent` spec.
    A sliding-window group gets the kvkit window whose blocks are exactly
    those vLLM keeps for the next token (:func:`kvkit_window`), so a hit loads
    every block vLLM's attention reads and none it replaced by its null block.

    Raises:
        ConfigError: no groups; a group that is neither full attention, a
            sliding window nor MLA (Mamba, chunked local...), has K and V of
            different sizes (or an MLA latent with a V), or differs from the
            others in block size, heads, head size, dtype or cache kind (latent
            or K/V); a window vLLM keeps in one block.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        raise ConfigError(f"kvkit's vLLM connector needs at least one KV cache group, got none "
                          f"(kv_cache_config={type(kv_cache_config).__name__})")
    shapes, kv_groups, first = set(), [], 0
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        head_size = getattr(spec, "head_size", None)
        latent = name == _LATENT
        if name not in _KINDS or getattr(spec, "head_size_v", head_size) != (0 if latent else head_size):
            raise ConfigError(
                f"kvkit's vLLM connector serves full-attention and sliding-window layers with K and V of "
                f"equal size, and MLA layers of one latent (head_size_v=0); KV cache group {g} is "
                f"{name}(head_size={head_size!r}, head_size_v={getattr(spec, 'head_size_v', None)!r})")
        shapes.add((spec.block_size, spec.num_kv_heads, head_size, str(spec.dtype).removeprefix("torch."),
                    latent))
        layers = range(first, first + len(group.layer_names))
        first += len(layers)
        if _KINDS[name] is GroupKind.FULL:
            kv_groups.append(KVGroupSpec(layers))
        else:
            window = kvkit_window(spec.sliding_window + getattr(spec, "extra_retained_tokens", 0),
                                  spec.block_size)
            kv_groups.append(KVGroupSpec(layers, GroupKind.SLIDING_WINDOW, window))
    if len(shapes) != 1:
        raise ConfigError(f"kvkit's vLLM connector needs one block size, KV head count, head size, dtype and "
                          f"cache kind (MLA latent or K/V) across KV cache groups, got {sorted(shapes)!r}")
    ((block_size, num_kv_heads, head_dim, dtype, latent),) = shapes
    return KVCacheSpec(num_layers=first, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       dtype=dtype, groups=kv_groups, latent=latent)


def kvkit_window(vllm_window: int, block_size: int) -> int:
    """The kvkit window whose :meth:`~kvkit.interfaces.KVGroupSpec.blocks_needed` is what vLLM keeps.

    vLLM keeps, before a block-aligned position ``T``, the blocks holding
    tokens ``[T - vllm_window + 1, T)`` (those the token at ``T`` attends to):
    ``ceil((vllm_window - 1) / block_size)`` blocks. kvkit's window ``w``
    needs ``ceil(w / block_size) + 1``, so ``w`` is one block less.

    Raises:
        ConfigError: vLLM keeps a single block (``vllm_window <= block_size + 1``):
            no kvkit window loads that few.
    """
    kept = -(-(vllm_window - 1) // block_size)
    if kept < 2:
        raise ConfigError(f"sliding_window={vllm_window!r} with block_size={block_size!r}: vLLM keeps one "
                          f"block per window, kvkit loads at least two; use a window above "
                          f"{plural(block_size + 1, 'token')} or a smaller block size")
    return (kept - 1) * block_size


def parse_extra_config(extra: Mapping[str, Any] | None, *, kv: KVCacheSpec, gpu_blocks: int,
                       world_size: int, device: str, model: str | None = None,
                       role: str = "kv_both") -> ConnectorSettings:
    """Validate ``kv_connector_extra_config`` and turn it into settings.

    Keys (all optional):

    * every ``StackConfig`` slot of :data:`STACK_KEYS`, with its meaning,
      default (:data:`kvkit.config.DEFAULTS`) and checks; the rest are
      :data:`VLLM_SLOTS`. Named slots (``cpu_eviction``, ``store``, ``copy``,
      ``allocator``) take registered names, as ``kvkit list`` shows them: the
      config crosses process boundaries. ``shared`` is a URL string or a
      mapping of :class:`~kvkit.config.SharedConfig` fields (``{"url": ...,
      "write": "write-back", "tenant": "acme"}``); its ``model`` defaults to
      ``model`` (vLLM's model and revision). Its HMAC ``secret`` is never
      taken from the extra config (on vLLM's command line and in its logs):
      the mapping's ``secret_env`` (an environment variable's name) or
      ``secret_file`` (a path) names where each connector process reads it
      (a variable's UTF-8 bytes; a file's bytes without a trailing newline, from
      a regular file of at most 64 KiB). A password written in its URL is
      taken with a ``UserWarning`` (it is on vLLM's command line and in the
      arguments vLLM logs): ``?password_env=VAR`` or ``?password_file=PATH``
      name where each process reads it instead. ``cpu_layout``
      defaults to vLLM's layout, e.g. ``"cross-layer"`` for the ``staged``
      copy backend;
    * the CPU tier's size: ``cpu_bytes`` (``"8GiB"`` or an int; per worker)
      or ``cpu_blocks``, or the keys of vLLM's ``SimpleCPUOffloadConnector``
      (the seed) with its meaning: ``cpu_bytes_to_use`` (the total, divided by
      ``world_size``; 8 GiB when no key sizes the tier) and
      ``cpu_bytes_to_use_per_rank``, which wins over a disagreeing total with
      a warning. ``cpu_bytes`` beside a seed key must agree per worker, and
      ``cpu_blocks`` goes alone;
    * ``lazy_offload`` (the seed's, a bool): ``True`` is ``store="lazy"``,
      ``False`` any other store policy; a ``store`` that contradicts it is refused;
    * ``kv_offload_backend`` (the seed's ``"cpu"``, the default, or ``"disk"``)
      with ``disk_path``, ``disk_capacity_bytes``, ``disk_buffer_slots`` and
      ``use_page_cache``: ``"disk"`` puts kvkit's disk block store behind the
      CPU tier as the shared tier (see :func:`_seed_backend`; ``shared`` beside
      it is refused); under ``"cpu"`` the disk keys are ignored with a warning;
    * ``async_load`` (a bool): load CPU hits while other requests run, through
      vLLM's asynchronous-load path. Default ``False``, but ``True`` for a
      model with several KV groups or a sliding-window group and a shared
      tier: vLLM takes a failed load of a model with several groups only as a
      whole request loaded asynchronously (block ids are per group), and
      recomputes a failed synchronous load from its first block, before which
      a sliding-window group holds no KV; a shared value missing, corrupt or
      late fails its load. ``False`` is refused there;
    * ``layerwise`` (a bool, default ``True``): per-layer loads and stores
      (``wait_for_layer_load`` waits for one layer, ``save_kv_layer`` lets that
      layer's stores start); ``False`` loads everything before the forward pass;
    * ``layout``: ``"auto"`` (default) or a kvkit layout name.

    On the CPU platform the ``torch`` copy backend runs on its background
    thread (``options["copy"]["host_thread"]``, default ``True`` there).

    ``role`` is vLLM's ``kv_role`` (:data:`KV_ROLES`): ``kv_consumer`` sets
    ``store="never"`` (it loads, never stores; a ``store`` or ``lazy_offload``
    that would store is refused), ``kv_producer`` and ``kv_both`` load and store.

    Raises:
        ConfigError: ``extra`` is neither a mapping nor ``None``; or one error
            listing every problem (unknown keys, names that are not registered
            or not available here, a bad capacity, a write-back store policy
            with several KV groups: it writes back single GPU blocks;
            ``async_load=False`` with a shared tier and several KV groups or a
            sliding-window group; capacity
            keys or ``lazy_offload`` and ``store`` that contradict each other or
            the role; an unknown ``kv_offload_backend``, a disk backend without
            ``disk_path`` or with a bad size, slot count or flag; a secret given
            in the config, or a secret source that is unset, empty, unreadable,
            or a file that is no regular file of at most 64 KiB: named, never
            shown).
    """
    if extra is not None and not isinstance(extra, Mapping):  # a JSON string or list given for the object
        raise ConfigError(f"{_EXTRA}={quote(extra)}: must be a mapping of its keys (a JSON object), such as "
                          f"{{'cpu_bytes': '8GiB'}}, or None")
    extra = dict(extra or {})
    if role not in KV_ROLES:
        raise ConfigError(f"kv_role={quote(role)}: expected one of {', '.join(KV_ROLES)}")
    problems = [f"{_EXTRA}[{quote(key)}]: {VLLM_SLOTS[key]} sets it" if key in VLLM_SLOTS else
                f"{_EXTRA}[{quote(key)}]: unknown key; valid: {', '.join(EXTRA_KEYS)}{did_you_mean(key, EXTRA_KEYS)}"
                for key in extra if key not in EXTRA_KEYS]
    slots = {key: extra[key] for key in STACK_KEYS if key in extra and key not in ("cpu_blocks", "cpu_bytes")}
    for slot in set(NAMED_SLOTS) & slots.keys():
        if not isinstance(slots[slot], str):  # the loop also drops the slot
            problems.append(f"{_EXTRA}[{slot!r}]={quote(slots.pop(slot))}: must be a registered name (the "  # noqa: PERF401
                            f"config crosses process boundaries); register your class in kvkit.registry")
    bools = {key: problem_of(check_bool, f"{_EXTRA}[{key!r}]", extra[key])
             for key in ("async_load", "layerwise", "lazy_offload") if key in extra}
    problems += [problem for problem in bools.values() if problem is not None]
    lazy = extra.get("lazy_offload")
    if lazy is not None and bools["lazy_offload"] is None:
        if "store" in extra and (extra["store"] == "lazy") != lazy:
            problems.append(f"{_EXTRA}: lazy_offload={lazy!r} contradicts store={quote(extra['store'])}; "
                            f"give one of them")
        elif lazy:
            slots["store"] = "lazy"
    if role == "kv_consumer":
        if slots.get("store", "never") != "never":
            given = "lazy_offload=True" if lazy is True else f"store={quote(slots['store'])}"
            problems.append(f"kv_role='kv_consumer' never stores; {_EXTRA}: {given} contradicts it; drop it or "
                            f"use kv_role='kv_both'")
        slots["store"] = "never"
    disk, wrong = _seed_backend(extra)
    problems += wrong
    if disk is not None:
        if "shared" in slots:
            problems.append(f"{_EXTRA}: kv_offload_backend='disk' and shared both name the tier behind the CPU "
                            f"tier; give one of them")  # shared's URL may hold a password: never shown
        else:
            slots["shared"] = disk
    capacity, wrong = _capacity(extra, world_size)
    problems += wrong
    layout = extra.get("layout", "auto")
    if (problem := problem_of(check_choice, f"{_EXTRA}['layout']", layout, ("auto", *LAYOUTS))) is not None:
        problems.append(problem)
    shared = slots.get("shared")
    url = shared.get("url") if isinstance(shared, Mapping) else shared
    warn_logged_password(f"{_EXTRA}['shared']", url)
    if shared is not None and not isinstance(url, str):
        shown = f"['url']={quote(url)}" if isinstance(shared, Mapping) else f"={quote(shared)}"  # never the secret
        problems.append(f"{_EXTRA}['shared']{shown}: must be a URL string, or a mapping of SharedConfig fields "
                        f"with one (the config crosses process boundaries)")
        del slots["shared"]
    elif isinstance(shared, Mapping):
        slots["shared"], wrong = _read_secret(shared)
        problems += wrong
    slots.update(_host_thread_copy(slots, device))
    stack = None
    try:
        stack = StackConfig(kv=kv, gpu_blocks=gpu_blocks, world_size=world_size, device=device, **capacity, **slots)
    except ConfigError as exc:
        problems += exc.problems
    if stack is not None and model is not None:
        stack = name_shared_model(stack, model)
    if stack is not None and len(kv.groups) > 1 and _writes_back(stack):
        problems.append(
            f"store={stack.store!r}: a write-back policy stores single GPU blocks, and this model has "
            f"{plural(len(kv.groups), 'KV cache group')}; use eager, selective or never")
    windowed = any(g.kind is GroupKind.SLIDING_WINDOW for g in kv.groups)
    async_by_need = stack is not None and stack.shared is not None and (len(kv.groups) > 1 or windowed)
    if async_by_need and extra.get("async_load") is False:
        why = (f"with {plural(len(kv.groups), 'KV cache group')}: vLLM stops the engine on a failed synchronous "
               f"load of such a model (its block ids are per group)" if len(kv.groups) > 1 else
               "with a sliding-window KV group: vLLM recomputes a failed synchronous load from its first block, "
               "and such a group holds no block before its window, so the recomputed tokens would attend to KV "
               "that is not there")
        problems.append(
            f"{_EXTRA}['async_load']=False with a shared tier (shared, or kv_offload_backend='disk') for a model "
            f"{why}; vLLM recomputes a failed load whole only for a request loaded asynchronously, and a shared "
            f"value missing, corrupt or late fails its load; drop async_load (it is then true) or the shared tier")
    if problems:
        raise ConfigError(problems)
    assert stack is not None  # built, or its problems were raised
    return ConnectorSettings(stack, layout, extra.get("async_load", async_by_need), extra.get("layerwise", True))


def warn_logged_password(where: str, url: object, options: Mapping[str, Any] | None = None) -> None:
    """One ``UserWarning``, showing no secret, when the store ``url`` or one of its ``options`` given at
    ``where`` in vLLM's ``kv_transfer_config`` holds a password or another secret (:mod:`kvkit.redact`'s rule):
    that config is on vLLM's command line and in the arguments vLLM logs at start, which kvkit cannot mask. It
    is taken all the same; the warning names where every process can read it instead (``password_env``,
    ``password_file``)."""
    given = dict(options or {})
    named = [name for name, value in given.items() if value is not None and is_secret_name(name)]
    if isinstance(url, str) and redact_url(url) != url:
        holder = f"the URL {quote(shown_url(url))} holds"
    elif named:
        holder = f"{', '.join(map(repr, named))} {'holds' if len(named) == 1 else 'hold'}"
    else:
        return
    warn(f"{where}: {holder} a password (or another secret), which is on vLLM's command line and in the "
         f"arguments vLLM logs at start (kvkit cannot mask either); name where every connector process reads it "
         f"instead: ?password_env=VAR or ?password_file=PATH", UserWarning)


def _read_secret(shared: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``shared`` with its ``secret_env`` or ``secret_file`` read into ``secret``, and the problems.

    A ``secret`` given as is is refused, and so is a password (any secret-named key: not a ``SharedConfig``
    field) or where one is kept: the store's password is named in its URL. The source is read by
    :mod:`kvkit.kept`'s rules (messages name the variable or the file, never what it holds).
    """
    shared = dict(shared)
    where = f"{_EXTRA}['shared']"
    problems = []
    if shared.pop("secret", None) is not None:
        problems.append(f"{where}['secret']: not taken here (the extra config is on vLLM's command line and in "
                        f"its logs); name where every connector process reads it: secret_env (an environment "
                        f"variable) or secret_file (a file)")
    for key in [key for key in shared if key in PASSWORD_OPTIONS or is_secret_name(key)]:
        del shared[key]
        logged = "" if key in PASSWORD_OPTIONS[1:] else " (the extra config is on vLLM's command line and in its logs)"
        problems.append(f"{where}[{key!r}]: not taken here{logged}; the store's password is named in its URL, "
                        f"where every connector process reads it: ?password_env=VAR or ?password_file=PATH")
    given = {key: shared.pop(key) for key in _SECRET_SOURCES if shared.get(key) is not None}
    if len(given) > 1:
        return shared, [*problems, f"{where}: secret_env and secret_file both name the secret; give one"]
    for key, source in given.items():
        try:
            shared["secret"] = read_kept(f"{where}[{key!r}]", source, "env" if key == "secret_env" else "file")
        except ConfigError as exc:
            problems.extend(exc.problems)
    return shared, problems


def _capacity(extra: Mapping[str, Any], world_size: int) -> tuple[dict[str, Any], list[str]]:
    """``StackConfig``'s ``cpu_bytes``/``cpu_blocks`` from kvkit's or the seed's keys, and their contradictions.

    Rules, per worker: kvkit's ``cpu_bytes`` or ``cpu_blocks`` as given; else
    the seed's ``cpu_bytes_to_use_per_rank`` when given (a ``cpu_bytes_to_use``
    over ``world_size`` that disagrees is warned about and ignored, as the seed
    does), else ``cpu_bytes_to_use // world_size`` (8 GiB in total when no key
    sizes the tier: :data:`SEED_DEFAULTS`). ``cpu_blocks`` beside a byte key,
    and ``cpu_bytes`` beside a seed key that gives another size, are refused.
    With a contradiction the capacity is a one-block stand-in, so every other
    key is still checked (and the config is refused anyway).
    """
    given = {key: extra[key] for key in _BYTE_KEYS if extra.get(key) is not None}
    blocks = extra.get("cpu_blocks")
    if blocks is not None or "cpu_bytes" in given:
        if set(given) <= {"cpu_bytes"}:  # kvkit's own keys: StackConfig checks them
            return {"cpu_bytes": given.get("cpu_bytes"), "cpu_blocks": blocks}, []
        if blocks is not None:
            return {"cpu_blocks": 1}, [(f"{_EXTRA}: cpu_blocks={blocks!r} and "
                                        f"{', '.join(f'{k}={v!r}' for k, v in given.items())} all size the CPU "
                                        f"tier; give cpu_blocks or bytes")]
    per_worker, problems = {}, []
    for key, value in given.items():
        try:
            num_bytes = parse_bytes(value)
        except ConfigError as exc:
            problems.append(f"{_EXTRA}[{key!r}]={value!r}: {exc}")
            continue
        per_worker[key] = num_bytes // world_size if key == "cpu_bytes_to_use" else num_bytes
    if problems:
        return {"cpu_blocks": 1}, problems
    if not per_worker:
        return {"cpu_bytes": SEED_DEFAULTS["cpu_bytes_to_use"] // world_size}, []
    total, rank = per_worker.get("cpu_bytes_to_use"), per_worker.get("cpu_bytes_to_use_per_rank")
    if "cpu_bytes" in per_worker and len(set(per_worker.values())) > 1:
        return {"cpu_blocks": 1}, [
            f"{_EXTRA}: " + ", ".join(f"{k}={given[k]!r} ({n} bytes per worker)" for k, n in per_worker.items())
            + f" disagree (cpu_bytes_to_use is the total over {plural(world_size, 'worker')}); give one of them"]
    if total is not None and rank is not None and total != rank:
        warn(f"{_EXTRA}: cpu_bytes_to_use_per_rank={given['cpu_bytes_to_use_per_rank']!r} ({rank} bytes) "
             f"!= cpu_bytes_to_use={given['cpu_bytes_to_use']!r} over {plural(world_size, 'worker')} "
             f"({total} bytes); using the per-rank value", UserWarning)
    return {"cpu_bytes": rank if rank is not None else per_worker[next(iter(per_worker))]}, []


def _seed_backend(extra: Mapping[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    """The shared tier the seed's ``kv_offload_backend`` names (``None`` for ``"cpu"``), and the problems.

    ``"cpu"`` (the default) is kvkit's CPU tier alone; the disk keys are then
    ignored with a warning, as the seed does. ``"disk"`` adds kvkit's disk
    block store (``backends/blockstore/disk.py``) behind the CPU tier, as the
    shared tier (write-through): ``disk_path`` (required) is its directory
    (created if missing; every rank's blocks in it; a leading ``~`` is the
    home directory, as for any DiskStore's path), ``disk_capacity_bytes``
    its size per worker process (100 GiB), ``disk_buffer_slots`` its I/O
    threads (the transfers in flight, 2), ``use_page_cache`` its
    ``page_cache`` (``False``: each value is flushed and dropped from the
    page cache once written or read, where the seed opens with ``O_DIRECT``).
    """
    backend = extra.get("kv_offload_backend", SEED_DEFAULTS["kv_offload_backend"])
    if backend not in ("cpu", "disk"):
        return None, [f"{_EXTRA}['kv_offload_backend']={quote(backend)}: expected 'cpu' or 'disk'"]
    if backend == "cpu":
        ignored = [key for key in _DISK_KEYS if key in extra]
        if ignored:
            warn(f"{_EXTRA}: kv_offload_backend is 'cpu', ignoring the disk backend's "
                 f"{', '.join(ignored)}; set kv_offload_backend='disk' to use it", UserWarning)
        return None, []
    values = {key: extra.get(key, SEED_DEFAULTS.get(key)) for key in _DISK_KEYS}
    problems = []
    path = values["disk_path"]
    if not isinstance(path, str) or not path:
        problems.append(f"{_EXTRA}['disk_path']={quote(path)}: kv_offload_backend='disk' needs a directory path")
    try:
        capacity = parse_bytes(values["disk_capacity_bytes"])
    except ConfigError as exc:
        problems.append(f"{_EXTRA}['disk_capacity_bytes']={quote(values['disk_capacity_bytes'])}: {exc}")
    else:
        if capacity <= 0:
            problems.append(f"{_EXTRA}['disk_capacity_bytes']={quote(values['disk_capacity_bytes'])}: must be "
                            f"above 0")
    for key, check, kwargs in (("disk_buffer_slots", check_int, {"minimum": 1}), ("use_page_cache", check_bool, {})):
        if (problem := problem_of(check, f"{_EXTRA}[{key!r}]", values[key], **kwargs)) is not None:
            problems.append(problem)
    if problems:
        return None, problems
    page_cache = str(values["use_page_cache"]).lower()
    path = absolute_path(path)  # as DiskStore makes its own path absolute
    url = (f"file://{url_quote(os.fsencode(path))}?capacity_bytes={capacity}"  # its bytes
           f"&threads={values['disk_buffer_slots']}&page_cache={page_cache}")
    return {"url": url}, []


def _host_thread_copy(slots: Mapping[str, Any], device: str) -> dict[str, Any]:
    """``options`` with ``{"copy": {"host_thread": True}}`` for the ``torch`` copy on the CPU platform, else nothing.

    vLLM's KV and the CPU tier are both host memory there, where ``TorchCopy``
    would copy inside ``submit``: on its background thread, asynchronous loads
    and stores run while the worker goes on. A ``host_thread`` given in
    ``options`` is kept; malformed ``options`` are left for ``StackConfig`` to refuse.
    """
    options = slots.get("options", {})
    if device != "cpu" or slots.get("copy", DEFAULTS.copy) != "torch" or not isinstance(options, Mapping):
        return {}
    copy = options.get("copy", {})
    if not isinstance(copy, Mapping):
        return {}
    return {"options": {**options, "copy": {"host_thread": True, **copy}}}


def _writes_back(stack: StackConfig) -> bool:
    store = STORE.create(stack.store, slot="store", **dict(stack.options.get("store", {})))
    return store.writeback_target(0, 1) > 0
