"""The compiled part of kvkit: optional, every module has a pure-Python reference that runs without it."""

from setuptools import Extension, setup

setup(ext_modules=[
    # hit density's per-block bookkeeping loops (backends/eviction/hit_density/booking.py holds the reference)
    Extension("kvkit.backends.eviction.hit_density._booking", ["backends/eviction/hit_density/_booking.c"],
              include_dirs=["backends"], depends=["backends/_twin.h", "backends/_views.h"],
              optional=True, extra_compile_args=["-ffp-contract=off"]),  # its float steps as the Python's
    # the density model's numeric kernels (backends/eviction/hit_density/kernels.py holds the references)
    Extension("kvkit.backends.eviction.hit_density._kernels", ["backends/eviction/hit_density/_kernels.c"],
              include_dirs=["backends"], depends=["backends/_twin.h", "backends/_views.h"],
              optional=True, extra_compile_args=["-ffp-contract=off"]),  # its float steps as the Python's
    # hit density's census (backends/eviction/hit_density/census.py holds the reference)
    Extension("kvkit.backends.eviction.hit_density._census", ["backends/eviction/hit_density/_census.c"],
              include_dirs=["backends"], depends=["backends/_twin.h", "backends/_views.h"],
              optional=True, extra_compile_args=["-ffp-contract=off"]),  # its float steps as the Python's
    # hit density's selection rounds (backends/eviction/hit_density/selection.py holds the reference)
    Extension("kvkit.backends.eviction.hit_density._selection", ["backends/eviction/hit_density/_selection.c"],
              include_dirs=["backends"], depends=["backends/_twin.h", "backends/_views.h"],
              optional=True, extra_compile_args=["-ffp-contract=off"]),  # its densities compared as the Python's
    # the chain index's batch loops (backends/eviction/_chains.py holds the references)
    Extension("kvkit.backends.eviction._chains_loops", ["backends/eviction/_chains_loops.c"],
              include_dirs=["backends"], depends=["backends/_views.h"], optional=True),
    # the block pool's per-block loops (backends/allocator/pool.py holds the reference, loops.py the contracts)
    Extension("kvkit.backends.allocator._pool_loops", ["backends/allocator/_pool_loops.c"], optional=True),
    # the parking queue's batch loops (backends/eviction/_queue.py holds the references)
    Extension("kvkit.backends.eviction._queue_loops", ["backends/eviction/_queue_loops.c"], optional=True),
])
