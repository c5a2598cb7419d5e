"""``kvkit bench transfer``: GB/s of each copy backend on a model-shaped KV cache, every copy checked.

For each backend the benchmark copies one plan (or a store and a load plan at
once) repeatedly and reports GB/s next to the ceiling measured in the same
run: one large page-locked copy per direction. Every timed copy is checked:
destinations are poisoned first and compared byte for byte with their sources
afterwards. ``--with-gemm`` runs bf16 8192x8192 matrix products while copies
keep running on another thread (the copy covers the whole GEMM window) and
reports GEMM time per product against GEMMs alone, plus the copy rate inside
that window. Without a GPU both tiers live in host memory and only backends
that run there (``torch``) are timed.
"""

from __future__ import annotations

import collections
import functools
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import numpy as np
import torch

from kvkit.errors import ConfigError, SpecMismatchError
from kvkit.interfaces.capabilities import LayeredCopy
from kvkit.interfaces.copy import CopyBackend, Region
from kvkit.interfaces.types import Direction, KVCacheSpec, TransferPlan
from kvkit.registry import COPY
from kvkit.validate import did_you_mean, plural
from kvkit.worker.engine import layer_stages
from kvkit.worker.layouts import allocate_kv, check_layouts, kv_nbytes, kv_views, regions_for
from kvkit.worker.memory import check_fits

__all__ = ["DIRECTIONS", "GemmLoad", "Rig", "bench_backend", "gemm_alone", "make_plans",
           "measure_ceiling", "run_transfer"]

_POISON = 0xA5
_GEMM_N = 8192
DIRECTIONS = {Direction.STORE.value: (Direction.STORE,), Direction.LOAD.value: (Direction.LOAD,),
              "both": (Direction.STORE, Direction.LOAD)}
"""Direction names -> the plans they time: ``store`` (GPU -> CPU), ``load`` (CPU -> GPU), or both at once."""

def _direction(direction: str) -> str:
    """``direction`` as a name in :data:`DIRECTIONS`.

    Raises:
        ConfigError: not a direction name.
    """
    if direction not in DIRECTIONS:
        valid = list(DIRECTIONS)
        raise ConfigError(f"direction={direction!r}: unknown; valid: {', '.join(valid)}"
                          f"{did_you_mean(str(direction), valid)}")
    return direction


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[num_blocks, piece_bytes]`` uint8 (pieces are contiguous)."""
    return t.flatten(1).view(torch.uint8) if t.dim() > 1 else t.view(torch.uint8).unsqueeze(1)


@attrs.define(eq=False)
class Rig:
    """A KV cache on both tiers, filled with random bytes, and its regions.

    The CPU tier is one page-locked buffer carved with ``kv_views`` in the
    GPU tier's layout or another one (as the transfer engine allocates its mirror). The GPU tier is one buffer too
    (``alloc="buffer"``: regions evenly spaced) or one tensor per layer
    (``alloc="tensors"``, as most engines allocate).
    """

    spec: KVCacheSpec
    layout: str
    num_blocks: int
    device: torch.device
    regions: list[Region]
    keep: list[torch.Tensor]

    @staticmethod
    def check(spec: KVCacheSpec, layout: str, num_blocks: int, device: torch.device,
              cpu_layout: str | None = None) -> int:
        """The bytes of one tier, once the layouts pair and both tiers fit; allocates nothing.

        Raises:
            ConfigError: the layouts do not pair.
            InsufficientMemoryError: a tier does not fit.
        """
        check_layouts(spec, layout, cpu_layout)
        nbytes = kv_nbytes(spec, layout, num_blocks)
        if device.type == "cuda":
            check_fits(device, {"GPU tier": nbytes})
            check_fits("cpu", {"CPU tier": nbytes})
        else:
            check_fits(device, {"GPU tier (host memory here)": nbytes, "CPU tier": nbytes})
        return nbytes

    @classmethod
    def allocate(cls, spec: KVCacheSpec, layout: str, num_blocks: int, device: torch.device,
                 alloc: str = "buffer", seed: int = 0, cpu_layout: str | None = None) -> Rig:
        """Allocate and fill both tiers: the GPU one on ``device``, the CPU one in ``cpu_layout`` or ``layout``.

        Raises:
            ConfigError / InsufficientMemoryError: as :meth:`check`, before anything is allocated.
        """
        nbytes = cls.check(spec, layout, num_blocks, device, cpu_layout)
        gen = torch.Generator(device=device).manual_seed(seed)
        if alloc == "buffer":
            gpu_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            gpu = kv_views(spec, layout, num_blocks, gpu_buf)
            keep = [gpu_buf]
        else:
            gpu = allocate_kv(spec, layout, num_blocks, device)
            keep = list(gpu)
        for t in gpu:
            t.view(torch.uint8).random_(0, 256, generator=gen)
        cpu_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        step = 1 << 28
        for start in range(0, nbytes, step):  # random bytes made on the device, independent of the GPU tier's
            part = cpu_buf[start:start + step]
            part.copy_(torch.empty(len(part), dtype=torch.uint8, device=device).random_(0, 256, generator=gen))
        cpu = kv_views(spec, cpu_layout or layout, num_blocks, cpu_buf)
        regions = regions_for(spec, layout, gpu, cpu, cpu_layout=cpu_layout)
        return cls(spec, layout, num_blocks, device, regions, [*keep, cpu_buf])

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across every region."""
        return sum(r.piece_bytes for r in self.regions)

    def poison(self, plan: TransferPlan) -> None:
        """Overwrite every destination piece of ``plan`` with a fixed byte."""
        for r in self.regions:
            dst = r.cpu if plan.direction is Direction.STORE else r.gpu
            _rows(dst).index_fill_(0, torch.tensor(plan.dst, device=dst.device), _POISON)

    def verify(self, plan: TransferPlan) -> bool:
        """Whether every destination piece of ``plan`` equals its source piece, byte for byte."""
        for r in self.regions:
            src, dst = (r.gpu, r.cpu) if plan.direction is Direction.STORE else (r.cpu, r.gpu)
            a = _rows(src).index_select(0, torch.tensor(plan.src, device=src.device))
            b = _rows(dst).index_select(0, torch.tensor(plan.dst, device=dst.device))
            if not torch.equal(a.to(self.device), b.to(self.device)):
                return False
        return True


