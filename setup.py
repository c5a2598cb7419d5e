"""The compiled part of kvkit: optional, every module has a pure-Python reference that runs without it."""

from setuptools import Extension, setup

_SHARED_HEADERS = ["backends/_objects.h", "backends/_twin.h", "backends/_views.h"]


def _twin(module: str, *, exact_floats: bool = False, own_header: str | None = None) -> Extension:
    """The optional extension ``kvkit.backends.<module>`` from ``backends/<module path>.c``: with the shared
    headers, and its ``own_header`` beside it, and with ``exact_floats`` built without fused multiply-adds (its
    float steps as the Python's)."""
    path = f"backends/{module.replace('.', '/')}"
    depends = _SHARED_HEADERS + ([f"{path.rsplit('/', 1)[0]}/{own_header}"] if own_header else [])
    return Extension(f"kvkit.backends.{module}", [f"{path}.c"], optional=True,
                     include_dirs=["backends"], depends=depends,
                     extra_compile_args=["-ffp-contract=off"] if exact_floats else [])


setup(ext_modules=[
    # hit density: its per-block bookkeeping loops, the density model's numeric kernels, its census and its
    # selection rounds (booking.py, kernels.py, census.py and selection.py hold the references)
    _twin("eviction.hit_density._booking", exact_floats=True, own_header="_ghost_map.h"),
    _twin("eviction.hit_density._kernels", exact_floats=True),
    _twin("eviction.hit_density._census", exact_floats=True),
    _twin("eviction.hit_density._selection", exact_floats=True),  # its densities compared as the Python's
    # the chain index's loops (backends/eviction/_chains.py holds the references)
    _twin("eviction._chains_loops"),
    # the block pool's per-block loops (backends/allocator/pool.py holds the reference, loops.py the contracts)
    _twin("allocator._pool_loops"),
    # the parking queue's batch loops (backends/eviction/_queue.py holds the references)
    _twin("eviction._queue_loops"),
    # the manager's per-step progress of its running requests (kvkit/manager/manager.py holds the reference)
    Extension("kvkit.manager._progress", ["kvkit/manager/_progress.c"], optional=True, include_dirs=["backends"],
              depends=_SHARED_HEADERS),
])