def _check_pool(blocks: int, directions: int, pool: int) -> int:
    """Blocks the plans need of a pool of ``pool`` blocks; ``ConfigError`` if it is smaller."""
    need = blocks * directions
    if need > pool:
        raise ConfigError(f"--blocks {blocks} x {plural(directions, 'direction')} needs a pool of at least "
                          f"{plural(need, 'block')}, got --pool-blocks {pool}")
    return need


def make_plans(rig: Rig, blocks: int, ids: str, direction: str, seed: int = 0) -> list[TransferPlan]:
    """One plan per direction of ``direction``; a store and a load never touch the same blocks.

    Raises:
        ConfigError: the pool is too small for the plans.
    """
    dirs = DIRECTIONS[_direction(direction)]
    need = _check_pool(blocks, len(dirs), rig.num_blocks)
    rng = np.random.default_rng(seed)
    if ids == "random":
        gpu_ids = rng.choice(rig.num_blocks, need, replace=False)
        cpu_ids = rng.choice(rig.num_blocks, need, replace=False)
    else:
        gpu_ids = rng.integers(0, rig.num_blocks - need + 1) + np.arange(need)
        cpu_ids = rng.integers(0, rig.num_blocks - need + 1) + np.arange(need)
    plans = []
    for i, d in enumerate(dirs):
        g, c = gpu_ids[i * blocks:(i + 1) * blocks], cpu_ids[i * blocks:(i + 1) * blocks]
        plans.append(TransferPlan(g, c, d) if d is Direction.STORE else TransferPlan(c, g, d))
    return plans


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_ceiling(rig: Rig, nbytes: int = 1 << 30, trials: int = 5) -> dict[str, float]:
    """GB/s of one large copy between the rig's page-locked CPU buffer and its GPU buffer.

    Keyed like :data:`DIRECTIONS`: ``store`` (device to host) and ``load``
    alone, and ``both`` at once (sum of the two directions).
    """
    cpu_buf = rig.keep[-1]
    nbytes = min(nbytes, cpu_buf.numel() // 2)
    host = cpu_buf[:nbytes]
    host2 = cpu_buf[nbytes:2 * nbytes]
    dev = torch.empty(nbytes, dtype=torch.uint8, device=rig.device)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=rig.device)
    out: dict[str, float] = {}
    if rig.device.type != "cuda":
        times = []
        for _ in range(trials + 1):
            t0 = time.perf_counter()
            dev.copy_(host)
            times.append(time.perf_counter() - t0)
        out["store"] = out["load"] = out["both"] = _gbps(nbytes, statistics.median(times[1:]))
        return out
    streams = [torch.cuda.Stream(rig.device), torch.cuda.Stream(rig.device)]
    jobs = {"store": [(host, dev)], "load": [(dev, host)], "both": [(host, dev), (dev2, host2)]}  # (dst, src)
    for name, pairs in jobs.items():
        times = []
        for _ in range(trials + 1):
            _sync(rig.device)
            t0 = time.perf_counter()
            for (dst, src), s in zip(pairs, streams):
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)
            _sync(rig.device)
            times.append(time.perf_counter() - t0)
        out[name] = _gbps(nbytes * len(pairs), statistics.median(times[1:]))
    return out


@attrs.define(eq=False)
class GemmLoad:
    """bf16 matrix products on their own stream."""

    a: torch.Tensor
    b: torch.Tensor
    stream: torch.cuda.Stream

    @classmethod
    def make(cls, device: torch.device) -> GemmLoad:
        """Seeded bf16 operands on the CUDA ``device`` and a stream of their own."""
        gen = torch.Generator(device=device).manual_seed(1)
        a = torch.randn(_GEMM_N, _GEMM_N, device=device, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(_GEMM_N, _GEMM_N, device=device, dtype=torch.bfloat16, generator=gen)
        return cls(a, b, torch.cuda.Stream(device))

    def run(self, count: int) -> tuple[float, float, float]:
        """``(ms per product, host start, host end)`` of ``count`` back-to-back products."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            start.record()
            for _ in range(count):
                torch.mm(self.a, self.b)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / count, t0, time.perf_counter()


def gemm_alone(gemm: GemmLoad, count: int, trials: int = 3) -> float:
    """Median ms per product of ``count`` products with nothing else running."""
    gemm.run(5)
    return statistics.median(gemm.run(count)[0] for _ in range(trials))


def _copy_during_gemm(backend: CopyBackend, plans: Sequence[TransferPlan], nbytes: Sequence[int],
                      gemm: GemmLoad, count: int) -> dict[str, Any]:
    """GEMM ms per product while a thread keeps ``plans`` copying, and the copy rate meanwhile."""
    stop, first = threading.Event(), threading.Event()
    done: list[tuple[float, int]] = []  # (host time completion was seen, bytes)
    errors: list[BaseException] = []
    last = [-1]  # the worker's latest handle

    def worker() -> None:
        try:
            sizes: collections.deque[int] = collections.deque()
            while not stop.is_set():
                for plan, size in zip(plans, nbytes):
                    last[0] = backend.submit(plan)
                    sizes.append(size)
                while len(sizes) > 2 * len(plans) and not stop.is_set():
                    finished = backend.poll()
                    now = time.perf_counter()
                    for _ in finished:
                        done.append((now, sizes.popleft()))
                        first.set()
                    if not finished:
                        time.sleep(1e-4)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
            first.set()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    first.wait(timeout=60)
    ms, t0, t1 = gemm.run(count)
    stop.set()
    thread.join()
    if last[0] >= 0:
        backend.wait(last[0])
    backend.poll()
    if errors:
        raise errors[0]
    inside = [(t, b) for t, b in done if t0 <= t <= t1]
    rate = (_gbps(sum(b for _, b in inside[1:]), inside[-1][0] - inside[0][0])
            if len(inside) >= 3 else float("nan"))
    return {"gemm_ms": ms, "copy_gbps_during_gemm": rate, "copies_during_gemm": len(inside)}


def bench_backend(rig: Rig, label: str, backend: CopyBackend, plans: Sequence[TransferPlan], *,
                  repeat: int = 10, trials: int = 3, gemm: GemmLoad | None = None, gemm_count: int = 0,
                  gemm_alone_ms: float | None = None) -> dict[str, Any]:
    """Time ``plans`` on ``backend`` (already registered with ``rig.regions``) and check every copy."""
    nbytes = [len(p) * rig.block_bytes for p in plans]
    for p in plans:  # warm up (compilation, allocator, first touches)
        backend.wait(backend.submit(p))
    backend.poll()
    submit_s = []
    for _ in range(5):
        _sync(rig.device)
        t0 = time.perf_counter()
        h = backend.submit(plans[0])
        submit_s.append(time.perf_counter() - t0)
        backend.wait(h)
    times, ok = [], True
    for _ in range(trials):
        for p in plans:
            rig.poison(p)
        _sync(rig.device)
        t0 = time.perf_counter()
        h = -1
        for _ in range(repeat):
            for p in plans:
                h = backend.submit(p)
        backend.wait(h)
        _sync(rig.device)
        times.append(time.perf_counter() - t0)
        ok = ok and all(rig.verify(p) for p in plans)
    backend.poll()
    seconds = statistics.median(times) / repeat
    result: dict[str, Any] = {
        "backend": label,
        "directions": [p.direction.value for p in plans],
        "blocks": len(plans[0]),
        "bytes_per_round": sum(nbytes),
        "gbps": _gbps(sum(nbytes), seconds),
        "ms_per_round": seconds * 1e3,
        "submit_ms": statistics.median(submit_s) * 1e3,
        "verified": ok,
    }
    if isinstance(backend, LayeredCopy):
        result.update(_layered(rig, backend, plans[0], repeat, trials))
    planner = getattr(backend, "planner", None)
    if planner is not None:
        result["descriptors"] = planner.count(plans[0])[0]
        result["descriptors_plain"] = planner.count(plans[0], coalesce=False)[0]
        result["submit_us_per_descriptor"] = result["submit_ms"] * 1e3 / max(1, result["descriptors"])
    if gemm is not None:
        for p in plans:
            rig.poison(p)
        during = _copy_during_gemm(backend, plans, nbytes, gemm, gemm_count)
        during["verified"] = all(rig.verify(p) for p in plans)
        result["verified"] = ok and during["verified"]
        result["gemm_ms_alone"] = gemm_alone_ms
        result["gemm_slowdown"] = during["gemm_ms"] / gemm_alone_ms if gemm_alone_ms else float("nan")
        result.update({k: v for k, v in during.items() if k != "verified"})
    return result


def _layered(rig: Rig, backend: CopyBackend, plan: TransferPlan, repeat: int, trials: int) -> dict[str, Any]:
    """The cost of per-layer stages: ``plan`` in one stage a layer against ``plan`` whole, timed alternately.

    ``backend`` is a :class:`~kvkit.interfaces.capabilities.LayeredCopy`.
    """
    stages = [regions for regions, _ in layer_stages(rig.spec, rig.regions, 1)[plan.group]]
    staged = cast(LayeredCopy, backend)
    runs = {"whole": lambda: backend.submit(plan), "layered": lambda: staged.submit_stages(plan, stages)[0]}
    submit_s: list[float] = []
    times: dict[str, list[float]] = {"whole": [], "layered": []}
    backend.wait(runs["layered"]())  # warm-up
    for _ in range(5):
        _sync(rig.device)
        t0 = time.perf_counter()
        handle = runs["layered"]()
        submit_s.append(time.perf_counter() - t0)
        backend.wait(handle)
    ok = True
    for _ in range(trials):
        for mode, run in runs.items():
            rig.poison(plan)
            _sync(rig.device)
            t0 = time.perf_counter()
            for _ in range(repeat):
                handle = run()
            backend.wait(handle)
            _sync(rig.device)
            times[mode].append(time.perf_counter() - t0)
            ok = ok and rig.verify(plan)
    backend.poll()
    whole, layered = (statistics.median(times[m]) for m in ("whole", "layered"))
    return {"layered_stages": len(stages), "layered_submit_ms": statistics.median(submit_s) * 1e3,
            "layered_gbps": _gbps(len(plan) * rig.block_bytes, layered / repeat),
            "layered_vs_whole": whole / layered, "layered_verified": ok}


def _backends(name: str, device: torch.device, options: dict[str, Any]) -> list[tuple[str, Callable[[], CopyBackend]]]:
    """The backends ``name`` selects on ``device``, each as (label, factory); builds nothing.

    Raises:
        ConfigError: ``name`` is neither ``"all"`` nor a registered copy backend
            (the valid names and the closest one are listed), nothing selected
            runs on ``device``, or ``options`` do not fit a named backend.
    """
    valid = ["all", *COPY.names()]
    if name not in valid:
        raise ConfigError(f"--backend {name!r}: unknown copy backend; valid: {', '.join(valid)}"
                          f"{did_you_mean(str(name), valid)}")
    if name != "all" and (problem := COPY.check(name, slot="--backend")) is not None:
        raise ConfigError(problem)  # registered but not available here: the reason, and what is
    names = [n for n in COPY.names() if COPY.available(n)] if name == "all" else [name]
    names = [n for n in names if device.type == "cuda" or n == "torch"]  # only torch runs on host memory alone
    if not names:
        raise ConfigError(f"--backend {name!r}: nothing to run on {device.type}; hint: on a CPU-only machine "
                          f"use --backend torch")
    out: list[tuple[str, Callable[[], CopyBackend]]] = []
    used: set[str] = set()
    for n in names:
        accepted = {k: v for k, v in options.items() if COPY.check_options(n, {k: v}, partial=True) is None}
        used |= set(accepted)
        label = n + "".join(f" {k}={v}" for k, v in accepted.items())
        out.append((label, functools.partial(COPY.create, n, **accepted)))
    unused = sorted(set(options) - used)
    if unused:
        raise ConfigError(f"--set {', '.join(map(repr, unused))}: no option of "
                          f"{' or '.join(repr(n) for n in names)}; see each backend's constructor "
                          f"(kvkit list shows where it lives)")
    return out


def run_transfer(spec: KVCacheSpec, *, backend: str = "all", layout: str = "per-layer", blocks: int = 256,
                 ids: str = "random", direction: str = "store", with_gemm: bool = False,
                 pool_blocks: int | None = None, repeat: int = 10, alloc: str = "buffer",
                 options: dict[str, Any] | None = None, seed: int = 0,
                 cpu_layout: str | None = None, on_step: Callable[[str, int, int], None] | None = None,
                 on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Everything ``kvkit bench transfer`` measures, as a JSON-able report.

    With ``backend="all"``, a backend that refuses the rig's regions (``staged``
    without a cross-layer CPU tier) is listed under ``"skipped"`` with its reason.
    ``direction`` is a name in :data:`DIRECTIONS` (``d2h``/``h2d`` still work
    for one release and warn).

    ``on_step(what, done, total)`` is called, once every option passed its checks, as each step starts (allocating,
    the ceiling, the GEMM baseline, each backend) and once at the end
    (``done == total``); ``on_result`` with each backend's result as it finishes.

    Raises:
        ConfigError: a bad backend name, direction or option, checked before
            anything is allocated or measured.
    """
    direction = _direction(direction)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = _backends(backend, device, options or {})  # a typo fails here, before any work
    if with_gemm and device.type != "cuda":
        raise ConfigError("--with-gemm needs a CUDA GPU")
    n_dirs = len(DIRECTIONS[direction])
    pool = pool_blocks or max(2048 if device.type == "cuda" else 64, 2 * blocks * n_dirs)
    _check_pool(blocks, n_dirs, pool)  # before the (slow) allocation
    Rig.check(spec, layout, pool, device, cpu_layout)  # so the first step starts a run that will happen
    total = 2 + with_gemm + len(backends)
    step = on_step or (lambda what, done, total: None)
    step(f"allocating {plural(pool, 'block', grouped=True)} per tier", 0, total)
    rig = Rig.allocate(spec, layout, pool, device, alloc=alloc, seed=seed, cpu_layout=cpu_layout)
    plans = make_plans(rig, blocks, ids, direction, seed=seed)
    step("measuring the ceiling (one large pinned copy)", 1, total)
    ceiling = measure_ceiling(rig)
    gemm = GemmLoad.make(device) if with_gemm else None
    gemm_count, alone = 0, None
    if gemm is not None:
        step("timing GEMMs alone", 2, total)
        probe = gemm_alone(gemm, 10)
        gemm_count = max(20, int(0.3e3 / probe))  # a ~0.3 s window
        alone = gemm_alone(gemm, gemm_count)
    results, skipped = [], {}
    for i, (label, factory) in enumerate(backends):
        step(label, total - len(backends) + i, total)
        instance = factory()
        try:
            instance.register(rig.regions)
        except SpecMismatchError as exc:
            if backend != "all":
                raise
            skipped[label] = str(exc)
            continue
        results.append(bench_backend(rig, label, instance, plans, repeat=repeat, gemm=gemm,
                                     gemm_count=gemm_count, gemm_alone_ms=alone))
        if on_result is not None:
            on_result(results[-1])
    step("done", total, total)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "layout": layout, "cpu_layout": cpu_layout or layout, "alloc": alloc, "blocks": blocks, "ids": ids,
        "direction": direction,
        "pool_blocks": pool, "block_bytes": rig.block_bytes,
        "piece_bytes": rig.regions[0].piece_bytes, "regions": len(rig.regions),
        "ceiling_gbps": ceiling[direction],
        "ceilings_gbps": ceiling, "gemm_ms_alone": alone, "results": results, "skipped": skipped,
    }
